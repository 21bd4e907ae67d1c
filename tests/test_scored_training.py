"""Scored training (``plexrl_dask/rl/scoring.py``): a GRPO step scored in its training request
on the worker computes what the driver path computes, on one worker, over a sharded policy
and with a rollout; a recipe that does not fit is refused there, typed, with nothing trained."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import dask
import pytest
import torch

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.rl import GRPOConfig, GRPOJob
from plexrl_dask.rl.scoring import ScoringRecipe, score_samples
from plexrl_dask.shared.checks import rank_shares, whole_batch_loss
from plexrl_dask.shared.types import Datum, PolicyGradient, SampledSequence, SampleResult
from plexrl_dask.tasks import Problem
from tests.conftest import tiny_spec, unique
from tests.test_grpo import CONFIG, FirstCharIsDigit

RECORDED = ("reward_mean", "reward_max", "groups_used", "sampled_tokens", "completion_lengths",
            "loss", "grad_norm", "version", "sampled_with", "extra")  # fmt: skip


def _records(records):
    return [[getattr(r, k) for k in RECORDED] for r in records]


def _weights(deployment):
    return plexrl.result(deployment.get_weights()).tensors


def test_scores_and_shares_are_the_driver_paths():
    """The pure parts: scores per group, data only from groups that teach, contiguous rank
    shares, and the whole batch's normaliser on every rank."""
    task = FirstCharIsDigit()
    problems = task.problems(0, 2)

    def seq(text: str) -> SampledSequence:
        n = len(text)
        return SampledSequence(tuple(range(5, 5 + n)), (0.0,) * n, text, "stop")

    out = SampleResult(
        prompt_tokens=((1, 2), (1, 3)),
        sequences=((seq("1a"), seq("b")), (seq("c"), seq("dd"))),  # group 2 all wrong
    )
    scored = score_samples(task, GRPOConfig(group_size=2), problems, out)
    assert scored.summary.rewards == (1.0, 0.0, 0.0, 0.0)
    assert scored.summary.lengths == (2, 1, 1, 2)
    assert scored.summary.groups_used == 1 and scored.summary.sampled_tokens == 6
    assert [d.tokens for d in scored.data] == [(1, 2, 5, 6), (1, 2, 5)]
    assert scored.data[0].advantages[-1] > 0 > scored.data[1].advantages[-1]

    batch = [Datum.from_prompt_completion((1,), (2,) * n, advantage=1.0) for n in (1, 2, 3)]
    assert [len(s) for s in rank_shares(batch, 2)] == [2, 1]
    with pytest.raises(errors.InvalidBatch):
        rank_shares(batch, 4)
    loss = PolicyGradient()
    assert whole_batch_loss(loss, batch, 1) is loss
    assert whole_batch_loss(loss, batch, 2).normalizer == sum(sum(d.token_weights()) for d in batch)


def test_scored_steps_record_and_train_what_driver_steps_do(runtime):
    """Colocated on one worker and split with a rollout: scored on the worker or on the
    driver, the same records and the same final weights; colocated, each step one
    ``sample_train`` request or a sample and a training request, the same again."""
    spec = tiny_spec(seed=11)  # (every step of CONFIG trains from these weights)
    task = FirstCharIsDigit()
    runs = {}
    for where in (True, False):
        policy = runtime.deploy(unique("scored-colocated"), spec)
        job = GRPOJob("j", runtime, task, policy, CONFIG, score_on_worker=where, fuse_steps=False)
        assert not job._fuses
        runs["colocated", where] = (job.run(), _weights(policy))
        policy = runtime.deploy(unique("scored-split"), spec)
        rollout = runtime.deploy(unique("scored-rollout"), spec, role="rollout")
        job = GRPOJob("j", runtime, task, policy, CONFIG, rollout, score_on_worker=where)
        runs["split", where] = (job.run(), _weights(policy))
        assert plexrl.result(rollout.get_weights()).version == 3  # (synced after the last)
    policy = runtime.deploy(unique("scored-fused"), spec)
    job = GRPOJob("j", runtime, task, policy, CONFIG)
    assert job._fuses  # (the default for a colocated job on one worker)
    runs["fused", True] = (job.run(), _weights(policy))
    runs["fused", False] = runs["colocated", False]
    for mode in ("colocated", "split", "fused"):
        (on_worker, w_worker), (on_driver, w_driver) = runs[mode, True], runs[mode, False]
        assert [r.version for r in on_worker] == [1, 2, 3]  # (every step trained)
        assert _records(on_worker) == _records(on_driver)
        assert all(torch.equal(w_worker[n], t) for n, t in w_driver.items())


