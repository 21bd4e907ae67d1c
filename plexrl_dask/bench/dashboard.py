"""Benchmark of the PlexRL dashboard pages on a scheduler holding a large synthetic state.

A real ``Scheduler`` (in this process, dashboard on 127.0.0.1, the ``plexrl_dask.plugins``
preload: the PlexRL plugin, the dashboard plugin, the pages and routes) gets a synthetic
plugin state of production size (:mod:`plexrl_dask.bench.synthetic_state`): ``--requests``
(10,000) queued requests in the dispatcher over ``--workers`` (256) workers' residency (each holds a few of the deployments in HBM, DRAM
or NVMe), the Timeline's spans, job step reports and recent decisions. The state keeps
changing the whole time (new spans, residency moves, requests replaced, new steps: ``churn``),
and a plain-task workload keeps the scheduler busy as a real one is (2 worker processes,
``--tasks-per-s`` submitted by a client in a process of its own), the same in every phase.

- ``update_ms_p99``: the 99th percentile of every page's ``update()`` wall time (all four pages
  open in a headless Chromium, updating every ``plexrl.dashboard.update-interval``; measured on
  the scheduler's event loop, the Bokeh messages to the browser included; a page's first
  update, when it opens, is reported apart as ``first_update_ms_max``). Target <= 5 ms.
  ``update_cpu_ms_p99`` is the same in thread CPU time (without waits for a core or the GIL,
  and without the time the machine stalled the thread: measured here, a busy thread's CPU
  time falls short of its wall time by about the stalls ``machine_stalls`` counts);
  ``update_cpu_ms_p99_outside_gc`` less the collections inside each update too: the pages'
  own work. ``updates_over_5ms[_cpu]`` count the updates above the target.
  Garbage collections of the process that ran inside an update are part of its time; they
  are the cost of everything the scheduler allocated, so ``updates_with_gc``,
  ``update_gc_ms_max`` and ``update_ms_p99_outside_gc[_<page>]`` (each update less the
  collections inside it) tell the pages' own work apart.
- ``inbound_patches``: the document changes the browsers sent back (each handled on the
  scheduler's loop), by kind.
- ``scheduler_loop_lag_ratio``: the scheduler's event-loop lag (mean overshoot of a 10 ms
  ticker on its loop) with the four pages open and updating ÷ without, in the same run; phases
  alternate (without, with, without, with, ...) so drift of the machine hits both. Target
  <= 1.1. The browser runs on other CPUs than this process (see ``_separate``), so what is
  measured is the pages' work on the scheduler, not the browser competing for its core.
  ``loop_lag_ms_*`` give the lags themselves (mean and p99), ``lag_ratio_per_round`` each
  round's ratio (how much the machine's noise moves it). A garbage collection of the process
  (a full one takes hundreds of milliseconds here) delays a tick by its whole length, and a
  phase has one or none. The process's allocations schedule one about once a minute, and
  opening the pages (new documents and sessions) tips it into the phase that follows, so
  every phase starts after a ``gc.collect()`` (outside the measured windows, the same for
  both): what a phase measures is its own work and the collections that work causes.
  ``scheduler_loop_lag_ratio_outside_gc`` is the ratio without the ticks any collection
  delayed, ``gc_ms_per_s_{without,with}`` how much collecting each phase had.

``reference_ms_p50`` / ``_p99`` / ``_max``, ``reference_cpu_ms_p99`` and ``reference_over_5ms``:
a fixed piece of pure-Python work (:class:`ReferenceWork`, about 1.5 ms when the run starts)
timed on the scheduler's loop as often as the pages update (all together), in every phase,
counted in the phases with the pages open: how far this machine alone spreads the time of
the same work, in the same seconds as the updates (a stall probe sees the machine stop a
thread, not run it slower).

``machine_before`` / ``machine_after``: how often this machine itself stalls a busy thread
(:func:`machine_stalls`, on the scheduler's CPU, before and after the measured run, with
nothing else of ours running): the rate of stalls longer than 5 ms is what a tail of a few
updates in several hundred can be made of.

``metrics_ms_p50`` / ``_p99`` / ``_max`` and ``metrics_samples``: what PlexRL's part of a
scrape of the scheduler's ``/metrics`` (its collector, not Dask's nor the text encoding)
costs the scheduler's loop in the same state, 100 collections in a row after the rounds
(:func:`scrape_times`).

It also saves one screenshot per page (``--screenshots DIR``) of that state.

Run: ``python -m plexrl_dask.bench.dashboard --json OUT [--quick]``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import logging
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from plexrl_dask.bench.common import parser, report
from plexrl_dask.bench.synthetic_state import churn, fill_synthetic
from plexrl_dask.cluster import MODEL_STACK
from plexrl_dask.config import DashboardConfig
from plexrl_dask.dashboard import PAGES
from plexrl_dask.errors import RequestTimeout

logger = logging.getLogger(__name__)

class LoopTicker:
    """Event-loop lag of the loop it runs on: how late an ``interval`` sleep wakes up. Each
    tick is ``(woke, lag)``, ``woke`` on ``perf_counter``, lag in seconds."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.ticks: list[tuple[float, float]] = []
        self._stop = False

    async def run(self) -> None:
        while not self._stop:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval)
            t1 = time.perf_counter()
            self.ticks.append((t1, max(0.0, t1 - t0 - self.interval)))

    def take(self) -> list[tuple[float, float]]:
        out, self.ticks = self.ticks, []
        return out


