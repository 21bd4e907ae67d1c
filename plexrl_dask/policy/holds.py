"""Holds: an order of requests keeping its workers for its next request.

Pure code over plain state (no Dask), part of :class:`~plexrl_dask.policy.dispatch.Dispatcher`,
which owns one :class:`Holds` and asks it, while deciding, which free or busy workers are held,
until when and for whom.

**Gangs hold their workers** (``DispatchPolicy.gang_hold_s`` > 0; off by default). A gang
needs all its workers free at once, and its job's driver submits its next request only after
reading the last one's result: in between, a single-worker request of another job that starts
on one of its workers holds the whole gang up, and a rank that ends before the rest of its gang
frees a worker that the gang needs again moments later. So each order of gang requests holds
its group's free workers: while one of its requests runs, until that request is expected to
end plus the gap its requests usually leave between an end and the next arrival (learned per
order and per kind of request before the gap, its op and whether it is marked ``holds``: a
running mean, capped at ``gang_hold_s``; a request that arrives while the one before it runs
teaches a gap of 0, as a driver that sends its next step ahead does); after it ended, until
that end plus the gap; while its next request waits for the group (nobody else's urgent
request reserved it), until the group's busy workers are expected to end. Another job's
request that is not urgent starts on a held worker only if it is expected to end by then (the
same test as backfilling); the gang's own order and job (its rollout, its syncs) and urgent
requests ignore holds, so the dispatcher's bound is unaffected. No event marks the end of a
hold: :meth:`Dispatcher.next_wakeup` says when to decide again. Measured on the standard mix in
a pool of two workers, it did not lower the pool's cost (``benchmarks/RESULTS.md``,
bench.multiplex at 192 MiB), which is why it is off.

**Turns hold their worker** (``DispatchPolicy.turn_hold_s`` > 0). An agentic episode's model
turn is one request, and the episode's next turn arrives once the turn's tool calls have run;
another job's long request that starts on the worker meanwhile holds that turn up, and the
episode's job, whose wall time is mostly tool calls, is the one a pool waits for. A request
marked ``holds`` (a turn after which tools run) makes its order hold its worker exactly as a
gang's order does, capped at ``turn_hold_s``: others start there meanwhile only if they are
expected to end before the turn's learned return, and the order's next request, once it waits,
takes the worker first. The order then holds with each of its requests (the episode's last
turn, its training, the next step's first turn: the gap after each kind of request is
learned apart, so that the scoring after the last turn and the next turn sent while the
training runs each get their own) until a hold lapses with nothing of it running or waiting;
a gap is learned also when it outlasted the hold. Two orders that hold one worker (two
agentic jobs sharing it) do not keep each other out: either's requests start there by
ratio, and the rest only if they end before the earlier hold does.
"""

from __future__ import annotations

from typing import Protocol

Group = tuple[str, ...]
#: Orders whose hold lapsed that are remembered, to learn the gap to their next request.
LAPSED_KEPT = 4096
#: What a held order's gap to its next request is learned per: the op of the request before
#: the gap, and whether it was marked ``holds``.
Kind = tuple[str, bool]
NO_KIND: Kind = ("", False)
#: A held worker's hold: until when, for which jobs and which orders.
Hold = tuple[float, frozenset[str], frozenset[str]]


class HoldPolicy(Protocol):
    gang_hold_s: float
    turn_hold_s: float


class DispatchView(Protocol):
    """What holds read of the dispatch state."""

    policy: HoldPolicy

    def running_ends(self, request: str, group: Group, now: float) -> list[float]:
        """The expected ends of the ranks of ``request`` that run on ``group``'s workers."""
        ...

    def waits(self, order: str) -> bool:
        """Whether a request of ``order`` is pending."""
        ...

    def waiting_until(self, order: str, group: Group, now: float) -> float | None:
        """For ``order``'s pending head: until when ``group``'s busy workers are expected to
        run, or None when it does not wait for ``group`` (it waits for other workers, or the
        group is promised to another's urgent request)."""
        ...


def holds_for(hold: Hold, order: str, job: str) -> bool:
    """Whether ``hold`` (until, jobs, orders) is for a request of ``order`` and ``job``: one of
    the holding orders, or another request of a holding job (the rest of its chain: its
    rollout, its syncs)."""
    return order in hold[2] or (bool(job) and job in hold[1])


def held_off(holds: dict[str, Hold], group: Group, end: float, order: str, job: str) -> bool:
    """Whether ``holds`` (worker -> its hold) keep a request of ``order`` and ``job`` that would
    run on ``group`` until ``end`` off it: a worker of ``group`` is held, for others, until
    before ``end``."""
    return any(
        w in holds and end > holds[w][0] and not holds_for(holds[w], order, job) for w in group
    )


