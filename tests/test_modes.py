"""The deployment modes on a real process cluster: the same jobs in every layout, the same
trajectories, a ledger that adds up, the report."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import replace

import pytest
from rich.console import Console

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.bench.common import confined
from plexrl_dask.rl import GRPOConfig
from plexrl_dask.rl.catalog import standard_jobs
from plexrl_dask.rl.modes import (
    JobSpec,
    Layout,
    peak_tokens_per_second,
    resumable,
    run_mode,
)
from plexrl_dask.rl.report import plot_run, summary_table
from plexrl_dask.rl.warmup import warm_start
from tests.conftest import tiny_spec, unique
from tests.test_grpo import FirstCharIsDigit

CONFIG = GRPOConfig(steps=3, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2)


def test_every_mode_runs_the_same_jobs(client, tmp_path):
    runtime = plexrl.Runtime(client, job=unique("modes"))
    specs = [
        JobSpec(
            unique("j1"),
            FirstCharIsDigit(),
            tiny_spec(seed=1),
            replace(CONFIG, seed=1),
            warmup_steps=3,
            warmup_batch_size=8,
        ),
        JobSpec(
            unique("j2"),
            FirstCharIsDigit(),
            tiny_spec(seed=2, hidden_size=48, num_heads=4, num_kv_heads=2),
            replace(CONFIG, seed=2),
            warmup_steps=4,
            warmup_batch_size=8,
        ),
    ]
    progress = []
    checkpoints = warm_start(
        runtime, specs, tmp_path / "warmup", on_progress=lambda *a: progress.append(a)
    )
    assert sorted((job, step) for job, step, _ in progress) == sorted(
        (s.name, k) for s in specs for k in range(1, s.warmup_steps + 1)
    )
    assert {c["version"] for c in checkpoints.values()} == {3, 4}

    workers = sorted(plexrl.worker_info(client))
    grid = [
        Layout("colocated", 1),
        Layout("split", 2, 1),
        Layout("split-async", 2, 1),
        Layout("multiplexed", 2, 1),
        Layout("multiplexed", 1, 0),
    ]
    # Each isolated job's run, and each pool's, confined to as many cores as it holds workers
    # (bench --cores equal): what it holds, and the driver's cores meanwhile.
    held: list[tuple[int, int]] = []
    floating = os.sched_getaffinity(0)

    @contextlib.contextmanager
    def recording(workers_held):
        with confined(len(workers_held)) as cores:
            held.append((len(workers_held), len(os.sched_getaffinity(0))))
            yield cores

    runs = {
        layout: run_mode(
            runtime, specs, layout, checkpoints, workers, metrics_dir=tmp_path / "m",
            confine=recording,
        )
        for layout in grid
    }  # fmt: skip
    cores = len(floating)
    assert held == [
        (1, 1), (1, 1),  # colocated: each job alone on its worker
        (2, min(2, cores)), (2, min(2, cores)), (2, min(2, cores)), (2, min(2, cores)),  # split
        (2, min(2, cores)), (1, 1),  # the pools
    ]  # fmt: skip
    assert os.sched_getaffinity(0) == floating

    # The synchronous layouts compute exactly the same thing; the jobs trained.
    reference = runs[grid[0]]
    for layout, run in runs.items():
        for s in specs:
            assert len(run.records[s.name]) == CONFIG.steps
            if layout.mode != "split-async":
                assert run.trajectory(s.name) == reference.trajectory(s.name), layout
    assert any(loss is not None for s in specs for _, loss in reference.trajectory(s.name))
    assert [r.sampled_with for r in runs[grid[2]].records[specs[0].name]][:2] == [3, 3]  # ahead
    # Every synchronous step samples with the weights of the step before (the checkpoint's 3
    # first); with staleness 1 the second step still samples with them.
    assert [r.sampled_with for r in reference.records[specs[0].name]] == [3, 4, 5]

    # A split-async job multiplexed computes what it computes isolated.
    ahead = [replace(s, grpo=replace(s.grpo, staleness=1)) for s in specs]
    mux_async = run_mode(runtime, ahead, Layout("multiplexed", 2, 1), checkpoints, workers)
    for s in specs:
        assert mux_async.trajectory(s.name) == runs[grid[2]].trajectory(s.name)
    with pytest.raises(errors.ConfigError, match="rollout"):  # staleness 1 needs a rollout
        run_mode(runtime, ahead[:1], Layout("multiplexed", 1, 0), checkpoints, workers)

    # The ledgers add up.
    for layout, run in runs.items():
        ledger = run.ledger
        assert 0 < ledger.busy_worker_seconds() <= ledger.reserved_worker_seconds() + 1e-6
        assert 0 <= ledger.idle_fraction() < 1
        for s in specs:
            assert ledger.rollout_worker_seconds(s.name) > 0
        ops = {sp.op for sp in ledger.spans}
        assert "sample" in ops and "train_step" in ops
        if layout.mode == "multiplexed":
            assert ledger.reserved_worker_seconds() == pytest.approx(
                layout.workers * ledger.makespan()
            )
            assert {sp.worker for sp in ledger.spans if sp.job in {s.name for s in specs}} <= set(
                workers[: layout.workers]
            )
        else:
            assert ledger.reserved_worker_seconds() == pytest.approx(
                sum(layout.workers * w.wall_s for w in ledger.jobs)
            )
    assert {sp.job for sp in runs[grid[3]].ledger.spans} >= {
        s.name for s in specs
    }  # spans carry the job

    # Nothing is left deployed; every run wrote its metrics with a reproducible header.
    names = {d.name for d in runtime.deployments()}
    assert not any(s.name in n for s in specs for n in names)
    header = json.loads(
        (tmp_path / "m" / f"multiplexed-{specs[0].name}.jsonl").read_text().splitlines()[0]
    )
    assert header["config"]["seed"] == 1

    mux = runs[grid[3]]
    png = tmp_path / "run.png"
    plot_run(mux.records, mux.ledger, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    console = Console(record=True, width=150)
    console.print(
        summary_table(
            mux.records,
            mux.ledger,
            isolated_estimates={"colocated": mux.ledger.isolated_cost_lower_bound()},
        )
    )
    text = console.export_text()
    assert specs[0].name in text and "worker-s" in text


def test_peak_throughput_decodes_full_batches(client):
    runtime = plexrl.Runtime(client, job=unique("peak"))
    worker = sorted(plexrl.worker_info(client))[0]
    best, by_batch = peak_tokens_per_second(
        runtime, tiny_spec(seed=3), worker, "1+2=", max_tokens=5, batch_sizes=(2, 8), repeats=1
    )
    assert set(by_batch) == {2, 8} and best == max(by_batch.values()) > 0
    assert not [d for d in runtime.deployments() if d.name.startswith("peak-")]


def test_bad_job_specs_and_layouts_are_typed_errors(client, tmp_path):
    with pytest.raises(errors.ConfigError):
        JobSpec("bad name!", FirstCharIsDigit(), tiny_spec(), CONFIG)
    with pytest.raises(errors.ConfigError):
        JobSpec("ok", FirstCharIsDigit(), tiny_spec(), CONFIG, warmup_steps=-1)
    with pytest.raises(errors.ConfigError):
        standard_jobs(0)
    with pytest.raises(errors.ConfigError):
        standard_jobs(2, scale=0)
    runtime = plexrl.Runtime(client, job=unique("bad-layout"))
    spec = JobSpec(unique("j"), FirstCharIsDigit(), tiny_spec(), CONFIG)
    with pytest.raises(errors.ConfigError, match="needs 3 workers"):
        run_mode(runtime, [spec], Layout("multiplexed", 3, 1), {}, ["w1", "w2"])


def test_standard_mix_scales_steps_only():
    full, quick = standard_jobs(5), standard_jobs(5, scale=0.25)
    assert len({s.name for s in full}) == 5 and len({s.model.name for s in full}) >= 3
    for a, b in zip(full, quick, strict=True):
        assert replace(b, grpo=a.grpo, warmup_steps=a.warmup_steps) == a
        assert b.grpo.steps < a.grpo.steps and b.warmup_steps < a.warmup_steps


def test_the_same_job_runs_on_a_local_checkpoint_path(client, tmp_path):
    """Nothing in a job depends on the tiny model: a local Hugging Face checkpoint (here one
    written from a tiny spec) runs through warm-up, restore and GRPO alike."""
    path = tiny_spec(seed=5).save_pretrained(str(tmp_path / "hf"))
    runtime = plexrl.Runtime(client, job=unique("path"))
    spec = JobSpec(
        unique("p"),
        FirstCharIsDigit(),
        path,
        replace(CONFIG, steps=2),
        warmup_steps=2,
        warmup_batch_size=4,
    )
    checkpoints = warm_start(runtime, [spec], tmp_path / "warmup")
    workers = sorted(plexrl.worker_info(client))
    run = run_mode(runtime, [spec], Layout("split", 2, 1), checkpoints, workers)
    assert [r.sampled_with for r in run.records[spec.name]][0] == 2
    assert len(run.records[spec.name]) == 2 and run.ledger.useful_tokens() > 0


def test_a_warm_up_past_its_timeout_raises_at_once_and_undeploys(client, tmp_path, monkeypatch):
    """``warm_start`` past its timeout raises then, not when the warm-ups end; the one still
    running stops after its current step and leaves nothing deployed."""
    import plexrl_dask.rl.warmup as warmup

    runtime = plexrl.Runtime(client, job=unique("late"))
    spec = JobSpec(
        unique("late"), FirstCharIsDigit(), tiny_spec(seed=6), CONFIG, warmup_steps=100_000
    )
    monkeypatch.setattr(warmup, "request_timeout", lambda: 1e-4)  # the whole: ~10 s
    t0 = time.monotonic()
    steps = []
    with pytest.raises(errors.RequestTimeout, match="did not finish"):
        warm_start(runtime, [spec], tmp_path / "warmup", on_progress=lambda *a: steps.append(a))
    assert time.monotonic() - t0 < 40 and steps  # (it had started)

    def left() -> list[str]:
        return [d.name for d in runtime.deployments(every_job=True) if d.owner == spec.name]

    deadline = time.monotonic() + 60
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left()
    ran = len(steps)
    time.sleep(0.5)
    assert len(steps) == ran < spec.warmup_steps  # stopped


def warmed_job(client, tmp_path, prefix: str, seed: int):
    """A 2-step job after a 2-step warm-up: its runtime, spec, starting state and workers."""
    runtime = plexrl.Runtime(client, job=unique(f"{prefix}-runtime"))
    spec = JobSpec(
        unique(prefix),
        FirstCharIsDigit(),
        tiny_spec(seed=seed),
        replace(CONFIG, steps=2, seed=seed),
        warmup_steps=2,
        warmup_batch_size=4,
    )
    start = warm_start(runtime, [spec], tmp_path / "warmup")
    return runtime, spec, start, sorted(plexrl.worker_info(client))


@pytest.mark.parametrize("layout", [Layout("multiplexed", 2, 1), Layout("split", 2, 1)])
def test_a_resumed_mode_loads_each_state_once_and_continues_the_run(client, tmp_path, layout):
    """A job with a checkpoint under ``checkpoint_dir`` needs no starting state: its
    deployments load the checkpoint once (no warm-up state before it, no weight sync of a
    state about to be replaced), and the records continue the interrupted run's."""
    runtime, spec, start, workers = warmed_job(client, tmp_path, "r", seed=7)
    ck = tmp_path / "ck"
    assert resumable(ck, layout.mode, [spec]) == {}
    first = run_mode(runtime, [spec], layout, start, workers, checkpoint_dir=ck, checkpoint_every=1)
    assert set(resumable(ck, layout.mode, [spec])) == {spec.name}

    longer = replace(spec, grpo=replace(spec.grpo, steps=3))
    t0 = time.time()
    resumed = run_mode(runtime, [longer], layout, {}, workers, checkpoint_dir=ck)
    records = resumed.records[spec.name]
    assert [r.step for r in records] == [0, 1, 2]
    assert records[:2] == first.records[spec.name]  # restored, not redone
    # Each of the job's two deployments loaded one state, once, and no weights were synced
    # before those restores (the syncs after them: the rollout's saved weights are one
    # version behind the policy's after a last step, and the final weights at the end).
    spans = sorted(
        (sp for sp in runtime.timeline(since=t0) if sp.job == spec.name), key=lambda sp: sp.start
    )
    ops = [sp.op for sp in spans]
    assert ops.count("load_state") == 2, ops
    restored = max(i for i, op in enumerate(ops) if op == "load_state")
    assert "load_weights" not in ops[:restored] and ops.count("load_weights") == 2, ops
    assert resumed.ledger.useful_tokens() == sum(records[2].completion_lengths)

    # Without a checkpoint to resume, a job without a starting state is refused up front.
    other = replace(spec, name=unique("none"))
    with pytest.raises(errors.ConfigError, match="neither a starting state"):
        run_mode(runtime, [other], layout, {}, workers, checkpoint_dir=ck)
    assert not [d for d in runtime.deployments() if other.name in d.name]


