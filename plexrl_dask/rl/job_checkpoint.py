"""Checkpoints of a whole GRPO job, and resuming one bit for bit.

A job that runs for hours on a shared pool will meet a dead driver, a preempted node or an
operator's restart. With :class:`JobCheckpoints` a :class:`~plexrl_dask.rl.grpo.GRPOJob`
saves, every ``every`` steps and after its last, what its next step depends on, and a job
started again on the same directory continues from there. Because sampling is seeded per
(job, step, prompt, sample) and state is saved and restored bit for bit, the resumed job's
records (rewards, losses, lengths, versions) are exactly those of a run that never stopped.

What a step depends on is: the policy's parameters and optimizer state; the rollout's
parameters (a split job's are the policy's, which the content-addressed store keeps once; a
split-async job's are one version behind, and the next step's samples and behaviour
log-probabilities come from them); the records of the steps done; and the job's config.
Saving the rollout also lets a job restore it when the worker that held it died: a running
job that loses a deployment's state goes back to its last checkpoint by itself
(``max_recoveries`` times), and a job starting afresh saves its initial state first, so
there is always one to go back to.

A checkpoint directory holds::

    job.json         the manifest: steps done, versions, what ``save_state`` returned
    lock             held (``flock``) by the job running on the directory, if any
    steps.jsonl      one record per step done (appended every step; the manifest says how
                     many lines belong to the checkpoint, later ones are redone on resume)
    state/           a state store with the saved versions (``Deployment.save_state``)

The manifest is replaced atomically after every save has returned (saves are themselves
atomic versions of the store), so a crash at any point leaves the previous checkpoint whole.
Only the ``keep`` newest checkpoints' versions stay in the store; older ones are deleted and
their unshared chunks collected. The directory must be reachable by the driver and by the
workers of the policy's rank 0 and of the rollout's replica 0: a local disk on a local
cluster, a shared filesystem otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import numbers
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plexrl_dask import config
from plexrl_dask.errors import (
    CheckpointError,
    CheckpointIncompatible,
    CheckpointIncomplete,
    ConfigError,
    StateStoreError,
)
from plexrl_dask.state_store.store import StateStore

logger = logging.getLogger(__name__)

MANIFEST = "job.json"
STEPS = "steps.jsonl"
STORE = "state"
LOCK = "lock"
FORMAT = 1


@dataclass(frozen=True)
class JobCheckpoints:
    """Where and how often a job checkpoints (``plexrl.job-checkpoint.*`` for the defaults).

    ``every``: steps between checkpoints (the job's last step is always saved). ``keep``: how
    many of the newest checkpoints stay in the store. ``resume``: continue from the
    directory's checkpoint when there is one (``False``: a checkpoint there is an error, so
    that a new run never silently continues an old one). ``max_recoveries``: how many times
    a running job goes back to its last checkpoint after losing a deployment's state.
    ``required``: the job must resume from a checkpoint there (its deployments were given no
    starting state of their own); none is :class:`CheckpointNotFound`, never a fresh start."""

    directory: Path
    every: int
    keep: int
    resume: bool = True
    max_recoveries: int = 3
    required: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        # (plexrl.job-checkpoint.* or the caller's: an integral count, never a bool)
        for name, least in (("every", 1), ("keep", 1), ("max_recoveries", 0)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or (value < least)
            ):
                raise ConfigError(
                    f"job checkpoints' {name} (plexrl.job-checkpoint."
                    f"{name.replace('_', '-')}) is an integer >= {least}, got {value!r}"
                )
            object.__setattr__(self, name, int(value))

    @classmethod
    def at(
        cls,
        directory: str | os.PathLike[str],
        every: int | None = None,
        keep: int | None = None,
        resume: bool = True,
        max_recoveries: int | None = None,
        required: bool = False,
    ) -> JobCheckpoints:
        """Checkpoints in ``directory``; what is not given comes from the config."""
        return cls(
            Path(directory),
            config.get("job-checkpoint.every") if every is None else every,
            config.get("job-checkpoint.keep") if keep is None else keep,
            resume,
            config.get("job-checkpoint.max-recoveries")
            if max_recoveries is None
            else max_recoveries,
            required,
        )

    def due(self, steps_done: int, steps: int) -> bool:
        """Whether a checkpoint is taken once ``steps_done`` of ``steps`` steps are done."""
        return steps_done % self.every == 0 or steps_done == steps

    @property
    def store(self) -> str:
        """The state store's path (what ``save_state`` writes to)."""
        return str(self.directory / STORE)


