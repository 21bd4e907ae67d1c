"""Waiting for Dask futures with a timeout, without poisoning the client.

``distributed.Future.result(timeout=t)`` runs the fetch of the result under ``wait_for`` and
cancels it when ``t`` runs out. A client batches its concurrent fetches into one shared
``_gather_remote`` task that waits on a semaphore; cancelled there, before it runs, it stays
the client's pending gather for good, and every later ``result()`` of that client (any future,
any thread) attaches to it and ends in ``CancelledError`` (read by distributed 2026.8's
``sync`` as an ``UnboundLocalError``): the client never returns a result again. Agentic jobs
met this (their tool calls stopped returning once one poll timed out at the wrong moment).

So a wait here never cancels a fetch: :func:`fetching` starts the fetch on the client's event
loop and hands back a ``concurrent.futures.Future`` that the caller waits for with its own
timeouts, as often as it likes; a fetch that is given up on finishes (or fails) on its own,
harmlessly, when the Dask future settles (a cancelled Dask future ends it at once).

What needs no answer is not waited for at all: :func:`post_event` logs an event on the
scheduler from the client's loop while the caller goes on (``Client.log_event`` waits for
the scheduler's reply, a round trip that an agentic episode would otherwise pay every turn).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from distributed import Future
from distributed.client import FutureCancelledError

from plexrl_dask import config
from plexrl_dask.errors import PlexRLError, RequestTimeout, SchedulerLost

logger = logging.getLogger(__name__)

# Why a client cancels its futures when its scheduler goes (distributed.client).
_SCHEDULER_GONE = ("scheduler-connection-lost", "scheduler-restart")


def fetching(future: Future) -> concurrent.futures.Future:
    """Start fetching ``future``'s result on its client's loop: the returned future gives the
    value or raises the task's error; wait for it with a timeout, never cancel it."""
    loop = future.client.loop.asyncio_loop
    if loop.is_closed():
        raise RuntimeError("the client's event loop is closed")
    return asyncio.run_coroutine_threadsafe(_first(future), loop)


def post_event(client: Any, topic: str, msg: Any) -> None:
    """Log ``msg`` under ``topic`` on ``client``'s scheduler (as ``Client.log_event`` does)
    without waiting: best effort, a failure is logged, never raised. Events posted so may
    reach the scheduler out of order (each takes a connection of the client's pool)."""

    async def send() -> None:
        try:
            await client.scheduler.log_event(topic=topic, msg=msg)
        except Exception as e:  # noqa: BLE001 (a report must never fail its sender)
            logger.warning("could not log a %s event: %r", topic, e)

    coroutine = send()
    try:
        asyncio.run_coroutine_threadsafe(coroutine, client.loop.asyncio_loop)
    except RuntimeError as e:  # (the client's loop is closed)
        coroutine.close()  # (never to run: closed, not left unawaited)
        logger.warning("could not log a %s event: %r", topic, e)


def run_on_workers(
    client: Any,
    function: Any,
    *args: Any,
    workers: list[str] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """``client.run(function, *args, workers=workers, on_error="return")`` (each worker's
    error is its value) within ``timeout`` seconds (default ``plexrl.request.timeout``):
    :class:`RequestTimeout` past it. ``Client.run`` alone waits for a hung worker forever."""
    timeout = config.request_timeout() if timeout is None else timeout
    try:
        return client.sync(
            client._run, function, *args, workers=workers, on_error="return",
            callback_timeout=timeout,
        )  # fmt: skip
    except TimeoutError as e:
        if isinstance(e, PlexRLError):
            raise
        raise RequestTimeout(
            f"{getattr(function, '__name__', function)} did not answer from every worker "
            f"within {timeout:.0f}s (a worker hung or paused?)"
        ) from e


async def _first(future: Future) -> Any:
    [value] = await future.client.gather([future], asynchronous=True)
    return value


def result(futures: Any, timeout: float | None = None) -> Any:
    """Wait for a future (or a list of them) with a timeout and return the result(s).

    Raises :class:`RequestTimeout` once ``timeout`` seconds (default ``plexrl.request.timeout``)
    have passed for the whole list; a failed request raises its own (typed) error. Each future
    is waited for through its own client, so this works with non-default clients too.
    """
    timeout = config.request_timeout() if timeout is None else timeout
    many = isinstance(futures, (list, tuple))
    items = list(futures) if many else [futures]
    deadline = time.monotonic() + timeout
    pending = [fetching(f) if isinstance(f, Future) else f for f in items]
    values = []
    for p in pending:
        try:
            values.append(p.result(timeout=max(deadline - time.monotonic(), 0.0)))
        except FutureCancelledError as e:
            if e.reason in _SCHEDULER_GONE:
                raise SchedulerLost(
                    f"the scheduler went away ({e.reason}) with {len(items)} PlexRL request(s) "
                    "in flight; they were cancelled"
                ) from e
            raise
        except TimeoutError as e:
            if isinstance(e, PlexRLError):
                raise  # a request's own typed timeout (e.g. GroupTimeout)
            raise RequestTimeout(
                f"{sum(not g.done() for g in items)} PlexRL request(s) did not finish within "
                f"{timeout:.0f}s (plexrl.request.timeout)"
            ) from e
    return values if many else values[0]


async def settled(future: Future, timeout: float | None = None) -> Any:
    """``future``'s result, awaited from another event loop (an HTTP server's), within
    ``timeout`` seconds (default ``plexrl.request.timeout``): :class:`RequestTimeout` past it.
    The fetch is shielded: giving up on it (a timeout, a cancelled caller) never cancels it."""
    timeout = config.request_timeout() if timeout is None else timeout
    pending = asyncio.wrap_future(fetching(future))
    try:
        return await asyncio.wait_for(asyncio.shield(pending), timeout)
    except FutureCancelledError as e:
        if e.reason in _SCHEDULER_GONE:
            raise SchedulerLost(
                f"the scheduler went away ({e.reason}) with a request in flight"
            ) from e
        raise
    except TimeoutError as e:
        if isinstance(e, PlexRLError):
            raise
        raise RequestTimeout(f"a PlexRL request did not finish within {timeout:.0f}s") from e
