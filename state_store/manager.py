"""The per-node StateManager: the one owner of a node's DRAM and NVMe tiers.

**What it owns.** Two :class:`~plexrl_dask.state_store.store.StateStore` tiers: DRAM (a store on
a shared-memory filesystem, ``/dev/shm``, that every worker process of the node maps) and NVMe
(a store on a local disk, durable: fsynced). Workers read and write chunk bytes *directly* in
those directories (a memory copy, never a socket); the manager holds what must be decided in
one place: capacity (reservations), which versions are in use (pins), eviction DRAM -> NVMe,
promotion NVMe -> DRAM, prefetch, and garbage collection. Its state is an index that it can
rebuild from the files at any time, so it can die and be replaced without losing a byte.

**How it is found or started (election).** The manager of a node is the process holding an
exclusive ``flock`` on ``<dram>/manager.lock``, listening on an abstract Unix socket named
after the DRAM path (:func:`socket_name`). A client (any worker) connects; if nothing
answers it takes ``<dram>/start.lock`` (so only one client of the node starts one), checks
again, and spawns ``python -m plexrl_dask.state_store.manager`` detached from itself (its own
session: it outlives the worker that started it). A manager that cannot take the lock exits at
once, so two racing starters still end with one manager.

**When it dies.** The kernel drops its lock and socket. Bytes are files, so nothing is lost;
what dies with it is the index (rebuilt by the next manager from the stores) and the pins and
reservations of connected clients. Every client call has a timeout; a client whose call fails
on a broken connection starts or finds the next manager (the election above), re-registers its
pins and reservations, and retries the call once (every call is idempotent). A version that
was being moved stays where it was (moves publish atomically, then delete the source).

**Two nodes on one NVMe path.** The NVMe tier's ``owner.json`` names the node and DRAM path of
the manager that owns it and carries a heartbeat. A manager finding a live lease of another
owner refuses to start (:class:`~plexrl_dask.errors.TierInUse`, reported to the starting client
through ``<dram>/manager.error``); an expired lease may be taken over, and a manager that finds
its lease taken over stops.

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

Protocol: newline-delimited JSON, ``{"op": ..., **args}`` -> ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": <PlexRL error name>, "message": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from plexrl_dask.errors import (
    PlexRLError,
    StateStoreError,
    TierFull,
    TierInUse,
    TierNotPrivate,
    VersionNotFound,
)
from plexrl_dask.state_store.store import StateStore

logger = logging.getLogger(__name__)

LOCK_FILE = "manager.lock"
START_LOCK_FILE = "start.lock"
ERROR_FILE = "manager.error"
LOG_FILE = "manager.log"
OWNER_FILE = "owner.json"
#: <dram>/clients/<pid>.json: a client's pins (TierManager._absent_clients)
CLIENTS_DIR = "clients"
STORE_DIR = "store"  # a tier's store, beside the manager's files in the tier directory
TIERS = ("dram", "nvme")


@dataclass(frozen=True)
class ManagerConfig:
    """What one node's manager runs with (``plexrl.state.*``, resolved to concrete values)."""

    dram_path: str
    nvme_path: str
    dram_capacity: int
    nvme_capacity: int | None
    node_id: str
    owner_lease_s: float = 30.0
    idle_exit_s: float = 60.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ManagerConfig:
        return cls(**json.loads(text))


def peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end of Unix socket ``sock`` (``SO_PEERCRED``);
    None where the platform cannot say."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return None
    return struct.unpack("3i", creds)[1]


def socket_name(dram_path: str | os.PathLike[str]) -> str:
    """The abstract Unix socket of the manager of ``dram_path`` (no file: nothing stale to
    clean after a crash, and no path-length limit)."""
    key = xxhash.xxh3_64_hexdigest(os.path.realpath(os.fspath(dram_path)).encode())
    return f"\0plexrl-state-{key}"


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
        self._collected_at = {tier: 0.0 for tier in TIERS}
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
                if held.started <= self._collected_at[held.tier]:
                    # A collection walked the tier during this write and counted what it had
                    # written by then: count again rather than add twice.
                    self.used[held.tier] = self.store(held.tier).objects.scan_bytes()
                else:
                    self.used[held.tier] += int(written)
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
        """Unpublish the version from ``tiers`` (refused while pinned) and collect those tiers
        soon (:meth:`_collect_soon`): the version is gone when this returns, its unshared
        objects a moment later."""
        key = (model, version)
        out = {}
        with self._move_lock(key):
            for tier in tiers:
                with self._lock:
                    if key in self.pins and tier == "dram":
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
            self._collected_at[tier] = time.time()
        report = self.store(tier).gc(grace_s=0.0)
        with self._lock:
            # Bytes of writes still in progress were already on disk in the walk; their leases
            # still reserve them too. Over-counting until they end is the safe direction.
            self.used[tier] = report["object_bytes"]
        return report

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


