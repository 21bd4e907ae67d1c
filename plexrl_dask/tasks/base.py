"""What every procedural task is: reproducible problems and an exact verifier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """A prompt, its reference answer (the exact completion text), and an id."""

    prompt: str
    answer: str
    index: int


class Task(Protocol):
    """Problems are a pure function of ``(task config, index)``; ``reward`` scores a
    completion exactly; ``stop`` ends an answer."""

    stop: str

    def problems(self, start: int, count: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...
