"""The Python sandbox tool: run a program in a subprocess with limits, return what it printed.

Each call runs the program (at most :attr:`SandboxLimits.code_bytes`) as ``python -s -S -B -P
main.py`` would with string hashing fixed (``PYTHONHASHSEED=0``, the only variable of the
interpreter's environment), in a process forked for it from this process's *sandbox server*
(``_jail.py``: an interpreter started once per calling process and mode, and again if it
ends): a call costs a fork, not an interpreter's start, which was most of a short program's
call (``bench.sandbox``). Every call is a fork of the same server, so a program finds the
same interpreter in every call, and what a fresh one has (see ``_jail.py``). Linux only.

- **isolation** (``isolation="namespaces"``, the default where the kernel allows it: Linux, run
  as root or with user namespaces): new network, mount and PID namespaces per call (where
  this process is not root, its server runs as root of a user namespace and each call in a
  user namespace of its own, so that no program holds a capability over another), so the
  program has no network (a loopback that is down), sees no other process than the jail that
  waits for it, and every process it starts dies with it; every mount read-only but empty
  tmpfs file systems over ``/tmp``, ``/var/tmp`` and ``/dev/shm``, so it cannot write outside
  those private mounts (not in a directory the machine leaves open to anyone, nor in the
  caller's own files); it runs as an unprivileged user (where the caller is not root: root of
  its user namespace with no capability, so it cannot remount), in a working directory of its
  own. Each running program has a uid of its own
  (:attr:`SandboxLimits.uid_base` + a slot held with a lock file while it runs, across the
  machine's processes), so one program's processes never count against another's process
  limit: a fork bomb stops at its own. Where namespaces are
  not available (``"limits"``, what :func:`isolation` falls back to, and what a call runs
  with unless ``plexrl.tools.sandbox-isolation`` is ``namespaces``: then it refuses; with
  ``auto`` it says so once in the log): the limits below, an
  empty environment in a temporary directory, and, when run by root, the uid of its own; a
  test says which mode ran. There, without Landlock (below), a program may write wherever
  its uid may: a directory open to anyone, and, where the caller is not root, the caller's
  own files.
- **limits**: wall-clock time (the call's processes are killed: its PID namespace, or its
  process group and, run by root, every process of its uid), CPU seconds, address space per
  process, file size, open files, processes; no core files; an empty environment. And, where
  the server may write the machine's memory cgroups (run as root, cgroup v1, or v2 where the
  server's cgroup may enable the memory controller below it: :func:`memory_bounded` says; see
  ``_jail.py``), the memory of all the call's
  processes together (:attr:`SandboxLimits.call_memory_bytes`, a cgroup per call): elsewhere
  a program has at most ``call_memory_bytes // memory_bytes`` processes (2 by default, and,
  where the server is not root, counting every process of its user: it cannot fork), so that
  they cannot together hold more than the call's bound either.
- **system calls** (every mode; x86-64 and AArch64): a seccomp filter refuses the program
  namespaces, the kernel's keyrings, mounts, tracing and a few more (``_confine.DENIED``), so
  that it can neither mount an unbounded tmpfs in a user namespace of its own nor leave a key
  for a later call under the same uid.
- **files and ports** (every mode, where the kernel has Landlock: :func:`files_confined`): it
  reads only the system's and its interpreter's files, writes only its own directory, binds
  and connects no TCP port, and signals no process outside its call, whatever file
  permissions would let its uid do (where the caller is not root, its uid maps to the
  caller's); see ``_confine.py``.
- **CPU priority**: the call's processes run at :attr:`SandboxLimits.nice` (10 by default), so
  that on a machine they share with model workers (a node's spare cores, a laptop's
  ``local_cluster``) untrusted programs take the CPU the workers leave, and a worker's decode
  loop, which feeds its accelerator, is not slowed by them. Measured on 2 cores in
  ``bench.agentic`` (``benchmarks/RESULTS.md``).
- **output**: standard output, at most :attr:`SandboxLimits.output_bytes`: a program that
  prints more is stopped there and its call fails with
  :class:`~plexrl_dask.errors.ToolLimitExceeded` (an output cut short is not the program's
  answer: the episode sees a tool error, as for any other limit); a program that fails gives
  its exception's line (the last whole line of its standard error that is not a traceback's
  frame; else its exit status) as a :class:`~plexrl_dask.errors.ToolError`.

Deterministic for a given program: no network, no environment, a fixed working directory path,
no other process to see, the same string hashes (so the order of a set of strings) in every
call; a program that reads the clock or randomness breaks that, which is the task's to avoid
(the program-output tasks generate programs that do not).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import dask.config

from plexrl_dask.errors import ConfigError, ToolError, ToolLimitExceeded
from plexrl_dask.tools import _confine
from plexrl_dask.tools.calls import CALL_CANCELLED

logger = logging.getLogger(__name__)

_JAIL = Path(__file__).with_name("_jail.py")


@dataclass(frozen=True)
class SandboxLimits:
    """A sandboxed program's limits (see the module docstring)."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20  # (each process's address space)
    call_memory_bytes: int = 2**30  # (all of a call's processes, where cgroups allow)
    file_bytes: int = 2**20
    processes: int = 32
    output_bytes: int = 4096
    code_bytes: int = 64 * 2**10
    uid_base: int = 200_000  # (uids with no account: base .. base + uid_slots - 1)
    uid_slots: int = 1024
    nice: int = 10  # (0-19: the processes' CPU priority, added to the caller's)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"sandbox limit {name} must be a number, got {value!r}")
            if name == "nice":
                if not (isinstance(value, int) and 0 <= value <= 19):
                    raise ConfigError(f"sandbox nice must be an integer 0-19, got {value!r}")
            elif value <= 0:
                raise ConfigError(f"sandbox limit {name} must be a number > 0, got {value!r}")


