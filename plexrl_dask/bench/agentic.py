"""Benchmark: agentic jobs (tool calls between turns) isolated and multiplexed.

The agentic mix (:func:`~plexrl_dask.rl.catalog.agentic_jobs`): ``multiply3`` calls the
calculator, ``program`` runs each of its calls in the Python sandbox (a process forked per
call), beside two single-turn jobs of the standard mix. One ``local_cluster`` with as many
model workers as cores and one tool worker (without the GPU resource, running
``plexrl.local-cluster.tool-threads`` calls at once: the tool calls run there). Each job first runs its supervised warm-up (outside every measurement); then every
layout of every mode that fits (:func:`~plexrl_dask.rl.modes.layouts`) runs all jobs to the
end, as in ``bench.multiplex``, whose cost ledger this uses (:mod:`plexrl_dask.rl.ledger`:
cost = reserved worker-seconds; isolated jobs one after another, the pool for its makespan;
tool workers are not counted in any mode, since every mode runs the same calls on them).

Results: ``cost_ratio_vs_colocated`` (the cheapest pool ÷ the cheapest colocated layout,
those two layouts rerun back to back after the sweep, ``--pairs`` times, which goes first
alternating: the median of the pairs' ratios; ``sweep_cost_ratio_vs_colocated``, the same
layouts' ratio in the sweep, was the figure before: one run of each layout, which moved with
the machine by more than the gap), and
``cost_ratio_vs_split_async`` (the cheapest pool ÷ split-async's cheapest layout, in the
sweep), ``idle_fraction`` per mode, ``bench.multiplex``'s ``longest_job`` figures,
``busy_ratio_vs_colocated`` and ``no_idle_cost_ratio_vs_colocated``, each job's
``colocated_wall_s``, and from the cheapest pool's run:
``tool_calls`` and ``tool_runs`` (the calls the policy made; those that ran: identical calls of
a turn run once), ``turns_p50``/``turns_max`` (model turns per episode), ``tool_s_p50``/
``tool_s_p99`` (seconds a call that ran took on its tool worker; before identical calls ran
once, every call ran and counted), ``distributions`` (per agentic job: its episodes by number
of model turns, and percentiles of its calls' seconds), ``reward_first``/``reward_last`` per
agentic job (mean reward of its first and last 5 steps), ``reward_trajectories_identical``
(every job's reward and loss per step the same in every synchronous layout: colocated and
multiplexed), ``prefix_cache_hit_rate`` (the cheapest pool's turn prompts: tokens a replica's
prefix cache held ÷ their tokens; :mod:`plexrl_dask.worker.prefix_cache`; ``prefix_cache``
has the counts), and
``longest_job_tool_s_ratio`` (the longest job's tool seconds, summed over its calls that ran,
in the cheapest pool ÷ colocated: the same calls, slower where they share the cores with a busy
model worker), ``cpu_s`` (CPU seconds each layout's run took, colocated and the cheapest pool:
the model workers, the tool workers with their sandboxes, and this process, which is the driver
of every job and the local cluster's scheduler), and
``paired_cost_ratios`` (the pairs behind the first figure: its spread on this machine), and
``sandbox_escapes`` with ``sandbox_programs``: a fixed suite of hostile programs run in the
sandbox in the same run, an escape being a file written outside it (in ``/tmp``, the run's
temporary directory, or any directory the machine leaves writable to anyone), a connection made, a
process it left running, a program that ran past its limits unstopped, one that read what
only root may read, megabytes of output not stopped with a limit error, or processes of one
program that held more memory together than the call's bound (``memory in processes``, which
ends by itself only if all its processes held theirs at once).

On 2 cores the tool worker's interpreters share the cores with the model workers and the
driver: a pool, whose workers are busy while tools run, pays for that more than an isolated
job, whose idle worker leaves a core to the tools. Clusters run tools on other machines.

Run: ``python -m plexrl_dask.bench.agentic --json OUT [--quick] [--pairs N] [--tool-cpus LIST]
[--cores free|equal]`` (``--quick``: half the GRPO steps and one pair; the warm-ups, not
measured, stay whole: a quarter of them left both agentic jobs at a reward of 0, nothing to
learn from;
``--tool-cpus``: the tool worker and its sandboxes bound to those cores, as tools on machines
of their own; by default they float over the cores the model workers use; ``--cores``: see
``bench.multiplex``, the same definition, tools included).
"""

from __future__ import annotations

import collections
import os
import resource
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import dask
from distributed import Client
from rich.console import Console

