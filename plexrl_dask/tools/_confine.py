"""What confines a sandboxed program's process beyond its resource limits and its uid: no
capabilities, a system-call filter (seccomp) and, where the kernel has Landlock, the files
and TCP ports it may reach. Standard library only: loaded by the sandbox's server
(``_jail.py``, run as a script) from beside it, and called in each program's process just
before the program runs (after no-new-privileges, which seccomp and Landlock need without
privileges). Each function raises :class:`OSError` where the kernel refuses it; the caller
fails the call as not set up (never runs the program less confined than asked).

Landlock (Linux >= 5.13, where the kernel's LSM list enables it; its ABI version grows with
the kernel, and what a version knows is all handled here): the program reads and executes
only the system's directories (``/usr``, ``/lib*``, ``/bin``, ``/sbin``, ``/etc``) and its
interpreter's (the directories on its path and the installation's ``lib``), writes only its
working directory (and, in its own mounts, the private ``/tmp``, ``/var/tmp``, ``/dev/shm``),
and uses ``/dev/null``, ``/dev/zero``, ``/dev/full`` and the random devices; everything else on
the machine, a user's home included, is refused whatever its permissions say. With ABI 4 it
binds and connects no TCP port; with ABI 6 it reaches no abstract UNIX socket and signals no
process outside its own (the jail, the server, the caller). Where the kernel has no Landlock
the program runs without it (:func:`landlock_abi` says 0; ``sandbox.files_confined()``)."""

from __future__ import annotations

import ctypes
import os
import sys

_libc = ctypes.CDLL(None, use_errno=True)

_PR_CAPBSET_DROP = 24
_CAPABILITY_VERSION_3 = 0x20080522
_EINVAL = 22

#: The system calls a program is refused (``EPERM``). Namespaces: ``unshare``, ``setns`` (a
#: user namespace of its own would let it mount an unbounded tmpfs); the kernel's keyrings:
#: ``add_key``, ``request_key``, ``keyctl`` (the per-uid user keyring outlives a call, so one
#: call could leave keys for the next under the same uid slot); mounts, old and new (``mount``
#: ... ``mount_setattr``, ``pivot_root``, ``chroot``); other processes' memory and tracing
#: (``ptrace``, ``process_vm_*``); ``io_uring_setup`` (its operations are not filtered),
#: ``bpf``, ``perf_event_open``, ``userfaultfd``; file handles; and what needs capabilities
#: anyway (``kexec_load``, ``init_module``, ``swapon``, ``reboot``, ``acct``, ``quotactl``,
#: ``fanotify_init``). ``clone`` is refused with a namespace flag (its first argument),
#: ``clone3`` is answered ``ENOSYS`` (its flags are behind a pointer the filter cannot read; the
#: C library then falls back to ``clone``).
DENIED = (
    "unshare", "setns",
    "add_key", "request_key", "keyctl",
    "mount", "umount2", "pivot_root", "chroot",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev",
    "io_uring_setup", "bpf", "perf_event_open", "userfaultfd",
    "name_to_handle_at", "open_by_handle_at",
    "kexec_load", "init_module", "swapon", "reboot", "acct", "quotactl", "fanotify_init",
)  # fmt: skip
#: Per architecture (``seccomp_data.arch``): its system calls' numbers, and the bit of the
#: x32 ABI's (on x86-64; refused whole).
_SYSCALLS = {
    0xC000003E: {  # x86-64 (asm/unistd_64.h)
        "unshare": 272, "setns": 308, "add_key": 248, "request_key": 249, "keyctl": 250,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "mount_setattr": 442, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "io_uring_setup": 425, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "name_to_handle_at": 303, "open_by_handle_at": 304,
        "kexec_load": 246, "init_module": 175, "swapon": 167, "reboot": 169, "acct": 163,
        "quotactl": 179, "fanotify_init": 300, "clone": 56, "clone3": 435,
        "x32": 0x40000000,
    },
    0xC00000B7: {  # AArch64 (asm-generic/unistd.h)
        "unshare": 97, "setns": 268, "add_key": 217, "request_key": 218, "keyctl": 219,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "mount_setattr": 442, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "io_uring_setup": 425, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "name_to_handle_at": 264, "open_by_handle_at": 265,
        "kexec_load": 104, "init_module": 105, "swapon": 224, "reboot": 142, "acct": 89,
        "quotactl": 60, "fanotify_init": 262, "clone": 220, "clone3": 435,
        "x32": None,
    },
}  # fmt: skip
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE_NAMESPACES = 0x7E020000  # (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET)
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38

