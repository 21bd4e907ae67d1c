"""Tools of agentic episodes: the call format, the calculator, the Python sandbox against
hostile programs, and the pool that runs calls on tool workers (a real process cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from plexrl_dask import errors
from plexrl_dask.bench.agentic import (
    hold_at_once,
    hostile_suite,
    writable_directories,
    write_everywhere,
)
from plexrl_dask.cluster import worker_info
from plexrl_dask.driver.waits import post_event
from plexrl_dask.shared.timeline import TOOL_TOPIC
from plexrl_dask.tools import (
    Calculator,
    PythonSandbox,
    SandboxLimits,
    ToolCall,
    ToolPool,
    ToolResult,
    _confine,
    isolation,
    parse_call,
    run_call,
    stop_strings,
)
from plexrl_dask.tools.calls import check_tools
from plexrl_dask.tools.sandbox import (
    _server,
    files_confined,
    memory_bounded,
    sandbox_processes,
)

TOOLS = {"calc": Calculator()}
FAST = SandboxLimits(wall_s=2.0, cpu_s=2, output_bytes=256)
NAMESPACES = pytest.mark.skipif(
    isolation() != "namespaces",
    reason="network, mount and PID namespaces are not available here (the sandbox runs with "
    "its limits only)",
)


def test_the_calculator_is_exact_integer_arithmetic_and_refuses_the_rest():
    calc = Calculator()
    assert calc.run("123*456") == "56088"
    assert calc.run(" (7 + 5) * -3 - 10 // 4 % 3 ") == "-38"
    assert calc.run("7/2") == "3"  # exact: integer division
    for bad in (
        "2**10",
        "1.5*2",
        "abs(-1)",
        "x*2",
        "1/0",
        "3%0",
        "",
        "9" * 41,
        "9" * 30 + "*" + "9" * 30,
        "1+" * 150,
    ):
        with pytest.raises(errors.InvalidToolCall):
            calc.run(bad)
    # Through run_call a failed call is a result that says why, not an exception.
    res = run_call(ToolCall("calc", "1/0"), TOOLS)
    assert not res.ok and res.error == "InvalidToolCall" and "division by zero" in res.output
    assert res.observation(64) == "<out>error: division by zero</out>"
    assert run_call(ToolCall("nope", "1"), TOOLS).error == "InvalidToolCall"

    class Broken:
        name = "broken"

        def run(self, text: str) -> str:
            raise RuntimeError("a fault of the tool")

    fault = run_call(ToolCall("broken", ""), {"broken": Broken()})
    assert fault.error == "ToolFailed" and "a fault of the tool" in fault.output


def test_the_calculator_answers_threads_that_call_it_at_once():
    import concurrent.futures

    calc = Calculator()
    exprs = [f"({i} + 1) * {i}" for i in range(400)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        assert list(ex.map(calc.run, exprs)) == [str((i + 1) * i) for i in range(400)]
    assert ToolResult("x" * 100).observation(20) == "<out>" + "x" * 17 + "...</out>"


def test_a_turn_ends_with_a_call_or_is_an_answer():
    assert stop_strings(TOOLS) == ("</calc>",)
    assert parse_call("let me see <calc>12*3</calc>", TOOLS) == ToolCall("calc", "12*3")
    assert parse_call("36\n", TOOLS) is None
    # the token that completed the tag may carry a little more (a BPE token such as ">\n")
    for rest in ("\n", ".", " \n\n"):
        assert parse_call(f"<calc>12*3</calc>{rest}", TOOLS) == ToolCall("calc", "12*3")
    # ... but an answer that only mentions a call is one
    assert parse_call("<calc>12*3</calc> gives 36", TOOLS) is None
    assert parse_call("<calc>1</calc>" + "." * 20, TOOLS) is None
    with pytest.raises(errors.InvalidToolCall):
        parse_call("12*3</calc>", TOOLS)
    for bad in ({"out": Calculator()}, {"a b": Calculator()}, {"py": Calculator()}):
        with pytest.raises(errors.InvalidToolCall):
            check_tools(bad)


def run(program: str, limits: SandboxLimits = FAST) -> ToolResult:
    return run_call(ToolCall("py", program), {"py": PythonSandbox(limits)})


def test_the_sandbox_runs_a_program_in_an_empty_environment_and_is_deterministic():
    program = (
        "import os, sys\nprint(sorted(os.environ), sys.flags.no_user_site, sys.flags.safe_path)"
        "\nprint(sorted(m for m in sys.modules if m.startswith('plexrl')))"
        "\nprint({str(i) * 3 for i in range(12)})\nprint(6 * 7)"
    )
    outputs = {run(program).output for _ in range(3)}
    assert len(outputs) == 1  # (a set of strings too: the hash seed is fixed)
    flags, modules, _, answer = outputs.pop().splitlines()
    assert flags == "[] 1 True" and modules == "[]" and answer == "42"
    failed = run("def f():\n    1 / 0\nf()")
    assert failed.error == "ToolError" and failed.output == "ZeroDivisionError: division by zero"
    assert run("import sys\nsys.exit(3)").output == "exit status 3"
    late = "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), print(1))).start()"
    assert run(late).output == "1\n"  # (it ends as a script does: its threads joined)


@pytest.mark.parametrize(
    "name, program, error",
    [
        ("loops", "while True:\n    pass", "ToolLimitExceeded"),  # (wall or CPU time first)
        (
            "threads spin",
            "import threading\ndef f():\n    while True:\n        pass\n"
            "for _ in range(4):\n    threading.Thread(target=f).start()",
            "ToolLimitExceeded",
        ),
        ("sleeps", "import time\ntime.sleep(60)", "ToolLimitExceeded"),
        ("allocates", "x = bytearray(10**10)", "ToolError"),
        ("raises", "1 / 0", "ToolError"),
        ("writes a huge file", "open('big', 'wb').write(b'x' * 10**8)", "ToolError"),
        ("does not parse", "def (:", "ToolError"),
    ],
)
def test_a_hostile_program_gets_an_error_and_the_next_one_runs(name, program, error):
    t0 = time.monotonic()
    res = run(program)
    assert res.error == error, res
    assert time.monotonic() - t0 < FAST.wall_s + 5
    assert run("print('next')").output == "next\n"


def test_a_program_that_prints_megabytes_is_stopped_at_the_documented_size():
    t0 = time.monotonic()
    res = run("while True:\n    print('x' * 1000)")
    assert res.error == "ToolLimitExceeded", res
    assert f"more than {FAST.output_bytes} bytes" in res.output
    assert time.monotonic() - t0 < FAST.wall_s  # (stopped at the size, not at the clock)
    assert (
        run(f"print('x' * {FAST.output_bytes - 1})").output == "x" * (FAST.output_bytes - 1) + "\n"
    )


def test_the_sandbox_runs_without_namespaces_only_as_configured(monkeypatch, caplog):
    import dask.config

    from plexrl_dask.tools import sandbox

    # (the pid a program sees: 1 or 2 in a PID namespace of its own, the host's elsewhere)
    pid = "import os\nprint(os.getpid() > 2)"
    with dask.config.set({"plexrl.tools.sandbox-isolation": "limits"}):
        assert run(pid).output == "True\n"  # (limits alone, asked for: no warning)
    with (
        dask.config.set({"plexrl.tools.sandbox-isolation": "bogus"}),
        pytest.raises(errors.ConfigError, match="sandbox-isolation"),
    ):
        PythonSandbox(FAST).run("print(1)")
    monkeypatch.setattr(sandbox, "isolation", lambda: "limits")  # (as on a host without them)
    with dask.config.set({"plexrl.tools.sandbox-isolation": "namespaces"}):
        res = run(pid)
        assert res.error == "ToolError" and "not available" in res.output, res
    sandbox._warn_limits_only.cache_clear()
    with caplog.at_level("WARNING", logger="plexrl_dask.tools.sandbox"):
        assert run(pid).output == "True\n" and run(pid).output == "True\n"  # auto: limits
    said = [r for r in caplog.records if "limits alone" in r.getMessage()]
    assert len(said) == 1  # (once, not per call)


def test_a_failed_programs_error_is_its_last_whole_line_never_a_frame_or_a_cut_one():
    # (standard error past output_bytes is kept from its end: the line the cut began inside
    # of is not the program's, and a traceback's frames name the sandbox's own files)
    cut = run(
        "import sys\nsys.stderr.write('A' * 300 + '/host/path\\n  File \"x\"\\n')\nsys.exit(1)"
    )
    assert cut.error == "ToolError" and cut.output == "exit status 1", cut
    res = run("import sys\nsys.stderr.write('y' * 1000 + '\\n')\nraise ValueError('boom')")
    assert res.error == "ToolError" and res.output == "ValueError: boom", res


def test_a_fork_bomb_stays_inside_its_limits():
    res = run("import os\nwhile True:\n    os.fork()")
    assert not res.ok
    assert run("print('still here')").output == "still here\n"


@pytest.mark.skipif(
    not memory_bounded(),
    reason="the sandbox may not make memory cgroups here (not root, or no memory controller "
    "it may write): a call's processes are bounded one by one only",
)
def test_the_processes_of_a_program_share_one_memory_bound():
    # (each child's 160 MiB is within a process's 256 MiB; four hold 640 MiB together)
    program = hold_at_once(4, 160)
    roomy = SandboxLimits(wall_s=10.0, memory_bytes=256 * 2**20, call_memory_bytes=2**30)
    assert run(program, roomy).output == "4\n"  # (the control: a bound they fit in)
    tight = SandboxLimits(wall_s=10.0, memory_bytes=256 * 2**20, call_memory_bytes=384 * 2**20)
    res = run(program, tight)
    assert res.error == "ToolLimitExceeded" and "memory together" in res.output, res
    assert run("print('next')", tight).output == "next\n"
    # every call's cgroup is gone once the call has ended (the server's own stays)
    server = _server(isolation())
    assert server.memory_cgroup is not None and os.path.isdir(server.memory_cgroup)
    assert [e.name for e in os.scandir(server.memory_cgroup) if e.is_dir()] == []


def test_the_sandbox_finds_its_memory_cgroup_on_v1_and_v2_hosts_and_in_containers():
    from plexrl_dask.tools._jail import memory_cgroup_of

    v1_cgroups = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
    v1_mounts = (
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    assert memory_cgroup_of(v1_cgroups, v1_mounts) == (1, "/sys/fs/cgroup/memory/process_api/abc")
    # a container's v1 mount shows its own subtree (root /docker/c1), and one that does not
    # hold the process's cgroup is passed over
    docker = "5:memory:/docker/c1/job\n0::/\n"
    mounts = (
        "40 31 0:32 /other /mnt/x rw - cgroup cgroup rw,memory\n"
        "41 31 0:32 /docker/c1 /sys/fs/cgroup/memory rw shared:9 - cgroup cgroup rw,memory\n"
    )
    assert memory_cgroup_of(docker, mounts) == (1, "/sys/fs/cgroup/memory/job")
    # v2 only: the unified hierarchy, a systemd unit's path; a mount point with a space
    v2 = "0::/system.slice/worker.service\n"
    v2_mounts = "30 23 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    assert memory_cgroup_of(v2, v2_mounts) == (2, "/sys/fs/my cgroup/system.slice/worker.service")
    assert memory_cgroup_of("0::/\n", v2_mounts) == (2, "/sys/fs/my cgroup")  # (cgroupns)
    assert memory_cgroup_of(v2, v1_mounts.replace("cgroup2", "tmpfs")) is None
    assert memory_cgroup_of("", v1_mounts) is None


@NAMESPACES
def test_a_fork_bomb_does_not_starve_a_program_running_beside_it():
    import concurrent.futures

    bomb = "import os\nwhile True:\n    os.fork()"
    # (one child at a time: where no memory cgroup bounds a call, a program has 2 processes)
    forks = (
        "import os, time\ntime.sleep(0.5)\nok = 0\nfor _ in range(4):\n"
        "    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n"
        "    ok += os.waitpid(pid, 0)[1] == 0\nprint(ok)"
    )
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        b = ex.submit(run, bomb)
        time.sleep(0.2)
        ok = ex.submit(run, forks)
        assert ok.result().output == "4\n"  # its own uid: its own process limit
        assert not b.result().ok


@NAMESPACES
def test_the_sandbox_has_no_network_and_writes_nothing_outside_it(tmp_path):
    outside = f"/tmp/plexrl-escape-{uuid.uuid4().hex}"
    mine = tmp_path / "escaped"
    res = run(f"open({outside!r}, 'w').write('x')\nprint(open({outside!r}).read())")
    assert res.output == "x\n"  # (its own private /tmp)
    assert not os.path.exists(outside)
    assert run(f"open({str(mine)!r}, 'w').write('x')").error == "ToolError"
    assert not mine.exists()
    # (UDP: Landlock, where the kernel has it, refuses TCP before the namespace is asked)
    net = run(
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).connect(('1.1.1.1', 53))"
    )
    assert net.error == "ToolError" and "unreachable" in net.output.lower(), net
    sees = run(
        "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]), os.getpid())"
    )
    assert sees.output.split() == ["2", "2"]  # only the jail (its namespace's init) and itself
    uid = int(run("import os\nprint(os.getuid())").output)
    limits = SandboxLimits()
    assert limits.uid_base <= uid < limits.uid_base + limits.uid_slots


@NAMESPACES
def test_a_program_reaches_none_of_the_machines_unix_sockets():
    """A read-only mount does not stop a connect() on a socket file: the machine's sockets
    (under /run: a user's bus, systemd's, docker's) are behind an empty mount."""
    import socket

    path = f"/run/plexrl-test-{uuid.uuid4().hex[:8]}.sock"
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
    except OSError as e:
        pytest.skip(f"cannot make a socket under /run here: {e}")
    os.chmod(path, 0o777)  # (anyone may connect: only the mount stops the program)
    server.listen(1)
    server.settimeout(0.5)
    try:
        res = run(f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})")
        assert res.error == "ToolError"
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
        os.unlink(path)


