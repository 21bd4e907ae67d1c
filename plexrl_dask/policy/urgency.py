"""Urgency: when a pending head turns urgent, which workers urgent requests reserve, and the
share order they start in.

Pure code over plain state (no Dask), part of :class:`~plexrl_dask.policy.dispatch.Dispatcher`,
which keeps an :class:`Entry` per pending request and owns one :class:`Urgency` over them. The
rule is in ``DISPATCH.md`` beside this module ("Urgency and reservations", "Share order"): a
head that has waited its patience turns urgent and reserves one of its groups, and on a
reserved worker urgent requests start in share order ``K = (S, arrival, seq)``, where ``S`` is
a per-job tag (start-time fair queueing, counting requests) never below the virtual clock
``V``, the smallest pending tag. The dispatcher chooses the group to reserve and what starts;
this module keeps the deadlines, each worker's reservers and the tags, and drops what went
stale (a request that started, left or reserved elsewhere) lazily, when it reaches the top.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plexrl_dask.policy.holds import Group

if TYPE_CHECKING:
    from plexrl_dask.policy.dispatch import Request


@dataclass(eq=False)
class Entry:
    """A pending request as the dispatcher keeps it: ``seq`` numbers it in order of adding,
    ``patience`` is how long after its arrival it turns urgent (once it is its order's head),
    ``tag`` its share tag; ``head``, ``urgent`` and ``reserved`` (the group it reserved, while
    urgent) say where it stands, ``workers`` are those of all its groups."""

    request: Request
    seq: int
    patience: float
    tag: float = 0.0
    head: bool = False
    urgent: bool = False
    reserved: Group | None = None
    workers: frozenset[str] = field(default_factory=frozenset)

    @property
    def rank(self) -> tuple[float, float, int]:
        """Position in share order (``K``; arrival order when every tag is 0)."""
        return (self.tag, self.request.arrival, self.seq)


class Urgency:
    """The urgency state of one dispatcher over its pending ``entries`` (request -> entry: the
    dispatcher's own dict, read, never changed): the heads' deadlines, each worker's reservers,
    the urgent requests with no group to reserve, and the share tags."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self._entries = entries
        self._deadlines: list[tuple[float, int, str]] = []  # (urgent at, seq, request) of heads
        self._reservers: dict[str, list[tuple[float, float, int, str]]] = {}  # worker -> heap
        self.stranded: set[str] = set()  # urgent, but no group with all workers live
        # Share order: the virtual clock, the next tag of each job, the last tag of each order,
        # and the pending tags (a heap, entries of requests gone are dropped lazily).
        self.clock = 0.0
        self._next_tag: dict[str, float] = {}
        self._last_tag: dict[str, float] = {}
        self._tags: list[tuple[float, int, str]] = []

    # --- deadlines -----------------------------------------------------------------------------

    def watch(self, e: Entry) -> None:
        """``e`` became its order's head: it is due once it has waited its patience."""
        heapq.heappush(self._deadlines, (e.request.arrival + e.patience, e.seq, e.request.request))

    def due(self, now: float) -> Iterator[Entry]:
        """The heads that have waited their patience by ``now`` and are not urgent yet, by
        deadline; each deadline is dropped as its head is yielded."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, rid = heapq.heappop(self._deadlines)
            e = self._entries.get(rid)
            # (seq: the id may have been removed and added again, with a new deadline)
            if e is not None and e.seq == seq and e.head and not e.urgent:
                yield e

    # --- reservations --------------------------------------------------------------------------

    def reserve(self, e: Entry, group: Group) -> None:
        """Urgent ``e`` reserves ``group``: it joins the reservers of each of its workers."""
        e.reserved = group
        for w in group:
            heapq.heappush(self._reservers.setdefault(w, []), (*e.rank, e.request.request))

    def top(self, worker: str) -> Entry | None:
        """The first reserver of ``worker`` in share order, or None."""
        heap = self._reservers.get(worker)
        while heap:
            e = self._entries.get(heap[0][-1])
            if e is not None and e.reserved is not None and worker in e.reserved:
                return e
            heapq.heappop(heap)  # started, removed, or re-reserved elsewhere
        if heap is not None:
            del self._reservers[worker]
        return None

    def drop_worker(self, worker: str) -> list[Group]:
        """``worker`` left: the requests that reserved it lose their reservations and are
        stranded (until they reserve again); returns the groups they had reserved."""
        dropped = []
        for *_, rid in self._reservers.pop(worker, []):
            e = self._entries.get(rid)
            if e is not None and e.reserved is not None and worker in e.reserved:
                dropped.append(e.reserved)
                e.reserved = None
                self.stranded.add(rid)
        return dropped

    # --- share order ---------------------------------------------------------------------------

    def share_tag(self, request: Request, weight: float) -> float:
        """``S(r)`` of a request being added (``weight``: its job's), advancing its job's next
        tag (see "Share order")."""
        self.advance_clock()
        order, job = request.order_key, request.job
        tag = max(self.clock, self._next_tag.get(job, 0.0), self._last_tag.get(order, 0.0))
        self._next_tag[job] = tag + 1.0 / weight
        self._last_tag[order] = tag
        return tag

    def track(self, e: Entry) -> None:
        """Count ``e``'s tag among the pending ones (that the clock follows)."""
        heapq.heappush(self._tags, (e.tag, e.seq, e.request.request))

    def order_done(self, order: str) -> None:
        """No request of ``order`` pends any more: its next one's tag need not follow its last."""
        self._last_tag.pop(order, None)

    def advance_clock(self) -> float:
        """Move ``V`` up to the smallest pending tag (entries of requests gone are dropped);
        returns it."""
        tags = self._tags
        while tags:
            tag, seq, rid = tags[0]
            e = self._entries.get(rid)
            if e is not None and e.seq == seq:
                self.clock = max(self.clock, tag)
                return self.clock
            heapq.heappop(tags)
        # Nothing pending: a job whose next tag is not ahead of the clock needs no entry.
        self._next_tag = {j: t for j, t in self._next_tag.items() if t > self.clock}
        return self.clock
