"""What every procedural task is: reproducible problems and an exact verifier."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from plexrl_dask.errors import ConfigError
from plexrl_dask.shared.types import Chat


@dataclass(frozen=True)
class Problem:
    """A prompt (text, tokenized as Hugging Face does; chat messages, rendered with the model's
    chat template; or token ids, used as they are), its reference answer (the exact completion text, for a supervised warm-up), an id, and
    ``metadata`` the reward may read (a row's test cases, its source; not compared)."""

    prompt: str | Chat | tuple[int, ...]
    answer: str
    index: int
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, (str, Chat)):
            try:
                ids = tuple(self.prompt)
            except TypeError:
                ids = None
            if not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ConfigError(
                    f"Problem.prompt is text, a Chat or a non-empty sequence of token ids >= 0, "
                    "got "
                    f"{self.prompt!r:.80}"
                )
            object.__setattr__(self, "prompt", ids)


class Task(Protocol):
    """Problems are a pure function of ``(task config, index)``; ``reward`` scores a
    completion exactly; ``stop`` ends an answer. A task may also have
    ``score(problem, completion) -> (reward, terms)``, the reward with its named parts
    (:class:`~plexrl_dask.tasks.rewards.WeightedRewards`), which a job then records."""

    stop: str

    def problems(self, start: int, count: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


#: The longest task ``repr`` written as it is into a metrics header or job description; a
#: longer one (a task whose data fields are in its repr) is cut there, with a digest of all of
#: it, so that two such tasks still read apart.
TASK_REPR_CHARS = 2000


def check_task(task: Any) -> None:
    """:class:`~plexrl_dask.errors.ConfigError` unless ``task`` is a :class:`Task`: a string
    ``stop``, callable ``problems`` and ``reward``, and ``score``, where it has one, callable
    (checked when a job is made, not at its first step)."""
    missing = [m for m in ("problems", "reward") if not callable(getattr(task, m, None))]
    if not isinstance(getattr(task, "stop", None), str):
        missing.append("stop (a string)")
    if hasattr(task, "score") and not callable(task.score):
        missing.append("score (callable, where a task has one)")
    if getattr(task, "tools", None):  # (an agentic task: its episodes read these)
        for name in ("max_turns", "observation_limit"):
            value = getattr(task, name, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                missing.append(f"{name} (an int >= 1: it has tools)")
    if missing:
        raise ConfigError(
            f"a task has problems(start, count), reward(problem, completion) and a stop string "
            f"(docs/tasks.md); {type(task).__name__} lacks {', '.join(missing)}"
        )


def describe_task(task: Any) -> str:
    """``repr(task)`` as every process writes it, cut at :data:`TASK_REPR_CHARS` characters
    with a digest of the whole where it is longer (a job checkpoint names its task so: a
    resume in another process must find the same text). So a task whose class has no repr
    of its own is named by its class, a function by its module and name (never an address:
    ``object``'s repr holds one, which another process does not share), and a dataclass's
    sets are listed in sorted order (their order follows the process's string hash seed);
    the problems' digest tells data apart."""
    text = _canonical(task, 0)
    if len(text) <= TASK_REPR_CHARS:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[:TASK_REPR_CHARS]}... ({len(text)} characters, sha256 {digest})"


def _canonical(value: Any, depth: int) -> str:
    """:func:`describe_task`'s repr of ``value``: a dataclass with its generated repr field
    by field, sets sorted, functions and classes by name, addresses left out elsewhere."""
    if depth > 8:
        return _ADDRESS.sub("", repr(value))
    kind = type(value)
    if isinstance(value, (set, frozenset)):
        items = sorted(_canonical(v, depth + 1) for v in value)
        inner = "{" + ", ".join(items) + "}" if items else ""
        return f"{kind.__name__}({inner})" if kind is frozenset or not items else inner
    if inspect.ismethod(value):  # (a bound method: of which object, too)
        return f"<{value.__qualname__} of {_canonical(value.__self__, depth + 1)}>"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"<{getattr(value, '__module__', '?')}.{value.__qualname__}>"
    if dataclasses.is_dataclass(value) and hasattr(kind.__repr__, "__wrapped__"):
        fields = (f for f in dataclasses.fields(value) if f.repr)
        inner = ", ".join(
            f"{f.name}={_canonical(getattr(value, f.name), depth + 1)}" for f in fields
        )
        return f"{kind.__qualname__}({inner})"
    if kind.__repr__ is object.__repr__:
        return f"<{kind.__module__}.{kind.__qualname__}>"
    if isinstance(value, (list, tuple)) and kind in (list, tuple):
        items = [_canonical(v, depth + 1) for v in value]
        return (
            f"[{', '.join(items)}]"
            if kind is list
            else f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        )
    return _ADDRESS.sub("", repr(value))


#: An address in a repr (``<function f at 0x7f...>``): another process's differs.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