@NAMESPACES
def test_a_program_writes_in_no_directory_the_machine_leaves_open_to_anyone():
    """Not only ``/tmp``: the whole file system is read-only to a program (``/run/lock``, on
    most machines, is anyone's to write in); its private ``/tmp``, ``/var/tmp`` and
    ``/dev/shm`` take what it writes, and vanish with it."""
    directories = writable_directories()
    marker = f"plexrl-escape-{uuid.uuid4().hex}"
    try:
        res = run(write_everywhere(directories, marker))
    finally:
        written = [d for d in directories if (d / marker).exists()]
        for d in written:
            (d / marker).unlink()
    assert written == []
    assert res.ok and int(res.output) >= 1  # (its own /tmp, at least)
    refused = run(
        "import os\ntry:\n    os.mkdir('/run/plexrl-x')\nexcept OSError as e:\n"
        "    print(e.strerror)"
    )
    assert refused.output.strip() in ("Read-only file system", "No such file or directory")


def test_without_namespaces_the_limits_and_an_own_uid_still_hold():
    tools = {"py": PythonSandbox(FAST, mode="limits")}
    uid = int(run_call(ToolCall("py", "import os\nprint(os.getuid())"), tools).output)
    limits = SandboxLimits()
    if os.geteuid() == 0:
        assert limits.uid_base <= uid < limits.uid_base + limits.uid_slots
    else:
        assert uid == os.geteuid()
    assert run_call(ToolCall("py", "while True:\n    pass"), tools).error == "ToolLimitExceeded"
    assert not run_call(ToolCall("py", "import os\nwhile True:\n    os.fork()"), tools).ok
    assert run_call(ToolCall("py", "print('after')"), tools).output == "after\n"


