"""The per-worker replica holder: the deployments one worker holds, under a memory budget.

One holder per PlexRL worker: a real Dask actor, created on the cluster side (the scheduler
plugin's own client submits it, restricted to the worker, when the worker announces itself; never
a job's client, whose dropped future would kill it) and created again when a worker comes back.
Clients and the dashboard address it as an actor (:meth:`plexrl_dask.Runtime.holder`).
Requests do **not** go through actor calls (those bypass the scheduler); they run as ordinary
tasks on this worker and use the instance in-process (:func:`holder_of`).

Memory: every replica's device bytes count against ``budget_bytes``. Before a replica is loaded
or reloaded, and after any request that grew one (optimizer state appears at the first step, a
prefix cache grows with the conversations it keeps), the resident replicas' prefix caches are
shrunk and then the least recently used *other* resident replicas offloaded until the resident
total fits.
On a worker, offloaded state goes to the node's state store (DRAM tier, NVMe under pressure;
:mod:`plexrl_dask.worker.offload`), shared by the node's workers and deduplicated; a holder
built without a node (``node=None``: unit tests and tools) keeps it in its own memory. Each
transition is reported to the scheduler as a residency event (schema: docs/architecture.md, "Residency reports") with its
measured duration and the tier it came from or went to. The record kept per replica, and what
each op does to its state, are :mod:`plexrl_dask.worker.replica`'s.

This module is part of the worker package's face (:mod:`plexrl_dask.worker`): the task functions
the scheduler deserialises import it, so it reaches the backends, offload, process groups and
the node's store as the package's engine attributes, loaded when a worker first needs them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from distributed import get_worker
from distributed.worker import thread_state

from plexrl_dask import config
from plexrl_dask import worker as engine
from plexrl_dask.config import WorkerConfig
from plexrl_dask.errors import (
    CorruptState,
    DeploymentDoesNotFit,
    DeploymentLost,
    DeviceOutOfMemory,
    OpNotSupported,
    PermissionDenied,
    PlexRLError,
    RankLost,
    TensorNotFound,
    VersionNotFound,
)
from plexrl_dask.policy.residency import HOLDER_TOPIC, RESIDENCY_TOPIC, ResidencyReport
from plexrl_dask.shared.records import DeploymentInfo
from plexrl_dask.shared.timeline import RequestSpan, SpanLog
from plexrl_dask.worker.replica import (
    MUTATING_OPS,
    TRAINING_OPS,
    Replica,
    reload_bytes,
    shared_bytes,
)

if TYPE_CHECKING:
    from plexrl_dask.state_store.node import NodeState
    from plexrl_dask.worker.groups import GroupContext

logger = logging.getLogger(__name__)


def _worker_only(what: str) -> None:
    """:class:`PermissionDenied` when called through the holder's Dask actor: a client may
    read a holder (status, capacity, timeline, names) but not run, drop, offload or prefetch
    replicas behind the scheduler's back (owners offload with ``Deployment.offload``)."""
    if getattr(thread_state, "actor", False):
        raise PermissionDenied(
            f"a replica holder's {what} is the worker's own, not a client's: submit requests "
            "through a Deployment (its owner offloads with deployment.offload())"
        )


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is torch's out-of-device-memory error (torch is looked up, not
    imported: the scheduler imports this module's names and never torch)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(error, oom)


def holder_of(worker: Any) -> ReplicaHolder | None:
    """The replica holder living on ``worker`` (a ``distributed.Worker``), if created yet."""
    for actor in worker.state.actors.values():
        if isinstance(actor, ReplicaHolder):
            return actor
    return None


