"""Benchmark: the same GRPO jobs isolated (colocated, split, split-async) and multiplexed.

One ``local_cluster`` with as many workers as cores (one torch thread each, so an idle worker
cannot lend its core to a busy one). First, outside every measurement, each job of the
standard mix (:mod:`plexrl_dask.rl.catalog`) runs its supervised warm-up and saves a
checkpoint; every mode then starts each job from it. Then, in one run:

1. one worker's **peak decode throughput** for each job's model at its best batch size
   (:func:`~plexrl_dask.rl.modes.peak_tokens_per_second`), at the start;
2. every **layout** of every mode that fits the cores (:func:`~plexrl_dask.rl.modes.layouts`:
   the documented search, the same for every mode), each running all jobs to the end, with
   the peaks measured again right before and right after it; its throughput-to-peak divides
   by their mean at each batch size (:func:`bracketed`): this machine's speed drifts over
   minutes, and a ratio of two different minutes' speeds would measure the drift. A mode's
   cost is its cheapest layout's. Definitions: :mod:`plexrl_dask.rl.ledger`.
   ``throughput_to_peak_peaks_before`` and ``throughput_to_peak_run_start_peaks`` give the
   ratio against the peaks right before the layout only and against the first peaks.

Results: ``cost_ratio_vs_{split_async,split,colocated}`` (multiplexed ÷ baseline, each at its
best layout), ``throughput_to_peak`` (multiplexed) and ``colocated_throughput_to_peak``,
``reward_trajectories_identical`` (every job's reward and loss per step bit-identical in every
synchronous layout: colocated, split and multiplexed; false if no step trained, and
``trajectory_steps_trained`` counts those that did), ``final_mean_reward`` per job,
``idle_fraction`` per mode, ``generation_length_p50``/``_p90``/``_p99``/``_max`` over all
sampled completions, plus every layout's ledger and a PNG of the best multiplexed run.
Where the pool's cost goes with a fixed set of jobs: the pool holds its workers until the
last job ends, so ``longest_job`` (the longest colocated wall time) matters most:
``longest_job_bound_ratio_vs_colocated`` is what the pool would cost, ÷ colocated, if that job
ran in the pool as fast as alone and everything else fitted around it
(:func:`~plexrl_dask.rl.ledger.longest_job_bound`); ``longest_job_wall_ratio`` is the pool's
makespan ÷ that job's colocated wall, and ``longest_job_blocked_s`` the seconds its chain of
requests waited on other jobs' requests in the pool (:meth:`~plexrl_dask.rl.ledger.ModeLedger.blocked_seconds`);
``busy_ratio_vs_colocated`` is the pool's busy worker-seconds ÷ colocated's: the same requests,
slower where they share the cores with more; ``no_idle_cost_ratio_vs_colocated`` the pool's busy
worker-seconds ÷ colocated's cost, what the pool would cost with no idle time
(:func:`~plexrl_dask.rl.ledger.where_cost_goes`).
A diagnostic of where to-peak goes: ``rollout_cpu_share`` (multiplexed; ``colocated_…``), the
share of the rollout requests' run time their threads were on a CPU, against
``peak_cpu_share``, the same share of the peak requests around that layout
(:func:`~plexrl_dask.rl.ledger.cpu_share`); each layout's ledger has both, and
``busy_by_op``: its busy worker-seconds by request op (sample, train_step, weight syncs).
Split-async changes the algorithm, not only the layout: ``split_async_vs_sync`` compares its
final rewards with the synchronous job's over ``--seeds`` seeds (default 5): within two
standard errors of independent samples (``split_async_within_two_se``), and seed by seed
(``paired_*``: the same seeds ran both ways). Three seeds leave each side's spread with two
degrees of freedom: one job's standard error read 0.0017 with three seeds and 0.0098 with
five, in runs of the same code on the same machine.

Memory decides layouts, as on real clusters: at ``--memory-budget`` (default
:data:`BUDGET`) each job's training takes its smallest group that fits
(:func:`~plexrl_dask.rl.modes.smallest_groups`); countdown4 shards over two workers, and
colocated means each job trains and samples on its own group. ``training_groups`` and
``training_memory_bytes`` in the config say what each job needed. Split and split-async hold
a training group and a rollout worker: countdown4 needs three workers there, so on two they
are not run; ``--memory-budget auto`` (every job fits one worker) compares against them.

A mode none of whose layouts fits ``--workers`` is not run: on one worker (a machine with one
GPU, where ``--workers`` defaults to the GPUs and may not exceed them) split and split-async
need a second one. ``modes_not_run`` names them, and every result that needs them
(``cost_ratio_vs_split_async``, ``cost_ratio_vs_split``, their to-peaks, idle fractions and
rewards) is None.

**Cores per worker** (``--cores``). Cost counts worker-seconds, a worker standing for a
device; on this CPU machine a worker is a core, and everything else (each job's driver, the
scheduler, tool calls) runs on the same cores. With ``--cores free`` (the default, and every
run recorded before the option) every process floats over all of them: an isolated job
holding one worker of two cores has its driver and the scheduler on the other core for free,
while a pool's drivers share its workers' cores, which its cost counts. With ``--cores equal``
each run is confined (:func:`~plexrl_dask.bench.common.confined`) to as many cores as it holds
workers (an isolated job to its group's and rollout's; the pool to its workers'), its
drivers, scheduler and tools on them: every layout gets one core per worker-second it is
charged, what a device's host CPUs are where drivers do not count. The two definitions are
reported apart, the option in ``config["cores"]``.

Run: ``python -m plexrl_dask.bench.multiplex --jobs 4 --json OUT [--quick] [--cores free|equal]`` (8-20 minutes on
2 cores as the machine's speed varies, 2-8 of them warm-up; ``--quick``: a quarter of the
warm-up and GRPO steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import dask.config
import dask.utils
from distributed import Client
from rich.console import Console

import plexrl_dask as plexrl
from plexrl_dask.bench.common import add_cores_option, confinement, parser, report
from plexrl_dask.cluster import visible_gpus
from plexrl_dask.rl.catalog import STANDARD_BUDGET, standard_jobs
from plexrl_dask.rl.ledger import (
    ISOLATED_MODES,
    MODES,
    cost_ratio,
    cpu_share,
    percentile,
    seed_difference,
    where_cost_goes,
)
from plexrl_dask.rl.modes import (
    JobSpec,
    Layout,
    ModeRun,
    cheapest,
    layouts,
    peak_tokens_per_second,
    run_mode,
    sampling_fits,
    smallest_groups,
    tensor_parallel_degrees,
    trajectories_identical,
)
from plexrl_dask.rl.report import plot_run, reward_start_end
from plexrl_dask.rl.sizing import budget_bytes
from plexrl_dask.rl.warmup import warm_start, warmup_deployment
from plexrl_dask.shared.types import Streams

logger = logging.getLogger(__name__)

#: The workers' memory budget (why this one: :data:`~plexrl_dask.rl.catalog.STANDARD_BUDGET`).
BUDGET = STANDARD_BUDGET

TARGETS = {
    "cost_ratio_vs_split_async": "<= 0.60 (paper: 0.62-0.69)",
    "throughput_to_peak": ">= 0.80 (paper 0.75)",
    "colocated_throughput_to_peak": "(paper 0.53)",
    "cost_ratio_vs_colocated": "<= 0.80 (RollMux: 0.72)",
    "reward_trajectories_identical": "true",
}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=4, help="jobs of the standard mix (1-5)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="at most the cores, and the GPUs where CUDA is visible (default: as many)",
    )
    p.add_argument(
        "--png", default=None, help="PNG of the best multiplexed run (default: beside --json)"
    )
    p.add_argument(
        "--memory-budget",
        default=BUDGET,
        help="each worker's plexrl.worker.memory-budget; it decides each job's smallest "
        f"training group (default {BUDGET}: see the module docstring; 'auto': the device's)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=24,
        help="GRPO steps of every job (the main job runs 60; fewer keep the run under 30 min)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=5,
        help="GRPO seeds per job in the split-async comparison (0: skip it; else >= 2)",
    )
    p.add_argument(
        "--stream-rows",
        type=int,
        default=None,
        help="plexrl.sampling.stream-rows for every layout (default: the setting). A step of "
        "the standard jobs is 128 rows: at 128, one stream, which a job colocated on 2 "
        "workers decodes on its rank 0 alone; at 64 each rank decodes one",
    )
    add_cores_option(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    if args.workers is None:
        args.workers = len(visible_gpus()) or os.cpu_count() or 1
    if args.workers > (os.cpu_count() or 1):
        raise SystemExit(
            f"--workers {args.workers} > {os.cpu_count()} cores: idle workers would lend cores"
        )
    gpus = len(visible_gpus())
    if gpus and args.workers > gpus:
        raise SystemExit(
            f"--workers {args.workers} > {gpus} GPUs: workers would share a GPU (on a GPU "
            f"machine every worker is one GPU)"
        )
    if args.seeds == 1:
        raise SystemExit("--seeds: 0 (skip the comparison) or at least 2 (a standard error)")
    scale = 0.25 if args.quick else 1.0
    steps = max(2, round(args.steps * scale))
    specs = [replace(j, grpo=replace(j.grpo, steps=steps)) for j in standard_jobs(args.jobs, scale)]
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else "multiplex.png")

    budget = budget_bytes(args.memory_budget)
    groups = smallest_groups(specs, budget, args.workers)
    for name, k in groups.items():
        if k > 1:
            console.print(
                f"{name}: its training needs {k} workers at {budget / 2**20:.0f} MiB each "
                f"({specs_by_name(specs)[name].training_memory().total / 2**20:.0f} MiB on one)"
            )
    not_run = modes_not_run(args.workers, groups)
    degrees = tensor_parallel_degrees(specs, args.workers)  # (split with TP rollout)
    for mode, why in not_run.items():
        console.print(f"{mode}: not run ({why})")
    settings = {"plexrl.worker.memory-budget": args.memory_budget}
    if args.stream_rows is not None:  # (workers get it too: shipped settings)
        settings["plexrl.sampling.stream-rows"] = args.stream_rows
    with (
        dask.config.set(settings),
        tempfile.TemporaryDirectory(prefix="plexrl-bench-") as tmp,
        plexrl.local_cluster(n_workers=args.workers) as cluster,
        Client(cluster) as client,
    ):
        runtime = plexrl.Runtime(client, job="bench-multiplex")
        workers = sorted(plexrl.worker_info(client))
        t0 = time.perf_counter()
        checkpoints = warm_start(runtime, specs, Path(tmp) / "warmup")
        console.print(
            f"warm-up of {len(specs)} jobs: {time.perf_counter() - t0:.0f}s (not measured)"
        )

        # The peaks are measured at the start and again around each layout, whose ledger
        # uses the ones next to it: this VM's speed drifts over minutes, and a peak from
        # another minute than the requests it divides would measure the drift.
        peaks, peak_detail, _ = measure_peaks(runtime, specs, workers[0])
        console.print(f"peak tokens/s per job: { {k: round(v) for k, v in peaks.items()} }")

        runs: list[ModeRun] = []
        # per layout, the peaks measured right before it and right after it (the next
        # layout's "before"; one more measurement after the last layout), with the peak
        # requests' CPU share
        brackets: list[dict[str, dict[int, float]]] = []
        shares: list[float | None] = []
        fits = sampling_fits(specs, budget, groups)
        for mode in MODES:
            for layout in layouts(mode, args.workers, groups.values(), degrees, fits):
                t0 = time.perf_counter()
                here, detail, share = measure_peaks(runtime, specs, workers[0])
                brackets.append(detail)
                shares.append(share)
                run = run_mode(
                    runtime,
                    specs,
                    layout,
                    checkpoints,
                    workers,
                    metrics_dir=Path(tmp) / "metrics",
                    peak_tokens_per_s=here,
                    groups=groups,
                    confine=confinement(args.cores),
                )
                runs.append(run)
                s = run.ledger.summary()
                console.print(
                    f"{layout.label}: cost {s['cost_worker_seconds']:.1f} worker-s, idle "
                    f"{s['idle_fraction']:.2f}, throughput-to-peak against the peaks before it "
                    f"{s['throughput_to_peak']:.2f} ({time.perf_counter() - t0:.0f}s)"
                )
        _, detail, share = measure_peaks(runtime, specs, workers[0])
        brackets.append(detail)
        shares.append(share)
        layout_peaks = {
            r.layout.label: {"before": brackets[i], "after": brackets[i + 1]}
            for i, r in enumerate(runs)
        }
        peak_shares = {
            r.layout.label: _mean_share(shares[i], shares[i + 1]) for i, r in enumerate(runs)
        }
        runs = [
            replace(
                r,
                ledger=replace(r.ledger, peak_tokens_per_s=bracketed(brackets[i], brackets[i + 1])),
            )
            for i, r in enumerate(runs)
        ]
        # Written now and again at the end: the comparison below is long.
        results, config = summarise(
            runs, specs, peaks, peak_detail, layout_peaks, png, peak_shares, not_run
        )
        config.update(
            workers=args.workers,
            quick=args.quick,
            memory_budget=args.memory_budget,
            memory_budget_bytes=budget,
            training_groups=groups,
            training_memory_bytes={s.name: dataclasses.asdict(s.training_memory()) for s in specs},
            seeds=0,
            steps=steps,
            cores=args.cores,
            stream_rows=args.stream_rows or Streams.from_config().rows,
        )
        report("multiplex", results, TARGETS, config, args.json)
        seeds = None
        if args.seeds:
            t0 = time.perf_counter()
            seeds = seed_comparison(
                runtime, specs, checkpoints, workers, args.seeds, Path(tmp) / "seeds", groups
            )
            console.print(
                f"split-async vs synchronous over {args.seeds} seeds: {time.perf_counter() - t0:.0f}s"
            )
    if seeds is None:
        return
    results["split_async_vs_sync"] = seeds
    results["split_async_within_two_se"] = all(v["within_2se"] for v in seeds.values())
    config["seeds"] = args.seeds
    report("multiplex", results, TARGETS, config, args.json)


def seed_comparison(
    runtime: plexrl.Runtime,
    specs: list[JobSpec],
    checkpoints: dict[str, dict[str, Any]],
    workers: list[str],
    seeds: int,
    metrics_dir: Path,
    groups: dict[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Split-async changes the algorithm (staleness 1), so its rewards are compared with the
    synchronous job's over ``seeds`` GRPO seeds rather than bit for bit: every (job, seed,
    staleness) variant runs at once on the shared pool (a multiplexed run is bit-identical
    to the isolated one of the same algorithm and layout: tests/test_modes.py). Per job: the
    mean final reward (last 5 steps) of each algorithm over the seeds, their difference and
    its standard error, and whether the difference is within two standard errors."""
    variants: list[JobSpec] = []
    base: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    readers: dict[str, list[str]] = {}  # the variants of each job
    for spec in specs:
        for k in range(seeds):
            for staleness in (0, 1):
                grpo = replace(spec.grpo, seed=spec.grpo.seed + 1000 * k, staleness=staleness)
                variants.append(replace(spec, name=f"{spec.name}-s{k}-st{staleness}", grpo=grpo))
                base[variants[-1].name] = checkpoints[spec.name]
                sizes[variants[-1].name] = (groups or {}).get(spec.name, 1)
                readers.setdefault(spec.name, []).append(variants[-1].name)
    t0 = time.perf_counter()
    with shared_warmups(runtime, specs, readers):
        run = run_mode(
            runtime,
            variants,
            Layout("multiplexed", len(workers), 1),
            base,
            workers,
            metrics_dir=metrics_dir,
            groups=sizes,
        )
    logger.info(
        "seed comparison: %d jobs multiplexed in %.0fs", len(variants), time.perf_counter() - t0
    )
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        finals = {
            st: [reward_start_end(run.records[f"{spec.name}-s{k}-st{st}"])[1] for k in range(seeds)]
            for st in (0, 1)
        }
        out[spec.name] = seed_difference(finals[0], finals[1])  # split-async - synchronous
    return out


