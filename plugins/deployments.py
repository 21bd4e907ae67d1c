"""The deployment registry: a component of the PlexRL scheduler plugin.

:class:`DeploymentRegistry` holds what a deployment is and where it lives, apart from how its
requests are routed: the records (name → :class:`DeploymentInfo`), the capacity each worker's
replica holder reports, and the holders themselves. The plugin
(:class:`~plexrl_dask.plugins.scheduler.PlexRLSchedulerPlugin`) owns one, registers its
handlers, and is told through ``on_undeploy`` when a deployment goes (its requests, groups and
estimates are the plugin's).

- the ``plexrl_deploy`` / ``undeploy`` / ``get_deployment`` / ``list_deployments`` handlers:
  register a deployment and assign it workers through the policy core (:func:`assign_workers`) on the
  capacity each worker's replica holder reports, within its job's node group when the
  spatiotemporal placement is live;
- ``plexrl_relocations`` / ``plexrl_relocate`` / ``plexrl_placement``: moving a job's idle
  deployments into its node group, and the placement's state;
- re-placing a deployment whose worker left (:meth:`DeploymentRegistry.placed`, :meth:`DeploymentRegistry.worker_left`);
- creating each GPU worker's replica-holder actor, owned by the plugin's own client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed import Client, Security

from plexrl_dask import config, protocol
from plexrl_dask.errors import (
    ConfigError,
    DeploymentBusy,
    DeploymentExists,
    DeploymentLost,
    DeploymentNotFound,
    DeploymentRelocating,
    InvalidModelSpec,
    PermissionDenied,
    PlexRLError,
    QuotaExceeded,
    to_status,
)
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.plugins.journal import Journal, JournaledMap
from plexrl_dask.plugins.placement import LivePlacement
from plexrl_dask.plugins.requests import RequestQueue
from plexrl_dask.plugins.worker import HOLDER_KEY_PREFIX, new_replica_holder
from plexrl_dask.policy.assignment import WorkerView, assign_workers
from plexrl_dask.policy.estimates import Estimates
from plexrl_dask.policy.residency import ResidencyMap
from plexrl_dask.shared.access import Shares, check_owner
from plexrl_dask.shared.records import DeploymentInfo, Lifecycle, split_name

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

logger = logging.getLogger(__name__)


def client_security(security: Any) -> Any:
    """The ``Security`` of the client the plugin opens to its own scheduler: the scheduler's,
    with the scheduler's certificate and key in the client role where the cluster names no
    client certificate (``dask scheduler --tls-cert ... --tls-key ...`` sets only the
    scheduler's). The certificate must then be valid for client authentication too, as Dask's
    and most clusters' are (no extended key usage, or both)."""
    if security.tls_client_cert or not security.tls_scheduler_cert:
        return security
    fields = {name: getattr(security, name) for name in Security.__slots__}
    fields.update(
        tls_client_cert=security.tls_scheduler_cert, tls_client_key=security.tls_scheduler_key
    )
    return Security(**fields)


class DeploymentRegistry:
    """Deployment handlers and placement (see the module docstring). ``counters``,
    ``residency``, ``estimates``, ``placement`` and ``requests`` are the plugin's, shared;
    ``on_undeploy(info)`` runs once a deployment is removed. :meth:`start` gives it the
    scheduler."""

    def __init__(
        self,
        *,
        gpu_resource: str,
        report_timeout: float,
        counters: Counter[str],
        residency: ResidencyMap,
        estimates: Estimates,
        placement: LivePlacement | None,
        requests: RequestQueue,
        on_undeploy: Callable[[DeploymentInfo], None],
        journal: Journal | None = None,
        running: Callable[[str], int] = lambda name: 0,
    ) -> None:
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # (set by start)
        self.gpu_resource = gpu_resource
        self.report_timeout = report_timeout
        self.counters = counters
        self.residency = residency
        self.estimates = estimates
        self.placement = placement
        self.requests = requests
        self.running = running  # a deployment's released tasks not yet ended
        self.on_undeploy = on_undeploy
        # (written through to the journal, if any: plugins/journal.py)
        self.deployments: JournaledMap[DeploymentInfo] = JournaledMap(
            journal, "deployment", DeploymentInfo.to_dict
        )
        self._grants: JournaledMap[dict[str, frozenset[str]]] = JournaledMap(
            journal, "share", lambda grants: {job: sorted(ops) for job, ops in grants.items()}
        )
        self.shares = Shares(self._grants)  # the ops owners shared with other jobs
        # worker -> what its replica holder reported (budget, device, ...)
        self.worker_capacity: dict[str, dict[str, Any]] = {}
        self._client: Any = None
        self._client_lock = asyncio.Lock()
        self._holders: dict[str, Any] = {}  # worker address -> Future of its holder actor

    def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def restore(self) -> list[str]:
        """Bring back the journaled deployments and grants (a restarted scheduler). A restored
        deployment's workers are gone with the old scheduler: as when its workers leave, it is
        ``lost`` if its state was modified since deploy (until its job restores a checkpoint),
        else ``unplaced`` (placed again on its next request). Returns the names restored."""
        names = self.deployments.restore(DeploymentInfo.from_dict)
        self._grants.restore(lambda grants: {j: frozenset(ops) for j, ops in grants.items()})
        for name in names:
            info = self.deployments[name]
            if info.state == Lifecycle.PLACED and not all(
                w in self.scheduler.workers for w in info.workers
            ):
                state = Lifecycle.LOST if info.modified else Lifecycle.UNPLACED
                self.deployments[name] = info.moved(state)
        for name in list(self._grants):
            if name not in self.deployments:
                self.shares.forget(name)
        self.counters["deployments_restored"] += len(names)
        return names

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
            # (an asynchronous client counts itself on its loop's runner and its close does
            # not uncount it: a LocalCluster's loop thread, and its scheduler, then outlived
            # the cluster, one more per cluster started in the process)
            client._loop_runner.stop()

    # --- replica holders ---------------------------------------------------------------------

    async def _holder_client(self) -> Any:
        async with self._client_lock:
            if self._client is None:
                self._client = await Client(
                    self.scheduler.address,
                    asynchronous=True,
                    security=client_security(self.scheduler.security),
                    name="plexrl-scheduler-plugin",
                    set_as_default=False,
                )
            return self._client

    async def create_holder(self, worker: str) -> None:
        """Submit the replica-holder actor of ``worker``, owned by this plugin's client."""
        if worker in self._holders or worker not in self.scheduler.workers:
            return
        self._holders[worker] = None  # claimed: one holder per worker incarnation
        try:
            client = await self._holder_client()
            if worker not in self.scheduler.workers:
                self._holders.pop(worker, None)  # it left while the client connected
                return
            self._holders[worker] = client.submit(
                new_replica_holder,
                actor=True,
                workers=[worker],
                allow_other_workers=False,
                key=f"{HOLDER_KEY_PREFIX}-{uuid.uuid4().hex}",
                pure=False,
            )
            self.counters["holders_created"] += 1
        except Exception:
            self._holders.pop(worker, None)
            logger.exception("could not create the replica holder of %s", worker)

    def holder_errors(self) -> dict[str, str]:
        """Workers whose holder actor failed to start, with the error (a worker that joined
        but cannot serve: e.g. its tier directories cannot be made)."""
        failed = {}
        for worker, future in self._holders.items():
            ts = None if future is None else self.scheduler.tasks.get(future.key)
            if ts is not None and ts.state == "erred":
                failed[worker] = str(ts.exception_text or ts.exception)
        return failed

    # --- registry handlers ------------------------------------------------------------------

    async def deploy(
        self,
        name: str,
        uid: str,
        spec: dict,
        role: str,
        backend: str,
        owner: str,
        memory_bytes: int,
        exist_ok: bool = False,
        candidates: list[str] | None = None,
        world_size: int = 1,
        replicas: int = 1,
        vocab_size: int = 0,
        max_positions: int = 0,
        job: str | None = None,
    ) -> dict[str, Any]:
        """Register and place a deployment for ``job``, its owner. Returns ``{"status": "OK",
        "deployment": {...}, "created": bool}`` or an error status (:class:`PermissionDenied`
        for another ``owner``, or an existing deployment of another job with ``exist_ok``)."""
        try:
            check_owner(name, owner, job, "register")
            if split_name(name)[1] != owner:  # (ConfigError for a name not <name>@<job>)
                raise PermissionDenied(
                    f"{name!r} is in another job's namespace, not job {owner!r}'s: deployment "
                    "names are registered as <name>@<job> (Runtime.deploy does it)"
                )
            info = _deployment_info(
                name, uid, spec, role, backend, owner, memory_bytes, candidates,
                world_size, replicas, vocab_size, max_positions,
            )  # fmt: skip
            # Wait here, before the checks: from them to the registration nothing awaits, so
            # two deploys at once count each other (a name, the job's quotas).
            await self._wait_for_worker_reports()
            existing = self.deployments.get(name)
            if existing is not None:
                same = existing.same_model_and_layout(info)
                if exist_ok and same:
                    check_owner(name, existing.owner, job, "take over")
                    return {"status": "OK", "deployment": existing.to_dict(), "created": False}
                raise DeploymentExists(
                    f"a deployment named {name!r} already exists (owner {existing.owner!r}, "
                    f"model {existing.spec.name}); pick another name, undeploy it first, or "
                    "look it up with runtime.deployment(name)"
                )
            limit = config.count(
                "plexrl.quotas.max-deployments-per-job",
                config.get("quotas.max-deployments-per-job"),
            )
            held = sum(1 for d in self.deployments.values() if d.owner == owner)
            if held >= limit:
                raise QuotaExceeded(
                    f"job {owner!r} has {held} deployments, plexrl.quotas.max-deployments-per-job "
                    f"= {limit}: undeploy one first"
                )
            self._check_bytes_quota(owner, info)
            candidates = info.candidates
            if candidates is None and self.placement is not None:
                # the job's node group (its dedicated workers while it is profiled)
                group = self.placement.candidates(
                    owner, info.num_workers, info.spec.name, self.worker_nodes(), time.monotonic()
                )
                if group is not None and len(group) >= info.num_workers:
                    candidates = group
                elif group is not None:  # workers of its group left: best effort meanwhile
                    logger.warning(
                        "job %s: its node group has %d live workers, %s needs %d; placing it "
                        "anywhere", owner, len(group), name, info.num_workers
                    )  # fmt: skip
            try:
                workers = assign_workers(
                    name, info.memory_bytes, self.worker_views(), info.num_workers, candidates
                )
            except PlexRLError:
                # (the placer took the job on its first deployment: it has none after all)
                if self.placement is not None and held == 0:
                    self.placement.finish(owner, time.monotonic())
                raise
            info = info.with_(workers=workers)
            self.deployments[name] = info
            self.counters["deploys"] += 1
            logger.info("deployed %s (%s) on %s", name, info.spec.name, info.workers)
            return {"status": "OK", "deployment": info.to_dict(), "created": True}
        except PlexRLError as e:
            return to_status(e)

    def _check_bytes_quota(self, owner: str, info: DeploymentInfo) -> None:
        """:class:`QuotaExceeded` if ``owner``'s deployments, with ``info``, would hold more
        device memory than ``plexrl.quotas.max-device-bytes-per-job`` (declared bytes per rank
        times ranks and replicas; each holder measures what it builds against the declared)."""
        limit = config.get("quotas.max-device-bytes-per-job")
        if limit is None:
            return
        limit = config.get_bytes("quotas.max-device-bytes-per-job")
        held = sum(
            d.memory_bytes * d.num_workers for d in self.deployments.values() if d.owner == owner
        )
        wanted = info.memory_bytes * info.num_workers
        if held + wanted > limit:
            raise QuotaExceeded(
                f"job {owner!r} holds {held} bytes of device memory in its deployments and "
                f"{info.name!r} needs {wanted} more; plexrl.quotas.max-device-bytes-per-job = "
                f"{limit}: undeploy one first"
            )

    async def undeploy(
        self, name: str, uid: str | None = None, job: str | None = None
    ) -> dict[str, Any]:
        """Remove ``job``'s deployment ``name`` and free its replicas. With ``uid``, only that
        incarnation."""
        info = self.deployments.get(name)
        if info is None or (uid is not None and info.uid != uid):
            return to_status(DeploymentNotFound(f"no deployment named {name!r}"))
        try:
            check_owner(name, info.owner, job, "undeploy")
        except PlexRLError as e:
            return to_status(e)
        del self.deployments[name]
        self.shares.forget(name)
        self.residency.forget_deployment(name)
        self.estimates.forget(name)
        self.on_undeploy(info)  # its requests, groups: the plugin's
        live = [w for w in info.workers if w in self.scheduler.workers]
        replies = await self._tell_holders(protocol.HOLDER_DROP, name, live)
        self.counters["undeploys"] += 1
        if self.placement is not None and not any(
            d.owner == info.owner for d in self.deployments.values()
        ):
            self.placement.finish(info.owner, time.monotonic())  # its last deployment went
        dropping = [w for w in live if w not in replies]  # (each drops it when it can)
        return {"status": "OK", "dropping": dropping} if dropping else {"status": "OK"}

    async def offload(
        self, name: str, job: str | None = None, replica: int | None = None
    ) -> dict[str, Any]:
        """Offload ``job``'s deployment ``name`` (every replica, or ``replica``) to host memory
        now, as its holders do under memory pressure (for experiments: a cold start). Returns
        ``{"status": "OK", "offloaded": {worker: bool}}`` (False: it was not resident there)."""
        try:
            info = self.deployments.get(name)
            if info is None:
                raise DeploymentNotFound(f"no deployment named {name!r}")
            check_owner(name, info.owner, job, "offload")
            k = info.world_size
            if replica is not None and not (
                isinstance(replica, int) and 0 <= replica < info.replicas
            ):
                raise ConfigError(f"{name!r} has replicas 0..{info.replicas - 1}, not {replica!r}")
            workers = (
                info.workers if replica is None else info.workers[replica * k : (replica + 1) * k]
            )
        except PlexRLError as e:
            return to_status(e)
        live = [w for w in workers if w in self.scheduler.workers]
        replies = await self._tell_holders(protocol.HOLDER_OFFLOAD, name, live)
        return {"status": "OK", "offloaded": {w: replies.get(w) is True for w in live}}

    async def _tell_holders(self, op: str, name: str, workers: list[str]) -> dict[str, Any]:
        """Send ``op`` about deployment ``name`` to the holders of ``workers``; their replies,
        of those that answered within ``plexrl.deploy.holder-wait``. A holder running a
        request (possibly another job's) acts once that request ends: the caller is not kept
        waiting on it, and the message still takes effect."""
        if not workers:
            return {}
        wait = config.get_seconds("deploy.holder-wait")
        msg = {"op": op, "name": name}
        sent = {
            w: asyncio.ensure_future(
                self.scheduler.broadcast(msg=msg, workers=[w], on_error="return")
            )
            for w in workers
        }
        await asyncio.wait(sent.values(), timeout=wait)
        replies = {}
        for w, task in sent.items():
            if task.done():
                replies.update(task.result())
            else:
                logger.info("%s of %s on %s: still waiting after %.0f s", op, name, w, wait)
        return replies

    def placement_status(self, job: str | None = None) -> dict[str, Any]:
        """The spatiotemporal placement's state, decisions, recorded events and traces."""
        if self.placement is None:
            return {"status": "OK", "enabled": False}
        return {"status": "OK", **self.placement.status(job)}

    def relocations(self, owner: str) -> dict[str, Any]:
        """``owner``'s deployments placed outside its node group while the group has room for
        them: ``{"status": "OK", "moves": [{"name", "uid", "modified", "workers", "group"}]}``
        (empty without placement, while the job waits, or for deployments given workers)."""
        moves = []
        for info in self.deployments.values():
            if info.owner != owner or info.candidates is not None or info.state != "placed":
                continue
            group = self._candidates(info)
            if group is not None and not set(info.workers) <= set(group):
                moves.append(
                    {
                        "name": info.name,
                        "uid": info.uid,
                        "modified": info.modified,
                        "workers": list(info.workers),
                        "group": list(group),
                    }
                )
        return {"status": "OK", "moves": moves}

    def relocate(
        self, name: str, uid: str, job: str | None = None, checkpoint: dict | None = None
    ) -> dict[str, Any]:
        """Move idle deployment ``name`` (incarnation ``uid``, as ``relocations`` listed it)
        into its job's node group: ``unplaced`` if its state is unmodified (its next request
        rebuilds it there from its spec), else ``relocating`` (refusing every request but
        ``load_state``, which places it there and restores ``checkpoint``, the one the job
        saved first, kept in the record meanwhile). Returns ``{"status": "OK", "state": ...}``;
        :class:`DeploymentNotFound` for another incarnation, :class:`DeploymentBusy` while any
        of its requests is in flight."""
        try:
            if checkpoint is not None and not (
                isinstance(checkpoint, dict) and all(isinstance(k, str) for k in checkpoint)
            ):
                raise ConfigError(f"a relocation's checkpoint is a dict, got {checkpoint!r:.80}")
            info = self.deployments.get(name)
            if info is None or info.uid != uid:
                raise DeploymentNotFound(
                    f"deployment {name!r} incarnation {uid!r} is gone (undeployed or re-placed "
                    "since it was listed); list the relocations again"
                )
            check_owner(name, info.owner, job, "relocate")
            busy = self._in_flight(name)
            if busy:
                raise DeploymentBusy(
                    f"{name!r} has {busy} requests in flight; relocate it when none of its "
                    "job's requests are (between steps)"
                )
            state = "relocating" if info.modified else "unplaced"
            kept = dict(checkpoint) if state == "relocating" and checkpoint else None
            if state == "relocating" and kept is None and not info.weights_only:
                # (modified since its job listed it, say: moved now, nothing could revive it)
                raise DeploymentBusy(
                    f"{name!r} holds trained state and no checkpoint of it was given; save it "
                    "and relocate again (list the relocations again: Runtime.relocate does)"
                )
            self.deployments[name] = info.moved(state, relocation=kept)
            self.counters["relocations"] += 1
            logger.info("relocating %s (%s) from %s", name, state, list(info.workers))
            return {"status": "OK", "state": state}
        except PlexRLError as e:
            return to_status(e)

    def _in_flight(self, name: str) -> int:
        """``name``'s requests whose tasks have not all finished: those still queued, and
        the tasks released to workers and not yet ended (running, or queued there)."""
        tasks = self.scheduler.tasks
        done = ("memory", "erred", "released", "forgotten")
        queued = sum(
            1
            for r in self.requests.deployment(name)
            if (
                len(r.keys) < r.ranks
                or any(k in tasks and tasks[k].state not in done for k in r.keys.values())
            )
        )
        return queued + self.running(name)

    def _candidates(self, info: DeploymentInfo) -> tuple[str, ...] | None:
        """Where ``info`` may be (re)placed: the workers it was given, else its job's node
        group's live workers when they are enough for it, else anywhere (None)."""
        if info.candidates is not None:
            return info.candidates
        if self.placement is None:
            return None
        group = self.placement.group_workers(info.owner, self.scheduler.workers)
        return group if group is not None and len(group) >= info.num_workers else None

    def get_deployment(self, name: str) -> dict[str, Any]:
        info = self.deployments.get(name)
        if info is None:
            known = sorted(self.deployments)[:10]
            return to_status(
                DeploymentNotFound(f"no deployment named {name!r}; registered: {known}")
            )
        return {"status": "OK", "deployment": info.to_dict()}

    def list_deployments(self, job: str | None = None) -> dict[str, Any]:
        """Every deployment, or (``job``) those it owns or that were shared with it."""
        return {
            "status": "OK",
            "deployments": [
                info.to_dict()
                for info in self.deployments.values()
                if job is None or info.owner == job or job in self.shares.of(info.name)
            ],
        }

    def share(self, name: str, to: str, ops: list[str], job: str | None = None) -> dict[str, Any]:
        """Let job ``to`` run ``ops`` on ``job``'s deployment ``name`` (replacing what it was
        granted; no ops: revoke). Returns ``{"status": "OK", "ops": [...]}``."""
        try:
            info = self.deployments.get(name)
            if info is None:
                raise DeploymentNotFound(f"no deployment named {name!r}")
            check_owner(name, info.owner, job, "share")
            granted = self.shares.grant(name, to, ops)
            return {"status": "OK", "ops": sorted(granted)}
        except PlexRLError as e:
            return to_status(e)

    # --- placement ---------------------------------------------------------------------------

    def bytes_of(self, deployment: str) -> int:
        info = self.deployments.get(deployment)
        return info.memory_bytes if info is not None else 0

    def budget_of(self, worker: str) -> int:
        return int(self.worker_capacity.get(worker, {}).get("budget_bytes", 0))

    def gpu_workers(self) -> list[str]:
        return [
            addr
            for addr, ws in self.scheduler.workers.items()
            if ws.resources.get(self.gpu_resource, 0) >= 1
        ]

    def worker_nodes(self) -> dict[str, str]:
        """The node of every GPU worker that has reported its capacity: its state store's
        node id (``plexrl.state.node-id``: the machine's host name, or what a batch system
        names the node), else its host. Node groups are made of these nodes."""
        nodes = {}
        for w in self.gpu_workers():
            reported = self.worker_capacity.get(w)
            if reported is not None:
                nodes[w] = str(reported.get("node") or self.scheduler.workers[w].host)
        return nodes

    async def _wait_for_worker_reports(self) -> None:
        """Give freshly started GPU workers a bounded time to report their capacity."""
        deadline = time.monotonic() + self.report_timeout
        while time.monotonic() < deadline:
            gpu = self.gpu_workers()
            if gpu and all(w in self.worker_capacity for w in gpu):
                return
            await asyncio.sleep(0.05)

    def worker_views(self) -> list[WorkerView]:
        committed: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for info in self.deployments.values():
            for w in info.workers:
                committed[w] += info.memory_bytes
                count[w] += 1
        return [
            WorkerView(
                address=w,
                budget_bytes=int(self.worker_capacity[w]["budget_bytes"]),
                committed_bytes=committed[w],
                num_deployments=count[w],
            )
            for w in self.gpu_workers()
            if w in self.worker_capacity
        ]

    def worker_left(self, worker: str) -> None:
        """``worker`` left the cluster: its holder and capacity go, and each deployment it held
        is ``lost`` if its state was modified since deploy, else ``unplaced`` (a relocating
        one keeps moving: its state is saved)."""
        self.worker_capacity.pop(worker, None)
        holder = self._holders.pop(worker, None)
        if holder is not None:
            holder.release()  # else Dask would try to recreate the actor on the dead worker
        for name, info in list(self.deployments.items()):
            if worker in info.workers and info.state != Lifecycle.RELOCATING:
                state = Lifecycle.LOST if info.modified else Lifecycle.UNPLACED
                # (workers kept: survivors of the old placement are told to drop it later)
                self.deployments[name] = info.moved(state)
                logger.info("worker %s left: deployment %s is %s", worker, name, state)

    def placed(self, info: DeploymentInfo) -> DeploymentInfo:
        """``info`` with a live worker, placing it again if its worker left."""
        if info.state == "placed" and all(w in self.scheduler.workers for w in info.workers):
            return info
        if info.state == "relocating":
            raise DeploymentRelocating(
                f"{info.name!r} is moving to its job's node group: load its weights "
                "(runtime.sync_weights) before other requests"
                if info.weights_only
                else f"{info.name!r} is moving to its job's node group: restore the checkpoint "
                "saved for the move (Runtime.relocate does; a driver that took over: "
                f"deployment.load_state(deployment.info.relocation), {info.relocation}) before "
                "other requests"
            )
        if info.state == "lost" and info.weights_only:
            raise DeploymentLost(
                f"a worker holding {info.name!r} left the cluster with the weights it was given; "
                "load them again (runtime.sync_weights) before other requests"
            )
        if info.state == "lost":
            again = (
                "load its weights again (runtime.sync_weights) or restore a checkpoint"
                if info.revived_by("load_weights")
                else "restore a checkpoint with deployment.load_state(path) (save them with "
                "save_state), or undeploy it"
            )
            raise DeploymentLost(
                f"{info.name!r} lost its state (modified since deploy): a worker holding it "
                f"left the cluster, or a rank of its group failed mid-request; {again}"
            )
        workers = assign_workers(
            info.name, info.memory_bytes, self.worker_views(), info.num_workers,
            self._candidates(info),
        )  # fmt: skip
        # A new incarnation (new uid): no surviving holder reuses state of the old placement
        # under a different rank, and late reports of the old one are ignored.
        placed = info.moved(Lifecycle.PLACED, workers=workers, uid=uuid.uuid4().hex)
        self.deployments[info.name] = placed
        old = [w for w in info.workers if w in self.scheduler.workers and w not in workers]
        if old:
            asyncio.ensure_future(
                self.scheduler.broadcast(
                    msg={"op": protocol.HOLDER_DROP, "name": info.name},
                    workers=old,
                    on_error="return",
                )
            )
        self.counters["replacements"] += 1
        logger.info("re-placed %s on %s", info.name, workers)
        return placed


def _deployment_info(
    name: str,
    uid: str,
    spec: Any,
    role: str,
    backend: str,
    owner: str,
    memory_bytes: Any,
    candidates: Any,
    world_size: Any,
    replicas: Any,
    vocab_size: Any,
    max_positions: Any,
) -> DeploymentInfo:
    """The record a deploy asks for, from the fields the handler got over the wire: each
    checked here, whatever the client checked (:class:`ConfigError` for a malformed field,
    :class:`InvalidModelSpec` for a spec that does not parse)."""
    if not isinstance(spec, dict):
        raise InvalidModelSpec(f"a deployment's spec is a dict, got {type(spec).__name__}")
    try:
        model = ModelSpec.from_dict(spec)
    except PlexRLError:
        raise
    except Exception as e:
        raise InvalidModelSpec(f"the deployment's spec does not parse: {e!r}") from None
    numbers = {
        "memory_bytes": memory_bytes,
        "world_size": world_size,
        "replicas": replicas,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
    }
    for field, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{field} is an integer >= 0, got {value!r}")
    if candidates is not None and (
        not isinstance(candidates, list | tuple) or not all(isinstance(w, str) for w in candidates)
    ):
        raise ConfigError(f"candidates are worker addresses, got {candidates!r}")
    if not all(isinstance(x, str) for x in (name, uid, role, backend, owner)):
        raise ConfigError("name, uid, role, backend and owner are strings")
    return DeploymentInfo(
        name=name,
        uid=uid,
        spec=model,
        role=role,
        backend=backend,
        owner=owner,
        candidates=None if candidates is None else tuple(candidates),
        **numbers,
    )
