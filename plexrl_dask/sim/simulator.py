"""The trace-driven cluster simulator: one entry point over every placement policy.

:func:`simulate` runs a generated workload (:mod:`plexrl_dask.sim.workload`) under one policy:

- ``isolated``: every job gets private GPUs for its whole run, in the deployment mode that costs
  it the fewest GPU-seconds (colocated, split or split-async, each job its own best), admitted
  first-come first-served with EASY backfill of whole jobs (a later job starts early when it
  fits now and does not delay the first waiting job's reserved start; the estimates are the
  true durations, so the backfill is as good as it gets). ``colocated``, ``split`` and
  ``split-async`` are the same with one mode for all jobs (:mod:`plexrl_dask.sim.isolated`).
- ``spread``, ``spread+backfill``, ``pack+backfill``: PlexRL. Jobs share node groups through the
  policy core's :class:`~plexrl_dask.policy.spatiotemporal.SpatiotemporalPlacer` (profiled on
  dedicated capacity, then micro-shifted into a group), and run phase by phase, each phase on
  specific GPUs of its group (:class:`plexrl_dask.sim.multiplexed.MultiplexedSim`).
- ``rollmux``: the RollMux-style peer policy, split jobs phase-multiplexed in co-execution
  groups (:mod:`plexrl_dask.sim.rollmux`; its admission stretch is
  ``plexrl.sim.rollmux-max-stretch``, default 1.5).

Both kinds report through :class:`SimOutcome`; :class:`GpuLedger` records who holds every GPU
(each start checks the GPUs are free, counting any double booking), the per-node utilisation
heatmap and the Gantt rows of one node group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from plexrl_dask.errors import InvalidTrace, JobDoesNotFit
from plexrl_dask.policy.spatiotemporal import PlacementConfig
from plexrl_dask.sim.workload import ClusterSpec, SimJob

ISOLATED_POLICIES = ("isolated", "colocated", "split", "split-async")
PLEXRL_POLICIES = ("spread", "spread+backfill", "pack+backfill")
PEER_POLICIES = ("rollmux",)
POLICIES = ISOLATED_POLICIES + PEER_POLICIES + PLEXRL_POLICIES
#: Admission stretch of the RollMux-style groups when ``plexrl.sim.rollmux-max-stretch`` is unset.
ROLLMUX_MAX_STRETCH = 1.5


@dataclass
class JobOutcome:
    """One job's run: when it arrived, started, ended; what it was charged; its ideal time
    (its fastest isolated mode on an empty cluster)."""

    name: str
    arrival_s: float
    start_s: float
    end_s: float
    gpu_seconds: float
    ideal_s: float

    @property
    def jct_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def slowdown(self) -> float:
        return self.jct_s / self.ideal_s


@dataclass
class SimOutcome:
    """What one simulation produced."""

    policy: str
    jobs: list[JobOutcome]
    held_gpu_seconds: float  # GPU-seconds reserved (private allocations, or node groups)
    busy_gpu_seconds: float  # GPU-seconds a phase actually ran
    double_bookings: int
    events: int
    wall_s: float
    heatmap: np.ndarray = field(repr=False)  # busy GPU-seconds per (node, time bin)
    bin_s: float = 3600.0
    gantt: list[tuple[str, str, float, float, int]] = field(default_factory=list, repr=False)
    decisions: list[dict] = field(default_factory=list, repr=False)  # placement decisions
    inputs: list[dict] = field(default_factory=list, repr=False)  # placement events
    nvme_loads: int = 0  # training states loaded from NVMe (DRAM was full)
    best_effort_iterations: int = 0  # iterations of waiting jobs run by Backfill
    preempted_phases: int = 0  # best-effort phases stopped because their group was released
    # when each job's iterations completed, by job name (profiled iterations: at the profile's
    # end); what the sustained-throughput measure credits (plexrl_dask.sim.study)
    iteration_ends: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def makespan_s(self) -> float:
        return max(j.end_s for j in self.jobs) - min(j.arrival_s for j in self.jobs)

    @property
    def floor_makespan_s(self) -> float:
        """The completion time no policy can beat on these jobs: each job needs at least its
        ideal time after it arrives, so the last of ``arrival + ideal`` bounds any makespan
        (an arrival-bound workload has every policy near it)."""
        return max(j.arrival_s + j.ideal_s for j in self.jobs) - min(j.arrival_s for j in self.jobs)

    def summary(self) -> dict:
        jct = np.array([j.jct_s for j in self.jobs])
        slow = np.array([j.slowdown for j in self.jobs])
        return {
            "policy": self.policy,
            "jobs": len(self.jobs),
            "makespan_h": self.makespan_s / 3600,
            "floor_makespan_h": self.floor_makespan_s / 3600,
            "mean_jct_h": float(jct.mean()) / 3600,
            "mean_slowdown": float(slow.mean()),
            "p99_slowdown": float(np.quantile(slow, 0.99)),
            "user_gpu_hours": sum(j.gpu_seconds for j in self.jobs) / 3600,
            "held_gpu_hours": self.held_gpu_seconds / 3600,
            "busy_gpu_hours": self.busy_gpu_seconds / 3600,
            "utilisation": self.busy_gpu_seconds / max(self.held_gpu_seconds, 1e-9),
            "gpu_double_bookings": self.double_bookings,
            "nvme_loads": self.nvme_loads,
            "best_effort_iterations": self.best_effort_iterations,
            "preempted_phases": self.preempted_phases,
            "events": self.events,
            "sim_wall_s": self.wall_s,
            "events_per_s": self.events / max(self.wall_s, 1e-9),
        }


class GpuLedger:
    """Who holds each GPU. :meth:`take` counts a double booking for every GPU that is not
    free; :meth:`give` frees them and adds the busy time to the per-node heatmap."""

    def __init__(self, cluster: ClusterSpec, bin_s: float = 3600.0) -> None:
        self.owner = np.full(cluster.gpus, -1, dtype=np.int64)
        self.per_node = cluster.gpus_per_node
        self.nodes = cluster.nodes
        self.bin_s = bin_s
        self.heat = np.zeros((self.nodes, 64))
        self.double_bookings = 0
        self.busy_gpu_seconds = 0.0
        # busy intervals not binned into `heat` yet: (node of each GPU, t1 - t0, t0, t1, first
        # bin, last bin), binned at once by _bin (a give per phase; binning each was the cost)
        self._given: list[tuple[np.ndarray, float, float, float, int, int]] = []
        self._width = self.heat.shape[1]  # the bins `heat` grows to by then

    def take(self, owner: int, gids: np.ndarray) -> None:
        clash = int(np.count_nonzero(self.owner[gids] != -1))
        self.double_bookings += clash
        self.owner[gids] = owner

    def give(self, gids: np.ndarray, t0: float, t1: float) -> None:
        self.owner[gids] = -1
        if t1 <= t0:
            return
        self.busy_gpu_seconds += len(gids) * (t1 - t0)
        b0, b1 = int(t0 // self.bin_s), int(t1 // self.bin_s)
        if b1 >= self._width:  # (grown as binning one interval at a time grows it)
            self._width = max(b1 + 1, 2 * self._width)
        nodes = gids // self.per_node  # (a new array: the caller may reuse `gids`)
        self._given.append((nodes, t1 - t0, t0, t1, b0, b1))

    def heatmap(self, until_s: float) -> np.ndarray:
        """Utilisation (0..1) per node and bin up to ``until_s``."""
        self._bin()
        bins = max(1, int(np.ceil(until_s / self.bin_s)))
        h = self.heat[:, :bins]
        return h / (self.per_node * self.bin_s)

    def _bin(self) -> None:
        """Add the intervals given since the last call to ``heat``: each node's GPUs times the
        interval's overlap with each bin. Every cell sums its terms in the order given, the
        same floats as adding each interval when given."""
        given, self._given = self._given, []
        if self._width > self.heat.shape[1]:
            self.heat = np.pad(self.heat, ((0, 0), (0, self._width - self.heat.shape[1])))
        if not given:
            return
        # per (interval, node): GPUs, by interval then node (a sort and run lengths: several
        # times faster than np.unique on millions of GPU-intervals)
        which = np.repeat(np.arange(len(given)), [len(g[0]) for g in given])
        key = np.sort(which * self.nodes + np.concatenate([g[0] for g in given]))
        first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        count = np.diff(first, append=len(key))
        which, nodes = np.divmod(key[first], self.nodes)
        dt, t0, t1, b0, b1 = (np.array(c) for c in list(zip(*given, strict=True))[1:])
        # each (interval, node) once per bin it overlaps: GPUs x the overlap
        k = (b1 - b0 + 1)[which]
        entry = np.repeat(np.arange(len(which)), k)
        i = which[entry]
        cols = b0[i] + np.arange(len(entry)) - np.repeat(np.cumsum(k) - k, k)
        overlap = np.minimum((cols + 1) * self.bin_s, t1[i]) - np.maximum(cols * self.bin_s, t0[i])
        overlap = np.where(k[entry] == 1, dt[i], overlap)  # within one bin: the duration
        # in the order given (`i` never decreases), which ufunc.at keeps for a repeated cell
        np.add.at(self.heat, (nodes[entry], cols), count[entry] * overlap)


def simulate(
    jobs: list[SimJob],
    cluster: ClusterSpec,
    policy: str,
    placement: PlacementConfig | None = None,
    gantt_group: str = "g0",
    gantt_hours: float = 12.0,
    progress: bool = False,
) -> SimOutcome:
    """Run ``jobs`` on ``cluster`` under ``policy`` (one of :data:`POLICIES`).

    ``placement`` (a :class:`~plexrl_dask.policy.spatiotemporal.PlacementConfig`) overrides
    the PlexRL policies' configuration; its ``packing`` is set from the policy name.
    Deterministic: the same jobs give the same outcome.
    """
    if policy not in POLICIES:
        raise InvalidTrace(f"unknown policy {policy!r}; one of {POLICIES}")
    if not jobs:
        raise InvalidTrace("no jobs to simulate")
    for job in jobs:
        need = max(job.rollout_gpus + job.train_gpus, job.colocated_gpus)
        if need > cluster.gpus:
            raise JobDoesNotFit(
                f"{job.name} needs {need} GPUs (split), more than the cluster's {cluster.gpus}"
            )
        if job.iterations < 1:
            raise InvalidTrace(f"{job.name} has no iterations")
    t0 = time.perf_counter()
    if policy in ISOLATED_POLICIES:
        from plexrl_dask.sim.isolated import simulate_isolated

        out = simulate_isolated(jobs, cluster, policy, progress=progress)
    elif policy in PEER_POLICIES:
        import dask.config

        from plexrl_dask.sim.rollmux import RollMuxSim

        stretch = float(dask.config.get("plexrl.sim.rollmux-max-stretch", ROLLMUX_MAX_STRETCH))
        if not stretch >= 1:
            raise InvalidTrace(f"plexrl.sim.rollmux-max-stretch must be >= 1, got {stretch}")
        out = RollMuxSim(jobs, cluster, stretch).run()
    else:
        from plexrl_dask.sim.multiplexed import MultiplexedSim

        out = MultiplexedSim(
            jobs, cluster, policy, placement, gantt_group, gantt_hours, progress
        ).run()
    out.wall_s = time.perf_counter() - t0
    return out
