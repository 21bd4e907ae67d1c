"""The node's StateManager for real: spawned manager processes, tiers on /dev/shm and a temp
dir, clients in this process and in other processes (no mocks).

Each test gets its own tiers (a fresh DRAM directory under /dev/shm, the NVMe tier under
``tmp_path``); the ``tiers`` fixture stops every manager it may have started (and kills one
that does not stop) and removes the DRAM directories. A manager start costs ~3 s (it imports
torch), so checks that can share one manager share a test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.shared.records import DeploymentInfo
from plexrl_dask.shared.types import CrossEntropy, Datum
from plexrl_dask.state_store import peer
from plexrl_dask.state_store.keys import Manifest
from plexrl_dask.state_store.manager import (
    LOCK_FILE,
    LOG_FILE,
    OWNER_FILE,
    ManagerConfig,
    socket_name,
)
from plexrl_dask.state_store.node import NodeState, StateConfig
from plexrl_dask.state_store.store import digest_of
from plexrl_dask.worker.backends import BACKENDS, TorchBackend
from plexrl_dask.worker.holder import ReplicaHolder
from tests.test_holder import fb, make_info, spec, step, weights

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # the bound of every wait in this file (generous: the CPUs may be shared)


# --- helpers ----------------------------------------------------------------------------------


def make_tensors(seed: int, nbytes: int = MiB) -> dict[str, torch.Tensor]:
    """One float32 tensor of ``nbytes`` (a single chunk), distinct per seed."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(nbytes // 4, generator=g)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(bits(a), bits(b)), name


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(bits(tensors[name]).numpy().tobytes())
    return h.hexdigest()