@contextlib.contextmanager
def shared_warmups(
    runtime: plexrl.Runtime, specs: list[JobSpec], readers: dict[str, list[str]]
) -> Iterator[None]:
    """While the block runs, the jobs ``readers[job]`` may load ``job``'s warm-up checkpoint
    (:func:`~plexrl_dask.rl.warmup.warm_start`'s): they are other jobs, and stored state is its
    deployment's (docs/tenancy.md), so the job deploys its warm-up deployment's name again
    (never loaded: it holds no memory) and its owner shares ``get_weights`` with them."""
    held = []
    try:
        for spec in specs:
            job = plexrl.Runtime(runtime.client, job=spec.name)
            name = warmup_deployment(spec.name)
            warmup = job.deploy(name, spec.model, role="rollout")
            held.append((job, name))
            for reader in readers.get(spec.name, ()):
                warmup.share(reader, ops=("get_weights",))
        yield
    finally:
        for job, name in held:
            job.undeploy(name)


def measure_peaks(
    runtime: Any, specs: list[Any], worker: str
) -> tuple[dict[str, float], dict[str, dict[int, float]], float | None]:
    """Every job's peak tokens/s on ``worker``, its measurement per batch size, and the
    peak requests' :func:`~plexrl_dask.rl.ledger.cpu_share`."""
    peaks: dict[str, float] = {}
    detail: dict[str, dict[int, float]] = {}
    t0 = time.time()
    for spec in specs:
        prompt = spec.task.problems(spec.grpo.problem_offset, 1)[0].prompt
        peaks[spec.name], detail[spec.name] = peak_tokens_per_second(
            runtime, spec.model, worker, prompt, spec.grpo.max_tokens
        )
    spans = [s for s in runtime.timeline(since=t0) if s.op == "sample" and s.start >= t0]
    return peaks, detail, cpu_share(spans)


