"""The PlexRL scheduler plugin: the deployment registry and request routing.

Installed on the scheduler (``plexrl_dask.local_cluster()``, ``plexrl_dask.install(client)`` or
``dask scheduler --preload plexrl_dask.plugins``), it

- keeps the **deployment registry** (name → :class:`DeploymentInfo`), reached through the
  ``plexrl_*`` scheduler handlers, so the client-side router is stateless and any job's driver
  can address any deployment. The plugin is composed of parts, each in its own module: the
  registry (deploy, undeploy, relocate, placement through the policy core, re-placing after a
  worker left, the replica holders: :class:`~plexrl_dask.plugins.deployments.DeploymentRegistry`),
  the queue of routed requests, its per-job quota and the checks of their annotations
  (:class:`~plexrl_dask.plugins.requests.RequestQueue`,
  :class:`~plexrl_dask.plugins.requests.QueueQuota`), the dispatch policy from configuration
  and the operator, and the queue as it ranks it (:mod:`plexrl_dask.plugins.dispatching`), the
  accounting of released ones (:class:`~plexrl_dask.plugins.accounting.RequestAccounting`), the
  gangs' process-group epochs and rendezvous (:class:`~plexrl_dask.plugins.gangs.GroupEpochs`,
  :class:`~plexrl_dask.plugins.gangs.Rendezvous`) and the live placement of jobs
  (:class:`~plexrl_dask.plugins.placement.LivePlacement`); this module composes them and holds
  the request path;
- **parks** every task annotated ``plexrl={"deployment": ...}`` before the scheduler first
  places it (``update_graph`` runs before the new tasks' transitions: the task is restricted to
  an address that is never a worker, so it waits in ``no-worker``), aims it at its deployment's
  worker for its (replica, rank), and **releases** requests through the policy core's dispatch
  rule (:mod:`plexrl_dask.policy.dispatch`) whenever one arrives or a worker frees up: all ranks
  of a gang at once, with the process-group epoch they must share; plain Dask tasks are never
  touched;
- knows the **principals** (:class:`~plexrl_dask.shared.access.Principals`): jobs register and
  get a secret, every handler run in a job's name and every request presents it, and only
  the operator changes the dispatch policy;
- hosts the rendezvous of worker process groups (``plexrl_rendezvous_*`` handlers, served by
  :class:`~plexrl_dask.plugins.gangs.Rendezvous` with the token each gang is released with);
- keeps the **residency map** from the holders' ``plexrl-residency`` events;
- re-places a deployment whose worker left (rebuilt from its spec on another worker) unless its
  state was modified (then it is ``lost`` and requests fail with :class:`DeploymentLost`), and
  re-routes the requests that were waiting for the dead worker;
- relocates a job's idle deployments into its placement group when the job asks
  (``plexrl_relocations`` lists them, ``plexrl_relocate`` re-places one: rebuilt from its spec
  there if unmodified, else ``relocating`` until the job restores the checkpoint it saved);
- registers the worker plugin on every worker, present and future, and, owning a client of
  its own, creates each GPU worker's :class:`ReplicaHolder` **actor** when the worker announces
  itself (so no job's client owns a holder, and a worker that comes back gets a new one).

The order is HRRS (``plexrl.scheduler.ordering``), with service and setup times learned from
completed requests and residency reports (:mod:`plexrl_dask.policy.estimates`); ``status``
shows the queue with current ratios and the recent decisions with their reasons.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import os
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dask
from dask.utils import parse_bytes
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from plexrl_dask import config, protocol
from plexrl_dask.errors import (
    ConfigError,
    DeploymentNotFound,
    NotRouted,
    PlexRLError,
    RankLost,
    SchedulerBusy,
    to_status,
)
from plexrl_dask.plugins.accounting import RequestAccounting, Started
from plexrl_dask.plugins.deployments import DeploymentRegistry
from plexrl_dask.plugins.dispatching import (
    dispatch_policy_from_config,
    queue_view,
    requested_policy,
)
from plexrl_dask.plugins.gangs import GroupEpochs, Rendezvous
from plexrl_dask.plugins.journal import JournaledMap, open_journal
from plexrl_dask.plugins.placement import LivePlacement
from plexrl_dask.plugins.requests import (
    PendingRequest,
    QueueQuota,
    RequestQueue,
    candidate_groups,
    check_fits,
    keep_only_the_clients,
    positions,
)
from plexrl_dask.plugins.worker import PlexRLWorkerPlugin
from plexrl_dask.policy.dispatch import Dispatcher, Request
from plexrl_dask.policy.estimates import Estimates, SetupCosts
from plexrl_dask.policy.residency import (
    HOLDER_TOPIC,
    PREFETCH_OP,
    RESIDENCY_TOPIC,
    WORKER_TOPIC,
    ResidencyMap,
    ResidencyReport,
)
from plexrl_dask.protocol import ANNOTATION, PARKED
from plexrl_dask.shared.access import Principals, new_secret
from plexrl_dask.shared.records import DeploymentInfo, Lifecycle, group_key

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState

logger = logging.getLogger(__name__)


def _fetches(groups: Any, tasks: list[TaskState]) -> bool:
    """Whether a worker of ``groups`` would fetch an input of ``tasks`` (other tasks' results)
    before it could run them: some input is not held by every one of those workers."""
    workers = {w for g in groups for w in g}
    return any(
        not workers <= {ws.address for ws in dep.who_has or ()}
        for ts in tasks
        for dep in ts.dependencies
    )


class PlexRLSchedulerPlugin(SchedulerPlugin):
    """See the module docstring."""

    name = "plexrl"
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # (set by start)
        self.gpu_resource = str(config.get("worker.gpu-resource"))
        self.residency = ResidencyMap()
        self.counters: Counter[str] = Counter()
        self.requests = RequestQueue()  # routed, not yet released (plugins/requests.py)
        self.quota = QueueQuota(self.requests, self.counters)  # what a job may have waiting
        self.groups = GroupEpochs()  # the gangs' process groups (plugins/gangs.py)
        # Released tasks: when each started, what is queued behind it, per-job counters.
        self.accounting = RequestAccounting()
        self._releases = 0  # requests released so far (their tasks' Dask priority)
        self._wakeup: asyncio.TimerHandle | None = None  # a decision when a gang hold ends
        self.estimates = Estimates(
            service_prior_s=config.get_seconds("scheduler.service-prior"),
            load_bandwidths={
                tier: float(parse_bytes(v))
                for tier, v in config.get("scheduler.load-bandwidth-priors").items()
            },
        )
        # Spatiotemporal placement of jobs into node groups (plugins/placement.py).
        self.placement: LivePlacement | None = None
        if config.get("placement.live"):
            self.placement = LivePlacement(config.placement_config())
        # The durable part of this plugin's state (plugins/journal.py; null: none).
        self.journal = open_journal(config.get("scheduler.journal"))
        self.registry = DeploymentRegistry(
            gpu_resource=self.gpu_resource,
            report_timeout=config.get_seconds("deploy.worker-report-timeout"),
            counters=self.counters,
            residency=self.residency,
            estimates=self.estimates,
            placement=self.placement,
            requests=self.requests,
            on_undeploy=self._undeployed,
            journal=self.journal,
            running=lambda name: sum(
                1 for s in self.accounting.started.values() if s.deployment == name
            ),
        )
        self.policy = dispatch_policy_from_config()
        self.dispatcher = Dispatcher(
            self.policy,
            SetupCosts(
                self.residency, self.estimates, self.registry.bytes_of, self.registry.budget_of
            ),
        )
        self.prefetch_hints = bool(config.get("scheduler.prefetch-hints"))
        self.batch_interval = config.batch_interval()  # (plexrl.comm; None: Dask's own)
        self.hints: dict[str, tuple[str | None, str]] = {}  # worker -> (deployment, uid) hinted
        self._touched: set[str] = set()  # workers whose prediction may have changed
        self.decisions: deque[dict[str, Any]] = deque(
            maxlen=int(config.get("scheduler.decisions-kept"))
        )
        self.rendezvous = Rendezvous(self.counters)  # where gangs' groups meet (plugins/gangs.py)

    # --- lifecycle ---------------------------------------------------------------------------

    # Read by the dashboard and benchmarks: the registry's records, the holders' reports, the
    # released tasks and the jobs' counters.
    @property
    def started(self) -> dict[Any, Started]:
        return self.accounting.started

    @property
    def queued_behind(self) -> dict[str, Any]:
        return self.accounting.queued_behind

    @property
    def job_counters(self) -> defaultdict[str, Counter[str]]:
        return self.accounting.job_counters

    @property
    def deployments(self) -> dict[str, DeploymentInfo]:
        return self.registry.deployments

    @property
    def worker_capacity(self) -> dict[str, dict[str, Any]]:
        return self.registry.worker_capacity

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        for stream in [*scheduler.stream_comms.values(), *scheduler.client_comms.values()]:
            config.tune_batched_send(stream, self.batch_interval)
        self.registry.start(scheduler)
        self._start_principals(scheduler)
        restored = self.registry.restore()
        if restored:
            logger.info(
                "restored %d deployments and %d jobs from the journal %s",
                len(restored), len(self.principals.jobs()), self.journal.path,  # type: ignore[union-attr]
            )  # fmt: skip
        registry = self.registry
        handlers: dict[str, Callable[..., Any]] = {
            protocol.DEPLOY: registry.deploy,
            protocol.UNDEPLOY: registry.undeploy,
            protocol.GET_DEPLOYMENT: registry.get_deployment,
            protocol.LIST_DEPLOYMENTS: registry.list_deployments,
            protocol.STATUS: self.status,
            protocol.SET_POLICY: self.set_policy,
            protocol.RENDEZVOUS_PUT: self.rendezvous.put,
            protocol.RENDEZVOUS_GET: self.rendezvous.get,
            protocol.PLACEMENT: registry.placement_status,
            protocol.RELOCATIONS: registry.relocations,
            protocol.RELOCATE: registry.relocate,
            protocol.SHARE: self.share,
            protocol.OFFLOAD: registry.offload,
            protocol.REGISTER_JOB: self.register_job,
        }
        handlers = {name: _checked_arguments(h) for name, h in handlers.items()}
        for name in protocol.ACTS_AS_JOB:
            handlers[name] = self._as_job(handlers[name])
        scheduler.handlers.update(handlers)
        for worker in self.registry.gpu_workers():
            self.dispatcher.add_worker(worker)
        await scheduler.register_worker_plugin(
            None, dumps(PlexRLWorkerPlugin()), name=PlexRLWorkerPlugin.name, idempotent=True
        )
        # Dask adds this plugin to the scheduler only after start() returns: replay what
        # workers announced meanwhile (registering on a running cluster).
        for topic in (WORKER_TOPIC, HOLDER_TOPIC):
            for _, msg in scheduler.get_events(topic):
                if isinstance(msg, dict) and msg.get("worker") in scheduler.workers:
                    self.log_event(topic, dict(msg))

    async def close(self) -> None:
        await self.registry.close()
        if self.journal is not None:
            self.journal.close()

    def _start_principals(self, scheduler: Scheduler) -> None:
        """The operator secret: configured, else a fresh one written to a file only the user
        running the scheduler can read (its path in ``status``)."""
        configured = dask.config.get("plexrl.operator-secret", None)
        self.operator_secret_file: str | None = None
        if configured is None:
            configured = new_secret()
            path = os.path.join(scheduler.local_directory, "plexrl-operator-secret")
            if os.path.exists(path):
                os.unlink(path)  # (not ours to trust: a new one, created 0600)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(configured)
            self.operator_secret_file = path
        jobs: JournaledMap[str] = JournaledMap(self.journal, "job", str)
        jobs.restore(str)
        try:
            self.principals = Principals(str(configured), jobs)
        except PlexRLError:
            raise ConfigError(
                "plexrl.operator-secret must be a string of at least 16 characters"
            ) from None

    def _as_job(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """``handler`` for callers acting as ``job``: they present its ``secret`` (else
        :class:`PermissionDenied`, and the handler does not run)."""
        if inspect.iscoroutinefunction(handler):

            @functools.wraps(handler)
            async def checked_async(*args: Any, secret: Any = None, **kwargs: Any) -> Any:
                try:
                    self.principals.verify(kwargs.get("job"), secret)
                except PlexRLError as e:
                    return to_status(e)
                return await handler(*args, **kwargs)

            return checked_async

        @functools.wraps(handler)
        def checked(*args: Any, secret: Any = None, **kwargs: Any) -> Any:
            try:
                self.principals.verify(kwargs.get("job"), secret)
            except PlexRLError as e:
                return to_status(e)
            return handler(*args, **kwargs)

        return checked

    def share(self, name: str, to: str, ops: list[str], job: str | None = None) -> dict[str, Any]:
        """The registry's ``share`` (see there); then ``to``'s requests to ``name`` still
        queued are routed again under the new grant: those it no longer allows fail with
        :class:`PermissionDenied` rather than run (released ones run to their end)."""
        status = self.registry.share(name, to, ops, job=job)
        if status.get("status") == "OK":
            self._soon(lambda: self._route_again(name, to))
        return status

    def _route_again(self, name: str, job: str) -> None:
        """Route ``job``'s requests to ``name`` that are not released yet again."""
        tasks = self.scheduler.tasks
        again = [r for r in self.requests.deployment(name) if r.job == job]
        stale = []
        for request in again:
            stale.extend(tasks[k] for k in request.keys.values() if k in tasks)
            self._forget(request)
        self._route_anew(stale, "share")

    def _undeployed(self, info: DeploymentInfo) -> None:
        """``info`` was undeployed: its gangs' groups go, and its queued requests fail with
        :class:`DeploymentNotFound` instead of waiting forever."""
        self.groups.forget(info.uid)
        for request in list(self.requests.deployment(info.name)):
            request.groups = None  # stale: routed again (to the error) by _reroute_orphans
            self.dispatcher.remove(request.request)
            request.admitted = False
        self._soon(self._reroute_orphans)

    # --- handlers ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Everything the plugin knows, as plain data (for clients and the dashboard)."""
        return {
            "status": "OK",
            "deployments": [info.to_dict() for info in self.deployments.values()],
            "residency": [{**r.to_event(), "worker": r.worker} for r in self.residency.reports()],
            "workers": {w: dict(c) for w, c in self.worker_capacity.items()},
            "holder_errors": self.registry.holder_errors(),
            "counters": dict(self.counters),
            "jobs": {job: dict(c) for job, c in self.job_counters.items()},
            "queue": self.queue_view(100),
            "decisions": list(self.decisions)[-50:],
            "hints": {w: d for w, (d, _) in self.hints.items() if d is not None},
            "policy": dataclasses.asdict(self.policy),
            "jobs_registered": self.principals.jobs(),
            "operator_secret_file": self.operator_secret_file,
        }

    def register_job(self, job: str, secret: str | None = None) -> dict[str, Any]:
        """Register ``job`` (a new job gets a fresh secret) or re-attach to it (presenting its
        secret). Returns ``{"status": "OK", "secret": ...}``."""
        try:
            return {"status": "OK", "secret": self.principals.register(job, secret)}
        except PlexRLError as e:
            return to_status(e)

    def set_policy(
        self,
        ordering: str | None = None,
        choice: str | None = None,
        setup_weight: float | None = None,
        patience_factor: float | None = None,
        patience_floor_s: float | None = None,
        lookahead: bool | None = None,
        fair_share: bool | None = None,
        operator_secret: str | None = None,
        gang_hold_s: float | None = None,
        turn_hold_s: float | None = None,
    ) -> dict[str, Any]:
        """Change the dispatch policy (for experiments and benchmarks): ``ordering`` "hrrs"
        (the configured HRRS knobs unless given) or "fifo" (default: the configured one);
        ``choice`` "residency" or "blind"; ``lookahead`` and ``fair_share`` on or off,
        ``gang_hold_s`` and ``turn_hold_s`` seconds (default: the configured ones; see
        :func:`~plexrl_dask.plugins.dispatching.requested_policy`). Only the operator may
        (``operator_secret``, else :class:`PermissionDenied`). Refused with
        :class:`SchedulerBusy` while requests are pending or released ones wait behind others,
        so every request is decided under the policy it arrived under."""
        try:
            self.principals.check_operator(operator_secret, "change the dispatch policy")
            if self.requests or self.accounting.busy():
                raise SchedulerBusy(
                    f"{len(self.requests)} requests are pending and "
                    f"{len(self.accounting.queued_behind)} "
                    "queued behind others; change the policy when idle"
                )
            policy = requested_policy(
                ordering=ordering,
                choice=choice,
                setup_weight=setup_weight,
                patience_factor=patience_factor,
                patience_floor_s=patience_floor_s,
                lookahead=lookahead,
                fair_share=fair_share,
                gang_hold_s=gang_hold_s,
                turn_hold_s=turn_hold_s,
            )
        except PlexRLError as e:
            return to_status(e)
        self.policy = self.dispatcher.policy = policy
        logger.info("dispatch policy is now %s", policy)
        return {"status": "OK", "policy": dataclasses.asdict(policy)}

    def queue_view(self, limit: int, now: float | None = None) -> dict[str, Any]:
        """The queue as plain data, for ``status`` and the dashboard (``now``: the dispatcher's
        clock): :func:`plexrl_dask.plugins.dispatching.queue_view`."""
        return queue_view(self.dispatcher, self.requests, limit, now)

    # --- routing and dispatch ----------------------------------------------------------------

    def update_graph(
        self, scheduler: Scheduler, *, annotations: dict | None = None, **kwargs: Any
    ) -> None:
        routed = False
        for key in (annotations or {}).get(ANNOTATION, {}):
            ts = scheduler.tasks.get(key)
            if ts is not None and ts.run_spec is not None:
                keep_only_the_clients(ts)
                self._route(ts)
                routed = True
        if routed:
            # The stream to the requesting client carries its results' "key in memory": it
            # exists once the client connected (after add_client), so it is tuned here.
            config.tune_batched_send(
                scheduler.client_comms.get(kwargs.get("client")), self.batch_interval
            )
            self._soon(self._dispatch)

    def _route(self, ts: TaskState) -> None:
        """Park a PlexRL task and queue it under its request with its candidate groups (the
        workers of its replica, or of every replica for a data-parallel request); or, if it
        cannot run, let it run anywhere and raise the typed error there, so the caller's future
        fails instead of waiting forever."""
        raw = ts.annotations.get(ANNOTATION)
        ann = dict(raw) if isinstance(raw, dict) else {}
        ann.pop("error", None)
        name = ann.get("deployment")
        request = str(ann.get("request") or ts.key)
        groups: tuple[tuple[str, ...], ...] | None = None
        try:
            if not isinstance(raw, dict):
                raise NotRouted(
                    f"the plexrl annotation of a request is a dict (deployment, job, op, ...), "
                    f"got {raw!r:.80}"
                )
            ranks, rank, replica = positions(ann)
            info = self.deployments.get(name) if isinstance(name, str) else None
            if info is None:
                raise DeploymentNotFound(
                    f"no deployment named {name!r} is registered; deploy it first "
                    f"(registered: {sorted(self.deployments)[:10]})"
                )
            job = str(ann.get("job") or "")
            self.registry.shares.check_request(name, info.owner, job, str(ann.get("op") or ""))
            self.principals.verify(job, ann.get("secret"))
            if ann.get("op") in ("load_state", "load_weights", "load_adapter"):
                # whose stored state this job may read: its own, and what was shared with it
                ann["readable"] = self.registry.shares.granting(job, "get_weights")
            self.quota.check(job, request)
            if ann.get("incarnation") not in (None, info.incarnation):
                raise DeploymentNotFound(
                    f"the deployment {name!r} this handle addressed was undeployed, and "
                    f"{name!r} now names another deployment (owner {info.owner!r}); look it up "
                    "again (runtime.deployment(name)) to address that one"
                )
            if ann.get("dispatched") and ranks > 1:
                raise RankLost(
                    f"rank {rank} of a {ranks}-rank {ann.get('op')!r} request of {name!r} lost "
                    "its worker mid-request; the request failed and the group is rebuilt on the "
                    "next request"
                )
            op = str(ann.get("op", ""))
            self.requests.check_id(request, ts.key, job, name, op, ranks, rank, replica)
            check_fits(name, info, ranks, rank, replica)
            if info.state in ("lost", "relocating") and info.revived_by(str(ann.get("op"))):
                # Restoring a checkpoint (or a weights-only deployment's weights) is how a lost
                # (or relocating) deployment comes back: a new incarnation (new uid, so no
                # holder reuses a stale rank), placed anew. Should the restore fail, the
                # record goes back to what it was (see _revival_failed).
                ann["revived_from"] = {"state": info.state.value, "relocation": info.relocation}
                info = info.moved(Lifecycle.UNPLACED, relocation=None)
                self.deployments[name] = info
            if info.state in ("lost", "relocating") or self.registry.worker_views():
                info = self.registry.placed(info)
                groups = candidate_groups(info, replica)
                ann.update(uid=info.uid, modified=info.modified)
            # else: no GPU worker right now; parked until one reports (then _reroute_orphans).
        except Exception as e:
            if not isinstance(e, PlexRLError):  # a bug, or input nothing checked: this
                logger.exception("routing %s failed", ts.key)  # request fails, nothing else
                e = NotRouted(f"this request could not be routed: {e!r}")
            ann["error"] = to_status(e)
            ts.worker_restrictions = None
            ts.resource_restrictions = None
            ts.annotations = {**ts.annotations, ANNOTATION: ann}
            self.counters["routing_errors"] += 1
            return
        ts.worker_restrictions = {PARKED}
        ts.loose_restrictions = False
        ts.resource_restrictions = {self.gpu_resource: 1}
        ts.annotations = {**ts.annotations, ANNOTATION: ann}
        queued = self.requests.add(
            PendingRequest(
                request,
                ranks,
                name,
                str(ann.get("op", "")),
                replica,
                job,
                holds=ann.get("holds") is True,
            )
        )
        self.requests.add_key(ts.key, queued, rank)
        queued.groups = groups
        self.counters["routed"] += 1

    def _admit(self, name: str) -> None:
        """Hand ``name``'s requests to the dispatcher in submission order, each once it is
        ready (every rank parked in ``no-worker``) and every earlier one was admitted. Reads
        from any replica and writes to one replica are not reordered: a data-parallel request
        waits until the requests of the deployment before it were released, and vice versa."""
        queue = self.requests.deployment(name)
        tasks = self.scheduler.tasks
        now = time.monotonic()
        ready = [
            r.groups is not None
            and len(r.keys) == r.ranks
            and all(k in tasks and tasks[k].state == "no-worker" for k in r.keys.values())
            for r in queue
        ]
        # A request not ready yet (its inputs are being computed, say) holds back its own
        # job's later requests, never another job's: one job cannot stall a deployment.
        waiting: set[str] = set()
        for i, r in enumerate(queue):
            if r.admitted:
                continue
            if not ready[i] or r.job in waiting:
                waiting.add(r.job)
                continue
            if any(
                q.order != r.order
                and (q.replica is None or r.replica is None)
                and (ready[j] or q.job == r.job)
                for j, q in enumerate(queue[:i])
            ):
                return
            self.dispatcher.add(
                Request(
                    request=r.request,
                    groups=r.groups,
                    arrival=now,
                    service_s=self.service_estimate(r.deployment, r.op),
                    order=r.order,
                    deployment=r.deployment,
                    op=r.op,
                    job=r.job,
                    holds=r.holds,
                    # Results of other tasks that a worker may still be fetching when the
                    # request is released (nothing may be queued behind it, or that would
                    # start first); none to fetch where they are held already (a scored
                    # training step on its own samples).
                    inputs=_fetches(r.groups, [tasks[k] for k in r.keys.values()]),
                )
            )
            r.admitted = True
            self._touched.update(w for g in r.groups for w in g)  # their predictions may change

    def service_estimate(self, deployment: str, op: str) -> float:
        """Expected seconds of a request of ``op`` on ``deployment`` (learned; for a pair
        not yet seen, from its bytes: :class:`~plexrl_dask.policy.estimates.Estimates`)."""
        return self.estimates.service(deployment, op, self.registry.bytes_of(deployment))

    def _dispatch(self) -> None:
        """Admit what became ready, release what the policy core picks (all ranks of a request
        at once), then send the workers whose prediction changed a prefetch hint."""
        tasks = self.scheduler.tasks
        for request in [r for r in self.requests if r.forgotten(tasks)]:
            self._forget(request)
        now = time.monotonic()
        # Requests released to free workers, then those queued behind a running one: a worker
        # runs what it is sent in the order it arrives, and one decision may release a request
        # to a free worker and queue the next of the same order behind it (the transition
        # engine would send one batch of recommendations in reverse).
        recommendations: dict[Any, str] = {}
        queued: dict[Any, str] = {}
        released = 0
        while True:
            for name in self.requests.take_changed():
                self._admit(name)
            decisions = self.dispatcher.decide(now)
            for decision in decisions:
                self._release(decision, now, queued if decision.behind else recommendations)
            released += len(decisions)
            # A release can lift the barrier of a request behind it: admit and decide again.
            if not decisions or not self.requests.has_changed():
                break
        if released:
            self.counters["dispatched"] += released
        for recs in (recommendations, queued):
            if recs:
                self.scheduler.transitions(recs, stimulus_id=f"plexrl-dispatch-{time.time()}")
        self._send_hints(now)
        self._wake_at(self.dispatcher.next_wakeup(now), now)

    def _wake_at(self, when: float | None, now: float) -> None:
        """Decide again at ``when`` (a gang's hold ends then: no event marks that moment)."""
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
        if when is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # (no loop: a test driving the plugin by hand decides again itself)
            self._wakeup = loop.call_later(max(0.0, when - now), self._dispatch)

    def _release(self, decision: Any, now: float, recommendations: dict[Any, str]) -> None:
        """Aim every rank of ``decision``'s request at its worker and recommend processing."""
        tasks = self.scheduler.tasks
        request = self.requests.release(decision.request.request)
        extra: dict[str, Any] = {"dispatched": True}
        if request.ranks > 1:
            info = self.deployments[request.deployment]
            # (the replica whose group runs it: a request for any replica names none; a
            # group the record no longer has, after a move, keeps replica 0's numbering)
            groups = candidate_groups(info, None)
            group = tuple(decision.group)
            extra["group"] = groups.index(group) if group in groups else 0
            extra["epoch"] = self.groups.epoch_for(info.uid, group, extra["group"])
            key = group_key(info.uid, extra["group"], extra["epoch"])
            token = self.rendezvous.token(key)
        # A worker runs the tasks waiting on it by Dask priority, which ties for requests
        # submitted within fifo-timeout of each other (each is a one-task graph): order them
        # by release instead, so that a worker runs PlexRL requests in the order they were
        # released to it (a forward_backward before the optim_step queued behind it). Ahead
        # of ordinary tasks of any generation on the same worker.
        self._releases += 1
        for rank, key in request.keys.items():
            ts = tasks[key]
            worker = decision.group[rank]
            ts.priority = (ts.priority[0] if ts.priority else 0, -1, self._releases)
            ts.worker_restrictions = {worker}
            mine = {**extra, "rendezvous": token} if request.ranks > 1 and rank == 0 else extra
            ts.annotations = {
                **ts.annotations,
                ANNOTATION: {**ts.annotations[ANNOTATION], **mine, "worker": worker},
            }
            self.accounting.released(
                key, now, request.deployment, request.op, worker, request.job,
                behind=decision.behind is not None, request=request.request,
            )  # fmt: skip
            recommendations[key] = "processing"
            self._touched.add(worker)
        self.accounting.dispatched(request.job, decision.wait_s)
        self.decisions.append({"time": time.time(), **decision.to_dict()})

    def _send_hints(self, now: float) -> None:
        """Tell each worker whose predicted next deployment changed what to prefetch (or that
        nothing is predicted any more)."""
        touched, self._touched = self._touched, set()
        if not self.prefetch_hints:
            return
        for worker in touched:
            deployment = self.dispatcher.hint(worker, now)
            info = self.deployments.get(deployment) if deployment else None
            hint = (deployment, info.uid) if info is not None else (None, "")
            if deployment and self.residency.tier(deployment, worker) == "hbm":
                # Resident already: nothing to prefetch. A job alone on its worker would
                # otherwise get two hints per request (its deployment, then none), each a
                # message on both event loops while its request runs.
                hint = (None, "")
            comm = self.scheduler.stream_comms.get(worker)
            # Only workers whose holder reported in have the handler (an unknown op would
            # break the worker's stream).
            if comm is None or worker not in self.worker_capacity:
                continue
            if self.hints.get(worker, (None, "")) == hint:
                continue
            self.hints[worker] = hint
            comm.send({"op": PREFETCH_OP, "deployment": hint[0], "uid": hint[1]})
            self.counters["prefetch_hints"] += 1

    def _forget(self, request: PendingRequest) -> None:
        self.requests.forget(request)
        self.dispatcher.remove(request.request)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if not self.requests.tracks(key):
            return
        if start == "processing":
            now = time.monotonic()
            started = self.accounting.ended(key, finish == "memory", now)
            if started is not None:
                t0, deployment, op, worker, job, _ = started
                self.dispatcher.release_worker(worker, self.requests.request_of(key), now)
                self._touched.add(worker)
                if finish == "memory":
                    self.estimates.observe_service(
                        deployment, op, now - t0, self.registry.bytes_of(deployment)
                    )
                    if self.placement is not None:
                        try:
                            self.placement.record(job, op, worker, t0, now)
                        except PlexRLError as e:  # a bad trace must not break the scheduler
                            logger.warning("placement: %s", e)
            ts = self.scheduler.tasks.get(key)
            ann = (ts.annotations or {}).get(ANNOTATION, {}) if ts is not None else {}
            if finish == "erred" and isinstance(ann.get("revived_from"), dict):
                self._revival_failed(ann)
            if finish != "memory" and int(ann.get("ranks", 1)) > 1:
                # A failed rank may have left its group unusable: the next gang request of
                # this deployment forms a new group.
                self.groups.broken(str(ann.get("uid")))
            if finish in ("memory", "erred", "forgotten"):
                self.requests.drop_key(key)
            self._soon(self._dispatch)
        elif finish == "no-worker":
            request = self.requests.of_key(key)
            live = self.scheduler.workers
            if (
                request is None
                or request.groups is None
                or any(w not in live for g in request.groups for w in g)
            ):
                self._soon(self._reroute_orphans)  # its target left while it waited
            else:
                self.requests.changed(request.deployment)  # one more rank is ready
                self._soon(self._dispatch)
        elif finish in ("erred", "forgotten", "released"):
            # Failed or cancelled before it ran (e.g. its dependency failed): drop its request
            # so it does not hold its deployment's queue.
            request = self.requests.of_key(key)
            if request is not None:
                self._forget(request)
                siblings = [k for k in request.keys.values() if k != key]
                if siblings:
                    self._soon(lambda: self._fail_parked(siblings, request))
            self.requests.drop_key(key)
            self._soon(self._dispatch)

    def _fail_parked(self, keys: list[Any], request: PendingRequest) -> None:
        """The ranks ``keys`` of ``request`` still parked fail (:class:`RankLost`): another
        rank failed or was cancelled before the request ran, and a gang runs whole or not."""
        tasks, errors = self.scheduler.tasks, {}
        error = to_status(
            RankLost(
                f"another rank of this {request.ranks}-rank {request.op!r} request of "
                f"{request.deployment!r} failed or was cancelled before it ran"
            )
        )
        for key in keys:
            ts = tasks.get(key)
            if ts is None or ts.state != "no-worker":
                continue
            ts.worker_restrictions = None
            ts.resource_restrictions = None
            ann = {**ts.annotations.get(ANNOTATION, {}), "error": error}
            ts.annotations = {**ts.annotations, ANNOTATION: ann}
            errors[key] = "processing"
        if errors:
            self.scheduler.transitions(errors, stimulus_id=f"plexrl-gang-{time.time()}")

    def _revival_failed(self, ann: dict[str, Any]) -> None:
        """A restore that revived a lost or relocating deployment failed: the deployment
        goes back to that state, its saved checkpoint kept (its workers hold only what its
        spec builds, which must not serve as its trained state)."""
        name, before = ann.get("deployment"), ann["revived_from"]
        info = self.deployments.get(name) if isinstance(name, str) else None
        if info is None or info.uid != ann.get("uid") or info.state != Lifecycle.PLACED:
            return  # (re-placed, undeployed, or another rank already put it back)
        self.deployments[name] = info.moved(before["state"], relocation=before["relocation"])
        logger.warning("%s: the restore that was to revive it failed: %s again",
                       name, before["state"])  # fmt: skip

    def _reroute_orphans(self) -> None:
        """Route again every PlexRL request with a candidate worker that is gone (or with no
        candidates yet): all its ranks together, so a gang never ends up half re-placed."""
        live = self.scheduler.workers
        tasks = self.scheduler.tasks
        stale: list[TaskState] = []
        for request in self.requests:
            if request.groups is None or any(w not in live for g in request.groups for w in g):
                stale.extend(tasks[k] for k in request.keys.values() if k in tasks)
                self._forget(request)
        for ts in list(self.scheduler.unrunnable):  # dispatched, then lost their worker
            ann = (ts.annotations or {}).get(ANNOTATION)
            queued = self.requests.of_key(ts.key)
            # Released to a worker still here but not running (paused for memory, say): it
            # runs there once that worker does, which the dispatcher counts it busy with.
            aimed = ts.worker_restrictions or set()
            waits = bool(aimed) and PARKED not in aimed and all(w in live for w in aimed)
            if (
                ann is not None
                and ts.state == "no-worker"
                and queued is None
                and ts not in stale
                and not waits
            ):
                stale.append(ts)
        self._route_anew(stale, "error")

    def _route_anew(self, stale: list[TaskState], why: str) -> None:
        """Route the tasks ``stale`` again (their requests forgotten); those that cannot be
        routed now run at once to raise their error. Then dispatch."""
        errors = {}
        for ts in stale:
            try:
                self._route(ts)  # (a request that cannot be routed fails alone)
            except Exception:  # (a defect: never leave the other requests stranded)
                logger.exception("re-routing %s failed", ts.key)
                continue
            if ts.worker_restrictions is None and ts.state == "no-worker":
                errors[ts.key] = "processing"  # a routing error: run it to raise the error
        if errors:
            self.scheduler.transitions(errors, stimulus_id=f"plexrl-{why}-{time.time()}")
        self._dispatch()

    def _soon(self, fn: Callable[[], None]) -> None:
        # Never re-enter the transition engine from a hook: run on the next loop iteration.
        try:
            asyncio.get_running_loop().call_soon(fn)
        except RuntimeError:
            fn()

    # --- cluster events ----------------------------------------------------------------------

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self.dispatcher.remove_worker(worker)
        self.hints.pop(worker, None)
        self.accounting.worker_left(worker)
        self.groups.worker_left(worker)
        self.residency.forget_worker(worker)
        self.registry.worker_left(worker)
        self._soon(self._reroute_orphans)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        config.tune_batched_send(scheduler.stream_comms.get(worker), self.batch_interval)
        ws = scheduler.workers.get(worker)
        if ws is not None and ws.resources.get(self.gpu_resource, 0) >= 1:
            self.dispatcher.add_worker(worker)

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == RESIDENCY_TOPIC and isinstance(msg, dict):
            try:
                report = ResidencyReport.from_event(msg)
            except (TypeError, ValueError) as e:  # (not a worker's: any client may log)
                logger.warning("a residency report that does not parse: %s", e)
                return
            info = self.deployments.get(report.deployment)
            if info is None or info.uid != report.uid:
                return  # a late report of an undeployed incarnation
            self.residency.apply(report)
            if report.tier == "hbm":
                # A weights-only engine's load time is learned as its own, but not as the
                # tier's bandwidth, which every deployment's first estimate shares: its start
                # and wake are not a copy of the bytes it reports (its budget holds a KV cache
                # and overhead that a wake allocates, not moves).
                self.estimates.observe_load(
                    report.deployment,
                    report.source,
                    report.load_s,
                    0 if info.weights_only else report.bytes,
                )
            if report.modified and not info.modified:
                info = self.deployments[report.deployment] = info.with_(modified=True)
            if report.tier == "absent" and report.modified and report.lost and info.world_size > 1:
                # A rank dropped its trained shard (its group failed mid-request): the
                # deployment's state is incomplete until a checkpoint is restored.
                self.deployments[report.deployment] = info.moved(Lifecycle.LOST)
        elif topic == WORKER_TOPIC and isinstance(msg, dict) and "worker" in msg:
            asyncio.ensure_future(self.registry.create_holder(msg["worker"]))
        elif (
            topic == HOLDER_TOPIC
            and isinstance(msg, dict)
            and msg.get("worker") in self.scheduler.workers
        ):
            self.worker_capacity[msg["worker"]] = msg
            if self.placement is not None and self.placement.placer is not None:
                # a worker of a new node makes a free node for placement at once (waiting
                # jobs may start); its node is known from this report on
                self.placement.sync_workers(self.registry.worker_nodes(), time.monotonic())
            self._soon(self._reroute_orphans)


def _checked_arguments(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` answering a call whose arguments it does not take (an unknown policy
    knob, a missing name) with a :class:`ConfigError` status, where the handler's own
    ``TypeError`` would reach the client untyped."""
    signature = inspect.signature(handler)

    def refused(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            return to_status(ConfigError(f"{handler.__name__}: {e}"))
        return None

    if inspect.iscoroutinefunction(handler):

        @functools.wraps(handler)
        async def checked_async(*args: Any, **kwargs: Any) -> Any:
            return refused(args, kwargs) or await handler(*args, **kwargs)

        return checked_async

    @functools.wraps(handler)
    def checked(*args: Any, **kwargs: Any) -> Any:
        return refused(args, kwargs) or handler(*args, **kwargs)

    return checked
