"""A GRPO job's checkpoints: stopped and resumed on new deployments, it computes exactly what
an uninterrupted run computes; a checkpoint of another job is refused and left whole."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

import dask
import numpy as np
import pytest
import torch

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.cli import main as cli_main
from plexrl_dask.rl import GRPOConfig, GRPOJob, JobCheckpoints, read_checkpoint, run_jobs
from plexrl_dask.rl.job_checkpoint import FORMAT, hold
from plexrl_dask.state_store.store import StateStore
from plexrl_dask.tasks import Problem
from tests.conftest import tiny_spec, unique
from tests.test_grpo import FirstCharIsDigit

CONFIG = GRPOConfig(steps=5, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, seed=5)
MODES = {"colocated": 0, "split": 0, "split-async": 1}


class Stop(Exception):
    """The driver dies (raised from ``on_step``)."""


def deployments(runtime, mode: str, seed: int):
    policy = runtime.deploy(unique(f"ck-{mode}-policy"), tiny_spec(seed=seed))
    if mode == "colocated":
        return policy, None
    rollout = runtime.deploy(unique(f"ck-{mode}-rollout"), tiny_spec(seed=seed), role="rollout")
    plexrl.result(runtime.sync_weights(policy, rollout))
    return policy, rollout


def job(runtime, mode: str, seed: int, config: GRPOConfig = CONFIG, **kwargs) -> GRPOJob:
    policy, rollout = deployments(runtime, mode, seed)
    config = replace(config, staleness=MODES[mode])
    return GRPOJob(mode, runtime, FirstCharIsDigit(), policy, config, rollout=rollout, **kwargs)


def comparable(records) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "wall_s"} for r in records]


def stop_after(step: int):
    def on_step(record) -> None:
        if record.step == step:
            raise Stop

    return on_step


@pytest.mark.parametrize("mode", list(MODES))
def test_a_resumed_job_computes_what_an_uninterrupted_run_computes(runtime, tmp_path, mode):
    whole = job(runtime, mode, seed=21)
    want = whole.run()
    assert all(r.loss is not None for r in want)  # every step trained

    # Every 2 steps, stopped after step 2: the checkpoint holds 2 steps, step 2 is redone.
    ck = JobCheckpoints.at(tmp_path / "ck", every=2, keep=2)
    first = job(runtime, mode, seed=21, checkpoints=ck)
    with pytest.raises(Stop):
        first.run(stop_after(2))
    saved = read_checkpoint(ck.directory)
    assert saved is not None and saved.steps_done == 2
    assert (saved.rollout is not None) == (mode != "colocated")
    assert len((ck.directory / "steps.jsonl").read_text().splitlines()) == 3
    for d in (first.policy, first.rollout):
        if d is not None:
            runtime.undeploy(d.name)

    # New deployments from another initialisation: what they hold comes from the checkpoint.
    metrics = tmp_path / "resumed.jsonl"
    resumed = job(runtime, mode, seed=99, checkpoints=ck, metrics_path=metrics)
    got = resumed.run()
    assert comparable(got) == comparable(want)
    final = plexrl.result(whole.policy.get_weights()).tensors
    weights = plexrl.result(resumed.policy.get_weights())
    assert weights.version == want[-1].version
    assert all(torch.equal(weights.tensors[n], t) for n, t in final.items())
    if resumed.rollout is not None:  # and the rollout ends with the final weights
        synced = plexrl.result(resumed.rollout.get_weights()).tensors
        assert all(torch.equal(synced[n], t) for n, t in final.items())

    # The directory: every step once, the last checkpoint at the end, two checkpoints kept.
    saved = read_checkpoint(ck.directory)
    assert saved.steps_done == 5 and saved.version == want[-1].version
    lines = [json.loads(line) for line in (ck.directory / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4]
    assert [r["reward_mean"] for r in lines] == [r.reward_mean for r in want]
    store = StateStore(ck.store)
    held = {(m, v) for m in store.models() for v in store.versions(m)}
    kept = [saved.policy, saved.rollout, *(s for pair in saved.kept for s in pair)]
    assert held == {(s["model"], s["version"]) for s in kept if s}
    assert len(saved.kept) == 1 and saved.kept[0][0]["version"] == want[3].version
    # The metrics file of the resumed run reads as an uninterrupted run's.
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows[0]["config"]["seed"] == CONFIG.seed
    assert [r["step"] for r in rows[1:]] == [0, 1, 2, 3, 4]

    # A finished job resumed again does nothing more; continued for more steps, it goes on
    # exactly as a longer run would.
    assert comparable(job(runtime, mode, seed=99, checkpoints=ck).run()) == comparable(want)
    longer = job(runtime, mode, seed=21, config=replace(CONFIG, steps=7)).run()
    more = job(runtime, mode, seed=99, config=replace(CONFIG, steps=7), checkpoints=ck)
    assert comparable(more.run()) == comparable(longer)


def test_a_checkpoint_of_another_job_is_refused_and_left_whole(runtime, tmp_path, capsys):
    ck = JobCheckpoints.at(tmp_path / "ck", every=1)
    short = replace(CONFIG, steps=2)
    done = job(runtime, "colocated", seed=22, config=short, checkpoints=ck).run()
    manifest = (ck.directory / "job.json").read_bytes()
    steps = (ck.directory / "steps.jsonl").read_bytes()

    other = job(runtime, "colocated", seed=23, config=replace(short, lr=2e-2), checkpoints=ck)
    with pytest.raises(errors.CheckpointIncompatible, match="lr"):
        other.run()
    # nothing was loaded into the other job's deployment, nothing in the directory changed
    assert plexrl.result(other.policy.get_weights()).version == 0
    assert (ck.directory / "job.json").read_bytes() == manifest
    assert (ck.directory / "steps.jsonl").read_bytes() == steps
    wider = runtime.deploy(unique("ck-wider"), tiny_spec(seed=23, hidden_size=64))
    with pytest.raises(errors.CheckpointIncompatible, match="model"):
        GRPOJob("colocated", runtime, FirstCharIsDigit(), wider, short, checkpoints=ck).run()
    with pytest.raises(errors.CheckpointIncompatible, match="staleness"):
        job(runtime, "split-async", seed=23, config=short, checkpoints=ck).run()
    with pytest.raises(errors.CheckpointError, match="resume it or give a new directory"):
        job(
            runtime, "colocated", seed=23, config=short, checkpoints=replace(ck, resume=False)
        ).run()
    # A job that must resume (its deployments were given no state) and finds no checkpoint
    # fails typed: no fresh start from whatever its deployments hold, nothing written.
    gone = replace(ck, directory=tmp_path / "removed", required=True)
    with pytest.raises(errors.CheckpointNotFound, match="holds no checkpoint"):
        job(runtime, "colocated", seed=23, config=short, checkpoints=gone).run()
    assert read_checkpoint(gone.directory) is None
    assert {f.name for f in gone.directory.iterdir()} <= {"lock"}  # (the job's lock file)

    # another job runs on this directory: refused, nothing touched
    rival = job(runtime, "colocated", seed=23, config=short, checkpoints=ck)
    with hold(ck.directory), pytest.raises(errors.CheckpointError, match="in use by another"):
        rival.run()
    assert (ck.directory / "job.json").read_bytes() == manifest

    # What the directory holds, for an operator (and a typed refusal of what is not one).
    assert cli_main(["checkpoint", str(ck.directory)]) == 0
    shown = capsys.readouterr().out
    assert "job colocated, 2 of 2 steps done" in shown
    assert cli_main(["checkpoint", str(tmp_path / "nothing")]) == 2

    # The same job still resumes from it, untouched by the refusals.
    again = job(runtime, "colocated", seed=23, config=short, checkpoints=ck).run()
    assert comparable(again) == comparable(done)

    # A damaged directory is a typed error, never a silent fresh start.
    (ck.directory / "steps.jsonl").write_bytes(steps.splitlines(keepends=True)[0])
    with pytest.raises(errors.CheckpointIncomplete, match="1 readable steps of the 2"):
        job(runtime, "colocated", seed=23, config=short, checkpoints=ck).run()
    (ck.directory / "job.json").write_text("{")
    with pytest.raises(errors.CheckpointError, match="cannot read"):
        job(runtime, "colocated", seed=23, config=short, checkpoints=ck).run()


def test_jobs_past_their_timeout_stop_before_their_next_step(runtime, tmp_path):
    """``run_jobs`` past its timeout (as on Ctrl-C) stops every job between two steps,
    instead of waiting for the rest of its steps; the checkpoint holds every step done."""
    ck = JobCheckpoints.at(tmp_path / "ck", every=1)
    endless = job(runtime, "colocated", seed=24, config=replace(CONFIG, steps=1000), checkpoints=ck)
    with pytest.raises(errors.RequestTimeout, match="stopped before its next step"):
        run_jobs([endless], timeout=3.0)
    assert len(endless.records) < 1000
    assert read_checkpoint(ck.directory).steps_done == len(endless.records)
    with pytest.raises(errors.JobStopped):  # (a stopped job stays stopped)
        endless.run()


def test_checkpoint_settings_are_checked():
    for bad in ({"every": 0}, {"keep": 0}, {"every": 1.5}, {"every": True},
                {"max_recoveries": False}, {"keep": "2"}):  # fmt: skip
        with pytest.raises(errors.ConfigError):
            JobCheckpoints.at("/tmp/unused", **bad)
    for key, bad in (("every", "five"), ("keep", 1.5), ("every", None)):
        setting = {f"plexrl.job-checkpoint.{key}": bad}
        with dask.config.set(setting), pytest.raises(errors.ConfigError, match=key):
            JobCheckpoints.at("/tmp/unused")
    ck = JobCheckpoints.at("/tmp/unused", every=np.int64(3))
    assert ck.every == 3 and type(ck.every) is int
    assert [n for n in range(1, 8) if ck.due(n, 7)] == [3, 6, 7]


@pytest.mark.parametrize(
    "field, value",
    [("time", "yesterday"), ("config", [1]), ("steps_done", "2"), ("steps_done", -3),
     ("version", True), ("job", None)],  # fmt: skip
)
def test_a_manifest_of_the_wrong_shape_is_a_checkpoint_error_and_keeps_the_steps(
    tmp_path, field, value
):
    """A manifest's plain fields are checked as its saves are: a typed error, and the step
    records untouched (a negative steps_done once cut steps.jsonl to nothing)."""
    manifest = {
        "job": "j", "config": {}, "task": "t", "model": {}, "steps_done": 1, "version": 1,
        "policy": {"model": "m", "version": 1}, "rollout": None, "format": FORMAT,
    }  # fmt: skip
    (tmp_path / "steps.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "job.json").write_text(json.dumps({**manifest, field: value}))
    with pytest.raises(errors.CheckpointError, match=field):
        read_checkpoint(tmp_path)
    assert (tmp_path / "steps.jsonl").read_text() == '{"step": 0}\n'


class NeverRight(FirstCharIsDigit):
    """A task no completion solves: no step trains (every group's rewards are equal)."""

    def reward(self, problem, completion: str) -> float:
        return 0.0


def test_a_job_whose_steps_train_nothing_resumes(runtime, tmp_path):
    """The manifest holds the deployment's own version, not the records' (which, without
    training, repeat the caller's ``start_version``): such a job resumes too."""
    ck = JobCheckpoints.at(tmp_path / "ck", every=1)
    config = replace(CONFIG, steps=3)

    def idle(seed: int) -> GRPOJob:
        policy = runtime.deploy(unique("ck-idle"), tiny_spec(seed=seed))
        return GRPOJob("idle", runtime, NeverRight(), policy, config, start_version=7,
                       checkpoints=ck)  # fmt: skip

    with pytest.raises(Stop):
        idle(25).run(stop_after(1))
    got = idle(26).run()
    assert [r.loss for r in got] == [None] * 3 and read_checkpoint(ck.directory).version == 0


@dataclass(frozen=True)
class Rows:
    """A dataset task whose repr leaves its rows out (docs/tasks.md's advice)."""

    rows: tuple[str, ...] = field(repr=False)
    stop: str = "\n"

    def problems(self, start: int, count: int) -> list[Problem]:
        n = len(self.rows)
        return [Problem(self.rows[i % n], "1\n", i) for i in range(start, start + count)]

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion[:1].isdigit())


