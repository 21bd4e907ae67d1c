"""What every procedural task is: reproducible problems and an exact verifier."""

from __future__ import annotations

import hashlib
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
    if missing:
        raise ConfigError(
            f"a task has problems(start, count), reward(problem, completion) and a stop string "
            f"(docs/tasks.md); {type(task).__name__} lacks {', '.join(missing)}"
        )


def describe_task(task: Any) -> str:
    """``repr(task)``, cut at :data:`TASK_REPR_CHARS` characters with a digest of the whole
    where it is longer; a task whose class has no repr of its own is named by its class
    (``object``'s repr holds its address, which another process does not share: a job
    checkpoint would never match its task again; the problems' digest tells data apart)."""
    if type(task).__repr__ is object.__repr__:
        return f"<{type(task).__module__}.{type(task).__qualname__}>"
    text = repr(task)
    if len(text) <= TASK_REPR_CHARS:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[:TASK_REPR_CHARS]}... ({len(text)} characters, sha256 {digest})"
