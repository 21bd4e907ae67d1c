"""The dashboard's data on the scheduler: a small scheduler plugin and the four views.

:class:`PlexRLDashboardPlugin` (``"plexrl-dashboard"``, installed next to the PlexRL scheduler
plugin by the preload, ``local_cluster()`` and ``install(client)``) gathers what the scheduler
does not already hold:

- **request spans**: every ``plexrl.dashboard.span-poll-interval`` it asks each replica holder
  for the spans that ended since the last one it got (the holder actor's ``timeline(since)``,
  the call ``Runtime.timeline`` makes, sent straight from the scheduler); it keeps the last
  ``spans-kept`` for the Timeline, and charges each span once to its job (:class:`JobLedger`);
- **job step reports** from the ``plexrl-job`` event topic (:mod:`plexrl_dask.dashboard.jobs`);
- **node tier usage and dedup savings**: the node StateManager's status, from one worker per
  node, only while someone looks at the Residency page or route.

Everything else is read from the PlexRL plugin (queue, decisions, residency map, registry,
per-job counters) through its public attributes and :meth:`queue_view`.

The views (:meth:`timeline_view`, :meth:`residency_view`, :meth:`queue_view`,
:meth:`jobs_view`) are plain data: the JSON routes return them (with :func:`finite`: JSON has
no infinity), and the pages draw the same rows. Every view's work is bounded by
the ``plexrl.dashboard`` limits, the number of workers and of deployments, never by the length
of the queue: they run on the scheduler's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps
from distributed.protocol.serialize import Serialized, deserialize
from tornado.ioloop import PeriodicCallback

from plexrl_dask import config
from plexrl_dask.config import DashboardConfig
from plexrl_dask.dashboard import metrics
from plexrl_dask.dashboard.jobs import JOB_TOPIC, JobLedger, JobStepReport
from plexrl_dask.errors import InvalidJobReport
from plexrl_dask.policy.residency import RESIDENCY_TOPIC, TIERS
from plexrl_dask.shared.timeline import TOOL_OP, TOOL_TOPIC, RequestSpan, tool_spans
from plexrl_dask.worker.holder import holder_of

logger = logging.getLogger(__name__)

NAME = "plexrl-dashboard"
PLEXRL_PLUGIN = "plexrl"


def finite(x: Any) -> Any:
    """``x`` with non-finite floats replaced by ``None`` (JSON has no infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def node_of(worker: str, capacity: dict[str, Any] | None = None) -> str:
    """The node a worker is on: its holder's StateManager node id, else its host."""
    node = (capacity or {}).get("node")
    return str(node) if node else (urlparse(worker).hostname or worker)


def decision_reason(d: dict[str, Any], policy: dict[str, Any]) -> str:
    """Why the dispatcher released a request, in words, from its decision record."""
    setup = d.get("setup_s") or 0.0
    where = "resident (no setup)" if setup <= 0 else f"after a {setup:.2f}s load"
    if d.get("behind"):
        where += ", queued behind the request running there"
    if policy.get("setup_weight", 0) == 0 and policy.get("patience_factor", 0) == 0:
        return f"fifo: oldest request, {where}"
    if d.get("urgent"):
        return f"urgent: waited {d.get('wait_s', 0):.1f}s, past its patience; {where}"
    ratio = d.get("ratio") or 0.0
    worker = "a busy worker" if d.get("behind") else "a free worker"
    return f"highest ratio {ratio:.2f} on {worker}, {where}"


class SpanStore:
    """The last ``kept`` spans with sequence numbers, and per worker the spans inside the
    Timeline window (for busy/idle seconds without a pass over all spans)."""

    def __init__(self, kept: int, window_s: float) -> None:
        self.kept = int(kept)
        self.window_s = float(window_s)
        self._spans: list[RequestSpan] = []
        self._base = 0  # sequence number of _spans[0]
        self._lanes: dict[str, deque[RequestSpan]] = {}
        self._lane_s: dict[str, list[float]] = {}  # worker -> [busy s, setup s] in its lane
        # workers whose spans overlap (a tool worker runs calls at once): their busy seconds
        # are the union of their spans, not the sum
        self._overlapping: set[str] = set()

    @property
    def next_seq(self) -> int:
        return self._base + len(self._spans)

    def add(self, span: RequestSpan) -> None:
        self._spans.append(span)
        if len(self._spans) >= 2 * self.kept:  # amortised O(1) trimming
            drop = len(self._spans) - self.kept
            del self._spans[:drop]
            self._base += drop
        lane = self._lanes.setdefault(span.worker, deque())
        lane.append(span)
        if span.op == TOOL_OP:
            self._overlapping.add(span.worker)
        sums = self._lane_s.setdefault(span.worker, [0.0, 0.0])
        sums[0] += span.end - span.ready
        sums[1] += span.ready - span.start
        self._evict(span.worker, span.end - self.window_s)  # bounded even if nobody looks

    def _evict(self, worker: str, t0: float) -> None:
        """Drop ``worker``'s lane spans that ended by ``t0``."""
        lane, sums = self._lanes[worker], self._lane_s[worker]
        while lane and lane[0].end <= t0:
            old = lane.popleft()
            sums[0] -= old.end - old.ready
            sums[1] -= old.ready - old.start

    def since(self, seq: int, limit: int) -> tuple[int, list[RequestSpan]]:
        """Up to ``limit`` spans from sequence number ``seq`` on (older ones dropped from the
        store are skipped), and the sequence number to ask for next."""
        start = max(seq, self._base, self.next_seq - self.kept)
        out = self._spans[start - self._base : start - self._base + limit]
        return start + len(out), out

    def recent(self, t0: float, limit: int) -> list[RequestSpan]:
        """The newest ``limit`` kept spans (in arrival order) that ended after ``t0``, oldest
        first. A pass over the kept spans (arrival order is only roughly end order): for the
        JSON route, not for page updates."""
        out: list[RequestSpan] = []
        for s in reversed(self._spans[-self.kept :]):
            if len(out) >= limit:
                break
            if s.end > t0:
                out.append(s)
        return out[::-1]

    @property
    def workers(self) -> Any:
        """The workers with spans kept (a view: its length is cheap)."""
        return self._lanes.keys()

    def lanes(self, now: float) -> dict[str, tuple[float, float]]:
        """Per worker, (busy s, setup s) of its spans inside ``[now - window, now]``."""
        return {worker: self.lane(worker, now) for worker in list(self._lanes)}

    def lane(self, worker: str, now: float) -> tuple[float, float]:
        """``worker``'s (busy s, setup s) inside ``[now - window, now]`` (zeros without
        spans)."""
        lane = self._lanes.get(worker)
        if lane is None:
            return 0.0, 0.0
        t0 = now - self.window_s
        self._evict(worker, t0)
        if worker in self._overlapping:
            inside = ((max(s.start, t0), min(s.end, now)) for s in lane if s.end > t0)
            return _union_s((a, b) for a, b in inside if b > a), 0.0
        busy, setup = self._lane_s[worker]
        if lane and lane[0].start < t0:  # the first span started before the window
            first = lane[0]
            cut = t0 - first.start
            setup_cut = min(cut, first.ready - first.start)
            setup -= setup_cut
            busy -= cut - setup_cut
        return max(0.0, busy), max(0.0, setup)

    def forget_worker(self, worker: str) -> None:
        self._lanes.pop(worker, None)
        self._lane_s.pop(worker, None)
        self._overlapping.discard(worker)


def _union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals`` (start, end)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _cell(r: Any, capacity: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "deployment": r.deployment,
        "worker": r.worker,
        "node": node_of(r.worker, capacity.get(r.worker)),
        "tier": r.tier,
        "bytes": r.bytes,
        "version": r.version,
        "load_s": r.load_s,
        "modified": r.modified,
    }


async def _node_tiers(dask_worker: Any) -> dict[str, Any] | None:
    """Run on a worker: its node StateManager's tier usage and dedup savings (None without a
    holder or node state). The manager call leaves the worker's event loop free."""

    holder = holder_of(dask_worker)
    node = getattr(holder, "node", None)
    if node is None:
        return None
    status = await asyncio.get_running_loop().run_in_executor(None, node.status)
    keys = ("capacity", "used", "reserved", "logical_bytes", "dedup_saved_bytes")
    return {
        "node": status.get("node"),
        "tiers": {
            tier: {k: info.get(k) for k in keys} | {"versions": len(info.get("versions", ()))}
            for tier, info in status.get("tiers", {}).items()
        },
    }


_NODE_TIERS = dumps(_node_tiers)


def _result(resp: Any) -> Any:
    """The result of a worker RPC answered with ``to_serialize`` (the scheduler's connections
    do not deserialize)."""

    if not isinstance(resp, dict) or resp.get("status") != "OK":
        raise RuntimeError(f"worker answered {str(resp)[:200]}")
    value = resp.get("result")
    if isinstance(value, Serialized):
        value = deserialize(value.header, value.frames)
    return value


class PlexRLDashboardPlugin(SchedulerPlugin):
    """See the module docstring."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.cfg = DashboardConfig.from_dask_config()
        self.gpu_resource = str(config.get("worker.gpu-resource"))
        self.scheduler: Any = None
        self.spans = SpanStore(self.cfg.spans_kept, self.cfg.timeline_window_s)
        self.ledger = JobLedger(self.cfg.steps_kept)
        self.nodes: dict[str, dict[str, Any]] = {}  # node -> its StateManager's tiers
        self.counters: dict[str, int] = {
            "span_polls": 0,
            "spans": 0,
            "poll_errors": 0,
            "job_reports": 0,
            "bad_job_reports": 0,
            "tool_spans": 0,
            "bad_tool_reports": 0,
        }
        self._cursor: dict[str, float] = {}  # worker -> end of the last span received
        self._job_slots: dict[str, int] = {}
        self.residency_seq = 0  # bumped by every residency report
        self._residency_dirty: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._residency_pruned = 0  # the newest sequence number dropped from that log
        self._residency_watched = float("-inf")
        self._last_node_poll = float("-inf")
        self.nodes_version = 0
        # The plugin's release times are on the monotonic clock; spans on the wall clock.
        self._wall_minus_monotonic = time.time() - time.monotonic()
        self._polling = False
        self._timer: PeriodicCallback | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        # Reports logged before this plugin was added (install() on a running cluster).
        for _, msg in scheduler.get_events(JOB_TOPIC):
            self.log_event(JOB_TOPIC, msg)
        from plexrl_dask.dashboard.routes import add_routes

        add_routes(scheduler)
        metrics.register(self)
        self._timer = PeriodicCallback(self.poll, 1000 * self.cfg.span_poll_interval_s)
        self._timer.start()

    async def close(self) -> None:
        metrics.unregister(self)
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == JOB_TOPIC:
            try:
                self.ledger.report(JobStepReport.from_event(msg))
                self.counters["job_reports"] += 1
            except InvalidJobReport as e:
                # A hook must not raise: a bad report is counted and logged, never applied.
                self.counters["bad_job_reports"] += 1
                logger.warning("ignored a job report: %s", e)
        elif topic == TOOL_TOPIC:
            # Tool calls' spans go to the Timeline, and each job's count of them to the Jobs
            # page: tool workers are not the pool, so the job ledger (worker-seconds of the
            # pool) does not charge them.
            try:
                spans = tool_spans(msg)
            except ValueError as e:
                self.counters["bad_tool_reports"] += 1
                logger.warning("ignored a tool report: %s", e)
                return
            for s in spans:
                self.spans.add(s)
                self.ledger.tool(s)
            self.counters["tool_spans"] += len(spans)
        elif topic == RESIDENCY_TOPIC and isinstance(msg, dict):
            self.mark_residency(str(msg.get("deployment")), str(msg.get("worker")))

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self._cursor.pop(worker, None)
        self.spans.forget_worker(worker)

    def mark_residency(self, deployment: str, worker: str) -> None:
        """The residency of ``deployment`` on ``worker`` may have changed (a report arrived)."""
        self.residency_seq += 1
        self._residency_dirty[(deployment, worker)] = self.residency_seq
        self._residency_dirty.move_to_end((deployment, worker))
        keep = max(1024, self.cfg.residency_cells)
        if len(self._residency_dirty) > 2 * keep:  # bounded: cells of gone workers linger
            while len(self._residency_dirty) > keep:
                _, self._residency_pruned = self._residency_dirty.popitem(last=False)

    def residency_changes(self, since: int) -> list[tuple[str, str]] | None:
        """The (deployment, worker) cells reported since ``residency_seq`` was ``since``: at
        most one entry per cell, however many reports it got; None when that is too long ago
        to say (redraw everything)."""
        if since < self._residency_pruned:
            return None
        out = []
        for key, seq in reversed(self._residency_dirty.items()):
            if seq <= since:
                break
            out.append(key)
        return out

    def residency_structure(self) -> tuple[Any, ...]:
        """Changes when workers or deployments come or go (pages then redraw residency from
        scratch; other changes arrive as :meth:`residency_changes`)."""
        plexrl = self.plexrl
        uids = () if plexrl is None else tuple(i.uid for i in plexrl.deployments.values())
        return (tuple(self.gpu_workers()), uids)

    def job_slot(self, job: str) -> int:
        """A small number per job in order of first sight: pages colour a job by it, so it
        has one colour on every page and across reloads."""
        slot = self._job_slots.get(job)
        if slot is None:
            slot = self._job_slots[job] = len(self._job_slots)
        return slot

    @property
    def plexrl(self) -> Any:
        """The PlexRL scheduler plugin, or None where it is not installed."""
        return None if self.scheduler is None else self.scheduler.plugins.get(PLEXRL_PLUGIN)

    # --- collection ------------------------------------------------------------------------

    def add_spans(self, spans: list[RequestSpan]) -> None:
        """Take spans (in end order per worker) into the store and the job ledger."""
        for s in spans:
            if s.end <= self._cursor.get(s.worker, float("-inf")):
                continue  # already have it (an overlapping poll)
            self._cursor[s.worker] = s.end
            self.spans.add(s)
            self.ledger.span(s)
            self.counters["spans"] += 1

    async def poll(self) -> None:
        """Collect new spans from every holder (and node tiers if the Residency view was
        looked at recently); one poll at a time, each call bounded by ``poll-timeout``."""
        plexrl = self.plexrl
        if self._polling or plexrl is None:
            return
        self._polling = True
        try:
            targets = [
                (w, cap["holder_key"])
                for w, cap in plexrl.worker_capacity.items()
                if cap.get("holder_key") and w in self.scheduler.workers
            ]
            fetched = await asyncio.gather(*(self._fetch(w, k) for w, k in targets))
            for spans in fetched:
                self.add_spans(spans)
            self.counters["span_polls"] += 1
            now = time.monotonic()
            watched = now - self._residency_watched < 3 * self.cfg.node_poll_interval_s
            if watched and now - self._last_node_poll >= self.cfg.node_poll_interval_s:
                self._last_node_poll = now
                await self._poll_nodes(plexrl)
        finally:
            self._polling = False

    async def _fetch(self, worker: str, holder_key: str) -> list[RequestSpan]:
        since = self._cursor.get(worker, 0.0)
        try:
            resp = await asyncio.wait_for(
                self.scheduler.rpc(worker).actor_execute(
                    actor=holder_key, function="timeline", args=(since,), kwargs={}
                ),
                self.cfg.poll_timeout_s,
            )
            return [RequestSpan.from_dict(d) for d in _result(resp)]
        except Exception as e:  # noqa: BLE001 (a worker leaving mid-poll; the next poll retries)
            self.counters["poll_errors"] += 1
            logger.debug("span poll of %s failed: %s", worker, e)
            return []

    async def _poll_nodes(self, plexrl: Any) -> None:
        one: dict[str, str] = {}
        for w, cap in plexrl.worker_capacity.items():
            if w in self.scheduler.workers:
                one.setdefault(node_of(w, cap), w)

        async def ask(node: str, worker: str) -> None:
            try:
                resp = await asyncio.wait_for(
                    self.scheduler.rpc(worker).run(function=_NODE_TIERS), self.cfg.poll_timeout_s
                )
                value = _result(resp)
                if value is not None and self.nodes.get(node) != value:
                    self.nodes[node] = value
                    self.nodes_version += 1
            except Exception as e:  # noqa: BLE001 (a node without a manager yet)
                self.counters["poll_errors"] += 1
                logger.debug("node tier poll via %s failed: %s", worker, e)

        await asyncio.gather(*(ask(n, w) for n, w in one.items()))
        for node in [n for n in self.nodes if n not in one]:
            del self.nodes[node]
            self.nodes_version += 1

    # --- views -----------------------------------------------------------------------------

    def gpu_workers(self) -> list[str]:
        """PlexRL workers (advertising the GPU resource), sorted."""
        return sorted(
            w
            for w, ws in self.scheduler.workers.items()
            if ws.resources.get(self.gpu_resource, 0) >= 1
        )

    def running(self) -> list[dict[str, Any]]:
        """Requests started and not finished: one row per rank (at most one per worker; a
        request queued behind a running one is not listed), ``start`` on the wall clock."""
        plexrl = self.plexrl
        if plexrl is None:
            return []
        offset = self._wall_minus_monotonic
        queued = set(plexrl.queued_behind.values())
        rows = [
            {
                "worker": worker,
                "deployment": deployment,
                "job": job,
                "op": op,
                "start": t0 + offset,
            }
            for key, (t0, deployment, op, worker, job, _) in itertools.islice(
                plexrl.started.items(), 4 * max(1, len(self.scheduler.workers))
            )
            if key not in queued
        ]
        return sorted(rows, key=lambda r: r["worker"])

    def worker_lanes(self, now: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Per PlexRL worker (and any worker with spans in the window): busy and setup
        seconds inside the Timeline window and its idle fraction (what runs now counts as
        busy); and the running requests. ``now``: wall clock."""
        lanes = self.spans.lanes(now)
        running = self.running()
        live = {r["worker"]: r["start"] for r in running}
        workers = []
        for w in sorted(set(self.gpu_workers()) | set(lanes)):
            busy, setup = lanes.get(w, (0.0, 0.0))
            workers.append(
                {
                    "worker": w,
                    "busy_s": busy,
                    "setup_s": setup,
                    "idle_fraction": self._idle(busy + setup, live.get(w), now),
                }
            )
        return workers, running

    def idle_fraction(self, worker: str, now: float, running_since: float | None) -> float:
        """:meth:`worker_lanes`' idle fraction of one worker; ``running_since``: the wall
        clock start of what it runs now, if anything."""
        busy, setup = self.spans.lane(worker, now)
        return self._idle(busy + setup, running_since, now)

    def _idle(self, active: float, running_since: float | None, now: float) -> float:
        window = self.cfg.timeline_window_s
        if running_since is not None:  # what runs now counts as busy
            active += min(window, max(0.0, now - running_since))
        return max(0.0, 1.0 - active / window)

    def timeline_view(self, now: float | None = None, limit: int | None = None) -> dict[str, Any]:
        """:meth:`worker_lanes` and the newest ``limit`` (default ``timeline-batch``) spans
        that ended inside the window, oldest first."""
        now = time.time() if now is None else now
        limit = self.cfg.timeline_batch if limit is None else int(limit)
        workers, running = self.worker_lanes(now)
        spans = [s.to_dict() for s in self.spans.recent(now - self.cfg.timeline_window_s, limit)]
        return {
            "installed": self.plexrl is not None,
            "now": now,
            "window_s": self.cfg.timeline_window_s,
            "workers": workers,
            "spans": spans,
            "running": running,
        }

    def residency_cell(self, deployment: str, worker: str) -> dict[str, Any]:
        """One cell of :meth:`residency_view` (tier ``"absent"`` where nothing is held)."""
        plexrl = self.plexrl
        capacity = plexrl.worker_capacity.get(worker) if plexrl is not None else None
        report = None if plexrl is None else plexrl.residency.get(deployment, worker)
        if report is None:
            return {
                "deployment": deployment,
                "worker": worker,
                "node": node_of(worker, capacity),
                "tier": "absent",
                "bytes": 0,
                "version": 0,
                "load_s": 0.0,
                "modified": False,
            }
        return _cell(report, {worker: capacity} if capacity else {})

    def watch_residency(self) -> None:
        """Someone looks at residency: collect node tier stats for the next while."""
        self._residency_watched = time.monotonic()

    def residency_view(self) -> dict[str, Any]:
        """Deployment × worker cells (tier, bytes, version, last transition time) of every
        deployment held somewhere (the first ``residency-cells``), bytes per tier per node as
        the workers report them, and each node StateManager's usage and dedup savings."""
        self.watch_residency()
        plexrl = self.plexrl
        if plexrl is None:
            return {
                "installed": False,
                "tiers": list(TIERS),
                "deployments": [],
                "workers": [],
                "cells": [],
                "truncated": 0,
                "nodes": [],
                "stores": {},
            }
        capacity = plexrl.worker_capacity
        reports = plexrl.residency.reports()
        cells = [_cell(r, capacity) for r in itertools.islice(reports, self.cfg.residency_cells)]
        return {
            "installed": True,
            "tiers": list(TIERS),
            "deployments": sorted(plexrl.deployments),
            "workers": self.gpu_workers(),
            "cells": cells,
            "truncated": max(0, len(reports) - len(cells)),
            "nodes": self.node_bytes(),
            "stores": {n: self.nodes[n] for n in sorted(self.nodes)},
        }

    def node_bytes(self) -> list[dict[str, Any]]:
        """Per node, sorted: its PlexRL workers and the bytes of replicas held in each tier
        (``<tier>_bytes``) as the workers report them. Per worker, not per report (the
        residency map keeps each worker's totals), and it starts no node polling (unlike
        :meth:`residency_view`)."""
        plexrl = self.plexrl
        if plexrl is None:
            return []
        capacity = plexrl.worker_capacity
        residency = plexrl.residency
        nodes: dict[str, dict[str, Any]] = {}

        def entry(worker: str) -> dict[str, Any]:
            n = node_of(worker, capacity.get(worker))
            if n not in nodes:
                nodes[n] = {"node": n, "workers": 0} | {f"{t}_bytes": 0 for t in TIERS[:-1]}
            return nodes[n]

        for w in self.gpu_workers():
            entry(w)["workers"] += 1
        for w in residency.workers():
            held = residency.bytes_by_tier(w)
            if not any(held.values()):
                continue  # holds nothing now (a PlexRL worker is listed above anyway)
            totals = entry(w)
            for tier, n in held.items():
                totals[f"{tier}_bytes"] += n
        return [nodes[n] for n in sorted(nodes)]

    def decisions_mark(self) -> tuple[int, int, Any]:
        """Changes when a decision is recorded or the policy (which the reasons cite) is
        changed: when the decisions :meth:`queue_view` lists change."""
        if self.plexrl is None:
            return 0, 0, None
        decisions = self.plexrl.decisions
        # the newest entry stays alive in the deque, so a new one cannot reuse its id
        return len(decisions), id(decisions[-1]) if decisions else 0, self.plexrl.policy

    def queue_view(
        self, now: float | None = None, limit: int | None = None, with_decisions: bool = True
    ) -> dict[str, Any]:
        """The PlexRL plugin's :meth:`queue_view` (``queue-rows`` requests; ``now`` on its
        monotonic clock), the owners of the deployments in its totals, and the most recent
        ``decisions-shown`` decisions, newest first, each with its reason (none without
        ``with_decisions``)."""
        plexrl = self.plexrl
        if plexrl is None:
            return {"installed": False, "queue": None, "owners": {}, "decisions": [], "policy": {}}
        limit = self.cfg.queue_rows if limit is None else int(limit)
        queue = plexrl.queue_view(limit, now)
        policy = {
            "setup_weight": plexrl.policy.setup_weight,
            "patience_factor": plexrl.policy.patience_factor,
            "patience_floor_s": plexrl.policy.patience_floor_s,
            "choice": plexrl.policy.choice,
        }
        decisions = [
            {**d, "reason": decision_reason(d, policy)}
            for d in itertools.islice(
                reversed(plexrl.decisions), self.cfg.decisions_shown if with_decisions else 0
            )
        ]
        owners = {
            name: info.owner
            for name in queue["by_deployment"]
            if (info := plexrl.deployments.get(name)) is not None
        }
        return {
            "installed": True,
            "queue": queue,
            "owners": owners,
            "decisions": decisions,
            "policy": policy,
        }

    def jobs_view(self, with_history: bool = True) -> dict[str, Any]:
        """Per job (the ``jobs-shown`` most recently active): its last step report, reward
        history, charges, share of the pool, isolated cost estimate and queue counters."""
        plexrl = self.plexrl
        ledger = self.ledger
        if plexrl is not None:
            held: dict[str, int] = {}
            for info in plexrl.deployments.values():
                held[info.owner] = held.get(info.owner, 0) + info.num_workers
            for job, workers in held.items():
                if job in ledger.charges or job in ledger.reports:
                    ledger.set_layout(job, workers)
        counters = {} if plexrl is None else plexrl.job_counters
        total = sum(c.charged_s for c in ledger.charges.values())
        rows = []
        for job in ledger.jobs(self.cfg.jobs_shown):
            r = ledger.reports.get(job)
            c = ledger.charges.get(job)
            q = counters.get(job, {})
            charged = c.charged_s if c is not None else 0.0
            dispatched = int(q.get("dispatched", 0))
            row = {
                "job": job,
                "name": r.name if r else "",
                "step": r.step + 1 if r else 0,  # steps done
                "steps": r.steps if r else 0,
                "reward_mean": r.reward_mean if r else None,
                "reward_max": r.reward_max if r else None,
                "loss": r.loss if r else None,
                "version": r.version if r else None,
                "requests": c.requests if c else 0,
                "busy_s": c.busy_s if c else 0.0,
                "setup_s": c.setup_s if c else 0.0,
                "charged_s": charged,
                "share": charged / total if total > 0 else 0.0,
                "isolated_workers": ledger.layout_workers.get(job, 1),
                "isolated_s": ledger.isolated_estimate_s(job),
                "dispatched": dispatched,
                "failed": int(q.get("failed", 0)),
                "mean_wait_s": q.get("wait_s", 0.0) / dispatched if dispatched else 0.0,
                "tool_calls": ledger.tools.get(job, (0, 0.0))[0],
                "tool_s": ledger.tools.get(job, (0, 0.0))[1],
            }
            if with_history:
                row["rewards"] = [list(h) for h in ledger.history.get(job, ())]
            rows.append(row)
        return {
            "installed": plexrl is not None,
            "charged_s": total,
            "jobs": rows,
            "counters": dict(self.counters),
        }


def dashboard_of(scheduler: Any) -> PlexRLDashboardPlugin | None:
    """The dashboard plugin of ``scheduler``, if installed."""
    plugin = scheduler.plugins.get(NAME)
    return plugin if isinstance(plugin, PlexRLDashboardPlugin) else None
