"""Procedural tasks: reproducible problems, exact verifiers, and answer lengths that vary."""

from __future__ import annotations

import pytest

from plexrl_dask import errors
from plexrl_dask.errors import ConfigError
from plexrl_dask.tasks import (
    ArithmeticTask,
    CountdownTask,
    Problem,
    RewardTerm,
    WeightedRewards,
    score,
)
from plexrl_dask.tasks.base import describe_task


def test_countdown_reference_answers_verify_and_problems_are_reproducible():
    task = CountdownTask(count=4, max_value=12, seed=3)
    problems = task.problems(0, 300)
    assert problems == CountdownTask(count=4, max_value=12, seed=3).problems(0, 300)
    assert problems != CountdownTask(count=4, max_value=12, seed=4).problems(0, 300)
    for p in problems:
        assert task.reward(p, p.answer) == 1.0, p
        numbers = [int(x) for x in p.prompt.rstrip(":").split(">")[0].split()]
        assert len(numbers) == 4 and all(1 <= n <= 12 for n in numbers)
    # Answers have 1 to 3 steps: lengths vary with the problem (the long tail's source).
    steps = {p.answer.strip("\n").count("\n") + 1 for p in problems}
    assert steps == {1, 2, 3}


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("7-3=4\n12*4=48\n\n", 1.0),  # the reference route
        ("12*7=84\n84-3=81\n\n", 0.0),  # valid steps, wrong target
        ("12*4=48\n\n", 0.0),  # 4 is not given
        ("7-3=4\n4*12=48", 1.0),  # another order, no stop string yet: still a derivation
        ("7-3=5\n12*5=60\n\n", 0.0),  # wrong arithmetic
        ("7-3=4\n7*4=28\n\n", 0.0),  # 7 used twice
        ("", 0.0),
        ("the answer is 48\n\n", 0.0),
        ("7-3=4\n12*4=48\n\nextra", 1.0),  # what follows the stop string is not the answer
    ],
)
def test_countdown_verifier_is_exact(completion, expected):
    task = CountdownTask()
    problem = Problem(prompt="3 7 12 5>48:", answer="7-3=4\n12*4=48\n\n", index=0)
    assert task.reward(problem, completion) == expected


def test_bad_task_configs_are_typed_errors():
    with pytest.raises(errors.ConfigError):
        CountdownTask(count=1)
    with pytest.raises(errors.ConfigError):
        ArithmeticTask(ops="/")