class _Interrupt(Exception):
    pass


def test_a_job_resumed_from_its_initial_checkpoint_records_what_a_fresh_run_does(client, tmp_path):
    """A job stopped before its first checkpointed step leaves the checkpoint of its initial
    state (steps_done 0): resumed from it with no starting state, a colocated job records
    the version it sampled with and trained to as an uninterrupted run does."""
    runtime, spec, start, workers = warmed_job(client, tmp_path, "z", seed=8)
    layout = Layout("multiplexed", 1, 0)  # each job samples from its policy
    uninterrupted = run_mode(runtime, [spec], layout, start, workers).records[spec.name]

    def interrupt(record):
        raise _Interrupt(record.step)

    ck = tmp_path / "ck"
    with pytest.raises(_Interrupt):
        run_mode(runtime, [spec], layout, start, workers, on_step=interrupt, checkpoint_dir=ck)
    assert resumable(ck, layout.mode, [spec])[spec.name].steps_done == 0
    resumed = run_mode(runtime, [spec], layout, {}, workers, checkpoint_dir=ck).records[spec.name]

    def what(records):
        return [(r.step, r.reward_mean, r.loss, r.version, r.sampled_with) for r in records]

    assert what(resumed) == what(uninterrupted)
    assert resumed[0].sampled_with == 2  # the warm-up's version, restored from the checkpoint


