"""A policy study on one workload: every policy on the same jobs, capacity by bisection, plots.

Shared by ``python -m plexrl_dask.bench.simulate`` and ``plexrl simulate``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from plexrl_dask.policy.spatiotemporal import PlacementConfig
from plexrl_dask.sim.simulator import SimOutcome, simulate
from plexrl_dask.sim.workload import WorkloadSpec, generate

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
