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

**Its decisions** (eviction, promotion, prefetch, collection, pins that outlive a manager)
are :class:`~plexrl_dask.state_store.tiers.TierManager`'s, which this process serves.

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
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from plexrl_dask.errors import (
    PlexRLError,
    StateStoreError,
    TierInUse,
    TierNotPrivate,
)
from plexrl_dask.state_store.tiers import TIERS, TierManager

logger = logging.getLogger(__name__)

LOCK_FILE = "manager.lock"
START_LOCK_FILE = "start.lock"
ERROR_FILE = "manager.error"
LOG_FILE = "manager.log"
OWNER_FILE = "owner.json"


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
