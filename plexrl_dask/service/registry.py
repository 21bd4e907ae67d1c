"""Deployment records: what the scheduler's registry stores about each deployment.

The registry itself lives in the scheduler plugin (so any job's driver can find any deployment);
this module only defines the record, shared by the plugin, the client-side router and the
workers' replica holders. Records cross the wire as plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from plexrl_dask.errors import ConfigError
from plexrl_dask.models.spec import ModelSpec

ROLES = ("train", "rollout")


@dataclass(frozen=True)
class DeploymentInfo:
    """A registered deployment.

    ``uid`` changes on every (re)deploy, so a holder never mistakes a new deployment for an old
    one of the same name. ``workers`` is the placement (one worker until multi-rank groups);
    ``candidates``, when set, are the only workers it may be placed on (then and after a
    worker loss).
    ``state`` is ``"placed"``, ``"unplaced"`` (its worker left and its state can be rebuilt from
    the spec, so the next request places it again) or ``"lost"`` (its worker left with trained
    state that exists nowhere else).
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
    state: str = "placed"
    modified: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.name or "/" in self.name:
            raise ConfigError(f"deployment names must be non-empty and contain no '/': {self.name!r}")

    @property
    def worker(self) -> str | None:
        return self.workers[0] if self.workers else None

    def with_(self, **changes: Any) -> DeploymentInfo:
        return replace(self, **changes)

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
            "state": self.state,
            "modified": self.modified,
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
            state=d.get("state", "placed"),
            modified=bool(d.get("modified", False)),
        )
