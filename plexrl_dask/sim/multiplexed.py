"""PlexRL in simulation: node groups shared phase by phase, placed by the policy core.

The :class:`~plexrl_dask.policy.spatiotemporal.SpatiotemporalPlacer` decides (the same object
the live plugin drives); this module is the runtime that acts on its decisions in simulated
time, at the granularity of phases (exact for the GPU counts a job holds; within a phase, the
GPUs it holds are busy for all of it):

- **Profiling.** A new job holds ``max(r, t)`` dedicated GPUs of its group for its first
  ``profile_iterations`` iterations, run phase after phase as it will run multiplexed (rollout
  on ``r`` of them, training on ``t``; no interference, a clean trace); each is recorded as ``rollout`` (``r`` GPUs: weight sync + bulk), ``tail`` (``tail_gpus``),
  ``train`` (``t``). The placer then reserves the trace built from them at the configured
  quantile, micro-shifted into a group. A later job of the same kind (model) is placed from
  that trace at once (``reuse_traces``), without profiling.
- **Iterations of a placed job** start at the job's reserved window
  (:meth:`~plexrl_dask.policy.spatiotemporal.NodeGroup.window_start`: a job finishing an
  iteration a little late — within ``late_tolerance`` of its period — starts the next at once,
  one later waits for its next window). With *backfill*, an iteration that would wait may start
  at once if :class:`~plexrl_dask.policy.spatiotemporal.BackfillSchedule` says its estimated
  phases fit the slack the other reservations leave.
- **Waiting jobs, best effort** (with *backfill*): a job the placer keeps waiting whose kind's
  trace is known runs iterations in a group's slack under the same test, as the live runtime
  runs a waiting job best effort; once placed it moves to its own group at the end of the
  iteration. Its state is parked in the group it ran in. If that group is released meanwhile,
  its phase in progress is preempted (charged, and the iteration run again later).
- **Phases** queue in their group: reserved ones by window start, then unreserved ones; a phase
  starts when its group has enough free GPUs. A reserved phase that does not fit blocks every
  unreserved one behind it (backfill never delays a reservation at runtime either), not other
  reserved ones. The rollout phase keeps ``tail_gpus`` of its GPUs for the tail and frees the
  rest at once: the shared pool's other jobs use them (this is how request-level multiplexing
  reclaims the long tail).
- **Tool waits** (agentic jobs): after the tail, the waits on the step's critical path hold
  no GPU (a ``gap`` phase of the job's trace): the group's other jobs use them meanwhile.
- **Setup.** Training states are parked in HBM (``hbm_park_gb`` per GPU, least recently used
  first out). A train phase runs on the GPUs that hold its state when they are all free
  (setup 0); otherwise on free GPUs with the least parked state, paying the load of its state
  (bytes per GPU over the host-to-device bandwidth) plus the offload of what it evicts. Weight
  sync is part of every rollout phase (``sync_s``), as in every baseline.
- **Tiers below HBM.** A state evicted from HBM goes to its group's host DRAM
  (``dram_gb_per_gpu`` × the group's GPUs; unbounded if unset). When DRAM is full, the least
  recently used states there move to NVMe. Loading a state from NVMe costs
  ``max(bytes / NVMe share, bytes / host-to-device)`` per GPU instead of the host-to-device
  time: the NVMe read and the copy to the GPU are pipelined in chunks, and each GPU gets
  ``nvme_gbps / gpus_per_node`` of its node's NVMe bandwidth.

Approximations, stated:
- GPUs within a group are interchangeable (no intra-group topology).
- Writes to NVMe are off the critical path: they overlap the phases that follow.
- A job's first training state, and the state of a job that changed groups, start in DRAM.
- A reserved phase is not preempted (only best-effort work, when its group is released).
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from plexrl_dask.config import placement_config
from plexrl_dask.policy.horizon import DemandTrace, Phase
from plexrl_dask.policy.spatiotemporal import (
    BackfillSchedule,
    NodeGroup,
    NodeView,
    PlacementConfig,
    PlacementDecision,
    SpatiotemporalPlacer,
)
from plexrl_dask.sim.isolated import fastest_s
from plexrl_dask.sim.simulator import GpuLedger, JobOutcome, SimOutcome
from plexrl_dask.sim.workload import ClusterSpec, SimJob

logger = logging.getLogger(__name__)

_ARRIVE, _PHASE_END, _WINDOW = 0, 1, 2
_EPS = 1e-9


@dataclass
class _Pending:
    job: int
    kind: str  # "profile", "rollout" or "train"
    gpus: int
    duration_s: float
    key: float  # window start (reserved) or submission time (unreserved)
    reserved: bool
    seq: int


@dataclass
class _Run:
    job: SimJob
    idx: int
    state: str = "arrived"  # arrived, profiling, placed, done
    iteration: int = 0
    group: str = ""
    start_s: float = -1.0
    gpu_seconds: float = 0.0
    trace: DemandTrace | None = None
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    reserved: bool = True
    key: float = 0.0
    phase: str = ""  # the phase it holds GPUs for ("gap": waiting on tools, holding none)
    window: float | None = None  # start of the reserved window it waits for
    pending: _Pending | None = None  # its phase queued in its group
    releases: list[tuple[float, int]] = field(default_factory=list)  # expected GPU releases
    need: tuple[float, int] | None = None  # the next reserved phase's expected start, GPUs
    phase_t0: float = 0.0  # when the phase it holds GPUs for started
    epoch: int = 0  # bumped when its best-effort work is preempted (stale phase ends)
    admitted: str = ""  # the group the placer gave it while it ran best effort
    gap_end: float = 0.0  # when its tool waits end (phase "gap")
    estimates: dict[str, float] = field(default_factory=dict)  # of `estimated`, by kind
    estimated: DemandTrace | None = None  # the trace `estimates` index (see _estimate)

    @property
    def peak_gpus(self) -> int:
        """The most GPUs it holds at once: those it runs on while profiling."""
        return max(self.job.rollout_gpus, self.job.train_gpus)

    @property
    def busy(self) -> bool:
        """In an iteration: holding GPUs, queued for them, or waiting on tools."""
        return bool(self.held.size) or self.pending is not None or self.phase == "gap"


class _GroupRuntime:
    """Who holds which GPU of one group, parked training states, and the phase queue."""

    def __init__(
        self,
        group: NodeGroup,
        park_bytes: float,
        now: float,
        dram_bytes: float = float("inf"),
        nvme_bytes_per_s: float = float("inf"),
    ) -> None:
        self.name = group.name
        self.gids = np.array([int(g) for g in group.gpus], dtype=np.int64)
        self.holder = np.full(len(self.gids), -1, dtype=np.int64)
        self.free = len(self.gids)
        self.members: set[int] = set()  # jobs placed or profiling here
        self.waiting: list[_Pending] = []
        self.home: dict[int, np.ndarray] = {}
        self.state_bytes: dict[int, float] = {}
        self.parked = np.zeros(len(self.gids))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.park_bytes = park_bytes
        self.born = now
        # offloaded states (bytes on all their GPUs), least recently used first, and those
        # that overflowed DRAM onto NVMe
        self.dram: OrderedDict[int, float] = OrderedDict()
        self.dram_bytes = dram_bytes
        self.dram_used = 0.0
        self.on_nvme: dict[int, float] = {}
        self.nvme_per_gpu = nvme_bytes_per_s
        self.nvme_loads = 0

    def choose(self, gpus: int) -> np.ndarray:
        """``gpus`` free GPUs, those with the least parked state first."""
        free = np.flatnonzero(self.holder == -1)
        order = np.argsort(self.parked[free], kind="stable")
        return free[order[:gpus]]

    def train_gpus(self, job: int, gpus: int, nbytes: float, h2d: float) -> tuple:
        """GPUs for a train phase and the setup it pays (module docstring)."""
        home = self.home.get(job)
        if home is not None and len(home) == gpus and bool((self.holder[home] == -1).all()):
            self.lru.move_to_end(job)
            return home, 0.0
        chosen = self.choose(gpus)
        if home is not None:
            self._unpark(job)
        load_s = nbytes / h2d
        if self.on_nvme.pop(job, None) is not None:
            self.nvme_loads += 1
            load_s = max(load_s, nbytes / self.nvme_per_gpu)
        elif job in self.dram:
            self.dram_used -= self.dram.pop(job)
        evicted = self._evict_for(job, chosen, nbytes)
        self.home[job] = chosen
        self.state_bytes[job] = nbytes
        self.parked[chosen] += nbytes
        self.lru[job] = None
        return chosen, load_s + float(evicted.max(initial=0.0)) / h2d

    def _evict_for(self, job: int, chosen: np.ndarray, nbytes: float) -> np.ndarray:
        """Offload parked states, least recently used first, until ``nbytes`` more fit on
        every GPU of ``chosen`` (only states on an overfull GPU go). Returns the bytes evicted
        from each GPU of ``chosen``."""
        evicted = np.zeros(len(chosen))
        over = self.parked[chosen] + nbytes - self.park_bytes
        if not (over > 0).any():
            return evicted
        on = np.zeros(len(self.gids), dtype=bool)  # scratch: the GPUs of one state
        for other in list(self.lru):
            if other == job:
                continue
            theirs = self.home[other]
            on[theirs] = True
            hit = on[chosen]
            on[theirs] = False
            if (hit & (over > 0)).any():
                evicted += hit * self.state_bytes[other]
                self._offload(other)
                # parked changes only here: recompute then, not for every state looked at
                over = self.parked[chosen] + nbytes - self.park_bytes
                if not (over > 0).any():
                    break
        return evicted

    def _unpark(self, job: int) -> None:
        self.parked[self.home.pop(job)] -= self.state_bytes.pop(job)
        self.lru.pop(job, None)

    def _offload(self, job: int) -> None:
        """``job``'s state leaves HBM for DRAM; what overflows DRAM goes to NVMe (LRU)."""
        total = self.state_bytes[job] * len(self.home[job])
        self._unpark(job)
        self.dram[job] = total
        self.dram_used += total
        while self.dram_used > self.dram_bytes and self.dram:
            old, size = self.dram.popitem(last=False)
            self.dram_used -= size
            self.on_nvme[old] = size

    def forget(self, job: int) -> None:
        """``job`` left the group (finished, or moved): its state is gone from every tier."""
        if job in self.home:
            self._unpark(job)
        if job in self.dram:
            self.dram_used -= self.dram.pop(job)
        self.on_nvme.pop(job, None)