class ReferenceWork:
    """A fixed piece of pure-Python work, timed on the scheduler's loop beside the pages'
    updates, as often as they update: how much this machine alone spreads the time of the
    same work.
    The work is an integer loop (it allocates nothing the garbage collector tracks), its
    length fixed once, before the cluster starts, to take about ``target_ms`` then. Each run
    is ``(started, wall ms, thread CPU ms)``."""

    def __init__(self, target_ms: float = 1.5) -> None:
        probe = 20_000
        took = min(self._timed(probe)[0] for _ in range(7))
        self.iterations = max(1_000, round(probe * target_ms / max(took, 1e-6)))
        self.runs: list[tuple[float, float, float]] = []

    @staticmethod
    def _timed(n: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        x = 0
        for i in range(n):
            x += i
        return 1000 * (time.perf_counter() - t0), 1000 * (time.thread_time() - c0)

    def run_once(self) -> None:
        started = time.perf_counter()
        wall, cpu = self._timed(self.iterations)
        self.runs.append((started, wall, cpu))

    def within(self, windows: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
        return [r for r in self.runs if any(a <= r[0] < b for a, b in windows)]


class GcRecorder:
    """The garbage collections of this process, as ``(start, end)`` on ``perf_counter``: a
    collection that runs inside a page's update (or delays a lag tick) is part of what is
    measured, but is the cost of everything the process allocated, not of that update."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []  # in start order
        self.full: list[tuple[float, float]] = []  # the full (generation 2) ones
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.spans.append((self._t0, time.perf_counter()))
            if info.get("generation") == 2:
                self.full.append(self.spans[-1])

    def __enter__(self) -> GcRecorder:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def inside(self, t0: float, ms: float) -> float:
        """Milliseconds of collections inside ``[t0, t0 + ms / 1000]``."""
        t1 = t0 + ms / 1000
        # full collections take up to ~0.7 s here: none that started 10 s earlier still runs
        lo = bisect.bisect_left(self.spans, (t0 - 10.0, t0 - 10.0))
        hi = bisect.bisect_right(self.spans, (t1, t1))
        return 1000 * sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.spans[lo:hi])


class InboundPatches:
    """Document patches the browsers send back to the scheduler (each is handled on its
    event loop): how many, and of which kinds."""

    def __init__(self) -> None:
        from bokeh.server.session import ServerSession

        self.kinds: dict[str, int] = {}
        self._cls = ServerSession
        self._orig = ServerSession._handle_patch
        recorder = self

        def counted(session: Any, message: Any, connection: Any) -> Any:
            for event in message.content.get("events", ()):
                kind = f"{event.get('kind')}:{event.get('attr', '')}"
                recorder.kinds[kind] = recorder.kinds.get(kind, 0) + 1
            return recorder._orig(session, message, connection)

        self._counted = counted

    def __enter__(self) -> InboundPatches:
        self._cls._handle_patch = self._counted
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls._handle_patch = self._orig


def _separate(pid: int) -> None:
    """Keep the browser and the workers off the scheduler's core: this process (the
    scheduler) on CPU 0, its child processes (worker processes, the browser driver and the
    browser ``pid``, whose later children inherit it) on the others. A user's
    browser runs on their own machine, not on the scheduler's; only the pages' work on the
    scheduler is to be measured. Without a second CPU the browser gets the lowest priority."""
    import psutil

    cpus = sorted(os.sched_getaffinity(0))
    with contextlib.suppress(psutil.Error, OSError):
        # the browser, and this process's children (the worker processes, the browser driver)
        others = psutil.Process().children(recursive=True)
        for proc in [psutil.Process(pid), *others]:
            with contextlib.suppress(psutil.Error, OSError):
                if len(cpus) > 1:
                    proc.cpu_affinity(cpus[1:])
                else:
                    proc.nice(19)
    if len(cpus) > 1:
        for tid in os.listdir("/proc/self/task"):  # every thread (the loop runs in its own)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus[:1])


def run(args: Any) -> dict[str, Any]:
    """The benchmark (see the module docstring); returns its results."""
    from distributed import Client, LocalCluster

    from plexrl_dask.dashboard import base as pages
    from plexrl_dask.dashboard.browser import Browser

    phase_s = args.phase_s or (6.0 if args.quick else 15.0)
    rounds = args.rounds or (2 if args.quick else 6)
    rng = random.Random(1)
    results: dict[str, Any] = {"console_errors": 0}
    # the machine's own stalls on the CPU the scheduler will run on, before anything starts
    probe_s = 5.0 if args.quick else 15.0
    cpu0 = min(os.sched_getaffinity(0))
    results["machine_before"] = machine_stalls(probe_s, cpu0)
    reference = ReferenceWork()
    with (
        LocalCluster(
            n_workers=2,  # plain worker processes (no GPU resource) for the plain-task load
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            scheduler_kwargs={"preload": ["plexrl_dask.plugins"]},
        ) as cluster,
        Client(cluster) as client,
    ):
        scheduler = cluster.scheduler
        base = cluster.dashboard_link.rsplit("/", 1)[0]
        t0 = time.perf_counter()
        syn = on_loop(
            client,
            lambda: fill_synthetic(
                scheduler,
                requests=args.requests,
                workers=args.workers,
                spans_per_worker=args.spans_per_worker,
            ),
        )
        results["fill_s"] = time.perf_counter() - t0
        ticker = LoopTicker()
        # as often as the pages update, all together
        reference_period = DashboardConfig.from_dask_config().update_interval_s / len(PAGES)
        with_windows: list[tuple[float, float]] = []  # the phases with the pages open
        stop = threading.Event()

        async def background() -> None:
            # the cluster's churn and the lag ticker, on the scheduler's loop, in every phase
            loop_task = asyncio.ensure_future(ticker.run())
            last = last_reference = time.monotonic()
            try:
                while not stop.is_set():
                    await asyncio.sleep(0.1)
                    now = time.monotonic()
                    churn(scheduler, syn, rng, now - last)
                    last = now
                    if now - last_reference >= reference_period:
                        reference.run_once()
                        last_reference = now
            finally:
                ticker._stop = True
                await loop_task

        future = asyncio.run_coroutine_threadsafe(background(), client.loop.asyncio_loop)
        load = _PlainLoad(scheduler.address, args.tasks_per_s)
        load.start()
        ticks: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
        per_round: list[float] = []  # each round's lag ratio: how much rounds disagree
        wall: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        in_gc: dict[str, list[float]] = {}  # ms of garbage collection inside each update
        first: list[float] = []
        shots = Path(args.screenshots) if args.screenshots else None
        try:
            with (
                Browser(width=1400, height=1000) as browser,
                GcRecorder() as collections,
                InboundPatches() as inbound,
            ):
                _separate(browser.driver.service.process.pid)
                for r in range(rounds):
                    _wait_no_sessions(client, scheduler)  # closed pages' sessions linger
                    _collect(ticker)  # each phase starts from the same collector state
                    without_t0 = time.perf_counter()
                    time.sleep(phase_s)
                    without = ticker.take()
                    ticks["without"].extend(without)
                    opened_t0 = time.perf_counter()
                    handles = _open_pages(browser, base)
                    _separate(browser.driver.service.process.pid)
                    first.extend(ms for v in pages.UPDATE_MS.values() for ms in v)
                    for stats in (pages.UPDATE_MS, pages.UPDATE_CPU_MS, pages.UPDATE_STARTED):
                        for v in stats.values():
                            v.clear()
                    _collect(ticker)
                    phase_t0 = time.perf_counter()
                    time.sleep(phase_s)
                    with_windows.append((phase_t0, time.perf_counter()))
                    with_pages = ticker.take()
                    ticks["with"].extend(with_pages)
                    per_round.append(_mean_lag(with_pages) / _mean_lag(without))
                    for name in list(pages.UPDATE_MS):
                        v, ms_cpu, started = _phase_updates(name, phase_t0)
                        wall.setdefault(name, []).extend(v)
                        cpu.setdefault(name, []).extend(ms_cpu)
                        gcs = [
                            collections.inside(t0, ms) for t0, ms in zip(started, v, strict=True)
                        ]
                        in_gc.setdefault(name, []).extend(gcs)
                        slowest = sorted(zip(v, started, gcs, strict=True), reverse=True)[:3]
                        logger.info(
                            "round %d, %s: slowest updates %s",
                            r,
                            name,
                            ", ".join(
                                f"{ms:.1f} ms at {t0 - phase_t0:.1f} s (gc {g:.1f})"
                                for ms, t0, g in slowest
                            ),
                        )
                    logger.info(
                        "round %d: lag %.3f ms without pages, %.3f ms with; full collections "
                        "(s into the round: %.1f opening pages, %.1f with them) %s",
                        r,
                        1000 * _mean_lag(without),
                        1000 * _mean_lag(with_pages),
                        opened_t0 - without_t0,
                        phase_t0 - without_t0,
                        [
                            f"{t0 - without_t0:.1f} s: {1000 * (t1 - t0):.0f} ms"
                            for t0, t1 in collections.full
                            if t0 >= without_t0
                        ],
                    )
                    if r == rounds - 1 and shots is not None:
                        for url, handle in handles.items():
                            browser.driver.switch_to.window(handle)
                            browser.screenshot(shots / f"{url.rsplit('-', 1)[-1]}.png")
                    results["console_errors"] += len(browser.console_errors())
                    _close_pages(browser, handles)
        finally:
            load.stop()
            stop.set()
            future.result(timeout=30)
        everything = [ms for v in wall.values() for ms in v]
        results["update_ms_p99"] = _p(everything, 0.99)
        results["update_ms_p50"] = _p(everything, 0.5)
        results["update_cpu_ms_p99"] = _p([ms for v in cpu.values() for ms in v], 0.99)
        for name in wall:
            results[f"update_ms_p99_{name}"] = _p(wall[name], 0.99)
            results[f"update_cpu_ms_p99_{name}"] = _p(cpu[name], 0.99)
            results[f"update_ms_p99_outside_gc_{name}"] = _p(
                [ms - g for ms, g in zip(wall[name], in_gc[name], strict=True)], 0.99
            )
            results[f"updates_{name}"] = len(wall[name])
        gcs = [ms for v in in_gc.values() for ms in v]
        results["updates_with_gc"] = sum(ms > 0 for ms in gcs)
        results["update_gc_ms_max"] = max(gcs, default=0.0)
        results["update_ms_p99_outside_gc"] = _p(
            [ms - g for name in wall for ms, g in zip(wall[name], in_gc[name], strict=True)],
            0.99,
        )
        # the pages' own work: CPU time (which a stall of the machine is not part of) less
        # the collections inside the update (CPU time too; clamped, a stall can sit in one)
        results["update_cpu_ms_p99_outside_gc"] = _p(
            [
                max(0.0, ms - g)
                for name in cpu
                for ms, g in zip(cpu[name], in_gc[name], strict=True)
            ],
            0.99,
        )
        results["updates_over_5ms"] = sum(ms > 5.0 for ms in everything)
        results["updates_over_5ms_cpu"] = sum(ms > 5.0 for v in cpu.values() for ms in v)
        # the same fixed work, at the same moments: what the machine alone does to a tail
        ref = reference.within(with_windows)
        results["reference_iterations"] = reference.iterations
        results["reference_runs"] = len(ref)
        results["reference_ms_p50"] = _p([w for _, w, _ in ref], 0.5)
        results["reference_ms_p99"] = _p([w for _, w, _ in ref], 0.99)
        results["reference_cpu_ms_p99"] = _p([c for _, _, c in ref], 0.99)
        results["reference_ms_max"] = max((w for _, w, _ in ref), default=float("nan"))
        results["reference_over_5ms"] = sum(w > 5.0 for _, w, _ in ref)
        results["inbound_patches"] = dict(inbound.kinds)
        results["first_update_ms_max"] = max(first, default=float("nan"))
        results["loop_lag_ms_without"] = 1000 * _mean_lag(ticks["without"])
        results["loop_lag_ms_with"] = 1000 * _mean_lag(ticks["with"])
        results["scheduler_loop_lag_ratio"] = (
            results["loop_lag_ms_with"] / results["loop_lag_ms_without"]
        )
        results["lag_ratio_per_round"] = [round(x, 3) for x in per_round]
        results["loop_lag_ms_p99_without"] = 1000 * _p([lag for _, lag in ticks["without"]], 0.99)
        results["loop_lag_ms_p99_with"] = 1000 * _p([lag for _, lag in ticks["with"]], 0.99)
        # The same without the ticks a garbage collection delayed (in either phase), and how
        # much collecting each phase had: collections are the whole process's cost.
        interval = ticker.interval
        clean = {
            phase: [
                (t, lag)
                for t, lag in ts
                if collections.inside(t - interval - lag, 1000 * (interval + lag)) == 0
            ]
            for phase, ts in ticks.items()
        }
        results["scheduler_loop_lag_ratio_outside_gc"] = _mean_lag(clean["with"]) / _mean_lag(
            clean["without"]
        )
        for phase, ts in ticks.items():
            seconds = len(ts) * interval + sum(lag for _, lag in ts)
            gc_ms = sum(
                collections.inside(t - interval - lag, 1000 * (interval + lag)) for t, lag in ts
            )
            results[f"gc_ms_per_s_{phase}"] = gc_ms / max(seconds, 1e-9)
        results["plain_tasks_done"] = load.done
        results["queued_requests"] = len(scheduler.plugins["plexrl"].requests)
        results.update(on_loop(client, scrape_times))
        # The scheduler runs in this process: none of the model stack here, as in a
        # preloaded `dask scheduler` (its full collections walk whatever the process holds).
        results["model_stack_imported"] = [m for m in MODEL_STACK if m in sys.modules]
    results["machine_after"] = machine_stalls(probe_s, cpu0)
    return results


def machine_stalls(seconds: float, cpu: int | None = None) -> dict[str, float]:
    """How often this machine stops a busy thread: a pure-Python loop on one CPU (``cpu``)
    for ``seconds``, nothing else of ours running, counting the gaps between two iterations
    longer than 1 and 5 ms (a virtual machine's stolen time, interrupts; an iteration itself
    takes well under a microsecond). Context for a tail: an update of ``d`` ms has about
    ``rate * d / 1000`` chance of holding a stall."""
    old = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        gaps = []
        t_end = time.perf_counter() + seconds
        last = time.perf_counter()
        while last < t_end:
            now = time.perf_counter()
            if now - last > 1e-3:
                gaps.append(now - last)
            last = now
    finally:
        os.sched_setaffinity(0, old)
    return {
        "stalls_over_1ms_per_s": sum(g > 1e-3 for g in gaps) / seconds,
        "stalls_over_5ms_per_s": sum(g > 5e-3 for g in gaps) / seconds,
        "stall_ms_max": 1000 * max(gaps, default=0.0),
    }


def _wait_no_sessions(client: Any, scheduler: Any, timeout: float = 90.0) -> None:
    """Wait until the Bokeh server has discarded every PlexRL page session (a closed page's
    session keeps updating until the server expires it, 15-32 s later)."""

    def sessions() -> int:
        n = 0
        for app in scheduler.http_application.applications:
            if hasattr(app, "get_sessions"):
                n += sum(len(app.get_sessions(path)) for path in app.app_paths if "plexrl" in path)
        return n

    deadline = time.monotonic() + timeout
    while on_loop(client, sessions):
        if time.monotonic() > deadline:
            raise RequestTimeout(f"Bokeh sessions of closed pages still alive after {timeout}s")
        time.sleep(0.5)


def scrape_times(n: int = 100) -> dict[str, Any]:
    """``n`` collections of PlexRL's Prometheus metrics (:mod:`plexrl_dask.dashboard.metrics`)
    in a row, on the scheduler's loop (call it there): ``metrics_ms_p50``/``_p99``/``_max``
    and ``metrics_samples``. PlexRL's part of a scrape only: not Dask's own collectors nor
    the text encoding. ``metrics_skipped`` says why not where there is no collector."""
    from plexrl_dask.dashboard import metrics

    collector = metrics.collector()
    if collector is None:
        return {
            "metrics_skipped": "no PlexRL collector in this process (prometheus_client is "
            "missing, or no dashboard plugin has started)"
        }
    times, samples = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        families = list(collector.collect())
        times.append(1000 * (time.perf_counter() - t0))
        samples = sum(len(f.samples) for f in families)
    return {
        "metrics_ms_p50": _p(times, 0.5),
        "metrics_ms_p99": _p(times, 0.99),
        "metrics_ms_max": max(times),
        "metrics_samples": samples,
    }


def on_loop(client: Any, fn: Any, timeout: float = 300.0) -> Any:
    """Call ``fn()`` on the event loop of ``client`` (where the in-process scheduler runs: its
    plugins' state is only touched there) and return its result."""

    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), client.loop.asyncio_loop).result(timeout)


