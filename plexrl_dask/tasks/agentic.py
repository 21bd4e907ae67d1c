"""Agentic tasks: problems whose way to the answer is a tool call.

An agentic task is a task (:class:`~plexrl_dask.tasks.base.Task`) with ``tools`` (name ->
:class:`~plexrl_dask.tools.calls.Tool`), ``max_turns`` and ``observation_limit`` (characters of
a tool's output shown to the model). :class:`~plexrl_dask.rl.grpo.GRPOJob` runs such a task's
samples as multi-turn episodes (:mod:`plexrl_dask.rl.episodes`); the verifier scores the
episode's last turn, its answer. A problem's ``answer`` is a whole reference transcript
(calls, observations, answer), what the supervised warm-up trains on with the observations
masked (:func:`plexrl_dask.rl.episodes.transcript_datum`).

:class:`MultiplyTask`: ``a*b=`` (or ``a*b*c=`` ..., ``factors`` of them, their number drawn
per problem) with numbers of ``digits`` digits; too many digits for a tiny model to multiply in
its head, one ``calc`` call per product away: the transcript multiplies left to right, each
call on the last one's output, ``<calc>a*b</calc><out>p</out><calc>p*c</calc><out>q</out>q``
and the stop, so an episode takes as many model turns as the problem has factors.

:class:`ProgramTask`: ``EXPR=`` for a generated Python expression (a sum of a range, a
remainder, the length of a power's digits, the middle of three numbers, ...); the way to its
value is to run it in the sandbox: ``<py>print(EXPR)</py><out>value\n</out>value`` and the stop.
Each call is a sandboxed process (milliseconds of a CPU), the tool wait that leaves a
colocated job's workers idle.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from plexrl_dask.errors import ConfigError
from plexrl_dask.tasks.base import Problem
from plexrl_dask.tools.calculator import Calculator
from plexrl_dask.tools.calls import OUT_CLOSE, OUT_OPEN, Tool
from plexrl_dask.tools.sandbox import PythonSandbox, SandboxLimits


def is_agentic(task: object) -> bool:
    """Whether ``task`` runs as multi-turn episodes (it has tools)."""
    return bool(getattr(task, "tools", None))


@dataclass(frozen=True)
class MultiplyTask:
    """Multiply ``digits``-digit numbers with the calculator, as many as ``factors`` says for
    each problem (``(least, most)``, drawn uniformly; see the module docstring)."""

    digits: int = 3
    seed: int = 0
    factors: tuple[int, int] = (2, 2)
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
        least, most = self.factors
        if not (isinstance(least, int) and isinstance(most, int) and 2 <= least <= most <= 8):
            raise ConfigError(
                f"factors is (least, most) with 2 <= least <= most <= 8, got {self.factors}"
            )
        if most > self.max_turns:
            raise ConfigError(f"{most} factors take {most} turns: max_turns is {self.max_turns}")
        from plexrl_dask.tools.calculator import MAX_DIGITS

        if self.digits * most > MAX_DIGITS:  # (the calculator answers no product past it)
            raise ConfigError(
                f"{most} factors of {self.digits} digits make products past the calculator's "
                f"{MAX_DIGITS} digits"
            )
        object.__setattr__(self, "factors", (least, most))  # (a list given: hashable)

    def problems(self, start: int, count: int) -> list[Problem]:
        out = []
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        for i in range(start, start + count):
            rng = random.Random(self.seed * 1_000_003 + i)
            n = (
                self.factors[0]
                if self.factors[0] == self.factors[1]
                else rng.randint(*self.factors)
            )
            numbers = [rng.randint(lo, hi) for _ in range(n)]
            transcript, p = "", numbers[0]
            for x in numbers[1:]:
                transcript += f"<calc>{p}*{x}</calc>{OUT_OPEN}{p * x}{OUT_CLOSE}"
                p *= x
            transcript += f"{p}{self.stop}"
            prompt = "*".join(map(str, numbers)) + "="
            out.append(Problem(prompt, transcript, i, {"product": p}))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        """1 if the answer (the episode's last turn, up to the stop) is the product."""
        answer = completion.split(self.stop, 1)[0].strip()
        return 1.0 if answer == str(problem.metadata["product"]) else 0.0


#: ProgramTask's expressions: a template and how to draw its numbers.
_PROGRAMS = (
    ("sum(range({a}))", lambda r: {"a": r.randint(10, 999)}),
    (
        "{a}*{b}%{c}",
        lambda r: {"a": r.randint(100, 999), "b": r.randint(100, 999), "c": r.randint(7, 97)},
    ),
    ("len(str({a}**{b}))", lambda r: {"a": r.randint(2, 9), "b": r.randint(10, 60)}),
    ("sorted([{a},{b},{c}])[1]", lambda r: {k: r.randint(0, 999) for k in "abc"}),
    ("max({a},{b})-min({c},{d})", lambda r: {k: r.randint(0, 999) for k in "abcd"}),
)


@dataclass(frozen=True)
class ProgramTask:
    """The value of a generated Python expression, by running it (see the module docstring).
    The sandbox's limits are the task's (fixed: part of the task's identity)."""

    seed: int = 0
    stop: str = "\n"
    max_turns: int = 3
    observation_limit: int = 64
    limits: SandboxLimits = SandboxLimits(wall_s=5.0, cpu_s=5, output_bytes=256)
    tools: dict[str, Tool] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.observation_limit < 8:
            raise ConfigError("max_turns >= 1 and observation_limit >= 8")
        if not self.tools:
            object.__setattr__(self, "tools", {"py": PythonSandbox(self.limits)})

    def problems(self, start: int, count: int) -> list[Problem]:
        out = []
        for i in range(start, start + count):
            rng = random.Random(self.seed * 1_000_003 + i)
            template, draw = _PROGRAMS[rng.randrange(len(_PROGRAMS))]
            expr = template.format(**draw(rng))
            value = str(_evaluate(expr))
            call = f"<py>print({expr})</py>{OUT_OPEN}{value}\n{OUT_CLOSE}"
            out.append(Problem(f"{expr}=", f"{call}{value}{self.stop}", i, {"value": value}))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        """1 if the answer (the last turn, up to the stop) is the expression's value."""
        answer = completion.split(self.stop, 1)[0].strip()
        return 1.0 if answer == problem.metadata["value"] else 0.0


def _evaluate(expr: str) -> int:
    """The value of one of :data:`_PROGRAMS`' expressions, computed here (they use only
    ``sum``, ``range``, ``len``, ``str``, ``sorted``, ``max``, ``min`` and integer operators)."""
    allowed = {
        "sum": sum,
        "range": range,
        "len": len,
        "str": str,
        "sorted": sorted,
        "max": max,
        "min": min,
    }
    return int(eval(expr, {"__builtins__": {}}, allowed))  # noqa: S307 (our own templates)
