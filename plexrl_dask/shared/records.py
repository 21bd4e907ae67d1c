"""Deployment records: what the scheduler's registry stores about each deployment.

The registry itself lives in the scheduler plugin (so any job's driver can find any deployment);
this module only defines the record, shared by the plugin, the client-side router and the
workers' replica holders. Records cross the wire as plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from plexrl_dask.errors import ConfigError, LifecycleError
from plexrl_dask.models.spec import ModelSpec

#: Joins a deployment's name to its job's in the name it is registered under.
NAME_SEPARATOR = "@"


def qualified_name(name: str, job: str) -> str:
    """The registered name of job ``job``'s deployment ``name``: ``name@job``. Deployment
    names are per-job namespaces (job B's ``policy`` is not job A's); a name already qualified
    (``name@job``, e.g. another job's, from its handle) is returned as it is."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a deployment name is a non-empty string, got {name!r}")
    if NAME_SEPARATOR in name:
        split_name(name)  # (checked)
        return name
    if not isinstance(job, str) or not job or NAME_SEPARATOR in job:
        raise ConfigError(f"a job name is a non-empty string without {NAME_SEPARATOR!r}: {job!r}")
    return f"{name}{NAME_SEPARATOR}{job}"


def split_name(registered: str) -> tuple[str, str]:
    """(name, job) of a registered name ``name@job`` (:class:`ConfigError` for another)."""
    if not isinstance(registered, str):
        raise ConfigError(f"a registered deployment name is a string, got {registered!r:.80}")
    name, sep, job = registered.rpartition(NAME_SEPARATOR)
    if not sep or not name or not job or NAME_SEPARATOR in name:
        raise ConfigError(
            f"a registered deployment name is <name>{NAME_SEPARATOR}<job>, one "
            f"{NAME_SEPARATOR!r}, got {registered!r}"
        )
    return name, job


ROLES = ("train", "rollout")
#: The engines a job's replicas run on (plexrl_dask/worker/backends/).
BACKEND_NAMES = ("torch", "vllm")
#: What ``deploy(backend=...)`` accepts: those, and "adapters", a bank of LoRA adapters on one
#: base (plexrl_dask/worker/backends/adapters.py).
DEPLOY_BACKENDS = (*BACKEND_NAMES, "adapters")
#: Backends whose whole state is the weights they are given (``load_weights``,
#: ``set_weights``): they hold nothing to checkpoint, and loading weights brings one back
#: after its worker left or it moved (a rollout engine: vLLM).
WEIGHTS_ONLY_BACKENDS = ("vllm",)


def group_key(uid: str, replica: int, epoch: int) -> str:
    """The name of a worker process group: the deployment incarnation ``uid``'s group of
    replica ``replica`` (a training deployment has one, replica 0) in epoch ``epoch``. Shared by
    the scheduler (which hands out rendezvous tokens per group) and the ranks."""
    group = uid if replica == 0 else f"{uid}/{replica}"
    return f"{group}:{epoch}"


class Lifecycle(StrEnum):
    """Where a deployment is in its life (the registry's record of it, not its residency):

    - ``placed``: it has workers, which hold it or will build it at its next request;
    - ``unplaced``: a worker of it left and its state can be rebuilt from its spec (or it was
      moved unmodified): its next request places it again;
    - ``lost``: a worker left with trained state that exists nowhere else (or a rank dropped
      its shard mid-request): only restoring a checkpoint brings it back;
    - ``relocating``: moving to its job's node group with its trained state saved: restoring
      that checkpoint places it there.

    A string enum: it compares equal to, and crosses the wire as, its value."""

    PLACED = "placed"
    UNPLACED = "unplaced"
    LOST = "lost"
    RELOCATING = "relocating"


#: The moves the scheduler makes, and only those (:meth:`DeploymentInfo.moved`).
MOVES: dict[Lifecycle, frozenset[Lifecycle]] = {
    # re-placed on new workers; a worker left; relocated (unmodified / with saved state)
    Lifecycle.PLACED: frozenset(Lifecycle),
    # placed by its next request; another worker left
    Lifecycle.UNPLACED: frozenset({Lifecycle.PLACED, Lifecycle.UNPLACED, Lifecycle.LOST}),
    # revived by a checkpoint restore, which then places it
    Lifecycle.LOST: frozenset({Lifecycle.UNPLACED, Lifecycle.LOST}),
    # revived by restoring the saved state; a rank of that restore dropped its shard
    Lifecycle.RELOCATING: frozenset({Lifecycle.UNPLACED, Lifecycle.LOST, Lifecycle.RELOCATING}),
}


@dataclass(frozen=True)
class DeploymentInfo:
    """A registered deployment.

    ``uid`` changes on every (re)deploy, so a holder never mistakes a new deployment for an old
    one of the same name. ``workers`` is the placement: ``replicas`` groups of ``world_size``
    ranks each, replica-major (worker of rank r of replica i: ``workers[i * world_size + r]``;
    a training deployment's ranks shard it with FSDP2, a rollout replica's ranks hold its
    tensor-parallel shards);
    ``candidates``, when set, are the only workers it may be placed on (then and after a
    worker loss). ``memory_bytes`` is what one rank/replica needs on its worker.
    ``state``: its :class:`Lifecycle` (changed only through :meth:`moved`).
    """

    name: str
    uid: str
    spec: ModelSpec
    role: str
    backend: str
    owner: str
    memory_bytes: int
    workers: tuple[str, ...] = ()
    candidates: tuple[str, ...] | None = None
    world_size: int = 1
    replicas: int = 1
    vocab_size: int = 0  # from the model config; 0: unknown (then only workers validate)
    max_positions: int = 0
    state: Lifecycle = Lifecycle.PLACED
    modified: bool = field(default=False, compare=False)
    #: The deploy that registered it (its first ``uid``): kept through every lifecycle move,
    #: new only when the name is deployed again. A handle's requests carry it, so a handle of
    #: an undeployed deployment never reaches a later one of the same name.
    incarnation: str = ""
    #: While ``relocating``: the checkpoint saved for the move (what ``save_state`` returned),
    #: for ``load_state``; kept here (and so in the journal) so that a driver that died
    #: mid-move can be replaced by one that finishes it.
    relocation: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.incarnation:
            object.__setattr__(self, "incarnation", self.uid)
        try:
            object.__setattr__(self, "state", Lifecycle(self.state))
        except ValueError:
            raise ConfigError(
                f"state must be one of {[s.value for s in Lifecycle]}, got {self.state!r}"
            ) from None
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.name or "/" in self.name:
            raise ConfigError(
                f"deployment names must be non-empty and contain no '/': {self.name!r}"
            )
        if self.world_size < 1 or self.replicas < 1:
            raise ConfigError(
                f"world_size and replicas must be >= 1: {self.world_size}, {self.replicas}"
            )
        if self.role == "train" and self.replicas != 1:
            raise ConfigError("a training deployment has one replica (shard it with world_size)")
        if self.role == "rollout" and self.world_size != 1 and self.backend != "torch":
            raise ConfigError(
                f"a tensor-parallel rollout runs on the torch backend, not {self.backend!r}"
            )
        if self.backend not in DEPLOY_BACKENDS:
            raise ConfigError(f"backend must be one of {DEPLOY_BACKENDS}, got {self.backend!r}")
        if self.backend == "adapters" and (
            self.role != "rollout" or self.world_size != 1 or self.spec.lora is not None
        ):
            raise ConfigError(
                "an adapter bank is a rollout deployment of its base model's spec (no LoRA) "
                "on one worker per replica: role='rollout', world_size=1"
            )
        if self.backend == "vllm" and self.role != "rollout":
            raise ConfigError(
                "the vllm backend only samples: deploy it with role='rollout', and the policy "
                "it syncs from with backend='torch'"
            )

    @property
    def weights_only(self) -> bool:
        """Its state is only the weights it is given (see ``WEIGHTS_ONLY_BACKENDS``)."""
        return self.backend in WEIGHTS_ONLY_BACKENDS

    def revived_by(self, op: str) -> bool:
        """Whether ``op`` restores all of this deployment's state, so that it may place a
        ``lost`` or ``relocating`` deployment anew: ``load_state``; for a weights-only
        deployment a weight load too; for a torch rollout replica (whose state is its weights:
        it has no optimizer) a load of a published version (``load_weights``, what
        ``sync_weights`` does; ``set_weights`` may set a subset)."""
        if op == "load_state":
            return True
        if self.weights_only:
            return op in ("load_weights", "set_weights")
        return self.role == "rollout" and self.backend == "torch" and op == "load_weights"

    @property
    def num_workers(self) -> int:
        return self.world_size * self.replicas

    def same_model_and_layout(self, other: DeploymentInfo) -> bool:
        return (self.spec, self.role, self.backend, self.world_size, self.replicas) == (
            other.spec,
            other.role,
            other.backend,
            other.world_size,
            other.replicas,
        )

    @property
    def worker(self) -> str | None:
        return self.workers[0] if self.workers else None

    def with_(self, **changes: Any) -> DeploymentInfo:
        """This record with ``changes`` (not its state: :meth:`moved`)."""
        if "state" in changes:
            raise TypeError("a deployment's state changes through moved(), which checks it")
        return replace(self, **changes)

    def moved(self, state: Lifecycle | str, **changes: Any) -> DeploymentInfo:
        """This record in lifecycle ``state`` (with ``changes``); :class:`LifecycleError` for
        a move the lifecycle does not make (:data:`MOVES`)."""
        to = Lifecycle(state)
        if to not in MOVES[self.state]:
            raise LifecycleError(
                f"deployment {self.name!r} is {self.state.value}: it cannot become {to.value}"
            )
        return replace(self, state=to, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uid": self.uid,
            "spec": self.spec.to_dict(),
            "role": self.role,
            "backend": self.backend,
            "owner": self.owner,
            "memory_bytes": self.memory_bytes,
            "workers": list(self.workers),
            "candidates": None if self.candidates is None else list(self.candidates),
            "world_size": self.world_size,
            "replicas": self.replicas,
            "vocab_size": self.vocab_size,
            "max_positions": self.max_positions,
            "state": self.state.value,
            "modified": self.modified,
            "incarnation": self.incarnation,
            "relocation": self.relocation,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeploymentInfo:
        return cls(
            name=d["name"],
            uid=d["uid"],
            spec=ModelSpec.from_dict(d["spec"]),
            role=d["role"],
            backend=d["backend"],
            owner=d["owner"],
            memory_bytes=int(d["memory_bytes"]),
            workers=tuple(d.get("workers", ())),
            candidates=None if d.get("candidates") is None else tuple(d["candidates"]),
            world_size=int(d.get("world_size", 1)),
            replicas=int(d.get("replicas", 1)),
            vocab_size=int(d.get("vocab_size", 0)),
            max_positions=int(d.get("max_positions", 0)),
            state=d.get("state", "placed"),
            modified=bool(d.get("modified", False)),
            incarnation=str(d.get("incarnation") or ""),
            relocation=d.get("relocation"),
        )