def _phase_updates(name: str, phase_t0: float) -> tuple[list[float], list[float], list[float]]:
    """Page ``name``'s update wall ms, CPU ms and start times, of the updates that started in
    the phase (from ``phase_t0``). One in flight while the benchmark forced its collection
    before the phase (in this thread, holding the GIL) would count that collection, which is
    the benchmark's and not the page's. The pages keep updating meanwhile: each deque is read
    at once (``list`` of a deque holds the GIL), and ``update()`` appends CPU, wall, start in
    that order, so the shortest of the three lines up with the others."""
    from plexrl_dask.dashboard import base as pages

    ms_cpu = list(pages.UPDATE_CPU_MS[name])
    ms = list(pages.UPDATE_MS[name])
    started = list(pages.UPDATE_STARTED[name])
    n = min(len(ms), len(ms_cpu), len(started))
    rows = [row for row in zip(ms[:n], ms_cpu[:n], started[:n], strict=True) if row[2] >= phase_t0]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _collect(ticker: LoopTicker) -> None:
    """A full collection before a phase (see the module docstring); the tick it delayed is
    dropped with what the ticker recorded so far."""
    gc.collect()
    time.sleep(0.2)
    ticker.take()


def _mean_lag(ticks: list[tuple[float, float]]) -> float:
    return statistics.fmean(lag for _, lag in ticks) if ticks else float("nan")


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _open_pages(browser: Any, base: str) -> dict[str, str]:
    """Open every PlexRL page in its own tab; wait until each has drawn its first data."""
    handles = {}
    first = True
    for url in PAGES:
        if not first:
            browser.driver.switch_to.new_window("tab")
        first = False
        t0 = time.monotonic()
        browser.open(base + url)
        logger.info("opened %s in %.1fs", url, time.monotonic() - t0)
        browser.wait_for(
            lambda: browser.driver.execute_script(
                "return !!(window.Bokeh && Bokeh.documents.length && Bokeh.documents[0].roots().length)"
            ),
            f"page {url}",
        )
        handles[url] = browser.driver.current_window_handle
        logger.info("%s drawn after %.1fs", url, time.monotonic() - t0)
    return handles


