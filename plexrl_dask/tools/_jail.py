"""The sandbox's child: run as ``python -s -S -B -P _jail.py KEY=VALUE ...`` (standard library
only, and as little of it as a call needs: every import here is paid by every tool call), inside
the namespaces :mod:`plexrl_dask.tools.sandbox` started it in; the program arrives on standard
input.

As root in a private mount namespace it first mounts empty tmpfs file systems over the
world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``), so whatever the program
writes there goes away with the namespace, and makes its working directory there, owned by the
unprivileged user; then, in every mode, a child of it sets the resource limits, drops to that
user (when the jail is root), clears the environment and runs the program as ``__main__`` of
this interpreter (one interpreter start per call, not two), while the jail waits for it and
exits with its status (128 + the signal that killed it). The child ends as ``python main.py``
would: its non-daemon threads joined, its output flushed, an uncaught exception's traceback
(the program's frames only) on standard error and status 1. Exit status 125 and a message on
standard error: the jail itself could not be set up (the parent reports it as such, not as the
program's failure).
"""

import os
import resource
import sys

#: The limits given as integers (the rest: ``uid`` an integer or empty for none,
#: ``private_mounts`` 0 or 1, ``workdir`` a path).
INTEGERS = ("cpu_s", "memory_bytes", "file_bytes", "processes", "code_bytes", "nice")


def parse(args: list) -> dict:
    """The limits from ``KEY=VALUE`` arguments (what :mod:`plexrl_dask.tools.sandbox` passes)."""
    limits = dict(a.split("=", 1) for a in args)
    for key in INTEGERS:
        limits[key] = int(float(limits[key]))
    limits["uid"] = int(limits["uid"]) if limits["uid"] else None
    limits["private_mounts"] = limits["private_mounts"] == "1"
    return limits


def main() -> None:
    limits = parse(sys.argv[1:])
    # (first: the program and whatever it starts inherit it; raising one's nice needs no right)
    if limits["nice"] > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, limits["nice"])
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
    with open(os.path.join(work, "main.py"), "wb") as f:  # (for the traceback's lines)
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
        confine(limits, root, uid)
        run_program(code)  # (never returns: SystemExit ends this interpreter)
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            break
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
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
    os.environ.clear()


def run_program(code: bytes) -> None:
    """Run ``code`` as ``__main__`` (what ``python -s -S -B -P main.py`` would), then end this
    process through :class:`SystemExit`, so the interpreter shuts down as after a script."""
    sys.argv = ["main.py"]
    sys.dont_write_bytecode = True
    module = type(sys)("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    try:
        exec(compile(code, "main.py", "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__  # (from the program's first frame: the jail's are not its own)
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        sys.excepthook(type(e), e, tb)
        sys.exit(1)
    sys.exit(0)


def mount_tmpfs(target: str, size: int) -> None:
    import ctypes  # (namespaces only: its import is a tenth of a call's start)

    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"size={size},mode=1777".encode()
    if libc.mount(b"none", target.encode(), b"tmpfs", 0, opts) != 0:
        fail(f"mounting a private {target}: errno {ctypes.get_errno()}")


def fail(message: str) -> None:
    sys.stderr.write(f"plexrl-jail: {message}\n")
    sys.exit(125)


if __name__ == "__main__":
    main()
