"""The same GRPO jobs in every deployment mode, on one runtime, with what each mode cost.

A :class:`JobSpec` is a whole job: task, model, GRPO config, supervised warm-up. Every mode
starts each job from the same warm-up checkpoint (:func:`~plexrl_dask.rl.warmup.warm_start`,
run once) and runs the same :class:`~plexrl_dask.rl.grpo.GRPOJob` code; only the deployments
differ:

- **colocated**: the job's training deployment samples too, on its whole training group
  (verl's hybrid engine: each rank decodes its share on gathered weights);
- **split**: a training deployment on its group, a rollout deployment of ``r`` replicas on
  ``r`` other workers, synced every step;
- **split-async**: the split layout with the rollout one step ahead (``staleness=1``);
- **multiplexed**: every job's training and rollout deployments on one shared pool of ``p``
  workers (``r`` rollout replicas per job, sized independently of training; ``r = 0``: each
  job samples from its training deployment), the jobs running at once, their
  requests ordered by the scheduler plugin and their state moved by the node's StateManager.

Memory decides each job's smallest training group (:func:`smallest_groups`, counted by
:mod:`plexrl_dask.rl.sizing` against the workers' budget), as on clusters where a large
model's training does not fit one device. Isolated jobs run one after another.
:func:`layouts` is the documented search space: every layout of a mode that fits the cores
(one torch thread per worker, never more workers than cores) and every job's group; each is
run and the cheapest kept (:mod:`plexrl_dask.rl.ledger` defines the cost).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from plexrl_dask import config
from plexrl_dask.driver.deployment import Deployment, split_prompts
from plexrl_dask.driver.runtime import Runtime, check_tensor_parallel
from plexrl_dask.driver.waits import result
from plexrl_dask.errors import ConfigError
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.models.tokenizer import encode_prompts
from plexrl_dask.rl.grpo import GRPOJob, StepRecord, run_jobs
from plexrl_dask.rl.job_checkpoint import JobCheckpoint, JobCheckpoints, read_checkpoint
from plexrl_dask.rl.ledger import ISOLATED_MODES, MODES, JobWindow, ModeLedger
from plexrl_dask.rl.objective import GRPOConfig
from plexrl_dask.rl.sizing import (
    SamplingMemory,
    StepWork,
    TrainingMemory,
    sampling_memory,
    step_work,
    training_memory,
)
from plexrl_dask.shared.records import BACKEND_NAMES, WEIGHTS_ONLY_BACKENDS
from plexrl_dask.shared.types import SamplingParams, Streams
from plexrl_dask.tasks.base import Task, describe_task

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSpec:
    """One RLVR job: everything that makes its runs in different modes the same job."""

    name: str
    task: Task
    model: ModelSpec
    grpo: GRPOConfig
    warmup_steps: int = 300
    warmup_batch_size: int = 64
    warmup_lr: float = 1e-3
    #: The backend of the job's rollout deployments (in layouts that have them): "torch", or
    #: "vllm" on CUDA workers with the vllm package. Training is always on "torch".
    rollout_backend: str = "torch"

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"job names are letters, digits, '-' and '_': {self.name!r}")
        if self.warmup_steps < 0 or self.warmup_batch_size < 1:
            raise ConfigError(f"warm-up steps >= 0 and batch size >= 1: {self}")
        if self.rollout_backend not in BACKEND_NAMES:
            raise ConfigError(
                f"rollout_backend is one of {BACKEND_NAMES}, got {self.rollout_backend!r}"
            )

    def config_for(self, mode: str) -> GRPOConfig:
        """The job's GRPO config in ``mode``: the isolated modes fix the algorithm
        (split-async runs one step ahead, colocated and split are synchronous); a
        multiplexed job keeps its own ``grpo.staleness``."""
        if mode == "multiplexed":
            return self.grpo
        return replace(self.grpo, staleness=1 if mode == "split-async" else 0)

    def training_memory(self) -> TrainingMemory:
        """What a step's training holds (:mod:`plexrl_dask.rl.sizing`): the state, and the
        activations of its whole batch (:meth:`step_shape`)."""
        return training_memory(self.model, *self.step_shape())

    def sampling_memory(self) -> SamplingMemory:
        """What sampling a step's batch holds (:func:`plexrl_dask.rl.sizing.sampling_memory`)
        at :meth:`step_shape`."""
        return sampling_memory(self.model, *self.step_shape())

    def step_work(self) -> StepWork:
        """A step's estimated compute (:func:`plexrl_dask.rl.sizing.step_work`) at
        :meth:`step_shape`."""
        return step_work(self.model, *self.step_shape())

    def step_shape(self) -> tuple[int, int]:
        """A step's rows (prompts × group size) and their padded width: the longest of its
        first step's prompts plus ``max_tokens``."""
        problems = self.task.problems(self.grpo.problem_offset, self.grpo.prompts_per_step)
        tokenizer = self.model.build_tokenizer()
        longest = max(len(t) for t in encode_prompts(tokenizer, [p.prompt for p in problems]))
        return self.grpo.prompts_per_step * self.grpo.group_size, longest + self.grpo.max_tokens

    def describe(self) -> dict[str, Any]:
        """What reproduces the job (JSON-able)."""
        return {
            "name": self.name,
            "task": describe_task(self.task),
            "model": self.model.to_dict(),
            "grpo": asdict(self.grpo),
            "rollout_backend": self.rollout_backend,
            "warmup": {
                "steps": self.warmup_steps,
                "batch_size": self.warmup_batch_size,
                "lr": self.warmup_lr,
            },
        }