def test_a_program_runs_at_the_lower_cpu_priority_it_was_given():
    """The call's processes (the program and whatever it starts) run ``nice`` below the
    caller, so that model workers on the same cores keep the CPU, in either mode, and so does
    its session's scheduling group where the kernel shows one."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    program = "import os\nprint(os.getpriority(os.PRIO_PROCESS, 0))"
    for mode in sorted({"limits", isolation()}):
        for _ in range(3):
            assert PythonSandbox(SandboxLimits(), mode).run(program) == f"{min(19, base + 10)}\n"
        assert PythonSandbox(SandboxLimits(nice=0), mode).run(program) == f"{base}\n"
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # (the caller's own is unchanged)
    try:  # (the kernel groups by session, shows the group, and lets this process set its nice)
        with open("/proc/self/autogroup", "r+") as f:
            shown = re.fullmatch(r"/autogroup-\d+ nice (-?\d+)\s*", f.read())
            if shown is None:  # (some kernels and sandboxes show an empty file)
                return
            own = int(shown.group(1))
            f.write(str(own))
    except OSError:
        return
    group = "print(open('/proc/self/autogroup').read().split()[-1])"
    assert PythonSandbox(SandboxLimits()).run(group) == f"{min(19, own + 10)}\n"


def test_calls_are_forks_of_a_server_that_comes_back_when_it_ends():
    """Every call of a mode runs on this process's sandbox server; calls at once each get
    their own output; a server that ended (killed here) is started again by the next call,
    which prints what it printed before; the server's CPU time counts its ended calls."""
    import concurrent.futures
    import signal

    from plexrl_dask.tools.sandbox import _server, servers_cpu_seconds

    program = "import sys\nprint(sorted({str(i) * 2 for i in range(9)}), sys.argv)"
    for mode in sorted({"limits", isolation()}):
        sandbox = PythonSandbox(FAST, mode)
        first = sandbox.run(program)
        server = _server(mode)
        before = servers_cpu_seconds()
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(sandbox.run, [f"print({i} * 3)" for i in range(16)]))
        assert outs == [f"{i * 3}\n" for i in range(16)]
        assert servers_cpu_seconds() > before
        pid = server.proc.pid
        os.kill(pid, signal.SIGKILL)
        server.proc.wait()
        assert sandbox.run(program) == first
        assert server.proc.pid != pid and server.running()


def test_nothing_a_program_starts_outlives_its_call_in_any_mode():
    """A process that makes itself a session of its own escapes the jail's group kill (in
    "limits" mode, with no PID namespace): it is ended with the call all the same, as the
    call's subreaper kills what comes back to it; a program's direct child ends with it."""
    import psutil

    marker, sleep = f"plexrl-stray-{uuid.uuid4().hex}", shutil.which("sleep")
    assert sleep is not None
    program = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv({sleep!r}, [{marker!r}, '60'])\n"
        f"    os.execv({sleep!r}, [{marker!r}, '60'])\n"
        "print('left')\n"
    )

    def strays() -> list[int]:
        found = []
        for p in psutil.process_iter(["cmdline", "create_time"]):
            with contextlib.suppress(psutil.Error):
                if any(marker in part for part in p.info["cmdline"] or ()):
                    found.append(p.pid)
        return found

    limits = SandboxLimits(processes=8, call_memory_bytes=8 * SandboxLimits().memory_bytes)
    for mode in sorted({"limits", isolation()}):
        assert PythonSandbox(limits, mode).run(program) == "left\n"
        deadline = time.monotonic() + 10
        while strays() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert strays() == [], mode


def test_a_program_cannot_write_its_own_status_or_reach_the_server():
    """The program's process holds standard input, output and error only: not the call's
    status socket (a program writing ``exit 0`` there would pass for one that succeeded),
    nor the server's."""
    forge = (
        "import os, sys\nheld = sorted(int(f) for f in os.listdir('/proc/self/fd'))\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, b'exit 0\\n')\n"
        "    except OSError:\n        pass\nprint(held[:3])\nsys.exit(3)"
    )
    for mode in sorted({"limits", isolation()}):
        res = run_call(ToolCall("py", forge), {"py": PythonSandbox(FAST, mode)})
        assert res.error == "ToolError" and res.output == "exit status 3", res


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid of its own per program needs root")
def test_without_namespaces_what_a_program_leaves_running_ends_with_its_call():
    """In limits mode there is no PID namespace to end with the program: a process it left
    in a session of its own is killed with the call, lest it keep the uid the next call gets."""
    leave = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
        "print(os.getuid())"
    )
    sandbox = PythonSandbox(FAST, "limits")
    uid = int(sandbox.run(leave))
    assert FAST.uid_base <= uid < FAST.uid_base + FAST.uid_slots
    deadline = time.monotonic() + 5.0  # (killed with the call; reaped a moment later)
    while sandbox_processes(FAST) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(FAST) == []
    sleeper = "import time\nif True:\n    import os\n    os.fork()\n    time.sleep(60)"
    assert run_call(ToolCall("py", sleeper), {"py": sandbox}).error == "ToolLimitExceeded"
    assert sandbox.run("print('next')") == "next\n"