class Holds:
    """The holding orders of one dispatcher: per order its job, group and whether it is a
    chain of turns, the request of it that runs, when its last one ended, and the learned gap
    from an end to the next arrival (per kind of request before the gap)."""

    def __init__(self, view: DispatchView) -> None:
        self._view = view
        self.orders: dict[str, tuple[str, Group, bool]] = {}  # order -> (job, group, turns)
        self.running: dict[str, str] = {}  # order -> request
        self.ended: dict[str, float] = {}
        self.gap: dict[tuple[str, Kind], float] = {}
        self.kind: dict[str, Kind] = {}  # order -> kind of its running or last request
        # order -> (end, kind) of its last request, kept when its hold lapsed: the gap to its
        # next arrival is learned all the same (else a gap longer than the one learned, or
        # any gap while none is learned yet, would never be)
        self.lapsed: dict[str, tuple[float, Kind]] = {}

    # --- events --------------------------------------------------------------------------------

    def arrived(self, order: str, arrival: float, first_pending: bool) -> None:
        """A request of ``order`` arrived (``first_pending``: none of its order waits): learn
        the gap from the end of the order's previous request."""
        ended, kind = self.ended.pop(order, None), self.kind.get(order, NO_KIND)
        lapsed = self.lapsed.pop(order, None)
        if ended is None and lapsed is not None:
            ended, kind = lapsed
        if ended is not None:
            self._learn_gap(order, kind, max(0.0, arrival - ended))
        elif order in self.running and first_pending:
            self._learn_gap(order, kind, 0.0)  # sent while the one before it ran: no gap

    def started(
        self, order: str, job: str, group: Group, request: str, op: str, holds: bool
    ) -> None:
        """A request of ``order`` started on ``group``: its order holds from now on if its kind
        of hold is on (a chain of turns holds with each of its requests until its hold lapses:
        an episode's training and next turn follow its last turn)."""
        held = self.orders.get(order)
        turns = holds or (held is not None and held[2])
        if self._cap(group, turns):
            self.orders[order] = (job, group, turns)
            self.running[order] = request
            self.ended.pop(order, None)
            self.kind[order] = (op, holds)

    def rank_ended(
        self, worker: str, request: str | None, busy: dict[str, str], now: float | None
    ) -> None:
        """The task of ``request`` (None: the one running) ended on ``worker`` (``busy``:
        worker -> request running there, before this end) at ``now``."""
        running = request if request is not None else busy.get(worker)
        for order, rid in list(self.running.items()):
            if rid != running or busy.get(worker) != rid:
                continue
            group = self.orders[order][1]
            if all(busy.get(w) != rid for w in group if w != worker):
                del self.running[order]  # its last rank
                if now is not None:
                    self.ended[order] = now

    # --- queries -------------------------------------------------------------------------------

    def on_free(self, free: set[str], now: float) -> dict[str, Hold]:
        """Free worker -> until when, and for which jobs and orders, it is held. Where several
        orders hold one worker: until the earliest of their holds, and for all of them
        (holders do not keep each other out)."""
        out: dict[str, Hold] = {}
        for order, (job, group, _) in list(self.orders.items()):
            until = self.until(order, now)
            if until is None:
                continue
            for w in group:
                if w not in free:
                    continue
                if w in out:
                    was = out[w]
                    out[w] = (min(until, was[0]), was[1] | {job}, was[2] | {order})
                else:
                    out[w] = (until, frozenset({job}), frozenset({order}))
        return out

    def on_busy(self, worker: str, now: float) -> Hold | None:
        """(until, {job}, {order}) of the earliest hold on busy ``worker`` once its running
        request ends: a rank of a gang whose other ranks run longer, or a worker of a gang that
        waits."""
        out: Hold | None = None
        for order, (job, group, _) in list(self.orders.items()):
            if worker not in group:
                continue
            until = self.until(order, now)
            if until is not None and (out is None or until < out[0]):
                out = (until, frozenset({job}), frozenset({order}))
        return out

    def until(self, order: str, now: float) -> float | None:
        """Until when ``order`` holds its group's workers: while a request of it runs, until
        that one is expected to end plus the order's learned gap (capped); while its next
        request waits for this group, until its busy workers are expected to end; after its
        last request ended, until that end plus the gap; None when it holds nothing (its hold
        is forgotten once it has expired: its next start holds again, or when the policy
        turned its kind of hold off)."""
        _, group, turns = self.orders[order]
        cap = self._cap(group, turns)
        if not cap:
            self.forget(order)
            return None
        gap = min(self.gap.get((order, self.kind.get(order, NO_KIND)), 0.0), cap)
        rid = self.running.get(order)
        if rid is not None:  # (a rank that runs past its estimate ends no earlier than now)
            return max([now, *self._view.running_ends(rid, group, now)]) + gap
        if self._view.waits(order):
            return self._view.waiting_until(order, group, now)
        ended = self.ended.get(order)
        if ended is not None and ended + gap > now:
            return ended + gap
        if ended is not None:
            self.lapsed[order] = (ended, self.kind.get(order, NO_KIND))
            if len(self.lapsed) > LAPSED_KEPT:  # (orders that never came back: oldest first)
                del self.lapsed[next(iter(self.lapsed))]
            self.forget(order)
        return None

    def forget(self, order: str) -> None:
        self.orders.pop(order, None)
        self.running.pop(order, None)
        self.ended.pop(order, None)
        self.kind.pop(order, None)

    def _cap(self, group: Group, turns: bool) -> float:
        """The longest hold an order over ``group`` may take (the policy in force: 0 when its
        kind of hold is off)."""
        policy = self._view.policy
        return max(
            policy.gang_hold_s if len(group) > 1 else 0.0,
            policy.turn_hold_s if turns else 0.0,
        )

    def _learn_gap(self, order: str, kind: Kind, gap: float) -> None:
        known = self.gap.get((order, kind))
        self.gap[order, kind] = gap if known is None else (known + gap) / 2
