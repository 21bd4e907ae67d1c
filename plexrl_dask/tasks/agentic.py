"""Agentic tasks: problems whose way to the answer is a tool call.

An agentic task is a task (:class:`~plexrl_dask.tasks.base.Task`) with ``tools`` (name ->
:class:`~plexrl_dask.tools.calls.Tool`), ``max_turns`` and ``observation_limit`` (characters of
a tool's output shown to the model). :class:`~plexrl_dask.rl.grpo.GRPOJob` runs such a task's
samples as multi-turn episodes (:mod:`plexrl_dask.rl.episodes`); the verifier scores the
episode's last turn, its answer. A problem's ``answer`` is a whole reference transcript
(calls, observations, answer), what the supervised warm-up trains on with the observations
masked (:func:`plexrl_dask.rl.episodes.transcript_datum`).

:class:`MultiplyTask`: ``a*b=`` with numbers of ``digits`` digits; too many digits for a tiny
model to multiply in its head, one ``calc`` call away: the transcript is
``<calc>a*b</calc><out>p</out>p`` and the stop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from plexrl_dask.errors import ConfigError
from plexrl_dask.tasks.base import Problem
from plexrl_dask.tools.calculator import Calculator
from plexrl_dask.tools.calls import OUT_CLOSE, OUT_OPEN, Tool


def is_agentic(task: object) -> bool:
    """Whether ``task`` runs as multi-turn episodes (it has tools)."""
    return bool(getattr(task, "tools", None))


@dataclass(frozen=True)
class MultiplyTask:
    """Multiply two ``digits``-digit numbers with the calculator (see the module docstring)."""

    digits: int = 3
    seed: int = 0
    stop: str = "\n"
    max_turns: int = 3
    observation_limit: int = 64
    tools: dict[str, Tool] = field(
        default_factory=lambda: {"calc": Calculator()}, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 12:
            raise ConfigError(f"digits is 1-12, got {self.digits}")
        if self.max_turns < 1 or self.observation_limit < 8:
            raise ConfigError("max_turns >= 1 and observation_limit >= 8")

    def problems(self, start: int, count: int) -> list[Problem]:
        out = []
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        for i in range(start, start + count):
            rng = random.Random(self.seed * 1_000_003 + i)
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            p = a * b
            transcript = f"<calc>{a}*{b}</calc>{OUT_OPEN}{p}{OUT_CLOSE}{p}{self.stop}"
            out.append(Problem(f"{a}*{b}=", transcript, i, {"product": p}))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        """1 if the answer (the episode's last turn, up to the stop) is the product."""
        answer = completion.split(self.stop, 1)[0].strip()
        return 1.0 if answer == str(problem.metadata["product"]) else 0.0
