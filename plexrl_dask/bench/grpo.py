"""One GRPO step through the runtime against the same step in one process.

    python -m plexrl_dask.bench.grpo --json OUT [--quick]

Every arm runs :class:`~plexrl_dask.rl.grpo.GRPOJob`'s own step (sampling seeded per (job,
step, prompt, sample), exact rewards, group advantages, the step as one ``sample_train``:
sampling, then a fused ``train_step`` that scores its samples where they are
(:mod:`plexrl_dask.rl.scoring`), the same :class:`~plexrl_dask.rl.objective.GRPOConfig`);
the in-process arms hand it an
:class:`InProcessDeployment`, a baseline harness whose calls run a
:class:`~plexrl_dask.worker.backends.torch_backend.TorchBackend` in the driver and return
already-resolved futures. Jobs are the standard mix (:mod:`plexrl_dask.rl.catalog`), each
warmed up once in this process (supervised, outside every timing) so its groups teach
something; every arm starts from those weights at version 0 with a fresh optimizer. One torch
thread everywhere, and no tokenizer pool (as a PlexRL worker runs: ``fix_threads``).

- ``step_rate_vs_in_process``: each job of the mix alone, colocated through the runtime on
  a one-worker ``local_cluster``, and in this process; a job's rate is its steps per second
  after the first (from the first step's record to the last's), the median over
  repetitions, arms alternated job by job. The ratio is the mix's summed seconds per step in
  process ÷ through the runtime (one step of each job, one after another; target ≥ 0.90);
  ``step_rate_vs_in_process_<job>``: each job's runtime rate ÷ in-process rate.
  ``records_equal``: every arm's records (rewards, lengths, losses, grad norms, versions,
  sampled tokens) are identical for every job and repetition (true). The runtime's worker
  has its threads bound to a core of its own, as ``local_cluster`` binds a worker that
  leaves a core to spare (``plexrl.local-cluster.bind-cpus``); in each repetition, before or
  after both arms in turn, the same runtime arm on a one-worker cluster whose worker floats
  over every core: ``step_rate_unbound_vs_in_process`` and ``bound_vs_unbound_step_rate`` (bound ÷
  unbound, the summed step times as above; per job ``bound_vs_unbound_step_rate_<job>``).
  The in-process arm floats: bound to one core it ran slower here.
- ``round_trips_per_step``: request/reply calls the driver's client made to the scheduler
  (counted by wrapping ``client.scheduler``: handler calls and result fetches) per
  steady-state step of the first job's first runtime run (the steps after the first and
  before the last: the first adds the job's setup, the last submits no next sample), by kind
  in ``round_trips_by_kind``; ``messages_by_kind``: one-way messages on the client's batched
  stream (task submissions, key releases), which wait for nothing.
  ``round_trips_per_step_split`` (and ``round_trips_split_by_kind``): the same for that job
  split, sampling on a rollout deployment synced every step, on a two-worker cluster. Which
  of them a step waits for: ``rl/grpo.py``'s module docstring and ``benchmarks/RESULTS.md``.
- ``pool_vs_parallel_processes``: wall time of the mix's four jobs multiplexed on a
  ``local_cluster`` of two workers (:func:`~plexrl_dask.rl.grpo.run_jobs`, every job
  colocated on one deployment, placed as the multiplexed mode places the mix:
  :func:`~plexrl_dask.rl.modes.pool_placement`, longest expected work first on the least
  loaded worker, each job's work its measured seconds per step in process: a profile, as
  PlexRL's placement profiles a job's first steps) ÷ the same four jobs as two processes (one core each), each running its pair
  of jobs in process one after the other: jobs 1–2 and 3–4 of the mix. Setup (cluster,
  deployments, weights; processes, backends) is outside both (target ≤ 1.0).
  The pool's two workers float over the two cores (``local_cluster`` binds workers only
  where they leave a core to spare). ``pool_records_equal``: every job's records are the
  same in both arms. Where the pool's CPU
  went (the repetition of the median wall): ``pool_driver_cpu_s`` (the driver's process: its
  jobs' threads, its client and the ``local_cluster``'s scheduler, all on the same two cores),
  ``pool_worker_cpu_s`` and ``pool_worker_busy_s`` (each worker's CPU seconds, and the seconds
  its requests ran), and the placement in the config.
- ``bos_matches_hf``: a saved checkpoint whose tokenizer's post-processor adds BOS; string
  prompts through ``Deployment.tokenize`` and through ``sample`` (its ``prompt_tokens``) give
  ``AutoTokenizer.from_pretrained(dir)(prompt)``'s ids, and sampling from the string equals
  sampling from those ids (true).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import resource
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import Any

import dask
import torch
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import config
from plexrl_dask.bench.common import median, parser, report
from plexrl_dask.rl.catalog import standard_jobs
from plexrl_dask.rl.grpo import GRPOJob, StepRecord, run_jobs
from plexrl_dask.rl.modes import JobSpec, Layout, pool_placement
from plexrl_dask.rl.scoring import ScoringRecipe, checked_recipe, scored_training
from plexrl_dask.rl.sizing import StepWork
from plexrl_dask.rl.warmup import supervised_warmup
from plexrl_dask.shared.checks import checked_adamw, checked_batch, checked_loss, checked_sample
from plexrl_dask.shared.types import AdamWParams, Datum, SampleResult, SamplingParams, Streams
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.device import fix_threads

Weights = dict[str, torch.Tensor]
#: What a record must repeat across arms (its wall time is the only field left out).
COMPARED = ("step", "reward_mean", "reward_max", "groups_used", "sampled_tokens",
            "completion_lengths", "loss", "grad_norm", "version", "sampled_with", "extra")  # fmt: skip


# --- the in-process baseline harness ---------------------------------------------------------


def _resolved(call: Callable[[], Any]) -> concurrent.futures.Future:
    """A future already holding ``call()``'s value (or its error)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(call())
    except Exception as e:  # noqa: BLE001 (the caller's result() raises it, as a request's)
        future.set_exception(e)
    return future