@dataclass(frozen=True)
class JobCheckpoint:
    """One checkpoint (the manifest): enough, with the store's versions and the first
    ``steps_done`` lines of ``steps.jsonl``, to continue the job exactly."""

    job: str
    config: dict[str, Any]  # the GRPOConfig's fields
    task: str  # the task's repr
    model: dict[str, Any]  # the policy's architecture (:func:`model_identity`)
    steps_done: int
    version: int  # the policy deployment's version, as saved after the last step done
    policy: dict[str, Any]  # what the policy's save_state returned
    rollout: dict[str, Any] | None  # the rollout's (None: the job had none)
    #: Older checkpoints kept: their (policy, rollout) saves, newest first.
    kept: list[list[dict[str, Any] | None]] = field(default_factory=list)
    time: float = 0.0
    format: int = FORMAT
    #: A digest of the problems its ``steps_done`` steps trained on (None: a checkpoint of a
    #: runtime before it): a task whose repr leaves its data out (``repr=False``) is still
    #: the same task only if it gives those steps the same problems.
    problems: str | None = None

    def check(self, job: str, job_config: dict[str, Any], task: str, model: dict[str, Any]) -> None:
        """Raise :class:`CheckpointIncompatible` unless this checkpoint is of the same job:
        same name, task, model architecture and config (``steps`` may differ: a job may be
        continued for more steps than it first ran)."""
        mine = {k: v for k, v in self.config.items() if k != "steps"}
        # (as the manifest holds it: through JSON)
        theirs = {k: v for k, v in json.loads(json.dumps(job_config)).items() if k != "steps"}
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        model = json.loads(json.dumps(model))
        if self.job != job or self.task != task or self.model != model or differ:
            what = [f"job {self.job!r} != {job!r}"] if self.job != job else []
            what += [f"task {self.task} != {task}"] if self.task != task else []
            what += [f"model {self.model} != {model}"] if self.model != model else []
            what += [f"config {k}: {mine.get(k)!r} != {theirs.get(k)!r}" for k in differ]
            raise CheckpointIncompatible(
                f"the checkpoint is of another job ({'; '.join(what)}); resume it with the "
                "same job, or give a new directory"
            )


def model_identity(spec: Any) -> dict[str, Any]:
    """What a checkpoint's model must match, of a :class:`~plexrl_dask.ModelSpec`: the
    architecture of a config-built model and the dtype. Not the init seed (the checkpoint
    replaces the initial weights) nor a checkpoint's path (the same base model may sit
    elsewhere on another machine; a model of other shapes fails the load with
    :class:`CheckpointIncompatible`)."""
    config = None if spec.config is None else [list(kv) for kv in spec.config]
    return {"config": config, "dtype": spec.dtype}


@contextlib.contextmanager
def hold(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``directory`` for one running job (an exclusive ``flock`` on its ``lock`` file,
    released when the block ends or the process dies). A second job on the same directory
    would prune the first one's saves: it gets a :class:`CheckpointError` instead. (On a
    shared filesystem this is as reliable as its ``flock``.)"""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / LOCK, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(
                f"{path} is in use by another running job: give each job its own directory"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def directory_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``directory`` (a checkpoint directory's size on disk)."""
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def read_checkpoint(directory: str | os.PathLike[str]) -> JobCheckpoint | None:
    """The checkpoint in ``directory`` (None when there is none). A manifest that cannot be
    read is a :class:`CheckpointError` (never silently a fresh start)."""
    path = Path(directory) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the job checkpoint {path}: {e}") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a job checkpoint of format {FORMAT}")
    try:
        ckpt = JobCheckpoint(**raw)
    except TypeError as e:
        raise CheckpointError(f"{path} is not a job checkpoint: {e}") from e
    fields = {
        "job": (str, "a string"), "task": (str, "a string"), "config": (dict, "an object"),
        "model": (dict, "an object"), "time": ((int, float), "a number"),
        "steps_done": (int, "an integer"), "version": (int, "an integer"),
        "problems": ((str, type(None)), "a string or null"),
    }  # fmt: skip
    for name, (types, kind) in fields.items():
        value = getattr(ckpt, name)
        if isinstance(value, bool) or not isinstance(value, types):
            raise CheckpointError(f"{path}: its {name} is not {kind}: {value!r:.80}")
    if ckpt.steps_done < 0 or ckpt.version < 0:
        raise CheckpointError(f"{path}: steps_done and version are counts >= 0")
    saves = [ckpt.policy, ckpt.rollout]
    if not isinstance(ckpt.kept, list) or not all(
        isinstance(pair, list) and len(pair) == 2 for pair in ckpt.kept
    ):
        raise CheckpointError(f"{path}: its kept checkpoints are not (policy, rollout) pairs")
    saves += [s for pair in ckpt.kept for s in pair]
    if ckpt.policy is None or not all(s is None or _is_save(s) for s in saves):
        raise CheckpointError(f"{path}: a save it names has no model and version")
    return ckpt


