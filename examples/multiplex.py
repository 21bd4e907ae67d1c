"""The main job: four RLVR jobs (different tasks, seeds and model sizes; one whose training
needs two workers at the stated memory budget) and an agentic one (multi-turn, calling a
calculator on a tool worker) multiplexed on one local pool, with live progress per job, a
table at the end and a PNG.

    python examples/multiplex.py [--jobs 4] [--agentic 1] [--memory-budget 192MiB] [--scale 1.0] [--grpo-steps N] [--rollout-replicas R]
                                 [--out runs/multiplex] [--checkpoint-every N] [--fresh] [--compare isolated|none]
                                 [--model PATH]   # every job on a local HF checkpoint instead
                                 [--rollout-backend vllm]   # rollout on vLLM (CUDA workers)
                                 [--slurm GPUS [--slurm-queue Q ...] [--dry-run]]   # on SLURM (TLS)
                                 [--scheduler ADDRESS --workers N]   # on a running cluster

Each job runs a supervised warm-up, then GRPO; all jobs share the pool's workers (one per
core), their requests ordered by the PlexRL scheduler plugin. Every job's per-step metrics go
to ``<out>/multiplexed-<job>.jsonl`` (the first line: the config that reproduces it).

Then (``--compare isolated``, the default) the same jobs run again from the same warm-ups,
alone, one after another, in each isolated mode's smallest layout that fits on the pool's
workers (colocated on each job's training group; split and split-async where a job's training
group leaves room for its rollout), written to ``<out>/<mode>-<job>.jsonl``: the table gives
the pool's cost against each as measured, and says whether each job's rewards and losses were
the same, step by step, as in the pool. (``bench.multiplex`` runs every layout of every mode.)

Every job checkpoints itself under ``<out>/checkpoints`` every few steps: stopped (Ctrl-C, a
lost machine), the same command resumes each job after its last checkpoint, without its
warm-up, and computes what an uninterrupted run computes. ``--fresh`` starts over.
"""

import argparse
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import dask
from distributed import Client
from rich.console import Console

import plexrl_dask as plexrl
from plexrl_dask.cli import nonnegative_int, positive_float, positive_int
from plexrl_dask.rl.catalog import STANDARD_BUDGET, agentic_jobs, standard_jobs
from plexrl_dask.rl.modes import (
    Layout,
    layouts,
    resumable,
    run_mode,
    sampling_fits,
    smallest_groups,
    tensor_parallel_degrees,
    trajectories_identical,
)
from plexrl_dask.rl.progress import JobProgress
from plexrl_dask.rl.report import plot_run, summary_table
from plexrl_dask.rl.sizing import budget_bytes
from plexrl_dask.rl.warmup import warm_start

# Worker processes are spawned and re-import this file: everything runs under main().


@contextlib.contextmanager
def connect(cluster: object, timeout: float) -> Iterator[Client]:
    """A client of ``cluster`` (a cluster object, or a running scheduler's address, waited for
    up to ``timeout`` seconds: then a one-line error, not a traceback)."""
    try:
        client = Client(cluster, **({"timeout": timeout} if isinstance(cluster, str) else {}))
    except OSError as e:
        raise SystemExit(f"no scheduler reached at {cluster}: {e}") from None
    with client:
        yield client


def gpu_workers(client: Client, n: int, timeout: float | None) -> list[str]:
    """The addresses of the cluster's PlexRL workers (those with the GPU resource), sorted,
    once at least ``n`` have joined (the pool is the first ``n``: ``run_mode``)."""
    resource = dask.config.get("plexrl.worker.gpu-resource")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        info = plexrl.worker_info(client)
        found = sorted(a for a, w in info.items() if w.get("resources", {}).get(resource, 0) >= 1)
        if len(found) >= n:
            return found
        if deadline is not None and time.monotonic() > deadline:
            raise SystemExit(f"{len(found)} of {n} PlexRL workers joined within {timeout:.0f}s")
        time.sleep(0.2)