#: Seconds before a failed probe of the namespaced sandbox is tried again.
PROBE_RETRY_S = 60.0
_probe: dict[str, float | bool] = {"ok": False, "failed_at": -math.inf}


def isolation() -> str:
    """``"namespaces"`` where a program runs in the namespaced sandbox here (checked by
    running one: a call must be able to make network, mount and PID namespaces, as root or
    in the user namespace ``unshare --user`` gives its server, and the unprivileged user must
    be able to run the interpreter), else ``"limits"``. A success holds for the process; a
    failure is tried again after :data:`PROBE_RETRY_S` (a probe that timed out under load, or
    found every uid slot busy, must not leave the process without namespaces for good)."""
    if not sys.platform.startswith("linux"):
        return "limits"
    if os.geteuid() != 0 and shutil.which("unshare") is None:
        return "limits"
    if _probe["ok"]:
        return "namespaces"
    if time.monotonic() - float(_probe["failed_at"]) < PROBE_RETRY_S:
        return "limits"
    try:
        ok = PythonSandbox(mode="namespaces").run("print(6 * 7)") == "42\n"
    except ToolLimitExceeded as e:
        # (the probe ran past its limit: the machine is loaded, which says nothing of the
        # namespaces; the call is refused, never run without them, and the probe tried again)
        raise ToolError(f"the sandbox's probe of its namespaces did not finish ({e})") from e
    except (OSError, ToolError):
        ok = False
    if ok:
        _probe["ok"] = True
    else:
        _probe["failed_at"] = time.monotonic()
    return "namespaces" if ok else "limits"


ISOLATIONS = ("auto", "namespaces", "limits")


def chosen_isolation() -> str:
    """The mode a call of a sandbox with no mode of its own runs in, as
    ``plexrl.tools.sandbox-isolation`` asks (see the module docstring):
    :class:`~plexrl_dask.errors.ToolError` where it asks for namespaces that are not
    available here, :class:`~plexrl_dask.errors.ConfigError` for a setting it does not know."""
    want = dask.config.get("plexrl.tools.sandbox-isolation", "auto")
    if want not in ISOLATIONS:
        raise ConfigError(f"plexrl.tools.sandbox-isolation is one of {ISOLATIONS}, got {want!r}")
    if want == "limits":
        return "limits"
    if isolation() == "namespaces":
        return "namespaces"
    if want == "namespaces":
        raise ToolError(
            "the sandbox's namespaces are not available here (plexrl.tools.sandbox-isolation "
            "is 'namespaces'): no program runs without them"
        )
    _warn_limits_only()
    return "limits"


@functools.cache
def _warn_limits_only() -> None:
    abi = _confine.landlock_abi()  # (what each Landlock version bounds: _confine.py)
    if abi >= 1:
        bounded = [
            "its files",
            *(["TCP ports"] if abi >= 4 else []),
            *(["signals"] if abi >= 6 else []),
        ]
        exposed = (
            f"see the machine's processes and use the network{' but TCP' if abi >= 4 else ''} "
            f"(Landlock {abi} bounds {', '.join(bounded)})"
        )
    else:
        exposed = (
            "use the network, write wherever its user may and, run as the caller's user "
            "(not root), signal the caller's other processes"
        )
    logger.warning(
        "the Python sandbox runs programs with limits alone here: no namespaces (not root, "
        "and no user namespaces), so a program may %s. Set plexrl.tools.sandbox-isolation "
        "to 'namespaces' to refuse, or to 'limits' to say this is meant",
        exposed,
    )


