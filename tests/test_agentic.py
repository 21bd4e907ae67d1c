"""Agentic GRPO: multi-turn episodes with tool calls, one turn per request, observations
masked out of the loss, and the same trajectory alone and multiplexed (real process cluster)."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.models.tokenizer import build_char_tokenizer
from plexrl_dask.rl import GRPOConfig, GRPOJob, run_jobs
from plexrl_dask.rl.episodes import Episode, Turn, transcript_datum, turn_calls
from plexrl_dask.rl.objective import group_data
from plexrl_dask.rl.warmup import supervised_warmup
from plexrl_dask.shared.timeline import TOOL_TOPIC
from plexrl_dask.tasks.agentic import MultiplyTask, is_agentic
from plexrl_dask.tasks.arithmetic import ArithmeticTask
from plexrl_dask.tools import Calculator, ToolCall
from plexrl_dask.tools.pool import driver_lane
from tests.conftest import tiny_spec, unique


class CharDeployment:
    """What transcript_datum needs of a deployment: its tokenizer."""

    def __init__(self) -> None:
        self.tok = build_char_tokenizer()

    def tokenize(self, text: str, special_tokens: bool | None = None) -> list[int]:
        return self.tok.encode(text, add_special_tokens=bool(special_tokens))


def test_the_multiply_task_and_its_transcripts():
    task = MultiplyTask(digits=3, seed=1)
    assert is_agentic(task) and not is_agentic(ArithmeticTask(digits=2))
    [p] = task.problems(7, 1)
    assert p == task.problems(7, 1)[0] and p != task.problems(8, 1)[0]
    a, b = (int(x) for x in p.prompt[:-1].split("*"))
    assert p.answer == f"<calc>{a}*{b}</calc><out>{a * b}</out>{a * b}\n"
    assert task.reward(p, f"{a * b}\n") == 1.0 and task.reward(p, "12\n") == 0.0
    with pytest.raises(errors.ConfigError):
        MultiplyTask(digits=0)
    # With 2 or 3 factors, a call per product, each on the last one's output.
    chains = MultiplyTask(digits=2, seed=4, factors=[2, 3])
    problems = chains.problems(0, 40)
    assert {p.prompt.count("*") + 1 for p in problems} == {2, 3}
    q = next(p for p in problems if p.prompt.count("*") == 2)
    x, y, z = (int(n) for n in q.prompt[:-1].split("*"))
    assert q.answer == (
        f"<calc>{x}*{y}</calc><out>{x * y}</out><calc>{x * y}*{z}</calc><out>{x * y * z}</out>"
        f"{x * y * z}\n"
    )
    assert chains.reward(q, f"{x * y * z}\n") == 1.0 and chains.factors == (2, 3)
    assert MultiplyTask(digits=3, seed=1, factors=(2, 2)).problems(7, 1) == [p]  # (as before)
    for bad in ((1, 2), (3, 2), (2, 9)):
        with pytest.raises(errors.ConfigError, match="factors"):
            MultiplyTask(factors=bad)
    with pytest.raises(errors.ConfigError, match="max_turns"):
        MultiplyTask(factors=(2, 4), max_turns=3)
    # The warm-up trains on the model's parts of the transcript only.
    dep = CharDeployment()
    datum = transcript_datum(dep, p)
    text = dep.tok.decode(datum.tokens)
    assert text == p.prompt + p.answer
    trained = "".join(
        dep.tok.decode([t]) for t, w in zip(datum.tokens, datum.weights, strict=True) if w
    )
    assert trained == f"<calc>{a}*{b}</calc>{a * b}\n"


def test_observations_carry_no_weight_in_the_loss():
    turn = Turn((5, 6, 7), (-0.1, -0.2, -0.3), "x", observation=(8, 9))
    ep = Episode((1, 2), (turn, Turn((10,), (-0.5,), "y")))
    assert ep.completion == (5, 6, 7, 8, 9, 10) and ep.mask == (1, 1, 1, 0, 0, 1)
    assert ep.answer == "y" and ep.policy_tokens == 4
    config = GRPOConfig(steps=1, prompts_per_step=1, group_size=2)
    data, teaches = group_data(config, ep.prompt, [ep.completion] * 2, [1.0, 0.0], [ep.mask] * 2)
    assert teaches and len(data) == 2
    assert data[0].weights == (0, 0, 1, 1, 1, 0, 0, 1)
    seq = replace(config, loss_aggregation="seq-mean")
    data, _ = group_data(seq, ep.prompt, [ep.completion] * 2, [1.0, 0.0], [ep.mask] * 2)
    assert data[0].weights == (0, 0, 0.25, 0.25, 0.25, 0, 0, 0.25)
    with pytest.raises(errors.ConfigError):
        group_data(config, ep.prompt, [ep.completion] * 2, [1.0, 0.0], [(1, 0)] * 2)


def test_a_turn_whose_call_does_not_parse_goes_on_with_an_error_observation():
    """A turn that closes a call it never opened gets the parse error as its observation (a
    failed result, as a failing tool's) and its episode goes on; an answer has no call; the
    last allowed turn runs none."""
    tools = {"calc": Calculator()}
    texts = ["<calc>6*7</calc>", "6*7</calc>", "42\n", "<out>1</out> 2</calc>"]
    calls, failed = turn_calls(texts, tools, last=False)
    assert calls == [ToolCall("calc", "6*7"), None, None, None]
    assert sorted(failed) == [1, 3]
    assert all(r.error == "InvalidToolCall" and not r.ok for r in failed.values())
    assert "</calc> without <calc>" in failed[1].observation(64)
    assert turn_calls(texts, tools, last=True) == ([None] * 4, {})


AGENT = tiny_spec(seed=61, hidden_size=64, num_layers=2, max_positions=96)


def _holder_status(dask_worker) -> dict:
    from plexrl_dask.worker.holder import holder_of

    return holder_of(dask_worker).status()


def agentic_job(runtime, name: str, state, config: GRPOConfig) -> GRPOJob:
    policy = runtime.deploy(unique(name), AGENT)
    plexrl.result(policy.load_state(state), timeout=120)
    return GRPOJob(name, runtime, MultiplyTask(digits=2, seed=5), policy, config)


def test_an_agentic_job_calls_its_tool_and_runs_the_same_multiplexed(client):
    runtime = plexrl.Runtime(client, job=unique("agentic"))
    warm = runtime.deploy(unique("agent-warm"), AGENT)
    task = MultiplyTask(digits=2, seed=5)
    # (the smallest warm-up after which it calls the calculator and copies its output often
    # enough for groups to score apart: 1 layer of 32 never copied it)
    losses = supervised_warmup(warm, task, 300, 32, plexrl.AdamWParams(lr=3e-3))
    assert losses[-1] < 0.5 * losses[0]
    state = plexrl.result(warm.save_state(), timeout=120)
    config = GRPOConfig(
        steps=3, prompts_per_step=4, group_size=4, max_tokens=20, temperature=1.0, lr=3e-3, seed=3
    )
    job = agentic_job(runtime, "agent", state, config)
    alone = job.run()
    # its later turns prefilled only their new tokens (the replica's prefix cache)
    caches = [
        r["prefix_cache"]
        for status in client.run(_holder_status).values()
        for name, r in status["replicas"].items()
        if name == job.policy.name and r["prefix_cache"] is not None
    ]
    assert caches and sum(c["hits"] for c in caches) > 0
    # No tool workers here: the calls ran on the driver, and the Timeline has them in a lane
    # of the job's driver (reported without waiting: they arrive soon after).
    lane, deadline, reported = driver_lane(runtime.job), time.monotonic() + 10, []
    while not reported and time.monotonic() < deadline:
        reported = [
            s for _, m in client.get_events(TOOL_TOPIC) for s in m["spans"] if s["worker"] == lane
        ]
        time.sleep(0.05)
    assert reported and {s["tool"] for s in reported} == {"calc"}
    other = plexrl.Runtime(client, job=unique("other"))
    beside = GRPOJob(
        "beside",
        other,
        ArithmeticTask(digits=1, seed=2),
        other.deploy(unique("beside"), tiny_spec(seed=62)),
        GRPOConfig(steps=3, prompts_per_step=4, group_size=4, max_tokens=4, seed=4),
    )
    again = agentic_job(runtime, "agent", state, config)  # (its job's own warm-up state)
    mux = run_jobs([again, beside])
    assert [(r.reward_mean, r.loss, r.completion_lengths) for r in alone] == [
        (r.reward_mean, r.loss, r.completion_lengths) for r in mux["agent"]
    ]
    timing = {"tool_s_mean", "tool_wait_s"}  # (seconds: the only things that may differ)
    for a, m in zip(alone, mux["agent"], strict=True):
        assert {k: v for k, v in a.extra.items() if k not in timing} == {
            k: v for k, v in m.extra.items() if k not in timing
        }
    # The warmed-up model calls the calculator and answers after its observation.
    assert sum(r.extra["tool_calls"] for r in alone) > 0
    assert max(r.extra["turns_max"] for r in alone) >= 2
    assert sum(r.loss is not None for r in alone) >= 1, [
        (r.reward_mean, r.groups_used, r.extra) for r in alone
    ]


def test_an_episode_never_outgrows_its_models_context():
    """A turn whose observation would leave no room for another whole turn ends the episode
    without it: every episode's prompt and completion fit the context it trains in."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from plexrl_dask.rl.episodes import run_episodes
    from plexrl_dask.shared.types import SampledSequence, SampleResult, SamplingParams
    from plexrl_dask.tools.calls import ToolResult

    tok = CharDeployment()
    task = MultiplyTask(digits=2, seed=5)

    class Sampler:  # in-process: every turn calls the calculator
        info = SimpleNamespace(max_positions=80)

        def tokenize(self, text, special_tokens=None):
            return tok.tokenize(text, special_tokens)

        def sample(self, prompts, params, prompt_ids, holds=False):
            call = tuple(tok.tokenize("<calc>12*34</calc>"))
            seq = SampledSequence(call, (-0.1,) * len(call), "<calc>12*34</calc>", "stop")
            out = Future()
            out.set_result(SampleResult(tuple(map(tuple, prompts)), ((seq,),) * len(prompts)))
            return out

    class Pool:
        tools = task.tools

        def run(self, calls, timeout):
            return [None if c is None else ToolResult("408" * 4) for c in calls]

    params = SamplingParams(n=1, max_tokens=8, seed=1)
    problems = task.problems(0, 2)
    batch = run_episodes(Sampler(), Pool(), problems, params, 2, 5, 64)
    for group in batch.groups:
        for ep in group:
            assert len(ep.prompt) + len(ep.completion) <= 80
            # (the first turn's observation fits with room for a second turn; the second's not)
            assert len(ep.turns) == 2 and ep.turns[0].observation
            assert ep.turns[1].result is not None and ep.turns[1].observation == ()
    # a prompt with no room for its first turn is refused, typed, as a single-turn one is
    # (not an empty episode whose group quietly teaches nothing)
    with pytest.raises(errors.SequenceTooLong):
        run_episodes(Sampler(), Pool(), problems, replace(params, max_tokens=80), 2, 5, 64)
    # a job that stopped starts no further turn (its rollout ends after the one it runs)
    import threading

    stop = threading.Event()
    stop.set()
    with pytest.raises(errors.JobStopped):
        run_episodes(Sampler(), Pool(), problems, params, 2, 5, 64, stop=stop)


def test_bench_agentic_reports_each_jobs_turns_and_tool_times_as_distributions():
    from plexrl_dask.bench.agentic import distribution

    got = distribution({"turns": [1, 2, 2, 3, 2], "tool_s": [0.01, 0.02, 0.5], "tool_calls": 4})
    assert got["episodes"] == 5 and got["turns"] == {"1": 1, "2": 3, "3": 1}
    assert (got["tool_calls"], got["tool_runs"]) == (4, 3)
    assert got["tool_s"]["p50"] == 0.02 and got["tool_s"]["max"] == 0.5
    assert distribution({"turns": [1], "tool_s": []})["tool_s"] is None


def test_the_program_task_its_transcripts_and_the_sandbox_agree():
    """ProgramTask's problems are deterministic, its warm-up transcripts show the output the
    sandbox really gives for their call, and its verifier takes the value and nothing else."""
    from plexrl_dask.tasks.agentic import ProgramTask
    from plexrl_dask.tools import parse_call, run_call

    task = ProgramTask(seed=3)
    assert is_agentic(task) and task == ProgramTask(seed=3)  # (its tools are not its identity)
    problems = task.problems(0, 12)
    assert problems == task.problems(0, 12) and problems != ProgramTask(seed=4).problems(0, 12)
    for p in problems:
        value = p.metadata["value"]
        call_text, rest = p.answer.split("</py>", 1)
        call = parse_call(call_text + "</py>", task.tools)
        assert call is not None and call.text == f"print({p.prompt[:-1]})"
        res = run_call(call, task.tools)  # (the real sandbox)
        assert res.ok and res.observation(task.observation_limit) == f"<out>{value}\n</out>"
        assert rest == f"<out>{value}\n</out>{value}\n"
        assert task.reward(p, f"{value}\n") == 1.0
        assert task.reward(p, f"{int(value) + 1}\n") == 0.0 and task.reward(p, "") == 0.0
    with pytest.raises(errors.ConfigError):
        ProgramTask(max_turns=0)
    with pytest.raises(errors.ConfigError):
        ProgramTask(observation_limit=4)


class ScriptedSampler:
    """In process, what ``run_episodes`` asks of a sampler: episode ``c``'s first turn is
    ``first_turns[c]`` (a call), its last answers ``"42\\n"``; a character tokenizer."""

    info = SimpleNamespace(max_positions=None)

    def __init__(self, first_turns: list[str]) -> None:
        self.first_turns, self.tok = first_turns, CharDeployment()

    def tokenize(self, text, special_tokens=None):
        return self.tok.tokenize(text, special_tokens)

    def sample(self, prompts, params, prompt_ids, holds=False):
        from concurrent.futures import Future

        from plexrl_dask.shared.types import SampledSequence, SampleResult

        texts = [self.first_turns[c] if holds else "42\n" for c in prompt_ids]
        seqs = [
            SampledSequence(tuple(self.tokenize(t)), (-0.1,) * len(t), t, "stop") for t in texts
        ]
        out = Future()
        out.set_result(SampleResult(tuple(map(tuple, prompts)), tuple((s,) for s in seqs)))
        return out


def test_hostile_tool_calls_end_as_error_observations_and_every_episode_goes_on():
    """An episode's program that loops, forks, allocates, prints megabytes, writes outside its
    directory, tries the network, or a call that does not parse: that sample's observation is
    the tool's error, its next turn is sampled and scored like any other, and the pool runs
    the next call as before (the real sandbox, on the driver's pool)."""
    from plexrl_dask.rl.episodes import run_episodes
    from plexrl_dask.shared.types import SamplingParams
    from plexrl_dask.tasks.agentic import ProgramTask
    from plexrl_dask.tools import PythonSandbox, SandboxLimits, ToolPool
    from plexrl_dask.tools.sandbox import sandbox_processes

    limits = SandboxLimits(wall_s=2.0, cpu_s=2, output_bytes=256)
    hostile = {
        "loop": ("<py>while True:\n    pass</py>", "ToolLimitExceeded"),
        "fork": ("<py>import os\nwhile True:\n    os.fork()</py>", "Tool"),
        "allocate": ("<py>x = []\nwhile True:\n    x.append(bytearray(2**24))</py>", "Tool"),
        "megabytes": ("<py>while True:\n    print('x' * 1000)</py>", "ToolLimitExceeded"),
        "outside": ("<py>open('/etc/plexrl-escape', 'w').write('x')</py>", "ToolError"),
        "network": (
            "<py>import socket\nsocket.create_connection(('1.1.1.1', 53), 1)</py>",
            "ToolError",
        ),
        "unparsed": ("print(1)</py>", "InvalidToolCall"),
        "fine": ("<py>print(6 * 7)</py>", None),
    }
    programs = list(hostile.values())
    tok = CharDeployment()
    task = ProgramTask(seed=1, limits=limits)

    pool = ToolPool(None, {"py": PythonSandbox(limits)})
    problems = task.problems(0, len(programs))
    params = SamplingParams(n=1, max_tokens=64, seed=1)
    t0 = time.monotonic()
    sampler = ScriptedSampler([text for text, _ in programs])
    batch = run_episodes(sampler, pool, problems, params, 1, 2, task.observation_limit)
    assert time.monotonic() - t0 < 60
    for (name, (_, error)), [ep], p in zip(hostile.items(), batch.groups, problems, strict=True):
        first, answer = ep.turns
        assert answer.text == "42\n" and ep.answer == "42\n", name  # (the episode went on)
        if error is None:
            assert first.result.ok and first.result.output == "42\n"
        else:
            assert not first.result.ok and first.result.error.startswith(error), (name, first)
            seen = tok.tok.decode(list(first.observation))
            assert seen.startswith("<out>error: ") and seen.endswith("</out>"), (name, seen)
        assert task.reward(p, ep.answer) == float(p.metadata["value"] == "42")
    assert not __import__("os").path.exists("/etc/plexrl-escape")
    [res] = pool.run([ToolCall("py", "print('next')")], 10)
    assert res.ok and res.output == "next\n"
    assert sandbox_processes(limits) == []
    pool.close()


def test_a_multiplication_past_the_calculators_digits_is_refused_when_made():
    from plexrl_dask.tools.calculator import MAX_DIGITS

    with pytest.raises(errors.ConfigError, match="calculator"):
        MultiplyTask(digits=12, factors=(4, 4), max_turns=4)
    assert MAX_DIGITS >= 36 and MultiplyTask(digits=6, factors=(6, 6), max_turns=6)