@dataclass(frozen=True)
class Layout:
    """How many workers a mode reserves: per job (isolated) or for the pool (multiplexed),
    and how many of them (isolated) or of the pool's workers (multiplexed) hold rollout
    replicas of each job (0: the job samples from its training deployment).

    ``train_ranks``: the training group of each job, at least (a job whose training needs
    more workers, :mod:`plexrl_dask.rl.sizing`, gets its smallest group that fits instead;
    :func:`run_mode`'s ``groups``). An isolated job holds its group and its rollout workers;
    ``workers`` is that for a job on ``train_ranks``. A colocated job samples on its whole
    training group (each rank its share of the streams on gathered weights); in a pool every
    job trains on its smallest group. A split layout's rollout replicas may each span
    ``tensor_parallel`` workers."""

    mode: str
    workers: int
    rollout_replicas: int = 0
    train_ranks: int = 1
    #: (multiplexed) Rollout replicas only for the jobs whose training spans several
    #: workers; the others sample from their policy.
    sharded_rollout_only: bool = False
    #: (split) Each rollout replica over this many workers, tensor-parallel.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode is one of {MODES}, got {self.mode!r}")
        split = self.mode in ("split", "split-async")
        if self.workers < 1 or self.rollout_replicas < 0 or self.train_ranks < 1:
            raise ConfigError(f"a layout needs workers, train_ranks >= 1, replicas >= 0: {self}")
        if self.mode == "colocated" and (self.rollout_replicas or self.workers != self.train_ranks):
            raise ConfigError(f"a colocated job samples on its training group: {self}")
        if split and (
            self.rollout_replicas < 1 or self.workers != self.job_workers(self.train_ranks)
        ):
            raise ConfigError(f"a split job holds its training group and its rollout: {self}")
        if self.tensor_parallel < 1 or (self.tensor_parallel > 1 and not split):
            raise ConfigError(f"a tensor-parallel rollout is a split layout's: {self}")
        if self.sharded_rollout_only and (self.mode != "multiplexed" or not self.rollout_replicas):
            raise ConfigError(f"rollout for sharded jobs only is a pool's, with replicas: {self}")
        if self.mode == "multiplexed" and (
            self.rollout_replicas > self.workers or self.train_ranks != 1
        ):
            raise ConfigError(
                f"a pool's rollout replicas are 0..pool size, each job on its smallest "
                f"training group: {self}"
            )

    def replicas_for(self, group: int) -> int:
        """The rollout replicas of a job training on ``group`` workers."""
        return 0 if self.sharded_rollout_only and group == 1 else self.rollout_replicas

    def group(self, smallest: int) -> int:
        """The training group of a job whose training needs ``smallest`` workers."""
        return max(self.train_ranks, smallest)

    def job_workers(self, smallest: int) -> int:
        """What an isolated job whose training needs ``smallest`` workers holds."""
        return self.group(smallest) + self.rollout_replicas * self.tensor_parallel

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            if self.train_ranks == 1:
                return "colocated, each job on its smallest training group"
            return f"colocated, each job on a training group of {self.train_ranks}+ workers"
        if self.mode == "multiplexed":
            rollout = (
                f"{self.rollout_replicas} rollout replica(s) per job"
                if self.rollout_replicas
                else "each job sampling from its policy"
            )
            if self.sharded_rollout_only:
                rollout = (
                    f"{self.rollout_replicas} rollout replica(s) per job training on several "
                    "workers, the others sampling from their policy"
                )
            return f"multiplexed, pool of {self.workers}, {rollout}"
        train = "its training group" if self.train_ranks == 1 else f"{self.train_ranks}+ train"
        if self.tensor_parallel > 1:
            return (
                f"{self.mode}, {train} + {self.rollout_replicas} rollout replica(s) of "
                f"{self.tensor_parallel} workers (tensor-parallel) per job"
            )
        return f"{self.mode}, {train} + {self.rollout_replicas} rollout worker(s) per job"


