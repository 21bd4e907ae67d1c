"""The cost ledger and the layout search space: pure arithmetic over hand-built spans."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from plexrl_dask import errors
from plexrl_dask.rl.ledger import (
    JobWindow,
    ModeLedger,
    cost_ratio,
    cpu_share,
    percentile,
    rollout_phases,
)
from plexrl_dask.rl.modes import Layout, layouts
from plexrl_dask.shared.timeline import RequestSpan, SpanLog, busy_seconds


def span(worker, deployment, op, start, end, ready=None):
    return RequestSpan(
        worker,
        deployment,
        deployment.split("-")[0],
        op,
        start,
        start if ready is None else ready,
        end,
    )


def window(job, workers, t0, t1, tokens=100, rollout=None, sampler=None):
    deployments = (f"{job}-policy", f"{job}-rollout")
    return JobWindow(
        job=job,
        deployments=deployments,
        sampler=sampler or f"{job}-rollout",
        workers=tuple(workers),
        rollout_workers=tuple(rollout if rollout is not None else workers[1:]),
        t0=t0,
        t1=t1,
        useful_tokens=tokens,
    )


def test_spans_busy_and_idle():
    spans = [
        span("w1", "a-policy", "sample", 0, 2),
        span("w1", "a-policy", "optim_step", 3, 4),
        span("w2", "b-policy", "sample", 1, 5),
    ]
    assert busy_seconds(spans, 0, 10) == 7
    assert busy_seconds(spans, 1, 3.5) == pytest.approx(1 + 0.5 + 2.5)
    assert 1 - busy_seconds([s for s in spans if s.worker == "w1"], 0, 4) / 4 == pytest.approx(0.25)
    assert busy_seconds(spans, 6, 9) == 0.0
    log = SpanLog(2)
    for s in spans:
        log.add(s)
    assert [s.op for s in log.since(0)] == ["optim_step", "sample"]  # bounded: oldest dropped
    assert log.since(4.5) == [spans[2]]
    assert RequestSpan.from_dict(spans[0].to_dict()) == spans[0]


def test_isolated_ledger_charges_every_held_worker_for_the_whole_job():
    # Job a: split, train on w1, rollout on w2, from t=0 to t=10; sample [0,4], train [4,9].
    # Job b: the same workers, from t=10 to t=16.
    spans = [
        span("w2", "a-rollout", "sample", 0, 4, ready=0.5),
        span("w1", "a-policy", "forward_backward", 4, 8),
        span("w1", "a-policy", "optim_step", 8, 9),
        span("w2", "a-rollout", "load_weights", 9, 9.5),
        span("w2", "b-rollout", "sample", 10, 12),
        span("w1", "b-policy", "forward_backward", 12, 15),
    ]
    ledger = ModeLedger(
        "split",
        (window("a", ["w1", "w2"], 0, 10), window("b", ["w1", "w2"], 10, 16)),
        tuple(spans),
        0,
        16,
        peak_tokens_per_s={"a": 100.0, "b": 50.0},
    )
    assert ledger.reserved_worker_seconds() == 2 * 10 + 2 * 6
    assert ledger.busy_worker_seconds() == pytest.approx(4 + 5 + 0.5 + 2 + 3)
    assert ledger.idle_fraction() == pytest.approx(1 - 14.5 / 32)
    assert ledger.rollout_worker_seconds("a") == 4  # the phase, setup included, x 1 replica
    assert ledger.throughput_to_peak() == pytest.approx(200 / (4 * 100 + 2 * 50))
    summary = ledger.summary()
    assert summary["jobs"]["a"] == {
        "rollout_worker_seconds": 4,
        "rollout_setup_seconds": 0.5,
        "useful_tokens": 100,
        "throughput_to_peak": pytest.approx(100 / (4 * 100)),
        "rollout_cpu_share": None,  # hand-built spans measured no CPU time
    }
    assert summary["jobs"]["b"]["rollout_setup_seconds"] == 0
    assert summary["rollout_worker_seconds"] == 4 + 2
    assert ledger.isolated_cost_lower_bound() == pytest.approx(9.5 + 5)
    assert ledger.isolated_cost_lower_bound(2) == pytest.approx(2 * (9.5 + 5))
    assert ledger.useful_tokens() == 200


def test_multiplexed_ledger_charges_the_pool_for_the_makespan():
    spans = [
        span("w1", "a-rollout", "sample", 0, 3, ready=1),
        span("w2", "b-rollout", "sample", 0, 2),
        span("w2", "a-policy", "forward_backward", 3, 5),
        span("w1", "b-policy", "forward_backward", 3, 4),
    ]
    jobs = (window("a", [], 0, 5, rollout=["w1"]), window("b", [], 0, 4, rollout=["w2"]))
    mux = ModeLedger("multiplexed", jobs, tuple(spans), 0, 5, pool=("w1", "w2"))
    assert mux.reserved_worker_seconds() == 10
    assert mux.busy_worker_seconds() == 8
    assert mux.rollout_worker_seconds("a") == 3  # only the worker-seconds its requests used
    assert mux.throughput_to_peak() is None  # no peak measured
    isolated = ModeLedger("split", (window("a", ["w1", "w2"], 0, 10),), (), 0, 10)
    assert cost_ratio(mux, isolated) == pytest.approx(0.5)
    assert set(mux.summary()) >= {"cost_worker_seconds", "idle_fraction", "throughput_to_peak"}


def test_cpu_share_is_cpu_over_run_time_of_the_spans_that_measured_it():
    def timed(deployment, op, start, ready, end, cpu):
        return RequestSpan("w1", deployment, deployment.split("-")[0], op, start, ready, end, cpu)

    spans = [
        timed("a-rollout", "sample", 0, 1, 3, 1.5),  # setup [0, 1] is not run time
        timed("a-rollout", "sample", 3, 3, 5, 2.0),
        timed("a-policy", "forward_backward", 5, 5, 9, 1.0),  # not rollout
        span("w1", "b-rollout", "sample", 5, 6),  # built elsewhere: no CPU time
        timed("b-rollout", "sample", 6, 6, 7, 0.25),
    ]
    assert cpu_share(spans[:2]) == pytest.approx(3.5 / 4)
    assert cpu_share(spans[3:4]) is None
    assert cpu_share([]) is None
    jobs = (window("a", [], 0, 9, rollout=["w1"]), window("b", [], 5, 9, rollout=["w1"]))
    mux = ModeLedger("multiplexed", jobs, tuple(spans), 0, 9, pool=("w1",))
    assert mux.rollout_cpu_share("a") == pytest.approx(3.5 / 4)
    assert mux.rollout_cpu_share("b") == pytest.approx(0.25)  # the unmeasured span is left out
    assert mux.rollout_cpu_share() == pytest.approx(3.75 / 5)
    summary = mux.summary()
    assert summary["rollout_cpu_share"] == pytest.approx(3.75 / 5)
    assert summary["jobs"]["b"]["rollout_cpu_share"] == pytest.approx(0.25)


def test_rollout_phases_span_all_parts_until_another_op_of_the_sampler():
    spans = [
        span("w2", "a-rollout", "sample", 0, 3),
        span("w3", "a-rollout", "sample", 0.1, 5),  # a second replica's part: the long tail
        span("w1", "a-policy", "forward_backward", 2, 6),  # another deployment: no boundary
        span("w2", "a-rollout", "load_weights", 6, 6.5),
        span("w2", "a-rollout", "sample", 7, 8),
    ]
    assert rollout_phases(spans, "a-rollout") == [(0, 5), (7, 8)]
    ledger = ModeLedger("split", (window("a", ["w1", "w2", "w3"], 0, 9),), tuple(spans), 0, 9)
    assert ledger.rollout_worker_seconds("a") == 2 * (
        5 + 1
    )  # both replicas held through each phase


def test_percentile_nearest_rank():
    assert percentile([5, 1, 3, 2, 4], 0.5) == 3
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile([7], 0.99) == 7
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_layout_search_space_and_bad_layouts():
    assert layouts("colocated", 2) == [Layout("colocated", 1, 0), Layout("colocated", 2, 0, 2)]
    assert layouts("split", 2) == [Layout("split", 2, 1)]
    assert layouts("split-async", 3) == [Layout("split-async", 2, 1), Layout("split-async", 3, 2)]
    assert [(x.workers, x.rollout_replicas) for x in layouts("multiplexed", 2)] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    assert layouts("split", 1) == []  # a split job needs two workers
    # Jobs whose training needs 1 and 2 workers: nothing that does not fit them is offered.
    assert layouts("colocated", 2, [1, 2]) == [
        Layout("colocated", 1, 0),
        Layout("colocated", 2, 0, 2),
    ]
    assert layouts("colocated", 2, [2, 2]) == [Layout("colocated", 1, 0)]  # (each on its 2)
    assert layouts("split", 2, [1, 2]) == [] and layouts("split", 3, [2]) == [Layout("split", 2, 1)]
    pools = layouts("multiplexed", 3, [1, 2])
    assert [x.workers for x in pools if not x.sharded_rollout_only] == [2, 2, 2, 3, 3, 3, 3]
    # and pools where only the job that trains on two gets rollout replicas
    sharded = [x for x in pools if x.sharded_rollout_only]
    assert [(x.workers, x.rollout_replicas) for x in sharded] == [
        (2, 1),
        (2, 2),
        (3, 1),
        (3, 2),
        (3, 3),
    ]
    assert sharded[0].replicas_for(1) == 0 and sharded[0].replicas_for(2) == 1
    assert not any(x.sharded_rollout_only for x in layouts("multiplexed", 2))
    assert layouts("colocated", 1, [2]) == []
    # Split with tensor-parallel rollout replicas where the degrees fit.
    assert layouts("split", 3, [1], [2]) == [
        Layout("split", 2, 1),
        Layout("split", 3, 2),
        Layout("split", 3, 1, tensor_parallel=2),
    ]
    # (a job training on two holds 2 + r * t workers: 3, 4 and 4 of them here)
    assert layouts("split", 4, [2], [2]) == [
        Layout("split", 2, 1),
        Layout("split", 3, 2),
        Layout("split", 3, 1, tensor_parallel=2),
    ]
    assert Layout("split", 5, 2, tensor_parallel=2).job_workers(1) == 5
    assert Layout("split", 2, 1).job_workers(3) == 4 and Layout("colocated", 2, 0, 2).group(1) == 2
    for bad in [
        ("colocated", 2, 0),
        ("colocated", 2, 1, 2),
        ("multiplexed", 2, 0, 2),
        ("multiplexed", 2, 0, 1, True),
        ("split", 2, 1, 1, True),
        ("colocated", 1, 0, 1, False, 2),
        ("split", 2, 1, 1, False, 2),
        ("split", 3, 1, 1),
        ("split", 1, 1),
        ("split", 3, 3),
        ("multiplexed", 1, 2),
        ("bogus", 1, 0),
        ("multiplexed", 0, 0),
    ]:
        with pytest.raises(errors.ConfigError):
            Layout(*bad)
    with pytest.raises(errors.ConfigError):
        layouts("nope", 2)
    with pytest.raises(errors.ConfigError):
        layouts("split", 0)


def test_seed_difference_within_two_standard_errors():
    from plexrl_dask.rl.ledger import seed_difference

    same = seed_difference([0.30, 0.34, 0.32], [0.31, 0.35, 0.30])
    assert same["within_2se"] and same["difference"] == pytest.approx(0.0)
    far = seed_difference([0.10, 0.11, 0.12], [0.50, 0.52, 0.51])
    assert not far["within_2se"] and far["difference"] == pytest.approx(0.4)
    assert far["standard_error"] == pytest.approx(((0.01**2 / 3) * 2) ** 0.5)
    with pytest.raises(ValueError):
        seed_difference([0.1], [0.2, 0.3])


def test_seed_difference_reports_the_paired_view_of_the_same_seeds():
    """Every pair lower by about the same amount: within two standard errors of the
    independent samples (the seeds spread widely), far outside the paired ones."""
    from plexrl_dask.rl.ledger import seed_difference

    base = [0.10, 0.20, 0.30, 0.40]
    other = [0.09, 0.188, 0.291, 0.389]
    out = seed_difference(base, other)
    assert out["within_2se"] and not out["paired_within_2se"]
    assert (out["pairs_higher"], out["pairs_lower"]) == (0, 4)
    pairs = [-0.01, -0.012, -0.009, -0.011]
    mean = sum(pairs) / 4
    sd = (sum((d - mean) ** 2 for d in pairs) / 3) ** 0.5
    assert out["paired_standard_error"] == pytest.approx(sd / 2)
    assert "paired_standard_error" not in seed_difference([0.1, 0.2], [0.1, 0.2, 0.3])


def test_a_layouts_peak_is_the_mean_of_the_measurements_around_it_at_the_best_batch_size():
    from plexrl_dask.bench.multiplex import bracketed

    before = {"a": {8: 100.0, 16: 200.0}, "b": {8: 50.0, 16: 40.0}}
    after = {"a": {8: 300.0, 16: 100.0}, "b": {8: 30.0, 16: 60.0}}
    # a: means 200 (b=8) and 150 (b=16); b: means 40 and 50
    assert bracketed(before, after) == {"a": 200.0, "b": 50.0}
    assert bracketed(before, before) == {"a": 200.0, "b": 50.0}


def test_the_tail_bound_is_one_without_a_fixed_step_cost_and_counts_the_tail_with_one():
    """``bench.sampling``'s tail bound: with a step cost proportional to its rows, any lengths
    reach the peak (1.0); with equal lengths, any step-cost curve does; with a fixed cost per
    step, a long tail of few rows costs what the formula says."""
    from plexrl_dask.bench.sampling import tail_bound

    proportional = {b: 0.01 * b for b in (1, 2, 4, 8)}
    assert tail_bound([[3, 9, 1, 5, 2, 7, 7, 4]], proportional) == pytest.approx(1.0)
    fixed = {b: 1.0 + 0.5 * b for b in (1, 2, 4, 8)}
    assert tail_bound([[6] * 8, [2] * 8], fixed) == pytest.approx(1.0)
    # 8 rows: 7 end at 2 tokens, 1 at 5. Steps 1..4 feed 8, 1, 1, 1 rows (tokens after the
    # first: 7 * 1 + 4 = 11). Cost 5 + 3 * 1.5 = 9.5; the best b / step(b) is 8 / 5.
    assert tail_bound([[2] * 7 + [5]], fixed) == pytest.approx(11 / 9.5 / (8 / 5))
    # Between measured sizes the cost is linear: 6 rows cost what 4 and 8 rows cost, halfway.
    assert tail_bound([[2] * 6], fixed) == pytest.approx(6 / 4.0 / (8 / 5))
    assert math.isnan(tail_bound([[1] * 8], fixed))  # every row ended at its first token


def test_the_benchmark_reports_the_modes_that_fit_no_layout_as_not_run(tmp_path):
    """On one worker (a machine with one GPU) split and split-async have no layout: the
    benchmark's summary reports them as not run, with None for what they would have given,
    and still compares the multiplexed pool with the colocated jobs."""
    from types import SimpleNamespace

    from plexrl_dask.bench.multiplex import modes_not_run, summarise
    from plexrl_dask.rl.grpo import StepRecord
    from plexrl_dask.rl.modes import ModeRun

    assert set(modes_not_run(1)) == {"split", "split-async"}
    assert modes_not_run(2) == {}

    def records(job):
        return [
            StepRecord(job, k, 0.1 * k, 1.0, 2, 40, [3, 5], 0.5 - 0.1 * k, 1.0, k + 1, k, 1.0)
            for k in range(2)
        ]

    colocated = ModeLedger(
        "colocated",
        (window("a", ["w1"], 0, 4, rollout=["w1"], sampler="a-policy"),),
        (span("w1", "a-policy", "sample", 0, 2), span("w1", "a-policy", "forward_backward", 2, 4)),
        0,
        4,
        peak_tokens_per_s={"a": 100.0},
    )
    pooled = ModeLedger(
        "multiplexed",
        (window("a", [], 0, 3, rollout=["w1"], sampler="a-policy"),),
        (span("w1", "a-policy", "sample", 0, 1), span("w1", "a-policy", "forward_backward", 1, 3)),
        0,
        3,
        pool=("w1",),
        peak_tokens_per_s={"a": 100.0},
    )
    runs = [
        ModeRun(Layout("colocated", 1, 0), {"a": records("a")}, colocated),
        ModeRun(Layout("multiplexed", 1, 0), {"a": records("a")}, pooled),
    ]
    job = SimpleNamespace(name="a", describe=lambda: {"name": "a"})
    peaks = {"a": {8: 100.0}}
    layout_peaks = {r.layout.label: {"before": peaks, "after": peaks} for r in runs}
    results, _ = summarise(
        runs,
        [job],
        {"a": 100.0},
        peaks,
        layout_peaks,
        str(tmp_path / "p.png"),
        {},
        modes_not_run(1),
    )
    assert results["cost_ratio_vs_colocated"] == pytest.approx(3 / 4)
    assert results["cost_ratio_vs_split"] is None and results["cost_ratio_vs_split_async"] is None
    assert results["throughput_to_peak_split"] is None
    assert results["split_async_final_mean_reward"] is None
    assert results["idle_fraction"]["split"] is None
    assert results["best_layout"]["split-async"] is None
    assert set(results["modes_not_run"]) == {"split", "split-async"}
    assert results["throughput_to_peak"] == pytest.approx(100 / (1 * 100))
    assert results["reward_trajectories_identical"] is True
    assert results["trajectory_steps_trained"] == 2
    assert (tmp_path / "p.png").exists()
    with pytest.raises(ValueError, match="colocated"):
        summarise(runs[1:], [job], {"a": 100.0}, peaks, layout_peaks, str(tmp_path / "q.png"))
    # Equal trajectories of steps that trained nothing (no loss) are not evidence.
    untrained = [
        ModeRun(r.layout, {"a": [replace(rec, loss=None) for rec in r.records["a"]]}, r.ledger)
        for r in runs
    ]
    results, _ = summarise(
        untrained, [job], {"a": 100.0}, peaks, layout_peaks, str(tmp_path / "u.png")
    )
    assert results["reward_trajectories_identical"] is False
    assert results["trajectory_steps_trained"] == 0


def test_training_memory_decides_the_smallest_group():
    from plexrl_dask.rl.catalog import standard_jobs
    from plexrl_dask.rl.modes import smallest_groups
    from plexrl_dask.rl.sizing import training_memory
    from tests.conftest import tiny_spec

    spec = tiny_spec(seed=3)
    n = spec.num_parameters()
    small, wide = training_memory(spec, 8, 16), training_memory(spec, 8, 32)
    assert small.weights == small.gradients == 4 * n and small.moments == 8 * n
    assert wide.activations > 2 * small.activations  # (attention grows with the width too)
    assert small.per_rank(2) < small.per_rank(1) < small.total + 1
    assert small.smallest_group(small.per_rank(1), 4) == 1
    assert small.smallest_group(small.per_rank(1) - 1, 4) == 2
    assert small.smallest_group(small.per_rank(4) - 1, 4) is None
    with pytest.raises(errors.ConfigError):
        training_memory(spec, 0, 8)
    # The benchmark's budget: countdown4 alone shards over two (bench.multiplex.BUDGET).
    jobs = standard_jobs(4)
    assert smallest_groups(jobs, 192 * 2**20, 2) == {
        "add2": 1,
        "countdown3": 1,
        "addsub2": 1,
        "countdown4": 2,
    }
    with pytest.raises(errors.ConfigError, match="countdown4"):
        smallest_groups(jobs, 120 * 2**20, 1)


def test_tensor_parallel_degrees_of_the_standard_mix():
    from plexrl_dask.rl.catalog import standard_jobs
    from plexrl_dask.rl.modes import tensor_parallel_degrees

    jobs = standard_jobs(4)  # 4 heads, 2 key-value heads each
    assert tensor_parallel_degrees(jobs, 4) == [2]
    assert tensor_parallel_degrees(jobs, 1) == []


def test_the_reward_plots_moving_average_averages_the_window_before_each_step():
    from plexrl_dask.rl.report import moving_average

    assert moving_average([1, 2, 3, 4, 5, 6], 3) == [1.0, 1.5, 2.0, 3.0, 4.0, 5.0]
    assert moving_average([], 5) == []
    assert moving_average([0.5], 5) == [0.5]


def test_a_pool_spreads_the_jobs_estimated_work_longest_first():
    from plexrl_dask.rl.catalog import standard_jobs
    from plexrl_dask.rl.modes import Layout, pool_placement
    from plexrl_dask.rl.sizing import StepWork, step_work
    from tests.conftest import tiny_spec

    spec = tiny_spec(seed=3)
    w = step_work(spec, 8, 16)
    assert w.train == 3 * w.sample == 6 * spec.num_parameters() * 8 * 16
    assert step_work(spec, 16, 16).total == 2 * w.total
    with pytest.raises(errors.ConfigError):
        step_work(spec, 8, 0)

    jobs = standard_jobs(4)
    groups = {"countdown4": 2}
    own = pool_placement(jobs, Layout("multiplexed", 2, 0), ["a", "b"], groups, stream_rows=128)
    # One stream per step: countdown4's whole rollout is on its rank 0, which takes the
    # least-loaded worker; the next-longest job goes to the other; ranks are distinct.
    cd4 = own["countdown4"]
    assert len(set(cd4.train)) == 2 and cd4.rollout == ()
    assert cd4.load[cd4.train[0]] > cd4.load[cd4.train[1]]
    assert own["countdown3"].train == (cd4.train[1],)
    totals = {x: sum(p.load.get(x, 0.0) for p in own.values()) for x in "ab"}
    work = {j.name: j.grpo.steps * j.step_work().total for j in jobs}
    assert sum(totals.values()) == pytest.approx(sum(work.values()))
    # LPT: the busier worker holds at most the lighter one plus the last job placed on it
    assert max(totals.values()) - min(totals.values()) <= max(work.values())
    # Streams of 64 rows split the rollout over both ranks: their loads are equal.
    even = pool_placement(jobs, Layout("multiplexed", 2, 0), ["a", "b"], groups, stream_rows=64)
    assert len(set(even["countdown4"].load.values())) == 1
    # With a rollout replica the rollout is the replica's; the same inputs, the same answer.
    rep = Layout("multiplexed", 2, 1, sharded_rollout_only=True)
    one = pool_placement(jobs, rep, ["a", "b"], groups, stream_rows=128)
    assert len(one["countdown4"].rollout) == 1 and one["add2"].rollout == ()
    assert one == pool_placement(jobs, rep, ["a", "b"], groups, stream_rows=128)
    with pytest.raises(errors.ConfigError, match="pool"):
        pool_placement(jobs, Layout("multiplexed", 1, 0), ["a"], groups, stream_rows=128)
    # A profile (seconds per step) places by what the jobs did, not by FLOPs: the two jobs
    # measured longest go to different workers, each with one short one.
    profile = {"add2": 0.05, "countdown3": 0.15, "addsub2": 0.03, "countdown4": 0.14}
    by_time = pool_placement(
        jobs, Layout("multiplexed", 2, 0), ["a", "b"], stream_rows=128,
        work={n: StepWork(sample=0.0, train=t) for n, t in profile.items()},
    )  # fmt: skip
    assert by_time["countdown3"].train != by_time["countdown4"].train
    assert by_time["countdown3"].train == by_time["addsub2"].train


def test_the_longest_jobs_bound_and_the_time_other_jobs_held_it_up():
    from plexrl_dask.rl.ledger import cost_ratio, longest_job_bound, where_cost_goes

    # Pool of two: job a (a gang on w1+w2) samples on w1, then trains on both; job b's
    # request on w2 runs 1.0-2.5, so a's training (ready at 1.5) starts at 2.5 on both.
    spans = [
        span("w1", "a-policy", "sample", 0.0, 1.0),
        span("w2", "b-policy", "sample", 1.0, 2.5),
        span("w1", "a-policy", "train_step", 2.5, 3.5),
        span("w2", "a-policy", "train_step", 2.5, 3.5),
        span("w1", "b-policy", "train_step", 3.6, 4.0),  # after a's last run: not counted
    ]
    pool = ModeLedger(
        "multiplexed",
        (
            window("a", (), 0.0, 4.0, sampler="a-policy", rollout=()),
            window("b", (), 0.0, 4.0, sampler="b-policy", rollout=()),
        ),
        tuple(spans),
        0.0,
        4.0,
        pool=("w1", "w2"),
    )
    assert pool.blocked_seconds("a") == pytest.approx(1.5)  # 1.0-2.5 on w2
    # b's next request took w1, which a held 2.5-3.5 (whether b's was ready then or not)
    assert pool.blocked_seconds("b") == pytest.approx(1.0)
    # Colocated: a on two workers for 3 s (busy 1 + 2), b on one for 2 s (busy 1.9).
    colocated = ModeLedger(
        "colocated",
        (
            window("a", ("w1", "w2"), 0.0, 3.0, sampler="a-policy", rollout=()),
            window("b", ("w1",), 3.0, 5.0, sampler="b-policy", rollout=()),
        ),
        (
            span("w1", "a-policy", "sample", 0.0, 1.0),
            span("w1", "a-policy", "train_step", 1.5, 2.5),
            span("w2", "a-policy", "train_step", 1.5, 2.5),
            span("w1", "b-policy", "sample", 3.0, 4.5),
            span("w1", "b-policy", "train_step", 4.5, 4.9),
        ),
        0.0,
        5.0,
    )
    assert colocated.blocked_seconds("a") == 0.0
    assert colocated.reserved_worker_seconds() == 8.0
    assert longest_job_bound(colocated, 2) == ("a", 6.0)  # 2 x 3 s > 4.9 busy
    assert longest_job_bound(colocated, 1) == ("a", pytest.approx(4.9))
    # The split of the pool's cost against colocated's: the same requests, as long (busy 4.9
    # worker-s in each: a's 3.0, b's 1.9), colocated's over 8.0 reserved worker-s.
    costs = where_cost_goes(pool, colocated)
    assert costs == {
        "longest_job": "a",
        "longest_job_bound_ratio_vs_colocated": pytest.approx(6.0 / 8.0),
        "busy_ratio_vs_colocated": pytest.approx(1.0),
        "no_idle_cost_ratio_vs_colocated": pytest.approx(4.9 / 8.0),
        "longest_job_wall_ratio": pytest.approx(4.0 / 3.0),
        "longest_job_blocked_s": pytest.approx(1.5),
    }
    # cost ratio = no-idle ratio ÷ (1 − the pool's idle fraction)
    assert cost_ratio(pool, colocated) == pytest.approx(
        costs["no_idle_cost_ratio_vs_colocated"] / (1 - pool.idle_fraction())
    )


def test_the_layout_search_offers_no_layout_whose_sampling_does_not_fit():
    """At a budget where countdown4's batch does not fit one worker's rollout replica but its
    shard on each of two (tensor-parallel, or its training group sampling on gathered
    weights) does, only the layouts that sample it on two workers are offered."""
    from plexrl_dask.rl.catalog import standard_jobs
    from plexrl_dask.rl.modes import sampling_fits

    [job] = [s for s in standard_jobs(4) if s.name == "countdown4"]
    m = job.sampling_memory()
    budget = max(m.per_replica(2), m.hybrid_per_rank(2))
    assert budget < m.per_replica(1) < m.hybrid_per_rank(1)  # (one rank: its moments too)
    fits = sampling_fits([job], budget, {"countdown4": 2})
    assert layouts("colocated", 2, [2], fits=fits) == [Layout("colocated", 1, 0)]  # (on its 2)
    assert layouts("split", 4, [2], [2], fits) == [Layout("split", 3, 1, tensor_parallel=2)]
    pools = layouts("multiplexed", 3, [2], fits=fits)
    assert pools and all(p.rollout_replicas == 0 for p in pools)  # (no one-worker replica)
    # trained on one worker, it cannot sample there: no colocated or pooled layout at all
    alone = sampling_fits([job], budget, {"countdown4": 1})
    assert layouts("colocated", 1, fits=alone) == layouts("multiplexed", 2, fits=alone) == []
    # the default budget fits every layout of the standard mix
    assert all(sampling_fits(standard_jobs(4), 192 * 2**20, {"countdown4": 2})(x) for x in pools)
