"""Multi-digit arithmetic: ``"37+85="`` → ``"122"``, verified exactly.

Problems are a pure function of ``(seed, index)``, so a dataset is reproducible and never
stored. The answer format is the bare number followed by a newline (the stop string), which a
character-level model can learn with a short supervised warm-up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from plexrl_dask.errors import ConfigError
from plexrl_dask.tasks.base import Problem

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticTask:
    """Problems ``a <op> b =`` with operands of ``1..digits`` digits."""

    digits: int = 2
    ops: str = "+"
    seed: int = 0
    stop: str = "\n"

    def __post_init__(self) -> None:
        if not (isinstance(self.stop, str) and self.stop):  # (the answer ends at it)
            raise ConfigError(f"ArithmeticTask's stop is a non-empty string, got {self.stop!r}")
        if self.digits < 1 or not self.ops or any(o not in _OPS for o in self.ops):
            raise ConfigError(f"digits must be >= 1 and ops a subset of {''.join(_OPS)}: {self}")

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"{self.seed}:{index}")
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        op = rng.choice(self.ops)
        return Problem(prompt=f"{a}{op}{b}=", answer=f"{_OPS[op](a, b)}{self.stop}", index=index)

    def problems(self, start: int, count: int) -> list[Problem]:
        return [self.problem(i) for i in range(start, start + count)]

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 if the completion states the right number before the stop string, else 0.0."""
        answer = problem.answer[: -len(self.stop)]
        stated = completion.split(self.stop, 1)[0].strip()
        return 1.0 if stated == answer else 0.0
