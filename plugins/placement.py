"""Live spatiotemporal placement: the scheduler plugin's side of the policy core.

The scheduler plugin owns one :class:`LivePlacement`. It drives the same
:class:`~plexrl_dask.policy.spatiotemporal.SpatiotemporalPlacer` the simulator drives, with
live events, and keeps what it needs to act on its decisions:

- **Nodes** are what the workers report as theirs (the state store's node id: the host name,
  or the batch system's node name; else the worker's host: ``DeploymentRegistry.worker_nodes``),
  **GPUs** are the PlexRL workers on them (one worker per GPU). The placer is built from the
  GPU workers present when the first job arrives (and rebuilt while no job is placed, as
  workers come). While jobs are placed, a worker on a new node, or on a node no group holds,
  joins placement as a free GPU of that node (waiting jobs that now fit are admitted); a worker
  that joins a node in a group, or one that leaves, is used (or missed) by
  request dispatch but changes placement only once the placer is idle again (a group's
  capacity would change under its reservations).
- **Jobs** are deployment owners (``Runtime(job=...)``). A job's first deployment submits it,
  needing as many GPUs as that deployment spans (a job's deployments share workers: the
  scheduler swaps them, so the job needs its largest deployment's span, not the sum). While
  it profiles, and once it is placed, its deployments are placed on the workers of its node
  group. A job the placer makes wait (no capacity for its dedicated profiling) keeps its place
  in the placer's queue and meanwhile runs *best effort*: its deployments go wherever deploy
  places them and its requests are ordered by HRRS with everyone else's, as on a pool smaller
  than its jobs (the local cluster); once admitted, its deployments go to its group's workers
  (the new ones at once, the existing ones when it relocates: see below).
- **Traces.** Every completed request of a job (its op, worker, start and end) feeds the job's
  :class:`~plexrl_dask.policy.horizon.TraceRecorder`; after ``profile_iterations`` complete
  iterations the trace goes to ``placer.profiled``, and the job is micro-shifted into a shared
  group. A group change applies to the deployments the job makes from then on, and to
  re-placements (after a worker loss); the job's existing deployments move there when it calls
  ``Runtime.relocate()`` at a point where none of its requests are in flight (``GRPOJob``
  does, between steps): each is re-placed in its group, its trained state carried through the
  state store (see the scheduler plugin's ``relocations`` and ``relocate`` handlers).
- **Finish.** When a job's last deployment is undeployed, ``placer.finish``.

Everything here is state + decisions; no I/O.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Mapping
from typing import Any

from plexrl_dask.policy.horizon import DemandTrace, Phase, TraceRecorder
from plexrl_dask.policy.spatiotemporal import (
    NodeView,
    PlacementConfig,
    PlacementDecision,
    SpatiotemporalPlacer,
)

logger = logging.getLogger(__name__)


def nodes_of(worker_nodes: Mapping[str, str]) -> list[NodeView]:
    """GPU workers grouped by node, in a deterministic order."""
    by_node: defaultdict[str, list[str]] = defaultdict(list)
    for worker, node in worker_nodes.items():
        by_node[node].append(worker)
    return [NodeView(node, tuple(sorted(ws))) for node, ws in sorted(by_node.items())]


class LivePlacement:
    """See the module docstring."""

    def __init__(self, config: PlacementConfig) -> None:
        self.config = config
        self.placer: SpatiotemporalPlacer | None = None
        self._built_from: dict[str, str] = {}  # the worker -> node the placer was built from
        self._workers: dict[str, str] = {}  # ... and of the nodes added since
        self.recorders: dict[str, TraceRecorder] = {}

    def sync_workers(self, worker_nodes: Mapping[str, str], now: float) -> SpatiotemporalPlacer:
        """Bring the placer up to the GPU workers present (see the module docstring): rebuilt
        while idle, else new nodes added as free nodes."""
        idle = self.placer is None or not self.placer.jobs
        if idle and dict(worker_nodes) != self._workers:
            # a fresh placer over today's workers: its inputs and log start anew (status and
            # replay cover the placer in force)
            self._built_from = dict(worker_nodes)
            self._workers = dict(worker_nodes)
            self.placer = SpatiotemporalPlacer(nodes_of(worker_nodes), self.config)
        assert self.placer is not None
        cluster = self.placer.cluster
        new = {
            w: h for w, h in worker_nodes.items() if w not in self._workers and cluster.can_add(h)
        }
        for node in nodes_of(new):
            self._log(self.placer.add_node(node, now))
            self._workers.update((w, node.name) for w in node.gpus)
        return self.placer

    def candidates(
        self, job: str, gpus: int, kind: str, worker_nodes: Mapping[str, str], now: float
    ) -> tuple[str, ...] | None:
        """The workers ``job``'s next deployment (spanning ``gpus`` workers) may use: those of
        its node group that are still present (a worker that left stays in its group's
        capacity, but a deployment cannot go there); None while the job waits (best effort:
        anywhere). Submits the job on its first deployment."""
        if not worker_nodes:
            return None  # no GPU worker yet: deploy reports that
        placer = self.sync_workers(worker_nodes, now)
        j = placer.jobs.get(job)
        if j is None:
            gpus = max(1, min(gpus, placer.cluster.total_gpus))
            decisions = placer.submit(job, gpus, now, kind=kind)
            self._log(decisions)
            self.recorders.setdefault(job, TraceRecorder())
            j = placer.jobs[job]
        if j.state == "waiting":
            logger.info("job %s waits for placement (%s): best effort meanwhile", job,
                        j.waited_reason)  # fmt: skip
            return None
        return self.group_workers(job, worker_nodes)

    def group_workers(self, job: str, live: Collection[str]) -> tuple[str, ...] | None:
        """The workers of ``job``'s node group that are in ``live``, in the group's order;
        None while the job has no group (not submitted, or waiting)."""
        j = None if self.placer is None else self.placer.jobs.get(job)
        if j is None or j.state == "waiting":
            return None
        assert self.placer is not None
        return tuple(w for w in self.placer.group_of(job).gpus if w in live)

    def record(self, job: str, op: str, worker: str, start: float, end: float) -> None:
        """A request of ``job`` completed; profile the job once its trace is recorded."""
        recorder = self.recorders.get(job)
        if recorder is None or self.placer is None or not recorder.add(op, worker, start, end):
            return
        j = self.placer.jobs.get(job)
        if j is None or j.state != "profiling":
            return
        trace = recorder.trace(self.config.profile_iterations, self.config.reserve_quantile)
        if trace is None:
            return
        # the recorded trace counts the workers it saw; never more than the job was given
        if trace.peak_gpus > j.gpus:
            trace = DemandTrace(
                tuple(Phase(p.kind, min(p.gpus, j.gpus), p.duration_s) for p in trace.phases)
            )
        self._log(self.placer.profiled(job, trace, end))

    def finish(self, job: str, now: float) -> None:
        """``job``'s last deployment is gone."""
        if self.placer is not None and job in self.placer.jobs:
            self._log(self.placer.finish(job, now))

    def _log(self, decisions: list[PlacementDecision]) -> None:
        for d in decisions:
            logger.info("placement %s %s group=%s offset=%s %s", d.kind, d.job, d.group,
                        d.offset, d.reason)  # fmt: skip

    def status(self, job: str | None = None) -> dict[str, Any]:
        """The placer's state, its decisions and inputs (for replay: ``nodes`` are those it
        was built from; nodes added later are among its inputs), recorded iterations."""
        if self.placer is None:
            return {"enabled": True, "state": None, "decisions": [], "inputs": [], "traces": {}}
        traces = {
            name: [[[p.kind, p.gpus, p.duration_s] for p in it] for it in r.iterations]
            for name, r in self.recorders.items()
            if job is None or name == job
        }
        return {
            "enabled": True,
            "config": dict(self.config.__dict__),
            "nodes": [{"name": n.name, "gpus": list(n.gpus)} for n in nodes_of(self._built_from)],
            "state": self.placer.state(),
            "decisions": [d.to_dict() for d in self.placer.log],
            "inputs": list(self.placer.inputs),
            "traces": traces,
        }