def files_confined() -> bool:
    """Whether a program here reaches only its own directory, the system's and the
    interpreter's files, and no TCP port (Landlock, ``_confine.py``; Linux 5.13 or later with
    Landlock enabled), in either mode. Where not, the rest of the sandbox holds, but a
    program reads whatever its uid may: where the caller is not root, the caller's files."""
    return _confine.landlock_abi() >= 1


@functools.cache
def _warn_files_unconfined() -> None:
    logger.warning(
        "the Python sandbox cannot confine programs to their files here (no Landlock in "
        "this kernel): a program reads whatever its user may read"
    )


@functools.cache
def interpreter() -> str:
    """The interpreter programs run with: the first of this one's real file (a virtual
    environment's ``python`` is a link) and the system's ``python3`` that every user may run
    (every directory on its path searchable by others: a ``pyenv`` under ``/root`` is not).
    ``-S`` needs none of its packages. :class:`~plexrl_dask.errors.ToolError` if none."""
    candidates = [
        sys.executable,
        shutil.which("python3"),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ]
    for c in candidates:
        real = os.path.realpath(c) if c else ""
        if real and os.path.exists(real) and _runnable_by_others(real) and _recent_enough(real):
            return real
    raise ToolError(
        f"no Python interpreter (3.9 or later) that an unprivileged user may run among {candidates}"
    )


def _recent_enough(path: str) -> bool:
    """Whether the interpreter at ``path`` is Python 3.9 or later (the server's needs)."""
    if path == os.path.realpath(sys.executable):
        return sys.version_info >= (3, 9)
    probe = "import sys; sys.exit(sys.version_info < (3, 9))"
    try:
        return subprocess.run([path, "-S", "-c", probe], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _runnable_by_others(path: str) -> bool:
    p = Path(path)
    try:
        if not p.stat().st_mode & 0o001:
            return False
        return all(d.stat().st_mode & 0o001 for d in p.parents)
    except OSError:
        return False


class PythonSandbox:
    """The ``py`` tool (see the module docstring)."""

    name = "py"

    def __init__(self, limits: SandboxLimits = SandboxLimits(), mode: str | None = None) -> None:
        if mode not in (None, "namespaces", "limits"):
            raise ConfigError(f"sandbox mode is 'namespaces' or 'limits', got {mode!r}")
        self.limits = limits
        self.mode = mode

    def run(self, text: str, server: SandboxServer | None = None) -> str:
        """The program's output (see the module docstring). ``server``: run the call on this
        server, not this process's for the mode (a server of the same mode)."""
        if not sys.platform.startswith("linux"):
            raise ToolError(
                "the Python sandbox runs on Linux only (its calls are forks of a server)"
            )
        mode = self.mode or chosen_isolation()
        if not files_confined():
            _warn_files_unconfined()
        code = text.encode()
        if len(code) > self.limits.code_bytes:
            raise ToolLimitExceeded(f"a program has at most {self.limits.code_bytes} bytes")
        with (
            contextlib.ExitStack() as stack,
            tempfile.TemporaryDirectory(prefix="plexrl-sandbox-") as tmp,
        ):
            os.chmod(tmp, 0o711)  # (the unprivileged user enters, lists nothing)
            # (run by root, in either mode, the program drops to a uid slot of its own)
            slot = stack.enter_context(_uid_slot(self.limits)) if os.geteuid() == 0 else 0
            limits = {
                **asdict(self.limits),
                # (the niceness the call sets for itself first, so that whatever it starts
                # inherits it, and its session's scheduling group's: see _jail.py)
                "nice": min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.limits.nice),
                "group_nice": min(19, _autogroup_nice() + self.limits.nice),
                # (None: not run by root, so no uid to drop to: in a user namespace its root
                # is the caller, who may not take another uid)
                "uid": self.limits.uid_base + slot if os.geteuid() == 0 else None,
                "private_mounts": mode == "namespaces",
                # (not root: the server is root of a user namespace; each call gets one more)
                "user_namespace": mode == "namespaces" and os.geteuid() != 0,
                "workdir": tmp,
            }
            return _run(server or _server(mode), limits, code, self.limits)