ESCAPE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
try:  # (a directory its uid owns outside its private mounts: the caller's files)
    open(os.path.join(OWNED, "escaped"), "w").write("x")
    print("WROTE")
except OSError:
    pass
if libc.mount(None, b"/", None, 0x1020, None) == 0:  # (MS_REMOUNT | MS_BIND: read-write)
    print("REMOUNTED")
if libc.umount2(b"/proc", 2):  # (the machine's /proc beneath)
    print("COVERED")
    sys.exit(0)
mine, pid = set(), int(os.readlink("/proc/self"))  # (its pid there, not in its namespace)
for _ in range(3):  # (this call's processes: the program's, the jail, the call)
    mine.add(pid)
    status = open(f"/proc/{pid}/status").read()
    pid = int(status.split("PPid:")[1].split()[0])
seen = denied = 0
for p in os.listdir("/proc"):
    try:
        if not p.isdigit() or b"_jail.py" not in open(f"/proc/{p}/cmdline", "rb").read():
            continue
    except OSError:
        continue
    if int(p) in mine:
        continue
    seen += 1
    try:
        open(f"/proc/{p}/mem", "rb").close()
        print("LEAK", p)
    except PermissionError:
        denied += 1
print(seen, denied)
"""

NOT_ROOT_PROBE = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from plexrl_dask.tools import PythonSandbox, SandboxLimits
from plexrl_dask.tools.sandbox import isolation
if isolation() != "namespaces":
    sys.exit(3)
sandbox = PythonSandbox(SandboxLimits(wall_s=10), "namespaces")
slept = []
other = threading.Thread(target=lambda: slept.append(sandbox.run("import time; time.sleep(3)")))
other.start()
time.sleep(1.0)  # (the other call runs on the same server meanwhile)
print(sandbox.run(sys.stdin.read()), end="")
other.join()
assert slept == [""]
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the sandbox as another user: needs root")
def test_without_root_no_program_reaches_the_server_or_another_call():
    """Run by a user that is not root, the server is root of a user namespace and so is each
    program (in one of its own, nested), but with no capability: it can neither write the
    caller's own files (the file system is read-only to it) nor remount it, nor uncover the
    machine's ``/proc``; and if it could uncover it, it could open neither the server's
    memory nor another call's processes' there."""
    import plexrl_dask

    repo = Path(plexrl_dask.__file__).resolve().parents[1]
    owned = Path(tempfile.mkdtemp(prefix=".plexrl-test-", dir=repo))  # (not under /tmp)
    os.chown(owned, 65534, 65534)
    try:
        escape = ESCAPE.replace("OWNED", repr(str(owned)))
        no_userns = "user namespaces are not available to an unprivileged user here"
        out = probe_as_nobody(NOT_ROOT_PROBE, stdin=escape, skips={3: no_userns})
        assert list(owned.iterdir()) == []
    finally:
        shutil.rmtree(owned, ignore_errors=True)
    assert "WROTE" not in out and "REMOUNTED" not in out
    if out == "COVERED\n":
        return  # (it cannot uncover the machine's /proc: nothing to reach there)
    assert "LEAK" not in out
    seen, denied = map(int, out.split())
    assert seen >= 4 and denied == seen  # (the server, and the other call's three processes)


def probe_as_nobody(
    probe: str, *args: str, stdin: str = "", skips: dict[int, str] | None = None
) -> str:
    """Run the script ``probe`` (its first argument this checkout, then ``args``) as the
    unprivileged user ``nobody``, ``stdin`` its input; its standard output. Skipped where
    there is no ``setpriv``, ``nobody`` cannot read the checkout, or the probe exits with a
    code of ``skips`` (its reason). The script lives in a directory ``nobody`` may read
    (pytest's are root's alone)."""
    import plexrl_dask

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv to run as another user")
    repo = Path(plexrl_dask.__file__).resolve().parents[1]
    folder = Path(tempfile.mkdtemp(prefix="plexrl-test-"))
    folder.chmod(0o755)
    script = folder / "probe.py"
    script.write_text(probe)
    script.chmod(0o644)
    try:
        nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        done = subprocess.run(
            [*nobody, sys.executable, str(script), str(repo), *args],
            input=stdin.encode(),
            capture_output=True,
            cwd="/",
            timeout=120,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode in (skips or {}):
        pytest.skip((skips or {})[done.returncode])
    if done.returncode != 0 and b"Permission denied" in done.stderr:
        pytest.skip("this checkout is not readable by an unprivileged user")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode()


UNBOUNDED_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from plexrl_dask.tools import PythonSandbox, SandboxLimits, ToolCall, run_call
from plexrl_dask.tools.sandbox import isolation, memory_bounded
program = sys.stdin.read()
out = {}
for mode in sorted({"limits", isolation()}):
    tools = {"py": PythonSandbox(SandboxLimits(wall_s=10), mode)}
    held, alone = (run_call(ToolCall("py", p), tools) for p in (program, "print(6 * 7)"))
    out[mode] = [memory_bounded(mode), held.error, alone.output]
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the sandbox as another user: needs root")
def test_without_a_memory_cgroup_a_programs_processes_fit_the_calls_bound_one_by_one():
    """A server that is not root makes no memory cgroups: there a program may have only as
    many processes as fit the call's bound at the per-process limit (2 of 512 MiB in 1 GiB),
    so three that would hold 300 MiB each at once cannot all run; one process runs as ever."""
    out = probe_as_nobody(UNBOUNDED_PROBE, stdin=hold_at_once(3, 300))
    for mode, (bounded, held_error, alone) in json.loads(out).items():
        assert not bounded and held_error is not None and alone == "42\n", (mode, out)


STRAY_PROBE = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from plexrl_dask.tools import PythonSandbox, SandboxLimits
marker, program = sys.argv[2], sys.stdin.read()
try:
    PythonSandbox(SandboxLimits(wall_s=2), "limits").run(program)
except Exception as e:  # (its wall clock ends the call)
    print(type(e).__name__, file=sys.stderr)

def strays():
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue  # (its own command line names the marker)
        try:
            found += marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            pass
    return found

deadline = time.monotonic() + 10
while strays() and time.monotonic() < deadline:
    time.sleep(0.1)
print(strays())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the sandbox as another user: needs root")
def test_what_a_program_of_an_unprivileged_server_leaves_ends_with_its_call():
    """With limits alone and no root (no uid of its own to kill, no PID namespace, and no
    room to fork under the uid's process cap), a program that made itself a session of its
    own, out of the jail's process group, ends with the call all the same."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    marker = f"plexrl-stray-{uuid.uuid4().hex}"
    program = f"import os\nos.setsid()\nos.execv({sleep!r}, [{marker!r}, '60'])\n"
    try:
        assert probe_as_nobody(STRAY_PROBE, marker, stdin=program).strip() == "0"
    finally:
        subprocess.run(["pkill", "-f", marker], check=False)


def test_a_call_short_of_descriptors_is_refused_typed_and_keeps_none(monkeypatch):
    from plexrl_dask.tools import sandbox as sandbox_module

    box = PythonSandbox(FAST, "limits")
    assert box.run("print(1)") == "1\n"  # (its server is up)

    def none_left(*args, **kwargs):
        raise OSError(24, "Too many open files")

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(sandbox_module.socket, "socketpair", none_left)
    with pytest.raises(errors.ToolError, match="no descriptors"):
        box.run("print(2)")
    assert len(os.listdir("/proc/self/fd")) == before


def test_bad_limits_and_modes_are_typed():
    with pytest.raises(errors.ConfigError):
        SandboxLimits(wall_s=0)
    for nice in (-1, 20, 2.5, True):
        with pytest.raises(errors.ConfigError):
            SandboxLimits(nice=nice)
    with pytest.raises(errors.ConfigError):
        PythonSandbox(mode="docker")
    with pytest.raises(errors.ToolLimitExceeded):
        PythonSandbox(SandboxLimits(code_bytes=10)).run("print('a long program')")


def test_calls_run_on_the_tool_worker_and_a_lost_worker_is_an_error_result(monkeypatch, tmp_path):
    import distributed

    import plexrl_dask as plexrl
    from plexrl_dask.tools import pool as pool_module
    from plexrl_dask.tools.pool import tool_workers

    class WhereAmI:
        name = "where"

        def run(self, text: str) -> str:
            if text.startswith("die"):  # "die" or "die:<seconds>"
                time.sleep(float(text.partition(":")[2] or 0))
                os._exit(1)
            if text == "hang":
                time.sleep(120)
            if text == "exit":
                raise SystemExit(3)
            if text.startswith("nap"):  # "nap<i>" or "nap<i>:<seconds>"
                t0 = time.monotonic()
                time.sleep(float(text.partition(":")[2] or 0.2))
                return f"{t0} {time.monotonic()} {distributed.get_worker().name}"
            return str(distributed.get_worker().name)

    with (
        plexrl.local_cluster(n_workers=1, tool_workers=1) as cluster,
        distributed.Client(cluster) as client,
    ):
        [tool] = tool_workers(client)
        assert worker_info(client)[tool]["name"] == "tool-0"
        tools = {"where": WhereAmI(), "calc": Calculator(), "py": PythonSandbox(FAST)}
        pool = ToolPool(client, tools, job="job-tools")
        calls = [ToolCall("where", ""), None, ToolCall("calc", "6*7"), ToolCall("calc", "6/0")]
        got = pool.run(calls, timeout_s=10)
        assert [r and (r.output, r.error) for r in got] == [
            ("tool-0", None),
            None,
            ("42", None),
            ("division by zero", "InvalidToolCall"),
        ]
        # each call's span on its tool worker, reported for the dashboard's Timeline
        # (sent without waiting: it arrives soon after)
        deadline = time.monotonic() + 10
        while not client.get_events(TOOL_TOPIC) and time.monotonic() < deadline:
            time.sleep(0.05)
        [(_, report)] = client.get_events(TOOL_TOPIC)
        assert report["job"] == "job-tools" and len(report["spans"]) == 3
        assert {s["worker"] for s in report["spans"]} == {tool}
        assert [s["tool"] for s in report["spans"]] == ["where", "calc", "calc"]
        assert all(0 <= s["end"] - s["start"] < 10 for s in report["spans"])
        # A turn of many calls goes out as one task per tool worker, which runs them as many
        # at once as the worker has threads (each result in its call's place).
        submitted, submit = [], client.submit
        client.submit = lambda *a, **k: (submitted.append(k["key"]), submit(*a, **k))[1]
        many = [ToolCall("calc", f"{i}*3") for i in range(40)]
        assert [r.output for r in pool.run(many, timeout_s=10)] == [str(3 * i) for i in range(40)]
        client.submit = submit
        assert len(submitted) == 1
        # A call stuck in its tool past its limit (and a margin, from its start) is given up
        # on by the worker: a failed result, and another thread takes its place.
        monkeypatch.setattr(pool_module, "CALL_MARGIN_S", 0.3)
        t0 = time.monotonic()
        [stuck] = pool.run([ToolCall("where", "hang")], timeout_s=0.2)
        assert stuck.error == "ToolLimitExceeded" and time.monotonic() - t0 < 10
        assert stuck.worker == tool and abs(stuck.started - time.time()) < 10  # (its span)
        # A tool that exits its thread fails its call only.
        [exited] = pool.run([ToolCall("where", "exit")], timeout_s=5)
        assert (exited.error, exited.output) == ("ToolFailed", "SystemExit: 3")
        # Time a call waits for a thread behind other jobs' calls does not count: another
        # job's turn queued behind a turn of long calls comes back whole, though its wait
        # is longer than its limit and both margins (past which it once failed).
        monkeypatch.setattr(pool_module, "MARGIN_S", 0.3)
        threads = worker_info(client)[tool]["nthreads"]
        long_turn = [ToolCall("where", f"nap{i}:0.6") for i in range(2 * threads)]
        ahead = threading.Thread(target=pool.run, args=(long_turn, 2.0))
        ahead.start()
        time.sleep(0.3)  # (its calls are queued on the worker first)
        other = ToolPool(client, {"calc": Calculator()}, job="job-other")
        assert [r.output for r in other.run([ToolCall("calc", "6*7")], timeout_s=0.1)] == ["42"]
        ahead.join(30)
        # A driver that goes away mid-turn (its client closed, so its task is cancelled):
        # the calls of its turn that have not started never run.
        from plexrl_dask.tools.calls import call_threads, run_calls

        def waiting(dask_worker=None) -> int:
            return call_threads(1).waiting()

        class Noted:  # (a call of 0.3 s that notes it ran)
            name = "noted"

            def run(self, text: str) -> str:
                with open(tmp_path / "ran", "a") as f:
                    f.write(text + "\n")
                time.sleep(0.3)
                return text

        doomed = distributed.Client(cluster.scheduler_address, set_as_default=False)
        naps = [ToolCall("noted", str(i)) for i in range(8 * threads)]
        doomed.submit(
            run_calls, naps, {"noted": Noted()}, True, 30.0, "job-doomed", workers=[tool], pure=False
        )
        deadline = time.monotonic() + 30
        while client.run(waiting, workers=[tool])[tool] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        doomed.close()
        deadline = time.monotonic() + 10
        while client.run(waiting, workers=[tool])[tool]:
            assert time.monotonic() < deadline, "a cancelled turn's calls still wait to run"
            time.sleep(0.05)
        time.sleep(0.5)  # (the calls running then end)
        assert len((tmp_path / "ran").read_text().split()) < 4 * threads
        # ... on threads every such task on the worker shares: at most its threads at once.
        naps = [ToolCall("where", f"nap{i}") for i in range(2 * threads + 1)]
        spans = []
        for r in pool.run(naps, timeout_s=10):
            t0, t1, name = r.output.split()
            spans.append((float(t0), float(t1)))
            assert name == "tool-0" and r.worker == tool
        at_once = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
        assert min(2, threads) <= at_once <= threads
        # bench.agentic's hostile programs, each a call through a pool to the tool worker:
        # none escapes (a file outside, a connection, a process left, a limit overrun, a
        # secret read), and the worker's pool serves on.
        suite = hostile_suite(client, tmp_path)
        # (without memory cgroups a program has too few processes to pass the call's bound
        # together: no program escapes either way)
        assert [n for n, v in suite["programs"].items() if v["escaped"]] == [], suite
        assert suite["processes_left"] == [] and suite["files_written_outside"] == []
        assert suite["programs"]["fork bomb"]["error"] and suite["programs"]["memory"]["error"]
        assert pool.run([ToolCall("calc", "2*3")], timeout_s=10)[0].output == "6"
        # The tool worker dies while a sandboxed program of the same turn runs, each call an
        # episode's: both calls are failed results, each episode's observation says so and
        # its next turn is sampled, and the program does not outlive its worker.
        from plexrl_dask.rl.episodes import run_episodes
        from plexrl_dask.shared.types import SamplingParams
        from plexrl_dask.tasks.agentic import ProgramTask
        from tests.test_agentic import ScriptedSampler

        t0 = time.monotonic()
        sleeper = "<py>import time\nprint('up', flush=True)\ntime.sleep(60)</py>"
        sampler = ScriptedSampler(["<where>die:1.0</where>", sleeper])
        problems = ProgramTask(seed=1, limits=FAST).problems(0, 2)
        params = SamplingParams(n=1, max_tokens=64, seed=1)
        batch = run_episodes(sampler, pool, problems, params, 1, 2, 200, tool_timeout_s=10)
        assert time.monotonic() - t0 < 30
        for [episode] in batch.groups:
            first, answer = episode.turns
            assert first.result.error == "ToolWorkerLost" and answer.text == "42\n"
            seen = sampler.tok.tok.decode(list(first.observation))
            assert seen.startswith("<out>error: the worker running the call was lost"), seen
        deadline = time.monotonic() + 15
        while sandbox_processes(FAST) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sandbox_processes(FAST) == []
        client.wait_for_workers(2, timeout=60)  # (its nanny starts it again)
        deadline = time.monotonic() + 30
        while not tool_workers(client) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.run([ToolCall("calc", "1+1")], timeout_s=10)[0].output == "2"
        _a_wait_that_times_out_leaves_the_client_working(client, pool)
    # A report posted through a client that is gone is logged, never raised.
    post_event(client, TOOL_TOPIC, {"job": "job-tools", "spans": []})
    # Without tool workers, calls run on the driver.
    local = ToolPool(None, {"calc": Calculator()})
    assert local.run([ToolCall("calc", "2*21")], timeout_s=5)[0].output == "42"
    local.close()


def _a_wait_that_times_out_leaves_the_client_working(client, pool) -> None:
    """A timed wait gives up on a fetch that is queued behind the client's gather semaphore
    (distributed's ``Future.result(timeout)`` would cancel it there and leave the client
    returning no result ever again: plexrl_dask.driver.waits); after it, results still come."""
    from plexrl_dask.driver.waits import result

    semaphore = getattr(client, "_gather_semaphore", None)
    if not isinstance(semaphore, asyncio.Semaphore):
        pytest.skip("this distributed has no client gather semaphore to hold")
    future = client.submit(sum, [1, 2], pure=False)
    assert result(future, timeout=30) == 3

    async def hold_all() -> int:
        n = 0
        while not semaphore.locked():
            await semaphore.acquire()
            n += 1
        return n

    async def release(n: int) -> None:
        for _ in range(n):
            semaphore.release()

    held = client.sync(hold_all)
    later = client.submit(sum, [3, 4], pure=False)
    with pytest.raises(errors.RequestTimeout):
        result(later, timeout=0.5)
    client.sync(release, held)
    assert result(later, timeout=30) == 7
    assert result(client.submit(sum, [5, 6], pure=False), timeout=30) == 11
    assert pool.run([ToolCall("calc", "2+2")], timeout_s=10)[0].output == "4"


def test_identical_calls_of_a_turn_run_once_unless_the_tool_is_not_pure():
    """The samples of a group often make the same call: it runs once, and each identical
    call gets its result, marked shared, in its own place; a failure is shared the same
    way. A tool that says it is not pure has every call run."""

    class Counted:
        name = "count"

        def __init__(self, pure: bool = True) -> None:
            self.pure, self.ran, self.lock = pure, [], threading.Lock()

        def run(self, text: str) -> str:
            with self.lock:
                self.ran.append(text)
            if text == "bad":
                raise errors.ToolError("bad input")
            return text.upper()

    tool = Counted()
    pool = ToolPool(None, {"count": tool, "calc": Calculator()})
    calls = [
        ToolCall("count", "a"),
        None,
        ToolCall("count", "b"),
        ToolCall("count", "a"),
        ToolCall("calc", "a"),  # (another tool, the same text: a call of its own)
        ToolCall("count", "bad"),
        ToolCall("count", "bad"),
    ]
    got = pool.run(calls, timeout_s=5)
    assert sorted(tool.ran) == ["a", "b", "bad"]
    assert [r and (r.output, r.error, r.shared) for r in got] == [
        ("A", None, False),
        None,
        ("B", None, False),
        ("A", None, True),
        (got[4].output, "InvalidToolCall", False),
        ("bad input", "ToolError", False),
        ("bad input", "ToolError", True),
    ]
    impure = Counted(pure=False)
    ToolPool(None, {"count": impure}).run([ToolCall("count", "a")] * 3, timeout_s=5)
    assert impure.ran == ["a", "a", "a"]
    pool.close()


def test_a_turn_of_calls_splits_into_strided_shares():
    from plexrl_dask.tools.pool import _shares

    assert _shares(10, 4) == [range(0, 10, 4), range(1, 10, 4), range(2, 10, 4), range(3, 10, 4)]
    assert [list(s) for s in _shares(5, 2)] == [[0, 2, 4], [1, 3]]
    assert _shares(3, 16) == [range(0, 3, 3), range(1, 3, 3), range(2, 3, 3)]
    assert _shares(0, 4) == []


def _pool_running_a_gated_call():
    """Call threads (one) running job "a"'s call "a1", which waits for the gate; the names of
    the calls in the order they ran; a factory of calls that note their name; "a1"."""
    from plexrl_dask.tools.calls import CallThreads

    threads = CallThreads(1)
    gate, ran = threading.Event(), []

    def call(name):
        def run():
            if name == "a1":
                gate.wait(10)
            ran.append(name)
            return ToolResult(name)

        return run

    first = threads.submit(call("a1"), "a")
    while first.started is None:
        time.sleep(0.01)
    return threads, gate, ran, call, first


def test_a_workers_tool_threads_serve_the_jobs_in_turn():
    """One job's many calls queued first do not hold back another job's: the jobs with calls
    waiting take turns, a call each, each job's in the order they came."""
    threads, gate, order, call, first = _pool_running_a_gated_call()
    calls = [threads.submit(call(f"a{i}"), "a") for i in range(2, 6)]
    calls.append(threads.submit(call("b1"), "b"))
    gate.set()
    outputs = [threads.result(c, None, "here").output for c in [first, *calls]]
    assert outputs == ["a1", "a2", "a3", "a4", "a5", "b1"]  # (each its own result)
    assert order == ["a1", "a2", "b1", "a3", "a4", "a5"]


def test_a_cancelled_turn_still_gives_up_on_its_call_stuck_in_a_tool(monkeypatch):
    """A turn's task that is cancelled withdraws its queued calls but still waits out the one
    running (at most its give-up time), so that a call stuck in its tool is given up on and
    its thread replaced, not left holding a thread of the pool for good."""
    from plexrl_dask.tools import calls as calls_module

    threads = calls_module.CallThreads(1)
    monkeypatch.setattr(calls_module, "call_threads", lambda n: threads)
    gate, ran = threading.Event(), []
    # (cancelled once its first call has started)
    monkeypatch.setattr(calls_module, "_task_cancelled", lambda: lambda: bool(ran))

    class Stuck:
        name = "stuck"

        def run(self, text: str) -> str:
            ran.append(text)
            if text == "hang":
                gate.wait(30)
            return text

    t0 = time.monotonic()
    got = calls_module.run_calls(
        [ToolCall("stuck", "hang"), ToolCall("stuck", "never")], {"stuck": Stuck()}, True, 0.3
    )
    assert [r.error for r in got] == ["ToolCancelled"] * 2
    assert 0.3 <= time.monotonic() - t0 < 10 and ran == ["hang"]
    # the stuck call was given up on: another thread serves the next call at once
    late = threads.submit(lambda: ToolResult("late"), "j")
    assert late.done.wait(5), "the stuck call still holds the pool's only thread"
    assert late.result is not None and late.result.output == "late"
    gate.set()


def test_a_cancelled_turn_ends_its_running_sandbox_programs(monkeypatch):
    """A sandboxed program of a turn whose task is cancelled ends then, not at its wall-clock
    limit: nobody reads its output any more, and the tool worker's thread is free again."""
    from dataclasses import replace

    from plexrl_dask.tools import calls as calls_module

    threads = calls_module.CallThreads(1)
    monkeypatch.setattr(calls_module, "call_threads", lambda n: threads)
    cancel_at = time.monotonic() + 1.0  # (once the program runs)
    monkeypatch.setattr(
        calls_module, "_task_cancelled", lambda: lambda: time.monotonic() > cancel_at
    )
    limits = replace(FAST, wall_s=30.0, cpu_s=30)
    program = "import time\nprint('up', flush=True)\ntime.sleep(60)"
    t0 = time.monotonic()
    got = calls_module.run_calls(
        [ToolCall("py", program)], {"py": PythonSandbox(limits)}, True, limits.wall_s + 5
    )
    assert [r.error for r in got] == ["ToolCancelled"]
    assert time.monotonic() - t0 < 10  # (not the program's 30 s)
    deadline = time.monotonic() + 10
    while sandbox_processes(limits) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes(limits) == []


def test_withdrawn_calls_never_run_and_a_running_one_runs_to_its_end():
    """A task that was cancelled takes its calls that have not started out of the queue
    (its driver is gone: nobody reads their results); the other jobs' calls keep their turn;
    a call already running ends as it would."""
    threads, gate, ran, call, first = _pool_running_a_gated_call()
    mine = [first, *(threads.submit(call(f"a{i}"), "a") for i in range(2, 5))]
    other = threads.submit(call("b1"), "b")
    assert threads.waiting() == 4
    # (a task waiting on a call returns None as soon as it is cancelled)
    assert threads.result(mine[1], None, "here", cancelled=lambda: True) is None
    assert threads.withdraw(mine) == 3 and threads.waiting() == 1
    assert threads.withdraw(mine) == 0
    gate.set()
    assert threads.result(other, None, "here").output == "b1"
    assert threads.result(first, None, "here").output == "a1"
    assert ran == ["a1", "b1"] and threads.waiting() == 0


@NAMESPACES
def test_a_program_sees_its_own_host_name_and_ipc_and_the_same_addresses_everywhere():
    """A call's own UTS and IPC namespaces: the host name is the sandbox's on every machine,
    and SysV shared memory a program makes (uncounted by its memory bound) goes with its
    call. Where the kernel lets the server run without address randomisation, a program's
    addresses are the same on every server."""
    assert run("import socket\nprint(socket.gethostname())").output == "sandbox\n"
    key = 0x7E51AB
    made = run(
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        f"print(libc.shmget({key}, 1 << 20, 0o1666) >= 0)"
    )
    assert made.output == "True\n"
    with open("/proc/sysvipc/shm") as f:
        assert not any(line.split()[0] == str(key) for line in f.readlines()[1:])
    allowed = subprocess.run(
        [sys.executable, "-c", "import ctypes, sys\nl = ctypes.CDLL(None)\n"
         "sys.exit(l.personality(l.personality(0xFFFFFFFF) | 0x40000) == -1)"],
        check=False,
    ).returncode == 0  # fmt: skip
    if allowed:
        seen = {PythonSandbox(FAST).run("print(id(object()))") for _ in range(2)}
        assert len(seen) == 1, seen  # (two sandboxes: two servers)


def test_a_call_given_up_on_twice_is_replaced_once():
    """A stuck call given up on, then asked for again when its task was cancelled, costs
    the pool one replacement thread, not two: the pool never runs more calls at once than
    it has threads."""
    from plexrl_dask.tools.calls import CallThreads, ToolCall, run_call

    release = threading.Event()

    class Stuck:
        name = "stuck"

        def run(self, text: str) -> str:
            release.wait(30)
            return text

    def serving() -> int:
        return sum(t.name == "plexrl-tool-call" for t in threading.enumerate())

    before = serving()
    pool, tools = CallThreads(1), {"stuck": Stuck()}
    try:
        job = pool.submit(lambda: run_call(ToolCall("stuck", "a"), tools))
        assert pool.result(job, 0.2, "here").error == "ToolLimitExceeded"
        assert pool.result(job, 0.2, "here").error == "ToolLimitExceeded"  # (asked again)
        time.sleep(0.1)
        assert serving() - before == 2  # (the stuck call's thread and one replacement)
    finally:
        release.set()


def test_a_probe_that_ran_out_of_time_refuses_the_call_rather_than_drop_namespaces(monkeypatch):
    from plexrl_dask.tools import sandbox

    def slow(self, program: str) -> str:
        raise errors.ToolLimitExceeded("the probe ran past its wall-clock limit (in this test)")

    monkeypatch.setattr(sandbox, "_probe", {"ok": False, "failed_at": -1e9})
    monkeypatch.setattr(sandbox.PythonSandbox, "run", slow)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox.sys, "platform", "linux")
    with pytest.raises(errors.ToolError, match="probe"):
        sandbox.isolation()
    assert sandbox._probe["failed_at"] == -1e9  # (not taken for a host without namespaces)


