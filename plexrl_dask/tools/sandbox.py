"""The Python sandbox tool: run a program in a subprocess with limits, return what it printed.

Each call runs the program (at most :attr:`SandboxLimits.code_bytes`) as ``python -s -S -B -P
main.py`` would with string hashing fixed (``PYTHONHASHSEED=0``, the only variable of the
interpreter's environment), in a fresh interpreter started once per call (a jail that sets
it up, whose child runs the program: ``_jail.py``):

- **isolation** (``isolation="namespaces"``, the default where the kernel allows it: Linux, run
  as root or with user namespaces): new network, mount and PID namespaces (``unshare``), so the
  program has no network (a loopback that is down), sees no other process than the jail that
  waits for it, and every process it starts dies with it; empty tmpfs file systems over ``/tmp``, ``/var/tmp`` and ``/dev/shm``; it
  runs as an unprivileged user, in a working directory of its own, so it cannot write outside
  that directory and those private mounts. Each running program has a uid of its own
  (:attr:`SandboxLimits.uid_base` + a slot held with a lock file while it runs, across the
  machine's processes), so one program's processes never count against another's process
  limit: a fork bomb stops at its own. Where namespaces are
  not available (``"limits"``, what :func:`isolation` falls back to): the limits below, an
  empty environment in a temporary directory, and, when run by root, the uid of its own; a
  test says which mode ran.
- **limits**: wall-clock time (the process group is killed), CPU seconds, address space, file
  size, open files, processes; no core files; an empty environment.
- **CPU priority**: the call's processes run at :attr:`SandboxLimits.nice` (10 by default), so
  that on a machine they share with model workers (a node's spare cores, a laptop's
  ``local_cluster``) untrusted programs take the CPU the workers leave, and a worker's decode
  loop, which feeds its accelerator, is not slowed by them. Measured on 2 cores in
  ``bench.agentic`` (``benchmarks/RESULTS.md``).
- **output**: standard output, at most :attr:`SandboxLimits.output_bytes` (the program is
  stopped when it prints more; what came first is kept and marked ``[truncated]``); a program
  that fails gives its last line of standard error as a :class:`~plexrl_dask.errors.ToolError`.

Deterministic for a given program: no network, no environment, a fixed working directory path,
no other process to see, the same string hashes (so the order of a set of strings) in every
call; a program that reads the clock or randomness breaks that, which is the task's to avoid
(the program-output tasks generate programs that do not).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from plexrl_dask.errors import ConfigError, ToolError, ToolLimitExceeded

_JAIL = Path(__file__).with_name("_jail.py")
TRUNCATED = "[truncated]"


@dataclass(frozen=True)
class SandboxLimits:
    """A sandboxed program's limits (see the module docstring)."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
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