def layouts(
    mode: str,
    max_workers: int,
    groups: Iterable[int] = (),
    tensor_parallel: Iterable[int] = (),
    fits: Callable[[Layout], bool] | None = None,
) -> list[Layout]:
    """Every layout of ``mode`` on at most ``max_workers`` workers (the search space), for
    jobs whose training needs ``groups`` workers each (default: one each) and whose models
    split over each of ``tensor_parallel`` (degrees > 1; :func:`tensor_parallel_degrees`).
    A layout that does not fit one of the jobs is not offered: an isolated job holds its
    group and its rollout workers, a pool is at least as large as the largest group, and
    where ``fits`` is given (:func:`sampling_fits`), every job's sampling fits where the
    layout puts it."""
    out = _layouts(mode, max_workers, groups, tensor_parallel)
    return out if fits is None else [layout for layout in out if fits(layout)]


def sampling_fits(
    specs: Sequence[JobSpec], budget: int, groups: Mapping[str, int] | None = None
) -> Callable[[Layout], bool]:
    """Whether each job's sampling fits a worker ``budget`` (bytes) in a layout
    (:class:`~plexrl_dask.rl.sizing.SamplingMemory`): on a rollout replica of one worker, or
    of a split layout's ``tensor_parallel`` workers, its share of the weights and of its
    batch's keys and values; sampling from its training group (colocated, or a pool's job
    without replicas), its shard, the gathered copy and its share of the batch, its gradients
    and moments offloaded. ``groups``: each job's smallest training group (default 1)."""
    groups = dict(groups or {})
    memory = {s.name: s.sampling_memory() for s in specs}

    def fits(layout: Layout) -> bool:
        for name, m in memory.items():
            g = groups.get(name, 1)
            if layout.mode == "colocated":
                need = m.hybrid_per_rank(max(layout.train_ranks, g))
            elif layout.mode in ("split", "split-async"):
                need = m.per_replica(layout.tensor_parallel)
            else:
                replicas = layout.rollout_replicas > 0 and (
                    not layout.sharded_rollout_only or g > 1
                )
                need = m.per_replica(1) if replicas else m.hybrid_per_rank(g)
            if need > budget:
                return False
        return True

    return fits


