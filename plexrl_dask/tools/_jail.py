"""The sandbox's server: run as ``python -s -S -B -P _jail.py FD`` (standard library only) by
:mod:`plexrl_dask.tools.sandbox`, once per calling process and mode, it serves that process's
calls for as long as it lives; the interpreter starts once, not once per call (a fresh
interpreter's start was most of a short program's call).

It reads calls from the ``SOCK_SEQPACKET`` socket ``FD``: each a JSON message of the call's
limits with four descriptors (the program's standard input, output and error, and a stream
socket the call's status goes back on), and forks a *call* process for each: it starts a
session of its own (the caller kills the call as a process group), sends ``pid N``, sets the
session's and its own CPU priority, reads the program from standard input and, where the call
asks for private mounts, enters new mount, PID and network namespaces (the server runs as root,
or as root of a user namespace ``unshare --user`` started it in). Its child, the *jail*, is
that PID namespace's init: it makes every mount read-only, mounts empty tmpfs file systems
over the usual world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``) and a
``/proc`` of the namespace, makes the working directory, owned by the unprivileged user, and
forks the program's process, which sets the resource limits, drops to that user (when the jail
is root; else, root of the call's user namespace, it drops every capability), clears the
environment, confines it further (``_confine.py``: a system-call filter, and Landlock's
bounds on the files and ports it reaches; in every mode) and runs the program as ``__main__``
of this interpreter.
The jail waits for it (reaping what it leaves) and exits with its status (128 + the signal
that killed it). The call sends ``exit N`` (N < 0: the jail was killed by signal -N) and
stays until the caller closes its end of the status socket, so that its process group is
there for the caller to kill. Exit status 125 and a
message on standard error: the call could not be set up (not the program's failure).

The program ends as ``python main.py`` would: its non-daemon threads joined, its exit functions
run, its module's objects released, its output flushed, an uncaught exception's traceback (the
program's frames only) on standard error and status 1. It starts from a fork of this server
whose ``sys.modules`` holds only what a fresh interpreter's does (what the server imported to
serve is imported afresh if the program imports it); a fork of the same server for every call,
so a program sees the same interpreter in every call. (It can tell: the frames below its own
are the server's.)

Where the caller is not root, every call makes a user namespace of its own too (nested in the
server's), so that no program, root in its namespaces, holds a capability over the server or
another call's processes.

Where the server may write the machine's memory cgroup tree (run as root: by root, or in a
user namespace the tree was delegated to; cgroup v1, or v2 where the server's own cgroup may
enable the memory controller below it, which v2 allows only the machine's root cgroup while
processes live in it), it makes a cgroup of its own for its calls
(``plexrl-sandbox-<pid>``, in its own memory cgroup; its ``ready`` says ``memory PATH``), and every
call a cgroup in that with the call's ``call_memory_bytes`` as its memory limit: the jail moves
itself there first, so the program and whatever it forks share one bound (the per-process
address-space limit alone let 32 processes take 32 times it). Where that bound killed one of
them, the call's status says so (``exit N memory``). The call removes its cgroup when it ends
(one a killed call leaves is removed by the next server that starts in the same cgroup). A
program never holds a right to its cgroup's files: it runs as another uid than root, or in
mounts made read-only; a server that is not root makes none (its programs would share its uid).
Where a call has no such cgroup, its program may have at most ``call_memory_bytes //
memory_bytes`` processes (2 by default; where the server is not root this counts every
process of its user, so the program cannot fork at all), so that they cannot together hold
more than the call's bound either.
"""

from __future__ import annotations

import sys

#: What a fresh ``python -s -S -B -P`` has imported (a program starts from these alone).
_FRESH_MODULES = frozenset(sys.modules) - {"__future__"}

import atexit  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402

