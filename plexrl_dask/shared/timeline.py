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

import math
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


#: Event topic of tool calls' spans, reported by the driver that made the calls
#: (:class:`~plexrl_dask.tools.pool.ToolPool`): ``{"job", "spans": [{"worker", "tool",
#: "start", "end"}, ...]}``, shown on the dashboard's Timeline as ``op`` ``"tool"``.
TOOL_TOPIC = "plexrl-tool"
#: The ``op`` of a tool call's span (a tool worker runs several at once: they overlap).
TOOL_OP = "tool"
#: The most spans one tool report may carry (a step's calls), and the longest name in one.
TOOL_REPORT_MAX_SPANS, TOOL_NAME_MAX = 4096, 200


def tool_spans(msg: Any) -> list[RequestSpan]:
    """The spans of a tool report (:data:`TOOL_TOPIC`): each a :class:`RequestSpan` on the
    tool's worker, deployment ``tool:<name>``, op ``"tool"``, no setup. :class:`ValueError`
    for a report that is not one (anyone may log to a topic: nothing unchecked is kept)."""

    # (lists arrive as tuples: events travel as msgpack)
    if not isinstance(msg, dict) or not isinstance(msg.get("spans"), (list, tuple)):
        raise ValueError("a tool report is {'job': str, 'spans': [...]}")
    job, raw = msg.get("job"), msg["spans"]
    if not isinstance(job, str) or len(job) > TOOL_NAME_MAX or len(raw) > TOOL_REPORT_MAX_SPANS:
        raise ValueError("a tool report names its job and carries a bounded number of spans")
    out = []
    for s in raw:
        names = [s.get(k) if isinstance(s, dict) else None for k in ("worker", "tool")]
        times = [s.get(k) if isinstance(s, dict) else None for k in ("start", "end")]
        if not all(isinstance(n, str) and 0 < len(n) <= TOOL_NAME_MAX for n in names) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            for t in times
        ):
            raise ValueError(f"a tool span is worker, tool, start, end: {s!r:.80}")
        start, end = float(times[0]), float(times[1])
        if end < start:
            raise ValueError(f"a tool span ends before it starts: {s!r:.80}")
        out.append(RequestSpan(names[0], f"tool:{names[1]}", job, TOOL_OP, start, start, end))
    return out


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
