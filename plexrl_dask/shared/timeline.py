"""What each worker ran, when: request spans and the worker-second arithmetic over them.

Every request a replica holder runs leaves one :class:`RequestSpan`: the deployment, its owning
job, the op, and three wall-clock instants — ``start`` (the request began on the worker and
waited for its replica to be resident), ``ready`` (the replica was resident: everything before
is *setup*, a load or reload) and ``end``, and ``cpu_s``: the CPU seconds the request's own
thread spent from ``ready`` to ``end`` (``time.thread_time``). A request that had its core
and the GIL throughout has ``cpu_s`` close to ``end - ready``; the difference is time it
waited for them (other processes on the core, the worker's event loop holding the GIL).
Spans of one node's workers share a clock (``time.time``), so a driver on the same host can
put them on one timeline with its own instants. Holders keep the most recent
``plexrl.worker.timeline-length`` spans.

The functions below are pure: they measure worker-seconds over spans, which is how the
multiplexing benchmark and the main job report utilisation and idle time.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RequestSpan:
    """One request on one worker (see the module docstring)."""

    worker: str
    deployment: str
    job: str
    op: str
    start: float
    ready: float
    end: float
    cpu_s: float | None = None  # None: not measured (spans built elsewhere than a holder)

    @property
    def seconds(self) -> float:
        """Worker-seconds the request occupied, its setup included."""
        return self.end - self.start

    @property
    def setup_seconds(self) -> float:
        return self.ready - self.start

    @property
    def run_seconds(self) -> float:
        """Wall seconds of the request's own work (after its setup)."""
        return self.end - self.ready

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestSpan:
        return cls(**d)


class SpanLog:
    """A bounded, thread-safe log of a holder's spans (oldest dropped first)."""

    def __init__(self, maxlen: int) -> None:
        self._spans: deque[RequestSpan] = deque(maxlen=max(1, int(maxlen)))
        self._lock = threading.Lock()

    def add(self, span: RequestSpan) -> None:
        with self._lock:
            self._spans.append(span)

    def since(self, t: float = 0.0) -> list[RequestSpan]:
        """Spans that ended after ``t``, oldest first."""
        with self._lock:
            return [s for s in self._spans if s.end > t]


def clip(spans: Iterable[RequestSpan], t0: float, t1: float) -> list[tuple[RequestSpan, float]]:
    """Each span overlapping ``[t0, t1]`` with the seconds of it inside the window."""
    out = []
    for s in spans:
        inside = min(s.end, t1) - max(s.start, t0)
        if inside > 0:
            out.append((s, inside))
    return out


def busy_seconds(spans: Iterable[RequestSpan], t0: float, t1: float) -> float:
    """Worker-seconds occupied by ``spans`` inside ``[t0, t1]`` (a worker runs one request at
    a time, so spans of one worker never overlap and the sum is exact)."""
    return sum(inside for _, inside in clip(spans, t0, t1))


def by_worker(spans: Iterable[RequestSpan]) -> dict[str, list[RequestSpan]]:
    """Spans grouped by worker, each list in start order."""
    out: dict[str, list[RequestSpan]] = {}
    for s in sorted(spans, key=lambda s: s.start):
        out.setdefault(s.worker, []).append(s)
    return out
