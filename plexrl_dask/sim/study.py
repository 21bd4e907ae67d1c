"""A policy study on one workload: every policy on the same jobs, capacity by bisection,
sustained throughput (the completed-work rate of a never-empty queue), plots.

Shared by ``python -m plexrl_dask.bench.simulate`` and ``plexrl simulate``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from plexrl_dask.policy.spatiotemporal import PlacementConfig
from plexrl_dask.sim.simulator import SimOutcome, simulate
from plexrl_dask.sim.workload import ClusterSpec, SimJob, WorkloadSpec, generate

logger = logging.getLogger(__name__)


def compare(
    spec: WorkloadSpec,
    policies: Sequence[str],
    seed: int = 0,
    placement: PlacementConfig | None = None,
    progress: bool = True,
) -> dict[str, SimOutcome]:
    """Each policy on the same generated jobs (``spec`` and ``seed``)."""
    jobs = generate(spec, seed)
    out = {}
    for policy in tqdm(policies, desc="policies", disable=not progress):
        out[policy] = simulate(jobs, spec.cluster, policy, placement, progress=progress)
        logger.info("%s: %s", policy, out[policy].summary())
    return out


def sustains(
    spec: WorkloadSpec,
    policy: str,
    load: float,
    slowdown_target: float,
    seed: int,
    placement: PlacementConfig | None,
) -> tuple[bool, float]:
    """Whether ``policy`` keeps the mean job slowdown within ``slowdown_target`` when jobs
    arrive offering ``load`` (and the mean slowdown it got)."""
    jobs = generate(spec.with_load(load), seed)
    slowdown = simulate(jobs, spec.cluster, policy, placement).summary()["mean_slowdown"]
    return slowdown <= slowdown_target, slowdown


def capacity(
    spec: WorkloadSpec,
    policy: str,
    slowdown_target: float,
    seed: int = 0,
    placement: PlacementConfig | None = None,
    lo: float = 0.25,
    hi: float = 4.0,
    steps: int = 6,
) -> float:
    """The highest offered load (arrival rate, in ``spec``'s offered-load units) that
    ``policy`` sustains with mean job slowdown within ``slowdown_target``: bisection in log
    space over ``[lo, hi]`` (``steps`` simulations; resolution ``(hi / lo) ** 2**-steps``).
    Returns the highest load found sustained, ``lo`` if none was (the bounds are not tested:
    a result at either bound says the bracket was too narrow)."""
    best = lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(steps):
        mid = (a + b) / 2
        ok, got = sustains(spec, policy, math.exp(mid), slowdown_target, seed, placement)
        logger.info("%s at load %.3f: mean slowdown %.2f", policy, math.exp(mid), got)
        if ok:
            best, a = math.exp(mid), mid
        else:
            b = mid
    return best


@dataclass(frozen=True)
class Sustained:
    """A policy's saturation throughput (:func:`sustained`): ``load`` in offered-load units
    over the window ``[t0_s, t1_s]``, and ``queued_at_end``, the jobs not yet started at
    ``t1_s`` (above 0: the queue never emptied in the window)."""

    load: float
    t0_s: float
    t1_s: float
    queued_at_end: int


def sustained_rate(outcome: SimOutcome, work: dict[str, np.ndarray], gpus: int,
                   window: tuple[float, float] = (0.2, 0.6)) -> Sustained:  # fmt: skip
    """The completed-work rate of ``outcome`` (a run of jobs all submitted at once) between
    its ``ceil(window[0] * N)``-th and ``ceil(window[1] * N)``-th job completions: the
    ``work`` of every iteration completed in that window (``work[name][i]``: job ``name``'s
    iteration ``i``; ``outcome.iteration_ends`` says when each completed) ÷ (``gpus`` × the
    window's length). Crediting iterations, not whole jobs, keeps the work of jobs running
    across either end out of the window. The first completions are warm-up (the jobs
    running then started together on an empty cluster); ``queued_at_end`` counts the jobs
    still waiting to start when the window ends."""
    done = sorted(outcome.jobs, key=lambda j: (j.end_s, j.name))
    n = len(done)
    k0, k1 = math.ceil(window[0] * n), math.ceil(window[1] * n)
    if not 1 <= k0 < k1 <= n:
        raise ValueError(f"window {window} of {n} completions is empty")
    t0, t1 = done[k0 - 1].end_s, done[k1 - 1].end_s
    if not t1 > t0:
        raise ValueError(f"completions {k0} and {k1} end together (at {t0} s)")
    credited = 0.0
    for name, ends in outcome.iteration_ends.items():
        at = np.asarray(ends)
        credited += float(work[name][(at > t0) & (at <= t1)].sum())
    queued = sum(1 for j in outcome.jobs if j.start_s > t1)
    return Sustained(credited / (gpus * (t1 - t0)), t0, t1, queued)


def iteration_work(job: SimJob, cluster: ClusterSpec) -> np.ndarray:
    """GPU-seconds of each of ``job``'s iterations in its cheapest isolated mode (they sum
    to the cost the offered load counts it at)."""
    from plexrl_dask.sim.isolated import isolated_run, iteration_times

    best = isolated_run(job, "best", cluster)
    return best.gpus * iteration_times(job, best.mode, cluster)


def sustained(
    spec: WorkloadSpec,
    policy: str,
    jobs: int,
    seed: int = 0,
    placement: PlacementConfig | None = None,
) -> tuple[Sustained, SimOutcome]:
    """``policy``'s saturation throughput on ``spec``'s mix: ``jobs`` jobs all submitted at
    time 0 on ``spec``'s cluster (the queue is never empty until the last one starts), the
    completed-work rate of :func:`sustained_rate`, work counted at each job's cheapest
    isolated GPU-seconds (the offered-load unit: 1.0 is every GPU busy at that cost)."""
    generated = generate(spec.scaled(spec.cluster.gpus, jobs).batch(), seed)
    work = {j.name: iteration_work(j, spec.cluster) for j in generated}
    outcome = simulate(generated, spec.cluster, policy, placement)
    return sustained_rate(outcome, work, spec.cluster.gpus), outcome


def tool_wait_share(jobs: Sequence[SimJob], cluster: ClusterSpec) -> float:
    """The agentic jobs' tool waits (on each step's critical path) ÷ their colocated run
    time: how much of such a job's private allocation its tools leave idle (0 without
    agentic jobs)."""
    from plexrl_dask.sim.isolated import iteration_times

    agentic = [j for j in jobs if j.stall is not None]
    if not agentic:
        return 0.0
    waits = sum(float(j.stall.sum()) for j in agentic)  # type: ignore[union-attr]
    return waits / sum(float(iteration_times(j, "colocated", cluster).sum()) for j in agentic)


def write_plots(outcomes: dict[str, SimOutcome], prefix: str | Path) -> list[Path]:
    """The study's figures, as ``<prefix>-policies.png``, ``-heatmap-<policy>.png`` (isolated
    and the best PlexRL policy) and ``-gantt.png``."""
    from plexrl_dask.sim.plots import plot_gantt, plot_heatmap, plot_policies

    prefix = str(prefix)
    paths = [plot_policies(list(outcomes.values()), f"{prefix}-policies.png")]
    for name in ("isolated", "spread+backfill"):
        if name in outcomes:
            safe = name.replace("+", "-")
            paths.append(plot_heatmap(outcomes[name], f"{prefix}-heatmap-{safe}.png"))
    with_gantt = [o for o in outcomes.values() if o.gantt]
    if with_gantt:
        shown = outcomes.get("spread+backfill", with_gantt[0])
        paths.append(plot_gantt(shown, f"{prefix}-gantt.png"))
    return paths