def _span_ops(runtime, deployment: str) -> list[str]:
    spans = [s for s in runtime.timeline(since=0.0) if s.deployment == deployment]
    return [s.op for s in sorted(spans, key=lambda s: s.start)]


def test_a_fused_step_is_a_sample_and_a_training_on_its_worker_and_checkpoints_see_its_weights(
    runtime, tmp_path
):
    """Each fused step shows on its worker as a ``sample`` then a ``train_step`` request; a
    checkpoint taken after a step holds that step's weights (the next step is not queued
    before it), so a job resumed from it computes what the uninterrupted job did."""
    from plexrl_dask.rl import JobCheckpoints

    spec, task = tiny_spec(seed=11), FirstCharIsDigit()
    config = replace(CONFIG, steps=4)
    policy = runtime.deploy(unique("fused-spans"), spec)
    whole = GRPOJob("j", runtime, task, policy, config).run()
    ops = _span_ops(runtime, policy.name)
    assert ops.count("sample") == 4 and ops[-2:] == ["sample", "train_step"]

    ck = JobCheckpoints.at(tmp_path / "ck", every=2)
    first = runtime.deploy(unique("fused-ck"), spec)
    half = GRPOJob("j", runtime, task, first, replace(config, steps=2), checkpoints=ck)
    assert half._fuses
    half.run()
    again = runtime.deploy(unique("fused-resumed"), spec)
    resumed = GRPOJob("j", runtime, task, again, config, checkpoints=ck).run()
    assert _records(resumed) == _records(whole)


def test_a_stopped_fused_job_ends_with_the_weights_of_its_last_record(runtime):
    """Stopped while the next step is queued behind the one running: that step still runs,
    so it is recorded too; the policy's version is the last record's."""
    policy = runtime.deploy(unique("fused-stop"), tiny_spec(seed=11))
    job = GRPOJob("j", runtime, FirstCharIsDigit(), policy, replace(CONFIG, steps=6))

    def stop_after_first(record) -> None:
        if record.step == 0:
            job.stop()

    with pytest.raises(errors.JobStopped):
        job.run(stop_after_first)
    assert 1 <= len(job.records) <= 2
    assert plexrl.result(policy.get_weights()).version == job.records[-1].version


def test_sample_train_refuses_what_it_cannot_run_typed_with_nothing_trained(runtime):
    """A sharded policy is refused by the driver; arguments the driver would refuse, sent
    around it, are refused by the worker before anything trains."""
    from plexrl_dask.rl.scoring import seal_recipe
    from plexrl_dask.worker import ops

    task = FirstCharIsDigit()
    problems = tuple(task.problems(0, 2))
    params = plexrl.SamplingParams(n=4, max_tokens=4, seed=1)
    recipe = seal_recipe(ScoringRecipe(task, replace(CONFIG, group_size=4), problems, 0))
    sharded = runtime.deploy(unique("fused-sharded"), tiny_spec(seed=34), world_size=2)
    with pytest.raises(errors.InvalidRecipe, match="single-worker"):
        sharded.sample_train([p.prompt for p in problems], params, recipe)

    policy = runtime.deploy(unique("fused-bad"), tiny_spec(seed=34))
    before = _weights(policy)
    prompts = [p.prompt for p in problems]
    bad_params = dataclasses.replace(params)
    object.__setattr__(bad_params, "max_tokens", -3)  # (a client that skipped the checks)
    with pytest.raises(errors.InvalidSamplingParams):
        plexrl.result(policy._submit("sample_train", ops.sample_train,
                                     [(prompts, bad_params, None, None, recipe)]))  # fmt: skip
    with pytest.raises(errors.InvalidRecipe, match="does not unpickle"):
        plexrl.result(policy.sample_train(prompts, params, b"not a recipe"))
    with pytest.raises(errors.InvalidRecipe, match="1 problems"):
        plexrl.result(policy.sample_train(prompts, params, replace_problems(recipe, problems)))
    assert all(torch.equal(before[n], t) for n, t in _weights(policy).items())
    done = plexrl.result(policy.sample_train(prompts, params, recipe))
    assert len(done["scored"].rewards) == 8