def isolated_runs(
    runtime: plexrl.Runtime,
    specs: list,
    checkpoints: dict,
    workers: list[str],
    groups: dict[str, int],
    pool: object,
    out: Path,
    console: Console,
) -> tuple[dict[str, float], list[str]]:
    """The same jobs, from the same warm-ups, run alone one after another in each isolated
    mode's smallest layout that fits on the pool's workers (each job on its smallest group:
    the mode's cheapest layout in ``bench.multiplex``'s sweep of every layout of these jobs,
    which the main job does not repeat): each one's measured cost by label, and a line per
    mode (its rewards and losses against the pool's, step by step, or why it did not run)."""
    costs, notes = {}, []
    tp = tensor_parallel_degrees(specs, len(workers))
    fits = sampling_fits(
        specs, budget_bytes(dask.config.get("plexrl.worker.memory-budget")), groups
    )
    for mode in ("colocated", "split", "split-async"):
        offered = layouts(mode, len(workers), groups.values(), tp, fits)
        if not offered:
            widest = max(groups, key=groups.get)
            notes.append(
                f"{mode}: no layout fits on {len(workers)} workers ({widest} trains on "
                f"{groups[widest]}, and a split job holds its rollout workers too)"
            )
            continue
        layout = offered[0]
        totals = [(s.name, s.grpo.steps) for s in specs]
        with JobProgress(totals, console) as progress:
            run = run_mode(
                runtime,
                specs,
                layout,
                checkpoints,
                workers,
                metrics_dir=out,
                on_step=lambda r, m=mode: progress.update(
                    r.job, r.step + 1, f"{m} reward {r.reward_mean:.3f}"
                ),
                groups=groups,
            )
        costs[f"{layout.label} (measured)"] = run.ledger.reserved_worker_seconds()
        if mode != "split-async":  # (a step ahead: other samples, by design)
            same, _ = trajectories_identical([pool, run], [s.name for s in specs])
            notes.append(
                f"{mode}: every job's reward and loss, step by step, "
                + ("the same as in the pool" if same else "NOT the same as in the pool")
            )
    return costs, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=positive_int, default=4)
    parser.add_argument(
        "--agentic",
        type=nonnegative_int,
        default=1,
        choices=(0, 1, 2),
        help="agentic jobs beside them: multiply3 (the calculator), and with 2 program (the "
        "Python sandbox); their tool calls run on a tool worker of the local cluster",
    )
    parser.add_argument(
        "--scale", type=positive_float, default=1.0, help="multiplies warm-up and GRPO steps"
    )
    parser.add_argument(
        "--grpo-steps", type=positive_int, default=None, help="GRPO steps of every job"
    )
    parser.add_argument(
        "--rollout-replicas",
        type=nonnegative_int,
        default=None,
        help="rollout replicas per job in the pool (default 0, each job sampling from its "
        "policy: the cheaper pool in bench.multiplex; 1 with --rollout-backend vllm)",
    )
    parser.add_argument("--workers", type=positive_int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default="runs/multiplex")
    parser.add_argument(
        "--memory-budget",
        default=STANDARD_BUDGET,
        help="each worker's memory budget: it decides each job's smallest training group "
        f"(default {STANDARD_BUDGET}, where countdown4 trains on 2 workers; 'auto': the device's)",
    )
    parser.add_argument(
        "--model", default=None, help="a local Hugging Face checkpoint for every job"
    )
    parser.add_argument(
        "--checkpoint-every", type=positive_int, default=None, help="GRPO steps between checkpoints"
    )
    parser.add_argument("--fresh", action="store_true", help="ignore checkpoints: start over")
    parser.add_argument(
        "--compare",
        choices=("isolated", "none"),
        default="isolated",
        help="after the pool, run the same jobs from the same warm-ups alone, one after "
        "another, in each isolated mode's smallest layout that fits on --workers (colocated on "
        "each job's training group; split and split-async), and give the pool's cost against "
        "each as measured (default); none: against lower bounds estimated from the pool's run",
    )
    parser.add_argument(
        "--rollout-backend",
        choices=("torch", "vllm"),
        default="torch",
        help="the rollout replicas' engine (vllm: CUDA workers with the vllm package)",
    )
    slurm = parser.add_argument_group("on SLURM (dask-jobqueue), instead of a local cluster")
    slurm.add_argument(
        "--slurm",
        type=positive_int,
        default=None,
        metavar="GPUS",
        help="submit jobs for GPUS GPUs in all, one PlexRL worker per GPU",
    )
    slurm.add_argument(
        "--slurm-gpus-per-job",
        type=positive_int,
        default=1,
        help="GPUs (and workers) per job; GPUS must be a multiple",
    )
    slurm.add_argument("--slurm-cores", type=positive_int, default=8)
    slurm.add_argument("--slurm-memory", default="64GB")
    slurm.add_argument("--slurm-walltime", default="04:00:00")
    slurm.add_argument("--slurm-queue", default=None)
    slurm.add_argument("--slurm-account", default=None)
    slurm.add_argument(
        "--slurm-scheduler-host",
        default=None,
        help="the address the jobs reach the scheduler at (default: dask-jobqueue's choice)",
    )
    slurm.add_argument(
        "--slurm-wait",
        type=positive_float,
        default=3600.0,
        help="seconds to wait for the jobs to start",
    )
    slurm.add_argument(
        "--slurm-shared-dir",
        default=None,
        help="where the workers' copy of the cluster's TLS certificate goes: a directory the "
        "jobs' nodes see at the same path (default: your home)",
    )
    slurm.add_argument("--dry-run", action="store_true", help="print the job script and stop")
    running = parser.add_argument_group(
        "on a running PlexRL cluster (Kubernetes, dask scheduler --preload), instead of a local one"
    )
    running.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="its scheduler; the pool is --workers of its GPU workers",
    )
    running.add_argument(
        "--scheduler-wait",
        type=positive_float,
        default=600.0,
        help="seconds to wait for --workers workers to join it",
    )
    args = parser.parse_args()  # fmt: skip
    if args.dry_run and not args.slurm:
        parser.error("--dry-run prints the SLURM job script: give --slurm GPUS")
    if args.slurm and args.scheduler:
        parser.error("--slurm starts a cluster, --scheduler joins one: give one of them")
    if args.slurm and args.slurm % args.slurm_gpus_per_job:
        parser.error("--slurm GPUS must be a multiple of --slurm-gpus-per-job")
    if args.rollout_backend == "vllm":
        if args.rollout_replicas == 0:
            parser.error("--rollout-backend vllm needs --rollout-replicas >= 1")
        # each vLLM replica runs its engine in a child process of its worker
        dask.config.set({"distributed.worker.daemon": False})
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = out / "checkpoints"
    if args.fresh:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    specs = standard_jobs(args.jobs, scale=args.scale)
    specs += agentic_jobs(scale=args.scale)[: args.agentic]
    if args.grpo_steps:
        specs = [replace(s, grpo=replace(s.grpo, steps=args.grpo_steps)) for s in specs]
    if args.model:
        specs = [replace(s, model=plexrl.ModelSpec(path=args.model)) for s in specs]
    specs = [replace(s, rollout_backend=args.rollout_backend) for s in specs]
    if args.slurm:
        args.workers = args.slurm  # the pool: one worker per GPU job
    if args.rollout_replicas is None:
        args.rollout_replicas = 1 if args.rollout_backend == "vllm" else 0
    layout = Layout("multiplexed", args.workers, args.rollout_replicas)
    dask.config.set({"plexrl.worker.memory-budget": args.memory_budget})
    try:
        groups = smallest_groups(specs, budget_bytes(args.memory_budget), args.workers)
    except plexrl.errors.ConfigError as e:
        raise SystemExit(str(e)) from None
    if not sampling_fits(specs, budget_bytes(args.memory_budget), groups)(layout):
        raise SystemExit(f"the jobs' sampling does not fit {layout.label} at {args.memory_budget}")
    resumed = resumable(checkpoint_dir, layout.mode, specs)
    if resumed:
        console.print(f"resuming {', '.join(resumed)} from {checkpoint_dir} (--fresh starts over)")
    (out / "run.json").write_text(
        json.dumps({"layout": layout.label, "jobs": [s.describe() for s in specs]}, indent=2)
    )

    if args.slurm:
        site = {
            "cores": args.slurm_cores,
            "memory": args.slurm_memory,
            "walltime": args.slurm_walltime,
            **({"queue": args.slurm_queue} if args.slurm_queue else {}),
            **({"account": args.slurm_account} if args.slurm_account else {}),
        }
        if args.slurm_scheduler_host:
            site["scheduler_options"] = {"host": args.slurm_scheduler_host}
        if args.slurm_shared_dir:
            site["shared_temp_directory"] = args.slurm_shared_dir
        cluster_cm = plexrl.slurm_cluster(
            args.slurm,
            args.rollout_backend,
            submit=not args.dry_run,
            gpus_per_job=args.slurm_gpus_per_job,
            **site,
        )
    elif args.scheduler:
        # (a tls:// scheduler: the client's certificates come from Dask's config, e.g.
        # DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT; a vLLM rollout needs workers started with
        # distributed.worker.daemon false)
        cluster_cm = contextlib.nullcontext(args.scheduler)
    else:
        # (tool calls run off the pool's workers; on a cluster without tool workers, on the
        # driver)
        cluster_cm = plexrl.local_cluster(
            n_workers=args.workers, tool_workers=1 if args.agentic else 0
        )
    with cluster_cm as cluster, connect(cluster, args.scheduler_wait) as client:
        if args.dry_run:
            print(cluster.job_script())  # (plain: a console would wrap its long lines)
            return
        runtime = plexrl.Runtime(client, job="main")
        runtime.status()  # a cluster without the PlexRL plugins: PluginsNotInstalled, now
        if args.slurm:  # (jobs that pend or workers without plugins: a typed error says so)
            from plexrl_dask.slurm import wait_for_plexrl_workers

            wait_for_plexrl_workers(client, args.workers, args.slurm_wait, cluster)
        workers = gpu_workers(client, args.workers, args.scheduler_wait if args.scheduler else None)
        console.print(f"cluster: {args.workers} workers, dashboard {client.dashboard_link}")
        totals = [(s.name, s.warmup_steps + s.grpo.steps) for s in specs]
        # (bars on a terminal; written to a file, a line per job every few seconds)
        with JobProgress(totals, console) as progress:

            def warmed(job: str, step: int, loss: float) -> None:
                progress.update(job, step, f"warm-up loss {loss:.3f}")

            warm = {s.name: s.warmup_steps for s in specs}
            for name, saved in resumed.items():
                progress.update(
                    name,
                    warm[name] + saved.steps_done,
                    f"resumed after {saved.steps_done} GRPO steps",
                )
            # (a resumed job starts from its own checkpoint, which run_mode loads: no warm-up)
            fresh = [s for s in specs if s.name not in resumed]
            checkpoints = warm_start(runtime, fresh, out / "warmup", on_progress=warmed)

            def stepped(r) -> None:
                progress.update(r.job, warm[r.job] + r.step + 1, f"GRPO reward {r.reward_mean:.3f}")

            t0 = time.perf_counter()
            run = run_mode(
                runtime,
                specs,
                layout,
                checkpoints,
                workers,
                metrics_dir=out,
                on_step=stepped,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=args.checkpoint_every,
                groups=groups,
            )
        console.print(f"GRPO: {len(specs)} jobs multiplexed in {time.perf_counter() - t0:.0f}s")
        baselines, notes = {}, []
        if args.compare == "isolated" and resumed:
            notes.append("no isolated runs to compare with: jobs resumed (--fresh runs them)")
        elif args.compare == "isolated":
            baselines, notes = isolated_runs(
                runtime, specs, checkpoints, workers, groups, run, out, console
            )

    ledger = run.ledger
    if args.compare == "none" or not baselines:
        # (each job alone on its training group; split: and a rollout worker)
        baselines = {"isolated colocated, at least": ledger.isolated_cost_lower_bound(groups)}
        if max(groups.values()) < args.workers:
            baselines["isolated split, at least"] = ledger.isolated_cost_lower_bound(
                {job: k + 1 for job, k in groups.items()}
            )
    console.print(
        summary_table(run.records, ledger, isolated_estimates=baselines, title=layout.label)
    )
    for note in notes:
        console.print(note)
    png = out / "multiplex.png"
    plot_run(run.records, ledger, png)
    console.print(
        f"reward curves and worker timeline: {png}; per-step metrics: {out}/multiplexed-<job>.jsonl"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # every job stopped before its next step
        Console().print("stopped: the same command resumes every job from its last checkpoint")
        raise SystemExit(130) from None
    except plexrl.errors.PluginsNotInstalled as e:  # --scheduler: a cluster without PlexRL
        raise SystemExit(f"{type(e).__name__}: {e}") from None
