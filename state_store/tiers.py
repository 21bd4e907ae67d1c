"""The policy of a node's StateManager: which version lives in which tier, and when it moves.

:class:`TierManager` holds the decisions and the file work of the manager process
(:mod:`~plexrl_dask.state_store.manager` serves it to the node's workers) over the node's two
:class:`~plexrl_dask.state_store.store.StateStore` tiers, DRAM and NVMe: capacity
(reservations), which versions are in use (pins), eviction DRAM -> NVMe, promotion NVMe -> DRAM,
prefetch, and garbage collection. Its state is an index that it rebuilds from the files when
it starts (bytes used, LRU order from publish times), so a manager can die and be replaced
without losing a byte.

**Eviction policy (DRAM -> NVMe).** A reservation that does not fit in DRAM evicts published
versions least recently used first (use = published, pinned, promoted or touched), skipping
pinned versions and versions being moved. A victim not yet on NVMe is copied there first (only
the objects NVMe lacks), then unpublished from DRAM; the objects no remaining DRAM version uses
are collected. If nothing more can be evicted the reservation is granted on NVMe instead (when
the client accepts that) or refused with :class:`~plexrl_dask.errors.TierFull`.

**Promotion.** ``pin(..., promote=True)`` (a read) and ``prefetch`` (a scheduler hint, in the
background) copy a version found only on NVMe into DRAM, evicting as above; a version that
cannot fit is read from NVMe where it is.

**Garbage collection safety.** An object is collected only if no published version, no
closed writer and no write in progress refers to it: a write records every object it uses in
its staging directory *before* looking it up or writing it, and collection checks an object's
age again right before deleting it (see :meth:`StateStore.gc`). Eviction therefore frees
exactly the victim's unshared bytes, and a victim that would free nothing is skipped. A
deletion unpublishes at once and leaves the collection to a thread of its own; a reservation
that does not fit, and a status report, wait for it first.

**Pins across manager deaths.** Each client also records its pins in
``<dram>/clients/<pid>.json`` at every change; a manager honours the records of live
processes, so a successor started by another client never evicts what a client of its
predecessor is reading, before or after that client reconnects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl_dask.errors import StateStoreError, TierFull, VersionNotFound
from plexrl_dask.state_store.store import StateStore

if TYPE_CHECKING:
    from plexrl_dask.state_store.manager import ManagerConfig

logger = logging.getLogger(__name__)

#: <dram>/clients/<pid>.json: a client's pins (TierManager._absent_clients)
CLIENTS_DIR = "clients"
STORE_DIR = "store"  # a tier's store, beside the manager's files in the tier directory
TIERS = ("dram", "nvme")

Key = tuple[str, int]


@dataclass
class _Lease:
    """A reservation of tier bytes for a write in progress."""

    client: str
    tier: str
    nbytes: int
    started: float = field(default_factory=time.time)


class TierManager:
    """The manager's decisions and file work, without the server (see the module docstring).
    Thread-safe: quick index updates under one lock; copies run outside it, one per version."""

    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.dram = StateStore(Path(cfg.dram_path) / STORE_DIR, create=True, durable=False)
        self.nvme = StateStore(Path(cfg.nvme_path) / STORE_DIR, create=True, durable=True)
        self._lock = threading.RLock()
        self._moving: dict[Key, threading.Lock] = {}
        self._busy: Counter[Key] = Counter()  # versions being moved (nested): never a victim
        self.pins: dict[Key, Counter[str]] = {}
        self.leases: dict[str, _Lease] = {}
        self.last_used: dict[Key, float] = {}
        self.counters = Counter[str]()
        # When each tier's accounting was last walked (the end of the walk), collections
        # walking it now, and whether a write ended during one (see release).
        self._scanned_at = {tier: 0.0 for tier in TIERS}
        self._scanning = Counter[str]()
        self._ended_while_scanning = {tier: False for tier in TIERS}
        self.client_pids: dict[str, int] = {}  # connection -> client process
        self.used = {
            "dram": self.dram.gc(grace_s=3600.0)["object_bytes"],
            "nvme": self.nvme.gc(grace_s=3600.0)["object_bytes"],
        }
        for model in self.dram.models():  # a restarted manager: LRU order from publish times
            for version in self.dram.versions(model):
                self.last_used[(model, version)] = self.dram.manifest(model, version).created
        self._prefetch_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="plexrl-prefetch"
        )
        # Collections that deletions asked for, one tier at a time (see _collect_soon).
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plexrl-collect")
        self._collections: dict[str, Future[Any]] = {}

    def store(self, tier: str) -> StateStore:
        return self.dram if tier == "dram" else self.nvme

    def capacity(self, tier: str) -> int | None:
        return self.cfg.dram_capacity if tier == "dram" else self.cfg.nvme_capacity

    # --- where versions are -------------------------------------------------------------------

    def locate(self, model: str, version: int) -> str | None:
        """The fastest tier holding the version, or None."""
        for tier in TIERS:
            if self.store(tier).has_version(model, version):
                return tier
        return None

    def touch(self, model: str, version: int) -> None:
        with self._lock:
            self.last_used[(model, version)] = time.time()

    # --- reservations ---------------------------------------------------------------------------

    def _reserved(self, tier: str) -> int:
        return sum(lease.nbytes for lease in self.leases.values() if lease.tier == tier)

    def _fits(self, tier: str, nbytes: int) -> bool:
        cap = self.capacity(tier)
        return cap is None or self.used[tier] + self._reserved(tier) + nbytes <= cap

    def reserve(
        self, client: str, nbytes: int, tiers: list[str], started: float | None = None
    ) -> dict[str, Any]:
        """Room for a write of up to ``nbytes`` on the first of ``tiers`` that can make it
        (DRAM by evicting); returns ``{"lease", "tier", "root", "started"}``. ``started``: when
        the write began, if before this call (a client re-registering with a new manager)."""
        nbytes = int(nbytes)
        for tier in tiers:
            if tier not in TIERS:
                raise StateStoreError(f"unknown tier {tier!r}; tiers: {TIERS}")
            if not self._fits(tier, nbytes):
                self.settle(tier)  # the room a deletion is freeing right now counts
            if tier == "dram":
                self._make_room(nbytes)
            with self._lock:
                if self._fits(tier, nbytes):
                    lease = uuid.uuid4().hex
                    held = self.leases[lease] = _Lease(client, tier, nbytes, started or time.time())
                    return {
                        "lease": lease,
                        "tier": tier,
                        "root": str(self.store(tier).root),
                        "started": held.started,
                    }
        raise TierFull(
            f"no room for {nbytes} bytes on {tiers} of node {self.cfg.node_id}: "
            + ", ".join(
                f"{t} {self.used[t]}+{self._reserved(t)} of {self.capacity(t)}" for t in TIERS
            )
            + " bytes used+reserved; stored versions are intact"
        )

    def release(self, lease: str, written: int = 0, published: Key | None = None) -> None:
        """End a write: ``written`` bytes of new objects now count as used; ``published``
        (model, version) enters the LRU order as just used."""
        with self._lock:
            held = self.leases.pop(lease, None)
            if held is not None:
                tier = held.tier
                if self._scanning[tier]:
                    # A walk in progress may or may not see this write's objects: walk again
                    # once it ends (collect).
                    self._ended_while_scanning[tier] = True
                elif held.started <= self._scanned_at[tier]:
                    # A walk during this write counted part of it: walk again rather than
                    # add twice.
                    self._rescan(tier)
                else:
                    self.used[tier] += int(written)
            if published is not None:
                self.last_used[tuple(published)] = time.time()  # type: ignore[index]

    def _pinned(self, key: Key, recorded: set[Key] | None = None) -> bool:
        """Pinned by a connected client, or in a live client's record (``recorded``: those
        records' pins, when the caller read them once for many keys)."""
        if key in self.pins:
            return True
        return key in (self._recorded_pins() if recorded is None else recorded)

    def _recorded_pins(self) -> set[Key]:
        return {(m, int(v)) for r in self._absent_clients() for m, v, _ in r.get("pins", [])}

    def _absent_clients(self) -> list[dict[str, Any]]:
        """Pins that live client processes recorded in the DRAM directory
        (:mod:`.node` rewrites its record at every change). They survive this manager: its
        successor honours them before the clients reconnect and register again, and while
        they do (so no eviction slips in between)."""
        out = []
        for path in (Path(self.cfg.dram_path) / CLIENTS_DIR).glob("*.json"):
            try:
                pid = int(path.stem)
                if pid == os.getpid():
                    continue
                os.kill(pid, 0)  # alive? (a dead client's pins died with it)
            except (ValueError, ProcessLookupError):
                continue
            except PermissionError:
                pass  # alive: another user's process
            with contextlib.suppress(ValueError, OSError):
                out.append(json.loads(path.read_text()))
        return out

    # --- pins -----------------------------------------------------------------------------------

    def pin(self, client: str, model: str, version: int, promote: bool) -> dict[str, Any]:
        """Keep the version where it is while ``client`` reads it; promote it to DRAM first if
        asked and it fits. Returns ``{"tier", "source", "root"}`` (``source``: where it was)."""
        key = (model, version)
        with self._lock:  # pinned before looking: an eviction cannot slip in between
            self.pins.setdefault(key, Counter())[client] += 1
        try:
            source = self.locate(model, version)
            if source is None:
                raise VersionNotFound(
                    f"{model!r} v{version} is in no tier of node {self.cfg.node_id}"
                )
            tier = source
            if source == "nvme" and promote:
                tier = self.promote(model, version)
            self.touch(model, version)
            return {"tier": tier, "source": source, "root": str(self.store(tier).root)}
        except BaseException:
            self.unpin(client, model, version)
            raise

    def unpin(self, client: str, model: str, version: int) -> None:
        key = (model, version)
        with self._lock:
            held = self.pins.get(key)
            if held is None:
                return
            held[client] -= 1
            if held[client] <= 0:
                del held[client]
            if not held:
                del self.pins[key]

    def drop_client(self, client: str) -> None:
        """A client went away (its process died or closed): its pins and leases go too."""
        with self._lock:
            for key in list(self.pins):
                self.pins[key].pop(client, None)
                if not self.pins[key]:
                    del self.pins[key]
            for lease, held in list(self.leases.items()):
                if held.client == client:
                    del self.leases[lease]

    # --- moves ----------------------------------------------------------------------------------

    def _move_lock(self, key: Key) -> threading.Lock:
        with self._lock:
            return self._moving.setdefault(key, threading.Lock())

    def promote(self, model: str, version: int) -> str:
        """Copy the version NVMe -> DRAM if it fits (evicting others); returns its tier now."""
        key = (model, version)
        with self._move_lock(key):
            if self.dram.has_version(model, version):
                return "dram"
            if not self.nvme.has_version(model, version):
                raise VersionNotFound(
                    f"{model!r} v{version} is in no tier of node {self.cfg.node_id}"
                )
            nbytes = self._new_bytes(self.nvme, self.dram, model, version)
            try:
                grant = self.reserve("manager", nbytes, ["dram"])
            except TierFull:
                logger.info("%s v%d does not fit in DRAM: read from NVMe", model, version)
                return "nvme"
            with self._lock:
                self._busy[key] += 1
            written = 0
            try:
                t0 = time.perf_counter()
                written = self.dram.copy_version_from(self.nvme, model, version)
                self.counters["promotions"] += 1
                self.counters["bytes_promoted"] += written
                logger.info(
                    "promoted %s v%d to DRAM (%d bytes, %.3fs)",
                    model,
                    version,
                    written,
                    time.perf_counter() - t0,
                )
            finally:
                with self._lock:
                    self._busy[key] -= 1
                self.release(grant["lease"], written, published=key)
            return "dram"

    def persist(self, model: str, version: int) -> int:
        """Make sure the version is on NVMe (durable), keeping the DRAM copy; bytes copied."""
        key = (model, version)
        with self._move_lock(key):
            if self.nvme.has_version(model, version):
                return 0
            if not self.dram.has_version(model, version):
                raise VersionNotFound(
                    f"{model!r} v{version} is in no tier of node {self.cfg.node_id}"
                )
            nbytes = self._new_bytes(self.dram, self.nvme, model, version)
            grant = self.reserve("manager", nbytes, ["nvme"])
            written = 0
            with self._lock:
                self._busy[key] += 1
            try:
                written = self.nvme.copy_version_from(self.dram, model, version)
                self.counters["persists"] += 1
            finally:
                with self._lock:
                    self._busy[key] -= 1
                self.release(grant["lease"], written)
            return written

    def evict(self, model: str, version: int) -> bool:
        """Move the version DRAM -> NVMe (persist, unpublish from DRAM, collect). False if it
        is pinned, moving or not in DRAM."""
        key = (model, version)
        with self._lock:
            if self._pinned(key) or self._busy[key] or not self.dram.has_version(model, version):
                return False
            self._busy[key] += 1
        try:
            try:
                self.persist(model, version)
            except TierFull:
                return False
            with self._lock:
                if self._pinned(key):  # pinned meanwhile: a reader is on it, keep it
                    return False
                nbytes = self.dram.manifest(model, version).tensors
                self.dram.delete_version(model, version)
                self.last_used.pop(key, None)
            self.counters["evictions"] += 1
            self.counters["bytes_evicted"] += sum(e.nbytes for e in nbytes.values())
            self.collect("dram")
            logger.info("evicted %s v%d from DRAM to NVMe", model, version)
            return True
        finally:
            with self._lock:
                self._busy[key] -= 1

    def _make_room(self, nbytes: int) -> None:
        """Evict DRAM versions, least recently used first, until ``nbytes`` more fit. A
        version whose eviction would free nothing now (its objects shared with another DRAM
        version, or touched by a write still open) is not a victim: moving it would cost a
        copy and gain no room."""
        tried: set[Key] = set()
        while not self._fits("dram", nbytes):
            recorded = self._recorded_pins()
            with self._lock:
                victims = sorted(
                    (
                        k
                        for k in self._dram_versions()
                        if not self._pinned(k, recorded) and not self._busy[k] and k not in tried
                    ),
                    key=lambda k: self.last_used.get(k, 0.0),
                )
            victims = [k for k in victims if self._freeable(k) > 0]
            if not victims:
                return
            tried.add(victims[0])
            self.evict(*victims[0])

    def _freeable(self, key: Key) -> int:
        """Bytes that evicting ``key`` from DRAM would free now (its objects that no other
        version and no publish in progress uses)."""
        try:
            mine = self.dram.manifest(*key).digests()
        except VersionNotFound:
            return 0
        freed = 0
        for digest in mine - self.dram.live_digests(exclude=key):
            with contextlib.suppress(FileNotFoundError):
                freed += self.dram.objects.path(digest).stat().st_size
        return freed

    def _dram_versions(self) -> list[Key]:
        return [(m, v) for m in self.dram.models() for v in self.dram.versions(m)]

    def _new_bytes(self, src: StateStore, dst: StateStore, model: str, version: int) -> int:
        """Bytes a copy of the version from ``src`` would add to ``dst`` (objects it lacks)."""
        manifest = src.manifest(model, version)
        return sum(
            src.objects.path(d).stat().st_size
            for d in manifest.digests()
            if not dst.objects.path(d).exists() and src.objects.path(d).exists()
        )

    def delete(self, model: str, version: int, tiers: list[str]) -> dict[str, bool]:
        """Unpublish the version from ``tiers`` (refused on every tier while it is pinned, by a
        client of this manager or in a live client's record: a reader may read it from any
        tier) and collect those tiers soon (:meth:`_collect_soon`): the version is gone when
        this returns, its unshared objects a moment later."""
        key = (model, version)
        out = {}
        with self._move_lock(key):
            recorded = self._recorded_pins()  # (files: read once, outside the lock)
            for tier in tiers:
                with self._lock:
                    if self._pinned(key, recorded):
                        raise StateStoreError(f"{model!r} v{version} is being read; not deleted")
                    store = self.store(tier)
                    out[tier] = store.has_version(model, version)
                    if out[tier]:
                        store.delete_version(model, version)
                if out[tier]:
                    self._collect_soon(tier)
        with self._lock:
            if not self.dram.has_version(model, version):
                self.last_used.pop(key, None)
        return out

    def _collect_soon(self, tier: str) -> None:
        """Collect ``tier`` on the collector thread; one collection not yet started serves
        every request made before it starts. A deletion so returns without waiting for the
        walk of the tier and the freeing of its objects (a weight sync deletes the version
        before the one it made, on its critical path, on both nodes); what reads the tier's
        accounting waits for the collection first (:meth:`settle`)."""
        with self._lock:
            queued = self._collections.get(tier)
            if queued is None or queued.running() or queued.done():
                self._collections[tier] = self._collector.submit(self._collect_quietly, tier)

    def _collect_quietly(self, tier: str) -> None:
        try:
            self.collect(tier)
        except Exception:  # the tier's accounting stays high (the safe way) until the next one
            logger.warning("collecting the %s tier failed", tier, exc_info=True)

    def settle(self, tier: str) -> None:
        """Wait until the collections that deletions asked for on ``tier`` are done."""
        with self._lock:
            queued = self._collections.get(tier)
        if queued is not None:
            queued.result()

    def collect(self, tier: str) -> dict[str, int]:
        """Garbage-collect ``tier`` now: nothing a version, a closed writer or a write in
        progress refers to is deleted (see the module docstring)."""
        with self._lock:
            self._scanning[tier] += 1
        try:
            report = self.store(tier).gc(grace_s=0.0)
        finally:
            with self._lock:
                self._scanning[tier] -= 1
        with self._lock:
            # Bytes of writes still in progress were already on disk in the walk; their leases
            # still reserve them too. Over-counting until they end is the safe direction.
            self.used[tier] = report["object_bytes"]
            self._scanned_at[tier] = time.time()
            if self._ended_while_scanning[tier] and not self._scanning[tier]:
                self._rescan(tier)
        return report

    def _rescan(self, tier: str) -> None:
        """Count ``tier``'s objects afresh (under the lock): writes that started before now
        are walked again when they end."""
        self.used[tier] = self.store(tier).objects.scan_bytes()
        self._scanned_at[tier] = time.time()
        self._ended_while_scanning[tier] = False

    def prefetch(self, model: str, version: int) -> bool:
        """Promote the version in the background (a scheduler hint); False if unknown."""
        if self.locate(model, version) is None:
            return False
        self.touch(model, version)
        if not self.dram.has_version(model, version):
            self._prefetch_pool.submit(self._prefetch, model, version)
        return True

    def _prefetch(self, model: str, version: int) -> None:
        try:
            if self.promote(model, version) == "dram":
                self.counters["prefetches"] += 1
        except Exception:
            logger.warning("prefetch of %s v%d failed", model, version, exc_info=True)

    # --- reporting ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Per tier: capacity, bytes used and reserved, versions (with logical bytes, pins and
        last use) and what dedup saves (logical bytes of all versions - stored bytes), once
        the collections deletions asked for are done."""
        for tier in TIERS:
            self.settle(tier)
        tiers: dict[str, Any] = {}
        with self._lock:
            pins = {f"{m}/{v}": sum(c.values()) for (m, v), c in self.pins.items()}
            for tier in TIERS:
                store = self.store(tier)
                versions = []
                logical = 0
                for model in store.models():
                    for version in store.versions(model):
                        try:
                            nbytes = sum(
                                e.nbytes for e in store.manifest(model, version).tensors.values()
                            )
                        except VersionNotFound:
                            continue  # deleted by a concurrent call
                        logical += nbytes
                        versions.append(
                            {
                                "model": model,
                                "version": version,
                                "bytes": nbytes,
                                "pins": pins.get(f"{model}/{version}", 0),
                                "last_used": self.last_used.get((model, version)),
                            }
                        )
                tiers[tier] = {
                    "root": str(store.root),
                    "capacity": self.capacity(tier),
                    "used": self.used[tier],
                    "reserved": self._reserved(tier),
                    "logical_bytes": logical,
                    "dedup_saved_bytes": max(0, logical - self.used[tier]),
                    "versions": versions,
                }
            return {
                "node": self.cfg.node_id,
                "pid": os.getpid(),
                "tiers": tiers,
                "leases": len(self.leases),
                "counters": dict(self.counters),
            }
