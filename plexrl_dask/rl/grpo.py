"""GRPO over the public API: a whole RLVR loop on futures, in a few hundred lines.

One step of :class:`GRPOJob`:

1. ``rollout.sample`` ``prompts_per_step`` problems, ``group_size`` completions each, with a
   seed that is a pure function of ``(job seed, step)`` (and, inside the sampler, of prompt
   index and sample index): the same job samples the same tokens wherever it runs;
2. each completion is scored by the task's exact verifier;
3. **group-normalised advantages**: ``A = (r - mean(group)) / (std(group) + eps)``, so a group
   whose samples all score alike teaches nothing (and is dropped from the batch); the options
   (normalisation, loss aggregation, clip-higher, KL estimator, AdamW and its learning-rate
   schedule, EOS-only stopping) are :class:`~plexrl_dask.rl.objective.GRPOConfig`'s;
4. ``policy.train_step`` per epoch (``forward_backward`` and ``optim_step`` in one request)
   with :class:`~plexrl_dask.PolicyGradient` (clipped importance ratio; the old
   log-probabilities are the policy's own, from a ``forward`` before the first epoch, when
   there is more than one; with one epoch the ratio is exactly 1) and, when ``kl_coef > 0``,
   the reference model's log-probabilities from ``reference.forward``;
5. ``runtime.sync_weights(policy, rollout)``.

Requests per step: one ``sample``, one ``train_step`` per epoch (plus one ``forward`` with
several epochs, one ``reference.forward`` with a KL term, both in flight at once), and
without colocation the sync's ``publish_weights`` and ``load_weights``.

**Where the samples are scored.** A synchronous step without a KL term or further epochs, on
samples (not agentic episodes), is *scored training* by default (``score_on_worker``,
:mod:`plexrl_dask.rl.scoring`): its ``train_step`` takes the sample request's future and
scores, batches and trains on the worker, so the driver never reads the samples and nothing
of the driver lies between a step's sample and its training. Otherwise the driver fetches the
samples, scores them and submits the training. The records are the same either way. A
colocated job whose policy is one worker makes each such step one ``sample_train`` request
(``fuse_steps``), the next step's queued behind it: no hand-off through the scheduler within
a step or between steps.

Round trips to the scheduler per step (counted by ``bench.grpo``), scored training: the
training request's result (scores and metrics, while the next step samples), the dashboard
report and the placement question (:class:`PlacementFollower`, asked while the step trains),
none of them between a sample's end and its training. Scored on the driver: the samples'
fetch (with a split job's sync version in the same wait) lies there, and the metrics' fetch
is one more.

After each step the driver reports it to the scheduler (``plexrl-job`` event,
:mod:`plexrl_dask.dashboard.jobs`) under its runtime's job name, for the dashboard's Jobs page.

Pipelining: everything a step submits goes out at once as futures; the PlexRL scheduler keeps
each deployment's requests in submission order, so the next step's ``sample`` may be submitted
as soon as this step's weight sync is (it runs after the sync). The driver only waits for what
it must read: samples (to score them, unless the worker does) and the step's metrics. Once
per step, when nothing of the job is in flight, it follows the job's placement (with scored
training the next sample is in flight then: it waits for it only when something moves);
between steps it checkpoints, and after
a lost deployment it goes back to its last checkpoint (:mod:`plexrl_dask.rl.recovery`).

Modes, same job code: **colocated** samples from the policy itself (``rollout=None``, no weight
sync); **split** samples from a rollout deployment synced every step; **split-async**
(``staleness=1``) lets the rollout run one step ahead (see :meth:`GRPOJob.run`). Several jobs
run together on one pool with :func:`run_jobs` (multiplexed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distributed.client import FutureCancelledError

from plexrl_dask import config as plexrl_config
from plexrl_dask.config import request_timeout
from plexrl_dask.dashboard.jobs import JobStepReport, report_step
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.runtime import Runtime
from plexrl_dask.driver.waits import result
from plexrl_dask.errors import (
    ConfigError,
    DeploymentLost,
    JobStopped,
    RankLost,
    RequestTimeout,
    SchedulerLost,
)
from plexrl_dask.rl.episodes import EpisodeBatch, episodes_timeout, run_episodes
from plexrl_dask.rl.job_checkpoint import JobCheckpoints
from plexrl_dask.rl.objective import GRPOConfig
from plexrl_dask.rl.recovery import JobSaver, PlacementFollower
from plexrl_dask.rl.scoring import (
    MAX_SEALED_TASK_BYTES,
    ScoredSummary,
    ScoringRecipe,
    score_samples,
    seal_recipe,
    seal_task,
)
from plexrl_dask.shared.types import Datum, SamplingParams
from plexrl_dask.tasks.agentic import is_agentic
from plexrl_dask.tasks.base import Problem, Task, check_task, describe_task
from plexrl_dask.tools.pool import ToolPool

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What one step measured (one JSON line of the job's metrics)."""

    job: str
    step: int
    reward_mean: float
    reward_max: float
    groups_used: int
    sampled_tokens: int
    completion_lengths: list[int]
    loss: float | None
    grad_norm: float | None
    version: int  # the policy's version after this step
    sampled_with: int  # the version of the weights that drew this step's samples
    wall_s: float
    extra: dict[str, float] = field(default_factory=dict)


