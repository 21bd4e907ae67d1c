"""Countdown: reach a target from given numbers with + - *, answer as worked steps.

A prompt lists the numbers and the target, ``"3 7 12 5>48:"``; an answer is one step per
line, each combining two available values (given numbers, or results of earlier steps, each
used at most once) into a new one, the last step ending on the target::

    7-3=4
    12*4=48

followed by an empty line (the stop string ``"\\n\\n"``).

**Length model.** Each problem is generated from a random expression over ``k`` of its
numbers, ``k`` uniform in ``[2, len(numbers)]``; its reference answer has ``k - 1`` steps, and
each step's length grows with its operands' digits. So correct answers are short or long
depending on the problem, and a model that has not learned to stop writes on until
``max_tokens``: the length distribution of completions is long-tailed for real, from the
task, not from a ``max_tokens`` trick. Reference answers of the default task (4 numbers up to
12), over 2,000 problems: p50 15, p90 24, p99 28, max 32 characters; a GRPO job records its
sampled completions' lengths every step (``completion_lengths`` in its metrics).

**Verifier.** Exact: every step must parse, use only values still available, compute
correctly, and the last result must equal the target. Any deviation scores 0; a correct
derivation scores 1 whatever route it takes (not only the reference's).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from plexrl_dask.errors import ConfigError
from plexrl_dask.tasks.base import Problem

_STEP = re.compile(r"^(\d+)([+\-*])(\d+)=(-?\d+)$")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class CountdownTask:
    """Problems of ``count`` numbers in ``[1, max_value]``; intermediate values stay
    non-negative and at most ``max_result`` (so answers stay short enough for a tiny model)."""

    count: int = 4
    max_value: int = 12
    max_result: int = 200
    seed: int = 0
    stop: str = "\n\n"

    def __post_init__(self) -> None:
        if self.count < 2 or self.max_value < 2 or self.max_result < self.max_value:
            raise ConfigError(f"count >= 2, max_value >= 2 and max_result >= max_value: {self}")

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"countdown:{self.seed}:{index}")
        while True:
            numbers = [rng.randint(1, self.max_value) for _ in range(self.count)]
            k = rng.randint(2, self.count)
            steps = self._derivation(rng, list(numbers[:k]))
            if steps is not None:
                break
        rng.shuffle(numbers)
        target = int(steps[-1].rsplit("=", 1)[1])
        prompt = " ".join(map(str, numbers)) + f">{target}:"
        return Problem(prompt=prompt, answer="\n".join(steps) + self.stop, index=index)

    def _derivation(self, rng: random.Random, values: list[int]) -> list[str] | None:
        """Random steps combining ``values`` down to one, or None if a step left range."""
        steps = []
        while len(values) > 1:
            a, b = rng.sample(range(len(values)), 2)
            x, y = values[a], values[b]
            op = rng.choice("+-*")
            if op == "-" and x < y:
                x, y = y, x
            z = _APPLY[op](x, y)
            if not 0 <= z <= self.max_result:
                return None
            steps.append(f"{x}{op}{y}={z}")
            values = [v for i, v in enumerate(values) if i not in (a, b)] + [z]
        return steps

    def problems(self, start: int, count: int) -> list[Problem]:
        return [self.problem(i) for i in range(start, start + count)]

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 for a valid derivation of the target (see the module docstring), else 0.0."""
        numbers_part, target_part = problem.prompt.rstrip(":").split(">")
        available = [int(x) for x in numbers_part.split()]
        target = int(target_part)
        lines = completion.split(self.stop, 1)[0].strip("\n").split("\n")
        if not lines or lines == [""]:
            return 0.0
        result = None
        for line in lines:
            m = _STEP.match(line.strip())
            if m is None:
                return 0.0
            x, op, y, z = int(m[1]), m[2], int(m[3]), int(m[4])
            if _APPLY[op](x, y) != z:
                return 0.0
            for v in (x, y):
                if v not in available:
                    return 0.0
                available.remove(v)
            available.append(z)
            result = z
        return 1.0 if result == target else 0.0