class ReplicaHolder:
    """Holds the replicas of one worker (see the module docstring).

    Constructed with no arguments as an actor on a worker, it configures itself from that
    worker (``plexrl.worker.*``) and reports its capacity to the scheduler; tests and tools can
    also build one directly with explicit arguments.
    """

    def __init__(
        self,
        worker_address: str | None = None,
        device: str | None = None,
        budget_bytes: int | None = None,
        max_batch_size: int | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
        node: NodeState | None = None,
        timeline_length: int = 10_000,
    ):
        if worker_address is None:
            self._init_on_worker()
            return
        self._init(
            worker_address,
            str(device),
            int(budget_bytes or 0),
            int(max_batch_size or 1),
            report,
            node,
            timeline_length,
        )

    def _init_on_worker(self) -> None:
        dask_worker = get_worker()
        cfg = WorkerConfig.from_dask_config()
        device = engine.device.resolve_device(cfg.device)
        budget = cfg.memory_budget
        if budget is None:
            budget = engine.device.default_budget(device)
        self._init(
            dask_worker.address,
            device,
            budget,
            int(config.get("sampling.max-batch-size")),
            lambda msg: dask_worker.log_event(RESIDENCY_TOPIC, msg),
            engine.stores.node_state(),
            cfg.timeline_length,
        )
        dask_worker.log_event(HOLDER_TOPIC, {**self.capacity(), "holder_key": thread_state.key})
        logger.info(
            "PlexRL holder on %s: %s, budget %.0f MiB",
            dask_worker.address,
            device,
            budget / 2**20,
        )

    def _init(
        self,
        worker_address: str,
        device: str,
        budget_bytes: int,
        max_batch_size: int,
        report: Callable[[dict[str, Any]], None] | None,
        node: NodeState | None = None,
        timeline_length: int = 10_000,
    ) -> None:
        self.worker_address = worker_address
        self.node = node
        self.device = device
        self.budget_bytes = int(budget_bytes)
        self.max_batch_size = int(max_batch_size)
        self._report = report or (lambda msg: None)
        self._replicas: dict[str, Replica] = {}
        # unmodified rollout replicas of one spec share its model (worker/backends/shared.py)
        self.share_frozen = bool(config.get("worker.share-frozen-weights"))
        self._bases: Any = None  # SharedBases (LoRA bases, shared rollouts): made on first use
        self._groups: Any = None  # ProcessGroupManager, created by the first multi-rank request
        # Requests run one at a time (the GPU resource), but actor calls (status, offload) come
        # from the actor thread; the lock keeps them from seeing a replica mid-transition.
        self._lock = threading.RLock()
        # Memory decisions (victims, bytes promised to a reload in flight): short sections,
        # taken after _lock where both are needed. A prefetch takes only this one, so it can
        # overlap a running request.
        self._moves = threading.RLock()
        self._incoming = 0  # bytes of reloads in flight outside _lock
        self._running: str | None = None  # the replica whose request is executing
        self.critical_load_s = 0.0  # transitions a request waited for before it ran, summed
        self.counters = {
            "loads": 0,
            "reloads": 0,
            "offloads": 0,
            "offload_failures": 0,  # offloads to make room whose stash failed (kept resident)
            "requests": 0,
            "out_of_memory": 0,  # requests refused DeviceOutOfMemory, the replica kept
            "prefetches": 0,
            "stash_writes": 0,
            # the prefix caches of replicas since dropped (live ones: status()'s replicas)
            "prefix_lookups": 0,
            "prefix_hits": 0,
            "prefix_tokens": 0,
            "prefix_hit_tokens": 0,
        }
        self._hint: tuple[str, str] | None = None  # (deployment, uid) predicted to run next
        self.load_seconds = 0.0  # measured time of every load into HBM, summed
        self.spans = SpanLog(timeline_length)

    # --- in-process API for request tasks --------------------------------------------------

    def run(
        self,
        info: DeploymentInfo,
        op: str,
        call: Callable[[Any], Any],
        group: GroupContext | None = None,
    ) -> Any:
        """Make ``info``'s replica resident and run ``call(backend)`` on it. ``group`` is the
        rank's group for a multi-rank deployment (joined, or re-joined, first)."""
        _worker_only("run")
        with self._lock:
            t0, start = time.perf_counter(), time.time()
            while True:
                replica = self._ensure(info, op, group)
                replica.last_used = time.monotonic()  # (the last victim a prefetch would pick)
                # A prefetch (another thread) offloads idle replicas to make room, and it
                # decides which are idle under _moves: mark this one running under the same
                # lock, and bring it back if a prefetch took it after _ensure.
                with self._moves:
                    if replica.backend.resident and self._replicas.get(info.name) is replica:
                        self._running = info.name
                        break
            # (copy on write; a backward needs weights that take gradients too)
            if op in MUTATING_OPS | TRAINING_OPS and callable(
                getattr(replica.backend, "private_copy", None)
            ):
                self._unshare(replica)
            self.critical_load_s += time.perf_counter() - t0
            replica.last_used = time.monotonic()
            ready, cpu0 = time.time(), time.thread_time()
            done = False
            try:
                result = call(replica.backend)
                done = True
            except RuntimeError as e:
                if group is None and _out_of_memory(e):
                    raise self._out_of_memory(replica, info.name, op, e) from e
                if group is None or isinstance(e, PlexRLError):
                    raise
                # A collective failed: a peer rank died or failed, possibly halfway through a
                # backward or a step, so this rank's state may no longer match its peers'. Drop
                # it (the scheduler then treats the deployment as lost until load_state).
                self._drop(info.name, lost=True)
                raise RankLost(
                    f"rank {group.rank}/{group.world_size} of {info.name!r}: the group failed "
                    f"mid-request ({e}); this rank's state was dropped, restore a checkpoint "
                    "with load_state"
                ) from e
            finally:
                self._running = None
                if not done:
                    replica.after_failure(op)
                replica.last_used = time.monotonic()
                self.counters["requests"] += 1
                self.spans.add(
                    RequestSpan(
                        self.worker_address,
                        info.name,
                        info.owner,
                        op,
                        start,
                        ready,
                        time.time(),
                        time.thread_time() - cpu0,
                    )
                )
            replica.after_success(op)  # (modified, prefixes and stored copy forgotten)
            # A request can grow the replica (gradients, optimizer state): re-balance, and
            # tell the scheduler the new size/version.
            self._make_room(0, keep=info.name)
            # Most requests (samples, forwards) change nothing the scheduler knows: a report
            # would cost a message on both event loops and invalidate the scheduler's setup
            # costs for this worker, per request. Only a change is sent.
            self._emit(replica, "hbm", replica.last_transition_s, unless_unchanged=True)
        if self._hint is not None:
            if self._hint[0] == info.name:
                self._hint = None  # the prediction came true: nothing left to prefetch
            else:
                self._prefetch_soon()
        return result

    def _ensure(self, info: DeploymentInfo, op: str, group: GroupContext | None) -> Replica:
        """``info``'s replica, resident and (for a rank) on the group of ``group``."""
        replica = self._replicas.get(info.name)
        if replica is not None and replica.info.uid != info.uid:
            # Same name, new deployment (or incarnation): the old state is not its state.
            self._drop(info.name)
            replica = None
        if replica is None:
            self._refuse_rebuild(info, op)
        if group is not None:
            self._join(group)
        if replica is None:
            return self._load(info, group, op)
        try:
            return self._resident(replica, info, group)
        except (CorruptState, VersionNotFound, TensorNotFound) as e:
            if info.revived_by(op) or not (replica.modified or info.modified):
                # Its offloaded copy is damaged or gone, but this request restores its whole
                # state (a checkpoint, or a weights-only deployment's weights), or its state
                # is what its spec builds: build it afresh.
                logger.warning(
                    "the offloaded copy of %s is unreadable (%s); rebuilding it for %s",
                    info.name, e, op,
                )  # fmt: skip
                self._drop(info.name)  # (its damaged copy with it)
                return self._load(info, group, op)
            # Trained state that cannot be read back: the deployment is lost (the job goes
            # back to its checkpoint), not stuck failing every request.
            self._drop(info.name, lost=True)
            raise DeploymentLost(
                f"the offloaded state of {info.name!r} on {self.worker_address} cannot be read "
                f"back ({e}); restore a checkpoint with load_state"
            ) from e

    def _resident(
        self, replica: Replica, info: DeploymentInfo, group: GroupContext | None
    ) -> Replica:
        """``replica`` made resident (reloaded, or rebuilt on the group of ``group``)."""
        with replica.transition:  # (waits for a prefetch of this replica in flight)
            t0 = time.perf_counter()
            source = "hbm" if replica.backend.resident else replica.tier
            if group is not None and (
                replica.backend.epoch_key != group.key or not replica.backend.resident
            ):
                if not replica.backend.resident:
                    self._make_room(reload_bytes(replica.backend), keep=info.name)
                    self.counters["reloads"] += 1
                replica.backend = replica.backend.rebuilt(self._groups)
            elif not replica.backend.resident:
                self._make_room(reload_bytes(replica.backend), keep=info.name)
                replica.backend.reload()
                self.counters["reloads"] += 1
            else:
                return replica
            if source != "hbm" and replica.stash is not None and replica.stash.source:
                source = replica.stash.source  # where the read actually found it
            self._emit(replica, "hbm", time.perf_counter() - t0, source=source)
        return replica

    def _join(self, group: GroupContext) -> None:
        if self._groups is None:
            self._groups = engine.groups.ProcessGroupManager(get_worker(), self.device)
        self._groups.join(group)

    def _load(self, info: DeploymentInfo, group: GroupContext | None, op: str) -> Replica:
        if info.memory_bytes > self.budget_bytes:
            raise DeploymentDoesNotFit(
                f"{info.name!r} needs {info.memory_bytes / 2**20:.1f} MiB per worker but "
                f"{self.worker_address} has a budget of {self.budget_bytes / 2**20:.1f} MiB"
            )
        if info.spec.lora is not None:
            return self._load_adapter(info, group)
        if info.backend == "adapters":
            return self._on_bases(info, info.spec, 0, engine.backends.AdapterBank)
        if (
            self.share_frozen
            and group is None
            and info.role == "rollout"
            and info.backend == "torch"
            # (a first request that writes or trains the weights: its own)
            and op not in MUTATING_OPS | TRAINING_OPS
        ):
            return self._load_shared(info)
        self._make_room(info.memory_bytes, keep=info.name)
        with self._reserved(info.memory_bytes):
            return self._build(info, group)

    @contextlib.contextmanager
    def _reserved(self, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` as coming while a replica is built (until it is held and its
        bytes count as resident): a prefetch meanwhile does not take the room made for it."""
        with self._moves:
            self._incoming += nbytes
        try:
            yield
        finally:
            with self._moves:
                self._incoming -= nbytes

    def _build(self, info: DeploymentInfo, group: GroupContext | None) -> Replica:
        """``info``'s replica built from its spec (room made for it) and held."""
        backends = engine.backends.BACKENDS
        backend_cls = backends.get(info.backend)
        if backend_cls is None:
            raise PlexRLError(f"unknown backend {info.backend!r}; available: {sorted(backends)}")
        t0 = time.perf_counter()
        if group is not None:
            # A multi-rank training deployment is FSDP2-sharded; a rollout replica, split
            # tensor-parallel.
            b = engine.backends
            sharded = b.TPBackend if info.role == "rollout" else b.FSDPBackend
            backend = sharded(info.spec, self.device, self._groups, self.max_batch_size)
        else:
            backend = backend_cls(info.spec, self.device, max_batch_size=self.max_batch_size)
        load_s = time.perf_counter() - t0
        self._check_built(info, backend, reserved=info.memory_bytes)
        # (a rank samples on a gathered copy, a replica on a static cache: each asks first)
        backend.room = lambda extra, name=info.name: self._make_room(extra, keep=name)
        return self._held(info, backend, group, load_s)

    def _load_shared(self, info: DeploymentInfo) -> Replica:
        """An unmodified rollout replica on this worker's copy of its spec's model (built if
        none is held); its first request that changes the weights gives it its own."""
        return self._on_bases(info, info.spec, 0, engine.backends.SharedWeightsBackend)

    def _on_bases(self, info: DeploymentInfo, shared: Any, own: int, kind: Any) -> Replica:
        """A replica of backend ``kind`` on this worker's copy of the model ``shared`` (built
        if none is held), room made for it and for ``own`` bytes of its own."""
        if self._bases is None:
            self._bases = engine.backends.SharedBases(self.device)
        held = self._bases.held(shared)
        base = 0 if held else shared.memory_bytes("rollout")
        self._make_room(base + own, keep=info.name)
        if held and not self._bases.held(shared):
            # (making room offloaded the base's last user, which let go of the base: it is
            # built again now, and needs its room too)
            base = shared.memory_bytes("rollout")
            self._make_room(base + own, keep=info.name)
        with self._reserved(base + own):
            t0 = time.perf_counter()
            backend = kind(
                info.spec, self.device, self.max_batch_size, bases=self._bases, user=info.name
            )
            load_s = time.perf_counter() - t0
            self._check_built(info, backend, reserved=base + own)
            return self._held(info, backend, None, load_s)

    def _unshare(self, replica: Replica) -> None:
        """Give ``replica`` weights of its own before a request changes them (copy on
        write); room is made for the copy first."""
        self._make_room(replica.info.memory_bytes, keep=replica.info.name)
        replica.backend = replica.backend.private_copy()
        self._emit(replica, "hbm", 0.0)
        self._emit_sharers(replica)  # (it let go of the shared model)

    def _load_adapter(self, info: DeploymentInfo, group: GroupContext | None) -> Replica:
        """A LoRA replica on this worker's copy of its base (built if none is held)."""
        if group is not None or info.backend != "torch":
            raise OpNotSupported(
                f"{info.name!r}: a LoRA adapter runs on one worker with the torch backend "
                f"(world_size 1), not {info.world_size} ranks of {info.backend!r}"
            )
        return self._on_bases(
            info, info.spec.base, info.spec.adapter_bytes(info.role), engine.backends.LoraBackend
        )

    def _held(
        self, info: DeploymentInfo, backend: Any, group: GroupContext | None, load_s: float
    ) -> Replica:
        replica = Replica(info=info, backend=backend, last_used=time.monotonic())
        if self.node is not None:
            rank = group.rank if group is not None else 0
            replica.stasher = engine.offload.Stasher(
                self.node, info.name, info.uid, self.worker_address, rank
            )
        self._replicas[info.name] = replica
        self.counters["loads"] += 1
        logger.info("loaded %s (%s) on %s in %.2fs", info.name, info.spec.name, self.device, load_s)
        self._emit(replica, "hbm", load_s, source="absent")
        return replica

    def _check_built(self, info: DeploymentInfo, backend: Any, reserved: int = 0) -> None:
        """Hold what was built to the budget, whatever its deployment declared: room is made
        for the bytes it measures (a deployment that declared less than it holds does not
        crowd the others past the budget), and one that does not fit even alone is closed
        and refused with :class:`DeploymentDoesNotFit`. ``reserved``: the bytes counted as
        coming for it while it was built (:meth:`_reserved`), which its own bytes replace."""
        own = int(backend.state_bytes())
        # a shared model is already counted once (its bases); the replica's share of it is
        # what it holds beside its own bytes
        measured = own + shared_bytes(backend)
        if measured <= info.memory_bytes or self._make_room(own - reserved, keep=info.name):
            return
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        raise DeploymentDoesNotFit(
            f"{info.name!r} declared {info.memory_bytes / 2**20:.1f} MiB per worker but its "
            f"replica holds {measured / 2**20:.1f} MiB, more than {self.worker_address} can "
            f"make room for in its budget of {self.budget_bytes / 2**20:.1f} MiB"
        )

    def _resident_bytes(self) -> int:
        bases = 0 if self._bases is None else self._bases.nbytes()  # (once for its adapters)
        return bases + sum(
            r.backend.state_bytes() for r in list(self._replicas.values()) if r.backend.resident
        )

    def room_for(self, incoming: int, keep: str) -> bool:
        """Make room for ``incoming`` more bytes of ``keep``'s replica (a request that grows
        it: an adapter loaded into a bank), offloading others as :meth:`_make_room` does;
        whether they fit now."""
        return self._make_room(incoming, keep)

    def _make_room(self, incoming: int, keep: str) -> bool:
        """Make ``incoming`` more bytes fit in the budget besides the reloads in flight: first
        shrink the prefix caches of resident replicas other than the one whose request runs
        (the least recently used replicas' first, ``keep``'s last: a prompt evicted costs its
        prefill again, where an offloaded replica costs its reload), then offload the least
        recently used replicas other than ``keep`` (and than the running one, and those
        mid-transition); False if they still do not fit. A request marks its replica running
        under ``_moves`` (see :meth:`run`), so none starts on a victim meanwhile."""
        with self._moves:
            victims = sorted(
                (
                    r
                    for n, r in self._replicas.items()
                    if n not in (keep, self._running) and r.backend.resident
                ),
                key=lambda r: r.last_used,
            )
            kept = self._replicas.get(keep)
            caches = [
                cache
                for r in [*victims, *([kept] if kept is not None and keep != self._running else [])]
                if (cache := getattr(r.backend, "prefix_cache", None)) is not None
            ]
            for cache in caches:  # (not the running request's: it may be using it)
                over = self._resident_bytes() + self._incoming + incoming - self.budget_bytes
                if over <= 0:
                    return True
                cache.shrink(cache.nbytes() - over)
            # Then what idle replicas' decoders keep beside their weights (a decode step's
            # weight layout, a static cache): rebuilt at their next sample, for a few ms.
            for victim in victims:
                if self._resident_bytes() + self._incoming + incoming <= self.budget_bytes:
                    return True
                release = getattr(victim.backend, "release_decoders", None)
                if callable(release) and victim.transition.acquire(blocking=False):
                    try:
                        release()
                    finally:
                        victim.transition.release()
            for victim in victims:
                if self._resident_bytes() + self._incoming + incoming <= self.budget_bytes:
                    return True
                if not victim.transition.acquire(blocking=False):
                    continue  # a prefetch is bringing it back: not a victim now
                try:
                    self._offload(victim)
                except PlexRLError as e:
                    # Its stash could not be written (a full tier, say): it stays resident
                    # and intact (offload stashes before it frees), so another victim, or
                    # none, makes the room. The request that asked must not fail for it:
                    # after a request, its result stands, whatever this rebalancing finds.
                    self.counters["offload_failures"] += 1
                    logger.warning("offloading %s failed: %s", victim.info.name, e)
                finally:
                    victim.transition.release()
            return self._resident_bytes() + self._incoming + incoming <= self.budget_bytes

    def _offload(self, replica: Replica) -> None:
        t0 = time.perf_counter()
        if replica.stasher is None or not replica.backend.stashes:
            replica.backend.offload()  # (a backend that keeps its own host copy: vLLM)
            tier = "dram"
        else:
            current = replica.stash
            if current is not None and current.tier() is None:
                current = None  # deleted behind our back (an operator): write it again
            # Unchanged since its stored copy (a rollout replica swapped in and out): nothing
            # to copy to the host, nothing to write.
            replica.backend.offload(replica.stasher, stored=current)
            replica.stash = replica.backend._host
            tier = replica.stash.tier() or "dram"
            if current is None:
                self.counters["stash_writes"] += 1
        self.counters["offloads"] += 1
        logger.info("offloaded %s from %s to %s", replica.info.name, self.worker_address, tier)
        self._emit(replica, tier, time.perf_counter() - t0, source="hbm")

    def _out_of_memory(self, replica: Any, name: str, op: str, error: BaseException) -> PlexRLError:
        """The typed error of ``op`` of ``name`` that ran out of device memory, once the
        replica has let go of what that request left (see :class:`DeviceOutOfMemory`); a
        replica whose optimizer step, or whose overwrite of its weights (``set_weights``,
        ``load_state``, ``load_weights``: tensor by tensor), ran out part-way is dropped as
        lost (:class:`DeploymentLost`: its state is half updated)."""
        training = op in TRAINING_OPS
        recover = getattr(replica.backend, "after_out_of_memory", None)
        whole = recover(training) is not False if callable(recover) else True
        self.counters["out_of_memory"] += 1
        if not whole or op in MUTATING_OPS - TRAINING_OPS:
            where = "its optimizer step" if training else "its overwrite of the weights"
            self._drop(name, lost=True)
            return DeploymentLost(
                f"{op} of {name!r} ran out of device memory inside {where}, which left the "
                "parameters half updated: the replica was dropped; restore a checkpoint "
                "with load_state"
            )
        dropped = " its pending gradients were dropped;" if training else ""
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        return DeviceOutOfMemory(
            f"{op} of {name!r} ran out of device memory ({first_line});"
            f"{dropped} the replica is intact: send it in smaller batches"
        )

    def _drop(self, name: str, lost: bool = False) -> None:
        replica = self._replicas.get(name)
        if replica is not None:
            with replica.transition:
                self._replicas.pop(name, None)
                cache = getattr(replica.backend, "prefix_cache", None)
                if cache is not None:
                    for k in ("lookups", "hits", "tokens", "hit_tokens"):
                        self.counters[f"prefix_{k}"] += cache.stats()[k]
                if replica.stash is not None:
                    replica.stash.delete()
                close = getattr(replica.backend, "close", None)
                if close is not None:  # a backend with a process or files of its own (vLLM)
                    close()
                self._emit(replica, "absent", 0.0, lost=lost)

    def refresh_tiers(self) -> int:
        """Report offloaded replicas whose stored state the node's manager moved (evicted to
        NVMe, promoted to DRAM) since their last report; returns how many moved. Called
        periodically by the worker plugin; never waits for a running request."""
        _worker_only("refresh_tiers")
        if self.node is None or not self._lock.acquire(blocking=False):
            return 0
        try:
            moved = 0
            for replica in self._replicas.values():
                if replica.backend.resident or replica.stash is None:
                    continue
                tier = replica.stash.tier() or "absent"
                if tier != replica.tier:
                    self._emit(replica, tier, replica.last_transition_s)
                    moved += 1
            return moved
        finally:
            self._lock.release()

    def _refuse_rebuild(self, info: DeploymentInfo, op: str) -> None:
        """Never rebuild a trained deployment from its spec behind the caller's back."""
        if info.modified and not info.revived_by(op):
            raise DeploymentLost(
                f"{info.name!r} was given weights but this worker ({self.worker_address}) holds "
                "none of them; load them again (runtime.sync_weights)"
                if info.weights_only
                else f"{info.name!r} has trained state but this worker ({self.worker_address}) "
                "holds none of it; restore a checkpoint with deployment.load_state(path)"
            )

    def _emit(
        self,
        replica: Replica,
        tier: str,
        load_s: float,
        lost: bool = False,
        source: str = "",
        unless_unchanged: bool = False,
        others: bool = True,
    ) -> None:
        """Report ``replica``'s tier; ``source`` names the tier of a transition just measured
        (``load_s``), empty for a report that only refreshes size and version. With
        ``unless_unchanged``, nothing is sent when the report equals the last one sent for
        this replica. A replica on a shared base (LoRA) reports its share of the base too;
        when one comes or goes, the others' shares change, so (``others``) they report
        again if theirs did."""
        replica.last_transition_s = load_s
        replica.tier = tier
        if tier == "hbm" and source in ("dram", "nvme", "absent"):
            self.load_seconds += load_s
        try:
            report = ResidencyReport(
                deployment=replica.info.name,
                version=int(replica.backend.version),
                tier=tier,
                bytes=int(replica.backend.state_bytes()) + shared_bytes(replica.backend),
                load_s=float(load_s),
                uid=replica.info.uid,
                modified=replica.modified,
                lost=lost,
                source=source,
            )
            if unless_unchanged and report == replica.last_report:
                return
            self._report(report.to_event())
            replica.last_report = report
        except Exception:  # reporting must never fail a request
            logger.warning("could not send a residency report", exc_info=True)
        if others and hasattr(replica.backend, "shared_bytes"):
            self._emit_sharers(replica)

    def _emit_sharers(self, changed: Replica) -> None:
        """Report again every other replica on a shared model whose share of it moved (one
        came or went: ``changed``)."""
        for other in list(self._replicas.values()):
            if other is not changed and hasattr(other.backend, "shared_bytes"):
                self._emit(other, other.tier, other.last_transition_s,
                           unless_unchanged=True, others=False)  # fmt: skip

    # --- prefetch ------------------------------------------------------------------------------

    def hint(self, deployment: str | None, uid: str = "") -> None:
        """The scheduler predicts ``deployment`` runs here next (``None``: nothing queued for
        this worker): bring it back from host memory when this worker is idle (see
        :meth:`prefetch`). Never blocks."""
        _worker_only("hint")
        self._hint = None if deployment is None else (deployment, uid)
        if self._hint is not None:
            self._prefetch_soon()

    def _prefetch_soon(self) -> None:
        # Hints arrive on the event loop, about one per request: starting a thread blocks the
        # loop until it runs, and the thread then takes the GIL from the running request.
        # So only a hint that could reload something (its replica held here, not resident)
        # gets one; prefetch re-checks all of this under its locks.
        hint = self._hint
        replica = None if hint is None else self._replicas.get(hint[0])
        if replica is None or replica.info.uid != hint[1] or replica.backend.resident:
            return
        threading.Thread(target=self.prefetch, name="plexrl-prefetch", daemon=True).start()

    def prefetch(self) -> bool:
        """Bring the hinted deployment back if it is held here offloaded, so that its next
        request finds it resident: its stored state NVMe -> DRAM in the node's manager, then
        DRAM -> device here. Both may overlap another deployment's running request: the
        reload only takes memory that is free or held by idle replicas (never the running
        one's), and that request's own growth after it ends can offload the prefetched
        replica again. A request of the prefetched deployment arriving meanwhile waits for the
        reload in flight. Multi-rank replicas are rebuilt on their group's next request
        instead (their reload joins a group)."""
        _worker_only("prefetch")
        hint = self._hint
        if hint is None:
            return False
        name, uid = hint
        replica = self._replicas.get(name)
        if replica is None or replica.info.uid != uid or replica.backend.resident:
            return False
        stash = replica.stash
        if stash is not None:
            # Whatever tier this holder last heard (the manager may have evicted it since):
            # the manager promotes from NVMe if needed, and only touches it otherwise.
            try:
                stash.node.prefetch(stash.model, stash.version)
            except Exception:
                logger.warning("prefetch hint to the node's StateManager failed", exc_info=True)
        if replica.info.world_size > 1 or not replica.transition.acquire(blocking=False):
            return False
        try:
            if replica.backend.resident or self._replicas.get(name) is not replica:
                return False
            nbytes = reload_bytes(replica.backend)
            with self._moves:
                if name == self._running or not self._make_room(nbytes, keep=name):
                    return False
                self._incoming += nbytes
            try:
                t0 = time.perf_counter()
                replica.backend.reload()
            finally:
                with self._moves:
                    self._incoming -= nbytes
            replica.last_used = time.monotonic()
            self.counters["prefetches"] += 1
            if self._hint == hint:
                self._hint = None
            source = replica.tier
            if replica.stash is not None and replica.stash.source:
                source = replica.stash.source
            self._emit(replica, "hbm", time.perf_counter() - t0, source=source)
            logger.info("prefetched %s on %s", name, self.worker_address)
            return True
        finally:
            replica.transition.release()

    # --- actor API (clients, dashboard) ----------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Budget, usage and one entry per replica."""
        with self._lock:
            return {
                "worker": self.worker_address,
                "device": self.device,
                "budget_bytes": self.budget_bytes,
                "resident_bytes": self._resident_bytes(),
                "counters": dict(self.counters),
                "load_seconds": self.load_seconds,
                "critical_load_seconds": self.critical_load_s,
                "hint": None if self._hint is None else self._hint[0],
                "node": None if self.node is None else self.node.node_id,
                "bases": {} if self._bases is None else self._bases.status(),
                "replicas": {n: r.status() for n, r in self._replicas.items()},
            }

    def capacity(self) -> dict[str, Any]:
        """What the scheduler needs for placement."""
        return {
            "budget_bytes": self.budget_bytes,
            "device": self.device,
            "node": None if self.node is None else self.node.node_id,
        }

    def offload(self, name: str) -> bool:
        """Offload ``name`` to host memory now; False if it is not held or not resident."""
        _worker_only("offload")
        with self._lock:
            replica = self._replicas.get(name)
            if replica is None or not replica.backend.resident:
                return False
            with replica.transition:
                self._offload(replica)
            return True

    def drop(self, name: str) -> bool:
        """Forget ``name`` and free its memory; False if it was not held."""
        _worker_only("drop")
        with self._lock:
            held = name in self._replicas
            self._drop(name)
            return held

    def timeline(self, since: float = 0.0) -> list[dict[str, Any]]:
        """The spans of requests that ended after ``since`` (wall-clock seconds), oldest
        first, as dicts (:class:`~plexrl_dask.shared.timeline.RequestSpan` fields)."""
        return [s.to_dict() for s in self.spans.since(since)]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)