def test_a_job_with_a_vllm_rollout_is_refused_where_vllm_cannot_run(client, tmp_path):
    """``rollout_backend="vllm"`` deploys the job's rollout on vLLM; a CPU cluster cannot run
    it, and the run fails with the typed error, leaving no deployment of the job behind."""
    with pytest.raises(errors.ConfigError, match="rollout_backend"):
        JobSpec("ok", FirstCharIsDigit(), tiny_spec(), CONFIG, rollout_backend="tensorrt")
    runtime, spec, start, workers = warmed_job(client, tmp_path, "v", seed=3)
    spec = replace(spec, rollout_backend="vllm")
    assert spec.describe()["rollout_backend"] == "vllm"
    with pytest.raises(errors.BackendUnavailable, match="CUDA"):
        run_mode(runtime, [spec], Layout("split", 2, 1), start, workers)
    assert not [d for d in runtime.deployments() if spec.name in d.name]
    # split-async scores old log-probabilities on the rollout: refused before deploying
    with pytest.raises(errors.ConfigError, match="staleness 1"):
        run_mode(runtime, [spec], Layout("split-async", 2, 1), start, workers)
    assert not [d for d in runtime.deployments() if spec.name in d.name]


def test_a_job_whose_training_shards_samples_on_its_group_and_pools_alike(client, tmp_path):
    """A job that trains on two workers: colocated, it samples on that group (the hybrid
    engine); in a pool it trains on two of the pool's workers, sampling from its policy or
    from a rollout replica; every layout computes the same trajectory, and the colocated
    job's ledger counts both workers."""
    runtime = plexrl.Runtime(client, job=unique("sharded"))
    spec = JobSpec(
        unique("wide"),
        FirstCharIsDigit(),
        tiny_spec(seed=5),
        replace(CONFIG, seed=5),
        warmup_steps=3,
        warmup_batch_size=8,
    )
    checkpoints = warm_start(runtime, [spec], tmp_path / "warmup")
    workers = sorted(plexrl.worker_info(client))
    groups = {spec.name: 2}
    runs = [
        run_mode(runtime, [spec], layout, checkpoints, workers, groups=groups)
        for layout in (
            Layout("colocated", 1),  # raised to the job's group of 2
            Layout("multiplexed", 2, 0),
            Layout("multiplexed", 2, 1),
        )
    ]
    assert any(loss is not None for _, loss in runs[0].trajectory(spec.name))
    for run in runs[1:]:
        assert run.trajectory(spec.name) == runs[0].trajectory(spec.name), run.layout
    colocated = runs[0].ledger
    (window,) = colocated.jobs
    assert set(window.workers) == set(window.rollout_workers) == set(workers)
    assert colocated.reserved_worker_seconds() == pytest.approx(2 * window.wall_s)
    samples = {sp.worker for sp in colocated.spans if sp.op == "sample"}
    assert samples == set(workers)  # both ranks sampled
    with pytest.raises(errors.ConfigError, match="smaller than a job's training group"):
        run_mode(runtime, [spec], Layout("multiplexed", 1, 0), checkpoints, workers, groups=groups)
    with pytest.raises(errors.ConfigError, match="needs 3 workers"):
        run_mode(runtime, [spec], Layout("split", 2, 1), checkpoints, workers, groups=groups)


