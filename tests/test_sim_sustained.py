"""The simulator's extended measures (issue 40): saturation throughput from the iterations each
policy completes, the tool-latency sweep's derived workloads, and the RollMux-style groups'
remembered cycle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from plexrl_dask.errors import InvalidTrace
from plexrl_dask.policy.spatiotemporal import PlacementConfig
from plexrl_dask.sim.isolated import isolated_run, iteration_times
from plexrl_dask.sim.rollmux import RollMuxSim
from plexrl_dask.sim.simulator import JobOutcome, SimOutcome, simulate
from plexrl_dask.sim.study import iteration_work, sustained, sustained_rate, tool_wait_share
from plexrl_dask.sim.workload import WORKLOADS, Dist, WorkloadSpec, generate

SMALL = PlacementConfig(slots=32, group_nodes=2)


def small(name: str, gpus: int = 64, jobs: int = 12) -> WorkloadSpec:
    """A committed mix on a small cluster, with short jobs (the test's budget)."""
    d = yaml.safe_load((WORKLOADS / f"{name}.yaml").read_text())
    d["iterations"] = {"dist": "uniform", "low": 4, "high": 8}
    d["cluster"]["gpus"] = 1024  # resolve rollout_gpus: auto as on a large cluster, then scale
    return WorkloadSpec.from_dict(d, base=WORKLOADS).scaled(gpus, jobs)


def outcome(jobs: list[JobOutcome], ends: dict[str, list[float]]) -> SimOutcome:
    return SimOutcome("test", jobs, 0.0, 0.0, 0, 0, 0.0, np.zeros((1, 1)), iteration_ends=ends)


def test_sustained_rate_credits_the_iterations_completed_in_its_window():
    # five jobs of two iterations each, completing at 10, 20, 30, 40, 50; the last starts at 35
    starts = [0.0, 5.0, 10.0, 15.0, 35.0]
    jobs = [JobOutcome(f"j{k}", 0.0, s, 10.0 * (k + 1), 0.0, 1.0) for k, s in enumerate(starts)]
    ends = {f"j{k}": [10.0 * (k + 1) - 6, 10.0 * (k + 1)] for k in range(5)}
    work = {f"j{k}": np.array([100.0, 1.0]) for k in range(5)}
    got = sustained_rate(outcome(jobs, ends), work, gpus=2, window=(0.2, 0.6))
    # window: the 1st completion (t = 10) to the 3rd (t = 30); iterations ending in (10, 30]:
    # j1's (14, 20) and j2's (24, 30); j0's end at 10 is not in it, j3's first (34) is after
    assert (got.t0_s, got.t1_s) == (10.0, 30.0)
    assert got.load == pytest.approx((101.0 + 101.0) / (2 * 20.0))
    assert got.queued_at_end == 1  # j4, not started by t = 30
    with pytest.raises(ValueError):
        sustained_rate(outcome(jobs, ends), work, gpus=2, window=(0.2, 0.2))


def test_every_engine_records_when_each_iteration_completed():
    spec = small("paper2048-agentic", gpus=128, jobs=10)
    jobs = generate(spec, 1)
    for policy in ("isolated", "split-async", "rollmux", "spread+backfill"):
        o = simulate(jobs, spec.cluster, policy, SMALL)
        assert o.iteration_ends.keys() == {j.name for j in jobs}, policy
        for j in o.jobs:
            ends = o.iteration_ends[j.name]
            n = next(x.iterations for x in jobs if x.name == j.name)
            assert len(ends) == n, (policy, j.name)
            assert all(b >= a for a, b in zip(ends, ends[1:], strict=False)), policy
            assert j.start_s < ends[0] and ends[-1] == pytest.approx(j.end_s), policy


def test_iteration_work_sums_to_the_offered_cost():
    spec = small("paper2048-agentic", jobs=8)
    for j in generate(spec, 0):
        best = isolated_run(j, "best", spec.cluster)
        w = iteration_work(j, spec.cluster)
        assert len(w) == j.iterations
        assert w.sum() == pytest.approx(best.gpu_seconds)


def test_sustained_throughput_of_a_never_empty_queue():
    spec = small("paper2048-backlog", gpus=64)
    for policy in ("isolated", "spread+backfill"):
        got, o = sustained(spec, policy, 40, 0, SMALL)
        assert o.double_bookings == 0 and all(j.arrival_s == 0 for j in o.jobs)
        assert 0 < got.t0_s < got.t1_s
        assert got.queued_at_end > 0, policy  # jobs still waited: the queue never emptied
        if policy == "isolated":
            # private allocations at each job's cheapest cost: never more than every GPU
            # busy, bar the part of the iterations in progress at the window's start
            assert 0.3 < got.load <= 1.05


def test_a_tool_latency_factor_scales_only_the_tool_waits():
    spec = small("paper2048-agentic", jobs=20)
    base = generate(spec.batch(), 0)
    assert [j.name for j in generate(spec.with_tool_latency(1.0), 0)] == [j.name for j in base]
    doubled = generate(spec.with_tool_latency(2.0).batch(), 0)
    agentic = 0
    for a, b in zip(base, doubled, strict=True):
        assert a.name == b.name
        for field in ("bulk", "tail", "train"):
            assert np.array_equal(getattr(a, field), getattr(b, field))
        if a.stall is None:
            assert b.stall is None
            continue
        agentic += 1
        assert np.array_equal(b.stall, 2.0 * a.stall)  # a power of two: exact
    assert agentic > 0
    # arrivals still offer the committed load at the jobs' new costs: the same draws, spread
    # by the ratio of the mean costs
    poisson = generate(spec, 0), generate(spec.with_tool_latency(2.0), 0)
    cost = [np.mean([isolated_run(j, "best", spec.cluster).gpu_seconds for j in js])
            for js in poisson]  # fmt: skip
    for a, b in zip(*poisson, strict=True):
        assert b.arrival_s == pytest.approx(a.arrival_s * cost[1] / cost[0], rel=1e-9)
    share = [tool_wait_share(generate(spec.with_tool_latency(f), 0), spec.cluster)
             for f in (0.5, 1.0, 2.0)]  # fmt: skip
    assert 0 < share[0] < share[1] < share[2] < 1
    assert tool_wait_share([j for j in base if j.stall is None], spec.cluster) == 0.0


def test_a_scaled_distribution_scales_every_sample():
    rng = lambda: np.random.default_rng(7)  # noqa: E731
    for d in (Dist("lognormal", 4.0, 1.0), Dist("uniform", 1.0, 3.0), Dist("fixed", 2.0)):
        assert np.allclose(d.scaled(4.0).sample(rng(), 50), 4.0 * d.sample(rng(), 50))
        assert d.scaled(0.5).mean() == pytest.approx(0.5 * d.mean())
    with pytest.raises(InvalidTrace):
        Dist("fixed", 1.0).scaled(0.0)


def test_rollmux_groups_remember_their_cycle_until_members_change():
    spec = small("paper2048-backlog", gpus=64, jobs=6)
    jobs = generate(spec, 0)
    sim = RollMuxSim(jobs, spec.cluster, 1.5)
    ms = sim.runs

    def direct(members: list[int], extra: int) -> tuple[float, float]:
        group = [ms[i] for i in members] + [ms[extra]]
        cycle = max(sum(m.roll_mean for m in group), sum(m.train_mean for m in group),
                    max(m.roll_mean + m.train_mean for m in group))  # fmt: skip
        return cycle, min(m.roll_mean + m.train_mean for m in group)

    g = sim._form(ms[0], 0.0)
    assert g is not None
    g.join(0)
    assert g.cycle(ms, ms[1]) == direct([0], 1)
    g.join(1)
    assert g.cycle(ms, ms[2]) == direct([0, 1], 2)
    g.leave(0)
    assert g.cycle(ms, ms[3]) == direct([1], 3)
    assert sim.n_free == spec.cluster.gpus - len(g.pools["rollout"]) - len(g.pools["train"])


def test_the_isolated_baseline_credits_its_iterations_in_order():
    spec = small("paper2048-agentic", gpus=64, jobs=4)
    jobs = generate(spec, 0)
    o = simulate(jobs, spec.cluster, "colocated")
    for j, out in zip(sorted(jobs, key=lambda x: x.name), o.jobs, strict=True):
        its = iteration_times(j, "colocated", spec.cluster)
        assert np.allclose(np.diff([out.start_s, *o.iteration_ends[j.name]]), its)
        assert math.isclose(o.iteration_ends[j.name][-1], out.end_s, rel_tol=1e-12)


def test_the_benchmarks_sweep_and_sustained_keys(tmp_path):
    from argparse import Namespace

    from plexrl_dask.bench.simulate import SHORT, sustained_keys, tool_sweep_keys
    from plexrl_dask.sim.study import compare

    spec = small("paper2048-agentic", gpus=128, jobs=10)
    args = Namespace(seed=0, sustained_jobs=30)
    ones = {n: o.summary() for n, o in compare(spec, SHORT, 0, SMALL, progress=False).items()}
    known = tool_sweep_keys(spec, [1.0, 2.0], args, SMALL, {1.0: ones})
    fresh = tool_sweep_keys(spec, [1.0], args, SMALL, {})
    # the agentic study's own runs stand for factor 1: the same as running it again
    for k, v in fresh.items():
        if not k.endswith("gpu_double_bookings"):
            assert known[k] == v, k
    assert known["tool_latency_x2.tool_wait_share"] > known["tool_latency_x1.tool_wait_share"]
    assert known["tool_latency_x2.gpu_double_bookings"] == 0
    from plexrl_dask.sim.plots import plot_tool_sweep

    points = {f: {k.removeprefix(f"tool_latency_x{f:g}."): v for k, v in known.items()
                  if k.startswith(f"tool_latency_x{f:g}.")} for f in (1.0, 2.0)}  # fmt: skip
    png = plot_tool_sweep(points, tmp_path / "sweep.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    got = sustained_keys(spec, ("isolated", "colocated", "rollmux", "spread+backfill"), args,
                         SMALL)  # fmt: skip
    assert got["sustained_gpu_double_bookings"] == 0
    assert got["sustained_capacity_multiplier_vs_colocated"] == pytest.approx(
        got["sustained_load.spread+backfill"] / got["sustained_load.colocated"]
    )
    for name in ("isolated", "rollmux", "spread+backfill"):
        t0, t1 = got[f"sustained_window_h.{name}"]
        assert 0 < t0 < t1 and got[f"sustained_load.{name}"] > 0
