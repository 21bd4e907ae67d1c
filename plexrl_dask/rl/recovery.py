"""What keeps a job going when things move or break, apart from its steps: checkpoints (save
every few steps, resume, go back after a lost deployment) and following its placement.

:class:`GRPOJob <plexrl_dask.rl.grpo.GRPOJob>` calls these between steps; each knows nothing of
GRPO. The checkpoint's on-disk form is :mod:`plexrl_dask.rl.job_checkpoint`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plexrl_dask.config import request_timeout
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.runtime import Runtime
from plexrl_dask.driver.waits import result
from plexrl_dask.errors import (
    CheckpointError,
    CheckpointIncompatible,
    CheckpointIncomplete,
    CheckpointNotFound,
    DeploymentBusy,
    StateStoreError,
)
from plexrl_dask.rl.job_checkpoint import (
    JobCheckpoint,
    JobCheckpoints,
    append_step,
    hold,
    model_identity,
    new_checkpoint,
    prune,
    read_checkpoint,
    read_steps,
    write_checkpoint,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What :meth:`JobSaver.restore` brought back: the steps done, their records (as saved)
    and the restored versions (the policy's, then the rollout's when it had saved state)."""

    steps_done: int
    records: list[dict[str, Any]]
    versions: list[int]


class JobSaver:
    """A job's checkpoints in ``checkpoints.directory``: its policy's state and its rollout's
    weights, every ``checkpoints.every`` steps, with the records of the steps done.
    ``identity``: what a checkpoint must match to be resumed (``config``, ``task``)."""

    def __init__(
        self,
        name: str,
        checkpoints: JobCheckpoints,
        identity: dict[str, Any],
        policy: Deployment,
        rollout: Deployment | None,
        staleness: int,
        problems: Callable[[int], Sequence[Any]] | None = None,
    ) -> None:
        """``problems``: step ``k``'s problems, of which a checkpoint keeps a digest
        (:class:`ProblemsDigest`), checked on resume."""
        self.name = name
        self.problems = None if problems is None else ProblemsDigest(problems)
        self.checkpoints = checkpoints
        self.identity = identity
        self.policy = policy
        self.rollout = rollout
        self.staleness = staleness
        self.saved: JobCheckpoint | None = None  # the newest checkpoint taken or resumed
        self.seconds: list[float] = []  # how long each checkpoint held up the driver

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Hold the directory for the job's run (one driver at a time)."""
        return hold(self.checkpoints.directory)

    def can_recover(self, recoveries: int) -> bool:
        """Whether a job that went back ``recoveries`` times may go back once more."""
        return self.saved is not None and recoveries < self.checkpoints.max_recoveries

    def restore(self, recovering: bool) -> Restored | None:
        """Restore the job's deployments from the directory's checkpoint and return what was
        restored; None when there is none (then the job's initial state is saved first, so
        that a failure before its first checkpoint can be recovered too). Nothing is loaded
        before the checkpoint has been checked against this job
        (:class:`CheckpointIncompatible`, :class:`CheckpointIncomplete`). ``recovering``:
        after a lost deployment, from the job's own checkpoint (whatever ``resume`` says)."""
        ck = self.checkpoints
        saved = read_checkpoint(ck.directory)
        if saved is None and ck.required:
            raise CheckpointNotFound(
                f"{self.name} was to resume from {ck.directory}, which holds no checkpoint "
                "now (removed since?); its deployments hold no state to start from"
            )
        if saved is None:
            ck.directory.mkdir(parents=True, exist_ok=True)
            read_steps(ck.directory, 0)  # steps of an earlier run that never checkpointed
            prune(ck, None)  # (and what it saved before it died)
            self.save(0)
            return None
        if not (ck.resume or recovering):
            raise CheckpointError(
                f"{ck.directory} holds a checkpoint of {saved.steps_done} steps of "
                f"{saved.job!r}; resume it or give a new directory"
            )
        saved.check(
            self.name,
            self.identity["config"],
            self.identity["task"],
            model_identity(self.policy.info.spec),
        )
        if self.problems is not None and saved.problems is not None:
            here = self.problems.at(saved.steps_done)
            if here != saved.problems:
                raise CheckpointIncompatible(
                    f"{self.name}'s task gives its first {saved.steps_done} steps other "
                    "problems than the checkpoint's steps trained on (its data changed?); "
                    "resume it with the same task, or give a new directory"
                )
        if self.staleness and saved.rollout is None:
            raise CheckpointIncompatible(
                "a split-async job resumes with its rollout's saved weights (one version "
                "behind the policy's): the checkpoint has none"
            )
        records = read_steps(ck.directory, saved.steps_done)
        loads = [self.policy.load_state(saved.policy)]
        if self.rollout is not None and saved.rollout is not None:
            loads.append(self.rollout.load_state(saved.rollout))
        versions = [int(v) for v in result(loads)]
        if versions[0] != saved.version:
            raise CheckpointIncomplete(
                f"{ck.directory}: the policy restored version {versions[0]}, its checkpoint "
                f"says {saved.version} after {saved.steps_done} steps"
            )
        self.saved = saved
        # A save the job made after this checkpoint, before it died (the policy's state of a
        # step whose manifest was never written), would meet the redone step's save under the
        # same version: a conflict unless the redone step is bit-identical (on a GPU it need
        # not be). Nothing refers to it: it goes.
        prune(ck, saved)
        logger.info(
            "%s: resumed from %s after %d steps (policy version %d)",
            self.name, ck.directory, saved.steps_done, saved.version,
        )  # fmt: skip
        return Restored(saved.steps_done, records, versions)

    def step_done(self, record: dict[str, Any], steps_done: int, steps: int) -> None:
        """Record a finished step; take a checkpoint when one is due."""
        append_step(self.checkpoints.directory, record)
        if self.checkpoints.due(steps_done, steps):
            self.save(steps_done)

    def save(self, done: int) -> None:
        """Save the policy's state and the rollout's weights (a split job's are the policy's
        bytes, which the store keeps once; a split-async job's are one version behind), then
        the manifest of ``done`` steps; then prune older checkpoints."""
        ck = self.checkpoints
        t0 = time.perf_counter()
        saves = [self.policy.save_state(ck.store)]
        if self.rollout is not None and not self.rollout.info.weights_only:
            # (a weights-only rollout, vLLM, holds the policy's weights after every step
            # but the last; a resumed job syncs it again)
            saves.append(self.rollout.save_state(ck.store))
        saved = result(saves)
        self.saved = new_checkpoint(
            self.saved,
            ck.keep,
            job=self.name,
            config=self.identity["config"],
            task=self.identity["task"],
            model=model_identity(self.policy.info.spec),
            steps_done=done,
            version=int(saved[0]["version"]),  # (the deployment's, as saved)
            policy=saved[0],
            rollout=saved[1] if len(saved) > 1 else None,
            problems=None if self.problems is None else self.problems.at(done),
        )
        write_checkpoint(ck.directory, self.saved)
        prune(ck, self.saved)
        self.seconds.append(time.perf_counter() - t0)
        logger.debug("%s: checkpoint of %d steps in %.3fs", self.name, done, self.seconds[-1])