def test_a_checkpoint_of_the_same_task_with_other_data_is_refused(runtime, tmp_path):
    """Two datasets whose tasks print alike: the checkpoint's problems say which trained."""
    ck = JobCheckpoints.at(tmp_path / "ck", every=1)
    config = replace(CONFIG, steps=2, problem_offset=0)
    mine, theirs = Rows(tuple(f"{i}+1=" for i in range(12))), Rows(("7+7=", "8+8="))
    assert repr(mine) == repr(theirs)

    def rows_job(task: Rows, seed: int) -> GRPOJob:
        policy = runtime.deploy(unique("ck-rows"), tiny_spec(seed=seed))
        return GRPOJob("rows", runtime, task, policy, config, checkpoints=ck)

    done = rows_job(mine, 31).run()
    assert read_checkpoint(ck.directory).problems is not None
    with pytest.raises(errors.CheckpointIncompatible, match="other problems"):
        rows_job(theirs, 32).run()
    assert comparable(rows_job(mine, 32).run()) == comparable(done)


def test_a_manifest_never_counts_step_records_a_crash_can_lose(tmp_path, monkeypatch):
    """The step records are flushed to disk before the manifest that counts them replaces
    the old one, and the rename is made durable with its directory."""
    from plexrl_dask.rl import job_checkpoint as jc

    jc.append_step(tmp_path, {"step": 0})
    order = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        order.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recorded_replace(src, dst):
        order.append(("replace", str(dst)))
        return replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    ckpt = jc.JobCheckpoint("j", {}, "t", {}, 1, 1, {"path": "p", "model": "m", "version": 1}, None)
    jc.write_checkpoint(tmp_path, ckpt)
    names = [(op, os.path.basename(p)) for op, p in order]
    assert names[0] == ("fsync", jc.STEPS)
    assert names[-2:] == [("replace", jc.MANIFEST), ("fsync", tmp_path.name)]
    assert jc.read_checkpoint(tmp_path) == ckpt