def wait_for(predicate, what: str, timeout: float = WAIT_S, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, e.g. a killed manager this process spawned
    and has not reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def managers_of(dram: str) -> list[int]:
    """Live manager processes started for the DRAM tier ``dram``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"plexrl_dask.state_store.manager" in cmdline and any(
            dram.encode() in arg for arg in cmdline
        )
        if ours and running(int(proc.name)):
            found.append(int(proc.name))
    return sorted(found)


def lock_pid(dram: str) -> int | None:
    try:
        text = (Path(dram) / LOCK_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def listening(dram: str) -> bool:
    """Whether the abstract socket of ``dram``'s manager exists."""
    name = "@" + socket_name(dram)[1:]
    with open("/proc/net/unix") as f:
        return any(line.rstrip("\n").endswith(name) for line in f)


def holds_locks(pid: int) -> bool:
    with open("/proc/locks") as f:
        return any(line.split()[4] == str(pid) for line in f if len(line.split()) > 4)


def kill_and_wait(pid: int, dram: str) -> None:
    """SIGKILL a manager and wait until it is gone for good: its process, its socket and its
    lock (a killed process's main thread turns zombie before its other threads have exited
    and its files are closed)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: not running(pid) and not listening(dram) and not holds_locks(pid),
        f"manager {pid} to die",
    )


def tier_versions(status: dict[str, Any], tier: str) -> set[tuple[str, int]]:
    return {(v["model"], v["version"]) for v in status["tiers"][tier]["versions"]}


def object_bytes_on_disk(root: Path) -> int:
    objects = root / "objects"
    return sum(p.stat().st_size for p in objects.glob("*/*") if not p.name.startswith("."))


def make_config(
    dram: str,
    nvme: str,
    *,
    node_id: str = "a",
    dram_capacity: int = 3 * MiB,
    nvme_capacity: int | None = None,
    owner_lease_s: float = 30.0,
    start_timeout_s: float = 60.0,
) -> StateConfig:
    return StateConfig(
        ManagerConfig(
            dram,
            nvme,
            dram_capacity=dram_capacity,
            nvme_capacity=nvme_capacity,
            node_id=node_id,
            owner_lease_s=owner_lease_s,
            idle_exit_s=20.0,
        ),
        call_timeout_s=10,
        transfer_timeout_s=60,
        start_timeout_s=start_timeout_s,
    )


@pytest.fixture(scope="module")
def stopped_managers():
    """Managers told to stop by the tests of this module: they exit in the background (~1 s
    each); at the end of the module any still running is killed."""
    stopped: set[tuple[int, str]] = set()
    yield stopped
    deadline = time.monotonic() + 20
    for pid, dram in stopped:
        while pid in managers_of(dram) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid in managers_of(dram):  # (re-checked: never a recycled pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def tiers(tmp_path, stopped_managers):
    """``tiers(**kw) -> StateConfig`` with a fresh DRAM dir (and, unless ``nvme`` is given,
    NVMe dir); every manager of those tiers is stopped and the DRAM dirs removed after."""
    made: list[StateConfig] = []

    def make(nvme: str | None = None, **kw: Any) -> StateConfig:
        dram = tempfile.mkdtemp(prefix="plexrl-test-dram-", dir="/dev/shm")
        if nvme is None:
            nvme = str(tmp_path / f"nvme-{len(made)}")
        cfg = make_config(dram, nvme, **kw)
        made.append(cfg)
        return cfg

    yield make
    for cfg in made:
        dram = cfg.manager.dram_path
        with contextlib.suppress(Exception):
            NodeState(cfg).shutdown()
        # (a manager that missed the shutdown also stops when its DRAM dir disappears)
        stopped_managers.update((pid, dram) for pid in managers_of(dram))
        shutil.rmtree(dram, ignore_errors=True)


# A client in another process (another worker of the node), driven line by line over stdin.
CLIENT = r"""
import hashlib, json, sys
import torch
from plexrl_dask.state_store.manager import ManagerConfig
from plexrl_dask.state_store.node import NodeState, StateConfig

def make_tensors(seed, nbytes):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(nbytes // 4, generator=g)}

def digest(tensors):
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

args = json.loads(sys.argv[1])
node = NodeState(StateConfig(ManagerConfig(**args["manager"]), **args["timeouts"]))
print(json.dumps({"ok": True, "ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    try:
        if op == "exit":
            node.close()
            print(json.dumps({"ok": True}), flush=True)
            break
        if op == "hello":
            node.call("hello")
            out = {}
        elif op == "publish":
            tier, _ = node.publish(cmd["model"], cmd["version"], make_tensors(cmd["seed"], cmd["nbytes"]))
            out = {"tier": tier}
        elif op == "read":
            tensors, _, source = node.read_all(cmd["model"], cmd["version"])
            out = {"digest": digest(tensors), "source": source}
        elif op == "status":
            out = {"status": node.status()}
        else:
            raise ValueError(op)
        out.update(ok=True, pid=node.manager_pid, restarts=node.restarts)
    except Exception as e:
        out = {"ok": False, "error": type(e).__name__, "message": str(e)}
    print(json.dumps(out), flush=True)
"""


class ClientProcess:
    """A NodeState client in a child process; every answer is awaited with a timeout."""

    def __init__(self, cfg: StateConfig, log: Path) -> None:
        args = {
            "manager": json.loads(cfg.manager.to_json()),
            "timeouts": {
                "call_timeout_s": cfg.call_timeout_s,
                "transfer_timeout_s": cfg.transfer_timeout_s,
                "start_timeout_s": cfg.start_timeout_s,
            },
        }
        self._log = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, json.dumps(args)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def answer(self, timeout: float = WAIT_S) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"client process gave no answer within {timeout:.0f}s") from None

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        out = self.answer()
        assert out["ok"], out
        return out

    def ready(self) -> None:
        assert self.answer()["ready"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.poll() is None:
                self.send(op="exit")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def client_processes(tmp_path):
    started: list[ClientProcess] = []

    def start(cfg: StateConfig) -> ClientProcess:
        c = ClientProcess(cfg, tmp_path / f"client-{len(started)}.log")
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


# --- election ---------------------------------------------------------------------------------


def test_two_processes_starting_at_once_elect_one_manager(tiers, client_processes):
    cfg = tiers()
    dram = cfg.manager.dram_path
    clients = [client_processes(cfg), client_processes(cfg)]
    for c in clients:
        c.ready()  # both imported and constructed: nothing runs yet
    for c in clients:
        c.send(op="hello")  # both find no manager at the same moment
    answers = [c.answer() for c in clients]
    assert all(a["ok"] for a in answers), answers
    pids = {a["pid"] for a in answers}
    assert len(pids) == 1, answers
    (pid,) = pids
    assert lock_pid(dram) == pid  # the lock holder wrote its pid
    assert running(pid)
    assert managers_of(dram) == [pid]  # and no second manager is (still) starting
    log = (Path(dram) / LOG_FILE).read_text()
    assert log.count(f"(pid {pid}) serving") == 1
    assert log.count("serving") == 1, log

    # Both keep using that one manager (each sees the other's data).
    clients[0].ask(op="publish", model="m", version=0, seed=1, nbytes=MiB)
    out = clients[1].ask(op="read", model="m", version=0)
    assert out["digest"] == digest(make_tensors(1)) and out["pid"] == pid
    assert out["restarts"] == 0


# --- eviction, promotion, pins, prefetch ------------------------------------------------------


def test_lru_eviction_promotion_pins_and_prefetch(tiers):
    node = NodeState(tiers(dram_capacity=3 * MiB))
    data = {v: make_tensors(v) for v in range(6)}
    for v in range(4):
        tier, _ = node.publish("m", v, data[v])
        assert tier == "dram"
    s = node.status()
    # The 4th MiB did not fit: the least recently used (v0) went to NVMe.
    assert tier_versions(s, "dram") == {("m", 1), ("m", 2), ("m", 3)}
    assert tier_versions(s, "nvme") == {("m", 0)}
    assert s["counters"]["evictions"] == 1 and s["counters"]["bytes_evicted"] == MiB
    assert s["tiers"]["dram"]["used"] == 3 * MiB <= s["tiers"]["dram"]["capacity"]
    assert s["tiers"]["nvme"]["used"] == MiB
    assert s["tiers"]["dram"]["reserved"] == s["tiers"]["nvme"]["reserved"] == 0
    assert node.locate("m", 0) == "nvme"

    # A read promotes it back (evicting the next LRU, v1), bit for bit.
    got, manifest, source = node.read_all("m", 0)
    assert source == "nvme"
    assert_bit_equal(got, data[0])
    assert manifest.version == 0
    assert node.locate("m", 0) == "dram"
    assert node.locate("m", 1) == "nvme"
    s = node.status()
    assert s["counters"]["promotions"] == 1 and s["counters"]["evictions"] == 2
    assert s["tiers"]["dram"]["used"] <= 3 * MiB
    # v0 stays on NVMe too (promotion copies): NVMe holds v0 and v1.
    assert tier_versions(s, "nvme") == {("m", 0), ("m", 1)}

    # DRAM LRU order now: v2 (oldest), v3, v0. Pinned v2 is skipped: v3 goes instead.
    with node.pinned("m", 2) as (store, where):
        assert where == {"tier": "dram", "source": "dram", "root": str(store.root)}
        pins = {
            (v["model"], v["version"]): v["pins"]
            for v in node.status()["tiers"]["dram"]["versions"]
        }
        assert pins[("m", 2)] == 1
        assert node.publish("m", 4, data[4])[0] == "dram"
        assert node.locate("m", 2) == "dram"
        assert node.locate("m", 3) == "nvme"
        assert_bit_equal({"w": store.read("m", 2, "w")}, data[2])
    # Everything in DRAM pinned: nothing may be evicted, so the publish lands on NVMe.
    with node.pinned("m", 2), node.pinned("m", 0), node.pinned("m", 4):
        evictions = node.status()["counters"]["evictions"]
        assert node.publish("m", 5, data[5])[0] == "nvme"
        s = node.status()
        assert s["counters"]["evictions"] == evictions
        assert tier_versions(s, "dram") == {("m", 0), ("m", 2), ("m", 4)}
    assert all(v["pins"] == 0 for v in node.status()["tiers"]["dram"]["versions"])
    for v in (1, 3, 5):
        assert node.locate("m", v) == "nvme"

    # Prefetch: v1 (NVMe only) becomes DRAM-resident with no read.
    assert node.prefetch("m", 1) is True
    assert node.prefetch("m", 99) is False  # unknown: nothing to do
    wait_for(lambda: node.locate("m", 1) == "dram", "the prefetch of v1 to land in DRAM")
    s = node.status()
    assert s["counters"]["prefetches"] == 1
    assert s["tiers"]["dram"]["used"] <= 3 * MiB
    got, _, source = node.read_all("m", 1)
    assert source == "dram"  # promoted before this read
    assert_bit_equal(got, data[1])
    # Every version, wherever it is now, reads back bit for bit.
    for v in range(6):
        assert_bit_equal(node.read_all("m", v, promote=False)[0], data[v])


# --- a manager killed under its clients ---------------------------------------------------------


def test_blocks_reading_one_version_at_once_share_one_pin(tiers):
    node = NodeState(tiers())
    node.publish("m", 0, make_tensors(11))

    def pins() -> int:
        versions = node.status()["tiers"]["dram"]["versions"]
        return {(v["model"], v["version"]): v["pins"] for v in versions}[("m", 0)]

    with node.pinned("m", 0) as (_, outer):
        with node.pinned("m", 0) as (_, inner):
            assert inner == outer and pins() == 1  # one pin of the manager for both
        # The inner block's end released nothing: the version is still pinned.
        assert pins() == 1
        with pytest.raises(errors.StateStoreError, match="being read"):
            node.delete("m", 0)
    assert pins() == 0
    assert node.delete("m", 0)["dram"]


def test_killed_manager_is_replaced_and_pins_are_registered_again(tiers, client_processes):
    cfg = tiers(dram_capacity=8 * MiB)
    other = client_processes(cfg)  # imports while this process starts the manager
    node = NodeState(cfg)
    mine = make_tensors(7)
    node.publish("mine", 0, mine)
    first = node.manager_pid
    assert first is not None and lock_pid(cfg.manager.dram_path) == first
    other.ready()
    assert other.ask(op="publish", model="theirs", version=0, seed=8, nbytes=MiB)["pid"] == first

    with node.pinned("mine", 0) as (store, where):
        assert where["tier"] == "dram"
        kill_and_wait(first, cfg.manager.dram_path)
        # The next call finds the manager gone, starts a new one, registers the pin again.
        s = node.status()
        second = node.manager_pid
        assert second is not None and second != first
        assert s["pid"] == second and running(second)
        assert node.restarts == 1
        assert lock_pid(cfg.manager.dram_path) == second
        pins = {(v["model"], v["version"]): v["pins"] for v in s["tiers"]["dram"]["versions"]}
        assert pins[("mine", 0)] == 1
        # Bytes are files: nothing was lost.
        assert_bit_equal({"w": store.read("mine", 0, "w")}, mine)
        assert tier_versions(s, "dram") == {("mine", 0), ("theirs", 0)}

    pins = {
        (v["model"], v["version"]): v["pins"] for v in node.status()["tiers"]["dram"]["versions"]
    }
    assert pins[("mine", 0)] == 0
    got, _, source = node.read_all("mine", 0)
    assert source == "dram"
    assert_bit_equal(got, mine)

    # The other process's connection broke too: its next call retries on the new manager.
    out = other.ask(op="read", model="theirs", version=0)
    assert out["digest"] == digest(make_tensors(8))
    assert out["pid"] == second and out["restarts"] == 1
    assert other.ask(op="read", model="mine", version=0)["digest"] == digest(mine)
    assert other.ask(op="publish", model="theirs", version=1, seed=9, nbytes=MiB)["pid"] == second
    assert_bit_equal(node.read_all("theirs", 1)[0], make_tensors(9))
    assert managers_of(cfg.manager.dram_path) == [second]
    assert node.restarts == 1


def test_pins_and_open_writes_are_protected_between_a_restart_and_the_clients_next_call(
    tiers, client_processes
):
    cfg = tiers(dram_capacity=4 * MiB)
    other = client_processes(cfg)
    node = NodeState(cfg)
    pinned_data = make_tensors(20)
    node.publish("m", 0, pinned_data)
    other.ready()
    other.ask(op="hello")
    first = node.manager_pid
    part_a, part_b = make_tensors(21)["w"], make_tensors(22, MiB // 4)["w"]
    problems = []
    with node.pinned("m", 0) as (store, _), node.writing("w", 0, 2 * MiB) as writer:
        writer.write("a", part_a)
        assert first is not None
        kill_and_wait(first, cfg.manager.dram_path)
        # Another worker of the node carries on first: its calls start the next manager, and
        # its publishes need DRAM room.
        for v in range(3):
            other.ask(op="publish", model="c", version=v, seed=30 + v, nbytes=MiB)
        # The pressure was real: with the pinned version and the open write's objects
        # protected, what did not fit went to NVMe.
        nvme = other.ask(op="status")["status"]["tiers"]["nvme"]["versions"]
        assert any(v["model"] == "c" for v in nvme)
        # This client still holds its pin and its lease: neither may have been undone.
        try:
            assert_bit_equal({"w": store.read("m", 0, "w")}, pinned_data)
        except Exception as e:
            problems.append(f"pinned version unreadable: {type(e).__name__}: {e}")
        writer.write("b", part_b)
    tier = "dram" if writer.store.root == node.store("dram").root else "nvme"
    try:
        node.commit(tier, "w", 0, expected_parts=1)
        assert_bit_equal(node.read_all("w", 0)[0], {"a": part_a, "b": part_b})
    except Exception as e:
        problems.append(f"open write lost objects: {type(e).__name__}: {e}")
    assert not problems, problems


# --- two nodes, one NVMe path -------------------------------------------------------------------


def test_second_node_on_the_same_nvme_path_is_refused_until_the_lease_expires(tiers, tmp_path):
    nvme = str(tmp_path / "shared-nvme")
    cfg_a = tiers(nvme=nvme, node_id="a", owner_lease_s=1.0)  # heartbeats every 1/3 s
    # Node b judges a's lease by its own owner_lease_s: a long one first (a refusal that no
    # heartbeat delayed by busy CPUs can turn into a takeover), a short one for the takeover.
    cfg_b = tiers(nvme=nvme, node_id="b", owner_lease_s=30.0)
    cfg_b_short = dataclasses.replace(
        cfg_b, manager=dataclasses.replace(cfg_b.manager, owner_lease_s=1.0)
    )
    a, b = NodeState(cfg_a), NodeState(cfg_b)
    data = make_tensors(40)
    a.publish("m", 0, data)
    assert a.persist("m", 0) == MiB
    pid_a = a.manager_pid

    with pytest.raises(errors.TierInUse) as info:
        b.call("hello")
    assert isinstance(info.value, errors.StateStoreError)
    assert "'a'" in str(info.value) and nvme in str(info.value)
    assert managers_of(cfg_b.manager.dram_path) == []  # b's manager gave up
    # Node a is untouched: same manager, same data, still the NVMe owner.
    assert a.status()["pid"] == pid_a and a.restarts == 0
    assert_bit_equal(a.read_all("m", 0)[0], data)
    assert json.loads((Path(nvme) / OWNER_FILE).read_text())["node"] == "a"
    assert tier_versions(a.status(), "nvme") == {("m", 0)}

    # Node a's manager stops (its heartbeat with it); once the lease expired, b may take over.
    a.shutdown()
    assert pid_a is not None
    wait_for(lambda: not running(pid_a), "node a's manager to stop")
    heartbeat = json.loads((Path(nvme) / OWNER_FILE).read_text())["heartbeat"]
    wait_for(lambda: time.time() > heartbeat + 1.5, "node a's lease to expire")
    b = NodeState(cfg_b_short)
    assert b.call("hello")["node"] == "b"
    assert json.loads((Path(nvme) / OWNER_FILE).read_text())["node"] == "b"
    s = b.status()
    assert tier_versions(s, "nvme") == {("m", 0)} and tier_versions(s, "dram") == set()
    got, _, source = b.read_all("m", 0)
    assert source == "nvme"
    assert_bit_equal(got, data)


# --- tiers full -------------------------------------------------------------------------------


def test_publish_raises_tier_full_and_stored_versions_stay_intact(tiers):
    node = NodeState(tiers(dram_capacity=MiB, nvme_capacity=3 * MiB))
    data = {v: make_tensors(50 + v) for v in range(10)}
    published = []
    with pytest.raises(errors.TierFull) as info:
        for v in range(10):
            node.publish("m", v, data[v])
            published.append(v)
    assert "intact" in str(info.value)
    # 1 MiB in DRAM + 3 MiB on NVMe: four versions, the fifth refused.
    assert published == [0, 1, 2, 3]
    s = node.status()
    assert tier_versions(s, "dram") == {("m", 3)}
    assert tier_versions(s, "nvme") == {("m", 0), ("m", 1), ("m", 2)}
    for tier, cap in (("dram", MiB), ("nvme", 3 * MiB)):
        assert s["tiers"][tier]["used"] <= cap
        assert s["tiers"][tier]["reserved"] == 0
    assert s["leases"] == 0
    assert node.locate("m", 4) is None
    for v in published:
        got, _, source = node.read_all("m", v)
        assert source == ("dram" if v == 3 else "nvme")
        assert_bit_equal(got, data[v])
    # Still refused, still intact (a failed publish leaves nothing behind).
    with pytest.raises(errors.TierFull):
        node.publish("m", 4, data[4])
    assert node.status()["tiers"]["nvme"]["used"] <= 3 * MiB


# --- garbage collection -----------------------------------------------------------------------


def test_collection_spares_open_writes_and_frees_everything_after_delete(tiers):
    cfg = tiers(dram_capacity=5 * MiB)
    node, evictor = NodeState(cfg), NodeState(cfg)  # a writing worker and a busy neighbour
    dram = node.store("dram")
    fillers = {v: make_tensors(100 + v) for v in range(4)}
    for v, t in fillers.items():  # published before the write begins
        assert evictor.publish("filler", v, t)[0] == "dram"
    filler_objects = {
        v: [dram.objects.path(d) for d in dram.manifest("filler", v).digests()] for v in fillers
    }
    parts = {f"t{i}": make_tensors(60 + i, MiB // 4)["w"] for i in range(4)}
    wrote, evicted = threading.Event(), threading.Event()
    failures: list[BaseException] = []
    more = iter(range(1000, 2000))

    def force_evictions() -> None:
        """After each chunk the writer stores, evict one filler: explicitly on even rounds,
        by the pressure of new publishes on odd ones (each eviction collects DRAM)."""
        try:
            for r in range(len(parts)):
                if not wrote.wait(WAIT_S):
                    raise AssertionError("the writer did not write")
                wrote.clear()
                if r % 2 == 0:
                    assert evictor.evict("filler", r) is True
                else:
                    for _ in range(4):
                        v = next(more)
                        evictor.publish("filler", v, make_tensors(v))
                        if evictor.locate("filler", r) != "dram":
                            break
                assert evictor.locate("filler", r) == "nvme"
                evicted.set()
        except BaseException as e:
            failures.append(e)
            evicted.set()

    thread = threading.Thread(target=force_evictions, daemon=True)
    thread.start()
    with node.writing("w", 0, MiB) as w:
        assert w.store.root == dram.root
        for r, (name, t) in enumerate(parts.items()):
            w.write(name, t)
            wrote.set()
            assert evicted.wait(WAIT_S), "the evictions did not happen"
            evicted.clear()
            assert not failures, failures
            # The collect freed the evicted filler's objects (garbage) ...
            assert not any(p.exists() for p in filler_objects[r])
            # ... and none of the open writer's (referenced by no manifest yet).
            assert all(dram.objects.path(d).exists() for d in w.pointers.values())
            assert node.status()["leases"] == 1
        node.call("collect")  # and one explicit collect, for good measure
        assert all(dram.objects.path(d).exists() for d in w.pointers.values())
    thread.join(WAIT_S)
    assert not thread.is_alive() and not failures, failures
    s = node.status()
    assert s["counters"]["evictions"] >= len(parts) and s["leases"] == 0
    node.commit("dram", "w", 0, expected_parts=1)
    got, _, source = node.read_all("w", 0)
    assert source == "dram"
    assert_bit_equal(got, parts)
    for v, t in fillers.items():  # the evicted ones from NVMe
        assert_bit_equal(node.read_all("filler", v, promote=False)[0], t)

    # Delete every version: every tier's used bytes drop to 0 (and the files are gone).
    s = node.status()
    everything = tier_versions(s, "dram") | tier_versions(s, "nvme")
    assert ("w", 0) in everything and len(everything) > len(fillers)
    for model, version in sorted(everything):
        node.delete(model, version)
    s = node.status()
    for tier in ("dram", "nvme"):
        assert s["tiers"][tier]["versions"] == []
        assert s["tiers"][tier]["used"] == 0
        assert s["tiers"][tier]["logical_bytes"] == 0
        assert object_bytes_on_disk(node.store(tier).root) == 0


def test_used_bytes_stay_exact_when_a_collect_ran_during_a_write(tiers):
    node = NodeState(tiers(dram_capacity=3 * MiB))
    dram = node.store("dram")
    data = {v: make_tensors(70 + v) for v in range(3)}
    with node.writing("m", 0, MiB) as w:
        w.write("w", data[0]["w"])
        node.call("collect")  # e.g. another worker's publish evicted something meanwhile
    assert w.store.root == dram.root
    node.commit("dram", "m", 0, expected_parts=1)
    problems = []
    used = node.status()["tiers"]["dram"]["used"]
    if used != object_bytes_on_disk(dram.root):
        problems.append(f"dram used {used} != {object_bytes_on_disk(dram.root)} bytes on disk")
    node.publish("m", 1, data[1])
    node.publish("m", 2, data[2])  # 3 x 1 MiB fit in 3 MiB exactly
    s = node.status()
    if s["counters"].get("evictions", 0):
        problems.append(
            f"{s['counters']['evictions']} needless eviction(s) of {tier_versions(s, 'nvme')}"
        )
    assert not problems, problems


def test_a_publish_drops_older_weights_from_both_tiers(tiers):
    """Published weights older than the version before the newest go from DRAM and from
    NVMe, where eviction moved the ones that waited unused."""
    from plexrl_dask.worker.stores import drop_older

    node = NodeState(tiers(dram_capacity=64 * MiB))
    for v in range(4):
        node.publish("weights.p", v, make_tensors(90 + v))
    for v in (0, 1):
        assert node.evict("weights.p", v) and node.locate("weights.p", v) == "nvme"
    drop_older(node, "weights.p", 3)
    assert [node.locate("weights.p", v) for v in range(4)] == [None, None, "dram", "dram"]


def test_eviction_under_an_open_write_frees_what_it_evicts(tiers):
    node = NodeState(tiers(dram_capacity=4 * MiB))
    data = {v: make_tensors(80 + v) for v in range(4)}
    with node.writing("slow", 0, MiB):  # e.g. a worker's long offload, still in progress
        for v in range(3):  # 3 MiB + the 1 MiB reservation: DRAM is full
            assert node.publish("m", v, data[v])[0] == "dram"
        tier, _ = node.publish("m", 3, data[3])
        s = node.status()
    problems = []
    if tier != "dram":
        problems.append(f"m v3 went to {tier}")
    if s["counters"].get("evictions", 0) != 1:
        problems.append(
            f"{s['counters'].get('evictions', 0)} evictions (DRAM now {tier_versions(s, 'dram')}, "
            f"{s['tiers']['dram']['used']} bytes used) to make room for 1 MiB"
        )
    assert not problems, problems


def test_client_of_a_stopping_manager_starts_the_next_one(tiers):
    cfg = tiers(start_timeout_s=10.0)
    worker, operator = NodeState(cfg), NodeState(cfg)
    worker.publish("m", 0, make_tensors(90))
    first = worker.manager_pid
    operator.call("hello")
    operator.shutdown()  # (or the manager's idle exit, or its crash) while a worker is connected
    got, _, _ = worker.read_all("m", 0)  # its next call finds the manager gone
    assert_bit_equal(got, make_tensors(90))
    assert worker.manager_pid != first


# --- replica holders offloading into the node's store -------------------------------------------


def make_holder(worker: str, node: NodeState | None) -> tuple[ReplicaHolder, list[dict]]:
    events: list[dict] = []
    holder = ReplicaHolder(
        worker,
        "cpu",
        64 * spec().memory_bytes("train"),
        max_batch_size=8,
        report=events.append,
        node=node,
    )
    return holder, events


def forward(holder: ReplicaHolder, info: DeploymentInfo) -> Any:
    return holder.run(info, "forward", lambda b: b.forward([Datum(tokens=(1, 5, 6, 7))]))


def stored_as(holder: ReplicaHolder, name: str) -> tuple[str, int]:
    model, version = holder.status()["replicas"][name]["stored_as"].rsplit("/", 1)
    return model, int(version)


class EngineOwnedHostCopy(TorchBackend):
    """Stands in for the vLLM backend, which needs CUDA: a backend that keeps its own host copy
    when offloaded (``stashes`` False: vLLM's sleep) and has an engine to stop (``close``)."""

    stashes = False

    def close(self) -> None:
        self.closed = getattr(self, "closed", 0) + 1


def test_a_backend_keeping_its_own_host_copy_is_not_stashed_and_is_closed_on_drop(
    tiers, monkeypatch
):
    monkeypatch.setitem(BACKENDS, "vllm", EngineOwnedHostCopy)
    node = NodeState(tiers(dram_capacity=64 * MiB))
    info = dataclasses.replace(make_info("engine", seed=5), role="rollout", backend="vllm")
    holder, events = make_holder("w1", node)
    first = forward(holder, info)
    assert holder.offload("engine")
    assert events[-1]["tier"] == "dram"
    assert holder.status()["replicas"]["engine"]["stored_as"] is None
    assert tier_versions(node.status(), "dram") == set()  # nothing written to the node
    assert holder.counters["stash_writes"] == 0
    assert forward(holder, info) == first  # back from its own copy
    backend = holder._replicas["engine"].backend
    assert holder.drop("engine")
    assert backend.closed == 1


def test_holders_of_one_node_store_one_copy_and_skip_unchanged_rewrites(tiers):
    node = NodeState(tiers(dram_capacity=64 * MiB))
    info = make_info("shared", seed=5)
    h1, ev1 = make_holder("w1", node)
    h2, ev2 = make_holder("w2", node)
    out1, out2 = forward(h1, info), forward(h2, info)
    assert out1.logprobs == out2.logprobs
    nbytes = h1.status()["replicas"]["shared"]["bytes"]
    assert nbytes == h2.status()["replicas"]["shared"]["bytes"] > 0
    assert h1.offload("shared") and h2.offload("shared")
    assert ev1[-1]["tier"] == ev2[-1]["tier"] == "dram"
    (m1, v1), (m2, v2) = stored_as(h1, "shared"), stored_as(h2, "shared")
    assert m1 != m2  # one store model per worker ...
    s = node.status()
    dram = s["tiers"]["dram"]
    assert tier_versions(s, "dram") == {(m1, v1), (m2, v2)}
    assert dram["logical_bytes"] == 2 * nbytes
    # ... but their identical chunks are stored once: about one replica's bytes, not two.
    assert 0 < dram["used"] <= nbytes
    assert dram["dedup_saved_bytes"] >= nbytes
    assert h1.counters["stash_writes"] == h2.counters["stash_writes"] == 1

    # An unchanged replica (forward only) offloaded again reuses its stored version, without
    # copying its state to the host first (on a GPU, a device-to-host copy of every byte).
    forward(h1, info)
    assert h1.status()["replicas"]["shared"]["resident"]
    assert ev1[-1]["tier"] == "hbm"
    backend = h1._replicas["shared"].backend
    copied: list[int] = []
    to_host = backend._to_host
    backend._to_host = lambda t: (copied.append(t.numel()), to_host(t))[1]
    assert h1.offload("shared")
    assert copied == []
    assert h1.counters["stash_writes"] == 1 and h1.counters["offloads"] == 2
    assert stored_as(h1, "shared") == (m1, v1)
    s2 = node.status()
    assert tier_versions(s2, "dram") == {(m1, v1), (m2, v2)}
    assert s2["tiers"]["dram"]["used"] == dram["used"]
    assert forward(h1, info).logprobs == out1.logprobs


def test_a_failed_training_request_never_brings_its_stored_copy_back(tiers):
    """A replica offloaded with pending gradients, reloaded by a training request that fails
    part-way (its gradients dropped, as the refusal says): its next offload writes the state
    as it is, so no later reload brings the dropped gradients back; it trains on as one that
    never had them."""
    node = NodeState(tiers(dram_capacity=64 * MiB))
    info, twin = make_info("trainee", seed=7), make_info("twin", seed=7)
    holder, _ = make_holder("w1", node)

    def fails(backend):
        backend.forward_backward([Datum(tokens=(1, 5, 6, 7))], CrossEntropy())
        raise torch.OutOfMemoryError("CUDA out of memory")

    fb(holder, info, 3)  # pending gradients ...
    assert holder.offload("trainee")  # ... stored with the replica
    with pytest.raises(errors.DeviceOutOfMemory):
        holder.run(info, "forward_backward", fails)  # reloads it, then fails: dropped
    assert holder.offload("trainee") and holder.counters["stash_writes"] == 2
    for i in (info, twin):
        fb(holder, i, 1)  # (reloads the trainee)
        step(holder, i)
    assert_bit_equal(weights(holder, info), weights(holder, twin))


def test_an_offloaded_copy_that_is_gone_rebuilds_a_fresh_replica_and_loses_a_trained_one(tiers):
    """An offloaded copy removed behind the holder's back (a cleaned /dev/shm): a replica
    whose state its spec builds comes back built afresh, a trained one is lost (the job goes
    back to its checkpoint), not stuck failing every request."""
    node = NodeState(tiers(dram_capacity=64 * MiB))
    fresh, trained = make_info("fresh", seed=8), make_info("trained", seed=8)
    holder, _ = make_holder("w1", node)
    first = forward(holder, fresh)
    fb(holder, trained)
    step(holder, trained)
    for name in ("fresh", "trained"):
        assert holder.offload(name)
        node.delete(*stored_as(holder, name))
    assert forward(holder, fresh).logprobs == first.logprobs
    with pytest.raises(errors.DeploymentLost, match="cannot be read back"):
        forward(holder, trained)
    assert holder.names() == ["fresh"]


def test_training_replica_evicted_to_nvme_reloads_and_trains_bit_identically(tiers):
    node = NodeState(tiers(dram_capacity=64 * MiB))
    info = make_info("trainee", seed=6)
    holder, events = make_holder("w1", node)
    reference, _ = make_holder("w1", None)  # never offloads
    losses = {}
    for h in (holder, reference):
        losses[id(h)] = []
        for k in range(3):
            losses[id(h)].append(fb(h, info, k)["loss"])
            step(h, info)
    assert losses[id(holder)] == losses[id(reference)]

    assert holder.offload("trainee")
    model, version = stored_as(holder, "trainee")
    assert node.locate(model, version) == "dram"
    assert node.evict(model, version) is True
    assert node.locate(model, version) == "nvme"
    assert holder.refresh_tiers() == 1  # the move is reported
    assert events[-1]["tier"] == "nvme" and events[-1]["deployment"] == "trainee"

    # Training continues: the reload reads the state from NVMe.
    n_events = len(events)
    for k in range(3, 5):
        assert fb(holder, info, k)["loss"] == fb(reference, info, k)["loss"]
        step(holder, info)
        step(reference, info)
    reloads = [e for e in events[n_events:] if e["tier"] == "hbm" and e.get("source")]
    assert [e["source"] for e in reloads] == ["nvme"]
    assert holder.counters["reloads"] == 1 and holder.counters["stash_writes"] == 1
    ws, wr = weights(holder, info), weights(reference, info)
    assert_bit_equal(ws, wr)
    assert fb(holder, info, 99)["loss"] == fb(reference, info, 99)["loss"]
    status = holder.status()["replicas"]["trainee"]
    assert status["version"] == reference.status()["replicas"]["trainee"]["version"] == 5
    # The stale stored state (superseded by training) is freed.
    wait_for(lambda: node.locate(model, version) is None, "the stale stash to be deleted")


def test_a_node_serves_only_the_versions_it_holds_typed(tiers):
    """The serving side of imports between nodes (state_store.peer): status dicts, typed
    errors, and only the objects of the version asked for."""
    node = NodeState(tiers())
    try:
        node.publish("m", 1, make_tensors(1))
        node.publish("other", 1, make_tensors(2))
        reply = peer.serve_manifest(node, "m", 1)
        assert reply["status"] == "OK"
        manifest = Manifest.from_json(reply["manifest"])
        digests = sorted(manifest.digests())
        got = peer.serve_objects(node, "m", 1, digests)
        assert got["status"] == "OK" and set(got["objects"]) == set(digests)
        assert all(digest_of(b) == d for d, b in got["objects"].items())
        missing = peer.serve_manifest(node, "m", 7)
        assert missing["status"] == "error" and missing["error"] == "VersionNotFound"
        assert peer.serve_manifest(node, "../x", 1)["error"] == "InvalidStateKey"
        theirs = sorted(node.store("dram").manifest("other", 1).digests())
        stray = peer.serve_objects(node, "m", 1, theirs)
        assert stray["status"] == "error" and "has no objects" in stray["message"]
    finally:
        node.close()


@pytest.mark.skipif(os.getuid() != 0, reason="acting as another uid needs root")
def test_the_manager_serves_only_the_user_that_owns_its_tiers(tiers):
    import socket

    cfg = tiers()
    node = NodeState(cfg)
    node.publish("m", 1, make_tensors(1))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # another local user (nobody) on the same node
        code = 3
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(WAIT_S)
            s.connect(socket_name(cfg.manager.dram_path))
            s.sendall(json.dumps({"op": "delete", "model": "m", "version": 1}).encode() + b"\n")
            os.write(write, s.makefile("rb").readline())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        reply = json.loads(f.read() or b"{}")
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reply["ok"] is False and reply["error"] == "PermissionDenied", reply
    # The refusal changed nothing, and the owner is served as before.
    assert NodeState(cfg).store("dram").versions("m") == [1]
    assert node.call("status")["tiers"]["dram"]["used"] > 0


def test_tier_directories_are_their_users_alone(tiers):
    cfg = tiers()
    for path in (cfg.manager.dram_path, cfg.manager.nvme_path):
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o777)  # ours, but open to everyone: closed before use
    node = NodeState(cfg)
    node.publish("m", 1, make_tensors(1))
    for path in (cfg.manager.dram_path, cfg.manager.nvme_path):
        assert os.stat(path).st_mode & 0o777 == 0o700
    if os.getuid() != 0:
        return  # (another user's directory needs root to make)
    other = tiers()
    os.makedirs(other.manager.dram_path, exist_ok=True)
    os.chown(other.manager.dram_path, 65534, 65534)
    os.chmod(other.manager.dram_path, 0o777)
    with pytest.raises(errors.TierNotPrivate, match="uid 65534"):
        NodeState(other).call("status")
    assert os.listdir(other.manager.dram_path) == []  # nothing written into it


def test_a_lora_adapter_offloaded_to_the_node_store_trains_on_bit_identically(tiers):
    """A LoRA replica stashes only its adapter (weights, moments, the optimizer's settings) in
    the node's store, drops its module tree and the base with it, and trains on exactly as a
    replica that never left."""
    pytest.importorskip("peft", reason="LoRA adapters need the peft package")
    node = NodeState(tiers(dram_capacity=64 * MiB))
    lora = spec(seed=7).with_lora(4)
    info = dataclasses.replace(
        make_info("adapter"), spec=lora, memory_bytes=lora.memory_bytes("train")
    )
    holder, events = make_holder("w1", node)
    reference, _ = make_holder("w1", None)  # never offloads
    for h in (holder, reference):
        for k in range(2):
            fb(h, info, k)
            step(h, info)
    assert holder.offload("adapter")
    assert holder.status()["bases"] == {}  # the base left with its last resident adapter
    model, version = stored_as(holder, "adapter")
    stored = node.store("dram").manifest(model, version).tensors
    assert stored and all(".lora_" in k for k in stored)  # the adapter's state, never the base
    for k in range(2, 4):
        assert fb(holder, info, k)["loss"] == fb(reference, info, k)["loss"]
        step(holder, info)
        step(reference, info)
    assert_bit_equal(weights(holder, info), weights(reference, info))
    # its report: its own state plus the whole base (its only user), as the holder counts them
    assert events[-1]["bytes"] == holder.status()["resident_bytes"]


def test_a_publish_keeps_the_version_before_it_for_a_replica_still_to_load_it(tiers):
    """``drop_older`` after publishing version 3 keeps 2 (a rollout replica whose load of 2
    is still queued finds it) and drops 1; it never drops a newer version than it was given
    (a replica that loads late leaves the newer publish alone)."""
    from plexrl_dask.worker.stores import drop_older

    node = NodeState(tiers(dram_capacity=8 * MiB))
    for v in (1, 2, 3):
        node.publish("w", v, make_tensors(v, MiB // 4))
    drop_older(node, "w", 3)
    assert tier_versions(node.status(), "dram") == {("w", 2), ("w", 3)}
    drop_older(node, "w", 2)  # (a late load of 2)
    assert tier_versions(node.status(), "dram") == {("w", 2), ("w", 3)}
    node.publish("w", 4, make_tensors(4, MiB // 4))
    drop_older(node, "w", 4)
    assert tier_versions(node.status(), "dram") == {("w", 3), ("w", 4)}
