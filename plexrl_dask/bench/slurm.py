"""Check: PlexRL on a real SLURM cluster (``tools/slurm-local``: slurmctld and one slurmd per
node, all on this machine), through dask-jobqueue, with a node lost by preemption.

In one run:

1. ``slurm_cluster(2)`` submits two worker jobs (``--gres=gpu:1`` each); the time from entering
   it to the first PlexRL worker reporting its holder is ``time_to_first_worker_s``;
   ``workers_joined`` counts those reporting, ``worker_nodes`` their nodes, which must be the
   nodes SLURM reports (``nodes_match_slurm``: node groups come from SLURM's nodes).
2. Two GRPO jobs multiplexed on those workers (:func:`two_jobs`); the same two on a
   ``local_cluster`` of two workers: ``records_equal_local`` is whether every step's reward,
   completion lengths, loss and version are equal.
3. The same two jobs again with checkpoints every 2 steps; after step ``steps // 2`` (counted
   from 0) of job ``a`` the
   SLURM job of the worker holding ``a``'s policy is cancelled (``scancel``, as a shared
   cluster preempts). The runtime re-places what it can on the remaining worker, the jobs
   that lost state go back to their checkpoints, and ``preempted_job_recovered_exact`` is
   whether job ``a`` went back (``recoveries``) and both jobs' records equal the uninterrupted
   run's (``steps_trained``: the steps, of both jobs, whose loss was computed). Then a job submitted later adds a
   worker (``scaled_up_worker_used``: a new job's policy sharded over every worker there is
   gets a group that includes it).

``jobs_submitted`` counts the SLURM jobs this run submitted. ``slurm_version`` is ``sinfo
--version``. Where SLURM is not there, nothing runs and the JSON says why (``skipped``).

Run: ``tools/slurm-local start && eval $(tools/slurm-local env)`` then
``python -m plexrl_dask.bench.slurm --quick --json OUT`` (about a minute).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import slurm
from plexrl_dask.bench.common import parser, report
from plexrl_dask.rl import (
    GRPOConfig,
    GRPOJob,
    JobCheckpoints,
    StepRecord,
    run_jobs,
    supervised_warmup,
)
from plexrl_dask.shared.types import AdamWParams
from plexrl_dask.tasks import ArithmeticTask

logger = logging.getLogger("plexrl_dask.bench.slurm")

TARGETS = {
    "records_equal_local": "true",
    "preempted_job_recovered_exact": "true",
    "nodes_match_slurm": "true",
    "scaled_up_worker_used": "true",
}
JOBS = ("a", "b")
#: Supervised steps before GRPO (single-digit sums: about 10 % right after 60 steps).
WARMUP_STEPS = 60
#: How long the workers of submitted jobs may take to report (a loaded 2-core machine).
WORKER_WAIT_S = 120.0


def config(steps: int) -> GRPOConfig:
    """The jobs' GRPO settings: small and quick, every step trains."""
    return GRPOConfig(steps=steps, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, seed=5)


def _spec(job: str) -> plexrl.ModelSpec:
    return plexrl.ModelSpec.tiny(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=JOBS.index(job) + 61
    )


Comparable = list[tuple[int, float, list[int], float | None, int]]


def comparable(records: list[StepRecord]) -> Comparable:
    """What must be equal across clusters and runs: per step, reward, lengths, loss, version."""
    return [(r.step, r.reward_mean, r.completion_lengths, r.loss, r.version) for r in records]


def two_jobs(
    client: Client,
    steps: int,
    tag: str,
    checkpoints: Path | None = None,
    on_step: Callable[[GRPOJob, StepRecord], None] | None = None,
) -> tuple[dict[str, Comparable], dict[str, GRPOJob]]:
    """Jobs ``a`` and ``b`` (each its own runtime and policy, sampling from it; each policy
    warmed up for :data:`WARMUP_STEPS`) multiplexed on ``client``'s workers for ``steps`` steps, checkpointing every 2 steps under
    ``checkpoints`` if given; ``on_step(job, record)`` after each step. Returns each job's
    comparable records and the jobs; their deployments are undeployed."""
    jobs: dict[str, GRPOJob] = {}
    runtimes = {}
    try:
        for name in JOBS:
            runtime = runtimes[name] = plexrl.Runtime(client, job=f"slurm-{name}")
            policy = runtime.deploy(f"{tag}-{name}", _spec(name))
            task = ArithmeticTask(digits=1, seed=JOBS.index(name))
            # a short supervised warm-up: rewards that vary within groups, so every step trains
            supervised_warmup(policy, task, WARMUP_STEPS, optim=AdamWParams(lr=1e-2))
            ck = None if checkpoints is None else JobCheckpoints.at(checkpoints / name, every=2)
            jobs[name] = GRPOJob(name, runtime, task, policy, config(steps), checkpoints=ck)
        hook = None if on_step is None else (lambda r: on_step(jobs[r.job], r))
        records = run_jobs(list(jobs.values()), hook)
        return {name: comparable(records[name]) for name in JOBS}, jobs
    finally:
        for runtime in runtimes.values():
            for d in runtime.deployments():
                if d.owner == runtime.job:
                    runtime.undeploy(d.name)


