"""Helpers shared by the benchmarks: argument parsing, timing, JSON output, a summary table."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (under 2 minutes)")
    return p


def time_call(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(arms: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Wall times of each arm, alternating arms on every repetition so slow drift of the
    machine (other load, thermal) hits every arm alike."""
    out: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(reps):
        for name, fn in arms.items():
            out[name].append(time_call(fn))
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def machine() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


#: The longest value the console table prints whole (longer dicts and lists: the JSON).
SHOWN_MAX = 200


def report(
    name: str,
    results: dict[str, Any],
    targets: dict[str, str],
    config: dict[str, Any],
    out: str | None,
) -> None:
    """Print a table of ``results`` (with targets) and write JSON to ``out``."""
    table = Table(title=f"plexrl_dask.bench.{name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target")
    for key, value in results.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        if len(shown) > SHOWN_MAX and isinstance(value, (dict, list, tuple)):
            shown = f"({len(value)} entries: see the JSON)"  # (a table of its own)
        table.add_row(key, shown, targets.get(key, ""))
    Console().print(table)
    write_json(name, results, targets, config, out)


def write_json(
    name: str,
    results: dict[str, Any],
    targets: dict[str, str],
    config: dict[str, Any],
    out: str | None,
) -> None:
    """Write the benchmark's JSON to ``out`` (nothing when None): what :func:`report` writes,
    also usable for partial results while a long benchmark runs."""
    if out:
        payload = {
            "benchmark": name,
            "command": " ".join(
                [os.path.basename(sys.executable), "-m", f"plexrl_dask.bench.{name}", *sys.argv[1:]]
            ),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "commit": source_commit(),
            "machine": machine(),
            "config": config,
            "results": results,
            "targets": targets,
        }
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(payload, f, indent=2)


def source_commit() -> str | None:
    """The commit of the code measured (``git rev-parse HEAD`` of this package's checkout),
    ``+dirty`` when the measured files differ from it; None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                "plexrl_dask",
                "plugins",
                "state_store",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (read from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _threads(pids: list[int]) -> dict[int, int]:
    """Every thread of ``pids``: its process, by thread id."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            out.update({int(tid): pid for tid in os.listdir(f"/proc/{pid}/task")})
    return out


@contextlib.contextmanager
def confined(workers: int) -> Iterator[list[int]]:
    """For the block, this process and every process it started (a local cluster's
    scheduler in it, nannies, workers, tool workers, their sandbox servers), every thread of
    each, on the first ``workers`` cores it may use; yields those cores. After it, each
    thread gets its cores back (one started meanwhile: its process's). What ``--cores
    equal`` runs a layout in: as many cores as it holds workers, its drivers, scheduler and
    tools on them too, as in a pool, where they share its workers' cores. Linux only."""
    cores = sorted(os.sched_getaffinity(0))[: max(1, workers)]
    saved: dict[int, set[int]] = {}
    for tid in _threads(_process_tree(os.getpid())):
        with contextlib.suppress(OSError):  # (a thread that ended, or not ours to move)
            saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
    try:
        yield cores
    finally:
        mine = saved.get(os.getpid(), set(os.sched_getaffinity(0)))
        for tid, pid in _threads(_process_tree(os.getpid())).items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, saved.get(tid) or saved.get(pid) or mine)


def add_cores_option(p: argparse.ArgumentParser) -> None:
    """``--cores free|equal``: what machine a layout's run gets (see :func:`confinement`)."""
    p.add_argument(
        "--cores",
        choices=("free", "equal"),
        default="free",
        help="free: every layout's processes float over all the cores (an isolated job's "
        "driver and scheduler then run beside its worker, on cores no worker is charged for); "
        "equal: each layout's run, and each isolated job's, on as many cores as it holds "
        "workers, its drivers, scheduler and tools on them too",
    )


def confinement(cores: str) -> Callable[[Any], Any] | None:
    """``run_mode``'s ``confine`` for ``--cores``: None (free), or :func:`confined` to as
    many cores as the run holds workers (equal)."""
    if cores == "free":
        return None
    return lambda held: confined(len(held))