#: The limits given as integers (the rest: ``uid`` an integer or None, ``private_mounts`` a
#: bool, ``workdir`` a path).
INTEGERS = (
    "cpu_s",
    "memory_bytes",
    "call_memory_bytes",
    "file_bytes",
    "processes",
    "code_bytes",
    "nice",
    "group_nice",
)
#: Per cgroup version: a call's memory limit file, and the file whose ``oom_kill`` line counts
#: the processes the limit killed.
_CGROUP_FILES = {
    1: ("memory.limit_in_bytes", "memory.oom_control"),
    2: ("memory.max", "memory.events"),
}
_CGROUP_PREFIX = "plexrl-sandbox-"
_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
_CLONE_NEWUSER = 0x10000000
# SysV IPC (shared memory a program could leave for the next call, unbounded by its memory
# limit) and the host name (what gethostname() answers: the same on every machine)
_CLONE_NEWIPC, _CLONE_NEWUTS = 0x08000000, 0x04000000
#: The host name a program sees (in its own UTS namespace).
HOSTNAME = b"sandbox"
#: personality(2)'s ADDR_NO_RANDOMIZE: a program's addresses (its id()s, its objects' default
#: reprs) the same in every call on every machine.
_ADDR_NO_RANDOMIZE = 0x0040000
#: The directories a call's own mounts put a private tmpfs on.
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")
#: Files a private tmpfs may hold (empty files cost kernel memory that no limit counts).
TMPFS_INODES = 4096
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_RDONLY, _MS_REMOUNT, _MS_BIND = 0x1, 0x20, 0x1000
#: A mount's flags that a read-only remount must keep (in a user namespace the machine's
#: mounts are locked to them: a remount that drops one is refused).
_KEPT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": 0x400,
    "nodiratime": 0x800,
    "relatime": 0x200000,
    "strictatime": 0x1000000,
}
#: ``mount_setattr`` (Linux >= 5.12; the same number in every architecture's table).
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_PR_SET_NO_NEW_PRIVS = 38
#: Seconds a call waits for its caller to close the status socket once it has sent the status.
_LINGER_S = 60.0
_libc = ctypes.CDLL(None, use_errno=True)


def _sibling(name: str):
    """The module ``name``.py beside this file (run as a script, it has no package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(f"plexrl_jail_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_confine = _sibling("_confine")


def serve(fd: int) -> None:
    """Serve calls from socket ``fd`` until the caller closes it (see the module docstring)."""
    server = socket.socket(fileno=fd)
    # (orphans of a call come back to this process, which reaps them: their CPU time counts)
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:  # (a call mounts only in a mount namespace other than this one)
        own_mounts = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        own_mounts = None  # (nor then: no way to tell)
    # (ended calls and orphans are reaped at once: their CPU time counts from then on)
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    groups = memory_groups()
    # (what exists now is left alone by the collections of a call's program, which would
    # otherwise copy every page the server's objects are on)
    gc.freeze()
    server.send(b"ready" + (f" memory {groups[1]}".encode() if groups else b""))
    try:
        _serve_calls(server, own_mounts, groups)
    finally:
        if groups is not None:  # (a server that is killed leaves them to the next one)
            _remove_tree(groups[1])


def _serve_calls(server: socket.socket, own_mounts: int | None, groups: tuple | None) -> None:
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(server, 1 << 16, 4)
        except OSError:
            return
        if not message:
            return  # (the caller closed its end)
        try:
            _fork_into(call, server, json.loads(message), fds, own_mounts, groups)
        except OSError as e:
            _refuse(fds, f"forking the call: {e}")
            continue
        for f in fds:
            os.close(f)


def _fork_into(body, *args) -> int:
    """Fork a child that runs ``body(*args)``, which ends the process (125 if it returns or
    raises); return the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        body(*args)
    finally:
        os._exit(125)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _refuse(fds: list, message: str) -> None:
    """Answer a call the server could not start (a caller that went away hears nothing)."""
    with contextlib.suppress(OSError):
        if len(fds) == 4:
            os.write(fds[2], f"plexrl-jail: {message}\n".encode())
            with socket.socket(fileno=os.dup(fds[3])) as status:
                status.sendall(b"exit 125\n")
    for f in fds:
        os.close(f)


