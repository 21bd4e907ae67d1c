"""A RollMux-style peer policy: phase multiplexing of split jobs in co-execution groups.

RollMux (phase-level multiplexing for RL post-training) keeps jobs in split deployment and lets
a few jobs share one rollout pool and one training pool, so that one job's training overlaps
another's rollout. Its rules as this simulator runs them:

- **Co-execution groups.** A group is ``r`` rollout GPUs and ``t`` training GPUs, formed from
  free GPUs for its first job and given back when its last job finishes. Jobs of one model
  class (same ``r`` and ``t``) share a group. A waiting job joins a group of its class when the
  group's round-robin cycle with it, ``C = max(sum of rollouts, sum of trainings, the longest
  member's rollout + training)``, stays within ``max_stretch`` times the shortest member's solo
  iteration (rollout + training, each member's mean, known exactly: an oracle estimate, as
  favourable to the policy as the isolated baselines' exact EASY estimates); otherwise it
  forms a new group when ``r + t`` GPUs are free. Waiting jobs are looked at in arrival order,
  first fit (a later job that fits starts before an earlier one that does not).
- **Round robin within a group.** When a pool frees, it serves the next member, in cyclic order
  after the one it served last, that is ready for that pool's phase (work-conserving).
- **Host-memory residency.** Every member's rollout weights and training state live in host
  DRAM; a pool that switches job loads the incoming job's state (bytes per GPU over the
  host-to-device bandwidth) after offloading the outgoing one's, on the critical path.

A phase on the rollout pool is one split-mode rollout: weight sync, bulk, tail and the tool
waits of agentic jobs (the pool holds through them), as in the ``split`` baseline; then the
training phase on the training pool. Jobs are charged the GPUs of the pool that runs their phase
(setup included); held GPU-seconds are the groups' GPUs over their lifetimes.

Expressed outside :mod:`plexrl_dask.policy`: the policy core's placer reserves per-slot GPU
counts within node groups and has no notion of a pool served in turn, so the rules above are
this module's own event loop, over the same jobs, ledger and outcome as every other policy.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from plexrl_dask.sim.isolated import fastest_s
from plexrl_dask.sim.simulator import GpuLedger, JobOutcome, SimOutcome
from plexrl_dask.sim.workload import TRAIN_BYTES_PER_PARAM, ClusterSpec, SimJob

_ARRIVE, _END = 0, 1
_POOLS = ("rollout", "train")


@dataclass
class _Member:
    job: SimJob
    idx: int
    group: int = -1
    iteration: int = 0
    ready: str = "rollout"  # the pool it waits for ("" while a phase of it runs)
    start_s: float = -1.0
    gpu_seconds: float = 0.0
    roll_mean: float = 0.0
    train_mean: float = 0.0


@dataclass
class _Group:
    gid: int
    model: str
    pools: dict[str, np.ndarray]  # pool -> GPU ids
    born: float
    members: list[int] = field(default_factory=list)
    busy: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(_POOLS, False))
    last: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_POOLS, -1))  # resident

    # the members' rollouts, trainings, longest and shortest solo iteration, kept while the
    # members do not change (a queue of waiting jobs asks every group of its class per event)
    _known: tuple[list[float], list[float], float, float] | None = field(default=None, repr=False)

    def join(self, j: int) -> None:
        self.members.append(j)
        self._known = None

    def leave(self, j: int) -> None:
        self.members.remove(j)
        self._known = None

    def cycle(self, runs: list[_Member], extra: _Member | None = None) -> tuple[float, float]:
        """The round-robin cycle of the members (and ``extra``), and the shortest solo
        iteration among them."""
        if self._known is None:
            ms = [runs[i] for i in self.members]
            solos = [m.roll_mean + m.train_mean for m in ms]
            self._known = ([m.roll_mean for m in ms], [m.train_mean for m in ms],
                           max(solos, default=-math.inf), min(solos, default=math.inf))  # fmt: skip
        rolls, trains, longest, shortest = self._known
        if extra is not None:  # summed over the same values in the same order as before
            rolls, trains = [*rolls, extra.roll_mean], [*trains, extra.train_mean]
            solo = extra.roll_mean + extra.train_mean
            longest, shortest = max(longest, solo), min(shortest, solo)
        return max(sum(rolls), sum(trains), longest), shortest


class RollMuxSim:
    """One run of ``jobs`` under the RollMux-style policy (module docstring)."""

    def __init__(self, jobs: list[SimJob], cluster: ClusterSpec, max_stretch: float) -> None:
        self.cluster = cluster
        self.max_stretch = max_stretch
        self.h2d = cluster.h2d_gbps * 1e9
        self.runs = [_Member(j, i) for i, j in enumerate(jobs)]
        for m in self.runs:
            j = m.job
            w = 0.0 if j.stall is None else float(j.stall.mean())
            m.roll_mean = j.sync_s + float(j.bulk.mean() + j.tail.mean()) + w
            m.train_mean = float(j.train.mean())
        self.free = np.ones(cluster.gpus, dtype=bool)
        self.n_free = cluster.gpus  # (counted: a long queue asks per job whether one fits)
        self.ledger = GpuLedger(cluster)
        self.groups: dict[int, _Group] = {}
        self.of_model: dict[str, list[_Group]] = {}  # the groups of each class, as formed
        self.waiting: list[int] = []
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.events = 0
        self.held_gpu_seconds = 0.0
        self.outcomes: list[JobOutcome] = []
        self.iteration_ends: dict[str, list[float]] = {}
        for m in self.runs:
            self._push(m.job.arrival_s, _ARRIVE, m.idx, None)

    def _push(self, t: float, kind: int, job: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, job, payload))

    def run(self) -> SimOutcome:
        while self.heap:
            now, _, kind, j, payload = heapq.heappop(self.heap)
            self.events += 1
            if kind == _ARRIVE:
                self.waiting.append(j)
                self._admit(now)
            else:
                self._phase_end(self.runs[j], payload, now)
        assert len(self.outcomes) == len(self.runs), "a job never finished"
        end = max(o.end_s for o in self.outcomes)
        return SimOutcome(
            policy="rollmux",
            jobs=sorted(self.outcomes, key=lambda o: o.name),
            held_gpu_seconds=self.held_gpu_seconds,
            busy_gpu_seconds=self.ledger.busy_gpu_seconds,
            double_bookings=self.ledger.double_bookings,
            events=self.events,
            wall_s=0.0,
            heatmap=self.ledger.heatmap(end),
            bin_s=self.ledger.bin_s,
            iteration_ends=self.iteration_ends,
        )

    # --- admission ---------------------------------------------------------------------------

    def _admit(self, now: float) -> None:
        """Waiting jobs in arrival order, first fit: join a group, else form one."""
        for j in list(self.waiting):
            m = self.runs[j]
            g = self._group_with_room(m)
            if g is None:
                g = self._form(m, now)
            if g is None:
                continue
            self.waiting.remove(j)
            g.join(j)
            m.group, m.start_s = g.gid, now
            self._serve(g, now)

    def _group_with_room(self, m: _Member) -> _Group | None:
        for g in self.of_model.get(m.job.model, ()):
            cycle, solo = g.cycle(self.runs, m)
            if cycle <= self.max_stretch * solo:
                return g
        return None

    def _form(self, m: _Member, now: float) -> _Group | None:
        r, t = m.job.rollout_gpus, m.job.train_gpus
        if self.n_free < r + t:
            return None
        ids = np.flatnonzero(self.free)
        self.free[ids[: r + t]] = False
        self.n_free -= r + t
        gid = self.seq
        self.seq += 1
        g = _Group(gid, m.job.model, {"rollout": ids[:r], "train": ids[r : r + t]}, now)
        self.groups[gid] = g
        self.of_model.setdefault(g.model, []).append(g)
        return g

    # --- phases ------------------------------------------------------------------------------

    def _serve(self, g: _Group, now: float) -> None:
        """Each free pool serves its next ready member in round-robin order."""
        for pool in _POOLS:
            if g.busy[pool] or not g.members:
                continue
            n = len(g.members)
            after = g.members.index(g.last[pool]) + 1 if g.last[pool] in g.members else 0
            for k in range(n):
                j = g.members[(after + k) % n]
                if self.runs[j].ready == pool:
                    self._start(g, pool, self.runs[j], now)
                    break

    def _start(self, g: _Group, pool: str, m: _Member, now: float) -> None:
        job, i = m.job, m.iteration
        setup = 0.0
        if g.last[pool] != m.idx:  # switch: offload the resident job's state, load this one's
            setup = self._state_bytes(job, pool) / self.h2d
            if g.last[pool] >= 0:
                setup += self._state_bytes(self.runs[g.last[pool]].job, pool) / self.h2d
        if pool == "rollout":
            dur = job.sync_s + float(job.bulk[i] + job.tail[i]) + job.stall_s(i)
        else:
            dur = float(job.train[i])
        g.busy[pool], g.last[pool], m.ready = True, m.idx, ""
        gids = g.pools[pool]
        self.ledger.take(m.idx, gids)
        self._push(now + setup + dur, _END, m.idx, (pool, now))

    @staticmethod
    def _state_bytes(job: SimJob, pool: str) -> float:
        """Bytes per GPU a pool moves to host and back for ``job``: bf16 weights spread over
        its rollout GPUs, or its training state over its training GPUs."""
        if pool == "rollout":
            return 2e9 * _params_b(job) / job.rollout_gpus
        return job.train_bytes_per_gpu

    def _phase_end(self, m: _Member, payload: object, now: float) -> None:
        pool, t0 = payload  # type: ignore[misc]
        g = self.groups[m.group]
        gids = g.pools[pool]
        self.ledger.give(gids, t0, now)
        m.gpu_seconds += len(gids) * (now - t0)
        g.busy[pool] = False
        if pool == "rollout":
            m.ready = "train"
        else:
            m.iteration += 1
            self.iteration_ends.setdefault(m.job.name, []).append(now)
            m.ready = "rollout" if m.iteration < m.job.iterations else ""
            if not m.ready:
                self._finish(g, m, now)
        self._serve(g, now)

    def _finish(self, g: _Group, m: _Member, now: float) -> None:
        ideal = fastest_s(m.job, self.cluster)
        self.outcomes.append(
            JobOutcome(m.job.name, m.job.arrival_s, m.start_s, now, m.gpu_seconds, ideal)
        )
        g.leave(m.idx)
        for pool in _POOLS:  # its states are dropped, not offloaded, when the pool switches
            if g.last[pool] == m.idx:
                g.last[pool] = -1
        if not g.members:
            ids = np.concatenate([g.pools[p] for p in _POOLS])
            self.free[ids] = True
            self.n_free += len(ids)
            self.held_gpu_seconds += len(ids) * (now - g.born)
            del self.groups[g.gid]
            self.of_model[g.model] = [x for x in self.of_model[g.model] if x is not g]
        self._admit(now)


def _params_b(job: SimJob) -> float:
    """Billions of parameters, from the training state's bytes."""
    return job.train_bytes_per_gpu * job.train_gpus / TRAIN_BYTES_PER_PARAM / 1e9