def test_a_program_that_ignores_its_cpu_signal_is_stopped_at_its_cpu_limit():
    program = (
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    )
    res = run(program, SandboxLimits(wall_s=6.0, cpu_s=1, output_bytes=256))
    assert res.error == "ToolLimitExceeded" and "CPU" in res.output, res


#: A program that tries system call ``name`` (numbered for this machine) and prints what it got.
_SYSCALL = (
    "import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\n"
    "n = {{'x86_64': {x86}, 'aarch64': {arm}}}[os.uname().machine]\n"
    "r = l.syscall(n, {args})\nprint(r, ctypes.get_errno())"
)


@pytest.mark.skipif(
    os.uname().machine not in ("x86_64", "aarch64"), reason="the filter knows x86-64 and AArch64"
)
@pytest.mark.parametrize("mode", ["namespaces", "limits"])
def test_a_program_makes_no_namespace_or_key_and_still_forks_and_starts_threads(mode):
    """The system-call filter: no user namespace (where it would mount an unbounded tmpfs),
    no key in the per-uid keyring a later call under the same uid would see, no x32 or
    namespace-making ``clone``; ``clone3`` answered ENOSYS, which the C library falls back
    from, so threads, forks and subprocesses still work, in either isolation mode."""
    if mode == "namespaces" and isolation() != "namespaces":
        pytest.skip("namespaces are not available here")
    sandbox = PythonSandbox(FAST, mode=mode)

    def call(x86: int, arm: int, args: str) -> str:
        return sandbox.run(_SYSCALL.format(x86=x86, arm=arm, args=args))

    eperm, enosys = "-1 1\n", "-1 38\n"
    assert call(272, 97, "0x10000000 | 0x20000") == eperm  # unshare(NEWUSER | NEWNS)
    assert call(248, 217, "b'user', b'plexrl', b'v', 1, -4") == eperm  # add_key (@u)
    assert call(250, 219, "0, -4, 1") == eperm  # keyctl(GET_KEYRING_ID, @u)
    assert call(56, 220, "0x10000000 | 17, 0, 0, 0, 0") == eperm  # clone(NEWUSER)
    assert call(435, 435, "0, 0") == enosys  # clone3
    if os.uname().machine == "x86_64":
        assert call(272 | 0x40000000, 0, "0") == eperm  # (x32's unshare)
    program = (
        "import os, subprocess, sys, threading\nr = []\n"
        "t = threading.Thread(target=r.append, args=(1,))\nt.start()\nt.join()\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(3)\n"
        "print(r, os.waitpid(pid, 0)[1] >> 8, subprocess.run([sys.executable, '-c', "
        "'print(5)'], capture_output=True).stdout)"
    )
    assert sandbox.run(program) == "[1] 3 b'5\\n'\n"


