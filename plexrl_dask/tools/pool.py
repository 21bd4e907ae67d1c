"""Where tool calls run: off the model workers.

Tool calls run as ordinary Dask tasks (keys ``plexrl-tool-...``) restricted to the cluster's
*tool workers*: workers that do not advertise the GPU resource (``plexrl.worker.gpu-resource``),
so a program never runs beside a model replica and the PlexRL scheduler plugin, which routes
only annotated requests, never sees them. ``local_cluster(tool_workers=n)`` starts such
workers. A turn's calls go out as one task per tool worker, each with every n-th call
(:func:`_shares`), which runs them as many at once as its worker has threads, on threads that
every such task there shares, the jobs with calls waiting in turn
(:func:`~plexrl_dask.tools.calls.run_calls`): a worker's threads stay busy until its share is
done, and a turn costs one task's round through the
scheduler and one fetch per tool worker, where a call may take microseconds (the calculator)
and a task's round milliseconds of the scheduler's, the driver's and the worker's CPU, which
the tools and the model workers need. The tool workers are asked of the scheduler at most
every :data:`WORKERS_TTL_S`. Where the cluster has none, calls run on the driver, on a thread
pool of its own (the sandbox is a subprocess either way).

Identical calls of one batch (the same tool and input: the samples of a group often make
the same call) run once, and each gets that run's result, marked ``shared``: tools are pure
functions of their input (:mod:`plexrl_dask.tools.calls`). A tool whose ``pure`` attribute is
False has every call run.

Every call returns a :class:`~plexrl_dask.tools.calls.ToolResult`: a failed call (it did not
parse, its program failed or ran past a limit) is a failed result, and so is a call whose worker
died (:class:`~plexrl_dask.errors.ToolWorkerLost`, every call of that task's share) or that
ran past its tool's time limit plus :data:`CALL_MARGIN_S` (the tool worker gives up on it:
:class:`~plexrl_dask.errors.ToolLimitExceeded`): the episode goes on either way. A call's
time counts from when it starts on its tool worker, not from when the driver sent it, so the
calls of other jobs queued ahead of it on the worker's threads cannot make it fail. The
driver itself waits at most what a turn of calls at their limit takes on the tool workers'
threads plus :data:`MARGIN_S`, or ``plexrl.request.timeout`` if that is longer (the bound of
a wait that others' calls make long). A task the driver gives up on (or whose driver went
away) takes its calls that have not started out of the worker's queue, and ends its running
sandboxed programs (:data:`~plexrl_dask.tools.calls.CALL_CANCELLED`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distributed import Future, KilledWorker
from distributed.comm.core import CommClosedError

from plexrl_dask import config
from plexrl_dask.cluster import worker_info
from plexrl_dask.driver.waits import fetching, post_event
from plexrl_dask.shared.timeline import TOOL_TOPIC
from plexrl_dask.tools.calls import Tool, ToolCall, ToolResult, run_calls

logger = logging.getLogger(__name__)

#: Seconds a call may run on its tool worker beyond its tool's own limit before the worker
#: gives up on it.
CALL_MARGIN_S = 5.0
#: Seconds the driver waits beyond a turn of calls at their tools' limit (scheduling, a
#: worker's start).
MARGIN_S = 30.0
#: How long the tool workers the scheduler named are taken as they are (a dead one shows in
#: the wait's checks; a new one is used from the next ask on).
WORKERS_TTL_S = 2.0
#: How often a waiting driver checks that the call's tool workers are still there.
POLL_S = 0.5


def tool_workers(client: Any) -> list[str]:
    """The addresses of the cluster's workers without the GPU resource."""
    return _tool_workers(worker_info(client))


def _tool_workers(workers: Mapping[str, Any]) -> list[str]:
    gpu = str(config.get("worker.gpu-resource"))
    return sorted(a for a, w in workers.items() if not (w.get("resources") or {}).get(gpu))


def _shares(n: int, most: int) -> list[range]:
    """``range(n)`` in at most ``most`` shares, share ``i`` every ``most``-th from ``i`` (the
    samples of one prompt, which make similar calls, are neighbours: strided, they spread
    over the shares)."""
    count = max(1, min(n, most))
    return [range(i, n, count) for i in range(count) if i < n]


def driver_lane(job: str) -> str:
    """The Timeline lane of the tool calls that ``job``'s driver ran itself."""
    return f"driver:{job}"


