"""A process's handle on its node's StateManager, and the tiers' configuration.

:class:`NodeState` is what a worker (a replica holder, a backend saving a checkpoint) uses: it
finds the node's manager or starts one (:mod:`.manager` documents the election and what
happens when the manager dies), asks it for room and pins, and reads and writes chunk bytes
directly in the tier directories. Every call has a timeout; a call cut off by a manager's
death is retried once on the next manager, with this process's pins and reservations
registered again first.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import torch
from dask.utils import parse_bytes

from plexrl_dask import config
from plexrl_dask.errors import ManagerUnavailable, PlexRLError, StateStoreError, from_status
from plexrl_dask.state_store.keys import DTYPES, ROW_SPLITS, Manifest
from plexrl_dask.state_store.manager import (
    ERROR_FILE,
    LOCK_FILE,
    LOG_FILE,
    START_LOCK_FILE,
    ManagerConfig,
    private_tier_dir,
    socket_name,
)
from plexrl_dask.state_store.objects import Tally
from plexrl_dask.state_store.store import StateStore, VersionWriter
from plexrl_dask.state_store.tiers import CLIENTS_DIR, STORE_DIR

logger = logging.getLogger(__name__)

#: Ops whose work may move whole versions between tiers (bounded by the transfer timeout).
_LONG_OPS = frozenset({"reserve", "pin", "persist", "evict", "delete", "collect"})


@dataclass(frozen=True)
class StateConfig:
    """The node's tiers and the manager's timeouts (``plexrl.state.*``, "auto" resolved)."""

    manager: ManagerConfig
    call_timeout_s: float
    transfer_timeout_s: float
    start_timeout_s: float

    @classmethod
    def for_tiers(cls, tiers: Mapping[str, object]) -> StateConfig:
        """The configuration of the node whose ``plexrl.state.*`` settings are ``tiers``
        (``dram-path``, ``nvme-path``, ``node-id``, ...) over the current ones: another node's
        tiers, as a local cluster or a test names them."""
        with dask.config.set({f"plexrl.state.{k}": str(v) for k, v in tiers.items()}):
            return cls.from_dask_config()

    @classmethod
    def from_dask_config(cls) -> StateConfig:
        user = getpass.getuser()
        dram = str(config.get("state.dram-path"))
        if dram == "auto":
            shm = Path("/dev/shm")
            base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
            dram = str(base / f"plexrl-dram-{user}")
        nvme = str(config.get("state.nvme-path"))
        if nvme == "auto":
            nvme = str(Path(tempfile.gettempdir()) / f"plexrl-nvme-{user}")
        dram_cap = config.get("state.dram-capacity")
        if dram_cap == "auto":
            parent = dram if os.path.isdir(dram) else os.path.dirname(dram)
            st = os.statvfs(parent)
            dram_cap = st.f_blocks * st.f_frsize // 2
        nvme_cap = config.get("state.nvme-capacity")
        node = str(config.get("state.node-id"))
        return cls(
            manager=ManagerConfig(
                dram_path=dram,
                nvme_path=nvme,
                dram_capacity=int(parse_bytes(dram_cap) if isinstance(dram_cap, str) else dram_cap),
                nvme_capacity=None
                if nvme_cap in (None, "none")
                else int(parse_bytes(nvme_cap) if isinstance(nvme_cap, str) else nvme_cap),
                node_id=default_node_id() if node == "auto" else node,
                owner_lease_s=config.get_seconds("state.owner-lease"),
                idle_exit_s=config.get_seconds("state.idle-exit"),
            ),
            call_timeout_s=config.get_seconds("state.call-timeout"),
            transfer_timeout_s=config.get_seconds("state.transfer-timeout"),
            start_timeout_s=config.get_seconds("state.start-timeout"),
        )


def default_node_id() -> str:
    """This node's name when ``plexrl.state.node-id`` is "auto": SLURM's name for it inside a
    SLURM job (a batch system's node may not be named as its host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass
class _Hold:
    """A pin of the manager that blocks of this process share (:meth:`NodeState.pinned`):
    where the manager said the version is, and how many blocks are reading it."""

    where: dict[str, Any]
    count: int = 0


@dataclass
class Lease:
    """Room reserved on one tier for a write in progress."""

    id: str
    tier: str
    nbytes: int
    store: StateStore
    started: float = 0.0


class NodeState:
    """A connection to the node's StateManager (see the module docstring). Thread-safe."""

    def __init__(self, cfg: StateConfig | None = None) -> None:
        self.cfg = cfg or StateConfig.from_dask_config()
        self.dram_path = Path(self.cfg.manager.dram_path)
        self._sock: socket.socket | None = None
        self._file: Any = None
        self._lock = threading.RLock()
        self._pins: Counter[tuple[str, int]] = Counter()  # the manager's pins this holds
        self._holds: dict[tuple[str, int], _Hold] = {}  # the pins reading blocks share
        self._leases: dict[str, Lease] = {}
        self._stores: dict[str, StateStore] = {}
        self.node_id = self.cfg.manager.node_id
        self.manager_pid: int | None = None
        self.restarts = 0  # managers found dead and replaced while this client used them

    # --- connection and election ----------------------------------------------------------------

    def _connect_once(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.cfg.call_timeout_s)
        try:
            s.connect(socket_name(self.dram_path))
        except (ConnectionRefusedError, FileNotFoundError):
            s.close()
            return False
        self._sock, self._file = s, s.makefile("rb")
        try:
            hello = self._roundtrip({"op": "hello", "pid": os.getpid()}, self.cfg.call_timeout_s)
        except (OSError, ValueError):
            self._close_socket()  # a manager on its way out: not connected
            return False
        self.manager_pid = hello["pid"]
        self.node_id = hello["node"]
        return True

    def _connect(self) -> None:
        """Connect to the node's manager, starting one if none answers."""
        if self._connect_once():
            return
        private_tier_dir(self.dram_path)  # (another user's directory: TierNotPrivate)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        with open(self.dram_path / START_LOCK_FILE, "a+") as start_lock:
            while True:  # one starter per node at a time; others wait, then find it running
                try:
                    fcntl.flock(start_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if self._connect_once():
                        return
                    if time.monotonic() > deadline:
                        raise ManagerUnavailable(
                            f"timed out waiting for another process to start the StateManager of {self.dram_path}"
                        ) from None
                    time.sleep(0.05)
            try:
                proc: subprocess.Popen | None = None
                while not self._connect_once():
                    if proc is not None and proc.poll() is not None:
                        self._raise_start_failure(
                            proc.returncode
                        )  # (returns if it lost the election)
                        proc = None
                    if proc is None and not self._manager_alive():
                        # None running, or the last one has just let go of its lock: start one.
                        proc = self._spawn()
                    if time.monotonic() > deadline:
                        raise ManagerUnavailable(
                            f"the StateManager of {self.dram_path} did not answer within "
                            f"{self.cfg.start_timeout_s:.0f}s (log: {self.dram_path / LOG_FILE})"
                        )
                    time.sleep(0.05)
            finally:
                fcntl.flock(start_lock, fcntl.LOCK_UN)

    def _manager_alive(self) -> bool:
        """Whether a process holds the manager lock (alive, maybe not listening yet)."""
        with open(self.dram_path / LOCK_FILE, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    def _spawn(self) -> subprocess.Popen:
        (self.dram_path / ERROR_FILE).unlink(missing_ok=True)
        logger.info(
            "starting the StateManager of node %s (%s)", self.cfg.manager.node_id, self.dram_path
        )
        with open(self.dram_path / LOG_FILE, "ab") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "plexrl_dask.state_store.manager",
                    "--config",
                    self.cfg.manager.to_json(),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # outlives this process (a worker may come and go)
                close_fds=True,
            )
        # Reap it when it exits (no zombie left in a long-lived worker).
        threading.Thread(target=proc.wait, name="plexrl-manager-reaper", daemon=True).start()
        return proc

    def _raise_start_failure(self, returncode: int) -> None:
        try:
            err = json.loads((self.dram_path / ERROR_FILE).read_text())
        except (FileNotFoundError, ValueError):
            err = None
        if err is not None:
            raise from_status({"error": err["error"], "message": err["message"]})
        if returncode == 0:
            return  # lost the election (or stopped at once): keep waiting, start another
        raise ManagerUnavailable(
            f"the StateManager of {self.dram_path} exited with {returncode} (log: {self.dram_path / LOG_FILE})"
        )

    def _close_socket(self) -> None:
        for f in (self._file, self._sock):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        self._sock = self._file = None

    def close(self) -> None:
        """Disconnect (the manager drops this client's pins and reservations)."""
        with self._lock:
            self._close_socket()
            self._record()

    def _record(self) -> None:
        """Write this process's pins where any manager honours them while this process lives,
        including one started after the death of the manager that knew them (``clients/<pid>``
        in the DRAM directory; a few hundred bytes on shared memory). Open writes need no
        record: they record the objects they use in their staging directory."""
        path = self.dram_path / CLIENTS_DIR / f"{os.getpid()}.json"
        if not self._pins:
            path.unlink(missing_ok=True)
            return
        record = {"pins": [[m, v, n] for (m, v), n in self._pins.items()]}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)

    def _roundtrip(self, msg: dict[str, Any], timeout: float) -> Any:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        self._sock.sendall(json.dumps(msg).encode() + b"\n")
        line = self._file.readline()
        if not line:
            raise ConnectionResetError("the StateManager closed the connection")
        reply = json.loads(line)
        if not reply["ok"]:
            raise from_status({"error": reply["error"], "message": reply["message"]})
        return reply["result"]

    def call(self, op: str, **args: Any) -> Any:
        """One manager call (see :mod:`.manager` for the ops), with its timeout; typed errors
        come back as themselves."""
        timeout = self.cfg.transfer_timeout_s if op in _LONG_OPS else self.cfg.call_timeout_s
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._connect()
                        if self._pins or self._leases:
                            self._restore()
                    return self._roundtrip({"op": op, **args}, timeout)
                except PlexRLError:
                    raise
                except TimeoutError:
                    self._close_socket()  # a late reply would be read as the next call's
                    raise ManagerUnavailable(
                        f"StateManager call {op!r} took longer than {timeout:.0f}s"
                    ) from None
                except (OSError, ValueError) as e:
                    self._close_socket()
                    if attempt:
                        raise ManagerUnavailable(
                            f"StateManager call {op!r} failed twice: {e}"
                        ) from e
                    self.restarts += 1
                    logger.warning(
                        "the StateManager of %s went away (%s): reconnecting", self.dram_path, e
                    )
            raise AssertionError("unreachable")

    def _restore(self) -> None:
        """Register this process's pins and reservations with a new manager."""
        for (model, version), count in list(self._pins.items()):
            for _ in range(count):
                with contextlib.suppress(PlexRLError):
                    self._roundtrip(
                        {"op": "pin", "model": model, "version": version, "promote": False},
                        self.cfg.transfer_timeout_s,
                    )
        for lease in list(self._leases.values()):
            # No bytes (they are written already); the original start, so that objects this
            # write stored before the old manager died stay protected from collection.
            grant = self._roundtrip(
                {"op": "reserve", "nbytes": 0, "tiers": [lease.tier], "started": lease.started},
                self.cfg.transfer_timeout_s,
            )
            lease.id = grant["lease"]

    # --- stores ---------------------------------------------------------------------------------

    def store(self, tier: str) -> StateStore:
        """This process's view of ``tier`` (created by the manager: call after a first call)."""
        with self._lock:
            if tier not in self._stores:
                if self._sock is None:
                    self.call("hello")
                root = (
                    self.dram_path if tier == "dram" else Path(self.cfg.manager.nvme_path)
                ) / STORE_DIR
                # Capacity is the manager's business (reservations), not a per-process count.
                self._stores[tier] = StateStore(root, durable=tier != "dram")
            return self._stores[tier]

    # --- writing ----------------------------------------------------------------------------------

    def reserve(self, nbytes: int, tiers: tuple[str, ...] = ("dram", "nvme")) -> Lease:
        grant = self.call("reserve", nbytes=int(nbytes), tiers=list(tiers))
        lease = Lease(
            grant["lease"], grant["tier"], int(nbytes), self.store(grant["tier"]), grant["started"]
        )
        with self._lock:
            self._leases[lease.id] = lease
        return lease

    def release(
        self, lease: Lease, written: int = 0, published: tuple[str, int] | None = None
    ) -> None:
        with self._lock:
            self._leases.pop(lease.id, None)
        self.call(
            "release",
            lease=lease.id,
            written=int(written),
            published=list(published) if published else None,
        )

    @contextlib.contextmanager
    def writing(
        self,
        model: str,
        version: int,
        nbytes: int,
        tiers: tuple[str, ...] = ("dram", "nvme"),
        publish_id: str = "solo",
    ) -> Iterator[VersionWriter]:
        """A writer for (this process's part of) a publish, with ``nbytes`` reserved on the
        first of ``tiers`` with room; closed and the reservation released on exit. The
        publish becomes visible when someone commits it (:meth:`commit`)."""
        lease = self.reserve(nbytes, tiers)
        written = Tally()
        try:
            with lease.store.writer(model, version, publish_id, counted=written) as w:
                yield w
        finally:
            self.release(lease, written.bytes)

    def commit(
        self,
        tier: str,
        model: str,
        version: int,
        publish_id: str = "solo",
        expected_parts: int | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Commit a publish whose writers have closed, holding a reservation meanwhile
        (assembling partly written chunks stores new objects, which collection must not take
        before the manifest refers to them); the version enters the LRU order."""
        store = self.store(tier)
        fragments = sum(
            p.stat().st_size
            for p in store._staging(model, version, publish_id).glob("fragments/*/*")
        )
        lease = self.reserve(fragments, (tier,))
        written = Tally()
        try:
            return store.commit(
                model,
                version,
                publish_id,
                expected_parts=expected_parts,
                meta=dict(meta or {}),
                counted=written,
            )
        finally:
            self.release(lease, written.bytes, published=(model, version))

    def publish(
        self,
        model: str,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        tiers: tuple[str, ...] = ("dram", "nvme"),
        split_dims: Mapping[str, tuple[int, ...]] | None = None,
    ) -> tuple[str, Manifest]:
        """Publish whole tensors from this process as one version; returns (tier, manifest).
        ``split_dims``: as :meth:`StateStore.publish`'s."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        publish_id = os.urandom(8).hex()
        lease = self.reserve(nbytes, tiers)
        written = Tally()
        try:
            with lease.store.writer(model, version, publish_id, counted=written) as w:
                for name, t in tensors.items():
                    w.write(name, t, split_dims=(split_dims or {}).get(name, ROW_SPLITS))
            manifest = lease.store.commit(
                model,
                version,
                publish_id,
                expected_parts=1,
                meta=dict(meta or {}),
                counted=written,
            )
        finally:
            self.release(lease, written.bytes, published=(model, version))
        return lease.tier, manifest

    # --- reading ----------------------------------------------------------------------------------

    def import_version(
        self,
        manifest: Manifest,
        fetch: Callable[[list[str]], Mapping[str, bytes | memoryview]],
        tiers: tuple[str, ...] = ("dram",),
    ) -> tuple[str, int]:
        """Publish the version ``manifest`` describes on this node (the first of ``tiers``
        with room), fetching only the objects the tier lacks (:meth:`StateStore.import_version`);
        returns (tier, bytes fetched). A version already on one of ``tiers`` is not fetched."""
        for tier in tiers:
            if self.store(tier).has_version(manifest.model, manifest.version):
                return tier, 0
        nbytes = sum(
            int(np.prod(e.chunks, dtype=np.int64)) * np.dtype(DTYPES[e.dtype][1]).itemsize
            for e in manifest.tensors.values()
            for _ in e.chunk_digests
        )
        lease = self.reserve(nbytes, tiers)
        written = Tally()
        fetched = None
        try:
            fetched = lease.store.import_version(manifest, fetch, counted=written)
        finally:
            self.release(
                lease,
                written.bytes,
                published=None if fetched is None else (manifest.model, manifest.version),
            )
        return lease.tier, fetched

    @contextlib.contextmanager
    def pinned(
        self, model: str, version: int, promote: bool = True
    ) -> Iterator[tuple[StateStore, dict[str, Any]]]:
        """The store holding the version, kept there while the block reads it (promoted to
        DRAM first when ``promote`` and it fits). Yields ``(store, {"tier", "source"})``.

        Blocks of this process that read one version at the same time share one pin of the
        manager, released when the last of them ends (a node serving a version to another
        node reads it in several requests at once: each used to pin and unpin it through the
        one connection, one after the other); a block that wants the version promoted while
        the shared pin found it on NVMe pins it anew."""
        key = (model, int(version))
        with self._lock:
            hold = self._holds.get(key)
            if hold is None or (promote and hold.where["tier"] != "dram"):
                where = self.call("pin", model=model, version=int(version), promote=promote)
                hold = self._holds[key] = _Hold(where)
                self._pins[key] += 1
                self._record()
            hold.count += 1
        try:
            yield self.store(hold.where["tier"]), hold.where
        finally:
            with self._lock:
                hold.count -= 1
                last = hold.count == 0
                if last:
                    if self._holds.get(key) is hold:
                        del self._holds[key]
                    self._pins[key] -= 1
                    if self._pins[key] <= 0:
                        del self._pins[key]
                    self._record()
            if last:
                with contextlib.suppress(ManagerUnavailable):
                    self.call("unpin", model=model, version=int(version))

    def read_all(
        self, model: str, version: int, promote: bool = True
    ) -> tuple[dict[str, torch.Tensor], Manifest, str]:
        """Every tensor of the version, its manifest and the tier it was found in."""
        with self.pinned(model, version, promote) as (store, where):
            manifest = store.manifest(model, version)
            # (one read of them all: every chunk on the I/O threads, counted as one read)
            return (
                store.read_many(model, version, dict.fromkeys(manifest.tensors)),
                manifest,
                where["source"],
            )

    # --- the rest of the manager's ops ----------------------------------------------------------

    def locate(self, model: str, version: int) -> str | None:
        return self.call("locate", keys=[[model, int(version)]])[f"{model}/{int(version)}"]

    def prefetch(self, model: str, version: int) -> bool:
        return bool(self.call("prefetch", model=model, version=int(version)))

    def persist(self, model: str, version: int) -> int:
        return int(self.call("persist", model=model, version=int(version)))

    def evict(self, model: str, version: int) -> bool:
        return bool(self.call("evict", model=model, version=int(version)))

    def delete(
        self, model: str, version: int, tiers: tuple[str, ...] = ("dram", "nvme")
    ) -> dict[str, bool]:
        return self.call("delete", model=model, version=int(version), tiers=list(tiers))

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def shutdown(self) -> None:
        """Stop the node's manager (bytes stay; the next call starts a new one)."""
        with self._lock:
            if self._sock is None and not self._connect_once():
                return
            with contextlib.suppress(OSError, ValueError, StateStoreError):
                self._roundtrip({"op": "shutdown"}, self.cfg.call_timeout_s)
            self._close_socket()


_CLIENTS: dict[str, NodeState] = {}
_CLIENTS_LOCK = threading.Lock()


def node_state(cfg: StateConfig | None = None) -> NodeState:
    """This process's :class:`NodeState` for the configured tiers (one per DRAM path)."""
    cfg = cfg or StateConfig.from_dask_config()
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(cfg.manager.dram_path)
        if client is None or client.cfg != cfg:
            client = _CLIENTS[cfg.manager.dram_path] = NodeState(cfg)
        return client