def replace_problems(recipe: bytes, problems) -> bytes:
    """``recipe`` for the first of ``problems`` only (more samples than it has problems)."""
    from plexrl_dask.rl.scoring import seal_recipe, unseal_recipe

    whole = unseal_recipe(recipe)
    return seal_recipe(replace(whole, problems=tuple(problems[:1])))


def test_a_sharded_policy_scores_on_every_rank_as_one_process_would(runtime):
    """A two-rank FSDP policy: each rank scores the same samples and trains its share; the
    records equal the driver path's over the same policy."""
    spec = tiny_spec(seed=32)
    config = replace(CONFIG, steps=2)
    records = {}
    for where in (True, False):
        policy = runtime.deploy(unique("scored-fsdp"), spec, world_size=2)
        job = GRPOJob("j", runtime, FirstCharIsDigit(), policy, config, score_on_worker=where)
        records[where] = job.run()
    assert records[True][-1].version >= 1  # (something trained)
    assert _records(records[True]) == _records(records[False])


class NothingRight(FirstCharIsDigit):
    def reward(self, problem: Problem, completion: str) -> float:
        return 0.0


def test_a_step_with_nothing_to_learn_trains_nothing(runtime):
    policy = runtime.deploy(unique("scored-flat"), tiny_spec(seed=33))
    before = _weights(policy)
    records = GRPOJob("j", runtime, NothingRight(), policy, replace(CONFIG, steps=2)).run()
    assert [(r.version, r.loss, r.groups_used) for r in records] == [(0, None, 0), (0, None, 0)]
    assert all(torch.equal(before[n], t) for n, t in _weights(policy).items())


def test_a_recipe_that_does_not_fit_is_refused_by_the_worker_with_nothing_trained(runtime):
    """Whatever the driver checked: a recipe rebuilt around its constructor (a config out of
    range, a problem count that is not the samples'), or samples that are not a sample
    request's, fail typed on the worker; the policy is untouched and serves the next step."""
    policy = runtime.deploy(unique("scored-bad"), tiny_spec(seed=34))
    task = FirstCharIsDigit()
    params = plexrl.SamplingParams(n=4, max_tokens=4, seed=1)
    problems = tuple(task.problems(0, 2))
    samples = policy.sample([p.prompt for p in problems], params)
    before = _weights(policy)

    def forged(**fields) -> ScoringRecipe:
        recipe = ScoringRecipe(task, replace(CONFIG, group_size=4), problems, 0)
        bad = object.__new__(ScoringRecipe)  # (a client that skipped the constructor)
        for f in dataclasses.fields(recipe):
            object.__setattr__(bad, f.name, fields.get(f.name, getattr(recipe, f.name)))
        return bad

    bad_config = object.__new__(GRPOConfig)
    for f in dataclasses.fields(CONFIG):
        object.__setattr__(bad_config, f.name, getattr(CONFIG, f.name))
    object.__setattr__(bad_config, "group_size", 1)
    with pytest.raises(errors.ConfigError, match="group_size"):
        plexrl.result(policy.train_scored(samples, forged(config=bad_config)))
    with pytest.raises(errors.InvalidRecipe, match="2 sampled groups for 1 problems"):
        plexrl.result(policy.train_scored(samples, forged(problems=problems[:1])))
    with pytest.raises(errors.InvalidRecipe, match="step"):
        plexrl.result(policy.train_scored(samples, forged(step=-1)))
    scattered = runtime.client.scatter(["not samples"])[0]
    with pytest.raises(errors.InvalidRecipe, match="SampleResult"):
        plexrl.result(policy.train_scored(scattered, forged()))
    with pytest.raises(errors.InvalidRecipe, match="future"):
        policy.train_scored(plexrl.result(samples), forged())  # (the driver's own check)
    with pytest.raises(errors.InvalidRecipe, match="reward"):
        ScoringRecipe(object(), CONFIG, problems, 0)  # type: ignore[arg-type]

    assert all(torch.equal(before[n], t) for n, t in _weights(policy).items())
    done = plexrl.result(policy.train_scored(samples, forged()))
    assert len(done["scored"].rewards) == 8


TASK_MODULE = """
from dataclasses import dataclass
from plexrl_dask.tasks import Problem


def _digit_first(text):
    return 1.0 if text[:1].isdigit() else 0.0


@dataclass(frozen=True)
class LocalTask:
    stop: str = "\\n"

    def problems(self, start, count):
        return [Problem(prompt=f"{i % 97}=", answer="1\\n", index=i) for i in range(start, start + count)]

    def reward(self, problem, completion):
        return _digit_first(completion)
"""