#: Landlock's system calls (one number on every architecture) and flags.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_VERSION, _LL_PATH_BENEATH = 1, 1
#: File-system rights: execute, write, read a file, read a directory (bits 0-3); remove,
#: make (4-12); refer (ABI 2), truncate (ABI 3), device ioctl (ABI 5).
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_TCP = 0b11  # (bind, connect: ABI 4)
_SCOPES = 0b11  # (abstract UNIX sockets, signals: ABI 6)
#: What the program reads and executes beside its interpreter's files.
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc")
#: The devices it reads and writes.
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def drop_capabilities() -> None:
    """No capability left, nor any that executing a program would give back (the bounding
    and inheritable sets emptied): root of its user namespace only by name, it can neither
    mount (undo the jail's read-only mounts, uncover the machine's ``/proc``) nor override a
    file's permissions."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) and ctypes.get_errno() != _EINVAL:
            _refused(f"dropping capability {cap}")
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    empty = (ctypes.c_uint32 * 6)()
    if _libc.capset(header, empty):
        _refused("dropping the capabilities")


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def syscall_filter(arch: int) -> list[tuple[int, int, int, int]]:
    """The classic-BPF program :func:`filter_syscalls` installs for ``arch`` (its
    ``seccomp_data.arch``): (code, jump if true, jump if false, k) per instruction. A system
    call of another architecture (a 32-bit call on x86-64) is refused whole."""
    table = _SYSCALLS[arch]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # (BPF_LD|W|ABS, BPF_JMP|..|K)
    deny, allow = (ret, 0, 0, _RET_ERRNO | _EPERM), (ret, 0, 0, _RET_ALLOW)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), deny, (ld, 0, 0, 0)]
    if table["x32"] is not None:
        prog += [(jge, 0, 1, table["x32"]), deny]
    prog += [(jeq, 0, 1, table["clone3"]), (ret, 0, 0, _RET_ERRNO | _ENOSYS)]
    for name in DENIED:
        prog += [(jeq, 0, 1, table[name]), deny]
    # clone: its flags are its first argument, whose low 32 bits (offset 16) hold them all
    prog += [(jeq, 0, 3, table["clone"]), (ld, 0, 0, 16), (jset, 0, 1, _CLONE_NAMESPACES)]
    return [*prog, deny, allow]


def filter_syscalls() -> None:
    """Refuse this process and what it forks the system calls in :data:`DENIED` (seccomp;
    it cannot be removed). :class:`OSError` on an architecture the table does not know."""
    arch = _AUDIT_ARCH.get(os.uname().machine)
    if arch is None:
        raise OSError(f"no system-call filter for {os.uname().machine}")
    prog = syscall_filter(arch)
    filters = (_SockFilter * len(prog))(*(_SockFilter(*ins) for ins in prog))
    fprog = _SockFprog(len(prog), filters)
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0):
        _refused("installing the system-call filter")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (too old, or not enabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_LL_VERSION))
    return max(version, 0)


def interpreter_dirs() -> list[str]:
    """The directories this interpreter reads its modules and libraries from: those on its
    path, and its installation's ``lib`` (the shared libraries its extension modules use)."""
    dirs = [p for p in sys.path if p and os.path.isdir(p)]
    dirs.append(os.path.join(sys.base_prefix, "lib"))
    return [os.path.realpath(d) for d in dirs]


def restrict_files(writable: list[str], private_proc: bool) -> int:
    """Landlock this process and what it forks (see the module docstring): read and execute
    :data:`SYSTEM_DIRS`, :func:`interpreter_dirs` and the interpreter itself; everything in
    ``writable``; the :data:`DEVICES`; ``/proc`` where it is the program's own
    (``private_proc``), else ``/proc/self`` alone (the machine's shows every process's command
    line). Returns the ABI used: 0, nothing done, where the kernel has no Landlock."""
    abi = landlock_abi()
    if abi < 1:
        return 0
    handled = (1 << 13) - 1
    handled |= (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    handled |= _FS_IOCTL_DEV if abi >= 5 else 0
    attr = _RulesetAttr(handled, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # (the fields this ABI knows)
    ruleset = _libc.syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        _refused("making a Landlock ruleset")
    read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    file_rights = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
    device = (_FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE) & handled
    proc = "/proc" if private_proc else os.path.realpath("/proc/self")
    rules = [(p, read) for p in (*SYSTEM_DIRS, *interpreter_dirs(), proc)]
    rules += [(os.path.realpath(sys.executable), read & file_rights)]
    rules += [(p, device) for p in DEVICES] + [(p, handled) for p in writable]
    try:
        for path, rights in rules:
            _allow(ruleset, path, rights)
        if _libc.syscall(_LL_RESTRICT, ruleset, 0):
            _refused("entering the Landlock ruleset")
    finally:
        os.close(ruleset)
    return abi


def _allow(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # (a system directory this machine does not have)
    try:
        if not os.path.isdir(path):
            rights &= _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
        beneath = _PathBeneath(rights, fd)
        if _libc.syscall(_LL_ADD_RULE, ruleset, _LL_PATH_BENEATH, ctypes.byref(beneath), 0):
            _refused(f"allowing {path} in the Landlock ruleset")
    finally:
        os.close(fd)


def _refused(what: str) -> None:
    errno = ctypes.get_errno()
    raise OSError(errno, f"{what}: {os.strerror(errno)}")
