"""Supervised warm-up and greedy evaluation of a deployment on a procedural task.

A randomly initialised tiny model cannot learn from rewards it never gets; a short
cross-entropy warm-up on (prompt, answer) pairs gives it a starting accuracy that RL can then
improve. Both loops use only the public API; the next batch's ``forward_backward`` is submitted
before the current step's result is read, so the worker never waits for the driver.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.waits import result
from plexrl_dask.rl.episodes import transcript_datum
from plexrl_dask.shared.types import AdamWParams, Chat, CrossEntropy, Datum, SamplingParams
from plexrl_dask.tasks.agentic import is_agentic
from plexrl_dask.tasks.base import Problem, Task

logger = logging.getLogger(__name__)


def problem_datum(deployment: Deployment, p: Problem) -> Datum:
    """A datum that trains on the answer of ``p`` given its prompt."""
    prompt = deployment.tokenize(p.prompt) if isinstance(p.prompt, (str, Chat)) else p.prompt
    return Datum.from_prompt_completion(prompt, deployment.tokenize(p.answer, special_tokens=False))


def supervised_warmup(
    deployment: Deployment,
    task: Task,
    steps: int,
    batch_size: int = 32,
    optim: AdamWParams = AdamWParams(lr=3e-3),
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[float]:
    """Train ``deployment`` on answers of ``task`` for ``steps`` steps; returns the losses.
    An agentic task's answers are reference transcripts, trained on with their tool
    observations masked (:func:`~plexrl_dask.rl.episodes.transcript_datum`)."""

    datum = transcript_datum if is_agentic(task) else problem_datum
    losses: list[float] = []
    pending = None
    for step in range(steps):
        batch = [datum(deployment, p) for p in task.problems(step * batch_size, batch_size)]
        fb = deployment.forward_backward(batch, CrossEntropy())
        opt = deployment.optim_step(optim)
        if pending is not None:
            losses.append(_finish(pending, step - 1, on_step))
        pending = (fb, opt)
    if pending is not None:
        losses.append(_finish(pending, steps - 1, on_step))
    return losses


def _finish(pending, step: int, on_step) -> float:
    metrics, _ = result(list(pending))
    if on_step is not None:
        on_step(step, metrics)
    return float(metrics["loss"])


def evaluate(
    deployment: Deployment, task: Task, problems: list[Problem], max_tokens: int = 8
) -> float:
    """Greedy accuracy of ``deployment`` on ``problems``."""
    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop=(task.stop,))
    out = result(deployment.sample([p.prompt for p in problems], params))
    rewards = [
        task.reward(p, group[0].text) for p, group in zip(problems, out.sequences, strict=True)
    ]
    return sum(rewards) / len(rewards)
