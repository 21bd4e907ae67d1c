"""Runtime dispatch: which pending request runs next, and on which of its candidate workers.

Pure code over plain state (no Dask). The scheduler plugin and the simulators drive one
:class:`Dispatcher` each: they add requests, tell it when workers free up, join or leave, and
call :meth:`Dispatcher.decide` after every such event.

The rule (HRRS among candidates, waiting that beats starting, urgency and reservations, share
order, the bound and its proof, holds, lookahead, prefetch hints) is specified in the design
document beside this module, ``DISPATCH.md``; docstrings here cite its sections by name ("Share
order"). Urgency's bookkeeping (deadlines, reservations, share tags) is in
:mod:`~plexrl_dask.policy.urgency`, holds in :mod:`~plexrl_dask.policy.holds`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from plexrl_dask.policy.estimates import Costs, NoCosts
from plexrl_dask.policy.holds import Group, Hold, Holds, held_off, holds_for
from plexrl_dask.policy.urgency import Entry, Urgency


@dataclass(frozen=True)
class Request:
    """A request as dispatch sees it.

    ``groups``: its candidate groups, each with one distinct worker per rank (all of one size);
    ``order``: requests of one order run in arrival order; ``arrival``: when it could first run
    (seconds on the clock ``decide`` gets); ``service_s``: the estimated service time;
    ``inputs``: its tasks take other tasks' results that a worker of its groups must fetch
    first (nothing is queued behind it: lookahead).
    """

    request: str
    groups: tuple[Group, ...]
    arrival: float = 0.0
    service_s: float = 1.0
    order: str = ""
    deployment: str = ""
    op: str = ""
    job: str = ""
    inputs: bool = False
    holds: bool = False  # its order's next request follows soon (:mod:`~plexrl_dask.policy.holds`)

    def __post_init__(self) -> None:
        if not self.groups or any(not g or len(set(g)) != len(g) for g in self.groups):
            raise ValueError(f"a request needs groups of distinct workers, one per rank: {self}")
        if len({len(g) for g in self.groups}) != 1:
            raise ValueError(f"all groups of a request have one worker per rank: {self}")
        if not self.service_s > 0:
            raise ValueError(f"service time must be > 0: {self}")

    @property
    def order_key(self) -> str:
        return self.order or self.request


@dataclass(frozen=True)
class DispatchPolicy:
    """The knobs of the rule (``plexrl.scheduler.*``; see ``DISPATCH.md``)."""

    setup_weight: float = 2.0  # alpha
    patience_factor: float = 8.0  # beta
    patience_floor_s: float = 2.0  # floor
    choice: str = "residency"  # or "blind": how a request chooses among its groups
    lookahead: bool = False  # queue one single-worker request behind a running one
    fair_share: bool = True  # urgent requests in share order (per-job tags), not arrival
    # Job -> weight in the share order (default 1): a job of weight 2 gets two urgent turns
    # per turn of a job of weight 1. Pairs, so that the policy stays hashable.
    job_weights: tuple[tuple[str, float], ...] = ()
    # Hold a gang's workers for its order's next request, for at most this long after its
    # last one ended (0: off; see :mod:`~plexrl_dask.policy.holds`).
    gang_hold_s: float = 0.0
    # The same for the order of a request marked ``holds`` (an agentic turn; 0: off).
    turn_hold_s: float = 0.0

    def __post_init__(self) -> None:
        if not all(
            v >= 0
            for v in (
                self.setup_weight,
                self.patience_factor,
                self.patience_floor_s,
                self.gang_hold_s,
                self.turn_hold_s,
            )
        ):
            raise ValueError(f"dispatch weights must be >= 0: {self}")
        if self.choice not in ("residency", "blind"):
            raise ValueError(f"choice must be 'residency' or 'blind', got {self.choice!r}")
        for job, weight in self.job_weights:
            if not (isinstance(job, str) and isinstance(weight, int | float) and weight > 0):
                raise ValueError(f"job weights are job -> number > 0, got {job!r}: {weight!r}")
            if weight == float("inf"):
                raise ValueError(f"job weight of {job!r} must be finite")

    @classmethod
    def fifo(
        cls,
        choice: str = "residency",
        lookahead: bool = False,
        gang_hold_s: float = 0.0,
        turn_hold_s: float = 0.0,
    ) -> DispatchPolicy:
        """Arrival order with reservations: every head urgent at once, no share order."""
        return cls(
            setup_weight=0.0,
            patience_factor=0.0,
            patience_floor_s=0.0,
            choice=choice,
            lookahead=lookahead,
            fair_share=False,
            gang_hold_s=gang_hold_s,
            turn_hold_s=turn_hold_s,
        )

    def weight(self, job: str) -> float:
        """``job``'s weight in the share order."""
        return dict(self.job_weights).get(job, 1.0)

    def ratio(self, wait_s: float, service_s: float, setup_s: float) -> float:
        return (max(0.0, wait_s) + service_s) / (service_s + self.setup_weight * setup_s)

    def patience(self, service_s: float, setup_s: float) -> float:
        return self.patience_factor * (service_s + setup_s) + self.patience_floor_s