def test_other_jobs_start_from_a_warm_up_only_while_its_job_shares_it(client, tmp_path):
    """A warm-up checkpoint is its job's state: another job (the seed comparison's variants
    in bench.multiplex) may load it only while the job shares its warm-up deployment."""
    from plexrl_dask.bench.multiplex import shared_warmups

    runtime, spec, start, _ = warmed_job(client, tmp_path, "shared-warmup", seed=7)
    variant = f"{spec.name}-s0-st0"
    other = plexrl.Runtime(client, job=variant)
    policy = other.deploy("policy", spec.model)
    try:
        with pytest.raises(errors.PermissionDenied, match="share"):
            plexrl.result(policy.load_state(start[spec.name]), timeout=120)
        with shared_warmups(runtime, [spec], {spec.name: [variant]}):
            assert plexrl.result(policy.load_state(start[spec.name]), timeout=120) == 2
        with pytest.raises(errors.PermissionDenied):  # (the grant ended with the block)
            plexrl.result(policy.load_state(start[spec.name]), timeout=120)
    finally:
        other.undeploy("policy")


def test_a_split_job_samples_on_a_tensor_parallel_replica_synced_every_step(tmp_path):
    """Split with tensor-parallel rollout inside a job (3 workers: its trainer and one
    replica over the other two): every step syncs the trainer's weights into both ranks'
    slices and samples there, the job trains, and its ledger holds all three workers. Its
    first step's reward is a one-worker rollout's (rounding flips no token there)."""
    from distributed import Client

    spec = JobSpec(
        unique("tp-job"),
        FirstCharIsDigit(),
        tiny_spec(seed=9, num_kv_heads=2),
        replace(CONFIG, seed=9),
        warmup_steps=3,
        warmup_batch_size=8,
    )
    with plexrl.local_cluster(n_workers=3) as cluster, Client(cluster) as client:
        runtime = plexrl.Runtime(client, job=unique("split-tp"))
        checkpoints = warm_start(runtime, [spec], tmp_path / "warmup")
        workers = sorted(plexrl.worker_info(client))
        tp = run_mode(
            runtime, [spec], Layout("split", 3, 1, tensor_parallel=2), checkpoints, workers
        )
        one = run_mode(runtime, [spec], Layout("split", 2, 1), checkpoints, workers)
    records = tp.records[spec.name]
    assert [r.step for r in records] == [0, 1, 2]
    assert any(r.loss is not None for r in records)
    (window,) = tp.ledger.jobs
    assert set(window.workers) == set(workers) and len(window.rollout_workers) == 2
    sampled = {sp.worker for sp in tp.ledger.spans if sp.op == "sample"}
    synced = {sp.worker for sp in tp.ledger.spans if sp.op == "load_weights"}
    assert sampled == set(window.rollout_workers), (sampled, window)
    assert set(window.rollout_workers) <= synced, synced
    # (its first step's samples, from the same weights: tokens agree but where rounding flips
    # a choice, none of 128 in bench.weight_sync; the steps after follow from them)
    assert tp.trajectory(spec.name)[0][0] == one.trajectory(spec.name)[0][0]