# --- the NVMe tier's owner lease ------------------------------------------------------------------


def _owner_record(cfg: ManagerConfig) -> dict[str, Any]:
    return {
        "node": cfg.node_id,
        "dram": os.path.realpath(cfg.dram_path),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "heartbeat": time.time(),
    }


def private_tier_dir(path: str | os.PathLike[str]) -> Path:
    """Tier directory ``path``, created if missing, as this user's alone (mode 0700: nothing
    under it is reachable by other local users, whatever the files' own modes);
    :class:`TierNotPrivate` if it belongs to another user (one who could read and replace
    its files)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise TierNotPrivate(
            f"tier directory {path} belongs to uid {st.st_uid}, not to this user (uid "
            f"{os.getuid()}): choose another plexrl.state path"
        )
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def claim_nvme(cfg: ManagerConfig) -> None:
    """Take (or renew) the NVMe tier's owner lease, or raise :class:`TierInUse`."""
    path = Path(cfg.nvme_path) / OWNER_FILE
    private_tier_dir(cfg.nvme_path)
    mine = _owner_record(cfg)
    # The check and the write are one critical section among processes of *this* host; across
    # hosts the lease (heartbeats every lease/3) is what keeps a second owner out.
    with open(Path(cfg.nvme_path) / ".owner.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            current = None
        if current is not None and (current.get("node"), current.get("dram")) != (
            mine["node"],
            mine["dram"],
        ):
            age = time.time() - float(current.get("heartbeat", 0.0))
            if age < cfg.owner_lease_s:
                raise TierInUse(
                    f"the NVMe tier {cfg.nvme_path} belongs to the StateManager of node "
                    f"{current.get('node')!r} (DRAM {current.get('dram')}, heartbeat {age:.1f}s ago); "
                    f"node {cfg.node_id!r} cannot share it: give each node its own plexrl.state.nvme-path"
                )
            logger.warning(
                "taking over the NVMe tier %s from node %r (lease expired %.0fs ago)",
                cfg.nvme_path,
                current.get("node"),
                age,
            )
        tmp = path.with_name(f".{OWNER_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(mine))
        os.replace(tmp, path)


# --- the server -------------------------------------------------------------------------------------


class ManagerServer:
    """The manager process's event loop: one connection per client, calls run on threads."""

    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.tiers = TierManager(cfg)
        self._clients = 0
        self._idle_since = time.monotonic()
        self._stop = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="plexrl-manager")

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        server = await asyncio.start_unix_server(
            self._connection, path=socket_name(self.cfg.dram_path), limit=2**24
        )
        logger.info(
            "StateManager of node %s (pid %d) serving %s / %s",
            self.cfg.node_id,
            os.getpid(),
            self.cfg.dram_path,
            self.cfg.nvme_path,
        )
        async with server:
            watch = asyncio.create_task(self._watch())
            await self._stop.wait()
            watch.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _watch(self) -> None:
        """Heartbeat the NVMe lease; stop when idle, when the DRAM tier is gone, or when
        another node took the NVMe tier over."""
        interval = max(0.2, min(self.cfg.owner_lease_s / 3, 5.0))
        while True:
            await asyncio.sleep(interval)
            if not Path(self.cfg.dram_path).is_dir():
                logger.info("DRAM tier %s removed: stopping", self.cfg.dram_path)
                self._stop.set()
                return
            try:
                await asyncio.to_thread(claim_nvme, self.cfg)
            except TierInUse as e:
                logger.error("lost the NVMe tier: %s; stopping", e)
                self._stop.set()
                return
            if self._clients == 0 and time.monotonic() - self._idle_since > self.cfg.idle_exit_s:
                logger.info("no clients for %.0fs: stopping", self.cfg.idle_exit_s)
                self._stop.set()
                return

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid is not None and uid != os.getuid():
            # The socket is abstract (any local user can connect): only processes of the user
            # that owns the tiers may use them (their files are that user's alone).
            logger.warning(
                "refused a connection from uid %s (this node's tiers are uid %d's)",
                uid,
                os.getuid(),
            )
            refusal = {
                "ok": False,
                "error": "PermissionDenied",
                "message": f"the StateManager of {self.cfg.dram_path} serves only uid "
                f"{os.getuid()}, not uid {uid}",
            }
            # (answering its first call, so that its write never meets a closed socket)
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError, ValueError):
                await asyncio.wait_for(reader.readline(), self.cfg.owner_lease_s)
                writer.write(json.dumps(refusal).encode() + b"\n")
                await writer.drain()
            writer.close()
            return
        client = uuid.uuid4().hex
        self._clients += 1
        loop = asyncio.get_running_loop()
        try:
            while line := await reader.readline():
                try:
                    msg = json.loads(line)
                    result = await loop.run_in_executor(self._pool, self._handle, client, msg)
                    reply = {"ok": True, "result": result}
                except PlexRLError as e:
                    reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
                except Exception as e:  # a bug, or an OS error: the client gets it, typed
                    logger.exception("StateManager call failed")
                    reply = {
                        "ok": False,
                        "error": "StateStoreError",
                        "message": f"{type(e).__name__}: {e}",
                    }
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._clients -= 1
            self._idle_since = time.monotonic()
            self.tiers.drop_client(client)
            self.tiers.client_pids.pop(client, None)
            writer.close()

    def _handle(self, client: str, msg: dict[str, Any]) -> Any:
        op = msg.pop("op", None)
        t = self.tiers
        if op == "hello":
            if "pid" in msg:
                t.client_pids[client] = int(msg["pid"])
            return {
                "node": self.cfg.node_id,
                "pid": os.getpid(),
                "dram": str(t.dram.root),
                "nvme": str(t.nvme.root),
            }
        if op == "reserve":
            return t.reserve(
                client, msg["nbytes"], list(msg.get("tiers", ["dram", "nvme"])), msg.get("started")
            )
        if op == "release":
            published = msg.get("published")
            t.release(msg["lease"], msg.get("written", 0), tuple(published) if published else None)
            return None
        if op == "pin":
            return t.pin(client, msg["model"], int(msg["version"]), bool(msg.get("promote", True)))
        if op == "unpin":
            t.unpin(client, msg["model"], int(msg["version"]))
            return None
        if op == "locate":
            return {f"{m}/{v}": t.locate(m, int(v)) for m, v in msg["keys"]}
        if op == "prefetch":
            return t.prefetch(msg["model"], int(msg["version"]))
        if op == "persist":
            return t.persist(msg["model"], int(msg["version"]))
        if op == "evict":
            return t.evict(msg["model"], int(msg["version"]))
        if op == "delete":
            return t.delete(msg["model"], int(msg["version"]), list(msg.get("tiers", TIERS)))
        if op == "collect":
            return {tier: t.collect(tier) for tier in TIERS}
        if op == "status":
            return t.status()
        if op == "shutdown":
            self._loop.call_soon_threadsafe(self._stop.set)  # (this runs on a pool thread)
            return None
        raise StateStoreError(f"unknown StateManager op {op!r}")

    def run(self) -> None:
        asyncio.run(self.serve())


def run_manager(cfg: ManagerConfig) -> int:
    """The manager process's body: win the node's election or exit; 0 on a clean stop."""
    try:
        dram = private_tier_dir(cfg.dram_path)
    except TierNotPrivate as e:  # (no error file: the directory is not ours to write)
        logger.error("%s", e)
        return 1
    lock = open(dram / LOCK_FILE, "a+")  # noqa: SIM115 (held open and locked for the process's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logger.info("another StateManager holds %s: exiting", dram / LOCK_FILE)
        return 0
    (dram / ERROR_FILE).unlink(missing_ok=True)
    try:
        claim_nvme(cfg)
        server = ManagerServer(cfg)
    except PlexRLError as e:
        (dram / ERROR_FILE).write_text(json.dumps({"error": type(e).__name__, "message": str(e)}))
        logger.error("%s", e)
        return 1
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    try:
        server.run()
    finally:
        # Let a successor start at once, not when this process has finished exiting.
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The PlexRL StateManager of this node (normally started by a worker)."
    )
    parser.add_argument("--config", required=True, help="ManagerConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_manager(ManagerConfig.from_json(args.config))


if __name__ == "__main__":
    sys.exit(main())