class PlacementFollower:
    """Moves a job's idle deployments into its node group (``Runtime.relocate``) when called
    at a point where none of the job's requests are in flight. Moving changes no result (state
    is restored bit for bit; sampling is seeded per step). If state cannot be checkpointed
    for a move (workers without a node store, a full tier), nothing moved: the deployments
    stay where they are and it stops trying. A failed restore (``RelocationFailed``) is
    raised: that deployment refuses requests until its checkpoint is restored.

    :meth:`ask` puts the scheduler the question early, while the job's requests still run,
    so the call waits for no round trip (the question is then up to one step old: a
    deployment that left the group since moves at the next call)."""

    def __init__(self, runtime: Runtime, name: str) -> None:
        self.runtime = runtime
        self.name = name
        self.stay = False  # set when the job's deployments cannot follow its placement
        self._asked: Any = None  # a question started by ask(), for the next call

    def ask(self) -> None:
        """Start the next call's question now (where none is pending)."""
        if not self.stay and self._asked is None:
            self._asked = self.runtime.ask_relocations()

    def due(self) -> bool:
        """Whether the call would move something (or raise): the question asked ahead lists
        moves, or was not answered as it should. A job that keeps its next request in flight
        across steps (scored training) lets it end before calling, only then. Waits for the
        answer (asked while the step ran: there by now); False when nothing was asked."""
        if self.stay or self._asked is None:
            return False
        try:
            status = self._asked.result(timeout=request_timeout() + 5.0)
        except Exception:
            return True  # (the call raises it, typed)
        return not (isinstance(status, dict) and status.get("status") == "OK") or bool(
            status.get("moves")
        )

    def __call__(self) -> None:
        asked, self._asked = self._asked, None
        if self.stay:
            return
        try:
            for move in self.runtime.relocate(asked=asked):
                logger.info("%s: %s moved into the job's node group", self.name, move["name"])
        except DeploymentBusy as e:  # another driver of this job has requests in flight
            logger.info("%s: relocation deferred to the next step: %s", self.name, e)
        except (CheckpointError, StateStoreError) as e:
            self.stay = True
            logger.warning(
                "%s: its deployments cannot move into its node group (%s); they stay where "
                "they are", self.name, e,
            )  # fmt: skip


class ProblemsDigest:
    """A digest of the problems of a job's first ``n`` steps, ``problems(step)`` each: their
    prompts, answers and indices (not their metadata, which a problem's repr leaves out
    too). Kept running: a checkpoint every few steps hashes only the steps since the last
    (going back, it starts over)."""

    def __init__(self, problems: Callable[[int], Sequence[Any]]) -> None:
        self.problems = problems
        self._hashed, self._hash = 0, hashlib.blake2b(digest_size=16)

    def at(self, steps: int) -> str:
        if steps < self._hashed:
            self._hashed, self._hash = 0, hashlib.blake2b(digest_size=16)
        for step in range(self._hashed, steps):
            for p in self.problems(step):
                self._hash.update(repr((p.prompt, p.answer, p.index)).encode())
        self._hashed = steps
        return self._hash.copy().hexdigest()
