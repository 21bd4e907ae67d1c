"""Supervised warm-up and greedy evaluation of a deployment on a procedural task; the
warm-up of a mix's jobs at once, each saved as the checkpoint every mode starts from
(:func:`warm_start`).

A randomly initialised tiny model cannot learn from rewards it never gets; a short
cross-entropy warm-up on (prompt, answer) pairs gives it a starting accuracy that RL can then
improve. Both loops use only the public API; the next batch's ``forward_backward`` is submitted
before the current step's result is read, so the worker never waits for the driver.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl_dask.config import request_timeout
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.runtime import Runtime
from plexrl_dask.driver.waits import result
from plexrl_dask.errors import RequestTimeout
from plexrl_dask.rl.episodes import transcript_datum
from plexrl_dask.shared.types import AdamWParams, Chat, CrossEntropy, Datum, SamplingParams
from plexrl_dask.tasks.agentic import is_agentic
from plexrl_dask.tasks.base import Problem, Task

if TYPE_CHECKING:
    from plexrl_dask.rl.modes import JobSpec

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
    stop = (task.stop,) if task.stop else ()  # (a task's "" is no stop string)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop=stop)
    out = result(deployment.sample([p.prompt for p in problems], params))
    rewards = [
        task.reward(p, group[0].text) for p, group in zip(problems, out.sequences, strict=True)
    ]
    return sum(rewards) / len(rewards)


def warmup_deployment(job: str) -> str:
    """The name of ``job``'s warm-up deployment (:func:`warm_start`), the writer its
    checkpoint records."""
    return f"warmup-{job}"


def warm_start(
    runtime: Runtime,
    specs: Sequence[JobSpec],
    directory: str | os.PathLike[str],
    on_progress: Callable[[str, int, float], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every job's supervised warm-up (at once, on whatever workers placement picks) and
    save each trained state as a checkpoint under ``directory``; returns the checkpoints by
    job (what ``save_state`` returned, for ``load_state``). ``on_progress(job, step, loss)``
    is called after every warm-up step. Past its timeout (a request timeout per step) it
    raises :class:`RequestTimeout` at once; the warm-ups still running stop after their
    current step and undeploy."""
    stop = threading.Event()

    def stepped(name: str) -> Callable[[int, dict[str, float]], None]:
        def on_step(step: int, metrics: dict[str, float]) -> None:
            if stop.is_set():
                raise RequestTimeout(f"the warm-up of {name} was stopped: past its timeout")
            if on_progress is not None:
                on_progress(name, step + 1, float(metrics["loss"]))

        return on_step

    def one(spec: JobSpec) -> dict[str, Any]:
        name = warmup_deployment(spec.name)
        job = Runtime(runtime.client, job=spec.name)  # the job's requests carry its name
        policy = job.deploy(name, spec.model)
        try:
            supervised_warmup(
                policy,
                spec.task,
                steps=spec.warmup_steps,
                batch_size=spec.warmup_batch_size,
                optim=AdamWParams(lr=spec.warmup_lr),
                on_step=stepped(spec.name),
            )
            return result(policy.save_state(Path(directory) / spec.name))
        finally:
            job.undeploy(name)

    if not specs:
        return {}
    # Every wait inside is bounded by the request timeout; so is the whole, per step.
    timeout = request_timeout() * (max((s.warmup_steps for s in specs), default=0) + 3)
    pool = ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="plexrl-warmup")
    try:
        futures = {s.name: pool.submit(one, s) for s in specs}
        _, running = wait(futures.values(), timeout=timeout)
        if running:
            late = [name for name, f in futures.items() if f in running]
            raise RequestTimeout(f"the warm-ups of {late} did not finish in {timeout:.0f} s")
        return {name: f.result() for name, f in futures.items()}
    finally:
        stop.set()  # (a warm-up still running stops at its next step and undeploys)
        pool.shutdown(wait=False, cancel_futures=True)