class ToolPool:
    """Runs tool calls for a driver: on the cluster's tool workers (see the module
    docstring), else on a local thread pool of ``local_threads``."""

    def __init__(
        self, client: Any, tools: Mapping[str, Tool], local_threads: int = 4, job: str = ""
    ) -> None:
        """``job``: the job the calls are for; with it and a client, each batch of calls is
        reported (:data:`~plexrl_dask.shared.timeline.TOOL_TOPIC`) for the dashboard's
        Timeline: in the lanes of the tool workers that ran them, or, where they ran on the
        driver (a cluster without tool workers), in a lane of that job's driver
        (:func:`driver_lane`)."""
        self.client = client
        self.job = job
        self.tools = dict(tools)
        self._local: concurrent.futures.ThreadPoolExecutor | None = None
        self._local_threads = local_threads
        self._workers: tuple[float, dict[str, int]] = (-WORKERS_TTL_S, {})

    def _known_workers(self) -> dict[str, int]:
        """The tool workers and their thread counts, asked of the scheduler at most every
        :data:`WORKERS_TTL_S`."""
        if self.client is None:
            return {}
        asked, workers = self._workers
        if time.monotonic() - asked >= WORKERS_TTL_S:
            info = worker_info(self.client)
            workers = {w: int(info[w].get("nthreads") or 1) for w in _tool_workers(info)}
            self._workers = (time.monotonic(), workers)
        return workers

    def run(self, calls: Sequence[ToolCall | None], timeout_s: float) -> list[ToolResult | None]:
        """Run ``calls`` (None entries are skipped and give None), each distinct call once
        and as many at once as the tool workers have threads (see the module docstring);
        each result in order. ``timeout_s``: the tools' own limit; a call that has run past
        it and :data:`CALL_MARGIN_S` is a failed result (see the module docstring)."""
        first = self._first_of_each(calls)
        ran = self._run([c if first.get(k) == k else None for k, c in enumerate(calls)], timeout_s)
        return [
            r if k == first.get(k, k) else dataclasses.replace(ran[first[k]], shared=True)
            for k, r in enumerate(ran)
        ]

    def _first_of_each(self, calls: Sequence[ToolCall | None]) -> dict[int, int]:
        """For each call, the position of the first identical call of a pure tool (itself
        where there is none before it, or where its tool is not pure)."""
        seen: dict[ToolCall, int] = {}
        first = {}
        for k, call in enumerate(calls):
            if call is None:
                continue
            pure = getattr(self.tools.get(call.tool), "pure", True)
            first[k] = seen.setdefault(call, k) if pure else k
        return first

    def _run(self, calls: Sequence[ToolCall | None], timeout_s: float) -> list[ToolResult | None]:
        if not any(c is not None for c in calls):
            return [None] * len(calls)
        threads_of = self._known_workers()
        workers = sorted(threads_of)
        if workers:
            threads = sum(threads_of.values())
            futures, shares = [], []
            todo = [k for k, c in enumerate(calls) if c is not None]
            for share in _shares(len(todo), len(workers)):
                ids = [todo[i] for i in share]
                tool = calls[ids[0]].tool  # type: ignore[union-attr]
                futures.append(
                    self.client.submit(
                        run_calls,
                        [calls[k] for k in ids],
                        self.tools,
                        True,
                        timeout_s + CALL_MARGIN_S,
                        self.job,
                        key=f"plexrl-tool-{tool}-{uuid.uuid4().hex}",  # (its first call's tool)
                        workers=workers,
                        allow_other_workers=False,
                        pure=False,
                        retries=0,
                    )
                )
                shares.append(ids)
            rounds = -(-len(todo) // threads)  # (every call at its limit, ``threads`` at once)
        else:
            if self._local is None:
                self._local = concurrent.futures.ThreadPoolExecutor(
                    self._local_threads, thread_name_prefix="plexrl-tool"
                )
            shares = [[k] for k, c in enumerate(calls) if c is not None]  # (a call a future)
            futures = [self._local.submit(run_calls, [calls[k]], self.tools) for [k] in shares]
            rounds = -(-len(shares) // self._local_threads)

        def alive() -> bool:  # (a tool worker that died comes back under another address)
            return not workers or bool(set(workers) & set(self.client.nthreads()))

        wait = rounds * timeout_s + MARGIN_S
        deadline = time.monotonic() + (max(wait, config.request_timeout()) if workers else wait)
        results: list[ToolResult | None] = [None] * len(calls)
        for f, ids in zip(futures, shares, strict=True):
            got = _outcome(f, deadline, alive)
            for k, r in zip(ids, got if isinstance(got, list) else [got] * len(ids), strict=True):
                results[k] = r
            if isinstance(got, ToolResult) and got.error == "ToolWorkerLost":
                self._workers = (-WORKERS_TTL_S, {})  # (ask again: it comes back elsewhere)
        if self.client is not None and self.job:
            self._report(calls, results)
        return results

    def _report(self, calls: Sequence[ToolCall | None], results: list[ToolResult | None]) -> None:
        """Log the calls' spans on where they ran, without waiting (best effort: a report
        that cannot be sent is logged; the episode goes on)."""
        lane = driver_lane(self.job)
        spans = [
            {
                "worker": lane if r.worker == "driver" else r.worker,
                "tool": c.tool,
                "start": r.started,
                "end": r.started + r.seconds,
            }
            for c, r in zip(calls, results, strict=True)
            if c is not None and r is not None and r.worker
        ]
        if not spans:
            return
        post_event(self.client, TOOL_TOPIC, {"job": self.job, "spans": spans})

    def close(self) -> None:
        if self._local is not None:
            self._local.shutdown(wait=False, cancel_futures=True)
            self._local = None


def _outcome(
    future: Any, deadline: float, alive: Callable[[], bool]
) -> list[ToolResult] | ToolResult:
    """``future``'s result (its calls' results) by ``deadline``, checking every
    :data:`POLL_S` that a worker that may run it is still there. A Dask future's result is
    fetched with :func:`~plexrl_dask.driver.waits.fetching`: polling
    ``Future.result(timeout)`` cancels the client's fetches and can leave it unable to
    return any result again."""
    pending = fetching(future) if isinstance(future, Future) else future
    while True:
        left = deadline - time.monotonic()
        try:
            return pending.result(timeout=max(0.0, min(POLL_S, left)))
        except TimeoutError:
            if left <= POLL_S:
                _cancel(future)
                return ToolResult("the call did not return in time", "ToolLimitExceeded")
            if not alive():
                _cancel(future)
                return ToolResult("the worker running the call was lost", "ToolWorkerLost")
        # its worker died or left mid-call, or the scheduler gave it up
        except (KilledWorker, CommClosedError, OSError, concurrent.futures.CancelledError) as e:
            logger.warning("tool call %s lost its worker: %r", getattr(future, "key", ""), e)
            return ToolResult(
                f"the worker running the call was lost ({type(e).__name__})", "ToolWorkerLost"
            )


def _cancel(future: Any) -> None:
    # (best effort: the task withdraws its calls not started and ends its sandboxed programs)
    with contextlib.suppress(Exception):
        future.cancel()