class GRPOJob:
    """A GRPO job on deployments of a :class:`Runtime` (see the module docstring).

    ``policy`` trains; ``rollout`` samples (``None``: the policy samples, colocated);
    ``reference`` scores for the KL term (needed when ``config.kl_coef > 0``).
    ``metrics_path``: a JSONL file getting one line per step, after a first line with the
    job's config (everything needed to reproduce the run). ``start_version``: the weights'
    version when the job starts (a restored checkpoint's; what the first samples are drawn
    with). ``checkpoints``: where the job saves itself every few steps and, when that
    directory already holds its checkpoint, resumes from it (:mod:`plexrl_dask.rl.job_checkpoint`;
    the resumed run's records equal an uninterrupted run's). ``score_on_worker`` (default
    ``plexrl.grpo.score-on-worker``): a synchronous step's samples are scored in its training
    request, where they are (:mod:`plexrl_dask.rl.scoring`), not fetched by the driver; the
    records are the same either way. ``fuse_steps`` (default ``plexrl.grpo.fuse-steps``):
    such a step of a colocated job whose policy is one worker is one request
    (:meth:`Deployment.sample_train <plexrl_dask.driver.deployment.Deployment.sample_train>`),
    and the next step's is queued behind it; the records are the same either way.
    """

    def __init__(
        self,
        name: str,
        runtime: Runtime,
        task: Task,
        policy: Deployment,
        config: GRPOConfig,
        rollout: Deployment | None = None,
        reference: Deployment | None = None,
        metrics_path: str | Path | None = None,
        start_version: int = 0,
        checkpoints: JobCheckpoints | None = None,
        score_on_worker: bool | None = None,
        fuse_steps: bool | None = None,
    ) -> None:
        check_task(task)
        if config.kl_coef > 0 and reference is None:
            raise ConfigError("kl_coef > 0 needs a reference deployment")
        if config.staleness and rollout is None:
            raise ConfigError("a split-async job (staleness 1) needs a rollout deployment")
        if config.staleness and rollout.info.weights_only:
            raise ConfigError(
                f"a split-async job (staleness 1) scores its samples' old log-probabilities "
                f"on its rollout, which a {rollout.info.backend} rollout does not do: run it "
                "with staleness 0, or a torch rollout"
            )
        self.name = name
        self.runtime = runtime
        self.task = task
        self.policy = policy
        self.rollout = rollout
        self.reference = reference
        self.config = config
        if score_on_worker is None:
            score_on_worker = plexrl_config.get("grpo.score-on-worker")
        if not isinstance(score_on_worker, bool):
            raise ConfigError(f"score_on_worker is true or false, got {score_on_worker!r}")
        self.score_on_worker = score_on_worker
        if fuse_steps is None:
            fuse_steps = plexrl_config.get("grpo.fuse-steps")
        if not isinstance(fuse_steps, bool):
            raise ConfigError(f"fuse_steps is true or false, got {fuse_steps!r}")
        self.fuse_steps = fuse_steps
        limit = plexrl_config.get("grpo.worker-reward-limit")
        self._reward_limit_s = (
            None if limit is None else plexrl_config.get_seconds("grpo.worker-reward-limit")
        )
        #: The step whose reward, scored on the worker, took longer than
        #: ``plexrl.grpo.worker-reward-limit``: the steps after it score on the driver.
        self.reward_moved_at: int | None = None
        self._sealed_task: bytes | None = None  # (sealed once: every step's recipe carries it)
        if self._scores_on_worker:
            self._sealed_task = self._seal_task()
        self.start_version = int(start_version)
        self.records: list[StepRecord] = []
        self.checkpoints = checkpoints
        self.first_step = 0  # the first step run() ran (after a resumed checkpoint's)
        self.recoveries: list[str] = []  # why the job went back to its checkpoint, each time
        # (agentic tasks) per step run: every episode's model turns, its tool calls, and the
        # seconds on its worker of every call that ran (identical calls of a turn run once)
        self._episode_stats: dict[int, tuple[list[int], int, list[float]]] = {}
        self._stop = threading.Event()
        self._episodes_stop = threading.Event()  # (set: an agentic rollout starts no turn)
        self._header = {
            "job": name, "config": asdict(config), "task": describe_task(task), "policy": policy.name
        }  # fmt: skip
        # Between steps (plexrl_dask.rl.recovery): checkpoints, and following the placement.
        self.saver = None
        if checkpoints is not None:
            identity = {"config": asdict(config), "task": describe_task(task)}
            self.saver = JobSaver(
                name, checkpoints, identity, policy, rollout, config.staleness, self._problems
            )
        self.follow_placement = PlacementFollower(runtime, name)
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        if self.metrics_path is not None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._write_metrics([])

    # --- one step --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _agentic(self) -> Iterator[None]:
        """For an agentic task, the tool pool and the thread a step's episodes run on (the
        next step's rollout may start while this step trains, as a sample request would)."""
        if not is_agentic(self.task):
            yield
            return
        self._tools = ToolPool(self.runtime.client, self.task.tools, job=self.runtime.job)
        self._episodes = ThreadPoolExecutor(1, thread_name_prefix=f"plexrl-episodes-{self.name}")
        self._episodes_stop.clear()
        try:
            yield
        finally:
            self._episodes_stop.set()  # (a rollout still running ends after its turn)
            self._episodes.shutdown(wait=True, cancel_futures=True)
            self._tools.close()

    def _sampler(self) -> Deployment:
        return self.rollout if self.rollout is not None else self.policy

    def _problems(self, step: int) -> list[Problem]:
        """Step ``step``'s problems. A task that cannot give them (an index past a finite
        dataset's end, say) or gives anything but ``prompts_per_step`` problems stops the
        job with a :class:`ConfigError` that names the indices asked for."""
        n = self.config.prompts_per_step
        start = self.config.problem_offset + step * n
        what = f"{type(self.task).__name__}.problems({start}, {n}) (step {step})"
        try:
            problems = list(self.task.problems(start, n))
        except Exception as e:  # noqa: BLE001 (the user's task: any failure, typed here)
            raise ConfigError(
                f"{what} failed: {type(e).__name__}: {e}; a finite dataset maps every index "
                "onto its rows (epochs: docs/tasks.md), or problem_offset and steps keep to them"
            ) from e
        if len(problems) != n or not all(isinstance(p, Problem) for p in problems):
            raise ConfigError(f"{what} gave {len(problems)} items, not {n} Problems")
        return problems

    def _sampling(self, step: int) -> SamplingParams:
        """Step ``step``'s sampling: its seed a pure function of (job seed, step)."""
        c = self.config
        return SamplingParams(
            n=c.group_size,
            temperature=c.temperature,
            max_tokens=c.max_tokens,
            stop=c.stops(self.task.stop),
            seed=(c.seed * 1_000_003 + step) % 2**31,
        )

    def _recipe(self, step: int, problems: list[Problem]) -> bytes:
        """Step ``step``'s sealed scoring recipe (:mod:`plexrl_dask.rl.scoring`)."""
        recipe = ScoringRecipe(self.task, self.config, tuple(problems), step)
        return seal_recipe(recipe, self._sealed_task)

    def _submit_fused(self, step: int) -> Any:
        """Submit step ``step`` whole: its sampling and scored training as one request."""
        problems = self._problems(step)
        return self.policy.sample_train(
            [p.prompt for p in problems], self._sampling(step), self._recipe(step, problems)
        )

    def _submit_sample(self, step: int) -> Any:
        c = self.config
        params = self._sampling(step)
        if is_agentic(self.task):
            task = self.task
            return self._episodes.submit(
                run_episodes,
                self._sampler(),
                self._tools,
                self._problems(step),
                params,
                c.group_size,
                task.max_turns,
                task.observation_limit,
                stop=self._episodes_stop,
            )
        return self._sampler().sample([p.prompt for p in self._problems(step)], params)

    def _samples_timeout(self) -> float | None:
        """How long a step waits for its samples: a request timeout (None), or for an agentic
        step's episodes, whose turns each have one, :func:`episodes_timeout`."""
        return episodes_timeout(self.task.max_turns) if is_agentic(self.task) else None

    def _train(self, step: int, data: list[Datum], old: Any = None) -> list[Any]:
        """Submit step ``step``'s training; returns its futures. ``old``: a future of the
        behaviour policy's log-probabilities of ``data`` (split-async)."""
        c = self.config
        t = c.scoring_temperature  # (every side of the ratio and the KL at the sampling one)
        ref = None
        if c.kl_coef > 0:
            assert self.reference is not None
            ref = self.reference.forward(data, temperature=t)
        if old is None and c.epochs > 1:
            old = self.policy.forward(data, temperature=t)
        # Both scorings are in flight at once and waited for together: one wait, not two
        # (neither reads the other's field of the data).
        scored = result([f for f in (ref, old) if f is not None])
        ref_lp = scored.pop(0).logprobs if ref is not None else [None] * len(data)
        old_lp = scored.pop(0).logprobs if old is not None else [None] * len(data)
        if ref is not None or old is not None:
            data = [
                Datum(
                    d.tokens,
                    d.weights,
                    d.advantages,
                    None if o is None else tuple(o),
                    None if r is None else tuple(r),
                )
                for d, r, o in zip(data, ref_lp, old_lp, strict=True)
            ]
        loss, optimizer = c.loss(len(data)), c.optimizer(step)
        # (one request per epoch: forward_backward and optim_step fused, one round trip)
        return [self.policy.train_step(data, loss, optimizer) for _ in range(c.epochs)]

    def _sync(self) -> Any:
        """Submit a weight sync policy -> rollout (None when colocated); its result is the
        version the rollout then holds."""
        return (
            None if self.rollout is None else self.runtime.sync_weights(self.policy, self.rollout)
        )

    def _report(self, record: StepRecord) -> None:
        """Report the step to the scheduler for the dashboard's Jobs page (best effort: a
        report that cannot be delivered is logged, the job goes on)."""
        report_step(
            self.runtime.client,
            JobStepReport(
                job=self.runtime.job,
                name=self.name,
                step=record.step,
                steps=self.config.steps,
                reward_mean=record.reward_mean,
                reward_max=record.reward_max,
                sampled_tokens=record.sampled_tokens,
                loss=record.loss,
                version=record.version,
                wall_s=record.wall_s,
                time=time.time(),
            ),
            timeout=request_timeout(),
        )

    def _write_metrics(self, records: list[StepRecord]) -> None:
        """(Re)write the metrics file: its header and ``records`` (a resumed job's file reads
        as an uninterrupted run's)."""
        if self.metrics_path is not None:
            lines = [json.dumps(self._header), *(json.dumps(asdict(r)) for r in records)]
            self.metrics_path.write_text("".join(line + "\n" for line in lines))

    @property
    def episode_turns(self) -> list[int]:
        """Every episode's model turns, over the steps this job ran (a step redone after a
        recovery counted once)."""
        return [t for s in sorted(self._episode_stats) for t in self._episode_stats[s][0]]

    @property
    def tool_calls(self) -> int:
        return sum(calls for _, calls, _ in self._episode_stats.values())

    @property
    def tool_seconds(self) -> list[float]:
        return [x for s in sorted(self._episode_stats) for x in self._episode_stats[s][2]]

    @property
    def checkpoint_s(self) -> list[float]:
        """How long each checkpoint held up the driver."""
        return [] if self.saver is None else self.saver.seconds

    def _resume(self, recovering: bool = False) -> tuple[int, Any]:
        """Continue from the job's checkpoint, if it has one (:meth:`JobSaver.restore`): its
        records and metrics file become the steps done. Returns the first step to run and
        what its samples' version comes from (an int, or the future of a weight sync)."""
        restored = None if self.saver is None else self.saver.restore(recovering)
        if restored is None:
            return 0, self.start_version
        self.records = [StepRecord(**r) for r in restored.records]
        done = restored.steps_done  # (the steps after it are redone: their episodes again)
        self._episode_stats = {s: v for s, v in self._episode_stats.items() if s < done}
        self._write_metrics(self.records)
        first, versions = restored.steps_done, restored.versions
        if self.rollout is None:
            return first, None  # (colocated: the records say the version)
        # A split-async rollout is one version behind, as saved. A split job's rollout was
        # saved with the policy's weights, except after its last step (no sync follows it).
        if len(versions) > 1 and (self.config.staleness or versions[1] == versions[0]):
            return first, versions[1]
        return first, self._sync()

    def run(self, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        """Run ``config.steps`` steps; returns (and appends to ``records``) their records.

        ``staleness=0`` (synchronous): step ``k`` trains on samples of version ``k`` (the
        policy after ``k`` steps); the next sample is submitted behind the weight sync.
        ``staleness=1`` (split-async): the rollout runs ahead by exactly one step: once step
        ``k``'s samples (drawn with version ``k - 1``) are in, the policy's current weights
        (version ``k``) are synced and step ``k + 1`` samples while step ``k`` trains; the
        importance ratio uses the behaviour policy's log-probabilities, scored by the rollout
        before it takes the new weights.

        With ``checkpoints``, a job whose directory holds its checkpoint starts after the
        steps it records (the returned records include those), and a job that loses a
        deployment's state (:class:`DeploymentLost`, :class:`RankLost`: a worker died) or its
        scheduler (:class:`SchedulerLost`: it waits for the scheduler to be started again on
        its journal) goes back to its last checkpoint, restores its deployments on the
        workers there are, and goes on, at most ``checkpoints.max_recoveries`` times (``recoveries`` says why each
        time). The steps after that checkpoint are redone and compute what they computed
        before."""
        with (
            contextlib.nullcontext() if self.saver is None else self.saver.hold(),
            self._agentic(),
        ):
            while True:
                try:
                    return self._run(on_step, recovering=bool(self.recoveries))
                except (DeploymentLost, RankLost, SchedulerLost) as e:
                    saver = self.saver
                    if saver is None or not saver.can_recover(len(self.recoveries)):
                        raise
                    self.recoveries.append(f"{type(e).__name__}: {e}")
                    if isinstance(e, SchedulerLost):
                        # (restarted on its journal: the deployments it trained are lost there
                        # until restored, which going back to the checkpoint does)
                        self.runtime.wait_for_scheduler()
                    assert saver.saved is not None
                    logger.warning(
                        "%s: %s; back to its checkpoint after %d steps (recovery %d of %d)",
                        self.name, e, saver.saved.steps_done, len(self.recoveries),
                        saver.checkpoints.max_recoveries,
                    )  # fmt: skip

    def stop(self) -> None:
        """Ask the running job to stop before its next step (from any thread): ``run()``
        then raises :class:`JobStopped`. What it abandons (the next step's samples in
        flight) changes no state; its last checkpoint stands."""
        self._stop.set()

    def _seal_task(self) -> bytes | None:
        """The task sealed for the workers; None (and the job scores on the driver, saying
        why) for one that does not pickle or is too large to travel with every step."""
        try:
            sealed = seal_task(self.task)
        except Exception as e:  # (whatever pickling it raises: a lock, an open file)
            logger.warning("%s: its task does not pickle (%s); scoring on the driver", self.name, e)
            self.score_on_worker = False
            return None
        if len(sealed) > MAX_SEALED_TASK_BYTES:
            logger.info(
                "%s: its task pickles to %d bytes, more than a step's request should carry; "
                "scoring on the driver", self.name, len(sealed),
            )  # fmt: skip
            self.score_on_worker = False
            return None
        return sealed

    @property
    def _scores_on_worker(self) -> bool:
        """Whether steps score their samples in the training request (:mod:`~plexrl_dask.rl.scoring`):
        synchronous steps without a KL term or further epochs, on samples (not episodes),
        while the task's reward keeps within ``plexrl.grpo.worker-reward-limit``."""
        c = self.config
        return (
            self.score_on_worker
            and self.reward_moved_at is None
            and c.kl_coef == 0
            and c.epochs == 1
            and c.staleness == 0
            and not is_agentic(self.task)
        )

    @property
    def _fuses(self) -> bool:
        """Whether each step is one ``sample_train`` request (``fuse_steps``): scored
        training of a colocated job whose policy is one worker."""
        info = self.policy.info
        return (
            self.fuse_steps
            and self._scores_on_worker
            and self.rollout is None
            and info.world_size == 1
            and info.replicas == 1
        )

    def _fused_step(self, step: int, pending: Any) -> tuple[list[dict[str, Any]], Any, bool]:
        """Step ``step`` fused: submit the next step behind it (unless a checkpoint is due
        after this one, whose save must see this step's weights, or the job is stopping),
        then wait for this one. Returns its metrics, the next step's future (None when not
        submitted yet) and whether that is a whole step (else its sample: the reward has
        moved to the driver)."""
        c = self.config
        saving = self.saver is not None and self.checkpoints.due(step + 1, c.steps)
        ahead, whole = None, False
        if step + 1 < c.steps and not saving and not self._stop.is_set():
            # (queued behind this step on its worker)
            whole = self._fuses
            ahead = self._submit_fused(step + 1) if whole else self._submit_sample(step + 1)
            self.follow_placement.ask()  # (answered while this step runs)
        try:
            return result([pending]), ahead, whole
        except BaseException:
            if ahead is not None:  # (a step past a failed one must not train)
                ahead.cancel()
            raise

    def _watch_reward(self, step: int, summary: ScoredSummary) -> None:
        """After step ``step``, scored on the worker: a reward slower than
        ``plexrl.grpo.worker-reward-limit`` held the worker (and every request of other jobs
        queued there) for its seconds, so the steps not yet submitted score on the driver
        (the records are the same either way)."""
        limit = self._reward_limit_s
        if limit is None or self.reward_moved_at is not None or summary.reward_s <= limit:
            return
        self.reward_moved_at = step
        logger.warning(
            "%s: %s's reward took %.3f s of step %d's request on its worker, over "
            "plexrl.grpo.worker-reward-limit (%.3f s); the steps from here on score on the driver",
            self.name,
            type(self.task).__name__,
            summary.reward_s,
            step,
            limit,
        )

    def _scored_step(
        self, step: int, problems: list[Problem], pending: Any, pending_version: Any
    ) -> tuple[list[Any], Any, Any, Any]:
        """Submit step ``step``'s scored training on its samples' future (the driver never
        reads them) and the next step's sample; returns the training futures, the next
        samples' future and version, and the version these were drawn with (an int, or the
        future of the sync that preceded them). With nothing to learn the worker trains
        nothing and a split job's sync finds every tensor unchanged."""
        c = self.config
        futures = [self.policy.train_scored(pending, self._recipe(step, problems))]
        sampled_with = pending_version
        if self.rollout is None:
            sampled_with = self.records[-1].version if self.records else self.start_version
        if step + 1 < c.steps:
            sync = self._sync()
            pending = self._submit_sample(step + 1)  # runs after the sync
            pending_version = sync
            self.follow_placement.ask()  # (answered while this step trains)
        return futures, pending, pending_version, sampled_with

    def _driver_step(
        self, step: int, problems: list[Problem], pending: Any, pending_version: Any
    ) -> tuple[ScoredSummary, list[Any], Any, Any, int]:
        """Step ``step`` scored on the driver: wait for its samples, follow the placement (no
        request of the job in flight), build the batch, submit the training (and a
        split-async job's old log-probabilities and sync) and the next sample. Returns the
        scores, the training futures, the next samples' future and version, and the
        version these samples were drawn with."""
        c = self.config
        ahead = c.staleness == 1
        wait = self._samples_timeout()
        if self.rollout is None:  # colocated: the policy samples with its current weights
            out = result(pending, wait)
            sampled_with = self.records[-1].version if self.records else self.start_version
        elif isinstance(pending_version, int):
            out, sampled_with = result(pending, wait), pending_version
        else:  # (the samples and the sync that preceded them: one wait)
            out, synced = result([pending, pending_version], wait)
            sampled_with = int(synced)
        # (nothing of the job is in flight here; the question was asked ahead)
        self.follow_placement()
        scored = score_samples(self.task, c, problems, out)
        data = list(scored.data)
        if isinstance(out, EpisodeBatch):
            episodes = [e for g in out.groups for e in g]
            self._episode_stats[step] = (
                [len(e.turns) for e in episodes],
                sum(len(e.calls) for e in episodes),
                [r.seconds for e in episodes for r in e.calls if not r.shared],
            )
        old = None
        if ahead and data:
            assert self.rollout is not None
            # (queued before the sync below: old weights; at the sampling temperature)
            old = self.rollout.forward(data, temperature=c.scoring_temperature)
        # (ahead, the sync for the next step's samples is what a checkpoint saves of the
        # rollout: it is made after the last step too, so the job can be continued)
        if ahead and (step + 1 < c.steps or self.checkpoints is not None):
            sync = self._sync()
        if ahead and step + 1 < c.steps:
            pending, pending_version = self._submit_sample(step + 1), sync
        elif ahead and self.checkpoints is not None:
            # (held to the end: Dask cancels a request whose future is released before it
            # runs, and the checkpoint saved next must find this sync done)
            pending_version = sync
        futures = self._train(step, data, old) if data else []
        if not ahead and step + 1 < c.steps:
            sync = self._sync() if futures else None
            pending = self._submit_sample(step + 1)  # runs after the sync
            pending_version = sync if sync is not None else sampled_with
        if step + 1 < c.steps:  # (answered while this step trains)
            self.follow_placement.ask()
        return scored.summary, futures, pending, pending_version, sampled_with

    def _run(
        self, on_step: Callable[[StepRecord], None] | None, recovering: bool
    ) -> list[StepRecord]:
        c = self.config
        first, pending_version = self._resume(recovering)
        if not recovering:  # (the first step this run() ran, for its ledger)
            self.first_step = first
        if first >= c.steps:
            return self.records
        fused = self._fuses
        pending = self._submit_fused(first) if fused else self._submit_sample(first)
        self.follow_placement.ask()
        for step in range(first, c.steps):
            # (a fused step submitted ahead trains once it runs: it is finished and recorded)
            if self._stop.is_set() and not (fused and pending is not None):
                raise JobStopped(f"{self.name} stopped before step {step} of {c.steps}")
            t0 = time.perf_counter()
            problems = self._problems(step)
            was_fused, on_worker = fused, fused or self._scores_on_worker
            if fused:
                metrics, pending, fused = self._fused_step(step, pending)
                summary = metrics[-1]["scored"]
                sampled_with = self.records[-1].version if self.records else self.start_version
            elif on_worker:
                samples = pending
                futures, pending, pending_version, sampled_with = self._scored_step(
                    step, problems, pending, pending_version
                )
                try:
                    metrics = result(futures)
                except FutureCancelledError:
                    # (cancelled for a lost input: the samples' own error says why, typed:
                    # a scheduler gone, a worker lost)
                    result(samples)
                    raise
                summary = metrics[-1]["scored"]
                if not isinstance(sampled_with, int):  # (a split step's sync, long done)
                    sampled_with = int(result(sampled_with))
            else:
                summary, futures, pending, pending_version, sampled_with = self._driver_step(
                    step, problems, pending, pending_version
                )
                metrics = result(futures) if futures else []
            last = metrics[-1] if metrics else {}
            fb, opt = last.get("forward_backward"), last.get("optim_step")
            version = (
                int(opt["version"])
                if opt is not None
                else (self.records[-1].version if self.records else self.start_version)
            )
            rewards = summary.rewards
            record = StepRecord(
                job=self.name,
                step=step,
                reward_mean=sum(rewards) / len(rewards),
                reward_max=max(rewards),
                groups_used=summary.groups_used,
                sampled_tokens=summary.sampled_tokens,
                completion_lengths=list(summary.lengths),
                loss=None if fb is None else float(fb["loss"]),
                grad_norm=None if opt is None else float(opt.get("grad_norm", float("nan"))),
                version=version,
                sampled_with=sampled_with,
                wall_s=time.perf_counter() - t0,
                extra={
                    **summary.terms,
                    **{k: float(fb[k]) for k in ("kl", "clip_fraction") if fb and k in fb},
                },
            )
            self.records.append(record)
            self._report(record)
            if self.metrics_path is not None:
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps(asdict(record)) + "\n")
            if self.saver is not None:
                self.saver.step_done(asdict(record), step + 1, c.steps)
            if on_step is not None:
                on_step(record)
            if on_worker:
                self._watch_reward(step, summary)
            if was_fused and pending is None and step + 1 < c.steps and not self._stop.is_set():
                self.follow_placement()  # (nothing of the job in flight)
                # (after this step's checkpoint)
                fused = self._fuses
                pending = self._submit_fused(step + 1) if fused else self._submit_sample(step + 1)
                self.follow_placement.ask()
            elif on_worker and step + 1 < c.steps and pending is not None:
                if self.follow_placement.due():  # (the job must be still to move)
                    result(pending)  # (the next step's request, in flight)
                self.follow_placement()  # (no moves: no round trip; the next step asks again)
        if self.rollout is not None:
            result(self._sync())  # the rollout ends with the final weights
        return self.records