class InProcessDeployment:
    """The baseline harness: the calls of :class:`~plexrl_dask.driver.deployment.Deployment`
    that a colocated ``GRPOJob`` and ``supervised_warmup`` make, run on a ``TorchBackend``
    in this process, each checked and computed as the worker's op does it (the same argument
    checks, the client's sampling streams, the workers' ``max-batch-size``) and returned as an
    already-resolved future. Not a fake of the system: it is what the runtime is compared to."""

    #: What ``GRPOJob`` reads of a deployment's record: one worker, one replica.
    info = SimpleNamespace(world_size=1, replicas=1)

    def __init__(self, spec: plexrl.ModelSpec, weights: Weights | None = None) -> None:
        self.name = f"in-process-{spec.name}"
        max_batch = int(config.get("sampling.max-batch-size"))
        self.backend = TorchBackend(spec, "cpu", max_batch_size=max_batch)
        if weights is not None:
            self.backend.set_weights(weights, version=0)

    def tokenize(self, text: str, special_tokens: bool | None = None) -> list[int]:
        return self.backend.tokenize([text], special_tokens)[0]

    def sample(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams = SamplingParams()
    ) -> concurrent.futures.Future:
        def call() -> SampleResult:
            texts, checked, ids, _ = checked_sample(prompts, params, None)
            tokens = self.backend.tokenize(texts)
            groups = self.backend.sample(tokens, checked, ids, Streams.from_config())
            return SampleResult(
                prompt_tokens=tuple(tuple(t) for t in tokens),
                sequences=tuple(tuple(g) for g in groups),
            )

        return _resolved(call)

    def forward(self, batch: Sequence[Datum]) -> concurrent.futures.Future:
        return _resolved(lambda: self.backend.forward(checked_batch(batch)))

    def forward_backward(self, batch: Sequence[Datum], loss: Any) -> concurrent.futures.Future:
        return _resolved(
            lambda: self.backend.forward_backward(checked_batch(batch), checked_loss(loss))
        )

    def optim_step(self, params: AdamWParams = AdamWParams()) -> concurrent.futures.Future:
        return _resolved(lambda: self.backend.optim_step(checked_adamw(params)))

    def train_scored(
        self, samples: concurrent.futures.Future, recipe: ScoringRecipe
    ) -> concurrent.futures.Future:
        def call() -> dict[str, Any]:
            summary, training = scored_training(*checked_recipe(recipe, samples.result()), 0, 1)
            if training is None:
                return {"scored": summary}
            return {"scored": summary, **self.backend.train_step(*training)}

        return _resolved(call)

    def sample_train(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams, recipe: bytes
    ) -> concurrent.futures.Future:
        return self.train_scored(self.sample(prompts, params), recipe)

    def train_step(
        self, batch: Sequence[Datum], loss: Any, params: AdamWParams
    ) -> concurrent.futures.Future:
        return _resolved(
            lambda: self.backend.train_step(
                checked_batch(batch), checked_loss(loss), checked_adamw(params)
            )
        )