def _close_pages(browser: Any, handles: dict[str, str]) -> None:
    """Close every page's tab (their sessions end), leaving one blank tab."""
    browser.driver.switch_to.new_window("tab")
    blank = browser.driver.current_window_handle
    for handle in handles.values():
        browser.driver.switch_to.window(handle)
        browser.driver.close()
    browser.driver.switch_to.window(blank)


class _PlainLoad:
    """Plain Dask tasks at about ``rate`` per second, submitted by a client in a process of
    its own (as a user's client is), until stopped.

    A client thread inside the scheduler's process would compete with the event loop for
    the GIL: the loop thread then waits up to the interpreter's switch interval (5 ms) for
    it, inside whatever the loop runs (with the load in such a thread, the Timeline's p99
    update was 8.4 ms of wall time against a CPU-time p99 of 3.6 ms in one run). A real
    scheduler's process holds no client; the scheduler handles the same tasks either way."""

    def __init__(self, address: str, rate: float) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._done = ctx.Value("q", 0)
        self._process = ctx.Process(
            target=_plain_load,
            args=(address, rate, self._stop, self._done),
            name="plain-load",
            daemon=True,
        )

    @property
    def done(self) -> int:
        return int(self._done.value)

    def start(self) -> None:
        self._process.start()

    def stop(self) -> None:
        self._stop.set()
        self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()


def _plain_load(address: str, rate: float, stop: Any, done: Any) -> None:
    from distributed import Client

    batch = max(1, int(rate / 10))
    with Client(address, set_as_default=False) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            futures = client.map(_noop, range(batch), pure=False)
            client.gather(futures)
            with done.get_lock():
                done.value += batch
            stop.wait(max(0.0, 0.1 - (time.monotonic() - t0)))


def _noop(x: int) -> int:
    return x


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--spans-per-worker", type=int, default=20)
    p.add_argument("--tasks-per-s", type=float, default=200.0)
    p.add_argument("--rounds", type=int, default=None, help="without/with pairs (default 6)")
    p.add_argument("--phase-s", type=float, default=None, help="seconds per phase (default 15)")
    p.add_argument("--screenshots", metavar="DIR", default=None, help="save one PNG per page here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("distributed").setLevel(logging.WARNING)
    results = run(args)
    report(
        "dashboard",
        results,
        {"update_ms_p99": "<= 5 ms", "scheduler_loop_lag_ratio": "<= 1.1"},
        {k: v for k, v in vars(args).items() if k != "json"} | {"cpus": os.cpu_count()},
        args.json,
    )


if __name__ == "__main__":
    main()
