"""Helpers shared by the benchmarks: argument parsing, timing, JSON output, a summary table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
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
            "machine": machine(),
            "config": config,
            "results": results,
            "targets": targets,
        }
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(payload, f, indent=2)
