"""The scheduler plugin's queue of PlexRL requests that are routed but not yet released, and
what a request's annotation may say.

A request is one call on a deployment: one task per rank, parked in ``no-worker`` until the
dispatch rule releases all of them together. The queue keeps them in submission order, per
deployment (requests of one deployment are admitted to the dispatcher in that order), remembers
which deployments' queues changed since the dispatcher last looked, and which request each task
key belongs to. It holds no policy: the plugin routes, admits and releases
(:mod:`plexrl_dask.plugins.scheduler`); the dashboard benchmark fills it the same way
(:mod:`plexrl_dask.bench.dashboard`). :class:`QueueQuota` is the one limit on it: how many
requests a job may have waiting at once, checked when the plugin routes a request.

A task's ``plexrl`` annotation is the client's word on its request, checked when the plugin
routes it: the fields only the scheduler writes (:data:`SCHEDULER_FIELDS`) are dropped from what
a client sent (:func:`keep_only_the_clients`); ``ranks``, ``rank`` and ``replica`` are integers
(:func:`positions`) that fit the deployment (:func:`check_fits`), whose workers for them are the
request's candidate groups (:func:`candidate_groups`); and a request id names one call
(:meth:`RequestQueue.check_id`). A check that fails raises :class:`NotRouted`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plexrl_dask import config
from plexrl_dask.errors import NotRouted, QuotaExceeded
from plexrl_dask.protocol import ANNOTATION

if TYPE_CHECKING:
    from distributed.scheduler import TaskState

    from plexrl_dask.shared.records import DeploymentInfo

#: Annotation fields only the scheduler plugin writes (a worker trusts them): what a client sent
#: under these names is dropped when its graph arrives.
SCHEDULER_FIELDS = frozenset(
    {"readable", "uid", "modified", "dispatched", "group", "epoch", "rendezvous", "worker", "error"}
)


def keep_only_the_clients(ts: TaskState) -> None:
    """Drop the :data:`SCHEDULER_FIELDS` from what a client annotated task ``ts`` with (its
    annotations are replaced, not changed in place; left alone when it sent none of them)."""
    ann = ts.annotations.get(ANNOTATION)
    if isinstance(ann, dict) and not SCHEDULER_FIELDS.isdisjoint(ann):
        clean = {k: v for k, v in ann.items() if k not in SCHEDULER_FIELDS}
        ts.annotations = {**ts.annotations, ANNOTATION: clean}


def positions(ann: dict) -> tuple[int, int, int | None]:
    """A request's ``ranks``, this task's ``rank`` and its ``replica`` (None: any replica)
    from its annotation (:class:`NotRouted` for what is not an integer)."""
    try:
        ranks, rank = int(ann.get("ranks", 1)), int(ann.get("rank", 0))
        replica = ann.get("replica", 0)
        return ranks, rank, None if replica is None else int(replica)
    except (TypeError, ValueError, OverflowError) as e:
        raise NotRouted(f"ranks, rank and replica are integers: {e}") from None


def check_fits(name: str, info: DeploymentInfo, ranks: int, rank: int, replica: int | None) -> None:
    """:class:`NotRouted` unless rank ``rank`` of a ``ranks``-rank request for ``replica``
    (None: any) fits deployment ``name`` (``info``): its world size, one of its replicas."""
    if (
        not 0 <= rank < ranks
        or ranks != info.world_size
        or (replica is not None and not 0 <= replica < info.replicas)
    ):
        raise NotRouted(
            f"{name!r} has world_size {info.world_size} and {info.replicas} replicas; "
            f"a request for rank {rank}/{ranks} of replica {replica} does not fit it"
        )


def candidate_groups(info: DeploymentInfo, replica: int | None) -> tuple[tuple[str, ...], ...]:
    """The candidate groups of a request: its replica's workers, or every replica's."""
    k = info.world_size
    replicas = range(info.replicas) if replica is None else (replica,)
    return tuple(tuple(info.workers[r * k : (r + 1) * k]) for r in replicas)


@dataclass(eq=False)
class PendingRequest:
    """A request not yet released: its tasks' keys by rank and its candidate groups of workers
    (None until routed, or once they are stale). ``replica`` is None for a data-parallel
    request (any replica may take it); ``admitted``: handed to the dispatcher."""

    request: str
    ranks: int
    deployment: str = ""
    op: str = ""
    replica: int | None = 0
    job: str = ""
    holds: bool = False  # its order's next request follows soon (an agentic turn)
    keys: dict[int, Any] = field(default_factory=dict)
    groups: tuple[tuple[str, ...], ...] | None = None
    admitted: bool = False

    @property
    def order(self) -> str:
        """Requests of one order run in submission order."""
        return f"{self.deployment}#{'any' if self.replica is None else self.replica}"

    def forgotten(self, tasks: Mapping[Any, Any]) -> bool:
        """Whether the scheduler forgot one of its tasks (its client let go of it)."""
        return any(k not in tasks for k in self.keys.values())


class RequestQueue:
    """Pending requests (see the module docstring). Iterating yields them in submission
    order."""

    def __init__(self) -> None:
        self._pending: dict[str, PendingRequest] = {}
        self._by_deployment: dict[str, list[PendingRequest]] = {}
        self._changed: set[str] = set()
        self._of_key: dict[Any, str] = {}
        self._keys_of: dict[str, set[Any]] = {}  # request id -> its tracked keys
        self._per_job: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[PendingRequest]:
        return iter(list(self._pending.values()))

    def __contains__(self, request: str) -> bool:
        return request in self._pending

    def get(self, request: str) -> PendingRequest | None:
        return self._pending.get(request)

    def of_key(self, key: Any) -> PendingRequest | None:
        """The pending request task ``key`` belongs to, if any."""
        return self._pending.get(self._of_key.get(key, ""))

    def tracks(self, key: Any) -> bool:
        """Whether task ``key`` is a PlexRL task this plugin routed and has not dropped (it may
        have been released already)."""
        return key in self._of_key

    def in_use(self, request: str, key: Any) -> bool:
        """Whether a tracked task other than ``key`` belongs to request id ``request``."""
        return bool(self._keys_of.get(request, set()) - {key})

    def check_id(
        self,
        request: str,
        key: Any,
        job: str,
        deployment: str,
        op: str,
        ranks: int,
        rank: int,
        replica: int | None,
    ) -> None:
        """:class:`NotRouted` unless task ``key`` may be rank ``rank`` of request ``request``:
        a request id names one call (every rank of it: the same job, deployment, op, ranks
        and replica, each rank once), and an id whose tasks still run names no new one. A
        request id is the caller's to choose, so the plugin checks it when it routes a task:
        one job reusing another's would otherwise take over that job's queued request, or its
        tasks' accounting."""
        queued = self.get(request)
        if queued is None:
            if self.in_use(request, key):
                raise NotRouted(f"request id {request!r} names a request still running")
            return
        same = (queued.job, queued.deployment, queued.ranks, queued.op, queued.replica) == (
            job,
            deployment,
            ranks,
            op,
            replica,
        )
        if not same or queued.keys.get(rank, key) != key:
            raise NotRouted(f"request id {request!r} names another request; ids are per call")

    def request_of(self, key: Any) -> str:
        """The request id of a tracked task ``key``."""
        return self._of_key[key]

    def add(self, request: PendingRequest) -> PendingRequest:
        """Queue ``request`` (or return the one already queued under its id, which its other
        ranks join)."""
        queued = self._pending.get(request.request)
        if queued is None:
            queued = self._pending[request.request] = request
            self._by_deployment.setdefault(request.deployment, []).append(request)
            self._per_job[request.job] += 1
        self._changed.add(request.deployment)
        return queued

    def add_key(self, key: Any, request: PendingRequest, rank: int) -> None:
        """Task ``key`` is rank ``rank`` of ``request``."""
        request.keys[rank] = key
        self._untrack(key)
        self._of_key[key] = request.request
        self._keys_of.setdefault(request.request, set()).add(key)

    def drop_key(self, key: Any) -> None:
        """Stop tracking task ``key`` (it finished, failed or was forgotten)."""
        self._untrack(key)

    def _untrack(self, key: Any) -> None:
        request = self._of_key.pop(key, None)
        keys = self._keys_of.get(request, None) if request is not None else None
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_of[request]

    def deployment(self, name: str) -> list[PendingRequest]:
        """``name``'s pending requests in submission order (the queue's own list: do not
        change it)."""
        return self._by_deployment.get(name, [])

    def of_job(self, job: str) -> int:
        """How many of ``job``'s requests are pending."""
        return self._per_job[job]

    def job_counts(self) -> dict[str, int]:
        """Pending requests per job."""
        return dict(self._per_job)

    def counts(self) -> dict[str, int]:
        """Pending requests per deployment."""
        return {name: len(q) for name, q in self._by_deployment.items()}

    def changed(self, deployment: str) -> None:
        """``deployment``'s queue may admit a request now (one more rank is ready, the request
        ahead of it left)."""
        self._changed.add(deployment)

    def take_changed(self) -> set[str]:
        """The deployments marked :meth:`changed` since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def has_changed(self) -> bool:
        return bool(self._changed)

    def release(self, request: str) -> PendingRequest:
        """Remove the request the dispatcher released (its tasks stay tracked until they
        end); the requests behind it may be admitted now."""
        queued = self._pending.pop(request)
        self._uncount(queued)
        self._unlist(queued, always=False)
        return queued

    def forget(self, request: PendingRequest) -> None:
        """Drop ``request`` and its tasks (cancelled, failed before it ran, or routed again)."""
        queued = self._pending.pop(request.request, None)
        if queued is not None:
            self._uncount(queued)
        self._unlist(request)
        for key in request.keys.values():
            self._untrack(key)

    def _uncount(self, request: PendingRequest) -> None:
        self._per_job[request.job] -= 1
        if self._per_job[request.job] <= 0:
            del self._per_job[request.job]

    def _unlist(self, request: PendingRequest, always: bool = True) -> None:
        """Take ``request`` out of its deployment's list; mark the deployment changed if
        requests remain there (``always``: even if none do)."""
        queue = self._by_deployment.get(request.deployment)
        if queue is not None and request in queue:
            queue.remove(request)
            if not queue:
                del self._by_deployment[request.deployment]
        if always or request.deployment in self._by_deployment:
            self._changed.add(request.deployment)


class QueueQuota:
    """``plexrl.quotas.max-queued-requests-per-job``: how many requests one job may have
    pending in ``requests`` at once. Refusals count in ``counters``; a refused request is
    remembered (the newest 4096), so each of its ranks is refused alike."""

    def __init__(self, requests: RequestQueue, counters: Counter[str]) -> None:
        self._requests = requests
        self._counters = counters
        self._refused: dict[str, QuotaExceeded] = {}  # request -> the error it was refused with

    def check(self, job: str, request: str) -> None:
        """:class:`QuotaExceeded` for a new request of ``job`` while it has
        ``plexrl.quotas.max-queued-requests-per-job`` pending (and for every rank of a request
        refused so, whenever its ranks arrive)."""
        if request in self._refused:
            raise self._refused[request]
        if request in self._requests:
            return  # another rank of a request already queued
        limit = config.count(
            "plexrl.quotas.max-queued-requests-per-job",
            config.get("quotas.max-queued-requests-per-job"),
        )
        if self._requests.of_job(job) < limit:
            return
        error = QuotaExceeded(
            f"job {job!r} has {self._requests.of_job(job)} requests waiting, "
            f"plexrl.quotas.max-queued-requests-per-job = {limit}: wait for some to finish"
        )
        self._refused[request] = error
        while len(self._refused) > 4096:
            self._refused.pop(next(iter(self._refused)))
        self._counters["quota_refusals"] += 1
        raise error