def _layouts(
    mode: str, max_workers: int, groups: Iterable[int], tensor_parallel: Iterable[int]
) -> list[Layout]:
    if max_workers < 1:
        raise ConfigError("the search needs at least one worker")
    if mode not in MODES:
        raise ConfigError(f"mode is one of {MODES}, got {mode!r}")
    sizes = sorted(set(groups)) or [1]
    widest = sizes[-1]
    if widest > max_workers:
        return []
    if mode == "colocated":
        # Each job on max(k, its own smallest group): a k at or under the smallest group of
        # every job is the k = 1 layout again.
        return [Layout(mode, k, 0, k) for k in range(1, max_workers + 1) if k == 1 or k > sizes[0]]
    if mode in ("split", "split-async"):
        return [
            Layout(mode, 1 + r * t, r, tensor_parallel=t)
            for t in sorted({1, *tensor_parallel})
            for r in range(1, (max_workers - widest) // t + 1)
        ]
    pools = [Layout(mode, p, r) for p in range(widest, max_workers + 1) for r in range(p + 1)]
    if widest > 1:  # rollout sized apart from a sharded training group, only where there is one
        pools += [
            Layout(mode, p, r, sharded_rollout_only=True)
            for p in range(widest, max_workers + 1)
            for r in range(1, p + 1)
        ]
    return pools


def tensor_parallel_degrees(specs: Sequence[JobSpec], max_workers: int) -> list[int]:
    """The tensor-parallel degrees above 1, up to ``max_workers``, that every job's model
    splits over (:func:`plexrl_dask.driver.runtime.check_tensor_parallel`'s rule) and every
    job's rollout backend runs."""
    out = []
    for t in range(2, max_workers + 1):
        try:
            for s in specs:
                check_tensor_parallel(s.model.hf_config(), "rollout", s.rollout_backend, 1, t)
        except ConfigError:
            continue
        out.append(t)
    return out


def smallest_groups(specs: Sequence[JobSpec], budget: int, max_workers: int) -> dict[str, int]:
    """Each job's smallest training group at a worker memory ``budget`` (bytes), by name;
    :class:`ConfigError` naming the jobs whose training fits no group of up to
    ``max_workers``."""
    out: dict[str, int | None] = {
        s.name: s.training_memory().smallest_group(budget, max_workers) for s in specs
    }
    unfit = [name for name, k in out.items() if k is None]
    if unfit:
        raise ConfigError(
            f"the training of {unfit} does not fit {max_workers} worker(s) of "
            f"{budget / 2**20:.0f} MiB each (plexrl_dask.rl.sizing counts what it needs)"
        )
    return {name: int(k) for name, k in out.items()}  # type: ignore[arg-type]


@dataclass(frozen=True)
class PoolPlace:
    """Where a job's deployments go in a pool: its training ranks in rank order and its
    rollout replicas' workers (none: it samples from its training deployment), with the
    work per step (FLOPs, :meth:`JobSpec.step_work`) each worker takes on from it."""

    train: tuple[str, ...]
    rollout: tuple[str, ...]
    load: Mapping[str, float]


def pool_placement(
    specs: Sequence[JobSpec],
    layout: Layout,
    pool: Sequence[str],
    groups: Mapping[str, int] | None = None,
    stream_rows: int | None = None,
    work: Mapping[str, StepWork] | None = None,
) -> dict[str, PoolPlace]:
    """Each job's workers in the pool of a multiplexed ``layout``, the expected work spread
    over them: longest job first (its steps × its step work), each of its parts to the
    least-loaded worker so far (LPT, Graham's rule: a makespan within 4/3 of the best). A
    job's step work is ``work[name]`` where given (a profile: what its steps took), else its
    estimate (:meth:`JobSpec.step_work`, FLOPs).

    A job's parts: each training rank's share of the step (training splits evenly over its
    ``groups[name]`` ranks, default one), and the rollout. Sampled by rollout replicas, the
    rollout splits evenly over them; sampled on the training group (the hybrid engine), each
    rank decodes the prompts :func:`~plexrl_dask.driver.deployment.split_prompts` gives it for
    ``stream_rows`` (default ``plexrl.sampling.stream-rows``): one stream per step puts the
    whole rollout on rank 0. A job's heaviest rank goes to the least-loaded worker, and its
    ranks and its replicas each take distinct workers. Ties go to the pool's order, so the
    placement is a function of its inputs."""
    if stream_rows is None:
        stream_rows = Streams.from_config().rows
    groups = {s.name: (groups or {}).get(s.name, 1) for s in specs}
    pool = list(pool)
    if max(groups.values(), default=1) > len(pool) or layout.rollout_replicas > len(pool):
        raise ConfigError(f"{layout.label}: a job needs more than the pool's {len(pool)} workers")
    parts: dict[str, tuple[list[float], list[float]]] = {}
    for spec in specs:
        k, g = groups[spec.name], spec.grpo
        step = (work or {}).get(spec.name) or spec.step_work()
        replicas = layout.replicas_for(k)
        ranks = [step.train / k] * k
        rollout = [step.sample / replicas] * replicas if replicas else []
        if not replicas:
            chunks = split_prompts(g.prompts_per_step, k, g.group_size, stream_rows)
            for rank, (a, b) in enumerate(chunks):
                ranks[rank] += step.sample * (b - a) / g.prompts_per_step
        parts[spec.name] = ([w * g.steps for w in ranks], [w * g.steps for w in rollout])
    load = dict.fromkeys(pool, 0.0)
    order = sorted(specs, key=lambda s: (-sum(map(sum, parts[s.name])), s.name))
    out: dict[str, PoolPlace] = {}
    for spec in order:
        ranks, rollout = parts[spec.name]
        mine: dict[str, float] = {}
        train = _least_loaded(ranks, load, mine)
        held = _least_loaded(rollout, load, mine)
        out[spec.name] = PoolPlace(train, held, mine)
    return {s.name: out[s.name] for s in specs}


def _least_loaded(
    works: Sequence[float], load: dict[str, float], mine: dict[str, float]
) -> tuple[str, ...]:
    """Distinct workers for ``works`` in their order, the heaviest part to the least-loaded
    worker (``load``, updated, as is ``mine``: this job's share per worker)."""
    chosen: dict[int, str] = {}
    for i in sorted(range(len(works)), key=lambda i: -works[i]):
        free = [w for w in load if w not in chosen.values()]
        w = min(free, key=lambda w: (load[w], list(load).index(w)))
        chosen[i] = w
        load[w] += works[i]
        mine[w] = mine.get(w, 0.0) + works[i]
    return tuple(chosen[i] for i in range(len(works)))


@dataclass
class ModeRun:
    """A mode's run: its layout, each job's records, and its cost ledger."""

    layout: Layout
    records: dict[str, list[StepRecord]]
    ledger: ModeLedger
    extra: dict[str, Any] = field(default_factory=dict)

    def trajectory(self, job: str) -> list[tuple[float, float | None]]:
        """``job``'s (reward mean, loss) per step: what must match across modes."""
        return [(r.reward_mean, r.loss) for r in self.records[job]]


@dataclass
class _Placed:
    spec: JobSpec
    runtime: Runtime  # the job's
    policy: Deployment
    rollout: Deployment | None
    workers: tuple[str, ...]
    rollout_workers: tuple[str, ...]
    version: int  # of the starting state (a resumed job's: its checkpoint's)
    resumed: bool  # the job restores its checkpoint (nothing was loaded here)


@contextlib.contextmanager
def _deployed(
    runtime: Runtime,
    spec: JobSpec,
    layout: Layout,
    start: dict[str, Any] | JobCheckpoint,
    train_workers: Sequence[str],
    rollout_workers: Sequence[str],
    replicas: int,
) -> Iterator[_Placed]:
    """``spec``'s deployments for ``layout`` (training sharded over ``train_workers``,
    ``replicas`` rollout replicas on ``rollout_workers``),
    restored from ``start`` (what ``save_state`` returned) and synced; undeployed on exit.
    ``start`` a job's checkpoint: nothing is loaded or synced, since the job restores both
    from it as it starts."""
    tag = f"{layout.mode}-{spec.name}"
    names = [f"{tag}-policy"]
    runtime = Runtime(runtime.client, job=spec.name)  # the job's own: its requests carry its name
    resumed = isinstance(start, JobCheckpoint)
    try:
        policy = runtime.deploy(
            names[0], spec.model, workers=list(train_workers), world_size=len(train_workers)
        )
        version = start.version if resumed else int(result(policy.load_state(start)))
        rollout = None
        if replicas:
            names.append(f"{tag}-rollout")
            rollout = runtime.deploy(
                names[1],
                spec.model,
                role="rollout",
                backend=spec.rollout_backend,
                workers=list(rollout_workers),
                replicas=replicas,
                tensor_parallel=layout.tensor_parallel,
            )
            if not resumed:
                result(runtime.sync_weights(policy, rollout))
        held = rollout.info.workers if rollout is not None else tuple(train_workers)
        yield _Placed(
            spec, runtime, policy, rollout, (*train_workers, *held), tuple(held), version, resumed
        )
    finally:
        for name in names:
            with contextlib.suppress(Exception):
                runtime.undeploy(name)


def job_checkpoint_dir(directory: str | os.PathLike[str], mode: str, job: str) -> Path:
    """Where :func:`run_mode` keeps ``job``'s checkpoints in ``mode`` under ``directory``."""
    return Path(directory) / f"{mode}-{job}"


def resumable(
    directory: str | os.PathLike[str], mode: str, specs: Sequence[JobSpec]
) -> dict[str, JobCheckpoint]:
    """The jobs of ``specs`` with a checkpoint of ``mode`` under ``directory``, by name:
    given that directory, :func:`run_mode` resumes them after the steps their checkpoints
    hold, and needs no starting state for them."""
    found = {}
    for spec in specs:
        saved = read_checkpoint(job_checkpoint_dir(directory, mode, spec.name))
        if saved is not None:
            found[spec.name] = saved
    return found


def _job(
    placed: _Placed,
    mode: str,
    metrics_dir: Path | None,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int | None = None,
) -> GRPOJob:
    spec = placed.spec
    checkpoints = None
    if checkpoint_dir is not None:
        checkpoints = JobCheckpoints.at(
            job_checkpoint_dir(checkpoint_dir, mode, spec.name),
            every=checkpoint_every,
            required=placed.resumed,
        )
    return GRPOJob(
        spec.name,
        placed.runtime,
        spec.task,
        placed.policy,
        spec.config_for(mode),
        rollout=placed.rollout,
        metrics_path=None if metrics_dir is None else metrics_dir / f"{mode}-{spec.name}.jsonl",
        start_version=placed.version,
        checkpoints=checkpoints,
    )


def _window(
    placed: _Placed,
    t0: float,
    t1: float,
    records: list[StepRecord],
    pooled: bool,
    first: int = 0,
) -> JobWindow:
    sampler = placed.rollout if placed.rollout is not None else placed.policy
    return JobWindow(
        job=placed.spec.name,
        deployments=tuple(d.name for d in (placed.policy, placed.rollout) if d is not None),
        sampler=sampler.name,
        workers=() if pooled else tuple(dict.fromkeys(placed.workers)),
        rollout_workers=placed.rollout_workers,
        t0=t0,
        t1=t1,
        # (the steps run in this window: a resumed job's records begin with restored ones)
        useful_tokens=sum(sum(r.completion_lengths) for r in records if r.step >= first),
    )


def cheapest(runs: Sequence[ModeRun], modes: Sequence[str] = MODES) -> dict[str, ModeRun]:
    """Each of ``modes`` that ran: its cheapest run (the ledger's cost)."""
    return {
        mode: min(
            (r for r in runs if r.layout.mode == mode),
            key=lambda r: r.ledger.reserved_worker_seconds(),
        )
        for mode in modes
        if any(r.layout.mode == mode for r in runs)
    }


def trajectories_identical(runs: Sequence[ModeRun], jobs: Sequence[str]) -> tuple[bool, int]:
    """Whether every job's (reward, loss) per step is the same in every synchronous run that
    trains each job on its smallest group (a group of another size rounds differently), and
    how many of the first such run's steps trained: equal trajectories of steps that trained
    nothing would prove little, so none trained is False."""
    synchronous = [r for r in runs if r.layout.mode != "split-async" and r.layout.train_ranks == 1]
    if not synchronous:
        return False, 0
    trained = sum(loss is not None for j in jobs for _, loss in synchronous[0].trajectory(j))
    same = all(r.trajectory(j) == synchronous[0].trajectory(j) for r in synchronous for j in jobs)
    return trained > 0 and same, trained


def _episodes(extra: dict[str, Any], job: GRPOJob) -> None:
    """An agentic job's turns per episode, tool calls, and tool seconds per call that ran,
    into a run's ``extra``."""
    if job.episode_turns:
        extra.setdefault("episodes", {})[job.name] = {
            "turns": list(job.episode_turns),
            "tool_calls": job.tool_calls,
            "tool_s": list(job.tool_seconds),
        }


def run_mode(
    runtime: Runtime,
    specs: Sequence[JobSpec],
    layout: Layout,
    checkpoints: dict[str, dict[str, Any]],
    workers: Sequence[str],
    metrics_dir: str | os.PathLike[str] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    peak_tokens_per_s: dict[str, float] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    groups: Mapping[str, int] | None = None,
    confine: Callable[[Sequence[str]], contextlib.AbstractContextManager[Any]] | None = None,
) -> ModeRun:
    """Run ``specs`` in ``layout`` on the first ``layout.workers`` of ``workers``: isolated
    modes one job after another, multiplexed all at once; returns every job's records and
    the mode's ledger (``peak_tokens_per_s``, by job, for throughput-to-peak).
    ``checkpoints``: each job's starting state by name (what ``save_state`` returned, e.g.
    by :func:`~plexrl_dask.rl.warmup.warm_start`). ``groups``: the workers each job's training
    needs at least (:func:`smallest_groups`; default one), which an isolated job holds in
    addition to its rollout workers and a pool must be as large as.

    ``checkpoint_dir``: each job checkpoints every ``checkpoint_every`` steps (default: the
    config's) under :func:`job_checkpoint_dir`, and a job that has a checkpoint there
    resumes after its steps: its state is loaded once, from that checkpoint, and it needs
    no starting state (:func:`resumable` lists them). The ledger then covers the steps run
    in this call. A job with neither raises :class:`ConfigError` before anything is
    deployed.

    ``confine``: entered with the workers an isolated job holds, around that job's run (the
    pool: its workers, around the jobs' run); a benchmark confines the machine there
    (``bench.common.confined``: everything on as many cores as the run holds workers)."""
    groups = {s.name: layout.group((groups or {}).get(s.name, 1)) for s in specs}
    needs = max(
        [layout.workers]
        + [layout.job_workers(groups[s.name]) for s in specs if layout.mode in ISOLATED_MODES]
        + [groups[s.name] for s in specs]
    )
    if layout.mode == "multiplexed" and needs > layout.workers:
        raise ConfigError(f"{layout.label} is smaller than a job's training group ({needs})")
    if needs > len(workers):
        raise ConfigError(f"{layout.label} needs {needs} workers, {len(workers)} given")
    scoring = [
        s.name
        for s in specs
        if s.rollout_backend in WEIGHTS_ONLY_BACKENDS
        and layout.rollout_replicas
        and s.config_for(layout.mode).staleness
    ]
    if scoring:
        raise ConfigError(
            f"jobs {scoring} run one step ahead (staleness 1), which scores old log-probabilities "
            "on the rollout: a vllm rollout does not score; use staleness 0 or a torch rollout"
        )
    reserved = list(workers[:needs])
    out_dir = None if metrics_dir is None else Path(metrics_dir)
    ck_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
    resuming = {} if ck_dir is None else resumable(ck_dir, layout.mode, specs)
    starts = {s.name: resuming.get(s.name) or checkpoints.get(s.name) for s in specs}
    missing = [name for name, start in starts.items() if start is None]
    if missing:
        raise ConfigError(
            f"jobs {missing} have neither a starting state in `checkpoints` nor a checkpoint "
            f"of {layout.mode!r} to resume under {ck_dir}"
        )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[StepRecord]] = {}
    windows: list[JobWindow] = []
    extra: dict[str, Any] = {}
    if layout.mode in ISOLATED_MODES:
        first = None
        for spec in specs:
            k = groups[spec.name]
            with _deployed(
                runtime,
                spec,
                layout,
                starts[spec.name],
                reserved[:k],
                reserved[k : layout.job_workers(k)],
                layout.rollout_replicas,
            ) as placed:
                job = _job(placed, layout.mode, out_dir, ck_dir, checkpoint_every)
                held = reserved[: layout.job_workers(k)]
                with confine(held) if confine is not None else contextlib.nullcontext():
                    t0 = time.time()
                    first = t0 if first is None else first
                    records[spec.name] = job.run(on_step)
                _episodes(extra, job)
                windows.append(
                    _window(placed, t0, time.time(), records[spec.name], False, job.first_step)
                )
        t_start, t_end, pool = first or time.time(), time.time(), ()
    else:
        places = pool_placement(specs, layout, reserved, groups)
        extra["placement"] = {
            name: {"train": list(p.train), "rollout": list(p.rollout)} for name, p in places.items()
        }
        with contextlib.ExitStack() as stack:
            placed_jobs = [
                stack.enter_context(
                    _deployed(
                        runtime,
                        spec,
                        layout,
                        starts[spec.name],
                        places[spec.name].train,
                        places[spec.name].rollout or reserved,
                        layout.replicas_for(groups[spec.name]),
                    )
                )
                for spec in specs
            ]
            jobs = [_job(p, layout.mode, out_dir, ck_dir, checkpoint_every) for p in placed_jobs]
            with confine(reserved) if confine is not None else contextlib.nullcontext():
                t_start = time.time()
                records = run_jobs(jobs, on_step)
                t_end = time.time()
            for job in jobs:
                _episodes(extra, job)
            windows = [
                _window(p, t_start, t_end, records[p.spec.name], True, j.first_step)
                for p, j in zip(placed_jobs, jobs, strict=True)
            ]
        pool = tuple(reserved)
    ledger = ModeLedger(
        mode=layout.mode,
        jobs=tuple(windows),
        spans=tuple(runtime.timeline(since=t_start)),
        t0=t_start,
        t1=t_end,
        pool=pool,
        peak_tokens_per_s=dict(peak_tokens_per_s or {}),
    )
    return ModeRun(layout, records, ledger, extra)


