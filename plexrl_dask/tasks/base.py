"""What every procedural task is: reproducible problems and an exact verifier."""

from __future__ import annotations

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