def _is_save(save: Any) -> bool:
    """Whether ``save`` is what a deployment's ``save_state`` returned (a stored version)."""
    if not isinstance(save, dict):
        return False
    version = save.get("version")
    return isinstance(save.get("model"), str) and type(version) is int


def write_checkpoint(directory: str | os.PathLike[str], ckpt: JobCheckpoint) -> None:
    """Replace the manifest atomically (written beside it, flushed, renamed over it), once
    the step records it counts are on disk; the rename is made durable with the directory.
    A crash at any point leaves the old manifest or the new one, each with its records."""
    path = Path(directory) / MANIFEST
    steps = Path(directory) / STEPS
    if steps.exists():  # (the manifest must never count records a crash can lose)
        _fsync(steps)
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(ckpt), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(Path(directory), directory=True)


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_step(directory: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append one step's record to ``steps.jsonl``."""
    with open(Path(directory) / STEPS, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_steps(directory: str | os.PathLike[str], steps_done: int) -> list[dict[str, Any]]:
    """The first ``steps_done`` records of ``steps.jsonl``, and the file cut to them (the
    steps after the checkpoint are redone). Fewer lines than that, or a record of another
    step, is a :class:`CheckpointIncomplete`."""
    path = Path(directory) / STEPS
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    try:
        records = [json.loads(line) for line in lines[:steps_done]]
    except ValueError as e:
        raise CheckpointIncomplete(f"{path}: a record is not JSON: {e}") from e
    if not all(isinstance(r, dict) for r in records):
        raise CheckpointIncomplete(f"{path}: a record is not a step's (a JSON object)")
    if len(records) < steps_done or [r.get("step") for r in records] != list(range(steps_done)):
        raise CheckpointIncomplete(
            f"{path} holds {len(records)} readable steps of the {steps_done} its checkpoint "
            "says are done"
        )
    if len(lines) > steps_done:
        tmp = path.with_name(f".{STEPS}.tmp")
        with open(tmp, "w") as f:  # (durable before it replaces the records it keeps)
            f.write("".join(line + "\n" for line in lines[:steps_done]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync(Path(directory), directory=True)
    return records


def prune(checkpoints: JobCheckpoints, ckpt: JobCheckpoint | None) -> dict[str, int]:
    """Delete the store's versions that no kept checkpoint refers to (``ckpt`` None: every
    version), and collect their chunks that nothing else shares. Returns the store's
    collection counts. Best effort: a failure is logged (the checkpoint itself is already
    whole)."""
    live: set[tuple[str, int]] = set()
    if ckpt is not None:
        live = {(s["model"], int(s["version"])) for pair in ckpt.kept for s in pair if s}
        live |= {(s["model"], int(s["version"])) for s in (ckpt.policy, ckpt.rollout) if s}
    if not Path(checkpoints.store).exists():
        return {}
    try:
        store = StateStore(checkpoints.store)
        # Every model of the job's store: a resumed job's deployments may have new names.
        for model in store.models():
            for version in store.versions(model):
                if (model, version) not in live:
                    store.delete_version(model, version)
        # Only this job writes here and nothing is being written now (the saves returned):
        # no grace period is needed for objects; a crashed publish's staging keeps its own.
        return store.gc(grace_s=0.0)
    except (OSError, StateStoreError) as e:
        logger.warning("pruning old checkpoints in %s failed: %s", checkpoints.store, e)
        return {}


def new_checkpoint(
    previous: JobCheckpoint | None,
    keep: int,
    **fields: Any,
) -> JobCheckpoint:
    """The manifest of a new checkpoint, keeping the ``keep - 1`` newest earlier ones."""
    kept: list[list[dict[str, Any] | None]] = []
    if previous is not None and keep > 1:
        kept = [[previous.policy, previous.rollout], *previous.kept][: keep - 1]
    return JobCheckpoint(kept=kept, time=time.time(), **fields)