def call(
    server: socket.socket,
    limits: dict,
    fds: list,
    own_mounts: int | None,
    groups: tuple[int, str] | None,
) -> None:
    """The call process (see the module docstring); never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (it waits for its own child)
    server.close()
    for i, f in enumerate(fds[:3]):
        os.dup2(f, i)
    # (a bare descriptor, no socket object: the jail closes it, and nothing of the program's
    # interpreter may hold it, lest a program write a status of its own)
    status = os.dup(fds[3])
    for f in fds:
        os.close(f)
    os.closerange(3, status)
    os.closerange(status + 1, 1 << 16)
    os.setsid()
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (no call outlives its server)
    # (what the program leaves in a group or session of its own, past the jail's group kill,
    # comes back here when orphaned, and is ended with the call: _end_strays)
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for key in INTEGERS:
        limits[key] = int(limits[key])
    group, killed = None, False
    try:
        os.write(status, f"pid {os.getpid()}\n".encode())
        _lower_priority(limits["group_nice"], limits["nice"])
        code = sys.stdin.buffer.read(limits["code_bytes"] + 1)
        if len(code) > limits["code_bytes"]:
            fail(f"a program has at most {limits['code_bytes']} bytes")
        # (made, and its parent opened, in the server's mount namespace: in the call's, which
        # the jail makes read-only, the cgroup could not be removed)
        group = _call_group(groups, limits["call_memory_bytes"])
        if group is None:  # (no bound on its processes together: so few that they fit it)
            within = max(1, limits["call_memory_bytes"] // limits["memory_bytes"])
            limits["processes"] = min(limits["processes"], within)
        if limits["private_mounts"]:
            _enter_namespaces(limits["user_namespace"])
        jail = _fork_into(run_jail, limits, code, own_mounts, None if group is None else group[0])
        code_of = _wait(jail, status)
        if not limits["private_mounts"]:  # (in a PID namespace, all ended with the jail)
            _end_strays()
        if not limits["private_mounts"] and limits["uid"] is not None and os.geteuid() == 0:
            # (no PID namespace to end with the jail: what the program started and left in a
            # session of its own would keep the uid the next call may get)
            os.waitpid(_fork_into(_kill_all_of, limits["uid"]), 0)
    except SystemExit as e:  # (``fail``)
        code_of = e.code
    except BrokenPipeError:
        code_of = None  # (the caller went away: nothing to tell)
    except Exception as e:  # (a fault of the call's own: the caller hears of it as such)
        with contextlib.suppress(OSError):
            os.write(2, f"plexrl-jail: the call failed: {e!r}\n".encode())
        code_of = 125
    finally:
        if group is not None:
            killed = _release_group(groups[0], *group)
    if code_of is None:
        os._exit(125)
    try:
        os.write(status, f"exit {code_of}{' memory' if killed else ''}\n".encode())
        _linger(status)
    finally:
        os._exit(0)


def _end_strays() -> None:
    """Kill what the call's program left running of its own, once the jail has ended: a
    process that made itself a group or session of its own escaped the jail's group kill
    (no PID namespace to end with the jail, in "limits" mode); orphaned, it came back to this
    call process, their subreaper. Each round kills the children there are; theirs come back
    for the next."""
    for _ in range(64):
        strays = _children()
        if not strays:
            return
        for pid in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in strays:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _children() -> list[int]:
    """This process's children: the kernel's list of them where it keeps one (this process
    is single-threaded), else every process whose parent it is."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        pass  # (a kernel without CONFIG_PROC_CHILDREN: look at every process)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # (it ended meanwhile)
        if parent == me:
            found.append(int(entry))
    return found


def _linger(status: int) -> None:
    """Stay (this process group there for the caller to kill) until the caller closes the
    status socket, at most :data:`_LINGER_S`; what it sent meanwhile is read and dropped."""
    end = time.monotonic() + _LINGER_S
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([status], [], [], left)
        if ready and not os.read(status, 256):
            return