@contextlib.contextmanager
def _uid_slot(limits: SandboxLimits) -> Iterator[int]:
    """A uid slot no other program on this machine runs under meanwhile: the first of
    ``limits.uid_slots`` whose lock file (in the temp dir) this process could lock."""
    folder = Path(tempfile.gettempdir()) / "plexrl-sandbox-uids"
    folder.mkdir(mode=0o700, exist_ok=True)
    for slot in range(limits.uid_slots):
        fd = os.open(folder / f"{limits.uid_base + slot}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield slot
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return
    raise ToolLimitExceeded(f"all {limits.uid_slots} sandbox uids are in use on this machine")


@functools.cache
def _autogroup_nice() -> int:
    """This process's scheduling group's nice (0 where the kernel shows none); read once:
    what each call's group is set relative to."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


#: Seconds a sandbox server may take to start.
START_S = 30.0
#: Seconds a call that ran past its time may take to end when asked.
END_S = 5.0
#: Seconds a server whose socket was closed may take to end by itself.
STOP_S = 1.0


class SandboxServer:
    """This process's sandbox server for one mode (``_jail.py``): started on first use, and
    again where it ended; every call of the mode is a fork of it. Where the mode is
    ``namespaces`` and this process is not root, the server runs as root of a user namespace
    of its own (``unshare --user``), which lets its calls make the other namespaces."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.lock = threading.RLock()  # (stop() takes it too, inside submit() or not)
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.owner = 0  # (the pid that started it: a forked caller starts its own)
        #: The cgroup its calls' memory cgroups are made in, where it makes them (_jail.py).
        self.memory_cgroup: str | None = None

    def submit(self, limits: dict, fds: list[int]) -> None:
        """Send one call (its limits and its four descriptors: see ``_jail.py``)."""
        message = json.dumps(limits).encode()
        with self.lock:
            for attempt in range(2):
                if not self.running():
                    self._start()
                try:
                    socket.send_fds(self.sock, [message], fds)
                    return
                except OSError as e:
                    self.stop()
                    if attempt:
                        raise ToolError(f"the sandbox server took no call: {e}") from e

    def running(self) -> bool:
        return self.proc is not None and self.owner == os.getpid() and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """The server's CPU seconds and its ended calls' (0 where it is not running here)."""
        if not self.running():
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return sum(int(t) for t in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def _start(self) -> None:
        self.stop()
        try:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as e:
            raise ToolError(f"the sandbox server could not start: {e}") from e
        cmd = [interpreter(), "-s", "-S", "-B", "-P", str(_JAIL), str(theirs.fileno())]
        if self.mode == "namespaces" and os.geteuid() != 0:
            cmd = [shutil.which("unshare") or "unshare", "--user", "--map-root-user", *cmd]
        with theirs, tempfile.TemporaryFile() as log:
            try:
                proc = subprocess.Popen(
                    cmd,
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    cwd="/",
                    env={"PYTHONHASHSEED": "0"},  # (the calls empty it for the programs)
                    start_new_session=True,  # (a signal to the caller's group is not its)
                )
            except OSError as e:
                mine.close()
                raise ToolError(f"the sandbox server could not start: {e}") from e
            mine.settimeout(START_S)  # (sends too: a stuck server is restarted)
            try:
                reply = mine.recv(4096)
            except OSError:
                reply = b""
            ready = reply.split(b" ")[0] == b"ready"
            if not ready:
                proc.kill()
                proc.wait()
                mine.close()
                log.seek(0)
                why = log.read().decode(errors="replace").strip().splitlines()
                raise ToolError(f"the sandbox server did not start: {why[-1:] or proc.returncode}")
        self.proc, self.sock, self.owner = proc, mine, os.getpid()
        memory = reply.split(b" ", 2)[1:]
        self.memory_cgroup = memory[1].decode() if memory[:1] == [b"memory"] else None

    def stop(self) -> None:
        """End the server (its calls in flight end with it: killed, say their callers)."""
        with self.lock:
            if self.sock is not None:
                self.sock.close()  # (the server ends when its socket does)
            if self.proc is not None and self.owner == os.getpid():
                # (a moment to end by itself, removing its calls' memory cgroups, then killed)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STOP_S)
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()
            self.proc = self.sock = None


_servers: dict[str, SandboxServer] = {}
_servers_lock = threading.Lock()


def _server(mode: str) -> SandboxServer:
    with _servers_lock:
        if not _servers:
            atexit.register(lambda: [s.stop() for s in _servers.values()])
        return _servers.setdefault(mode, SandboxServer(mode))


def memory_bounded(mode: str | None = None) -> bool:
    """Whether this process's calls in ``mode`` (default: :func:`isolation`'s) are bounded in
    the memory of all their processes together (:attr:`SandboxLimits.call_memory_bytes`),
    as the mode's server, started if need be, says."""
    server = _server(mode or isolation())
    with server.lock:
        try:
            if not server.running():
                server._start()
        except (OSError, ToolError):
            return False  # (no server here: no call runs, bounded or not)
        return server.memory_cgroup is not None


def sandbox_processes(limits: SandboxLimits) -> list[int]:
    """The pids of this machine's processes that run under ``limits``' uids (those a
    program runs as, when run by root): none once every call has ended."""
    return _processes_of(range(limits.uid_base, limits.uid_base + limits.uid_slots))


def _processes_of(uids: range) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid in uids:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def servers_cpu_seconds() -> float:
    """CPU seconds of this process's running sandbox servers, their ended calls' included
    (a server that ended counts in this process's children's time)."""
    with _servers_lock:
        return sum(s.cpu_seconds() for s in _servers.values())


def _run(server: SandboxServer, call: dict, code: bytes, limits: SandboxLimits) -> str:
    """Run one call on ``server``: the program's output, or the typed error of its end."""
    made: list[int] = []
    try:
        for _ in range(3):
            made.extend(os.pipe())
        status, theirs = socket.socketpair()
    except OSError as e:
        for f in made:  # (a worker short of descriptors must not lose more on every call)
            os.close(f)
        raise ToolError(f"no descriptors left for a sandbox call: {e}") from e
    in_r, in_w, out_r, out_w, err_r, err_w = made
    mine = [in_w, out_r, err_r]  # (closed here, unless handed on)
    proc, returncode = None, None
    try:
        try:
            server.submit(call, [in_r, out_w, err_w, theirs.fileno()])
        finally:
            for f in (in_r, out_w, err_w):
                os.close(f)
            theirs.close()
        proc = _Call(status, server)
        out = _Capped(os.fdopen(mine.pop(1), "rb", 0), limits.output_bytes, proc.kill)
        err = _Capped(os.fdopen(mine.pop(1), "rb", 0), limits.output_bytes, None, tail=True)
        deadline = time.monotonic() + limits.wall_s  # (the program's time, from its start)
        _feed(mine.pop(0), code, deadline)
        returncode = _wait(proc, deadline, CALL_CANCELLED.get())
    finally:
        if proc is not None and returncode is None:
            proc.end()
        for f in mine:
            os.close(f)
        status.close()
        # (a call that did not say it ended did not end what the program left; with no PID
        # namespace to end it, it is ended here, run by root, before the uid is free again)
        unended = proc is not None and not proc.reported and not call["private_mounts"]
        if unended and call["uid"] is not None:
            _kill_uid(call["uid"])
    out.join(max(0.1, deadline - time.monotonic() + 1.0))
    err.join(1.0)
    stop = CALL_CANCELLED.get()
    if returncode is None and stop is not None and stop.is_set():
        raise ToolError("the call was cancelled: its turn's task was given up on")
    if returncode == 125 and b"plexrl-jail:" in err.data:
        raise ToolError(err.data.decode(errors="replace").strip())  # (the jail, not the program)
    if out.truncated:
        raise ToolLimitExceeded(
            f"the program printed more than {limits.output_bytes} bytes (stopped there)"
        )
    if returncode is None:
        raise ToolLimitExceeded(f"the program ran past {limits.wall_s:g} s")
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        raise ToolLimitExceeded(f"the program ran past {limits.cpu_s} s of CPU time")
    if returncode != 0 and proc.out_of_memory:
        raise ToolLimitExceeded(
            f"the program's processes used more than {limits.call_memory_bytes} bytes of "
            "memory together"
        )
    if returncode != 0:
        # the exception's line: the last one that is not a traceback's indented frame (of a
        # tail cut short, not its first line, which the cut began inside of); none: its status
        text = err.data.decode(errors="replace")
        if err.truncated:
            text = text.partition("\n")[2]
        lines = [ln for ln in text.splitlines() if ln.strip()]
        top = [ln for ln in lines if not ln.startswith((" ", "\t", "Traceback"))]
        why = (top or [f"exit status {returncode}"])[-1]
        if returncode < 0:
            why = f"killed by signal {-returncode} ({why})"
        raise ToolError(why)
    return out.data.decode(errors="replace")


def _wait(proc: _Call, deadline: float, stop: threading.Event | None) -> int | None:
    """``proc``'s exit status, or None where it ran to ``deadline`` or ``stop`` was set
    first (looked at every :data:`CANCEL_POLL_S`): the caller then ends it."""
    while True:
        if stop is None:
            return proc.wait(deadline)
        returncode = proc.wait(min(deadline, time.monotonic() + CANCEL_POLL_S))
        if returncode is not None or stop.is_set() or time.monotonic() >= deadline:
            return returncode


#: How often a running call looks whether its task was cancelled.
CANCEL_POLL_S = 0.1


class _Call:
    """A started call, as its status socket tells it (``pid N``, then ``exit N``)."""

    def __init__(self, status: socket.socket, server: SandboxServer) -> None:
        self.status, self.buffer, self.pid, self.reported = status, b"", 0, False
        self.out_of_memory = False  # (the call's memory limit killed one of its processes)
        try:
            line = self._line(time.monotonic() + START_S)
        except TimeoutError:
            server.stop()  # (stuck: the next call starts another)
            raise ToolError(f"the sandbox server did not start the call in {START_S:g} s") from None
        if not line.startswith(b"pid "):
            raise ToolError("the sandbox server did not start the call")
        self.pid = int(line[4:])

    def wait(self, deadline: float) -> int | None:
        """The call's exit status; None if it did not end by ``deadline``; −9 where it ended
        without one (it was killed)."""
        try:
            line = self._line(deadline)
        except TimeoutError:
            return None
        self.reported = line.startswith(b"exit ")
        if not self.reported:
            return -signal.SIGKILL
        words = line.split()
        self.out_of_memory = words[2:] == [b"memory"]
        return int(words[1])

    def kill(self) -> None:
        """Ask the call to end: it kills the jail's process group (the PID namespace's init,
        and so all of it, where there is one) and answers with its status."""
        with contextlib.suppress(OSError):
            self.status.send(b"k")

    def end(self) -> None:
        """End a call that ran past its time: asked, or where it does not answer within
        :data:`END_S`, killed (the call's own group; the jail dies with it). A call that
        ended without answering is not killed: its pid may be another's by now."""
        self.kill()
        try:
            self.reported = self._line(time.monotonic() + END_S).startswith(b"exit ")
        except TimeoutError:  # (there, stuck: it waits for this socket to close)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def _line(self, deadline: float) -> bytes:
        """The next line (b"" once the call's end of the socket is closed)."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.status], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError
            try:
                chunk = self.status.recv(256)
            except OSError:  # (reset: the call died with bytes of ours unread)
                chunk = b""
            if not chunk:
                return b""
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (run by root; no PID namespace ends them with the
    call), before its slot is free for the next call; looked for again until none is left
    (at most a second: what it still forks is killed too, and its process limit bounds it)."""
    for _ in range(100):
        alive = [p for p in _processes_of(range(uid, uid + 1)) if not _zombie(p)]
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # (gone)


def _feed(fd: int, data: bytes, deadline: float) -> None:
    """Write ``data`` to the pipe ``fd`` and close it, by ``deadline`` (what the reader does
    not take by then is dropped: the call then runs past its time and is stopped)."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    try:
        while view:
            left = deadline - time.monotonic()
            _, ready, _ = select.select([], [fd], [], max(0.0, left))
            if not ready:
                return
            view = view[os.write(fd, view[:65536]) :]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


class _Capped(threading.Thread):
    """Reads a pipe up to ``cap`` bytes; past it, stops the call (``kill``, if given) and
    marks the data truncated. With ``tail``, reads it all and keeps the last ``cap`` bytes
    (standard error: the exception's line comes last)."""

    def __init__(self, pipe, cap: int, kill: Callable[[], None] | None, tail: bool = False) -> None:
        super().__init__(daemon=True)
        self.pipe, self.cap, self.kill, self.tail = pipe, cap, kill, tail
        self.data = b""
        self.truncated = False
        self.start()

    def run(self) -> None:
        with self.pipe:
            self._read()

    def _read(self) -> None:
        while True:
            chunk = self.pipe.read(65536)
            if not chunk:
                return
            if self.tail:
                joined = self.data + chunk
                self.truncated = self.truncated or len(joined) > self.cap
                self.data = joined[-self.cap :]
                continue
            room = self.cap - len(self.data)
            self.data += chunk[:room]
            if len(chunk) > room:
                self.truncated = True
                if self.kill is not None:
                    self.kill()
                return
