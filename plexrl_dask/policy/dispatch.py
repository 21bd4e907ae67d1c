"""Runtime dispatch: which pending requests the scheduler releases to their workers now.

Pure code over plain state (no Dask), called by the scheduler plugin whenever a request arrives
or a worker slot frees up. A *request* is one API call: ``ranks`` tasks, one per worker of its
deployment's group, that must start together (a gang) or a single task.

Rule (FIFO with reservations): walk the pending requests in arrival order; a request that is
ready (all its tasks are waiting only for a worker) is released iff none of its workers is busy
and none is reserved by an earlier request that is still waiting. A waiting request reserves its
workers, so a gang is never starved by a stream of later single requests, and everything it
needs frees up in a bounded time. Because every rank of a gang is released in the same decision,
no worker ever starts part of a gang: two gangs over overlapping workers cannot deadlock. The
HRRS issue replaces the arrival order with response ratios; the atomicity rule stays.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingRequest:
    """A request as dispatch sees it: its id, the worker of each rank, and whether every one
    of its tasks has arrived and is waiting only for a worker."""

    request: str
    workers: tuple[str, ...]
    ready: bool = True

    def __post_init__(self) -> None:
        if not self.workers or len(set(self.workers)) != len(self.workers):
            raise ValueError(f"a request needs distinct workers, one per rank: {self}")


def select_releases(
    pending: Sequence[PendingRequest], busy: Iterable[str], live: Iterable[str]
) -> list[PendingRequest]:
    """The requests to release now, in arrival order (see the module docstring).

    ``busy`` are workers running a PlexRL request; ``live`` the workers that exist. A request
    naming a worker that is not live is skipped (it waits for re-routing) and reserves nothing.
    """
    taken = set(busy)
    live = set(live)
    released: list[PendingRequest] = []
    for req in pending:
        workers = set(req.workers)
        if not workers <= live or not req.ready:
            continue
        if workers & taken:
            taken |= workers  # reserve: later requests may not overtake on these workers
            continue
        released.append(req)
        taken |= workers
    return released
