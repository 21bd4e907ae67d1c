"""Where tool calls run: off the model workers.

A tool call is an ordinary Dask task (key ``plexrl-tool-...``) restricted to the cluster's
*tool workers*: workers that do not advertise the GPU resource (``plexrl.worker.gpu-resource``),
so a program never runs beside a model replica and the PlexRL scheduler plugin, which routes
only annotated requests, never sees it. ``local_cluster(tool_workers=n)`` starts such workers.
Where the cluster has none, calls run on the driver, on a thread pool of its own (the sandbox
is a subprocess either way).

Every call returns a :class:`~plexrl_dask.tools.calls.ToolResult`: a failed call (it did not
parse, its program failed or ran past a limit) is a failed result, and so is a call whose worker
died or that did not come back within its tool's time limit plus a margin
(:class:`~plexrl_dask.errors.ToolWorkerLost`, :class:`~plexrl_dask.errors.ToolLimitExceeded`):
the episode goes on either way.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distributed import Future, KilledWorker
from distributed.comm.core import CommClosedError

from plexrl_dask import config
from plexrl_dask.cluster import worker_info
from plexrl_dask.driver.waits import fetching
from plexrl_dask.shared.timeline import TOOL_TOPIC
from plexrl_dask.tools.calls import Tool, ToolCall, ToolResult, run_call

logger = logging.getLogger(__name__)

#: Seconds a call may take beyond its tool's own limit (scheduling, a worker's start).
MARGIN_S = 30.0
#: How often a waiting driver checks that the call's tool workers are still there.
POLL_S = 0.5


def tool_workers(client: Any) -> list[str]:
    """The addresses of the cluster's workers without the GPU resource."""
    gpu = str(config.get("worker.gpu-resource"))
    workers = worker_info(client)
    return sorted(a for a, w in workers.items() if not (w.get("resources") or {}).get(gpu))


class ToolPool:
    """Runs tool calls for a driver: on the cluster's tool workers (see the module
    docstring), else on a local thread pool of ``local_threads``."""

    def __init__(
        self, client: Any, tools: Mapping[str, Tool], local_threads: int = 4, job: str = ""
    ) -> None:
        """``job``: the job the calls are for; with it, each batch of calls that ran on tool
        workers is reported (:data:`~plexrl_dask.shared.timeline.TOOL_TOPIC`) for the
        dashboard's Timeline."""
        self.client = client
        self.job = job
        self.tools = dict(tools)
        self._local: concurrent.futures.ThreadPoolExecutor | None = None
        self._local_threads = local_threads

    def run(self, calls: Sequence[ToolCall | None], timeout_s: float) -> list[ToolResult | None]:
        """Run ``calls`` (None entries are skipped and give None) at once; each result in
        order. ``timeout_s``: the tools' own limit; past it and :data:`MARGIN_S`, a call that
        has not returned is a failed result."""
        if not any(c is not None for c in calls):
            return [None] * len(calls)
        workers = tool_workers(self.client) if self.client is not None else []
        if workers:
            futures = [
                None
                if c is None
                else self.client.submit(
                    run_call,
                    c,
                    self.tools,
                    key=f"plexrl-tool-{c.tool}-{uuid.uuid4().hex}",
                    workers=workers,
                    allow_other_workers=False,
                    pure=False,
                    retries=0,
                )
                for c in calls
            ]
        else:
            if self._local is None:
                self._local = concurrent.futures.ThreadPoolExecutor(
                    self._local_threads, thread_name_prefix="plexrl-tool"
                )
            futures = [
                None if c is None else self._local.submit(run_call, c, self.tools) for c in calls
            ]

        def alive() -> bool:  # (a tool worker that died comes back under another address)
            return not workers or bool(set(workers) & set(self.client.nthreads()))

        deadline = time.monotonic() + timeout_s + MARGIN_S
        results = [None if f is None else _outcome(f, deadline, alive) for f in futures]
        if workers and self.job:
            self._report(calls, results)
        return results

    def _report(self, calls: Sequence[ToolCall | None], results: list[ToolResult | None]) -> None:
        """Log the calls' spans on their tool workers (best effort: a report that cannot be
        sent is logged; the episode goes on)."""
        spans = [
            {"worker": r.worker, "tool": c.tool, "start": r.started, "end": r.started + r.seconds}
            for c, r in zip(calls, results, strict=True)
            if c is not None and r is not None and r.worker and r.worker != "driver"
        ]
        if not spans:
            return
        try:
            self.client.log_event(TOOL_TOPIC, {"job": self.job, "spans": spans})
        except Exception:  # (reporting must never fail an episode)
            logger.warning("could not report %d tool calls' spans", len(spans), exc_info=True)

    def close(self) -> None:
        if self._local is not None:
            self._local.shutdown(wait=False, cancel_futures=True)
            self._local = None


def _outcome(future: Any, deadline: float, alive: Callable[[], bool]) -> ToolResult:
    """``future``'s result by ``deadline``, checking every :data:`POLL_S` that a worker that
    may run it is still there. A Dask future's result is fetched with
    :func:`~plexrl_dask.driver.waits.fetching`: polling ``Future.result(timeout)`` cancels
    the client's fetches and can leave it unable to return any result again."""
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
    # (best effort: the call's own limit stops its program)
    with contextlib.suppress(Exception):
        future.cancel()