class InProcessRuntime:
    """What ``GRPOJob`` asks of its runtime, for the in-process harness: a job name, and no
    placement to follow (one process has no node group)."""

    client = None

    def __init__(self, job: str) -> None:
        self.job = job

    def ask_relocations(self) -> None:
        return None

    def relocate(self, timeout: float | None = None, asked: Any = None) -> list[dict[str, Any]]:
        return []


class InProcessJob(GRPOJob):
    """``GRPOJob`` on the harness: the same step; no scheduler to report steps to."""

    def __init__(self, spec: JobSpec, weights: Weights, steps: int) -> None:
        policy = InProcessDeployment(spec.model, weights)
        cfg = replace(spec.grpo, steps=steps)
        super().__init__(spec.name, InProcessRuntime(spec.name), spec.task, policy, cfg)  # type: ignore[arg-type]

    def _report(self, record: StepRecord) -> None:
        pass


# --- counting the driver's round trips -------------------------------------------------------


class RoundTrips:
    """Counts, by kind, the request/reply calls a client makes to its scheduler (scheduler
    handlers, including ``gather`` of results) and the one-way messages it sends on its
    batched stream, while :meth:`counting` is active. ``marks`` are snapshots taken by
    :meth:`mark` (e.g. after every step)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()
        self.marks: list[tuple[Counter[str], Counter[str]]] = []
        self._lock = threading.Lock()

    def _count(self, counter: Counter[str], kind: str) -> None:
        with self._lock:
            counter[kind] += 1

    def mark(self, *_: Any) -> None:
        with self._lock:
            self.marks.append((Counter(self.calls), Counter(self.messages)))

    @contextmanager
    def counting(self, client: Client) -> Iterator[RoundTrips]:
        scheduler, send = client.scheduler, client._send_to_scheduler
        client.scheduler = _CountingRPC(scheduler, lambda k: self._count(self.calls, k))

        def counted_send(msg: dict[str, Any]) -> None:
            self._count(self.messages, str(msg.get("op")))
            send(msg)

        client._send_to_scheduler = counted_send  # type: ignore[method-assign]
        try:
            yield self
        finally:
            client.scheduler = scheduler
            client._send_to_scheduler = send  # type: ignore[method-assign]

    def per_step(self, first: int, last: int) -> tuple[float, dict[str, float], dict[str, float]]:
        """Mean calls per step between marks ``first`` and ``last``, and the mean of each kind
        of call and of message."""
        (c0, m0), (c1, m1) = self.marks[first], self.marks[last]
        n = last - first
        calls = {k: v / n for k, v in sorted((c1 - c0).items())}
        messages = {k: v / n for k, v in sorted((m1 - m0).items())}
        return sum(calls.values()), calls, messages


class _CountingRPC:
    """``client.scheduler`` with every handler call counted (attributes pass through)."""

    def __init__(self, inner: Any, count: Callable[[str], None]) -> None:
        self._inner, self._count_call = inner, count

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._count_call(name)
            return attr(*args, **kwargs)

        return call


# --- the arms ----------------------------------------------------------------------------------


def warm_weights(spec: JobSpec, steps: int) -> Weights:
    """``spec``'s model after ``steps`` steps of its supervised warm-up, in this process."""
    deployment = InProcessDeployment(spec.model)
    supervised_warmup(
        deployment,  # type: ignore[arg-type]
        spec.task,
        steps,
        batch_size=spec.warmup_batch_size,
        optim=AdamWParams(lr=spec.warmup_lr),
    )
    return deployment.backend.get_weights()


def _same(a: Sequence[StepRecord], b: Sequence[StepRecord]) -> bool:
    def key(r: StepRecord) -> list[Any]:
        d = asdict(r)
        return [d[k] for k in COMPARED]

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


