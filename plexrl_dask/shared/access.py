"""Who may do what to a deployment (pure: the scheduler plugin enforces it; the driver names
what it shares).

A deployment belongs to the job that deployed it (``DeploymentInfo.owner``, the deploying
runtime's job). Its owner may run any request on it and change it (undeploy, relocate,
share); another job only the request ops its owner shared with it
(``Deployment.share(job, ops)``, :class:`Shares`), and nothing else. A request names its
job in its annotation (``Runtime(job=...)`` does), and a request that names none is refused:
requests are charged to the job that submitted them, so every one has a job.

What this protects against is another job's requests and mistakes (a stale name, a copied
handle, a typo), not a hostile client: a Dask client can run any code on the workers, and the
job a runtime names is its own word (docs/architecture.md, "Tenants and ownership").
"""

from __future__ import annotations

from collections.abc import Iterable

from plexrl_dask.errors import ConfigError, PermissionDenied

#: The request ops a deployment serves (``plexrl_dask.worker.ops``).
OPS = frozenset(
    {
        "load",
        "forward",
        "forward_backward",
        "optim_step",
        "sample",
        "get_weights",
        "set_weights",
        "save_state",
        "load_state",
        "publish_weights",
        "load_weights",
    }
)
#: What ``share`` grants by default: the ops that read a deployment and change nothing.
READ_OPS = ("sample", "forward", "get_weights", "load")


def checked_ops(ops: Iterable[str]) -> frozenset[str]:
    """``ops`` as a set of known request ops; :class:`ConfigError` naming any other."""
    if isinstance(ops, str):
        ops = (ops,)
    out = frozenset(ops)
    unknown = sorted(str(o) for o in out - OPS)
    if unknown:
        raise ConfigError(f"unknown ops {unknown}; a deployment serves {sorted(OPS)}")
    return out


class Shares:
    """The ops each deployment's owner shared with other jobs: by deployment, by job."""

    def __init__(self) -> None:
        self._by_deployment: dict[str, dict[str, frozenset[str]]] = {}

    def grant(self, deployment: str, job: str, ops: Iterable[str]) -> frozenset[str]:
        """Let ``job`` run ``ops`` on ``deployment`` (replacing what it had; no ops: revoke)."""
        if not isinstance(job, str) or not job:
            raise ConfigError(f"share with a job name, got {job!r}")
        granted = checked_ops(ops)
        mine = self._by_deployment.setdefault(deployment, {})
        if granted:
            mine[job] = granted
        else:
            mine.pop(job, None)
        return granted

    def of(self, deployment: str) -> dict[str, frozenset[str]]:
        return dict(self._by_deployment.get(deployment, {}))

    def forget(self, deployment: str) -> None:
        self._by_deployment.pop(deployment, None)

    def check_request(self, deployment: str, owner: str, job: str, op: str) -> None:
        """:class:`PermissionDenied` unless ``job`` may run ``op`` on ``deployment``."""
        if not job:
            raise PermissionDenied(
                f"a request to {deployment!r} names no job: annotate it with its job "
                "(dask.annotate(plexrl={'deployment': ..., 'job': ...}); Runtime(job=...) does)"
            )
        if job == owner or op in self._by_deployment.get(deployment, {}).get(job, ()):
            return
        raise PermissionDenied(
            f"job {job!r} may not {op!r} deployment {deployment!r} of job {owner!r}; its owner "
            f"can share it: deployment.share({job!r}, ops=({op!r},))"
        )


def check_owner(deployment: str, owner: str, job: str | None, what: str) -> None:
    """:class:`PermissionDenied` unless ``job`` owns ``deployment`` (to ``what`` it)."""
    if job != owner:
        raise PermissionDenied(
            f"job {job!r} may not {what} deployment {deployment!r}: it belongs to job {owner!r}"
        )