@functools.cache
def isolation() -> str:
    """``"namespaces"`` where a program runs in the namespaced sandbox here (checked once, by
    running one: ``unshare`` must make network, mount and PID namespaces, and the unprivileged
    user must be able to run the interpreter), else ``"limits"``."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return "limits"
    try:
        ok = PythonSandbox(mode="namespaces").run("print(6 * 7)") == "42\n"
    except (OSError, ToolError):
        ok = False
    return "namespaces" if ok else "limits"


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
        if c and os.path.exists(c) and _runnable_by_others(os.path.realpath(c)):
            return os.path.realpath(c)
    raise ToolError(f"no Python interpreter that an unprivileged user may run among {candidates}")


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

    def run(self, text: str) -> str:
        mode = self.mode or isolation()
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
                # (the niceness the jail sets for itself first, so that whatever it starts
                # inherits it: set from here, after the start, it raced the jail's fork)
                "nice": min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.limits.nice),
                # (empty: not run by root, so no uid to drop to: in a user namespace its root
                # is the caller, who may not take another uid)
                "uid": self.limits.uid_base + slot if os.geteuid() == 0 else "",
                "private_mounts": int(mode == "namespaces"),
                "workdir": tmp,
            }
            # (the program runs in this interpreter after dropping to the unprivileged user,
            # so it must be one that user may run and whose library that user may read)
            # (not ``-I``, whose ``-E`` would ignore the hash seed: the environment is ours)
            cmd = [interpreter(), "-s", "-S", "-B", "-P", str(_JAIL)]
            cmd += [f"{k}={v}" for k, v in limits.items()]
            if mode == "namespaces":
                prefix = [shutil.which("unshare") or "unshare"]
                if os.geteuid() != 0:
                    prefix += ["--user", "--map-root-user"]
                cmd = [
                    *prefix,
                    *("--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child"),
                    *cmd,
                ]
            return _run(cmd, code, self.limits, tmp)


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


def _run(cmd: list[str], code: bytes, limits: SandboxLimits, cwd: str) -> str:
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env={"PYTHONHASHSEED": "0"},  # (the jail empties it for the program)
        start_new_session=True,  # its own process group: killed as one
    )
    _lower_priority(proc, limits.nice)
    out = _Capped(proc.stdout, limits.output_bytes, proc)
    err = _Capped(proc.stderr, limits.output_bytes, None, tail=True)
    try:
        proc.stdin.write(code)  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.wall_s
    try:
        timed_out = not _exited(proc, limits.wall_s)
    finally:
        _kill(proc)
    out.join(max(0.1, deadline - time.monotonic() + 1.0))
    err.join(1.0)
    if proc.returncode == 125 and b"plexrl-jail:" in err.data:
        raise ToolError(err.data.decode(errors="replace").strip())  # (the jail, not the program)
    if out.truncated:
        return out.data.decode(errors="replace") + TRUNCATED
    if timed_out:
        raise ToolLimitExceeded(f"the program ran past {limits.wall_s:g} s")
    if proc.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # (unshare passes it on)
        raise ToolLimitExceeded(f"the program ran past {limits.cpu_s} s of CPU time")
    if proc.returncode != 0:
        # the exception's line: the last one that is not a traceback's indented frame
        lines = [ln for ln in err.data.decode(errors="replace").splitlines() if ln.strip()]
        top = [ln for ln in lines if not ln.startswith((" ", "\t", "Traceback"))]
        why = (top or lines or [f"exit status {proc.returncode}"])[-1]
        if proc.returncode < 0:
            why = f"killed by signal {-proc.returncode} ({why})"
        raise ToolError(why)
    return out.data.decode(errors="replace")


def _lower_priority(proc: subprocess.Popen, nice: int) -> None:
    """Lower the started call's scheduling group by ``nice``. The jail lowers its own
    process's priority before it starts the program; but its own session is its own
    scheduling group where the kernel groups by session (autogroup, Linux's default on
    desktops and many servers): a process's nice then weighs only within its group, so the
    group's is set as well. The group exists from the start (``setsid`` precedes ``exec``) and
    every process of the session shares it, so setting it after the start misses none."""
    if not nice:
        return
    try:
        with open(f"/proc/{proc.pid}/autogroup", "w") as f:
            f.write(str(min(19, _autogroup_nice() + nice)))
    except OSError:
        pass  # no autogroups here (or it ended): the process's nice is what counts


@functools.cache
def _autogroup_nice() -> int:
    """This process's scheduling group's nice (0 where the kernel has no autogroups); read
    once: what each call's group is set relative to."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` seconds, told the moment it does: through a
    pidfd where the kernel has them (``Popen.wait(timeout)`` polls at doubling intervals,
    which added half a call's time to a short program's)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # (not Linux ≥ 5.3)
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(ready)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the call's process group, whether or not its first process is still running
    (what the program left behind in its group goes too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)
    proc.wait()


class _Capped(threading.Thread):
    """Reads a pipe up to ``cap`` bytes; past it, stops the process (``proc``, if given) and
    marks the data truncated. With ``tail``, reads it all and keeps the last ``cap`` bytes
    (standard error: the exception's line comes last)."""

    def __init__(self, pipe, cap: int, proc: subprocess.Popen | None, tail: bool = False) -> None:
        super().__init__(daemon=True)
        self.pipe, self.cap, self.proc, self.tail = pipe, cap, proc, tail
        self.data = b""
        self.truncated = False
        self.start()

    def run(self) -> None:
        while True:
            chunk = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536)
            if not chunk:
                return
            if self.tail:
                self.data = (self.data + chunk)[-self.cap :]
                continue
            room = self.cap - len(self.data)
            self.data += chunk[:room]
            if len(chunk) > room:
                self.truncated = True
                if self.proc is not None:
                    _kill(self.proc)
                return