import plexrl_dask as plexrl
from plexrl_dask.bench.common import add_cores_option, confinement, median, parser, report
from plexrl_dask.rl.catalog import agentic_jobs
from plexrl_dask.rl.ledger import cost_ratio, percentile, where_cost_goes
from plexrl_dask.rl.modes import (
    ModeRun,
    cheapest,
    layouts,
    run_mode,
    trajectories_identical,
)
from plexrl_dask.rl.report import reward_start_end
from plexrl_dask.rl.warmup import warm_start
from plexrl_dask.tasks.agentic import is_agentic
from plexrl_dask.tools import PythonSandbox, SandboxLimits, ToolCall, ToolPool, isolation
from plexrl_dask.tools.pool import tool_workers
from plexrl_dask.tools.sandbox import sandbox_processes, servers_cpu_seconds

MODES = ("colocated", "split-async", "multiplexed")
TARGETS = {
    "cost_ratio_vs_colocated": "<= 0.70",
    "reward_trajectories_identical": "true",
    "sandbox_escapes": "0",
}
PREFIX_COUNTS = ("lookups", "hits", "tokens", "hit_tokens")
#: The hostile suite's limits (short, so that the suite is quick).
SUITE_LIMITS = SandboxLimits(wall_s=2.0, cpu_s=2, output_bytes=256)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=None, help="model workers (default: the cores)")
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="rerun the cheapest colocated and pooled layouts in turn this often (default 4; "
        "--quick: 1)",
    )
    p.add_argument(
        "--tool-cpus",
        default=None,
        help="bind the tool worker and its sandboxes to these cores (e.g. 0), as tools on "
        "machines of their own (plexrl.local-cluster.tool-cpus; default: they float)",
    )
    add_cores_option(p)
    args = p.parse_args()
    if args.cores == "equal" and args.tool_cpus is not None:
        p.error("--cores equal runs the tools on each layout's cores: no --tool-cpus with it")
    confine = confinement(args.cores)
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 4)
    console = Console()
    workers_n = args.workers or os.cpu_count() or 1
    started = time.perf_counter()
    specs = agentic_jobs()
    if args.quick:  # (half the steps; the warm-ups whole: see the module docstring)
        specs = [replace(j, grpo=replace(j.grpo, steps=j.grpo.steps // 2)) for j in specs]
    with (
        dask.config.set({"plexrl.local-cluster.tool-cpus": args.tool_cpus}),
        tempfile.TemporaryDirectory(prefix="plexrl-bench-agentic-") as tmp,
        plexrl.local_cluster(n_workers=workers_n, tool_workers=1) as cluster,
        Client(cluster) as client,
    ):
        runtime = plexrl.Runtime(client, job="bench-agentic")
        tools = set(tool_workers(client))
        workers = sorted(a for a in plexrl.worker_info(client) if a not in tools)
        t0 = time.perf_counter()
        checkpoints = warm_start(runtime, specs, Path(tmp) / "warmup")
        warmup_s = time.perf_counter() - t0
        console.print(f"warm-up of {len(specs)} jobs: {warmup_s:.0f}s (not measured)")
        runs: list[ModeRun] = []
        for mode in MODES:
            for layout in layouts(mode, len(workers)):
                t0 = time.perf_counter()
                before, cpu = prefix_totals(client), cpu_seconds(client, tools)
                run = run_mode(runtime, specs, layout, checkpoints, workers, confine=confine)
                after, cpu_after = prefix_totals(client), cpu_seconds(client, tools)
                run.extra["prefix_cache"] = {k: after[k] - before[k] for k in after}
                run.extra["cpu_s"] = {k: cpu_after[k] - cpu[k] for k in cpu}
                runs.append(run)
                s = run.ledger.summary()
                console.print(
                    f"{layout.label}: cost {s['cost_worker_seconds']:.1f} worker-s, idle "
                    f"{s['idle_fraction']:.2f} ({time.perf_counter() - t0:.0f}s)"
                )
        paired = paired_ratios(
            runtime, specs, runs, checkpoints, workers, pairs, console, args.cores
        )
        suite = hostile_suite(client, Path(tmp))
    results = summarise(runs, specs, suite)
    # The target's figure: the pairs' median where there are pairs. The sweep runs each
    # layout once, colocated first: that one run came out cheaper than each of its four
    # reruns in three runs and dearer than each in a fourth. The sweep's ratio is kept too.
    results["sweep_cost_ratio_vs_colocated"] = results["cost_ratio_vs_colocated"]
    results["paired_cost_ratios"] = paired
    # (the whole run's seconds, cluster start to the hostile suite's end, and its warm-ups')
    results["wall_s"], results["warmup_s"] = time.perf_counter() - started, warmup_s
    if paired:
        results["cost_ratio_vs_colocated"] = median(paired)
    config = {
        "jobs": [s.describe() for s in specs],
        "workers": workers_n,
        "tool_workers": 1,
        "quick": args.quick,
        "pairs": pairs,
        "tool_cpus": args.tool_cpus,
        "cores": args.cores,
        "sandbox_isolation": isolation(),
    }
    report("agentic", results, TARGETS, config, args.json)


def paired_ratios(
    runtime: plexrl.Runtime,
    specs: list[Any],
    runs: list[ModeRun],
    checkpoints: dict[str, dict[str, Any]],
    workers: list[str],
    pairs: int,
    console: Console,
    cores: str = "free",
) -> list[float]:
    """The cheapest pool's cost ÷ the cheapest colocated layout's, each pair of the two run
    again back to back (``pairs`` times), which one goes first alternating from pair to pair:
    on a machine whose speed drifts between the sweep's layouts, the spread of ratios
    measured moments apart, with no layout always the first of its pair (``cores``: as
    ``--cores``)."""
    best = cheapest(runs, ("colocated", "multiplexed"))
    if len(best) < 2:
        return []

    def cost_of(mode: str) -> float:
        run = run_mode(
            runtime, specs, best[mode].layout, checkpoints, workers, confine=confinement(cores)
        )
        return run.ledger.summary()["cost_worker_seconds"]

    out = []
    for i in range(pairs):
        order = ("colocated", "multiplexed") if i % 2 == 0 else ("multiplexed", "colocated")
        cost = {m: cost_of(m) for m in order}
        costs = [cost["colocated"], cost["multiplexed"]]
        out.append(costs[1] / costs[0])
        console.print(f"pair {i + 1}/{pairs}: colocated {costs[0]:.1f}, pool {costs[1]:.1f}")
    return out


def summarise(runs: list[ModeRun], specs: list[Any], suite: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's results (see the module docstring) from its runs and the suite's."""
    best = cheapest(runs, MODES)
    mux = best["multiplexed"]
    colocated = best["colocated"].ledger
    costs = where_cost_goes(mux.ledger, colocated)
    longest = costs["longest_job"]
    identical, trained = trajectories_identical(runs, [s.name for s in specs])
    episodes = mux.extra.get("episodes", {})
    turns = [t for e in episodes.values() for t in e["turns"]]
    tool_s = [t for e in episodes.values() for t in e["tool_s"]]
    agentic = [s.name for s in specs if is_agentic(s.task)]
    alone_tool_s = tool_seconds(best["colocated"], longest)
    return {
        "cost_ratio_vs_colocated": cost_ratio(mux.ledger, best["colocated"].ledger),
        "cost_ratio_vs_split_async": cost_ratio(mux.ledger, best["split-async"].ledger)
        if "split-async" in best
        else None,
        "idle_fraction": {m: r.ledger.idle_fraction() for m, r in best.items()},
        # where the pool's cost goes with a fixed set of jobs (as in bench.multiplex)
        **costs,
        "colocated_wall_s": {j.job: j.wall_s for j in colocated.jobs},
        "longest_job_tool_s_ratio": tool_seconds(mux, longest) / alone_tool_s
        if alone_tool_s
        else None,
        "cpu_s": {m: best[m].extra["cpu_s"] for m in ("colocated", "multiplexed")},
        "tool_calls": sum(e.get("tool_calls", 0) for e in episodes.values()),
        "tool_runs": len(tool_s),
        "turns_p50": percentile(turns, 0.5) if turns else None,
        "turns_max": max(turns, default=None),
        "tool_s_p50": percentile(tool_s, 0.5) if tool_s else None,
        "tool_s_p99": percentile(tool_s, 0.99) if tool_s else None,
        "distributions": {job: distribution(e) for job, e in episodes.items()},
        "prefix_cache_hit_rate": hit_rate(mux.extra["prefix_cache"]),
        "prefix_cache": mux.extra["prefix_cache"],
        "reward_first": {n: reward_start_end(mux.records[n])[0] for n in agentic},
        "reward_last": {n: reward_start_end(mux.records[n])[1] for n in agentic},
        "reward_trajectories_identical": identical,
        "trajectory_steps_trained": trained,
        "sandbox_programs": len(suite["programs"]),
        "sandbox_escapes": sum(bool(v["escaped"]) for v in suite["programs"].values()),
        "sandbox": suite,
        "best_layout": {m: r.layout.label for m, r in best.items()},
        "layouts": [{"layout": r.layout.label, **r.ledger.summary()} for r in runs],
    }


def distribution(episodes: dict[str, Any]) -> dict[str, Any]:
    """One agentic job's measured distributions in a run: episodes by their number of model
    turns, and the seconds of its calls that ran (percentiles)."""
    turns, tool_s = episodes["turns"], episodes["tool_s"]
    return {
        "episodes": len(turns),
        "turns": {str(n): turns.count(n) for n in sorted(set(turns))},
        "tool_calls": episodes.get("tool_calls", 0),
        "tool_runs": len(tool_s),
        "tool_s": {f"p{round(q * 100)}": percentile(tool_s, q) for q in (0.1, 0.5, 0.9, 0.99)}
        | {"max": max(tool_s)}
        if tool_s
        else None,
    }


def tool_seconds(run: ModeRun, job: str) -> float:
    """``job``'s tool seconds in ``run``, summed over its calls that ran (0: none)."""
    return sum(run.extra.get("episodes", {}).get(job, {}).get("tool_s", []))


def _cpu_seconds() -> float:
    """This process's CPU seconds, its ended children's and its sandbox servers' (their ended
    calls' included): a tool worker's sandboxes."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    ended = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return ended + servers_cpu_seconds()


def cpu_seconds(client: Client, tools: set[str]) -> dict[str, float]:
    """CPU seconds so far: the model workers', the tool workers' (with their sandboxes) and
    this process's (the jobs' drivers and, in a local cluster, the scheduler)."""
    out = {"model_workers": 0.0, "tool_workers": 0.0, "driver_and_scheduler": _cpu_seconds()}
    for addr, seconds in client.run(_cpu_seconds).items():
        out["tool_workers" if addr in tools else "model_workers"] += seconds
    return out


def _holder_prefix_totals(dask_worker: Any) -> dict[str, int]:
    from plexrl_dask.worker.holder import holder_of

    holder = holder_of(dask_worker)
    if holder is None:
        return {}
    status = holder.status()
    out = {k: status["counters"][f"prefix_{k}"] for k in PREFIX_COUNTS}
    for replica in status["replicas"].values():
        for k in PREFIX_COUNTS:
            out[k] += (replica["prefix_cache"] or {}).get(k, 0)
    return out


def prefix_totals(client: Client) -> dict[str, int]:
    """The prefix caches' counters summed over every worker's replicas, live and dropped."""
    out = dict.fromkeys(PREFIX_COUNTS, 0)
    for totals in client.run(_holder_prefix_totals).values():
        for k, v in totals.items():
            out[k] += v
    return out


def hit_rate(counts: dict[str, int]) -> float | None:
    """Turn prompts' tokens not prefilled again ÷ their tokens (None: no turn prompt)."""
    return counts["hit_tokens"] / counts["tokens"] if counts["tokens"] else None


def writable_directories(budget_s: float = 5.0) -> list[Path]:
    """The directories anyone may write in (``o+w``), found walking the file system from
    ``/``, the shallowest first, for ``budget_s`` at most (``/proc`` and ``/sys`` aside,
    symbolic links not followed, nor directories others may not enter: nothing under them
    is anyone's to reach): where a program that got past the sandbox's mounts could leave a
    file."""
    found, queue, end = [], collections.deque(["/"]), time.monotonic() + budget_s
    while queue and time.monotonic() < end:
        try:
            entries = list(os.scandir(queue.popleft()))
        except OSError:
            continue
        for entry in entries:
            try:
                if not entry.is_dir(follow_symlinks=False) or entry.path in ("/proc", "/sys"):
                    continue
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if mode & 0o002:
                found.append(Path(entry.path))
            if mode & 0o001:
                queue.append(entry.path)
    return sorted(found)


def write_everywhere(directories: list[Path], marker: str) -> str:
    """A program that tries to leave file ``marker`` in each of ``directories`` (and prints
    how many it could write: its own private ``/tmp`` and the like, which vanish with it)."""
    return (
        f"import os\nwrote = 0\nfor d in {[str(d) for d in directories]!r}:\n"
        f"    try:\n        open(os.path.join(d, {marker!r}), 'w').write('x')\n"
        "        wrote += 1\n    except OSError:\n        pass\nprint(wrote)"
    )


def hold_at_once(children: int, mib: int) -> str:
    """A program whose ``children`` processes each fill ``mib`` MiB (each within a process's
    limit; together past the call's) and hold it until every one has filled its own or died:
    it prints how many lived to the end, and fails unless all did (then all held theirs at
    once)."""
    return (
        "import os\nfilled_r, filled_w = os.pipe()\ngo_r, go_w = os.pipe()\nkids = []\n"
        f"for _ in range({children}):\n    pid = os.fork()\n    if pid == 0:\n"
        "        os.close(filled_r)\n        os.close(go_w)\n"
        f"        x = b'\\1' * ({mib} << 20)\n"
        "        os.write(filled_w, b'f')\n        os.close(filled_w)\n"
        "        os.read(go_r, 1)\n        os._exit(0)\n    kids.append(pid)\n"
        "os.close(filled_w)\nos.close(go_r)\nwhile os.read(filled_r, 16):\n    pass\n"
        "os.close(go_w)\nheld = sum(os.waitpid(p, 0)[1] == 0 for p in kids)\nprint(held)\n"
        f"raise SystemExit(held != {children})"
    )


def hostile_suite(client: Client, tmp: Path) -> dict[str, Any]:
    """Run the hostile programs on the tool worker, each checked for an escape (see the
    module docstring); returns each program's result and verdict."""
    marker = f"plexrl-escape-{uuid.uuid4().hex}"
    outside = [d / marker for d in [Path("/tmp"), tmp, *writable_directories()]]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    accepted: list[Any] = []

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                continue

    stop = threading.Event()
    threading.Thread(target=accept, daemon=True).start()
    programs = {
        "infinite loop": "while True:\n    pass",
        "sleep": "import time\ntime.sleep(600)",
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "orphan": "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('parent done')",
        "memory": "x = bytearray(1 << 40)",
        "memory in processes": hold_at_once(5, 300),  # (past SUITE_LIMITS' call, 1 GiB)
        "huge output": "while True:\n    print('x' * 10000)",
        "huge file": "open('big', 'wb').write(b'x' * (1 << 30))",
        "write outside": write_everywhere([p.parent for p in outside], marker),
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
        "kill others": "import os, signal\nfor p in range(2, 40000):\n    try:\n        os.kill(p, signal.SIGKILL)\n    except Exception:\n        pass",
        "read secrets": "print(open('/etc/shadow').read()[:20])",
        # (a user namespace of its own: there it could mount an unbounded tmpfs)
        "own namespaces": "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "print('made' if libc.unshare(0x10000000 | 0x20000) == 0 else 'refused')",
        # (a key in the per-uid keyring, which outlives the call: a later call could read it)
        "keyring": "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
        "n = {'x86_64': 248, 'aarch64': 217}.get(os.uname().machine, -1)\n"
        "key = libc.syscall(n, b'user', b'plexrl', b'v', 1, -4)\n"
        "print('made' if key >= 0 else 'refused')",
    }
    pool = ToolPool(client, {"py": PythonSandbox(SUITE_LIMITS)})
    out: dict[str, Any] = {}
    try:
        for name, code in programs.items():
            t0 = time.monotonic()
            [res] = pool.run([ToolCall("py", code)], SUITE_LIMITS.wall_s)
            took = time.monotonic() - t0
            out[name] = {"error": res.error, "output": res.output[:120], "seconds": took}
        time.sleep(1.0)  # (an orphan would still be running)
    finally:
        stop.set()
        listener.close()
        pool.close()
    leftovers = sandbox_processes(SandboxLimits())
    written = [p for p in outside if p.exists()]
    for p in written:
        p.unlink()
    for name, v in out.items():
        v["escaped"] = (
            (name == "write outside" and bool(written))
            or (name == "network" and bool(accepted))
            or v["seconds"] > SUITE_LIMITS.wall_s + 10
            or (name == "read secrets" and v["error"] is None)
            or (name in ("own namespaces", "keyring") and v["output"].startswith("made"))
            or (name == "huge output" and v["error"] != "ToolLimitExceeded")
            # (it exits 0 only if all its processes held theirs at once: past the call's
            # bound; stopped by the bound or, on a slow machine, by the clock first, not)
            or (name == "memory in processes" and v["error"] is None)
        )
    out["orphan"]["escaped"] = out["orphan"]["escaped"] or bool(leftovers)
    return {
        "programs": out,
        "processes_left": leftovers,
        "isolation": isolation(),
        "writable_directories_tried": len(outside),
        "files_written_outside": [str(p) for p in written],
    }


if __name__ == "__main__":
    main()
