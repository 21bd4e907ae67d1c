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
    request: str = ""  # (its request: a gang's ranks share one)


class RequestAccounting:
    """Released tasks and per-job counters (see the module docstring)."""

    def __init__(self) -> None:
        self.started: dict[Any, Started] = {}
        self.queued_behind: dict[str, Any] = {}  # worker -> key of the task queued there
        self.job_counters: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._ranks_left: Counter[str] = Counter()  # request -> its ranks still released
        self._failed: set[str] = set()  # requests a rank of which failed

    def _ranks_ended(self, started: Started, succeeded: bool) -> bool | None:
        """One rank of ``started``'s request ended: whether the request succeeded, once its
        last rank has ended (None before)."""
        request = started.request
        if not succeeded:
            self._failed.add(request)
        self._ranks_left[request] -= 1
        if self._ranks_left[request] > 0:
            return None
        del self._ranks_left[request]
        failed = request in self._failed
        self._failed.discard(request)
        return not failed

    def released(
        self,
        key: Any,
        now: float,
        deployment: str,
        op: str,
        worker: str,
        job: str,
        behind: bool,
        request: str = "",
    ) -> None:
        """Task ``key`` (a rank of ``request``) was released to ``worker`` (``behind``: queued
        behind the one running there)."""
        request = request or str(key)
        self.started[key] = Started(now, deployment, op, worker, job, request)
        self._ranks_left[request] += 1
        if behind:
            self.queued_behind[worker] = key

    def dispatched(self, job: str, wait_s: float) -> None:
        """One of ``job``'s requests was released after waiting ``wait_s``."""
        self.job_counters[job]["dispatched"] += 1
        self.job_counters[job]["wait_s"] += wait_s

    def ended(self, key: Any, succeeded: bool, now: float) -> Started | None:
        """Task ``key`` left its worker: returns what it was (None if it was never released).
        The task queued behind it on that worker starts now; the job's counters count its
        worker-seconds, and its request (``completed`` or ``failed``) once its last rank ended,
        as ``dispatched`` counts it once."""
        started = self.started.pop(key, None)
        if started is None:
            return None
        queued = self.queued_behind.pop(started.worker, None)
        if queued is not None and queued != key and queued in self.started:
            behind = self.started[queued]
            self.started[queued] = behind._replace(t0=now)
        counters = self.job_counters[started.job]
        if succeeded:
            counters["busy_s"] += now - started.t0
        whole = self._ranks_ended(started, succeeded)
        if whole is not None:
            counters["completed" if whole else "failed"] += 1
        return started

    def worker_left(self, worker: str) -> None:
        for key in [k for k, s in self.started.items() if s.worker == worker]:
            started = self.started.pop(key)
            whole = self._ranks_ended(started, False)
            if whole is not None:
                self.job_counters[started.job]["failed"] += 1
        self.queued_behind.pop(worker, None)

    def busy(self) -> bool:
        """Whether a released task waits behind another (the policy must not change then)."""
        return bool(self.queued_behind)
