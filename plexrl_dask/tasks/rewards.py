"""Several reward functions with weights, over another task's problems, and the one place that
scores a completion for a job (:func:`score`)."""

from __future__ import annotations

import math
import numbers
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
        terms = {t.name: _number(t.fn(problem, completion), f"term {t.name!r}") for t in self.terms}
        return sum(t.weight * terms[t.name] for t in self.terms), terms

    def reward(self, problem: Problem, completion: str) -> float:
        return self.score(problem, completion)[0]


def score(task: Any, problem: Problem, completion: str) -> tuple[float, dict[str, float]]:
    """``completion``'s reward under ``task`` and its named terms (none unless the task has
    ``score``), as floats. The task's own code failing (any exception it raises), or a reward
    that is not a finite real number (a numpy scalar is one), is a :class:`ConfigError`
    naming the task and the problem: never a bare error of the user's code, which on a
    sharded policy's worker would read as a failed collective, nor a value that would poison
    every advantage of its group."""
    what = f"{type(task).__name__}'s reward of problem {problem.index}"
    scorer = getattr(task, "score", None)
    try:
        found = scorer(problem, completion) if scorer else (task.reward(problem, completion), {})
    except ConfigError:
        raise
    except Exception as e:  # (the user's code: whatever it raises)
        raise ConfigError(f"{what} raised {type(e).__name__}: {e}") from e
    if not (isinstance(found, tuple) and len(found) == 2 and isinstance(found[1], dict)):
        raise ConfigError(f"{what}: score() returns (reward, {{term: value}}), got {found!r:.80}")
    reward, terms = found
    return _number(reward, what), {
        str(k): _number(v, f"{what}, term {k!r}") for k, v in terms.items()
    }


def _number(value: Any, what: str) -> float:
    """``value`` as a finite float if it is a real number (not a string or None); else
    :class:`ConfigError` naming ``what``."""
    if isinstance(value, str) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{what} is not a finite number: {value!r:.80}")
    try:
        out = float(value)
    except (OverflowError, ValueError):
        out = math.inf
    if not math.isfinite(out):
        raise ConfigError(f"{what} is not a finite number: {value!r:.80}")
    return out
