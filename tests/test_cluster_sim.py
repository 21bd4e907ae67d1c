"""The trace-driven cluster simulator: workloads, every policy, determinism, no double booking,
and that the simulator's placement decisions are the policy core's own."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from plexrl_dask.cli import main as cli_main
from plexrl_dask.errors import InvalidTrace, JobDoesNotFit
from plexrl_dask.policy.horizon import Phase
from plexrl_dask.policy.spatiotemporal import NodeGroup, PlacementConfig, replay
from plexrl_dask.sim.isolated import isolated_run, iteration_times
from plexrl_dask.sim.multiplexed import _GroupRuntime, sim_nodes
from plexrl_dask.sim.simulator import POLICIES, GpuLedger, simulate
from plexrl_dask.sim.workload import (
    ClusterSpec,
    WorkloadSpec,
    generate,
    load_trace,
    save_trace,
)

SMALL = PlacementConfig(slots=32, group_nodes=2)


def small_spec(jobs: int = 24, gpus: int = 64, load: float = 2.0) -> WorkloadSpec:
    spec = WorkloadSpec.load("paper2048").scaled(gpus, jobs).with_load(load)
    # short jobs keep the test fast; the mix and durations are the committed workload's
    return WorkloadSpec.from_dict(
        {
            "name": "small",
            "cluster": {**spec.cluster.__dict__},
            "models": [
                {
                    "name": m.name, "params_b": m.params_b, "weight": m.weight,
                    "rollout_gpus": m.rollout_gpus, "train_gpus": m.train_gpus,
                    "rollout_bulk_s": {"dist": "lognormal", "median": m.bulk_s.a,
                                       "sigma": m.bulk_s.b},
                    "rollout_tail_s": {"dist": "lognormal", "median": m.tail_s.a,
                                       "sigma": m.tail_s.b},
                    "train_s": {"dist": "lognormal", "median": m.train_s.a, "sigma": m.train_s.b},
                }
                for m in spec.models
            ],
            "iterations": {"dist": "uniform", "low": 8, "high": 20},
            "jobs": jobs,
            "arrival": {"offered_load": load},
        }
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    spec = small_spec()
    jobs = generate(spec, seed=3)
    return spec, jobs, {p: simulate(jobs, spec.cluster, p, SMALL) for p in POLICIES}


def test_every_policy_runs_every_job_without_double_booking(runs):
    spec, jobs, outcomes = runs
    for policy, o in outcomes.items():
        assert len(o.jobs) == len(jobs), policy
        assert o.double_bookings == 0, policy
        assert all(j.end_s > j.start_s >= j.arrival_s for j in o.jobs), policy
        assert all(j.slowdown >= 1 - 1e-9 for j in o.jobs), policy
        assert o.busy_gpu_seconds <= o.held_gpu_seconds + 1e-6, policy
        s = o.summary()
        assert s["utilisation"] <= 1 + 1e-9 and s["makespan_h"] > 0
    # what each job is charged: PlexRL charges the GPUs its phases hold, which is never more
    # than a private allocation holds for the same work in split deployment
    split = sum(j.gpu_seconds for j in outcomes["split"].jobs)
    for p in ("spread", "spread+backfill", "pack+backfill"):
        assert sum(j.gpu_seconds for j in outcomes[p].jobs) < split
    # the isolated baseline takes each job's cheapest mode
    iso = {j.name: j.gpu_seconds for j in outcomes["isolated"].jobs}
    for m in ("colocated", "split", "split-async"):
        for j in outcomes[m].jobs:
            assert iso[j.name] <= j.gpu_seconds + 1e-6


def test_backfill_runs_waiting_jobs_best_effort(runs):
    """With Backfill, jobs the placer keeps waiting run iterations in groups' slack (as the
    live runtime runs them best effort); without it, none do. Either way every job runs each
    of its iterations once and no GPU is double-booked (checked above)."""
    _, _, outcomes = runs
    assert outcomes["spread"].best_effort_iterations == 0
    assert outcomes["spread+backfill"].best_effort_iterations > 0
    assert outcomes["spread+backfill"].summary()["best_effort_iterations"] > 0


def test_the_simulators_decisions_are_the_policy_cores(runs):
    spec, _, outcomes = runs
    for p in ("spread", "spread+backfill", "pack+backfill"):
        o = outcomes[p]
        kinds = {d["kind"] for d in o.decisions}
        assert {"profile", "place", "release"} <= kinds, p
        cfg = PlacementConfig(**{**SMALL.__dict__, "packing": p.split("+")[0]})
        again = [d.to_dict() for d in replay(sim_nodes(spec.cluster), cfg, o.inputs)]
        assert again == o.decisions, p


def test_deterministic_for_a_seed():
    spec = small_spec(jobs=10)
    a = simulate(generate(spec, 7), spec.cluster, "spread+backfill", SMALL)
    b = simulate(generate(spec, 7), spec.cluster, "spread+backfill", SMALL)
    c = simulate(generate(spec, 8), spec.cluster, "spread+backfill", SMALL)

    def strip(o):
        return {k: v for k, v in o.summary().items() if k not in ("sim_wall_s", "events_per_s")}

    assert strip(a) == strip(b) and a.decisions == b.decisions and a.gantt == b.gantt
    assert np.array_equal(a.heatmap, b.heatmap)
    assert strip(a) != strip(c)


def test_the_ledger_counts_a_double_booking():
    ledger = GpuLedger(ClusterSpec(gpus=16))
    ledger.take(0, np.array([0, 1, 2]))
    ledger.take(1, np.array([2, 3]))  # GPU 2 is held by job 0
    assert ledger.double_bookings == 1
    ledger.give(np.array([0, 1, 2]), 0.0, 7200.0)
    h = ledger.heatmap(7200.0)
    assert h.shape == (2, 2) and h[0, 0] == pytest.approx(3 / 8)


def test_isolated_modes_follow_their_definitions():
    spec = small_spec(jobs=1)
    [job] = generate(spec, 0)
    s = job.sync_s
    split = iteration_times(job, "split", spec.cluster)
    asyn = iteration_times(job, "split-async", spec.cluster)
    assert np.allclose(split, s + job.bulk + job.tail + job.train)
    assert np.allclose(asyn, np.maximum(s + job.bulk + job.tail, job.train))
    assert (asyn <= split).all()
    best = isolated_run(job, "best", spec.cluster)
    assert best.gpu_seconds == min(
        isolated_run(job, m, spec.cluster).gpu_seconds
        for m in ("colocated", "split", "split-async")
    )


def test_workload_spec_errors_are_typed(tmp_path):
    with pytest.raises(InvalidTrace, match="built in"):
        WorkloadSpec.load("no-such-workload")
    base = small_spec(jobs=2)
    d = {
        "name": "x",
        "cluster": {"gpus": 16},
        "models": [{"name": "m", "params_b": 1, "weight": 1, "rollout_gpus": 16,
                    "train_gpus": 8}],
        "iterations": 3,
        "jobs": 2,
        "arrival": {"offered_load": 1.0},
    }  # fmt: skip
    with pytest.raises(InvalidTrace, match="more than the cluster"):
        WorkloadSpec.from_dict(d)
    d["models"][0]["rollout_gpus"] = 8
    d["models"][0]["train_s"] = {"dist": "zipf"}
    with pytest.raises(InvalidTrace, match="unknown distribution"):
        WorkloadSpec.from_dict(d)
    with pytest.raises(InvalidTrace):
        ClusterSpec(gpus=12, gpus_per_node=8)
    with pytest.raises(InvalidTrace, match="unknown policy"):
        simulate(generate(base, 0), base.cluster, "round-robin")
    # What `plexrl simulate --gpus/--jobs/--offered-load` builds is validated too.
    paper = WorkloadSpec.load("paper2048")
    with pytest.raises(InvalidTrace, match="no job class .* fits 8 GPUs"):
        paper.scaled(8)
    with pytest.raises(InvalidTrace, match="gpus >= 1"):
        paper.scaled(0)
    with pytest.raises(InvalidTrace, match="jobs >= 1"):
        paper.scaled(64, jobs=0)
    for load in (0.0, -1.0, math.nan):
        with pytest.raises(InvalidTrace, match="offered_load"):
            paper.with_load(load)


@pytest.mark.parametrize(
    "path, value",
    [
        (("jobs",), "many"),
        (("jobs",), 2.5),
        (("iterations",), math.nan),
        (("iterations",), {"dist": "lognormal", "median": math.inf, "sigma": 0.1}),
        (("arrival", "offered_load"), "high"),
        (("arrival", "offered_load"), math.inf),
        (("cluster", "h2d_gbps"), math.nan),
        (("models", 0, "weight"), math.nan),
        (("models", 0, "params_b"), -7),
        (("models", 0, "rollout_gpus"), 4.5),
        (("models", 0, "rollout_bulk_s"), math.inf),
        (("models", 0, "tools"), {"turns": "x", "latency_s": 1.0}),
    ],
)
def test_a_workload_field_out_of_range_is_invalid_trace_at_parse(path, value):
    """Every field of a workload spec is checked where it is read: a NaN, an infinity, a
    string or a fraction where a count belongs is an InvalidTrace, never numpy's or a
    ZeroDivisionError later, nor a NaN result."""
    d = {
        "name": "x",
        "cluster": {"gpus": 16},
        "models": [{"name": "m", "params_b": 1, "weight": 1, "rollout_gpus": 8,
                    "train_gpus": 8, "rollout_bulk_s": 10.0, "train_s": 5.0}],
        "iterations": 3,
        "jobs": 2,
        "arrival": {"offered_load": 1.0},
    }  # fmt: skip
    WorkloadSpec.from_dict(d)  # (valid as it is)
    *where, key = path
    target = d
    for k in where:
        target = target[k]
    target[key] = value
    with pytest.raises(InvalidTrace):
        WorkloadSpec.from_dict(d)


def test_a_recorded_trace_that_is_not_one_and_a_job_past_the_cluster_are_typed(tmp_path):
    bad = {
        "inf": '{"iterations": [[["rollout", Infinity, 1.0]]]}',
        "empty iteration": '{"iterations": [[]]}',
        "deep": "[" * 100_000 + "]" * 100_000,
    }
    for name, text in bad.items():
        (tmp_path / f"{name}.json").write_text(text)
        with pytest.raises(InvalidTrace):
            load_trace(tmp_path / f"{name}.json")
    with pytest.raises(InvalidTrace):
        load_trace(tmp_path)  # (a directory)
    spec = small_spec(jobs=2)
    [job, other] = generate(spec, 0)
    wide = dataclasses.replace(job, rollout_gpus=spec.cluster.gpus)
    for policy in ("split", "rollmux", "spread"):
        with pytest.raises(JobDoesNotFit):
            simulate([wide, other], spec.cluster, policy)
    none = dataclasses.replace(job, bulk=job.bulk[:0], tail=job.tail[:0], train=job.train[:0])
    with pytest.raises(InvalidTrace, match="no iterations"):
        simulate([none], spec.cluster, "spread")


def test_recorded_traces_replay(tmp_path):
    its = [
        (Phase("rollout", 2, 10.0 + i), Phase("tail", 1, 3.0), Phase("train", 2, 5.0))
        for i in range(3)
    ]
    save_trace(tmp_path / "live.json", its, {"job": "add2"})
    assert load_trace(tmp_path / "live.json") == its
    (tmp_path / "w.yaml").write_text(
        json.dumps({
            "name": "replayed",
            "cluster": {"gpus": 16},
            "models": [{"name": "add2", "params_b": 0.01, "weight": 1, "rollout_gpus": 2,
                        "train_gpus": 2, "replay": "live.json"}],
            "iterations": 5,
            "jobs": 2,
            "arrival": {"offered_load": 0.5},
        })
    )  # fmt: skip
    spec = WorkloadSpec.load(tmp_path / "w.yaml")
    jobs = generate(spec, 0)
    assert jobs[0].bulk.tolist() == [10.0, 11.0, 12.0, 10.0, 11.0]  # cycled
    assert jobs[0].tail.tolist() == [3.0] * 5
    out = simulate(jobs, spec.cluster, "spread+backfill", SMALL)
    assert out.double_bookings == 0 and len(out.jobs) == 2
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(InvalidTrace):
        load_trace(tmp_path / "bad.json")


def test_cli_simulate_writes_json_and_figures(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = cli_main([
        "simulate", "--policy", "isolated", "--policy", "spread+backfill", "--gpus", "64",
        "--jobs", "6", "--json", str(out), "--png", str(tmp_path / "fig"),
    ])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"isolated", "spread+backfill"}
    assert data["policies"]["spread+backfill"]["gpu_double_bookings"] == 0
    for name in ("policies", "heatmap-isolated", "heatmap-spread-backfill", "gantt"):
        assert (tmp_path / f"fig-{name}.png").stat().st_size > 1000


def test_cli_refuses_bad_arguments_and_inputs_without_a_traceback(capsys):
    # argparse refuses what is not a positive number (usage error, exit 2) ...
    for argv in (["simulate", "--gpus", "0"], ["simulate", "--jobs", "-3"],
                 ["simulate", "--offered-load", "nan"], ["status", "--scheduler", "x",
                 "--timeout", "0"]):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        assert info.value.code == 2
        assert "must be" in capsys.readouterr().err
    # ... and a typed error of the command is one line, not a traceback, with exit 2.
    assert cli_main(["simulate", "--policy", "isolated", "--gpus", "8"]) == 2
    err = capsys.readouterr().err  # (errors on stderr: stdout may be piped on)
    assert "InvalidTrace" in err and "no job class" in err and "Traceback" not in err


def test_states_beyond_host_dram_load_from_nvme_and_cost_more(runs):
    spec, jobs, out = runs
    unbounded = out["spread+backfill"]
    assert unbounded.nvme_loads == 0  # the committed workload: DRAM holds every state
    # little HBM to park states in and less DRAM: evicted states overflow onto NVMe
    tight = dataclasses.replace(spec.cluster, hbm_park_gb=1.0, dram_gb_per_gpu=1.0, nvme_gbps=2.0)
    small = simulate(jobs, tight, "spread+backfill", SMALL)
    assert small.nvme_loads > 0 and small.double_bookings == 0
    assert len(small.jobs) == len(jobs)
    with pytest.raises(InvalidTrace):
        dataclasses.replace(spec.cluster, dram_gb_per_gpu=-1.0)


def test_a_state_evicted_past_dram_costs_its_nvme_read():
    group = NodeGroup("g", sim_nodes(ClusterSpec(gpus=8))[:1], 8, 0.0)
    gb, h2d, nvme = 1e9, 25e9, 1.5e9  # NVMe share per GPU slower than host-to-device
    for dram_gb, want in ((float("inf"), 10 * gb / h2d), (15.0, 10 * gb / nvme)):
        # HBM parks one 10 GB state per GPU; DRAM holds 15 GB per GPU, or everything
        g = _GroupRuntime(group, 10 * gb, 0.0, dram_bytes=dram_gb * gb * 8,
                          nvme_bytes_per_s=nvme)  # fmt: skip
        g.train_gpus(0, 8, 10 * gb, h2d)  # job 0's state parks on all 8 GPUs
        g.train_gpus(1, 8, 10 * gb, h2d)  # job 1 evicts it to DRAM (80 GB)
        g.train_gpus(2, 8, 10 * gb, h2d)  # job 2 evicts job 1; DRAM overflows: 0 to NVMe
        _, setup = g.train_gpus(0, 8, 10 * gb, h2d)  # job 0 back: evicts job 2
        assert setup == pytest.approx(want + 10 * gb / h2d)  # its load + the offload
    assert g.nvme_loads == 1 and list(g.dram) == [2] and list(g.on_nvme) == [1]