def test_the_documented_dataset_task_keeps_the_protocol():
    """docs/tasks.md's example, run as written: reproducible problems, every epoch a seeded
    permutation of the rows, an exact reward, and no data in its repr."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "tasks.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    namespace: dict = {}
    exec(compile(code, "docs/tasks.md", "exec"), namespace)  # noqa: S102 (our own docs)
    rows = tuple((f"{i}+{i}=", str(2 * i)) for i in range(5))
    task = namespace["QATask"]("qa", rows, seed=3)
    first, again = task.problems(0, 15), task.problems(0, 15)
    assert first == again and [p.index for p in first] == list(range(15))
    for epoch in range(3):
        seen = sorted(p.prompt for p in first[5 * epoch : 5 * epoch + 5])
        assert seen == sorted(prompt for prompt, _ in rows)
    assert [p.prompt for p in first[:5]] != [p.prompt for p in first[5:10]]  # reshuffled
    p = first[0]
    assert task.reward(p, p.answer) == 1.0 and task.reward(p, " " + p.answer.strip() + "\nx") == 1.0
    assert task.reward(p, "wrong\n") == 0.0
    assert "0+0=" not in repr(task)


def test_problems_take_text_or_token_ids_and_carry_metadata_the_reward_reads():
    p = Problem(prompt=[3, 4, 5], answer="7\n", index=0, metadata={"want": "7"})
    assert p.prompt == (3, 4, 5)  # stored as a tuple: hashable, immutable
    assert p == Problem(prompt=(3, 4, 5), answer="7\n", index=0)  # metadata is not compared
    for bad in ([], [1, -2], [1.5], [True], 7, None):
        with pytest.raises(ConfigError, match="token ids"):
            Problem(prompt=bad, answer="", index=0)


def test_weighted_rewards_sum_their_terms_and_say_each():
    base = ArithmeticTask(digits=1, seed=2)
    task = WeightedRewards(
        base,
        (RewardTerm("correct", base.reward), RewardTerm("short", lambda p, c: len(c) <= 3, 0.25)),
    )
    p = task.problems(0, 1)[0]
    assert task.stop == base.stop and task.problems(0, 3) == base.problems(0, 3)
    assert score(task, p, p.answer) == (1.25, {"correct": 1.0, "short": 1.0})
    assert task.reward(p, "wrong answer\n") == 0.0
    assert score(base, p, p.answer) == (1.0, {})
    with pytest.raises(ConfigError, match="distinct"):
        WeightedRewards(base, (RewardTerm("a", base.reward), RewardTerm("a", base.reward)))
    with pytest.raises(ConfigError, match="finite weights"):
        WeightedRewards(base, (RewardTerm("a", base.reward, float("nan")),))
    nan = WeightedRewards(base, (RewardTerm("a", lambda p, c: float("nan")),))
    with pytest.raises(ConfigError, match="not a finite number"):
        score(nan, p, "1\n")


class _Raising(ArithmeticTask):
    def reward(self, problem, completion):
        raise NotImplementedError("not yet")


def test_what_a_reward_raises_or_returns_is_checked_where_it_is_scored():
    """The user's reward is the user's code: whatever it raises is a ConfigError naming the
    task and the problem (a bare RuntimeError on a sharded policy's worker read as a failed
    collective, and dropped the policy's state); a real number of any type is a reward, a
    string, None, an overflow or a score() of the wrong shape is not."""
    import numpy as np

    task = ArithmeticTask()
    [p] = task.problems(0, 1)
    with pytest.raises(
        ConfigError, match=r"_Raising's reward of problem 0 raised NotImplementedError"
    ):
        score(_Raising(), p, "1")
    for value in (np.float32(1.0), np.int64(1), 1):
        assert (
            score(WeightedRewards(task, (RewardTerm("x", lambda p, c, v=value: v),)), p, "")[0]
            == 1.0
        )
    for value in ("1.0", None, 10**400, float("nan")):
        term = RewardTerm("x", lambda p, c, v=value: v)
        with pytest.raises(ConfigError, match="term 'x'"):
            score(WeightedRewards(task, (term,)), p, "")

    class Flat(ArithmeticTask):
        def score(self, problem, completion):
            return 1.0

    with pytest.raises(ConfigError, match=r"returns \(reward"):
        score(Flat(), p, "")


def test_a_tasks_description_is_the_same_in_every_process():
    """A job checkpoint names its task by this text, and a resume in another driver process
    must find it again: no addresses (a lambda reward term), sets in sorted order (their
    order follows the process's hash seed)."""
    import os
    import subprocess
    import sys

    program = (
        "import dataclasses\nfrom plexrl_dask.tasks import ArithmeticTask, RewardTerm, "
        "WeightedRewards\nfrom plexrl_dask.tasks.base import describe_task\n"
        "@dataclasses.dataclass(frozen=True)\nclass T(ArithmeticTask):\n"
        "    words: frozenset = frozenset({'alpha', 'beta', 'gamma', 'delta', 'eps'})\n"
        "print(describe_task(WeightedRewards(T(), (RewardTerm('c', lambda p, c: 1.0),))))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert len(seen) == 1, seen
    assert "0x" not in seen.pop()
    assert describe_task(ArithmeticTask()) == repr(ArithmeticTask())  # (plain ones: as before)


def test_a_task_of_no_stop_string_samples_to_its_end():
    from plexrl_dask.rl import GRPOConfig

    assert GRPOConfig().stops("") == ()
    with pytest.raises(ConfigError, match="stop"):
        ArithmeticTask(stop="")


def test_an_agentic_task_without_its_turn_limits_is_refused_when_the_job_is_made():
    from plexrl_dask.tasks.base import check_task
    from plexrl_dask.tools import Calculator

    class NoTurns(ArithmeticTask):
        tools = {"calc": Calculator()}

    with pytest.raises(ConfigError, match="max_turns"):
        check_task(NoTurns())