@dataclass(frozen=True)
class Decision:
    """A released request, where, and why."""

    request: Request
    group: Group
    ratio: float
    setup_s: float
    wait_s: float
    urgent: bool
    behind: str | None = None  # lookahead: queued behind this request, running on the worker
    tag: float = 0.0  # its share tag (see "Share order")

    def to_dict(self) -> dict:
        r = self.request
        return {
            "request": r.request,
            "deployment": r.deployment,
            "op": r.op,
            "job": r.job,
            "workers": list(self.group),
            "wait_s": self.wait_s,
            "ratio": self.ratio,
            "service_s": r.service_s,
            "setup_s": self.setup_s,
            "urgent": self.urgent,
            "behind": self.behind,
            "tag": self.tag,
        }


class Dispatcher:
    """The dispatch state of one cluster (the rule: ``DISPATCH.md``)."""

    def __init__(
        self,
        policy: DispatchPolicy | None = None,
        costs: Costs | None = None,
        workers: Iterable[str] = (),
    ) -> None:
        self.policy = policy or DispatchPolicy.fifo()
        self.costs: Costs = costs or NoCosts()
        self._live: set[str] = set(workers)
        self._free: set[str] = set(self._live)
        self._busy: dict[str, str] = {}  # worker -> request running there
        self._busy_until: dict[str, float] = {}  # worker -> estimated end of what runs there
        # Lookahead: worker -> (request queued behind the running one, its deployment, the
        # estimated end of the running one, whether it has inputs); and the busy workers
        # whose slot to look at.
        self._next: dict[str, tuple[str, str, float, bool]] = {}
        self._next_dirty: set[str] = set()
        self._inputs: set[str] = set()  # workers whose running request has inputs
        self._queues: dict[str, deque[Entry]] = {}
        self._entries: dict[str, Entry] = {}  # pending, in order of add()
        self._eligible: dict[str, set[str]] = {}  # worker -> orders with a non-urgent head there
        self._urgency = Urgency(self._entries)  # deadlines, reservations, share tags
        # Workers where what may start changed since the last decision (freed, joined, a new
        # head or reservation there, a reservation gone): only these are looked at.
        self._dirty: set[str] = set(self._live)
        self._seq = itertools.count()
        self._last_arrival: dict[str, float] = {}
        # Gangs (and turns) that hold their workers (see "Holds")
        self._holds = Holds(self)

    # --- state changes -----------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        if worker not in self._live:
            self._live.add(worker)
            if worker not in self._busy:
                self._free.add(worker)
            self._dirty.add(worker)
            self._stranded_retry()

    def remove_worker(self, worker: str) -> None:
        """``worker`` left: it runs nothing, urgent requests that reserved it choose again, and
        heads that could run on it are looked at again on their other workers (one may have
        been waiting for this worker to free up: see :meth:`_best_group`)."""
        for order in self._eligible.get(worker, ()):
            queue = self._queues.get(order)
            if queue:
                self._dirty.update(queue[0].workers)
        self._live.discard(worker)
        self._free.discard(worker)
        self._busy.pop(worker, None)
        self._busy_until.pop(worker, None)
        self._next.pop(worker, None)
        self._inputs.discard(worker)
        for group in self._urgency.drop_worker(worker):
            self._dirty.update(group)

    def add(self, request: Request) -> float:
        """Queue ``request`` (its arrival is raised to its order's last arrival, if earlier);
        returns its patience."""
        if request.request in self._entries:
            raise ValueError(f"request {request.request!r} is already pending")
        order = request.order_key
        last = self._last_arrival.get(order)
        if last is not None and request.arrival < last:
            request = _replace_arrival(request, last)
        self._last_arrival[order] = request.arrival
        self._holds.arrived(order, request.arrival, first_pending=not self._queues.get(order))
        setup = min(self._setup(request, g) for g in request.groups)
        e = Entry(
            request,
            next(self._seq),
            self.policy.patience(request.service_s, setup),
            tag=self._share_tag(request),
            workers=frozenset(w for g in request.groups for w in g),
        )
        self._entries[request.request] = e
        if self.policy.fair_share:
            self._urgency.track(e)
        queue = self._queues.setdefault(order, deque())
        queue.append(e)
        if len(queue) == 1:
            self._make_head(e)
        return e.patience

    def remove(self, request: str) -> Request | None:
        """Drop a pending request (cancelled, failed, or to be routed again)."""
        e = self._entries.pop(request, None)
        if e is None:
            return None
        order = e.request.order_key
        queue = self._queues[order]
        if e.head:
            self._unhead(e)
            queue.popleft()
            if queue:
                self._make_head(queue[0])
        else:
            queue.remove(e)
        if not queue:
            del self._queues[order]
            self._last_arrival.pop(order, None)
            self._urgency.order_done(order)
        self._urgency.stranded.discard(request)
        if e.reserved is not None:
            self._dirty.update(e.reserved)
            e.reserved = None
        return e.request

    def release_worker(
        self, worker: str, request: str | None = None, now: float | None = None
    ) -> None:
        """The task of ``request`` on ``worker`` ended (each rank of a gang frees its own
        worker) at ``now`` (needed for a gang's hold). Without ``request``, or naming the
        running one: the running task; a request queued behind it (lookahead) then runs
        there, else the worker is free. Naming the queued request: it ended (cancelled)
        before it ran, and the slot is open again. A request that neither runs nor waits
        there changes nothing."""
        self._holds.rank_ended(worker, request, self._busy, now)
        queued = self._next.get(worker)
        stale = request is not None and request != self._busy.get(worker)
        if stale and (queued is None or request != queued[0]):
            return  # neither runs nor waits here
        if queued is not None:
            if request == queued[0]:
                self._busy_until[worker] = queued[2]
            else:
                self._busy[worker] = queued[0]  # it starts now; its estimated end stands
                if queued[3]:
                    self._inputs.add(worker)
                else:
                    self._inputs.discard(worker)
            del self._next[worker]
            self._next_dirty.add(worker)
            return
        self._busy_until.pop(worker, None)
        self._inputs.discard(worker)
        if self._busy.pop(worker, None) is not None and worker in self._live:
            self._free.add(worker)
            self._dirty.add(worker)

    # --- what holds read (policy.holds.DispatchView) ----------------------------------------

    def running_ends(self, request: str, group: Group, now: float) -> list[float]:
        """The expected ends of the ranks of ``request`` that run on ``group``'s workers."""
        return [self._busy_until.get(w, now) for w in group if self._busy.get(w) == request]

    def waits(self, order: str) -> bool:
        """Whether a request of ``order`` is pending."""
        return bool(self._queues.get(order))

    def waiting_until(self, order: str, group: Group, now: float) -> float | None:
        """For ``order``'s pending head: until when ``group``'s busy workers are expected to
        run; None when it waits for other workers, or ``group`` is promised to another's
        urgent request."""
        head = self._queues[order][0]
        if group not in head.request.groups or not self._all_live(group):
            return None
        if any(self._urgency.top(w) not in (None, head) for w in group):
            return None
        return max([now] + [self._busy_until.get(w, now) for w in group if w in self._busy])

    def holds(self, now: float) -> dict[str, Hold]:
        """Free worker -> (until, jobs, orders) of the holds on it now (see "Holds"): why a
        free worker runs nothing while requests wait. A hold that has lapsed is dropped, as a
        decision at ``now`` would."""
        return self._holds.on_free(self._free, now)

    def next_wakeup(self, now: float) -> float | None:
        """When a hold on a free worker ends while a request waits (a decision then may
        start what the hold kept back; no event marks that moment), else None."""
        if not self._entries:
            return None
        ends = [until for until, *_ in self._holds.on_free(self._free, now).values() if until > now]
        return min(ends, default=None)

    # --- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: str) -> bool:
        return request in self._entries

    @property
    def busy(self) -> dict[str, str]:
        return dict(self._busy)

    @property
    def queued(self) -> dict[str, str]:
        """Worker -> the request queued behind its running one (lookahead)."""
        return {w: q[0] for w, q in self._next.items()}

    def pending(self) -> Iterator[Request]:
        """Pending requests, in the order they were added."""
        return (e.request for e in self._entries.values())

    def ratio(self, request: Request, now: float) -> tuple[float, float]:
        """``request``'s current best (ratio, setup) over its live groups (setup ``inf`` if none)."""
        setup, group = self.best_group(request)
        if not group:
            return 0.0, setup
        return self.policy.ratio(now - request.arrival, request.service_s, setup), setup

    def best_group(self, request: Request) -> tuple[float, Group]:
        """``request``'s live group with the cheapest setup (the first of equals) and that
        setup; ``(inf, ())`` when none of its groups is live."""
        best: tuple[float, Group] = (float("inf"), ())
        for g in request.groups:
            if self._all_live(g):
                setup = self._setup(request, g)
                if setup < best[0] or not best[1]:
                    best = (setup, g)
        return best

    def tag(self, request: str) -> float | None:
        """The share tag of a pending request (``None`` if it is not pending)."""
        e = self._entries.get(request)
        return None if e is None else e.tag

    @property
    def clock(self) -> float:
        """The virtual clock ``V``: the smallest tag of a pending request (it never goes back)."""
        return self._urgency.advance_clock()

    def is_urgent(self, request: str) -> bool:
        e = self._entries.get(request)
        return bool(e and e.urgent)

    def hint(self, worker: str, now: float) -> str | None:
        """The deployment ``worker`` is predicted to run next: that of the request queued
        there (lookahead), else of its first urgent reserver, else of the best head that may
        run there (by ratio), else ``None``."""
        queued = self._next.get(worker)
        if queued is not None:
            return queued[1] or None
        top = self._urgency.top(worker)
        if top is not None:
            return top.request.deployment or None
        best: tuple[float, int] | None = None
        choice = None
        for order in self._eligible.get(worker, ()):
            e = self._queues[order][0]
            groups = [g for g in e.request.groups if worker in g]
            setup = min(self._setup(e.request, g) for g in groups)
            key = (self.policy.ratio(now - e.request.arrival, e.request.service_s, setup), -e.seq)
            if best is None or key > best:
                best, choice = key, e.request.deployment
        return choice or None

    # --- the decision --------------------------------------------------------------------------

    def decide(self, now: float) -> list[Decision]:
        """Release what may start now: urgent requests first, then the best ratios."""
        out: list[Decision] = []
        while True:
            self._promote(now)
            released = len(out)
            if self.policy.lookahead:
                self._next_dirty |= self._dirty - self._free
            dirty, self._dirty = self._dirty & self._free, set()
            if not (self._release_urgent(dirty, now, out) and self._release_best(dirty, now, out)):
                self._dirty |= dirty  # stopped early: look at them again after promoting
            elif self.policy.lookahead and len(out) == released:
                self._release_lookahead(now, out)
            if len(out) == released:
                return out

    def _release_lookahead(self, now: float, out: list[Decision]) -> None:
        """Queue, on each busy worker with an open slot, the request it would run next (see
        "Lookahead"), until a release makes an overdue request a head."""
        watch, self._next_dirty = sorted(self._next_dirty), set()
        for i, w in enumerate(watch):
            if w not in self._live or w not in self._busy or w in self._next or w in self._inputs:
                continue
            e, blocked = self._next_for(w, now)
            if e is None:
                if blocked:
                    self._next_dirty.add(w)  # a gang comes first: look again as time passes
                continue
            out.append(self._queue_behind(e, w, now))
            if self._overdue_next(e, now):
                self._next_dirty.update(watch[i + 1 :])
                return

    def _next_for(self, worker: str, now: float) -> tuple[Entry | None, bool]:
        """The single-worker request to queue behind ``worker``'s running one, if any; and
        whether a gang comes first there (ratios move with time: look again later)."""
        top = self._urgency.top(worker)
        if top is not None:
            return (top, False) if top.reserved == (worker,) else (None, False)
        ranked = []
        for order in self._eligible.get(worker, ()):
            e = self._queues[order][0]
            setup = min(self._setup(e.request, g) for g in e.request.groups if worker in g)
            ratio = self.policy.ratio(now - e.request.arrival, e.request.service_s, setup)
            ranked.append(((not e.urgent, e.rank if e.urgent else (-ratio, e.seq)), e))
        hold = self._holds.on_busy(worker, now)
        held = False
        for _, e in sorted(ranked, key=lambda x: x[0]):
            if (worker,) not in e.request.groups:
                return None, True
            if (
                hold is not None
                and not e.urgent
                and not holds_for(hold, e.request.order_key, e.request.job)
            ):
                end = max(now, self._busy_until.get(worker, now)) + e.request.service_s
                if end + self._setup(e.request, (worker,)) > hold[0]:
                    held = True  # held for another order: the next may fit or be the holder's
                    continue
            if self._soonest_on(e, worker, now):
                return e, False
        return None, held  # (held: look again as time passes)

    def _soonest_on(self, e: Entry, worker: str, now: float) -> bool:
        """Whether ``e`` is expected to start on ``worker`` alone (after what runs and is
        queued there, and its setup) no later than on any other of its live groups."""

        def eta(group: Group) -> float:
            ready = max(self._busy_until.get(w, now) if w in self._busy else now for w in group)
            return max(now, ready) + self._setup(e.request, group)

        here = eta((worker,))
        return all(
            here <= eta(g)
            for g in e.request.groups
            if g != (worker,)
            and self._all_live(g)
            and all(self._urgency.top(w) in (None, e) for w in g)
        )

    def _queue_behind(self, e: Entry, worker: str, now: float) -> Decision:
        setup = self._setup(e.request, (worker,))
        ratio = self.policy.ratio(now - e.request.arrival, e.request.service_s, setup)
        running_until = self._busy_until.get(worker, now)
        self._next[worker] = (
            e.request.request,
            e.request.deployment,
            running_until,
            e.request.inputs,
        )
        self._busy_until[worker] = max(now, running_until) + setup + e.request.service_s
        behind = self._busy[worker]
        self.remove(e.request.request)  # (also drops its reservation)
        return Decision(
            e.request, (worker,), ratio, setup, now - e.request.arrival, e.urgent, behind, e.tag
        )

    def _promote(self, now: float) -> None:
        """Heads that have waited their patience become urgent and reserve a group."""
        self._stranded_retry()
        for e in self._urgency.due(now):
            self._make_urgent(e)

    def _release_urgent(self, dirty: set[str], now: float, out: list[Decision]) -> bool:
        """Start urgent requests on their reserved groups where they may (only a reserver of
        a ``dirty`` worker can have become startable); False if a start made an overdue request
        a head (to be promoted before anything else starts)."""
        candidates = {}
        for w in dirty:
            top = self._urgency.top(w)
            if top is not None:
                candidates[top.request.request] = top
        for e in sorted(candidates.values(), key=lambda e: e.rank):
            group = e.reserved
            if group is not None and all(
                w in self._free and self._urgency.top(w) is e for w in group
            ):
                out.append(self._start(e, group, now, urgent=True))
                if self._overdue_next(e, now):
                    return False
        return True

    def _release_best(self, dirty: set[str], now: float, out: list[Decision]) -> bool:
        """Start heads on free, unreserved groups: urgent ones first in share order (on their
        cheapest free group, which may differ from the one they reserved), then the rest in
        ratio order with backfilling (below). Only heads that may run on a ``dirty`` worker can
        have become startable. Returns False early when a release makes an overdue request a
        head, so that ``decide`` promotes it before anything else starts.

        **Backfilling.** A head that cannot start now (a gang whose other workers are busy, a
        read waiting for its replica) still takes its turn in ratio order: it *holds* the free
        workers of the group it expects to start on soonest until that group's busy workers
        are expected to finish, and a lower-ratio request may use a held worker only if it is
        expected to end by then (EASY backfilling, by estimates). So a gang with the best ratio
        is not overtaken indefinitely by singles before it turns urgent. A start looks again at
        the heads that could use its workers: one that was waiting may now start elsewhere (the
        start took the busy group it waited for) or hold another group."""
        urgent: list[Entry] = []
        heads: list[Entry] = []
        seen: set[str] = set()
        for w in dirty:
            if w not in self._free or self._urgency.top(w) is not None:
                continue
            for order in self._eligible.get(w, ()):
                e = self._queues[order][0]
                if e.request.request in seen:
                    continue
                seen.add(e.request.request)
                (urgent if e.urgent else heads).append(e)
        for e in sorted(urgent, key=lambda e: e.rank):
            best = self._best_group(e, now, urgent=True)
            if best is not None:
                out.append(self._start(e, best[0], now, urgent=True, setup=best[1]))
                if self._overdue_next(e, now):
                    return False
                queue = self._queues.get(e.request.order_key)
                if queue and not queue[0].urgent:
                    heads.append(queue[0])  # the new head competes by ratio
        held: dict[str, float] = {}  # free worker -> time until which it is held
        gangs = self._holds.on_free(
            self._free, now
        )  # free worker -> (until, jobs, orders) holding it
        versions: dict[str, int] = {}
        heap: list[tuple[float, float, int, int, str, Group | None, float]] = []

        def push(e: Entry) -> None:
            if e.urgent or not e.head:
                return
            rid = e.request.request
            versions[rid] = versions.get(rid, 0) + 1
            best = self._best_group(e, now, urgent=False, held=held, gangs=gangs)
            if best is not None:
                group, setup = best
            else:
                setups = [self._setup(e.request, g) for g in e.request.groups if self._all_live(g)]
                if not setups:
                    return
                group, setup = None, min(setups)
            ratio = self.policy.ratio(now - e.request.arrival, e.request.service_s, setup)
            heapq.heappush(
                heap, (-ratio, e.request.arrival, e.seq, versions[rid], rid, group, setup)
            )

        def push_around(workers: Iterable[str]) -> None:
            for order in {o for w in workers for o in self._eligible.get(w, ())}:
                push(self._queues[order][0])

        for e in heads:
            push(e)
        try:
            while heap:
                neg_ratio, _, _, version, rid, group, setup = heapq.heappop(heap)
                e = self._entries.get(rid)
                if e is None or not e.head or e.urgent or versions.get(rid) != version:
                    continue  # started, promoted, or superseded by a fresher entry
                if group is None:
                    push_around(self._hold(e, now, held))
                    continue
                out.append(self._start(e, group, now, urgent=False, ratio=-neg_ratio, setup=setup))
                if self._overdue_next(e, now):
                    return False
                queue = self._queues.get(e.request.order_key)
                if queue:
                    push(queue[0])
                push_around(group)  # heads that could have used these workers
            return True
        finally:
            # Held workers stay under watch: who holds them changes with time, not events.
            self._dirty.update(w for w in (*held, *gangs) if w in self._free)

    def _hold(self, e: Entry, now: float, held: dict[str, float]) -> list[str]:
        """Hold, for blocked head ``e``, the free workers of the group it can start on soonest
        (expected start = when that group's busy workers end; then cheapest setup); returns
        the workers newly held."""
        best: tuple[float, int, Group, float] | None = None
        for i, group in enumerate(e.request.groups):
            if not self._all_live(group) or any(self._urgency.top(w) is not None for w in group):
                continue
            start = max(max(now, self._busy_until.get(w, now)) for w in group)
            key = (start + self._setup(e.request, group), i)
            if best is None or key < best[:2]:
                best = (key[0], i, group, start)
        if best is None or best[3] <= now:
            return []
        until = best[3]
        newly = []
        for w in best[2]:
            if w in self._free and until < held.get(w, float("inf")):
                held[w] = until
                newly.append(w)
        return newly

    def _overdue_next(self, started: Entry, now: float) -> bool:
        """Whether the new head of ``started``'s order has waited its patience already."""
        queue = self._queues.get(started.request.order_key)
        return bool(queue) and queue[0].request.arrival + queue[0].patience <= now

    def _best_group(
        self,
        e: Entry,
        now: float,
        urgent: bool,
        held: dict[str, float] | None = None,
        gangs: dict[str, Hold] | None = None,
    ) -> tuple[Group, float] | None:
        """The free, unreserved group of ``e`` with the cheapest setup (then least crowded);
        for a request that is not urgent, only groups whose ``held`` workers it would release
        in time (see :meth:`_release_best`).

        With the residency-aware choice, a request that is not urgent rather waits (``None``) for a
        busy group of its own that is expected to free up and set it up sooner than the free
        one can: a data-parallel read keeps to the replica that holds its model instead of
        displacing another model elsewhere."""
        best: tuple[tuple, Group, float] | None = None
        for i, group in enumerate(e.request.groups):
            if not self._usable(group):
                continue
            setup = self._setup(e.request, group)
            if held and not urgent:
                end = now + setup + e.request.service_s
                if any(end > held.get(w, float("inf")) for w in group):
                    continue
            if gangs and not urgent:
                end = now + setup + e.request.service_s
                if held_off(gangs, group, end, e.request.order_key, e.request.job):
                    continue
            if self.policy.choice == "blind":
                return group, setup
            key = (setup, sum(self.costs.crowding(w) for w in group), i)
            if best is None or key < best[0]:
                best = (key, group, setup)
        if best is None or urgent or self.policy.choice == "blind" or len(e.request.groups) < 2:
            return None if best is None else (best[1], best[2])
        free_setup = best[2]
        for group in e.request.groups:
            if group == best[1] or not self._all_live(group) or self._usable(group):
                continue
            if any(w not in self._busy_until and w not in self._free for w in group):
                continue
            if any(self._urgency.top(w) is not None for w in group):
                continue  # promised to an urgent request: no telling when
            wait = max(max(0.0, self._busy_until.get(w, now) - now) for w in group)
            if wait + self._setup(e.request, group) < free_setup:
                return None
        return best[1], best[2]

    # --- internals -----------------------------------------------------------------------------

    def _share_tag(self, request: Request) -> float:
        """``S(r)`` of a request being added (0 without fair share; see "Share order")."""
        if not self.policy.fair_share:
            return 0.0
        return self._urgency.share_tag(request, self.policy.weight(request.job))

    def _setup(self, request: Request, group: Group) -> float:
        return self.costs.setup_s(request.deployment or request.order_key, group)

    def _all_live(self, group: Group) -> bool:
        return all(w in self._live for w in group)

    def _usable(self, group: Group) -> bool:
        return all(w in self._free and self._urgency.top(w) is None for w in group)

    def _make_head(self, e: Entry) -> None:
        e.head = True
        self._dirty.update(e.workers)
        order = e.request.order_key
        for w in e.workers:
            self._eligible.setdefault(w, set()).add(order)
        self._urgency.watch(e)

    def _unhead(self, e: Entry) -> None:
        e.head = False
        order = e.request.order_key
        for w in e.workers:
            orders = self._eligible.get(w)
            if orders is not None:
                orders.discard(order)
                if not orders:
                    del self._eligible[w]

    def _make_urgent(self, e: Entry) -> None:
        e.urgent = True
        self._reserve(e)

    def _reserve(self, e: Entry) -> None:
        groups = [g for g in e.request.groups if self._all_live(g)]
        if not groups:
            self._urgency.stranded.add(e.request.request)
            return
        if self.policy.choice == "blind":
            group = min(groups, key=lambda g: sum(w in self._busy for w in g))
        else:
            group = min(
                groups,
                key=lambda g: (
                    self._setup(e.request, g),
                    sum(w in self._busy for w in g),
                    sum(self.costs.crowding(w) for w in g),
                ),
            )
        self._urgency.reserve(e, group)
        self._dirty.update(group)

    def _stranded_retry(self) -> None:
        for rid in list(self._urgency.stranded):
            e = self._entries.get(rid)
            self._urgency.stranded.discard(rid)
            if e is not None and e.urgent and e.reserved is None:
                self._reserve(e)

    def _start(
        self,
        e: Entry,
        group: Group,
        now: float,
        urgent: bool,
        ratio: float | None = None,
        setup: float | None = None,
    ) -> Decision:
        if setup is None:
            setup = self._setup(e.request, group)
        if ratio is None:
            ratio = self.policy.ratio(now - e.request.arrival, e.request.service_s, setup)
        rid = e.request.request
        for w in group:
            self._busy[w] = rid
            self._busy_until[w] = now + setup + e.request.service_s
            self._free.discard(w)
            if e.request.inputs:
                self._inputs.add(w)
            else:
                self._inputs.discard(w)
        if self.policy.lookahead:
            self._next_dirty.update(group)  # a slot opened behind it
        r = e.request
        self._holds.started(r.order_key, r.job, group, rid, r.op, r.holds)
        self.remove(rid)  # (also drops its reservation, wherever it started)
        return Decision(e.request, group, ratio, setup, now - e.request.arrival, urgent, tag=e.tag)


def _replace_arrival(request: Request, arrival: float) -> Request:
    return replace(request, arrival=arrival)