def peak_tokens_per_second(
    runtime: Runtime,
    model: ModelSpec,
    worker: str,
    prompt: str,
    max_tokens: int,
    batch_sizes: Sequence[int] | None = None,
    repeats: int = 2,
) -> tuple[float, dict[int, float]]:
    """One worker's decode throughput for ``model`` at each batch size (the best of
    ``repeats`` requests of ``b`` samples of ``prompt``, every sample decoding ``max_tokens``
    tokens: ``ignore_eos``, no stop string), timed by the worker's own request spans without
    setup. Returns the best tokens/s and the measurement per batch size. The default batch
    sizes are the powers of two from 8 to twice ``plexrl.sampling.max-batch-size`` (past it,
    a request decodes as consecutive full batches)."""
    if batch_sizes is None:
        top = 2 * int(config.get("sampling.max-batch-size"))  # type: ignore[call-overload]
        batch_sizes = [8]
        while batch_sizes[-1] * 2 <= top:
            batch_sizes.append(batch_sizes[-1] * 2)
    name = f"peak-{model.name}-{worker.rsplit(':', 1)[-1]}"
    deployment = runtime.deploy(name, model, role="rollout", workers=[worker], exist_ok=True)
    by_batch: dict[int, float] = {}
    try:
        for b in batch_sizes:
            best = 0.0
            for r in range(repeats):
                t = time.time()
                params = SamplingParams(n=b, max_tokens=max_tokens, seed=r, ignore_eos=True)
                out = result(deployment.sample([prompt], params))
                spans = [s for s in runtime.timeline(since=t) if s.deployment == deployment.name]
                seconds = sum(s.run_seconds for s in spans)
                best = max(best, out.num_tokens() / seconds)
            by_batch[b] = best
    finally:
        runtime.undeploy(name)
    return max(by_batch.values()), by_batch
