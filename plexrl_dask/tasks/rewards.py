"""Several reward functions with weights, over another task's problems, and the one place that
scores a completion for a job (:func:`score`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plexrl_dask.errors import ConfigError
from plexrl_dask.tasks.base import Problem, Task


@dataclass(frozen=True)
class RewardTerm:
    """One named reward function and its weight in the sum."""

    name: str
    fn: Callable[[Problem, str], float]
    weight: float = 1.0


@dataclass(frozen=True)
class WeightedRewards:
    """``task``'s problems and stop string, scored ``sum(term.weight * term.fn(problem,
    completion))``; a ``GRPOJob`` records each term's mean per step
    (``StepRecord.extra["reward/<name>"]``). E.g. correctness plus a small format bonus::

        WeightedRewards(task, (RewardTerm("correct", task.reward),
                               RewardTerm("short", lambda p, c: len(c) < 8, 0.1)))
    """

    task: Task
    terms: tuple[RewardTerm, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.terms]
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"WeightedRewards needs terms with distinct names, got {names}")
        bad = [t.name for t in self.terms if not (isinstance(t.weight, (int, float))
                                                  and math.isfinite(t.weight))]  # fmt: skip
        if bad:
            raise ConfigError(f"reward terms {bad} need finite weights")

    @property
    def stop(self) -> str:
        return self.task.stop

    def problems(self, start: int, count: int) -> list[Problem]:
        return self.task.problems(start, count)

    def score(self, problem: Problem, completion: str) -> tuple[float, dict[str, float]]:
        terms = {t.name: float(t.fn(problem, completion)) for t in self.terms}
        return sum(t.weight * terms[t.name] for t in self.terms), terms

    def reward(self, problem: Problem, completion: str) -> float:
        return self.score(problem, completion)[0]


def score(task: Any, problem: Problem, completion: str) -> tuple[float, dict[str, float]]:
    """``completion``'s reward under ``task`` and its named terms (none unless the task has
    ``score``); a reward that is not a finite number is a :class:`ConfigError` naming the
    problem (it would poison every advantage of its group)."""
    scorer = getattr(task, "score", None)
    reward, terms = (
        scorer(problem, completion) if scorer else (task.reward(problem, completion), {})
    )
    values = [reward, *terms.values()]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ConfigError(
            f"the task's reward of problem {problem.index} is not a finite number: "
            f"{reward!r} {terms if terms else ''}"
        )
    return float(reward), terms