def test_a_task_from_a_module_the_workers_lack_is_sealed_by_value(runtime, tmp_path, monkeypatch):
    """A task class in a module only the driver can import (a script's helper, a notebook's
    file) still scores on the worker: its class travels by value; bytes that are not a
    recipe are refused typed."""
    (tmp_path / "only_here_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from only_here_task import LocalTask  # type: ignore[import-not-found]

    modules = runtime.client.run(
        lambda: __import__("importlib.util").util.find_spec("only_here_task")
    )
    assert set(modules.values()) == {None}  # (the workers cannot import it)
    policy = runtime.deploy(unique("scored-local-task"), tiny_spec(seed=11))
    job = GRPOJob("j", runtime, LocalTask(), policy, replace(CONFIG, steps=2))
    assert job.score_on_worker
    records = job.run()
    assert records[-1].version >= 1 and records[0].reward_mean > 0

    samples = policy.sample(["1="], plexrl.SamplingParams(n=2, max_tokens=2, seed=1))
    with pytest.raises(errors.InvalidRecipe, match="does not unpickle"):
        plexrl.result(policy.train_scored(samples, b"not a recipe"))


@dataclasses.dataclass(frozen=True)
class SlowFirstCharIsDigit(FirstCharIsDigit):
    """FirstCharIsDigit whose reward sleeps ``delay`` s a call and writes, to ``log``, the
    process it ran in and the problem's index."""

    log: str = ""
    delay: float = 0.0

    def reward(self, problem: Problem, completion: str) -> float:
        import os
        import time

        time.sleep(self.delay)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {problem.index}\n")
        return super().reward(problem, completion)


def _scored_where(log, config) -> list[set[int]]:
    """Per step, the processes its rewards ran in."""
    where: list[set[int]] = [set() for _ in range(config.steps)]
    for line in log.read_text().splitlines():
        pid, index = map(int, line.split())
        where[(index - config.problem_offset) // config.prompts_per_step].add(pid)
    return where


def test_a_reward_over_the_limit_moves_to_the_driver_with_the_same_records(runtime, tmp_path):
    """A reward slower than ``plexrl.grpo.worker-reward-limit`` over a step, scored on the
    worker, moves to the driver from the next step the job submits: fused, the step already
    queued behind it still scores on the worker; unfused, the next step's samples are
    scored on the driver. Same records as a job scored on the driver throughout."""
    import os

    config = replace(CONFIG, steps=4)
    workers = set(runtime.client.run(os.getpid).values())
    driver = {os.getpid()}
    runs = {}
    for name, kwargs in (
        ("driver", {"score_on_worker": False}),
        ("fused", {}),
        ("unfused", {"fuse_steps": False}),
    ):
        log = tmp_path / f"{name}.log"
        task = SlowFirstCharIsDigit(log=str(log), delay=0.003)  # (48 calls: ~0.14 s a step)
        policy = runtime.deploy(unique(f"slow-reward-{name}"), tiny_spec(seed=11))
        with dask.config.set({"plexrl.grpo.worker-reward-limit": "50ms"}):
            job = GRPOJob("j", runtime, task, policy, config, **kwargs)
        runs[name] = job.run()
        where = _scored_where(log, config)
        if name == "driver":
            assert job.reward_moved_at is None and where == [driver] * 4
        else:
            assert job.reward_moved_at == 0
            on_worker = 2 if name == "fused" else 1
            assert all(len(w) == 1 and w <= workers for w in where[:on_worker])
            assert where[on_worker:] == [driver] * (4 - on_worker)
    assert _records(runs["fused"]) == _records(runs["driver"]) == _records(runs["unfused"])

    log = tmp_path / "unlimited.log"
    policy = runtime.deploy(unique("slow-reward-unlimited"), tiny_spec(seed=11))
    with dask.config.set({"plexrl.grpo.worker-reward-limit": None}):
        job = GRPOJob("j", runtime, SlowFirstCharIsDigit(log=str(log), delay=0.003), policy,
                      replace(config, steps=2))  # fmt: skip
    job.run()
    where = _scored_where(log, replace(config, steps=2))
    assert job.reward_moved_at is None and all(len(w) == 1 and w <= workers for w in where)