def _enter_namespaces(own_user: bool) -> None:
    """New mount, PID and network namespaces for the call (and a user namespace of its own
    when ``own_user``: its root is this process's uid in the server's); the mounts made
    private before any is made."""
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    flags |= _CLONE_NEWUSER if own_user else 0
    if _libc.unshare(flags):
        fail(f"entering new namespaces: errno {ctypes.get_errno()}")
    if own_user:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"0 {uid} 1"),
            ("gid_map", f"0 {gid} 1"),
        ):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError as e:
                fail(f"mapping the call's user namespace ({name}): {e}")
    # (before any mount: the copied mounts must not pass new ones back to the machine's)
    if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None):
        fail(f"making the mounts private: errno {ctypes.get_errno()}")
    if _libc.sethostname(HOSTNAME, len(HOSTNAME)):
        fail(f"naming the call's host: errno {ctypes.get_errno()}")


def _kill_all_of(uid: int) -> None:
    os.setresuid(uid, uid, uid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)  # (every process this uid may signal: its own, not this)
    os._exit(0)


def _lower_priority(group_nice: int, nice: int) -> None:
    """The session's scheduling group (where the kernel groups by session: a process's nice
    then weighs only within its group) and this process's, whatever it starts inheriting it."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(group_nice))
    except OSError:
        pass  # (no autogroups here: the process's nice is what counts)
    if nice > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def _wait(jail: int, status: int) -> int:
    """The jail's exit status (−N: killed by signal N), once it has ended, or once the caller
    asked for the end (a byte on the status socket, or its end closed): then the jail is
    killed. Either way its process group goes (what the program left in it)."""
    with contextlib.suppress(OSError):  # (the jail does it too: whichever runs first)
        os.setpgid(jail, jail)
    try:
        handle = [os.pidfd_open(jail)]
    except (AttributeError, OSError):  # (not Linux >= 5.3: look every 50 ms)
        handle = []
    # (not reaped yet: an ended jail's group is still there to kill)
    while not _ended(jail):
        ready, _, _ = select.select([status, *handle], [], [], None if handle else 0.05)
        if status in ready:
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(jail, signal.SIGKILL)
    _, code = os.waitpid(jail, 0)
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _ended(pid: int) -> bool:
    """Whether child ``pid`` has ended, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except OSError:  # (a kernel without ``WNOWAIT``: the zombie's state says it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def run_jail(limits: dict, code: bytes, own_mounts: int | None, group: str | None) -> None:
    """The jail: the namespace's init where there is one (see the module docstring)."""
    os.closerange(3, 1 << 16)  # (the call's status: not the program's to write)
    os.setpgid(0, 0)  # (its own group, which the call kills; the call's own is the caller's)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if group is not None:  # (first: before it allocates, and before the mounts are read-only)
        try:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write("0")  # (this process: its pid here is not the tree's in a PID namespace)
        except OSError as e:
            fail(f"entering the call's memory cgroup: {e}")
    uid = gid = limits["uid"]
    root = uid is not None and os.geteuid() == 0  # (drop to ``uid``)
    if limits["private_mounts"]:
        if own_mounts is None or os.stat("/proc/self/ns/mnt").st_ino == own_mounts:
            fail("not in a mount namespace of its own")  # (never mount over the machine's)
        read_only_mounts()
        for target in PRIVATE_TMP:
            if os.path.isdir(target):
                size = f"size={limits['file_bytes'] * 4},nr_inodes={TMPFS_INODES},mode=1777"
                mount(b"none", target, b"tmpfs", 0, size)
        # The machine's sockets live under /run (a user's bus and systemd, docker's): a
        # read-only mount does not stop a connect(), an empty one over it does.
        flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        for target in ("/run", "/var/run"):
            if os.path.isdir(target) and not os.path.islink(target):
                mount(b"none", target, b"tmpfs", flags, "size=64k,mode=0755")
        mount(b"proc", "/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "")
    base = "/tmp" if limits["private_mounts"] else limits["workdir"]
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    with open(os.path.join(work, "main.py"), "wb") as f:  # (for the traceback's lines)
        f.write(code)
    if root:
        os.chown(work, uid, gid)
        os.chown(os.path.join(work, "main.py"), uid, gid)
    os.chdir(work)
    pid = os.fork()
    if pid == 0:
        try:
            confine(limits, root, uid)
        except BaseException as e:
            fail(f"confining the program: {e!r}")
        run_program(code)  # (never returns)
    while True:  # (a program's orphans come here, this being its namespace's init)
        done, status, usage = os.wait4(-1, 0)
        if done == pid:
            break
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= limits["cpu_s"]:
            # (it ignored SIGXCPU at its soft CPU limit, and the hard one killed it: the
            # CPU limit, not an unknown kill, ended it)
            signum = signal.SIGXCPU
        os._exit(128 + signum)
    os._exit(os.WEXITSTATUS(status))


def confine(limits: dict, root: bool, uid: int) -> None:
    """In the jail's child: the limits, the unprivileged user, an empty environment."""
    # (SIGXCPU at the soft limit, which ends the interpreter; SIGKILL a second later)
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if root:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif limits["processes"]:
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        cap = (
            limits["processes"]
            if hard == resource.RLIM_INFINITY
            else min(hard, limits["processes"])
        )
        resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    if os.geteuid() == 0:  # (root of the call's user namespace: the caller is not root)
        _confine.drop_capabilities()
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # (nothing it executes gains privileges)
    # (after the privileges: both need no-new-privileges; see _confine.py)
    private = limits["private_mounts"]
    writable = [os.getcwd(), *(PRIVATE_TMP if private else ())]
    _confine.restrict_files(writable, private_proc=private)
    _confine.filter_syscalls()
    # (last: a change of uid clears it) the program ends with its jail, wherever it went
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.environ.clear()


def memory_groups() -> tuple[int, str] | None:
    """(cgroup version, directory) of the cgroup this server makes its calls' memory cgroups
    in, made now in its own memory cgroup (after removing those of servers that have ended);
    None where it cannot or may not: not root (its programs, of its uid, could raise their own
    limits), no memory controller, one it may not write, or, in cgroup v2, one it may not
    enable below its own cgroup."""
    if os.geteuid() != 0:
        return None
    try:
        found = _own_memory_cgroup()
    except (OSError, ValueError, IndexError):  # (an unreadable or unexpected /proc)
        return None
    if found is None:
        return None
    version, parent = found
    _remove_ended(parent)
    base = os.path.join(parent, f"{_CGROUP_PREFIX}{os.getpid()}")
    try:
        os.mkdir(base)
    except OSError:
        return None
    try:
        if version == 2:
            with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        return version, base
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(base)
        return None


def _own_memory_cgroup() -> tuple[int, str] | None:
    """(cgroup version, directory) of this process's memory cgroup, where a mount of its
    hierarchy shows it; None where none does."""
    with open("/proc/self/cgroup") as f, open("/proc/self/mountinfo") as g:
        return memory_cgroup_of(f.read(), g.read())


def memory_cgroup_of(cgroups: str, mountinfo: str) -> tuple[int, str] | None:
    """:func:`_own_memory_cgroup` of a process whose ``/proc/PID/cgroup`` and
    ``/proc/PID/mountinfo`` read ``cgroups`` and ``mountinfo``: v1's memory hierarchy where
    there is one, else v2's; the directory under the first mount of that hierarchy whose root
    holds the process's cgroup (a container's mount shows a subtree)."""
    lines = [ln.split(":", 2) for ln in cgroups.splitlines() if ln.count(":") >= 2]
    mounts = [ln.split() for ln in mountinfo.splitlines()]
    v1 = [p for _, controllers, p in lines if "memory" in controllers.split(",")]
    version, own = (1, v1[0]) if v1 else (2, next((p for h, _, p in lines if h == "0"), None))
    if own is None:
        return None
    for m in mounts:
        if "-" not in m:
            continue
        kind, options = m[m.index("-") + 1], m[-1].split(",")
        if kind != ("cgroup" if version == 1 else "cgroup2"):
            continue
        if version == 1 and "memory" not in options:
            continue
        root, point = _unescape(m[3]), _unescape(m[4])
        if own == root or own.startswith(root.rstrip("/") + "/"):
            below = own[len(root) :].strip("/")
            return version, os.path.join(point, below) if below else point
    return None


def _unescape(field: str) -> str:
    """A path of ``/proc/self/mountinfo`` (spaces and the like written as octal escapes)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _remove_ended(parent: str) -> None:
    """Remove the call cgroups of servers that ended (a killed server removes nothing)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            pid = entry.name.removeprefix(_CGROUP_PREFIX)
            if entry.name.startswith(_CGROUP_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                _remove_tree(entry.path)


def _remove_tree(path: str) -> None:
    """Remove the cgroup ``path`` and its calls' (those whose processes have all gone)."""
    with contextlib.suppress(OSError):
        for child in os.scandir(path):
            if child.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.rmdir(child.path)
        os.rmdir(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _call_group(groups: tuple[int, str] | None, limit: int) -> tuple[str, int] | None:
    """A memory cgroup for this call (see the module docstring), ``limit`` bytes, and a
    descriptor of the directory it is in (to remove it by, whatever the call's mounts have
    become); None where the server has none to make it in."""
    if groups is None:
        return None
    version, base = groups
    # (a name no call had: one a killed call left, under a pid used again, is not reused)
    path = os.path.join(base, f"call-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(path)
    except OSError as e:
        fail(f"making the call's memory cgroup: {e}")
    try:
        with open(os.path.join(path, _CGROUP_FILES[version][0]), "w") as f:
            f.write(str(limit))
        swap = os.path.join(path, "memory.memsw.limit_in_bytes")  # (v1 with swap accounting)
        if version == 1 and os.path.exists(swap):
            with open(swap, "w") as f:
                f.write(str(limit))  # (memory and swap together: no more than memory alone)
        if version == 2:  # (its bound is memory, not memory and swap)
            with (
                contextlib.suppress(OSError),
                open(os.path.join(path, "memory.swap.max"), "w") as f,
            ):
                f.write("0")
        return path, os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        fail(f"limiting the call's memory cgroup: {e}")


def _release_group(version: int, path: str, base: int) -> bool:
    """Whether the limit of the call's cgroup ``path`` killed one of its processes; the
    cgroup removed (through ``base``, its parent's descriptor) once its processes have gone
    (at most a second: killed, they go at once)."""
    killed = False
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open(os.path.join(path, _CGROUP_FILES[version][1])) as f,
    ):
        killed = any(ln.split()[:1] == ["oom_kill"] and int(ln.split()[1]) > 0 for ln in f)
    try:
        for _ in range(100):
            try:
                os.rmdir(os.path.basename(path), dir_fd=base)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
    finally:
        os.close(base)
    return killed


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clear", "propagation", "userns")]


def read_only_mounts() -> None:
    """Every mount of the call's mount namespace read-only (before the private ones are
    made over it): a program writes only in those, whatever the machine leaves writable to
    its uid (``/run/lock``, a world-writable directory anywhere, the caller's own files
    where the caller is not root). ``mount_setattr`` does it at once; a kernel without it
    gets each mount remounted read-only, from ``/proc/self/mountinfo``."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    done = _libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        b"/",
        ctypes.c_uint(_AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if done == 0:
        return
    errno = ctypes.get_errno()
    if errno not in (38, 22, 1):  # (ENOSYS, EINVAL, EPERM: try mount by mount)
        fail(f"making the file system read-only: errno {errno}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4]
        for escaped, char in ((r"\040", " "), (r"\011", "\t"), (r"\012", "\n"), (r"\134", "\\")):
            point = point.replace(escaped, char)  # (the kernel escapes these in a path)
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY
        flags |= sum(_KEPT_FLAGS.get(o, 0) for o in fields[5].split(","))
        if _libc.mount(None, point.encode(), None, flags, None):
            errno = ctypes.get_errno()
            if errno != 2:  # (ENOENT: a mount point hidden by another mount; unreachable)
                fail(f"making {point} read-only: errno {errno}")


def run_program(code: bytes) -> None:
    """Run ``code`` as ``__main__`` (what ``python -s -S -B -P main.py`` would), from the
    modules a fresh interpreter has, and end the process as the interpreter ends a script
    (:func:`_finish`)."""
    sys.argv = ["main.py"]
    sys.orig_argv = [sys.executable, "-s", "-S", "-B", "-P", "main.py"]
    sys.dont_write_bytecode = True
    for name in set(sys.modules) - _FRESH_MODULES:
        del sys.modules[name]  # (the server's: imported afresh, as in a fresh interpreter)
    module = type(sys)("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    try:
        exec(compile(code, "main.py", "exec"), module.__dict__)
        status = 0
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:
        tb = e.__traceback__  # (from the program's first frame: the jail's are not its own)
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        sys.excepthook(type(e), e, tb)
        status = 1
    os._exit(_finish(status, module))


def _exit_status(e: SystemExit) -> int:
    """What the interpreter makes of an uncaught ``SystemExit``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF if -(2**63) <= e.code < 2**63 else 255  # (C long, or -1)
    sys.stderr.write(f"{e.code}\n")
    return 1


def _finish(status: int, module: object) -> int:
    """The interpreter's end of a script (``Py_FinalizeEx``'s order): the non-daemon threads
    joined, the exit functions run, the standard streams flushed, the program's objects
    released (``__main__``'s namespace cleared, cycles collected: their ``__del__`` and
    ``finally`` run), the streams flushed again; the exit status. The rest of the
    interpreter's teardown is left out: in a fork of the server it would copy every page the
    server left it, two thirds of a short call's time, for nothing a program prints."""
    threading = sys.modules.get("threading")  # (the program's, if it imported it)
    try:
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException:
        status = status or 1
    status = _flush(status)
    with contextlib.suppress(BaseException):
        module.__dict__.clear()
        gc.collect()
    return _flush(status)


def _flush(status: int) -> int:
    """Flush the standard streams as the interpreter does at exit (those closed or None are
    skipped; the originals too, if the program replaced them): 120 if standard output fails."""
    for stream in {
        id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    }.values():
        if stream is None or getattr(stream, "closed", True):
            continue
        try:
            stream.flush()
        except Exception:
            if stream in (sys.stdout, sys.__stdout__):
                status = status or 120
    return status


def mount(source: bytes, target: str, kind: bytes, flags: int, options: str) -> None:
    if _libc.mount(source, target.encode(), kind, flags, options.encode() or None):
        fail(f"mounting a private {target}: errno {ctypes.get_errno()}")


def fail(message: str) -> None:
    sys.stderr.write(f"plexrl-jail: {message}\n")
    sys.stderr.flush()
    sys.exit(125)


def _without_address_randomisation() -> None:
    """Run this server again without address randomisation, where the kernel lets it (a
    program forks from it: see :data:`_ADDR_NO_RANDOMIZE`); as it is where it does not."""
    current = _libc.personality(0xFFFFFFFF)
    if current == -1 or current & _ADDR_NO_RANDOMIZE:
        return
    if _libc.personality(current | _ADDR_NO_RANDOMIZE) != -1:
        os.execv(sys.executable, sys.orig_argv)  # (the socket's fd is inherited)


if __name__ == "__main__":
    _without_address_randomisation()
    serve(int(sys.argv[1]))
