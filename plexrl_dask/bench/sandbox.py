"""Benchmark: what one Python sandbox call costs, against a fresh interpreter per call.

The sandbox runs each call in a fork of a server interpreter (:mod:`plexrl_dask.tools.sandbox`)
with its namespaces, mounts, uid and limits. Two baselines: ``fresh_server``, the same
sandbox with a server started for each call and stopped after it (a fresh interpreter per call
with the same isolation: what each call cost before the server); and ``fresh_interpreter``,
the least a fresh interpreter per call costs: ``python -s -S -B -P -c PROGRAM`` with the same
environment, run by :func:`subprocess.run`, without any isolation or limits. All run the same
short programs (the kind ``ProgramTask`` generates: an expression printed), one call after
another, in blocks that alternate the arms, in this process and nothing else.

Results, per isolation mode this machine has (``namespaces`` where the kernel allows it, and
``limits``): ``<mode>_call_cpu_ms`` and ``<mode>_call_wall_ms`` (CPU and wall milliseconds
per sandbox call: this process's and the server's with its ended calls'),
the same for ``<mode>_fresh_server_...`` and ``fresh_interpreter_...`` (this process's and
the ended interpreters'), and the ratios ``<mode>_call_cpu_ratio_vs_fresh_server``,
``<mode>_call_cpu_ratio_vs_fresh_interpreter`` and their ``wall`` counterparts (the
sandbox ÷ the baseline; below 1: cheaper). ``outputs_identical``: every call's output the
same in every arm.

Run: ``python -m plexrl_dask.bench.sandbox --json OUT [--quick]`` (``--quick``: a fifth of
the calls).
"""

from __future__ import annotations

import resource
import subprocess
import time
from collections.abc import Callable

from plexrl_dask.bench.common import median, parser, report
from plexrl_dask.tools.sandbox import (
    PythonSandbox,
    SandboxLimits,
    SandboxServer,
    interpreter,
    isolation,
    servers_cpu_seconds,
)

#: Programs of the kind ``ProgramTask`` generates.
PROGRAMS = (
    "print(sum(range(731)))",
    "print(517*342%61)",
    "print(len(str(7**45)))",
    "print(sorted([412, 87, 230])[1])",
)


def fresh_interpreter(program: str) -> str:
    """The baseline: a fresh interpreter per call, nothing else."""
    cmd = [interpreter(), "-s", "-S", "-B", "-P", "-c", program]
    done = subprocess.run(cmd, env={"PYTHONHASHSEED": "0"}, capture_output=True, timeout=30)
    return done.stdout.decode()


def fresh_server(mode: str) -> Callable[[str], str]:
    """The first baseline: the sandbox, a server started for the call and stopped after it
    (its CPU then counts in this process's ended children's)."""
    sandbox = PythonSandbox(SandboxLimits(), mode)

    def run(program: str) -> str:
        server = SandboxServer(mode)
        try:
            return sandbox.run(program, server)
        finally:
            server.stop()

    return run


def cpu_seconds() -> float:
    """This process's CPU seconds, its ended children's and its sandbox servers'."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime
    return used + servers_cpu_seconds()


def measure(run: Callable[[str], str], calls: int) -> tuple[float, float, list[str]]:
    """CPU and wall seconds per call of ``calls`` calls of ``run``, and their outputs."""
    outputs = []
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    for i in range(calls):
        outputs.append(run(PROGRAMS[i % len(PROGRAMS)]))
    wall = time.perf_counter() - t0
    return (cpu_seconds() - cpu0) / calls, wall / calls, outputs


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    blocks, calls = 5, 20 if args.quick else 100
    modes = sorted({isolation(), "limits"})
    arms: dict[str, Callable[[str], str]] = {"fresh_interpreter": fresh_interpreter}
    for mode in modes:
        arms[mode] = PythonSandbox(SandboxLimits(), mode).run
        arms[f"{mode}_fresh_server"] = fresh_server(mode)
    for run in arms.values():  # (warm: the servers start, the files are in the page cache)
        run(PROGRAMS[0])
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    outputs: dict[str, list[str]] = {name: [] for name in arms}
    for block in range(blocks):
        order = list(arms) if block % 2 == 0 else list(reversed(arms))
        for name in order:
            cpu, wall, out = measure(arms[name], calls)
            samples[name].append((cpu, wall))
            outputs[name] += out
    per = {
        name: (median([c for c, _ in s]) * 1e3, median([w for _, w in s]) * 1e3)
        for name, s in samples.items()
    }
    base_cpu, base_wall = per["fresh_interpreter"]
    results: dict[str, object] = {
        "fresh_interpreter_cpu_ms": base_cpu,
        "fresh_interpreter_wall_ms": base_wall,
    }
    for mode in modes:
        cpu, wall = per[mode]
        fresh_cpu, fresh_wall = per[f"{mode}_fresh_server"]
        results |= {
            f"{mode}_call_cpu_ms": cpu,
            f"{mode}_call_wall_ms": wall,
            f"{mode}_fresh_server_cpu_ms": fresh_cpu,
            f"{mode}_fresh_server_wall_ms": fresh_wall,
            f"{mode}_call_cpu_ratio_vs_fresh_server": cpu / fresh_cpu,
            f"{mode}_call_wall_ratio_vs_fresh_server": wall / fresh_wall,
            f"{mode}_call_cpu_ratio_vs_fresh_interpreter": cpu / base_cpu,
            f"{mode}_call_wall_ratio_vs_fresh_interpreter": wall / base_wall,
        }
    results["outputs_identical"] = all(o == outputs["fresh_interpreter"] for o in outputs.values())
    config = {"blocks": blocks, "calls_per_block": calls, "programs": PROGRAMS, "modes": modes}
    report("sandbox", results, {"outputs_identical": "true"}, config, args.json)


if __name__ == "__main__":
    main()
