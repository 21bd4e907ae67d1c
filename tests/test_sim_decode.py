"""The simulator under the paper's conditions (issue 40): rollouts from the decode model,
colocated on the training group, tool waits, the RollMux-style peer, the backlog's arrivals."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import yaml

from plexrl_dask.errors import InvalidTrace
from plexrl_dask.policy.spatiotemporal import PlacementConfig
from plexrl_dask.sim.decode import DecodeModel, Hardware, LengthModel, ModelShape
from plexrl_dask.sim.isolated import isolated_run, iteration_times
from plexrl_dask.sim.simulator import POLICIES, simulate
from plexrl_dask.sim.study import capacity
from plexrl_dask.sim.workload import WORKLOADS, WorkloadSpec, generate

SMALL = PlacementConfig(slots=32, group_nodes=2)
H100 = Hardware(hbm_gb=80, hbm_tbps=3.35, bf16_tflops=989, mbu=0.6, decode_mfu=0.5,
                step_overhead_ms=1.0)  # fmt: skip
LENGTHS = LengthModel(median=3300, sigma=0.69, max_tokens=20480, prompt_tokens=256)
DENSE_7B = ModelShape(7.6, 7.6, 28, 4, 128)


def backlog_dict(name: str = "paper2048-backlog") -> dict:
    return yaml.safe_load((WORKLOADS / f"{name}.yaml").read_text())


def small(name: str = "paper2048-backlog", gpus: int = 64, jobs: int = 12) -> WorkloadSpec:
    """The committed mix on a small cluster, with short jobs (the test's budget)."""
    d = backlog_dict(name)
    d["iterations"] = {"dist": "uniform", "low": 4, "high": 8}
    d["cluster"]["gpus"] = 1024  # resolve rollout_gpus: auto as on a large cluster, then scale
    return WorkloadSpec.from_dict(d, base=WORKLOADS).scaled(gpus, jobs)


def test_the_decode_curve_is_linear_at_small_batch_and_saturates():
    model = DecodeModel(H100, DENSE_7B, LENGTHS, tp=1)
    b = np.array([1, 8, 64, 256])
    tps = model.tokens_per_s_per_gpu(b, 2000.0)
    assert (np.diff(tps) > 0).all()
    assert tps[1] / tps[0] > 6  # weights dominate: nearly linear
    assert tps[3] / tps[2] < 2.5  # KV traffic dominates: saturating
    per_sequence = tps / b
    assert (np.diff(per_sequence) < 0).all()
    # batch 1 is one read of the weights per token (plus the step overhead)
    assert 1 / tps[0] == pytest.approx(15.2e9 / (3.35e12 * 0.6) + 1e-3, rel=0.02)


def test_experts_read_per_step_grow_from_active_to_total():
    moe = ModelShape(30.5, 3.3, 48, 4, 128, experts=128, experts_active=8)
    w = moe.weight_bytes_read(np.array([1, 16, 10_000]))
    assert w[0] == pytest.approx(2 * 3.3e9)
    assert w[0] < w[1] < w[2] and w[2] == pytest.approx(2 * 30.5e9, rel=1e-3)


def test_a_rollout_over_more_gpus_is_shorter_but_costs_more_gpu_seconds():
    model = DecodeModel(H100, DENSE_7B, LENGTHS, tp=1)
    one = np.ones(1)
    longest = LENGTHS.longest(one, np.full(1, 0.5), 512)
    few = model.rollout(2, 512, one, longest, 0.25)
    many = model.rollout(8, 512, one, longest, 0.25)
    assert many.total_s[0] < few.total_s[0]
    assert 8 * many.total_s[0] > 2 * few.total_s[0]
    for r in (few, many):
        assert r.bulk_s[0] + r.tail_s[0] == pytest.approx(r.total_s[0])
        assert r.tail_s[0] > 0
    # the tail is bound by the longest response at a small batch: most of it is weight reads
    assert many.total_s[0] > longest[0] * 15.2e9 / (3.35e12 * 0.6)
    # a batch beyond what the KV cache holds queues (continuous batching): longer per token
    assert model.max_batch(one)[0] < 512
    queued = model.rollout(1, 512, one, longest, 0.25)
    assert queued.total_s[0] > few.total_s[0] * 1.2


def test_described_rollouts_colocate_on_the_training_group():
    spec = small()
    jobs = generate(spec, 0)
    for j in jobs:
        assert j.colocated_gpus == j.train_gpus and j.coloc_rollout is not None
        col = iteration_times(j, "colocated", spec.cluster)
        assert (col > j.coloc_rollout + j.train).all()
    by_model = {m.name: m for m in spec.models}
    assert by_model["qwen2.5-7b"].rollout_gpus < by_model["qwen2.5-7b"].train_gpus
    # durations are drawn once per (spec, seed): another load gives the same jobs, later
    again = generate(spec.with_load(0.5), 0)
    assert all(np.array_equal(a.bulk, b.bulk) for a, b in zip(jobs, again, strict=True))
    assert again[-1].arrival_s > jobs[-1].arrival_s


def test_the_backlog_offers_load_at_the_cheapest_isolated_cost():
    spec = small(jobs=40)
    assert spec.arrival_basis == "cheapest-isolated" and spec.offered_load >= 1.3
    jobs = generate(spec.with_load(1.0), 1)
    cost = np.mean([isolated_run(j, "best", spec.cluster).gpu_seconds for j in jobs])
    rate = (len(jobs) - 1) / jobs[-1].arrival_s  # Poisson: close to the offered rate
    assert rate * cost / spec.cluster.gpus == pytest.approx(1.0, rel=0.35)


def test_every_policy_on_the_backlog_and_agentic_mixes():
    for name in ("paper2048-backlog", "paper2048-agentic"):
        spec = small(name, gpus=128, jobs=10)
        jobs = generate(spec, 2)
        for policy in POLICIES:
            if policy == "spread":
                continue
            o = simulate(jobs, spec.cluster, policy, SMALL)
            assert len(o.jobs) == len(jobs) and o.double_bookings == 0, (name, policy)
            assert all(j.slowdown >= 1 - 1e-9 for j in o.jobs), (name, policy)
            assert o.busy_gpu_seconds <= o.held_gpu_seconds + 1e-6, (name, policy)


def test_tool_waits_hold_gpus_in_split_but_not_when_pooled():
    spec = small("paper2048-agentic", gpus=64, jobs=6)
    jobs = [j for j in generate(spec, 0) if j.stall is not None]
    assert jobs, "the agentic mix has agentic jobs"
    j = jobs[0]
    split = iteration_times(j, "split", spec.cluster)
    assert np.allclose(split, j.sync_s + j.bulk + j.tail + j.stall + j.train)
    phases = j.iteration_phases(0)
    assert [p.kind for p in phases] == ["rollout", "tail", "gap", "train"]
    assert phases[2].gpus == 0 and phases[2].duration_s == pytest.approx(j.stall[0])
    out = simulate([j], spec.cluster, "spread+backfill", SMALL)
    # profiling holds max(r, t) GPUs throughout; placed iterations hold each phase's GPUs,
    # none in the gap (plus training-state loads, a few seconds each)
    n = min(SMALL.profile_iterations, j.iterations)
    profile = max(j.rollout_gpus, j.train_gpus) * sum(
        p.duration_s for i in range(n) for p in j.iteration_phases(i)
    )
    placed = sum(p.gpus * p.duration_s for i in range(n, j.iterations)
                 for p in j.iteration_phases(i))  # fmt: skip
    assert j.iterations > n and j.stall[n:].sum() > 0
    assert out.jobs[0].gpu_seconds == pytest.approx(profile + placed, rel=0.05)


def test_rollmux_pairs_jobs_of_a_class_round_robin():
    spec = small(gpus=64, jobs=2)
    base = generate(spec, 0)
    j = next(x for x in base if x.model == "qwen2.5-7b")
    # training as long as the rollout: two such jobs fit one group's cycle
    j = dataclasses.replace(j, train=j.sync_s + j.bulk + j.tail)
    twins = [dataclasses.replace(j, name=f"twin{i}") for i in range(2)]
    alone = simulate(twins[:1], spec.cluster, "rollmux")
    both = simulate(twins, spec.cluster, "rollmux")
    assert both.double_bookings == 0
    # one group for both (its GPUs held once), each job slower than alone but not 2x
    r, t = j.rollout_gpus, j.train_gpus
    assert both.held_gpu_seconds == pytest.approx((r + t) * both.makespan_s, rel=1e-6)
    assert alone.makespan_s < both.makespan_s < 2 * alone.makespan_s
    split = isolated_run(j, "split", spec.cluster).duration_s
    assert alone.makespan_s >= split  # alone it is split deployment plus its first load


def test_capacity_bisects_within_its_bracket():
    spec = small(gpus=64, jobs=10)
    lo, hi = 0.25, 4.0
    got = capacity(spec, "isolated", 2.0, 0, SMALL, lo=lo, hi=hi, steps=4)
    assert lo <= got < hi


def test_described_workload_errors_are_typed():
    d = backlog_dict()
    bad = copy.deepcopy(d)
    bad["models"][5]["rollout"]["tp"] = 1  # 235 B of weights on one 80 GB GPU
    with pytest.raises(InvalidTrace, match="leave no KV cache"):
        WorkloadSpec.from_dict(bad)
    bad = copy.deepcopy(d)
    del bad["hardware"]
    with pytest.raises(InvalidTrace, match="needs hardware"):
        WorkloadSpec.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["models"][3]["rollout_gpus"] = 3  # not a multiple of tp 2
    with pytest.raises(InvalidTrace, match="multiples of the rollout's tp"):
        WorkloadSpec.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["hardware"]["mbu"] = 1.5
    with pytest.raises(InvalidTrace, match="shares <= 1"):
        WorkloadSpec.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["lengths"]["max_tokens"] = 100
    with pytest.raises(InvalidTrace, match="max_tokens >= median"):
        WorkloadSpec.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["models"][0]["tools"] = {"turns": 0, "latency_s": 1}
    with pytest.raises(InvalidTrace, match="turns must be >= 1"):
        WorkloadSpec.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["arrival"]["basis"] = "colocated"
    with pytest.raises(InvalidTrace, match="arrival basis"):
        WorkloadSpec.from_dict(bad)
    bad = copy.deepcopy(d)
    del bad["models"][0]["shape"]
    with pytest.raises(InvalidTrace, match="lacks or mistypes"):
        WorkloadSpec.from_dict(bad)
    paper = yaml.safe_load((WORKLOADS / "paper2048.yaml").read_text())
    paper["models"][0]["rollout_gpus"] = "auto"
    with pytest.raises(InvalidTrace, match="needs a described rollout"):
        WorkloadSpec.from_dict(paper)


def test_the_decode_model_against_published_measurements():
    from plexrl_dask.sim.measured import MEASUREMENTS, compare_measured, load_measurements

    gpus, points = load_measurements()
    assert MEASUREMENTS.parent == WORKLOADS and "H100-SXM-80GB" in gpus and len(points) >= 9
    for p in points:
        assert p.source.strip() and ("http" in p.source or "github.com" in p.source
                                     or "docs." in p.source), p.name  # fmt: skip
        assert p.printed.strip() and p.context > 0
    rows = compare_measured(backlog_dict_hardware())
    assert [r["name"] for r in rows] == [p.name for p in points]
    for r in rows:
        assert np.isfinite(r["ratio"]) and r["ratio"] > 0, r["name"]
        assert r["predicted_tok_s_per_gpu"] == pytest.approx(
            r["predicted_per_sequence_tok_s"] * r["batch"] / r["tp"]
        )
    # FP8 weights: half the bytes of bf16, the rest of the shape unchanged
    fp8 = dataclasses.replace(DENSE_7B, weight_bytes=1.0)
    assert fp8.weight_bytes_read(np.ones(1))[0] * 2 == DENSE_7B.weight_bytes_read(np.ones(1))[0]


def backlog_dict_hardware() -> Hardware:
    return Hardware.from_dict(backlog_dict()["hardware"])


def test_a_malformed_measured_point_is_a_typed_error(tmp_path):
    from plexrl_dask.sim.measured import MEASUREMENTS, compare_measured, parse_measurements

    d = yaml.safe_load(MEASUREMENTS.read_text())
    breaks = [
        (lambda p: p.pop("source"), "source"),
        (lambda p: p.update(gpu="B200"), "gpu"),
        (lambda p: p.update(batch=0), "batch"),
        (lambda p: p.pop("isl"), "isl and osl, or context"),
        (lambda p: p["measured"].update(kind="tok/s"), "kind"),
        (lambda p: p["measured"].update(value=-1), "value"),
        (lambda p: p["shape"].pop("layers"), "lacks or mistypes"),
    ]
    for spoil, match in breaks:
        bad = copy.deepcopy(d)
        point = next(p for p in bad["points"] if "isl" in p)
        spoil(point)
        with pytest.raises(InvalidTrace, match=match):
            parse_measurements(bad)
    bad = copy.deepcopy(d)
    bad["points"][0]["measured"] = 75
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(InvalidTrace, match="measured must be a mapping"):
        compare_measured(backlog_dict_hardware(), tmp_path / "m.yaml")
