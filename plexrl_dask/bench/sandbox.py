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

**Turns.** Then a turn of :data:`TURN_CALLS` distinct calls at a time through
:class:`~plexrl_dask.tools.pool.ToolPool` on a ``local_cluster`` with one tool worker (what an
agentic episode waits for between its model turns), against the same calls sent as one Dask
task each to that worker (``task_per_call``), turns alternating between the arms, for the
calculator and for the sandbox: ``turn_<tool>_wall_ms`` and
``turn_<tool>_task_per_call_wall_ms`` (medians), ``turn_<tool>_wall_ratio_vs_task_per_call``,
and ``turn_outputs_identical``.

Run: ``python -m plexrl_dask.bench.sandbox --json OUT [--quick]`` (``--quick``: a fifth of
the calls).
"""

from __future__ import annotations

import resource
import subprocess
import time
from collections.abc import Callable

from distributed import Client

from plexrl_dask.bench.common import median, parser, report
from plexrl_dask.cluster import local_cluster
from plexrl_dask.driver.waits import result
from plexrl_dask.tools.calculator import Calculator
from plexrl_dask.tools.calls import ToolCall, run_call
from plexrl_dask.tools.pool import ToolPool, tool_workers
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


#: Calls per measured turn (one step of 8 prompts × 8 samples, each making a call).
TURN_CALLS = 64


def turn_calls(tool: str, turn: int) -> list[ToolCall]:
    """Turn ``turn``'s distinct calls of ``tool`` (no two alike: every one runs)."""
    if tool == "calc":
        return [ToolCall("calc", f"{i}*{turn + 7}") for i in range(TURN_CALLS)]
    return [ToolCall("python", f"print({i}*{turn + 7})") for i in range(TURN_CALLS)]


def measure_turns(turns: int) -> dict[str, object]:
    """The turn results (see the module docstring)."""
    tools = {"calc": Calculator(), "python": PythonSandbox()}
    out: dict[str, object] = {}
    identical = True
    with (
        local_cluster(n_workers=1, tool_workers=1) as cluster,
        Client(cluster) as client,
    ):
        pool = ToolPool(client, tools)
        [worker] = tool_workers(client)

        def task_per_call(calls: list[ToolCall]) -> list[str]:
            futures = [
                client.submit(run_call, c, tools, workers=[worker], pure=False) for c in calls
            ]
            return [r.output for r in result(futures, 60)]

        def pooled(calls: list[ToolCall]) -> list[str]:
            return [r.output for r in pool.run(calls, 10)]  # type: ignore[union-attr]

        for tool in tools:
            arms = {"pool": pooled, "task_per_call": task_per_call}
            for run in arms.values():  # (warm: the sandbox server starts)
                run(turn_calls(tool, -1)[:2])
            walls: dict[str, list[float]] = {name: [] for name in arms}
            for turn in range(turns):
                calls = turn_calls(tool, turn)
                got = []
                for name in list(arms) if turn % 2 == 0 else list(reversed(arms)):
                    t0 = time.perf_counter()
                    got.append(arms[name](calls))
                    walls[name].append(time.perf_counter() - t0)
                identical &= got[0] == got[1]
            pool_ms, task_ms = (median(walls[n]) * 1e3 for n in arms)
            out |= {
                f"turn_{tool}_wall_ms": pool_ms,
                f"turn_{tool}_task_per_call_wall_ms": task_ms,
                f"turn_{tool}_wall_ratio_vs_task_per_call": pool_ms / task_ms,
            }
        pool.close()
    out["turn_outputs_identical"] = identical
    return out


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
    turns = 6 if args.quick else 20
    results |= measure_turns(turns)
    config = {
        "blocks": blocks,
        "calls_per_block": calls,
        "programs": PROGRAMS,
        "modes": modes,
        "turns": turns,
        "turn_calls": TURN_CALLS,
    }
    targets = {"outputs_identical": "true", "turn_outputs_identical": "true"}
    report("sandbox", results, targets, config, args.json)


if __name__ == "__main__":
    main()
