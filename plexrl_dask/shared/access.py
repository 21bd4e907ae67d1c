"""Who may do what to a deployment, and who a caller is (pure: the scheduler plugin enforces
it; the driver names what it shares and presents its secrets).

**Principals.** A job is registered with the scheduler by the first runtime that names it
(``Runtime(client, job=...)``), which gets the job's secret; every call and request in the job's
name presents it (:class:`Principals`). Another driver process that names the same job is
refused unless it presents that secret (``Runtime(client, job, secret=...)``: a driver that
reattaches). The cluster's *operator* holds the operator secret (``plexrl.operator-secret``, or
the file the scheduler writes it to, readable only by the user that runs the scheduler) and is
the only caller that may change cluster-wide policy.

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

import hashlib
import hmac
import secrets as _secrets
from collections.abc import Iterable, MutableMapping

from plexrl_dask.errors import ConfigError, PermissionDenied
from plexrl_dask.shared.records import NAME_SEPARATOR

#: The request ops a deployment serves (``plexrl_dask.worker.ops``).
OPS = frozenset(
    {
        "load",
        "forward",
        "forward_backward",
        "optim_step",
        "train_step",
        "sample",
        "sample_train",
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
    try:
        out = frozenset(ops)
    except TypeError:
        raise ConfigError(f"ops are a list of op names, got {ops!r:.80}") from None
    unknown = sorted(str(o) for o in out - OPS)
    if unknown:
        raise ConfigError(f"unknown ops {unknown}; a deployment serves {sorted(OPS)}")
    return out


class Shares:
    """The ops each deployment's owner shared with other jobs: by deployment, by job."""

    def __init__(self, store: MutableMapping[str, dict[str, frozenset[str]]] | None = None) -> None:
        # (a journaled map in the scheduler: every change is a new value, set whole)
        self._by_deployment = store if store is not None else {}

    def grant(self, deployment: str, job: str, ops: Iterable[str]) -> frozenset[str]:
        """Let ``job`` run ``ops`` on ``deployment`` (replacing what it had; no ops: revoke)."""
        if not isinstance(job, str) or not job:
            raise ConfigError(f"share with a job name, got {job!r}")
        granted = checked_ops(ops)
        mine = {j: o for j, o in self._by_deployment.get(deployment, {}).items() if j != job}
        if granted:
            mine[job] = granted
        if mine:
            self._by_deployment[deployment] = mine
        else:
            self._by_deployment.pop(deployment, None)
        return granted

    def of(self, deployment: str) -> dict[str, frozenset[str]]:
        return dict(self._by_deployment.get(deployment, {}))

    def granting(self, job: str, op: str) -> list[str]:
        """The deployments whose owners let ``job`` run ``op`` on them."""
        return sorted(d for d, grants in self._by_deployment.items() if op in grants.get(job, ()))

    def forget(self, deployment: str) -> None:
        self._by_deployment.pop(deployment, None)

    def check_request(self, deployment: str, owner: str, job: str, op: str) -> None:
        """:class:`PermissionDenied` unless ``job`` may run ``op`` on ``deployment``."""
        if not job:
            raise PermissionDenied(
                f"a request to {deployment!r} names no job: annotate it with its job "
                "and its secret (dask.annotate(plexrl={'deployment': ..., 'job': ..., "
                "'secret': ...}); Runtime(job=...) does)"
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


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def new_secret() -> str:
    """A fresh random secret (128 bits, hex)."""
    return _secrets.token_hex(16)


class Principals:
    """The registered jobs and the operator: who presents which secret. Only digests are kept."""

    def __init__(self, operator_secret: str, store: MutableMapping[str, str] | None = None) -> None:
        if not isinstance(operator_secret, str) or len(operator_secret) < 16:
            raise ConfigError("the operator secret must be a string of at least 16 characters")
        self._operator = _digest(operator_secret)
        # job -> hex digest of its secret (a journaled map in the scheduler)
        self._jobs = store if store is not None else {}

    def register(self, job: str, secret: str | None = None) -> str:
        """Register ``job`` and return its secret: a new job gets a fresh one; a known job is
        re-attached only by presenting its secret (:class:`PermissionDenied` otherwise)."""
        if not isinstance(job, str) or not job or len(job) > 200 or NAME_SEPARATOR in job:
            raise ConfigError(
                f"a job is named by a non-empty string of <= 200 characters without '@' "
                f"(it qualifies its deployments' names): {job!r}"
            )
        if job not in self._jobs:
            if secret is not None:
                raise PermissionDenied(
                    f"job {job!r} is not registered (the scheduler may have restarted); "
                    "register it without a secret to get a new one"
                )
            fresh = new_secret()
            self._jobs[job] = _digest(fresh).hex()
            return fresh
        self.verify(job, secret)
        assert secret is not None
        return secret

    def verify(self, job: str | None, secret: str | None) -> None:
        """:class:`PermissionDenied` unless ``job`` is registered and ``secret`` is its own."""
        known = self._jobs.get(job) if isinstance(job, str) else None
        if known is None:
            raise PermissionDenied(
                f"job {job!r} is not registered with the scheduler: "
                "create its runtime with plexrl_dask.Runtime(client, job=...)"
            )
        if not isinstance(secret, str) or not hmac.compare_digest(_digest(secret).hex(), known):
            raise PermissionDenied(
                f"job {job!r} is registered by another driver; present its secret to act in "
                "its name (Runtime(client, job, secret=...))"
            )

    def check_operator(self, secret: str | None, what: str) -> None:
        """:class:`PermissionDenied` unless ``secret`` is the operator's (to ``what``)."""
        if not isinstance(secret, str) or not hmac.compare_digest(_digest(secret), self._operator):
            raise PermissionDenied(
                f"only the cluster's operator may {what}: present the operator secret "
                "(plexrl.operator-secret, or the file named by status()['operator_secret_file'])"
            )

    def __contains__(self, job: object) -> bool:
        return job in self._jobs

    def jobs(self) -> list[str]:
        return sorted(self._jobs)