class MultiplexedSim:
    """One run of ``jobs`` under a PlexRL policy (``spread``, ``spread+backfill``,
    ``pack+backfill``); :meth:`run` returns its outcome."""

    #: Waiting jobs looked at (in queue order) when a group has slack for best-effort work.
    BEST_EFFORT_SCAN = 32

    def __init__(
        self,
        jobs: list[SimJob],
        cluster: ClusterSpec,
        policy: str,
        placement: PlacementConfig | None = None,
        gantt_group: str = "g0",
        gantt_hours: float = 12.0,
        progress: bool = False,
    ) -> None:
        base = placement or placement_config()
        packing = "pack" if policy.startswith("pack") else "spread"
        self.config = PlacementConfig(**{**base.__dict__, "packing": packing})
        self.backfill = policy.endswith("+backfill")
        self.policy = policy
        self.cluster = cluster
        self.placer = SpatiotemporalPlacer(sim_nodes(cluster), self.config)
        self.runs = [_Run(j, i) for i, j in enumerate(jobs)]
        self.by_name = {j.name: i for i, j in enumerate(jobs)}
        self.groups: dict[str, _GroupRuntime] = {}
        self.ledger = GpuLedger(cluster)
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.events = 0
        self.held_gpu_seconds = 0.0
        self.nvme_loads = 0  # of the groups closed so far
        self.best_effort_iterations = 0  # waiting jobs' iterations started by Backfill
        self.preempted_phases = 0  # best-effort phases stopped by their group's release
        self.outcomes: list[JobOutcome] = []
        self.iteration_ends: dict[str, list[float]] = {}
        self.gantt: list[tuple[str, str, float, float, int]] = []
        self.gantt_group, self.gantt_until = gantt_group, gantt_hours * 3600
        self.h2d = cluster.h2d_gbps * 1e9
        self.bar = tqdm(total=len(jobs), desc=policy, disable=not progress, leave=False)
        for r in self.runs:
            self._push(r.job.arrival_s, _ARRIVE, r.idx, None)

    # --- event loop ------------------------------------------------------------------------

    def _push(self, t: float, kind: int, job: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, job, payload))

    def run(self) -> SimOutcome:
        while self.heap:
            now, _, kind, j, payload = heapq.heappop(self.heap)
            self.events += 1
            if kind == _ARRIVE:
                r = self.runs[j]
                gpus = r.peak_gpus
                self._apply(self.placer.submit(r.job.name, gpus, now, kind=r.job.model), now)
            elif kind == _PHASE_END:
                self._phase_end(j, payload, now)
            elif kind == _WINDOW:
                self._window(self.runs[j], payload, now)
        self.bar.close()
        assert len(self.outcomes) == len(self.runs), "a job never finished"
        for g in list(self.groups):  # groups still formed at the end (none, normally)
            self._close_group(g, max(o.end_s for o in self.outcomes))
        end = max(o.end_s for o in self.outcomes)
        return SimOutcome(
            policy=self.policy,
            jobs=sorted(self.outcomes, key=lambda o: o.name),
            held_gpu_seconds=self.held_gpu_seconds,
            busy_gpu_seconds=self.ledger.busy_gpu_seconds,
            double_bookings=self.ledger.double_bookings,
            events=self.events,
            wall_s=0.0,
            heatmap=self.ledger.heatmap(end),
            bin_s=self.ledger.bin_s,
            gantt=self.gantt,
            decisions=[d.to_dict() for d in self.placer.log],
            inputs=list(self.placer.inputs),
            nvme_loads=self.nvme_loads,
            best_effort_iterations=self.best_effort_iterations,
            preempted_phases=self.preempted_phases,
            iteration_ends=self.iteration_ends,
        )

    # --- placement decisions -----------------------------------------------------------------

    def _apply(self, decisions: list[PlacementDecision], now: float) -> None:
        for d in decisions:
            if d.kind == "release":
                self._evict_best_effort(d.group, now)
                self._close_group(d.group, now)
                continue
            if d.kind == "wait":
                continue
            r = self.runs[self.by_name[d.job]]
            if d.group not in self.groups:
                self.groups[d.group] = self._group_runtime(d.group, now)
            if r.state == "best_effort":  # placed while it ran best effort (from its trace)
                assert d.kind == "place", "a job runs best effort only from a known trace"
                r.admitted = d.group
                if not r.busy:  # between iterations: move now
                    self._next_iteration(r, now)
                continue  # else it moves when its best-effort iteration ends
            self._move(r, d.group)
            if d.kind == "profile":
                r.state, r.start_s = "profiling", now
                n = min(self.config.profile_iterations, r.job.iterations)
                dur = sum(sum(p.duration_s for p in r.job.iteration_phases(i)) for i in range(n))
                self._enqueue(r, "profile", d.gpus, dur, reserved=True, key=now, now=now)
            elif d.kind == "place":
                r.state = "placed"
                if r.start_s < 0:  # placed from its kind's trace, without profiling
                    r.start_s = now
                    r.trace = self.placer.jobs[r.job.name].trace
                self._next_iteration(r, now)

    def _close_group(self, name: str, now: float) -> None:
        g = self.groups.pop(name, None)
        if g is None:
            return
        assert g.free == len(g.gids), f"group {name} dissolved while GPUs are held"
        self.nvme_loads += g.nvme_loads
        self.held_gpu_seconds += len(g.gids) * (now - g.born)

    # --- iterations and phases -------------------------------------------------------------

    def _next_iteration(self, r: _Run, now: float) -> bool:
        """Start ``r``'s next iteration (or finish it). Returns True iff its last action was to
        dispatch ``r``'s group (:meth:`_dispatch`: the caller need not dispatch it again)."""
        if r.iteration >= r.job.iterations:
            self._finish(r, now)
            return False
        if r.state == "best_effort":
            if not r.admitted:
                return False  # still waiting: idle in its group until Backfill picks it again
            self._move(r, r.admitted)
            r.state, r.admitted = "placed", ""
        group = self.placer.group_of(r.job.name)
        w = group.window_start(r.job.name, now, self.config.late_tolerance)
        if w <= now + _EPS:
            self._start_iteration(r, now, reserved=True, key=w)
            return True
        r.window = w
        self._push(w, _WINDOW, r.idx, r.iteration)
        if self.backfill:  # ready before its window: queue it as backfill until then
            self._start_iteration(r, now, reserved=False, key=w)
            return True
        return False

    def _window(self, r: _Run, iteration: object, now: float) -> None:
        if r.state != "placed" or r.iteration != iteration or r.window is None:
            return  # stale: the iteration ran (or the job moved) meanwhile
        r.window = None
        r.reserved, r.key = True, now
        if r.pending is not None:  # still queued as backfill: it is reserved from now on
            r.pending.reserved, r.pending.key = True, now
            self._dispatch(self.groups[r.group], now)
        elif r.phase == "gap":  # waiting on tools as backfill: its training is reserved
            r.need = (r.gap_end, r.job.train_gpus)
        elif r.held.size:  # running as backfill: its remaining phases are reserved
            gap = self._estimate(r, "gap")
            r.need = (r.releases[-1][0] + gap, r.job.train_gpus) if r.phase != "train" else None
        else:
            self._start_iteration(r, now, reserved=True, key=now)

    def _start_iteration(self, r: _Run, now: float, reserved: bool, key: float) -> None:
        r.reserved, r.key = reserved, key
        if reserved:
            r.window = None
        i = r.iteration  # (not iteration_phases: building every phase is the cost here)
        self._enqueue(r, "rollout", r.job.rollout_gpus, r.job.rollout_s(i), reserved, key, now)

    def _enqueue(
        self, r: _Run, kind: str, gpus: int, dur: float, reserved: bool, key: float, now: float
    ) -> None:
        """Queue ``r``'s phase ``kind`` in its group, then dispatch the group (last, always:
        callers rely on it to skip a redundant dispatch)."""
        g = self.groups[r.group]
        self.seq += 1
        r.pending = _Pending(r.idx, kind, gpus, dur, key, reserved, self.seq)
        g.waiting.append(r.pending)
        self._dispatch(g, now)

    def _estimate(self, r: _Run, kind: str) -> float:
        """The reserved duration of ``r``'s phase ``kind`` (0 for a phase its trace lacks)."""
        assert r.trace is not None
        if r.estimated is not r.trace:  # a new trace: index it once (asked per phase start)
            r.estimates = {}
            for p in r.trace.phases:
                r.estimates.setdefault(p.kind, p.duration_s)  # the first phase of a kind
            r.estimated = r.trace
        return r.estimates.get(kind, 0.0)

    def _dispatch(self, g: _GroupRuntime, now: float) -> None:
        """Reserved phases by window start, each as soon as its GPUs are free; then backfill
        (:func:`backfill_fits`) while no reserved phase is blocked.

        Idempotent: dispatching ``g`` again with nothing changed since starts nothing, which
        lets callers skip a redundant dispatch. A reserved phase left queued did not fit the
        free GPUs; backfill refused was tested after every reserved start, and later starts
        are unreserved: they only lower the free GPUs, now and at every later moment of the
        schedule, so what was refused stays refused."""
        if not g.waiting:
            return
        g.waiting.sort(key=lambda p: (not p.reserved, p.key, p.seq))
        blocked = False
        schedule: BackfillSchedule | None = None  # built once, again after each start
        for p in list(g.waiting):
            if p.gpus > g.free:
                blocked = blocked or p.reserved
                continue
            if not p.reserved:
                if blocked:
                    break
                if schedule is None:
                    schedule = BackfillSchedule(now, g.free, *self._schedule(g, now))
                if not schedule.fits(p.gpus, self._estimate(self.runs[p.job], p.kind)):
                    continue
            g.waiting.remove(p)
            self._start_phase(g, p, now)
            schedule = None
        if self.backfill and not blocked and g.free:
            self._best_effort(g, now, schedule)  # still valid, unless None

    def _best_effort(
        self, g: _GroupRuntime, now: float, schedule: BackfillSchedule | None = None
    ) -> None:
        """Backfill with waiting jobs' work: an iteration of a job the placer keeps waiting
        (one whose kind's trace is known, so its phases can be estimated) starts in ``g``'s
        slack when its rollout fits the backfill schedule, as the live runtime runs a waiting
        job best effort. Jobs that already ran here come first (their state is parked here),
        then the placer's queue in order (the first ``BEST_EFFORT_SCAN``). The rest of the
        iteration queues as backfill in ``g``; when the placer admits the job, it moves to its
        group at the end of the iteration. ``schedule``: ``g``'s backfill schedule, if one
        was built for its present state (None: build it when needed)."""
        runs, by_name = self.runs, self.by_name
        here = sorted([j for j in g.members if runs[j].state == "best_effort"])
        queued = [by_name[n] for n in self.placer.queue[: self.BEST_EFFORT_SCAN]]
        for j in dict.fromkeys([*here, *queued]):
            r = runs[j]
            job = r.job
            # the tests have no side effects: the cheapest and most selective go first
            if job.rollout_gpus > g.free or r.busy or r.state not in ("arrived", "best_effort"):
                continue
            if r.peak_gpus > len(g.gids):
                continue
            trace = r.trace or self.placer.jobs[job.name].trace
            if trace is None:
                continue
            if schedule is None:
                schedule = BackfillSchedule(now, g.free, *self._schedule(g, now))
            if not schedule.fits(r.job.rollout_gpus, trace.phases[0].duration_s):
                continue
            if r.group != g.name:
                self._move(r, g.name)
            if r.start_s < 0:
                r.start_s = now
            r.state, r.trace, r.reserved, r.key = "best_effort", trace, False, now
            self.best_effort_iterations += 1
            self.seq += 1
            dur = job.rollout_s(r.iteration)
            self._start_phase(
                g, _Pending(j, "rollout", job.rollout_gpus, dur, now, False, self.seq), now
            )
            schedule = None
            if not g.free:
                break

    def _move(self, r: _Run, group: str) -> None:
        """``r`` joins ``group``, leaving its previous one (its parked state is gone there)."""
        if r.group != group:
            old = self.groups.get(r.group)
            if old is not None:
                old.members.discard(r.idx)
                old.forget(r.idx)
            r.group = group
        self.groups[group].members.add(r.idx)

    def _evict_best_effort(self, name: str, now: float) -> None:
        """Group ``name`` is released: best-effort work in it stops (a phase in progress is
        preempted, its GPU-seconds charged and its iteration run again later)."""
        g = self.groups.get(name)
        if g is None:
            return
        for j in sorted(g.members):
            r = self.runs[j]
            if r.state != "best_effort":
                continue
            if r.held.size:
                self._release(g, r, r.held, r.phase_t0, now, r.phase)
                r.held = r.held[:0]
                self.preempted_phases += 1
            if r.pending is not None:
                g.waiting.remove(r.pending)
                r.pending = None
            r.epoch += 1
            r.releases, r.need, r.phase = [], None, ""
            g.members.discard(j)
            g.forget(j)
            r.group = ""
            if r.admitted:
                self._move(r, r.admitted)
                r.state, r.admitted = "placed", ""
                self._next_iteration(r, now)
            else:
                r.state = "arrived"

    def _schedule(self, g: _GroupRuntime, now: float) -> tuple[list, list]:
        """What the group's runtime expects: GPUs released by running phases, GPUs needed by
        reserved phases (next windows, next phases of reserved iterations, blocked ones)."""
        releases: list[tuple[float, int]] = []
        needs: list[tuple[float, int]] = []
        runs = self.runs  # (hot: once per dispatch that tests backfill, over every member)
        for j in g.members:
            r = runs[j]
            if r.releases:
                releases += r.releases
            if r.window is not None:
                needs.append((r.window, r.job.rollout_gpus))
            pending = r.pending
            if pending is not None and pending.reserved:
                needs.append((now, pending.gpus))
            if r.need is not None:
                needs.append(r.need)
        return releases, needs

    def _start_phase(self, g: _GroupRuntime, p: _Pending, now: float) -> None:
        r = self.runs[p.job]
        r.pending = None
        setup = 0.0
        if p.kind == "train":
            local, setup = g.train_gpus(p.job, p.gpus, r.job.train_bytes_per_gpu, self.h2d)
        else:
            local = g.choose(p.gpus)
        g.holder[local] = p.job
        g.free -= len(local)
        self.ledger.take(p.job, g.gids[local])
        r.held, r.phase = local, p.kind
        if p.kind == "rollout":
            roll_end = now + self._estimate(r, "rollout")
            tail_end = roll_end + self._estimate(r, "tail")
            r.releases = [(roll_end, p.gpus - r.job.tail_gpus), (tail_end, r.job.tail_gpus)]
            train_at = tail_end + self._estimate(r, "gap")
            r.need = (train_at, r.job.train_gpus) if r.reserved else None
        elif p.kind == "train":
            r.releases = [(now + setup + self._estimate(r, "train"), p.gpus)]
            r.need = None
        else:  # profiling: its end is not estimated (no trace yet)
            r.releases, r.need = [], None
        r.phase_t0 = now
        self._push(now + setup + p.duration_s, _PHASE_END, p.job, (p.kind, now, r.epoch))

    def _release(self, g: _GroupRuntime, r: _Run, local: np.ndarray, t0: float, now: float,
                 kind: str) -> None:  # fmt: skip
        g.holder[local] = -1
        g.free += len(local)
        self.ledger.give(g.gids[local], t0, now)
        r.gpu_seconds += len(local) * (now - t0)
        if g.name == self.gantt_group and t0 < self.gantt_until:
            self.gantt.append((r.job.name, kind, t0, now, len(local)))

    def _phase_end(self, j: int, payload: object, now: float) -> None:
        kind, t0, epoch = payload  # type: ignore[misc]
        r = self.runs[j]
        if epoch != r.epoch:
            return  # the best-effort phase was preempted (its group was released)
        g = self.groups[r.group]
        if kind == "profile":
            self._release(g, r, r.held, t0, now, kind)
            r.held = r.held[:0]
            n = min(self.config.profile_iterations, r.job.iterations)
            r.iteration = n
            self.iteration_ends.setdefault(r.job.name, []).extend([now] * n)
            if n >= r.job.iterations:
                self._finish(r, now)
            else:
                recorded = recorded_iterations(r.job, n)
                r.trace = DemandTrace.from_iterations(recorded, self.config.reserve_quantile)
                self._apply(self.placer.profiled(r.job.name, r.trace, now), now)
        elif kind == "rollout":
            # keep tail_gpus of the rollout GPUs for the tail, free the rest now
            keep, rest = r.held[: r.job.tail_gpus], r.held[r.job.tail_gpus :]
            self._release(g, r, rest, t0, now, kind)
            r.held, r.phase = keep, "tail"
            tail_end = now + self._estimate(r, "tail")
            r.releases = [(tail_end, len(keep))]
            train_at = tail_end + self._estimate(r, "gap")
            r.need = (train_at, r.job.train_gpus) if r.reserved else None
            self._push(now + float(r.job.tail[r.iteration]), _PHASE_END, j, ("tail", t0, r.epoch))
        elif kind == "tail":
            self._release(g, r, r.held, t0, now, "rollout")
            r.held, r.releases = r.held[:0], []
            wait = r.job.stall_s(r.iteration)
            if wait > 0:  # tool waits on the critical path: hold nothing meanwhile
                r.phase, r.gap_end = "gap", now + wait
                r.need = (r.gap_end, r.job.train_gpus) if r.reserved else None
                self._push(r.gap_end, _PHASE_END, j, ("gap", now, r.epoch))
            else:
                self._enqueue_train(r, now)
                return  # _enqueue dispatched g last: again would start nothing (_dispatch)
        elif kind == "gap":
            r.phase = ""
            self._enqueue_train(r, now)
            return  # as above
        elif kind == "train":
            self._release(g, r, r.held, t0, now, kind)
            r.held, r.releases, r.need = r.held[:0], [], None
            r.iteration += 1
            self.iteration_ends.setdefault(r.job.name, []).append(now)
            if self._next_iteration(r, now) and r.group == g.name:
                return  # as above
        self._dispatch(g, now)

    def _enqueue_train(self, r: _Run, now: float) -> None:
        job, i = r.job, r.iteration
        self._enqueue(r, "train", job.train_gpus, job.train_s(i), r.reserved, r.key, now)

    def _finish(self, r: _Run, now: float) -> None:
        r.state = "done"
        ideal = fastest_s(r.job, self.cluster)
        self.outcomes.append(
            JobOutcome(r.job.name, r.job.arrival_s, r.start_s, now, r.gpu_seconds, ideal)
        )
        self.bar.update()
        g = self.groups.get(r.group)
        if g is not None:
            g.members.discard(r.idx)
            g.forget(r.idx)
        self._apply(self.placer.finish(r.job.name, now), now)

    def _group_runtime(self, name: str, now: float) -> _GroupRuntime:
        c = self.cluster
        group = self.placer.cluster.groups[name]
        dram = float("inf") if c.dram_gb_per_gpu is None else c.dram_gb_per_gpu * 1e9
        return _GroupRuntime(
            group,
            c.hbm_park_gb * 1e9,
            now,
            dram_bytes=dram * len(group.gpus),
            nvme_bytes_per_s=c.nvme_gbps * 1e9 / c.gpus_per_node,
        )


def recorded_iterations(job: SimJob, count: int) -> list[tuple[Phase, ...]]:
    """The first ``count`` iterations of ``job`` as profiling records them."""
    return [job.iteration_phases(i) for i in range(min(count, job.iterations))]


def sim_nodes(cluster: ClusterSpec) -> list[NodeView]:
    """The simulated cluster's nodes; GPU names are their global indices."""
    per = cluster.gpus_per_node
    return [
        NodeView(f"n{n}", tuple(str(n * per + k) for k in range(per))) for n in range(cluster.nodes)
    ]