def test_a_save_left_by_a_driver_that_died_does_not_block_the_resume(runtime, tmp_path):
    """The driver died after saving the policy's state of a step whose manifest it never
    wrote: the resumed job's save of that version meets a version no manifest refers to,
    with other bytes (on a GPU a redone step need not be bit-identical). It is pruned when
    the job resumes, and the job goes on."""
    ck = JobCheckpoints.at(tmp_path / "ck", every=2, keep=2)
    name = unique("orphan")
    policy = runtime.deploy(name, tiny_spec(seed=23))
    first = GRPOJob("orphan", runtime, FirstCharIsDigit(), policy, CONFIG, checkpoints=ck)
    with pytest.raises(Stop):
        first.run(stop_after(2))
    saved = read_checkpoint(ck.directory)
    # the next checkpoint's version, saved with other bytes than the redone steps will give
    w = plexrl.result(policy.get_weights()).tensors
    plexrl.result(policy.set_weights({n: t + 1 for n, t in w.items()}, version=4))
    orphan = plexrl.result(policy.save_state(ck.store))
    assert orphan["version"] == 4 and saved.version < 4
    runtime.undeploy(name)
    again = runtime.deploy(name, tiny_spec(seed=99))
    resumed = GRPOJob("orphan", runtime, FirstCharIsDigit(), again, CONFIG, checkpoints=ck)
    assert len(resumed.run()) == CONFIG.steps
    assert read_checkpoint(ck.directory).steps_done == CONFIG.steps