def _median_index(values: Sequence[float]) -> int:
    """The index of ``values``' median (the lower one of an even count)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]


def _rate(marks: Sequence[float]) -> float:
    """Steps per second from the first step's end to the last's."""
    return (len(marks) - 1) / (marks[-1] - marks[0])


def in_process_run(spec: JobSpec, weights: Weights, steps: int) -> tuple[float, list[StepRecord]]:
    ends: list[float] = []
    records = InProcessJob(spec, weights, steps).run(lambda _: ends.append(time.perf_counter()))
    return _rate(ends), records


def runtime_run(
    client: Client, spec: JobSpec, weights: Weights, steps: int, split: bool = False
) -> tuple[float, list[StepRecord], RoundTrips]:
    """``spec`` for ``steps`` steps through the runtime (colocated, or ``split``: sampling on
    a rollout deployment synced every step), with its round trips counted."""
    runtime = plexrl.Runtime(client, job=f"{spec.name}-{uuid.uuid4().hex[:6]}")
    policy = runtime.deploy("policy", spec.model)
    plexrl.result(policy.set_weights(weights, version=0))
    rollout = None
    if split:
        rollout = runtime.deploy("rollout", spec.model, role="rollout")
        plexrl.result(runtime.sync_weights(policy, rollout))
    job = GRPOJob(spec.name, runtime, spec.task, policy, replace(spec.grpo, steps=steps), rollout)
    trips, ends = RoundTrips(), []

    def on_step(_: StepRecord) -> None:
        ends.append(time.perf_counter())
        trips.mark()

    try:
        with trips.counting(client):
            records = job.run(on_step)
    finally:
        runtime.undeploy("policy")
        if rollout is not None:
            runtime.undeploy("rollout")
    return _rate(ends), records, trips


def step_rates(
    specs: Sequence[JobSpec], weights: dict[str, Weights], steps: int, reps: int
) -> dict[str, Any]:
    """``step_rate_vs_in_process`` (and each job's), ``records_equal`` and the round trips
    of the first job's first runtime run; the same runtime arm on a worker left unbound
    (``plexrl.local-cluster.bind-cpus`` off), its cluster before or after the bound one's
    in turn: ``step_rate_unbound_vs_in_process`` and ``bound_vs_unbound_step_rate``."""
    rates: dict[tuple[str, str], list[float]] = {}
    records: dict[tuple[str, str], list[list[StepRecord]]] = {}
    trips = None
    for rep in range(reps):
        for bound in (True, False) if rep % 2 == 0 else (False, True):
            with dask.config.set({"plexrl.local-cluster.bind-cpus": bound}):
                cluster = plexrl.local_cluster(n_workers=1)
            with cluster, Client(cluster) as client:
                for spec in specs:  # (arms alternated, job by job)
                    arm = "runtime" if bound else "unbound"
                    rate, got, counted = runtime_run(client, spec, weights[spec.name], steps)
                    rates.setdefault((spec.name, arm), []).append(rate)
                    records.setdefault((spec.name, arm), []).append(got)
                    trips = trips or (counted if bound else None)
                    if bound:
                        rate, got = in_process_run(spec, weights[spec.name], steps)
                        rates.setdefault((spec.name, "in_process"), []).append(rate)
                        records.setdefault((spec.name, "in_process"), []).append(got)
    first = {s.name: records[s.name, "in_process"][0] for s in specs}
    same = all(_same(first[job], r) for (job, _), runs in records.items() for r in runs)
    assert trips is not None
    total, calls, messages = trips.per_step(0, steps - 2)
    rate = {key: median(v) for key, v in rates.items()}
    # A step of each job, one after another: the ratio of the summed step times.
    step_s = {
        arm: sum(1 / rate[s.name, arm] for s in specs)
        for arm in ("runtime", "in_process", "unbound")
    }
    return {
        "step_rate_vs_in_process": step_s["in_process"] / step_s["runtime"],
        **{
            f"step_rate_vs_in_process_{s.name}": rate[s.name, "runtime"]
            / rate[s.name, "in_process"]
            for s in specs
        },
        "step_rate_unbound_vs_in_process": step_s["in_process"] / step_s["unbound"],
        "bound_vs_unbound_step_rate": step_s["unbound"] / step_s["runtime"],
        **{
            f"bound_vs_unbound_step_rate_{s.name}": rate[s.name, "runtime"]
            / rate[s.name, "unbound"]
            for s in specs
        },
        **{f"steps_per_s_{arm}_{job}": r for (job, arm), r in rate.items()},
        "records_equal": same,
        "round_trips_per_step": total,
        "round_trips_by_kind": calls,
        "messages_by_kind": messages,
    }


def _pair_main(
    specs: list[JobSpec], weights: list[Weights], barrier: Any, out: Any, index: int
) -> None:
    """One process of the parallel-processes arm: its jobs in process, one after the other,
    started with the other process's (``barrier``); puts (index, start, end, records)."""
    fix_threads(1)  # as a PlexRL worker runs: one torch thread, no tokenizer pool
    jobs = [InProcessJob(s, w, s.grpo.steps) for s, w in zip(specs, weights, strict=True)]
    barrier.wait()
    start = time.time()
    records = {job.name: job.run() for job in jobs}
    out.put((index, start, time.time(), records))


def parallel_processes(
    pairs: list[list[JobSpec]], weights: dict[str, Weights], timeout: float
) -> tuple[float, dict[str, list[StepRecord]]]:
    """Wall time of ``pairs`` as processes, each running its jobs in process one after the
    other (processes and backends built before the clock starts), and every job's records."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(len(pairs)), ctx.Queue()
    procs = [
        ctx.Process(
            target=_pair_main, args=(pair, [weights[s.name] for s in pair], barrier, out, i)
        )
        for i, pair in enumerate(pairs)
    ]
    for p in procs:
        p.start()
    try:
        done = [out.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    wall = max(end for _, _, end, _ in done) - min(start for _, start, _, _ in done)
    return wall, {name: r for *_, records in done for name, r in records.items()}


def _cpu_s(dask_worker: Any = None) -> float:
    """CPU seconds this process has used (its threads and the scheduler's, in the driver)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pool(
    specs: list[JobSpec],
    weights: dict[str, Weights],
    workers: int,
    profile: dict[str, float] | None = None,
) -> tuple[float, dict[str, list[StepRecord]], dict[str, Any]]:
    """Wall time of ``specs`` multiplexed on a pool of ``workers`` (each job colocated on one
    deployment, placed as the multiplexed mode places the mix:
    :func:`~plexrl_dask.rl.modes.pool_placement`, by ``profile``'s seconds per step where
    given, else by estimated FLOPs), from ``run_jobs`` to its return, their
    records, and where the CPU went meanwhile: the driver's process (its jobs' threads, its
    client and, in a ``local_cluster``, the scheduler) and each worker's, and each worker's
    busy seconds (its requests' spans)."""
    with plexrl.local_cluster(n_workers=workers) as cluster, Client(cluster) as client:
        gpu = str(config.get("worker.gpu-resource"))
        addresses = sorted(
            a for a, w in plexrl.worker_info(client).items() if w["resources"].get(gpu)
        )
        work = {n: StepWork(sample=0.0, train=t) for n, t in (profile or {}).items()}
        placed = pool_placement(specs, Layout("multiplexed", workers), addresses, work=work)
        jobs = []
        for spec in specs:
            runtime = plexrl.Runtime(client, job=spec.name)
            policy = runtime.deploy("policy", spec.model, workers=list(placed[spec.name].train))
            plexrl.result(policy.set_weights(weights[spec.name], version=0))
            jobs.append(GRPOJob(spec.name, runtime, spec.task, policy, spec.grpo))
        cpu0, workers0 = _cpu_s(), client.run(_cpu_s)
        t0, since = time.perf_counter(), time.time()
        records = run_jobs(jobs)
        wall = time.perf_counter() - t0
        cpu1, workers1 = _cpu_s(), client.run(_cpu_s)
        busy = dict.fromkeys(addresses, 0.0)
        for span in jobs[0].runtime.timeline(since):
            if span.start >= since:
                busy[span.worker] += span.seconds
        return (
            wall,
            records,
            {
                "driver_cpu_s": cpu1 - cpu0,
                "worker_cpu_s": sorted(workers1[a] - workers0[a] for a in addresses),
                "worker_busy_s": sorted(busy.values()),
                "placement": {s.name: list(placed[s.name].train) for s in specs},
            },
        )


def split_round_trips(spec: JobSpec, weights: Weights, steps: int) -> dict[str, Any]:
    """The round trips of ``spec`` split (policy and rollout on two workers)."""
    with plexrl.local_cluster(n_workers=2) as cluster, Client(cluster) as client:
        _, _, trips = runtime_run(client, spec, weights, steps, split=True)
    total, calls, _ = trips.per_step(0, steps - 2)
    return {"round_trips_per_step_split": total, "round_trips_split_by_kind": calls}


def bos_matches_hf(prompts: Sequence[str]) -> bool:
    """``bos_matches_hf`` (see the module docstring), on a one-worker cluster."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from plexrl_dask.models.tokenizer import BOS, build_char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        spec = plexrl.ModelSpec.tiny(hidden_size=64, num_layers=2, seed=6).save_pretrained(tmp)
        tokenizer = build_char_tokenizer()
        bos = tokenizer.convert_tokens_to_ids(BOS)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, bos)]
        )
        tokenizer.save_pretrained(tmp)
        want = [AutoTokenizer.from_pretrained(tmp, local_files_only=True)(p)["input_ids"]
                for p in prompts]  # fmt: skip
        params = SamplingParams(n=2, max_tokens=6, seed=3)
        with plexrl.local_cluster(n_workers=1) as cluster, Client(cluster) as client:
            dep = plexrl.Runtime(client, job="bench-grpo-bos").deploy("bos", spec)
            by_text = plexrl.result(dep.sample(list(prompts), params))
            by_ids = plexrl.result(dep.sample(want, params))
            tokenized = [dep.tokenize(p) for p in prompts]
    return (
        all(w[0] == bos for w in want)
        and tokenized == want
        and [list(t) for t in by_text.prompt_tokens] == want
        and by_text.sequences == by_ids.sequences
    )


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    fix_threads(1)  # as a PlexRL worker runs: one torch thread, no tokenizer pool
    # quick: fewer steps and warm-up steps, one repetition; the jobs are otherwise the mix's
    steps, pool_steps, warmup, reps = (6, 4, 100, 1) if args.quick else (16, 24, 300, 3)
    specs = [
        replace(s, grpo=replace(s.grpo, steps=pool_steps), warmup_steps=warmup)
        for s in standard_jobs(4)
    ]
    t0 = time.perf_counter()
    weights = {s.name: warm_weights(s, warmup) for s in specs}
    warmup_s = time.perf_counter() - t0

    results = step_rates(specs, weights, steps, reps)
    results.update(split_round_trips(specs[0], weights[specs[0].name], max(4, steps // 2)))
    pairs = [specs[:2], specs[2:]]
    # The pool is placed by a profile (as PlexRL's placement profiles a job's first steps):
    # each job's measured seconds per step in process. The processes' pairs are the mix's.
    profile = {s.name: 1 / results[f"steps_per_s_in_process_{s.name}"] for s in specs}
    walls: dict[str, list[float]] = {"pool": [], "processes": []}
    where: list[dict[str, Any]] = []
    same = True
    for _ in range(1 if args.quick else 3):  # (arms alternated)
        wall, pooled, spent = pool(specs, weights, 2, profile)
        walls["pool"].append(wall)
        where.append(spent)
        timeout = config.request_timeout() * pool_steps * len(specs)
        wall, alone = parallel_processes(pairs, weights, timeout)
        walls["processes"].append(wall)
        same = same and all(_same(pooled[s.name], alone[s.name]) for s in specs)
    results.update(
        pool_vs_parallel_processes=median(walls["pool"]) / median(walls["processes"]),
        pool_wall_s=median(walls["pool"]),
        parallel_processes_wall_s=median(walls["processes"]),
        pool_records_equal=same,
        # (the repetition of the median wall: where its CPU went)
        pool_driver_cpu_s=where[_median_index(walls["pool"])]["driver_cpu_s"],
        pool_worker_cpu_s=where[_median_index(walls["pool"])]["worker_cpu_s"],
        pool_worker_busy_s=where[_median_index(walls["pool"])]["worker_busy_s"],
        bos_matches_hf=bos_matches_hf(["12+3=", "7*8=", "countdown 3 4 5 -> 12"]),
    )
    cfg = {
        "jobs": [s.describe() for s in specs],
        "round_trips_job": specs[0].name,
        "step_rate_steps": steps,
        "pool_steps": pool_steps,
        "pairs": [[s.name for s in p] for p in pairs],
        "repetitions": reps,
        "warmup_s": warmup_s,
        "walls": walls,
        "pool_placement": where[0]["placement"],
        "max_batch_size": int(config.get("sampling.max-batch-size")),
    }
    targets = {
        "step_rate_vs_in_process": ">= 0.90",
        "records_equal": "true",
        "pool_vs_parallel_processes": "<= 1.0",
        "pool_records_equal": "true",
        "bos_matches_hf": "true",
    }
    report("grpo", results, targets, cfg, args.json)


if __name__ == "__main__":
    main()