def run_jobs(
    jobs: list[GRPOJob],
    on_step: Callable[[StepRecord], None] | None = None,
    timeout: float | None = None,
) -> dict[str, list[StepRecord]]:
    """Run several jobs at once from one driver (each on its own thread: a job waits only
    on its own futures), sharing whatever deployments and workers the runtime gave them; the
    scheduler plugin interleaves their requests. Returns each job's records by name; the
    first job error is raised once all jobs have stopped. ``timeout`` bounds the whole run
    (default: ``plexrl.request.timeout`` per step times the longest job's steps): past it,
    or when the driver is interrupted (Ctrl-C), every job is stopped before its next step
    (:meth:`GRPOJob.stop`) and, once they have, :class:`RequestTimeout` (or the interrupt)
    is raised."""

    if not jobs:
        raise ConfigError("run_jobs needs at least one job")
    if len({j.name for j in jobs}) != len(jobs):
        raise ConfigError("jobs run together need distinct names")
    if timeout is None:
        timeout = plexrl_config.request_timeout() * max(j.config.steps for j in jobs)
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="plexrl-job") as pool:
        futures = {j.name: pool.submit(j.run, on_step) for j in jobs}
        try:
            _, running = wait(futures.values(), timeout=timeout)
        except BaseException:  # (an interrupt: the pool's exit waits for the jobs to stop)
            for j in jobs:
                j.stop()
            raise
        if running:
            for j in jobs:
                j.stop()
            late = [name for name, f in futures.items() if f in running]
            raise RequestTimeout(
                f"jobs {late} did not finish in {timeout:.0f}s; every job was stopped before "
                "its next step"
            )
        return {name: f.result() for name, f in futures.items()}