def bracketed(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]
) -> dict[str, float]:
    """Per job, the peak over the minutes of a layout: at each batch size the mean of its
    measurement right before and right after the layout, then the best batch size."""
    return {job: max((by_b[b] + after[job][b]) / 2 for b in by_b) for job, by_b in before.items()}


def summarise(
    runs: list[ModeRun],
    specs: list[Any],
    peaks: dict[str, float],
    peak_detail: dict[str, dict[int, float]],
    layout_peaks: dict[str, dict[str, dict[int, float]]],
    png: str,
    peak_shares: dict[str, float | None] | None = None,
    not_run: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The benchmark's results from its runs (best layout per mode; see the module docs).
    ``peaks``/``peak_detail``: measured at the start of the run; ``layout_peaks``: right
    before and right after each layout (its ledger's peaks are :func:`bracketed` from
    them); ``peak_shares``: per layout, the CPU share of the peak requests around it;
    ``not_run``: the modes no layout of which fitted, with why (their results are None).
    The multiplexed mode and the colocated one fit any worker count and must have run."""
    peak_shares = peak_shares or {}
    best = cheapest(runs, MODES)
    for needed in ("multiplexed", "colocated"):
        if needed not in best:
            raise ValueError(f"no {needed} layout among the runs")
    mux = best["multiplexed"]

    def of_best(mode: str, what: Callable[[ModeRun], Any]) -> Any:
        return what(best[mode]) if mode in best else None

    identical, trained = trajectories_identical(runs, [s.name for s in specs])
    lengths = [n for recs in mux.records.values() for rec in recs for n in rec.completion_lengths]
    colocated = best["colocated"].ledger
    costs = where_cost_goes(mux.ledger, colocated)
    plot_run(mux.records, mux.ledger, png, title=f"{mux.layout.label}: reward per step")
    results: dict[str, Any] = {
        "cost_ratio_vs_split_async": of_best(
            "split-async", lambda r: cost_ratio(mux.ledger, r.ledger)
        ),
        "cost_ratio_vs_split": of_best("split", lambda r: cost_ratio(mux.ledger, r.ledger)),
        "cost_ratio_vs_colocated": cost_ratio(mux.ledger, best["colocated"].ledger),
        "throughput_to_peak": mux.ledger.throughput_to_peak(),
        "colocated_throughput_to_peak": best["colocated"].ledger.throughput_to_peak(),
        # the same against the peaks measured right before the layout only, and against
        # those at the start of the run: what the machine's drift does to the ratio
        "throughput_to_peak_peaks_before": _against_before(mux, layout_peaks),
        "colocated_throughput_to_peak_peaks_before": _against_before(
            best["colocated"], layout_peaks
        ),
        "throughput_to_peak_run_start_peaks": replace(
            mux.ledger, peak_tokens_per_s=peaks
        ).throughput_to_peak(),
        # where to-peak goes: the share of the rollout requests' run time their threads were
        # on a CPU, against the same share of the peak requests around the layout
        "rollout_cpu_share": mux.ledger.rollout_cpu_share(),
        "peak_cpu_share": peak_shares.get(mux.layout.label),
        "colocated_rollout_cpu_share": best["colocated"].ledger.rollout_cpu_share(),
        # where the pool's cost goes with a fixed set of jobs (rl/ledger.py)
        **costs,
        "reward_trajectories_identical": identical,
        "trajectory_steps_trained": trained,
        "final_mean_reward": {s.name: reward_start_end(mux.records[s.name])[1] for s in specs},
        "start_mean_reward": {s.name: reward_start_end(mux.records[s.name])[0] for s in specs},
        "split_async_final_mean_reward": of_best(
            "split-async",
            lambda r: {s.name: reward_start_end(r.records[s.name])[1] for s in specs},
        ),
        "idle_fraction": {
            mode: of_best(mode, lambda r: r.ledger.idle_fraction()) for mode in MODES
        },
        "generation_length_p50": percentile(lengths, 0.50),
        "generation_length_p90": percentile(lengths, 0.90),
        "generation_length_p99": percentile(lengths, 0.99),
        "generation_length_max": max(lengths),
        "best_layout": {mode: of_best(mode, lambda r: r.layout.label) for mode in MODES},
        "modes_not_run": dict(not_run or {}),
        "layouts": [
            {
                "layout": r.layout.label,
                **r.ledger.summary(),
                "peak_by_batch_size": layout_peaks.get(r.layout.label, {}),
                "throughput_to_peak_peaks_before": _against_before(r, layout_peaks),
                "throughput_to_peak_run_start_peaks": replace(
                    r.ledger, peak_tokens_per_s=peaks
                ).throughput_to_peak(),
                "peak_cpu_share": peak_shares.get(r.layout.label),
                "placement": r.extra.get("placement"),  # (pools: each job's workers)
            }
            for r in runs
        ],
        "png": png,
    }
    for mode in ISOLATED_MODES:
        results[f"throughput_to_peak_{mode}"] = of_best(
            mode, lambda r: r.ledger.throughput_to_peak()
        )
    config = {
        "jobs": [s.describe() for s in specs],
        "peak_tokens_per_s": peaks,
        "peak_by_batch_size": peak_detail,
    }
    return results, config


def modes_not_run(workers: int, groups: dict[str, int] | None = None) -> dict[str, str]:
    """The modes of which no layout fits ``workers`` workers for jobs whose training needs
    ``groups`` workers each, with why (split and split-async need a rollout worker beside
    the training group)."""
    groups = groups or {}
    widest = max(groups.values(), default=1)
    wide = [name for name, k in groups.items() if k == widest and k > 1]
    why = f" ({', '.join(wide)} train(s) on {widest})" if wide else ""
    return {
        mode: f"every layout of it needs more than {workers} worker(s){why}"
        for mode in MODES
        if not layouts(mode, workers, groups.values())
    }


def specs_by_name(specs: list[JobSpec]) -> dict[str, JobSpec]:
    return {s.name: s for s in specs}


def _mean_share(a: float | None, b: float | None) -> float | None:
    known = [x for x in (a, b) if x is not None]
    return sum(known) / len(known) if known else None


def _against_before(run: ModeRun, layout_peaks: dict[str, dict[str, Any]]) -> float:
    before = layout_peaks[run.layout.label]["before"]
    peaks = {job: max(by_b.values()) for job, by_b in before.items()}
    return replace(run.ledger, peak_tokens_per_s=peaks).throughput_to_peak()


if __name__ == "__main__":
    main()