@pytest.mark.skipif(not files_confined(), reason="this kernel has no Landlock")
@pytest.mark.parametrize("mode", ["namespaces", "limits"])
def test_a_program_reads_only_system_and_interpreter_files_and_writes_only_its_own(mode):
    """Landlock, in either mode: a file anyone may read, beside the caller's own (here in the
    directory the tests run from, which is not the system's nor the interpreter's), is
    refused, as is a TCP connection (the limits mode has the network) and a write outside
    the program's directory; its own directory, the standard library, a subprocess of the
    interpreter and /dev/null still work."""
    if mode == "namespaces" and isolation() != "namespaces":
        pytest.skip("namespaces are not available here")
    folder = Path(tempfile.mkdtemp(dir=Path.cwd(), prefix=".plexrl-test-"))
    try:
        folder.chmod(0o755)
        secret = folder / "token"
        secret.write_text("hunter2")
        secret.chmod(0o644)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        program = (
            "import os, socket, subprocess, sys, decimal, sqlite3\n"
            "def attempt(f):\n    try:\n        return f()\n"
            "    except OSError as e:\n        return type(e).__name__\n"
            f"print(attempt(lambda: open({str(secret)!r}).read()))\n"
            f"print(attempt(lambda: os.listdir({str(folder)!r})))\n"
            f"print(attempt(lambda: open({str(folder / 'new')!r}, 'w')))\n"
            f"print(attempt(lambda: socket.create_connection(('127.0.0.1', {port}), 1)))\n"
            "open('mine', 'w').write('ok')\nprint(open('mine').read())\n"
            "print(subprocess.run([sys.executable, '-c', 'print(5)'], capture_output=True,"
            " check=True).stdout.decode().strip())\n"
            "open('/dev/null', 'w').write('x')\nprint(decimal.Decimal('1.5') * 2)"
        )
        with listener:
            out = PythonSandbox(FAST, mode=mode).run(program).splitlines()
        refused = "PermissionError"
        tcp = refused if _confine.landlock_abi() >= 4 or mode == "namespaces" else out[3]
        if mode == "namespaces":
            # (its own mounts hide the folder where it lies under /tmp, as a clone on CI
            # does; elsewhere Landlock refuses it; the machine's mounts are read-only too,
            # which refuses the write first)
            assert out[0] == out[1] and out[0] in (refused, "FileNotFoundError"), out
            assert out[2] in ("OSError", "FileNotFoundError") and out[3] == tcp, out
        else:
            assert out[:4] == [refused, refused, refused, tcp], out
        assert out[4:] == ["ok", "5", "3.0"], out
        assert not (folder / "new").exists()
    finally:
        shutil.rmtree(folder)