def preempt_after(
    cluster: Any, client: Client, job: str, step: int
) -> tuple[Callable[[GRPOJob, StepRecord], None], list[str]]:
    """An ``on_step`` hook for :func:`two_jobs` that, after ``job``'s step ``step``, cancels
    the SLURM job of the worker holding ``job``'s policy; the list gets that SLURM job's id."""
    cancelled: list[str] = []

    def hook(grpo: GRPOJob, record: StepRecord) -> None:
        if record.job == job and record.step == step and not cancelled:
            worker = grpo.runtime.deployment(grpo.policy.name).info.workers[0]
            cancelled.append(slurm.job_of_worker(cluster, client, worker))
            slurm.cancel(cancelled[0])
            # the job's next step starts once the worker is gone, not while it shuts down
            deadline = time.monotonic() + WORKER_WAIT_S
            while worker in plexrl.worker_info(client):
                if time.monotonic() > deadline:
                    raise slurm.WorkersNotStarted(f"{worker} still there after scancel")
                time.sleep(0.1)

    return hook, cancelled


def submit_one_more(cluster: Any) -> None:
    """Submit one more worker job (the cancelled ones still count in the cluster's spec)."""
    cluster.scale(jobs=len(cluster.worker_spec) + 1)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=None, help="GRPO steps per job (default 6, quick 4)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    steps = args.steps or (4 if args.quick else 6)
    problem = slurm.environment_problem()
    cfg: dict[str, Any] = {"steps": steps, "jobs": list(JOBS), "worker_wait_s": WORKER_WAIT_S}
    if problem is not None:
        report("slurm", {"skipped": problem}, TARGETS, cfg, args.json)
        return
    results: dict[str, Any] = {"slurm_version": slurm.slurm_version()}
    with tempfile.TemporaryDirectory(prefix="plexrl-bench-slurm-") as tmp:
        t0 = time.monotonic()
        with (
            slurm.slurm_cluster(2, **slurm.one_machine_site(tmp)) as cluster,
            Client(cluster) as client,
        ):
            slurm.wait_for_plexrl_workers(client, 1, WORKER_WAIT_S, cluster)
            results["time_to_first_worker_s"] = round(time.monotonic() - t0, 2)
            reports = slurm.wait_for_plexrl_workers(client, 2, WORKER_WAIT_S, cluster)
            results["workers_joined"] = len(reports)
            results["worker_nodes"] = sorted(r["node"] for r in reports.values())
            results["nodes_match_slurm"] = results["worker_nodes"] == slurm.slurm_nodes()
            on_slurm, _ = two_jobs(client, steps, "whole")
            hook, cancelled = preempt_after(cluster, client, "a", steps // 2)
            recovered, jobs = two_jobs(client, steps, "preempted", Path(tmp) / "ck", hook)
            results["preempted_slurm_job"] = cancelled[0] if cancelled else None
            results["recoveries"] = {n: list(j.recoveries) for n, j in jobs.items()}
            results["steps_trained"] = sum(r[3] is not None for rs in on_slurm.values() for r in rs)
            results["preempted_job_recovered_exact"] = (
                bool(cancelled) and bool(jobs["a"].recoveries) and recovered == on_slurm
            )
            results["scaled_up_worker_used"] = scaled_up_worker_used(cluster, client)
            results["jobs_submitted"] = len(cluster.worker_spec)
        with plexrl.local_cluster(n_workers=2) as local, Client(local) as client:
            on_local, _ = two_jobs(client, steps, "local")
        results["records_equal_local"] = on_local == on_slurm
    report("slurm", results, TARGETS, cfg, args.json)


def scaled_up_worker_used(cluster: Any, client: Client) -> bool:
    """Submit one more worker job, wait for its worker, and deploy a new job's policy sharded
    over every worker there is: the placer gives it a group that includes the new one."""
    before = set(slurm.wait_for_plexrl_workers(client, 1, WORKER_WAIT_S))
    submit_one_more(cluster)
    reports = slurm.wait_for_plexrl_workers(client, len(before) + 1, WORKER_WAIT_S, cluster)
    new = set(reports) - before
    runtime = plexrl.Runtime(client, job="slurm-late")
    policy = runtime.deploy("late-policy", _spec("a"), world_size=len(reports))
    try:
        return bool(new) and new <= set(policy.info.workers)
    finally:
        runtime.undeploy(policy.name)


if __name__ == "__main__":
    main()
