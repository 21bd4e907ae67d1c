"""Runtime dispatch: which pending requests the scheduler releases to their workers now.

Pure code over plain state (no Dask), called by the scheduler plugin whenever a request arrives
or a worker frees up. A *request* is one API call: ``ranks`` tasks, one per worker of its
deployment's group, that must start together (a gang), or a single task.

**Order within a deployment.** Requests of one deployment run in arrival order (they change its
state: ``optim_step`` must follow the ``forward_backward`` before it), so only the oldest pending
request of each deployment is a candidate.

**HRRS among candidates.** Highest Response Ratio with Setup: a candidate ``r`` that has waited
``w`` with estimated service time ``s`` and estimated setup ``c`` (the load time of its
deployment onto its workers: 0 where it is resident in HBM) scores

    ratio(r) = (w + s) / (s + alpha * c)

the response ratio of HRRN with the setup cost, weighted by ``alpha``, added to the
denominator. Without waiting, a resident request (c = 0) scores 1 and one that needs a load
scores below 1, so requests of resident models go first and same-model requests batch up;
short requests overtake long ones; and since ``ratio`` grows without bound with ``w``, every
request's score eventually beats any fixed competitor.

**Starvation bound.** Growth of the ratio alone does not stop a stream of fresh, tiny requests
from overtaking forever, and a gang needs all its workers free at once. So a candidate whose wait
reaches its *patience*

    P(r) = beta * (s + c) + floor

becomes *urgent*. Urgent candidates are served first, in arrival order, and reserve their
workers: a later request may not start on a worker an urgent one is waiting for. Hence (proof
sketch): once ``r`` is urgent, only requests already running on its workers, and urgent
requests that arrived before it and share a worker with it, start before it; each runs once.
So ``r`` starts by

    W(r) <= P(r) + max over its workers of the running request's remaining time
                 + sum over earlier urgent requests q sharing a worker of (s_q + c_q)

with actual (not estimated) times on the right. Every term is finite: the earlier requests are
the ones that arrived before ``r``. Ranks of a gang are released in the same decision or not at
all, so no worker starts part of a gang and gangs over overlapping workers cannot deadlock.

FIFO is the special case ``beta = 0, floor = 0``: every candidate is urgent at once, and the
rule is "arrival order with reservations" (``plexrl.scheduler.ordering: fifo``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingRequest:
    """A request as dispatch sees it.

    ``workers``: the worker of each rank; ``ready``: every task has arrived and waits only for a
    worker; ``arrival``: when it arrived (seconds, any clock shared with ``now``);
    ``service_s``/``setup_s``: the estimates that go into its ratio.
    """

    request: str
    workers: tuple[str, ...]
    ready: bool = True
    deployment: str = ""
    arrival: float = 0.0
    service_s: float = 1.0
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.workers or len(set(self.workers)) != len(self.workers):
            raise ValueError(f"a request needs distinct workers, one per rank: {self}")
        if self.service_s <= 0 or self.setup_s < 0:
            raise ValueError(f"service time must be > 0 and setup >= 0: {self}")


@dataclass(frozen=True)
class DispatchPolicy:
    """The knobs of the rule (``plexrl.scheduler.*``; see the module docstring)."""

    setup_weight: float = 2.0  # alpha
    patience_factor: float = 8.0  # beta
    patience_floor_s: float = 2.0  # floor

    @classmethod
    def fifo(cls) -> DispatchPolicy:
        return cls(setup_weight=0.0, patience_factor=0.0, patience_floor_s=0.0)

    def ratio(self, req: PendingRequest, now: float) -> float:
        wait = max(0.0, now - req.arrival)
        return (wait + req.service_s) / (req.service_s + self.setup_weight * req.setup_s)

    def patience(self, req: PendingRequest) -> float:
        return self.patience_factor * (req.service_s + req.setup_s) + self.patience_floor_s


@dataclass(frozen=True)
class Decision:
    """A released request and why: its ratio and whether it was urgent."""

    request: PendingRequest
    ratio: float
    urgent: bool


def candidates(pending: Sequence[PendingRequest]) -> list[PendingRequest]:
    """The oldest pending request of each deployment (``pending`` is in arrival order)."""
    seen: set[str] = set()
    heads = []
    for req in pending:
        key = req.deployment or req.request
        if key not in seen:
            seen.add(key)
            heads.append(req)
    return heads


def select_releases(
    pending: Sequence[PendingRequest],
    busy: Iterable[str],
    live: Iterable[str],
    now: float = 0.0,
    policy: DispatchPolicy | None = None,
) -> list[Decision]:
    """The requests to release now (see the module docstring), urgent ones first.

    ``pending`` is in arrival order; ``busy`` are workers running a PlexRL request; ``live``
    the workers that exist (a request naming another one waits for re-routing and reserves
    nothing; so does one that is not ready).
    """
    policy = policy or DispatchPolicy.fifo()
    taken = set(busy)
    live = set(live)
    heads = [r for r in candidates(pending) if r.ready and set(r.workers) <= live]
    urgent = [r for r in heads if now - r.arrival >= policy.patience(r)]
    released: list[Decision] = []
    for req in urgent:  # arrival order
        workers = set(req.workers)
        if not workers & taken:
            released.append(Decision(req, policy.ratio(req, now), True))
        taken |= workers  # released or reserved: later requests may not start there
    urgent_ids = {r.request for r in urgent}
    others = sorted(
        (r for r in heads if r.request not in urgent_ids),
        key=lambda r: (-policy.ratio(r, now), r.arrival),
    )
    for req in others:
        workers = set(req.workers)
        if not workers & taken:
            released.append(Decision(req, policy.ratio(req, now), False))
            taken |= workers
    return released
