"""The GRPO job over the public API, on a real process cluster."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import dask
import pytest
import torch
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.rl import GRPOConfig, GRPOJob, group_advantages, run_jobs
from plexrl_dask.rl.objective import group_data
from plexrl_dask.tasks import Problem
from tests.conftest import tiny_spec, unique


@dataclass(frozen=True)
class FirstCharIsDigit:
    """A task an untrained model sometimes solves: the completion must start with a digit.
    (Rewards vary within groups from the first step, so every step trains.)"""

    stop: str = "\n"

    def problems(self, start: int, count: int) -> list[Problem]:
        return [
            Problem(prompt=f"{i % 97}=", answer="1\n", index=i) for i in range(start, start + count)
        ]

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion[:1].isdigit() else 0.0


CONFIG = GRPOConfig(steps=3, prompts_per_step=6, group_size=8, max_tokens=6, lr=1e-2, seed=7)


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv[0] == pytest.approx(math.sqrt(3), rel=1e-5)
    assert adv[1] == pytest.approx(-1 / math.sqrt(3), rel=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_bad_configs_are_typed_errors(runtime):
    with pytest.raises(errors.ConfigError):
        GRPOConfig(group_size=1)
    with pytest.raises(errors.ConfigError):
        GRPOConfig(steps=0)
    policy = runtime.deploy(unique("grpo-bad"), tiny_spec(seed=1))
    with pytest.raises(errors.ConfigError, match="reference"):
        GRPOJob("bad", runtime, FirstCharIsDigit(), policy, GRPOConfig(kl_coef=0.1))

    # A task that is not one is refused when the job is made, each lack named.
    class NoStop:
        def problems(self, start, count):
            return []

        def reward(self, problem, completion):
            return 0.0

    class NotCallable(NoStop):
        stop = "\n"
        reward = 1.0
        score = "yes"

    for bad, lacks in (
        (NoStop(), "stop"),
        (NotCallable(), "reward, score"),
        (object(), "problems"),
    ):
        with pytest.raises(errors.ConfigError, match=lacks):
            GRPOJob("bad", runtime, bad, policy, GRPOConfig())


def test_a_task_is_described_by_its_repr_cut_with_a_digest_where_it_is_long():
    from plexrl_dask.tasks.base import TASK_REPR_CHARS, describe_task

    @dataclass(frozen=True)
    class Rows:
        rows: tuple[str, ...]

    short = Rows(("a", "b"))
    assert describe_task(short) == repr(short)
    big, other = Rows(("x",) * 5000), Rows(("x",) * 4999 + ("y",))
    text = describe_task(big)
    assert len(text) < TASK_REPR_CHARS + 100 and text.startswith(repr(big)[:100])
    assert "sha256" in text and describe_task(other) != text  # (still told apart)


def test_split_and_colocated_jobs_are_bit_identical(runtime, tmp_path):
    """The same job (model, task, seeds) sampling from a separate rollout deployment kept in
    sync, or from the policy itself, computes exactly the same trajectory (docs/architecture.md, "Sampling and determinism")."""
    spec = tiny_spec(seed=11)
    task = FirstCharIsDigit()
    policy = runtime.deploy(unique("grpo-split-policy"), spec)
    rollout = runtime.deploy(unique("grpo-split-rollout"), spec, role="rollout")
    metrics = tmp_path / "split.jsonl"
    split = GRPOJob(
        "split", runtime, task, policy, CONFIG, rollout=rollout, metrics_path=metrics
    ).run()
    alone = runtime.deploy(unique("grpo-colocated"), spec)
    colocated = GRPOJob("colocated", runtime, task, alone, CONFIG).run()

    assert [r.step for r in split] == [0, 1, 2]
    assert all(r.loss is not None and r.groups_used > 0 for r in split)  # every step trained
    assert [r.version for r in split] == [1, 2, 3]
    assert [r.sampled_with for r in split] == [r.sampled_with for r in colocated] == [0, 1, 2]
    for a, b in zip(split, colocated, strict=True):
        assert (a.reward_mean, a.completion_lengths, a.loss, a.grad_norm, a.version) == (
            b.reward_mean,
            b.completion_lengths,
            b.loss,
            b.grad_norm,
            b.version,
        )
    want = plexrl.result(alone.get_weights()).tensors
    got = plexrl.result(policy.get_weights()).tensors
    assert all(torch.equal(got[n], t) for n, t in want.items())
    synced = plexrl.result(rollout.get_weights())
    assert synced.version == 3 and all(torch.equal(synced.tensors[n], t) for n, t in want.items())

    # The metrics file: the config first (all that reproduces the run), then a line per step.
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[0]["config"]["seed"] == 7 and lines[0]["job"] == "split"
    assert [line["step"] for line in lines[1:]] == [0, 1, 2]
    assert lines[1]["reward_mean"] == split[0].reward_mean


def test_a_job_with_a_reference_and_non_default_options_trains_away_from_it(runtime):
    """The reference path: a frozen copy of the starting weights, deployed as a rollout (it
    only scores) and synced once; with ``kl_coef > 0`` every step scores its batch there. At
    step 0 the policy is the reference (KL exactly 0); after updates it drifts (KL > 0). The
    other options run through the same steps: seq-mean aggregation, clip-higher, the k2
    estimator, unbiased std, kept zero-advantage groups, AdamW with weight decay and a cosine
    schedule with warm-up, EOS-only stopping."""
    spec = tiny_spec(seed=13)
    policy = runtime.deploy(unique("grpo-kl-policy"), spec)
    reference = runtime.deploy(unique("grpo-kl-reference"), spec, role="rollout")
    plexrl.result(runtime.sync_weights(policy, reference))
    config = GRPOConfig(
        steps=3, prompts_per_step=4, group_size=8, max_tokens=6, lr=2e-2, seed=7,
        kl_coef=0.1, kl_estimator="k2", loss_aggregation="seq-mean", clip_high=0.28,
        advantage_norm="std-unbiased", keep_zero_advantage=True, weight_decay=0.01,
        lr_schedule="cosine", lr_warmup_steps=1, eos_only=True,
    )  # fmt: skip
    job = GRPOJob("kl", runtime, FirstCharIsDigit(), policy, config, reference=reference)
    assert job._sampling(0).stop == ()  # (EOS only: not the task's stop string)
    assert GRPOJob("s", runtime, FirstCharIsDigit(), policy, GRPOConfig())._sampling(0).stop == (
        FirstCharIsDigit().stop,
    )
    records = job.run()
    assert [r.version for r in records] == [1, 2, 3]
    assert records[0].extra["kl"] == 0.0
    assert records[-1].extra["kl"] > 0.0
    assert all(len(r.completion_lengths) == 32 for r in records)
    ref = plexrl.result(reference.get_weights())
    assert ref.version == 0  # (the reference never trains)


def test_jobs_whose_references_are_one_checkpoint_read_one_copy_of_it(runtime):
    """Two jobs' references deployed from one spec, unsynced (the checkpoint they start from),
    on one worker: the worker holds that model once for both, counted once in what it
    reports. A third job's reference holds the same weights as a copy of its own (synced).
    The three jobs, alike but for their names and references, compute the same records:
    sharing changes nothing."""
    spec = tiny_spec(seed=17)
    worker = sorted(runtime.client.scheduler_info()["workers"])[0]
    config = GRPOConfig(
        steps=2, prompts_per_step=4, group_size=4, max_tokens=6, lr=2e-2, seed=5, kl_coef=0.1
    )
    jobs = []
    for i, shared in enumerate((True, True, False)):
        policy = runtime.deploy(unique(f"grpo-ref-policy-{i}"), spec)
        ref = runtime.deploy(unique(f"grpo-ref-{i}"), spec, role="rollout", workers=[worker])
        if not shared:
            plexrl.result(runtime.sync_weights(policy, ref))  # (its weights, written: its own)
        jobs.append(GRPOJob(f"ref-{i}", runtime, FirstCharIsDigit(), policy, config, reference=ref))
    records = run_jobs(jobs)

    def bases(dask_worker=None):
        from plexrl_dask.worker.holder import holder_of

        status = holder_of(dask_worker).status()
        return list(status["bases"].values()), status["replicas"]

    held_bases, replicas = runtime.client.run(bases, workers=[worker])[worker]
    refs = [j.reference.name for j in jobs]
    [base] = [b for b in held_bases if b["users"] == sorted(refs[:2])]
    assert not any(refs[2] in b["users"] for b in held_bases)
    own = {n: replicas[n]["bytes"] for n in refs}  # (a replica's bytes beside any base)
    # the shared weights counted once, in the base, and in neither reference's own bytes;
    # the synced reference holds a copy of them
    assert own[refs[0]] + own[refs[1]] < base["bytes"] <= own[refs[2]]
    got = [
        [
            (r.reward_mean, r.completion_lengths, r.loss, r.grad_norm, r.extra["kl"])
            for r in records[j.name]
        ]
        for j in jobs
    ]
    assert got[0] == got[1] == got[2] and got[0][0][-1] == 0.0 < got[0][1][-1]


@dataclass(frozen=True)
class AsTokenIds:
    """FirstCharIsDigit's problems with their prompts as token ids (the tiny tokenizer's, which
    adds no special tokens), the text kept in metadata."""

    ids: dict

    stop: str = "\n"

    def problems(self, start: int, count: int) -> list[Problem]:
        return [
            Problem(self.ids[p.prompt], p.answer, p.index, metadata={"text": p.prompt})
            for p in FirstCharIsDigit().problems(start, count)
        ]

    def reward(self, problem: Problem, completion: str) -> float:
        return FirstCharIsDigit().reward(problem, completion)


def test_token_id_prompts_and_weighted_rewards_train_as_text_prompts_do(runtime):
    """The same problems given as token ids compute exactly the text prompts' trajectory; a
    reward of weighted terms (one reading the problem's metadata) is their sum, and the job
    records each term's mean."""
    from plexrl_dask.tasks import RewardTerm, WeightedRewards

    spec = tiny_spec(seed=14)
    config = GRPOConfig(steps=2, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, seed=3)
    texts = FirstCharIsDigit().problems(config.problem_offset, 8)
    probe = runtime.deploy(unique("grpo-ids-probe"), spec)
    ids = {p.prompt: tuple(probe.tokenize(p.prompt)) for p in texts}
    runs = []
    for task in (FirstCharIsDigit(), AsTokenIds(ids)):
        policy = runtime.deploy(unique("grpo-ids"), spec)
        runs.append([(r.reward_mean, r.completion_lengths, r.loss)
                     for r in GRPOJob("ids", runtime, task, policy, config).run()])  # fmt: skip
    assert runs[0] == runs[1]
    weighted = WeightedRewards(
        AsTokenIds(ids),
        (
            RewardTerm("digit", FirstCharIsDigit().reward),
            RewardTerm("echo", lambda p, c: float(c.startswith(p.metadata["text"][:1])), 0.5),
        ),
    )
    policy = runtime.deploy(unique("grpo-weighted"), spec)
    records = GRPOJob("weighted", runtime, weighted, policy, config).run()
    for r in records:
        digit, echo = r.extra["reward/digit"], r.extra["reward/echo"]
        assert r.reward_mean == pytest.approx(digit + 0.5 * echo)


def test_a_rerun_with_the_same_seeds_repeats_and_another_seed_differs(runtime):
    spec = tiny_spec(seed=12)
    task = FirstCharIsDigit()
    runs = []
    for seed in (7, 7, 8):
        policy = runtime.deploy(unique("grpo-rerun"), spec)
        config = GRPOConfig(
            steps=2, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, seed=seed
        )
        runs.append(
            [
                (r.reward_mean, r.completion_lengths, r.loss)
                for r in GRPOJob("r", runtime, task, policy, config).run()
            ]
        )
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.fixture(scope="module")
def tight_client():
    # Room for about two of the six deployments per worker: jobs running together swap state
    # through the node's store all the time.
    budget = int(tiny_spec(seed=0).memory_bytes("train") * 2.5)
    with (
        dask.config.set({"plexrl.worker.memory-budget": budget}),
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client


def three_jobs(client, tag: str) -> list[GRPOJob]:
    jobs = []
    for k in range(3):
        runtime = plexrl.Runtime(client, job=f"{tag}-{k}")
        spec = tiny_spec(seed=20 + k)
        policy = runtime.deploy(unique(f"{tag}-policy{k}"), spec)
        rollout = runtime.deploy(unique(f"{tag}-rollout{k}"), spec, role="rollout")
        config = GRPOConfig(
            steps=3, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, seed=k
        )
        jobs.append(
            GRPOJob(f"job{k}", runtime, FirstCharIsDigit(), policy, config, rollout=rollout)
        )
    return jobs


def test_jobs_multiplexed_on_one_pool_compute_exactly_what_they_compute_alone(tight_client):
    together = run_jobs(three_jobs(tight_client, "mux"))
    alone = {job.name: job.run() for job in three_jobs(tight_client, "solo")}
    runtime = plexrl.Runtime(tight_client, job="check")
    offloads = sum(
        runtime.holder(w).status().result(timeout=30)["counters"]["offloads"]
        for w in runtime.status()["workers"]
    )
    assert offloads > 0  # the pool really swapped jobs' state in and out
    for name, records in alone.items():
        # Every job trained (a step whose groups all scored alike has nothing to train on, so
        # it has no loss; that is an outcome of the samples, compared below like the rest).
        assert sum(r.loss is not None for r in records) >= 2
        got = [
            (r.reward_mean, r.completion_lengths, r.loss, r.grad_norm, r.version)
            for r in together[name]
        ]
        want = [
            (r.reward_mean, r.completion_lengths, r.loss, r.grad_norm, r.version) for r in records
        ]
        assert got == want, name


def test_a_second_epoch_takes_its_ratios_against_the_weights_that_sampled(runtime):
    """``epochs=2``: a step's batch trains twice, both epochs against the log-probabilities of
    the weights that sampled it (scored before the first update). The first epoch's ratios are
    1; the second's are (weights after one update) ÷ (sampling weights), which a twin of the
    policy, given the same first update, reproduces by hand, over the policy's own tokens (a
    multi-turn episode's observation, token 9 here, carries no weight and no ratio)."""
    spec = tiny_spec(seed=13)
    policy = runtime.deploy(unique("grpo-epochs-policy"), spec)
    twin = runtime.deploy(unique("grpo-epochs-twin"), spec)
    config = GRPOConfig(
        steps=1, prompts_per_step=1, group_size=4, max_tokens=6, lr=5e-2, seed=7, epochs=2
    )
    job = GRPOJob("epochs", runtime, FirstCharIsDigit(), policy, config)
    prompt = policy.tokenize("12=")
    completions = [(5, 6), (7,), (8, 9, 10), (11,)]
    masks = [(1, 1), (1,), (1, 0, 1), (1,)]
    data, _ = group_data(config, prompt, completions, [1.0, 0.0, 1.0, 0.0], masks)
    assert data[2].token_weights()[-2] == 0.0  # (the observation)
    first, second = plexrl.result(job._train(0, data))
    assert [first["optim_step"]["version"], second["optim_step"]["version"]] == [1, 2]
    assert first["forward_backward"]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)

    sampling = plexrl.result(twin.forward(data)).logprobs
    behaved = [
        plexrl.Datum(d.tokens, d.weights, d.advantages, tuple(o))
        for d, o in zip(data, sampling, strict=True)
    ]
    plexrl.result(twin.train_step(behaved, config.loss(len(data)), config.optimizer(0)))
    updated = plexrl.result(twin.forward(data)).logprobs
    num = den = 0.0
    for d, old, new in zip(data, sampling, updated, strict=True):
        for w, a, b in zip(d.token_weights(), old, new, strict=True):
            if w > 0:
                num, den = num + w * math.exp(b - a), den + w
    assert abs(num / den - 1.0) > 1e-3  # (the first update moved the weights)
    assert second["forward_backward"]["ratio_mean"] == pytest.approx(num / den, abs=1e-5)


def test_split_async_samples_one_version_behind_and_corrects_for_it(runtime):
    spec = tiny_spec(seed=13)
    task = FirstCharIsDigit()
    config = GRPOConfig(
        steps=4, prompts_per_step=6, group_size=8, max_tokens=6, lr=1e-2, seed=3, staleness=1
    )
    policy = runtime.deploy(unique("grpo-async-policy"), spec)
    rollout = runtime.deploy(unique("grpo-async-rollout"), spec, role="rollout")
    records = GRPOJob("async", runtime, task, policy, config, rollout=rollout).run()
    # Step k trains version k on samples drawn with version k - 1 (the first step: version 0).
    assert [r.sampled_with for r in records] == [0, 0, 1, 2]
    assert [r.version for r in records] == [1, 2, 3, 4]
    assert plexrl.result(rollout.get_weights()).version == 4  # and ends with the final weights
    # Its first step equals the synchronous job's (same samples, same weights); the second
    # already differs (its samples came from the old weights).
    sync_policy = runtime.deploy(unique("grpo-sync-policy"), spec)
    sync_rollout = runtime.deploy(unique("grpo-sync-rollout"), spec, role="rollout")
    synchronous = GRPOJob(
        "sync",
        runtime,
        task,
        sync_policy,
        GRPOConfig(**{**config.__dict__, "staleness": 0}),
        rollout=sync_rollout,
    ).run()
    assert [r.sampled_with for r in synchronous] == [0, 1, 2, 3]
    assert records[0].completion_lengths == synchronous[0].completion_lengths
    assert records[0].loss == pytest.approx(synchronous[0].loss, abs=1e-6)  # ratio ~1 vs exactly 1
    with pytest.raises(errors.ConfigError, match="rollout"):
        GRPOJob("bad", runtime, task, policy, config)


def test_the_documented_dataset_task_trains_through_a_job(runtime):
    """docs/tasks.md's task, defined as a user's script defines it (not importable by the
    workers: it travels by value), over a finite dataset from index 0: each step scores its
    own rows, epochs wrap, and the job runs its steps."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "tasks.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    namespace: dict = {"__name__": "__main__"}  # (a script's classes travel by value)
    exec(compile(code, "docs/tasks.md", "exec", dont_inherit=True), namespace)  # noqa: S102
    rows = tuple((f"{i}+{i}=", str(2 * i)) for i in range(10))
    task = namespace["QATask"]("qa", rows, seed=3)
    config = GRPOConfig(
        steps=3, prompts_per_step=4, group_size=4, max_tokens=4, seed=5, problem_offset=0
    )
    policy = runtime.deploy(unique("dataset-task"), tiny_spec(seed=21))
    records = GRPOJob("dataset", runtime, task, policy, config).run()
    assert [r.step for r in records] == [0, 1, 2]
    assert all(len(r.completion_lengths) == 16 and 0.0 <= r.reward_mean <= 1.0 for r in records)
    # (step 2's rows are 8, 9 of the first epoch, then 0, 1 of the second, reshuffled)
    assert [p.index for p in task.problems(8, 4)] == [8, 9, 10, 11]


@dataclass(frozen=True)
class EightRows:
    """A finite dataset that does not wrap its indices: 8 rows, then IndexError."""

    stop: str = "\n"

    def problems(self, start: int, count: int) -> list[Problem]:
        rows = [f"{i}+{i}=" for i in range(8)]
        return [Problem(rows[i], "0\n", i) for i in range(start, start + count)]

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion[:1].isdigit())


def test_a_task_that_runs_out_of_problems_stops_its_job_with_a_typed_error(runtime):
    config = GRPOConfig(
        steps=3, prompts_per_step=4, group_size=2, max_tokens=2, seed=1, problem_offset=0
    )
    policy = runtime.deploy(unique("eight-rows"), tiny_spec(seed=22))
    job = GRPOJob("eight", runtime, EightRows(), policy, config)
    with pytest.raises(errors.ConfigError, match=r"problems\(8, 4\) \(step 2\) failed: IndexError"):
        job.run()
    assert [r.step for r in job.records] in ([0], [0, 1])  # (step 2's problems: asked ahead)
    assert plexrl.result(policy.forward([plexrl.Datum(tokens=(5, 6, 7))])).logprobs  # serves
