"""A step's samples scored into training data: the same code on the driver and on a worker.

:func:`score_samples` turns one step's samples (or agentic episodes) into GRPO's training data:
each completion scored by the task's verifier (:func:`~plexrl_dask.tasks.rewards.score`),
advantages per group, zero-advantage groups dropped (:func:`~plexrl_dask.rl.objective.group_data`).

**Scored training** (:meth:`Deployment.train_scored <plexrl_dask.driver.deployment.Deployment.train_scored>`):
a synchronous GRPO step need not bring its samples to the driver at all. The training request
takes the sample request's future and a :class:`ScoringRecipe` (the task, the
:class:`GRPOConfig`, the step's problems and step number); the worker that trains scores the
samples with this module, builds the batch, and trains on its rank's share of it. The chain
sample → driver → training request (a fetch, the driver's work, a submission: the largest
share of what a step through the runtime cost over the same step in one process) becomes
sample → training request, one hand-off inside the scheduler. The driver reads the step's
rewards and lengths from the training request's result (:class:`ScoredSummary`), while the
next step samples.

What a recipe carries runs on the worker: the task's ``reward`` is the job's own code, which a
job holding a Dask client may run there anyway (docs/tenancy.md, "The threat model"). It
travels sealed (:func:`seal_recipe`): bytes the scheduler passes on unread, so the scheduler
never imports the task's module (nor torch, which this package's imports bring); the task's
class goes by value unless it is PlexRL's own, so a task defined in a script or a module the
workers lack still unpickles there. The worker checks the recipe and the samples it gets
(:func:`checked_recipe`) whatever the driver checked. Every rank of a sharded policy scores the same samples the same way and takes its
contiguous share (:func:`~plexrl_dask.shared.checks.rank_shares`), so the arithmetic is the driver path's, bit for bit
(``tests/test_scored_training.py``).
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

from plexrl_dask.errors import InvalidRecipe
from plexrl_dask.rl.objective import GRPOConfig, group_data
from plexrl_dask.shared.checks import rank_shares, rebuilt, whole_batch_loss
from plexrl_dask.shared.types import AdamWParams, Datum, PolicyGradient, SampleResult
from plexrl_dask.tasks.base import Problem, Task
from plexrl_dask.tasks.rewards import score

if TYPE_CHECKING:
    from plexrl_dask.rl.episodes import EpisodeBatch


@dataclass(frozen=True)
class ScoredSummary:
    """What the driver records of a scored step: every reward and completion length (the
    policy's tokens), the groups that taught something, each reward term's mean
    (``reward/<name>``) and, for episodes, their statistics, and the tokens sampled.
    ``reward_s``: the seconds the task's reward took over the step, where it was scored (a
    timing, not part of the step's result: left out of comparisons)."""

    rewards: tuple[float, ...]
    lengths: tuple[int, ...]
    groups_used: int
    terms: dict[str, float] = field(default_factory=dict)
    sampled_tokens: int = 0
    reward_s: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class ScoredBatch:
    """:class:`ScoredSummary` and the training data: the completions of the groups that
    teach something (unless ``keep_zero_advantage``), with their advantages."""

    data: tuple[Datum, ...]
    summary: ScoredSummary


def score_samples(
    task: Task,
    config: GRPOConfig,
    problems: Sequence[Problem],
    out: SampleResult | EpisodeBatch,
) -> ScoredBatch:
    """Score ``out`` (one group per problem, in order) and build the step's training data."""
    # (imported here: episodes run through the driver's runtime, which a worker scoring
    # samples never needs)
    from plexrl_dask.rl.episodes import EpisodeBatch, episode_data

    data: list[Datum] = []
    rewards: list[float] = []
    lengths: list[int] = []
    terms: dict[str, float] = {}
    groups_used = 0
    if isinstance(out, EpisodeBatch):
        groups = [
            (*episode_data(g), [e.answer for e in g], [e.policy_tokens for e in g])
            for g in out.groups
        ]
    else:
        groups = [
            (prompt, [s.tokens for s in g], None, [s.text for s in g], [len(s.tokens) for s in g])
            for prompt, g in zip(out.prompt_tokens, out.sequences, strict=True)
        ]
    reward_s = 0.0
    for problem, (prompt, completions, masks, texts, sizes) in zip(problems, groups, strict=True):
        scores = []
        for text in texts:
            t0 = time.perf_counter()
            reward, parts = score(task, problem, text)
            reward_s += time.perf_counter() - t0
            scores.append(reward)
            for name, value in parts.items():
                terms[f"reward/{name}"] = terms.get(f"reward/{name}", 0.0) + value
        rewards.extend(scores)
        lengths.extend(sizes)
        kept, teaches = group_data(config, prompt, completions, scores, masks)
        groups_used += teaches
        data.extend(kept)
    extra = {k: v / len(rewards) for k, v in terms.items()}
    if isinstance(out, EpisodeBatch):
        extra.update(out.stats())
    summary = ScoredSummary(
        tuple(rewards), tuple(lengths), groups_used, extra, out.num_tokens(), reward_s
    )
    return ScoredBatch(tuple(data), summary)


@dataclass(frozen=True)
class ScoringRecipe:
    """How a worker scores a step's samples and trains on them (see the module docstring):
    ``task`` (its ``reward`` and ``stop``), ``config`` (advantages, loss, optimizer),
    ``problems`` (one per sampled group, in order) and ``step`` (the learning rate's)."""

    task: Task
    config: GRPOConfig
    problems: tuple[Problem, ...]
    step: int

    def __post_init__(self) -> None:
        if not callable(getattr(self.task, "reward", None)):
            raise InvalidRecipe(f"the task {type(self.task).__name__} has no reward(problem, text)")
        if not isinstance(self.config, GRPOConfig):
            raise InvalidRecipe(f"config must be a GRPOConfig, got {type(self.config).__name__}")
        if not self.problems or not all(isinstance(p, Problem) for p in self.problems):
            raise InvalidRecipe("problems must be a non-empty sequence of Problem")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise InvalidRecipe(f"step must be an integer >= 0, got {self.step!r}")


#: A task whose pickled bytes exceed this is scored on the driver (a recipe travels with every
#: step's training request; a task holding a whole dataset should not).
MAX_SEALED_TASK_BYTES = 1 << 20

_SEALING = threading.Lock()  # (cloudpickle's by-value registry is process-wide)
_SEALED = "plexrl-scoring-recipe-1"  # (the first field of a sealed recipe: what it is)


def seal_task(task: Task) -> bytes:
    """``task`` pickled for a worker: its class (and what its module defines that it uses) by
    value unless it is PlexRL's own, so a task defined in a script, a notebook or a module that
    is not installed on the workers still unpickles there."""
    module = sys.modules.get(type(task).__module__)
    by_value = (
        module is not None
        and module.__name__ != "__main__"  # (cloudpickle pickles __main__ by value anyway)
        and not module.__name__.startswith("plexrl_dask.")
    )
    with _SEALING:
        registered = by_value and module.__name__ in cloudpickle.list_registry_pickle_by_value()
        if by_value and not registered:
            cloudpickle.register_pickle_by_value(module)
        try:
            return cloudpickle.dumps(task)
        finally:
            if by_value and not registered:
                cloudpickle.unregister_pickle_by_value(module)


def seal_recipe(recipe: ScoringRecipe, task: bytes | None = None) -> bytes:
    """``recipe`` as the bytes a scored training request carries: the scheduler passes them
    on unread (it never imports the task's module, nor this one), the worker unseals them
    (:func:`unseal_recipe`). ``task``: the task already sealed (:func:`seal_task`), reused."""
    task = seal_task(recipe.task) if task is None else task
    return cloudpickle.dumps((_SEALED, task, recipe.config, recipe.problems, recipe.step))


def unseal_recipe(sealed: Any) -> ScoringRecipe:
    """The recipe in ``sealed``, rebuilt through its constructor; :class:`InvalidRecipe` for
    bytes that are not one, or whose task does not unpickle here."""
    if not isinstance(sealed, bytes):
        raise InvalidRecipe(f"a sealed recipe is bytes, got {type(sealed).__name__}")
    try:
        tag, task, config, problems, step = pickle.loads(sealed)
        if tag != _SEALED:
            raise ValueError("not a sealed recipe")
        task = cloudpickle.loads(task)
    except Exception as e:  # (anything a pickle may raise: its modules, its data)
        raise InvalidRecipe(
            f"the scoring recipe does not unpickle on this worker ({type(e).__name__}: {e}); "
            "make the task's module importable here, or score on the driver "
            "(GRPOJob(score_on_worker=False))"
        ) from None
    try:
        return ScoringRecipe(task, config, tuple(problems), step)
    except TypeError as e:
        raise InvalidRecipe(f"the scoring recipe: {e}") from None


def checked_recipe(recipe: Any, samples: Any) -> tuple[ScoringRecipe, SampleResult]:
    """The recipe (sealed bytes, or a :class:`ScoringRecipe`) rebuilt through its constructor
    (its config through :class:`GRPOConfig`'s, each problem through :class:`Problem`'s), and
    the samples it scores: one group per problem (:class:`InvalidRecipe` otherwise)."""
    if isinstance(recipe, bytes):
        recipe = unseal_recipe(recipe)
    recipe = rebuilt(recipe, ScoringRecipe, InvalidRecipe, "the scoring recipe")
    config = rebuilt(recipe.config, GRPOConfig, InvalidRecipe, "the recipe's config")
    if not isinstance(samples, SampleResult):
        raise InvalidRecipe(f"scored training takes a SampleResult, got {type(samples).__name__}")
    if len(samples.sequences) != len(recipe.problems):
        raise InvalidRecipe(
            f"{len(samples.sequences)} sampled groups for {len(recipe.problems)} problems"
        )
    problems = tuple(
        rebuilt(p, Problem, InvalidRecipe, f"problem {i}") for i, p in enumerate(recipe.problems)
    )
    return dataclasses.replace(recipe, config=config, problems=problems), samples


def scored_training(
    recipe: ScoringRecipe, samples: SampleResult, rank: int, ranks: int
) -> tuple[ScoredSummary, tuple[tuple[Datum, ...], PolicyGradient, AdamWParams] | None]:
    """Score ``samples`` with ``recipe``; with training data, rank ``rank``'s share of it and
    the loss and optimizer step every rank trains with (None: no group taught anything, so
    nothing trains, as on the driver path)."""
    scored = score_samples(recipe.task, recipe.config, recipe.problems, samples)
    if not scored.data:
        return scored.summary, None
    config = recipe.config
    loss = whole_batch_loss(config.loss(len(scored.data)), scored.data, ranks)
    share = rank_shares(scored.data, ranks, pad=True)[rank]  # (fewer teach than ranks: fillers)
    return scored.summary, (share, loss, config.optimizer(recipe.step))
