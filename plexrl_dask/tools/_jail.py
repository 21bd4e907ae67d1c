"""The sandbox's child: run as ``python -I -S _jail.py LIMITS_JSON`` (standard library only),
inside the namespaces :mod:`plexrl_dask.tools.sandbox` started it in; the program arrives on
standard input.

As root in a private mount namespace it first mounts empty tmpfs file systems over the
world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``), so whatever the program
writes there goes away with the namespace, and makes its working directory there, owned by the
unprivileged user; then, in every mode, a child of it sets the resource limits, drops to that
user (when the jail is root) and replaces itself with the interpreter running the program with
an empty environment, while the jail waits for it and exits with its status (128 + the signal
that killed it). Exit status 125 and a message on standard error: the jail itself could not be set
up (the parent reports it as such, not as the program's failure).
"""

import ctypes
import json
import os
import resource
import sys


def main() -> None:
    limits = json.loads(sys.argv[1])
    code = sys.stdin.buffer.read(limits["code_bytes"] + 1)
    if len(code) > limits["code_bytes"]:
        fail(f"a program has at most {limits['code_bytes']} bytes")
    uid = gid = limits["uid"]
    root = uid is not None and os.geteuid() == 0  # (drop to ``uid``)
    if limits["private_mounts"]:
        for target in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(target):
                mount_tmpfs(target, limits["file_bytes"] * 4)
    base = "/tmp" if limits["private_mounts"] else limits["workdir"]
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    with open(os.path.join(work, "main.py"), "wb") as f:
        f.write(code)
    if root:
        os.chown(work, uid, gid)
        os.chown(os.path.join(work, "main.py"), uid, gid)
    os.chdir(work)
    # The jail stays (the namespace's init, reaping what the program leaves) and waits for the
    # program in a child: a program killed by a signal (SIGXCPU at its CPU limit) then exits
    # the jail with 128 + the signal, which ``unshare`` passes on as it is.
    pid = os.fork()
    if pid == 0:
        run_program(limits, root, uid)
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            break
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def run_program(limits: dict, root: bool, uid: int) -> None:
    """In the jail's child: the limits, the unprivileged user, then the interpreter."""
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
    python = limits["python"]
    try:
        os.execve(python, [python, "-I", "-S", "-B", "main.py"], {})
    except OSError as e:
        fail(f"cannot run {python} as uid {os.getuid()}: {e}")


def mount_tmpfs(target: str, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"size={size},mode=1777".encode()
    if libc.mount(b"none", target.encode(), b"tmpfs", 0, opts) != 0:
        fail(f"mounting a private {target}: errno {ctypes.get_errno()}")


def fail(message: str) -> None:
    sys.stderr.write(f"plexrl-jail: {message}\n")
    sys.exit(125)


if __name__ == "__main__":
    main()
