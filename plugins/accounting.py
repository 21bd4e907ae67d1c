"""What the scheduler plugin keeps about released requests: when each task started, what runs
next behind it on its worker, and per-job counters.

A released task "starts" when it is released to a free worker, or, queued behind another on its
worker (the dispatcher's lookahead), when that one ends. Its duration at the end teaches the
service-time estimates and feeds the job's counters, the live placement's traces and the
dashboard's running-requests view (which reads :attr:`RequestAccounting.started` and
:attr:`RequestAccounting.queued_behind`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, NamedTuple


class Started(NamedTuple):
    """A released task: when it started (``time.monotonic()``), what and where."""

    t0: float
    deployment: str
    op: str
    worker: str
    job: str


class RequestAccounting:
    """Released tasks and per-job counters (see the module docstring)."""

    def __init__(self) -> None:
        self.started: dict[Any, Started] = {}
        self.queued_behind: dict[str, Any] = {}  # worker -> key of the task queued there
        self.job_counters: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def released(
        self, key: Any, now: float, deployment: str, op: str, worker: str, job: str, behind: bool
    ) -> None:
        """Task ``key`` was released to ``worker`` (``behind``: queued behind the one running
        there)."""
        self.started[key] = Started(now, deployment, op, worker, job)
        if behind:
            self.queued_behind[worker] = key

    def dispatched(self, job: str, wait_s: float) -> None:
        """One of ``job``'s requests was released after waiting ``wait_s``."""
        self.job_counters[job]["dispatched"] += 1
        self.job_counters[job]["wait_s"] += wait_s

    def ended(self, key: Any, succeeded: bool, now: float) -> Started | None:
        """Task ``key`` left its worker: returns what it was (None if it was never released).
        The task queued behind it on that worker starts now; the job's counters count it."""
        started = self.started.pop(key, None)
        if started is None:
            return None
        queued = self.queued_behind.pop(started.worker, None)
        if queued is not None and queued != key and queued in self.started:
            behind = self.started[queued]
            self.started[queued] = behind._replace(t0=now)
        counters = self.job_counters[started.job]
        if succeeded:
            counters["completed"] += 1
            counters["busy_s"] += now - started.t0
        else:
            counters["failed"] += 1
        return started

    def worker_left(self, worker: str) -> None:
        for key in [k for k, s in self.started.items() if s.worker == worker]:
            del self.started[key]
        self.queued_behind.pop(worker, None)

    def busy(self) -> bool:
        """Whether a released task waits behind another (the policy must not change then)."""
        return bool(self.queued_behind)
