"""Spatiotemporal placement: which node group holds a job's demand, and when in its period.

Pure decisions over plain state (numpy, no Dask), driven by the live scheduler plugin and by
the simulator (:mod:`plexrl_dask.sim.simulator`) alike: both call :class:`SpatiotemporalPlacer`
with the same events (a job submitted, a job's trace recorded, a job finished) and act on the
:class:`PlacementDecision` list it returns.

**Hierarchical resource views.** The cluster is a set of nodes, each with GPUs. Nodes are
either free or belong to one :class:`NodeGroup`; a group is the unit a job's demand is
reserved in, and it sees its jobs over one period of its cyclic :class:`~.horizon.Horizon`.
Capacity is counted per level (cluster, group, node, GPU: :meth:`ClusterView.capacity`); a
group's capacity is the GPUs of its nodes.

**Atomic reservations.** A :class:`Reservation` is a job's demand profile (GPUs per slot of the
group's horizon) at an offset. :meth:`NodeGroup.reserve` adds it only if the group's load stays
within capacity in *every* slot, else raises :class:`ReservationConflict` and changes nothing;
forming a group takes all the nodes it needs or none. No slot of a group is ever reserved past
its capacity, so two reservations never count on the same GPU at the same time.

**Two phases.** A job whose trace is unknown is *profiled*: it gets a dedicated reservation (a
flat profile of all the GPUs it runs on, in a group whose every slot has that much slack, or in
a new group formed of free nodes), runs there, and the runtime records its iterations. Once
its trace is known (:meth:`SpatiotemporalPlacer.profiled`), it is placed for good: its
dedicated reservation is released and its shaped profile is *micro-shifted* into a group: of
the offsets at which it fits, the one with the lowest peak load, then the least overlap with
the group's load (the inner product of the two profiles: demand that falls into slack windows
overlaps nothing), then the smallest delay from now. It always finds a home, at worst its own
dedicated capacity back.

**Spread** chooses, among the groups where a job fits, the one whose peak load after placement
is the lowest (relative to its capacity), then the least overlap, then the least period
padding: load is balanced over groups and demand overlaps as little as it can. **Pack** (the
alternative, for comparison) chooses the fullest group that still fits (best fit). A group is
only a candidate if locking the job to its horizon slows it by at most ``max_padding``.

**Backfill** is a runtime rule (:func:`backfill_fits`, EASY backfill against the group's actual
reserved schedule): work outside a job's own reserved windows (an iteration that is ready
before its window) may take free GPUs now only if, over its whole estimated duration, the GPUs
the running phases are expected to release keep covering every reserved phase expected to
start (a job's next window, the next phase of an iteration running in its window) plus its
own: it fills slack and, as far as the estimates hold, delays no reservation. The runtime
applies it to placed jobs' early iterations and to waiting jobs' best-effort iterations (of
jobs whose kind's trace is known). Reserved phases are not preempted, so an estimate that
runs over can delay one by the overrun.

**Queue.** Jobs that fit nowhere wait in arrival order; a later job may go ahead of one that
does not fit (backfill of whole jobs), but a job passed over ``max_skips`` times blocks the
ones behind it until it is placed (the starvation bound).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from plexrl_dask.errors import (
    InvalidTrace,
    JobDoesNotFit,
    JobNotPlaced,
    PlacementError,
    ReservationConflict,
)
from plexrl_dask.policy.horizon import DemandTrace, Horizon

logger = logging.getLogger(__name__)

PACKINGS = ("spread", "pack")


@dataclass(frozen=True)
class PlacementConfig:
    """Knobs of the spatiotemporal placement (``plexrl.placement.*`` in dask.config)."""

    slots: int = 96  # slots per horizon period
    reserve_quantile: float = 0.9  # a phase reserves this quantile of its recorded durations
    profile_iterations: int = 3  # iterations recorded before a job is placed for good
    group_nodes: int = 64  # nodes a new group is formed with (more if a job needs them)
    packing: str = "spread"  # "spread" or "pack"
    max_padding: float = 2.0  # a job is not locked to a horizon that slows it more than this
    max_skips: int = 1000  # a waiting job passed over this often blocks the jobs behind it
    late_tolerance: float = 0.05  # runtime: fraction of its period a job may start late
    horizon_periods: int = 4  # a group's horizon spans this many periods of its first job
    group_peaks: float = 1.0  # a new group holds at least this many of its first job's peak
    reuse_traces: bool = True  # a job of a kind profiled before (or waiting then) uses its trace

    def __post_init__(self) -> None:
        if min(self.slots, self.profile_iterations, self.group_nodes, self.horizon_periods) < 1:
            raise InvalidTrace(
                "slots, profile_iterations, group_nodes and horizon_periods must be >= 1"
            )
        if self.packing not in PACKINGS:
            raise InvalidTrace(f"packing must be one of {PACKINGS}, got {self.packing!r}")
        if not 0 < self.reserve_quantile <= 1 or self.max_padding < 1 or self.max_skips < 0:
            raise InvalidTrace(
                "need 0 < reserve_quantile <= 1, max_padding >= 1 and max_skips >= 0"
            )
        if not 0 <= self.late_tolerance < 1:
            raise InvalidTrace("late_tolerance must be in [0, 1)")


@dataclass(frozen=True)
class NodeView:
    """A node and its GPUs (any hashable names; a Dask worker per GPU, live)."""

    name: str
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class Reservation:
    """A job's demand held in a group: ``profile[s]`` GPUs in slot ``s`` (already shifted).

    A dedicated reservation is flat and has no period; a shaped one repeats every
    ``locked_period_s``, its iterations starting in slot ``offset``.
    """

    job: str
    group: str
    profile: tuple[int, ...]
    offset: int = 0
    locked_period_s: float | None = None

    @property
    def dedicated(self) -> bool:
        return self.locked_period_s is None

    @property
    def peak_gpus(self) -> int:
        return max(self.profile)


@dataclass(frozen=True)
class PlacementDecision:
    """What the runtime must do: ``profile`` (run the job on dedicated capacity of ``group``),
    ``place`` (run it in ``group`` from its windows at ``offset`` on), ``wait`` (nowhere to
    run yet) or ``release`` (a group dissolved; its nodes are free)."""

    kind: str
    job: str
    group: str = ""
    offset: int = 0
    locked_period_s: float = 0.0
    gpus: int = 0
    time: float = 0.0
    reason: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class NodeGroup:
    """Nodes seen over one horizon: the unit reservations are made in."""

    def __init__(self, name: str, nodes: Sequence[NodeView], slots: int, now: float) -> None:
        self.name = name
        self.nodes = tuple(nodes)
        self.slots = slots
        self.horizon: Horizon | None = None  # set by the first shaped reservation
        self.epoch = now  # absolute time of slot 0
        self.load = np.zeros(slots, dtype=np.int64)
        self.reservations: dict[str, Reservation] = {}
        self.capacity = sum(len(n.gpus) for n in self.nodes)
        # best_shift's arguments known to fit at no offset, valid while the load and horizon
        # are those of _misfits_at: every waiting job is tried in every group at every
        # admission, and mostly the groups have not changed since the last one
        self._misfits: set[tuple[DemandTrace, float, int]] = set()
        self._misfits_at: tuple[bytes, Horizon | None] = (b"", None)

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(g for n in self.nodes for g in n.gpus)

    def others_load(self, job: str) -> np.ndarray:
        """The load of every reservation but ``job``'s."""
        res = self.reservations.get(job)
        return self.load if res is None else self.load - np.asarray(res.profile)

    def reserve(self, res: Reservation) -> None:
        """Add ``res`` if it fits in every slot; else raise and change nothing (atomic)."""
        if res.group != self.name or len(res.profile) != self.slots:
            raise ReservationConflict(
                f"reservation of {res.job!r} is for group {res.group!r} with "
                f"{len(res.profile)} slots, not {self.name!r} with {self.slots}"
            )
        if res.job in self.reservations:
            raise ReservationConflict(f"{res.job!r} already holds a reservation in {self.name}")
        new = self.load + np.asarray(res.profile)
        if new.max() > self.capacity:
            slot = int(new.argmax())
            raise ReservationConflict(
                f"{res.job!r} does not fit {self.name}: slot {slot} would hold "
                f"{int(new[slot])} of {self.capacity} GPUs"
            )
        self.load = new
        self.reservations[res.job] = res

    def release(self, job: str) -> Reservation:
        res = self.reservations.pop(job, None)
        if res is None:
            raise JobNotPlaced(f"{job!r} holds no reservation in group {self.name}")
        self.load = self.load - np.asarray(res.profile)
        if all(r.dedicated for r in self.reservations.values()):
            self.horizon = None  # the next shaped job sets the period afresh
        return res

    def best_shift(
        self, trace: DemandTrace, now: float, max_padding: float, horizon_periods: int = 1
    ) -> tuple[tuple, Reservation] | None:
        """The micro-shift of ``trace`` into this group: ``(score, reservation)`` of its best
        offset, or None if it fits at none (or would be padded by more than ``max_padding``).

        ``score`` is ``(peak load after / capacity, overlap / capacity², padding, delay)``.
        Whether it is None depends on ``trace``, the load and the horizon only (not ``now``).
        """
        at = (self.load.tobytes(), self.horizon)
        if at != self._misfits_at:
            self._misfits, self._misfits_at = set(), at
        key = (trace, max_padding, horizon_periods)
        if key in self._misfits:
            return None
        shift = self._best_shift(trace, now, max_padding, horizon_periods)
        if shift is None:
            self._misfits.add(key)
        return shift

    def _best_shift(
        self, trace: DemandTrace, now: float, max_padding: float, horizon_periods: int
    ) -> tuple[tuple, Reservation] | None:
        """:meth:`best_shift`, computed."""
        horizon = self.horizon or Horizon(trace.period_s * horizon_periods, self.slots)
        padding = horizon.padding(trace.period_s)
        if padding > max_padding or trace.peak_gpus > self.capacity:
            return None
        base = horizon.profile(trace)
        s = self.slots
        idx = (np.arange(s)[None, :] - np.arange(s)[:, None]) % s
        shifted = base[idx]  # row o: the profile starting in slot o
        loads = shifted + self.load[None, :]
        peaks = loads.max(axis=1)
        feasible = np.flatnonzero(peaks <= self.capacity)
        if feasible.size == 0:
            return None
        overlap = shifted[feasible] @ self.load
        here = horizon.slot_of(now, self.epoch) if self.horizon else 0
        delay = (feasible - here) % s
        order = np.lexsort((delay, overlap, peaks[feasible]))
        o = int(feasible[order[0]])
        score = (
            float(peaks[o]) / self.capacity,
            float(overlap[order[0]]) / self.capacity**2,
            padding,
            int(delay[order[0]]),
        )
        res = Reservation(
            self.name,
            self.name,
            tuple(int(x) for x in shifted[o]),
            o,
            horizon.locked_period(trace.period_s),
        )
        return score, res

    def window_start(self, job: str, t: float, late_tolerance: float) -> float:
        """The start of ``job``'s reserved iteration window that ``t`` may use: the latest one
        at most ``late_tolerance`` of a period before ``t``, else the next one."""
        res = self.reservations.get(job)
        if res is None or res.dedicated or self.horizon is None:
            raise JobNotPlaced(f"{job!r} has no shaped reservation in group {self.name}")
        period = res.locked_period_s
        assert period is not None
        base = self.epoch + res.offset * self.horizon.slot_s
        k = np.ceil((t - late_tolerance * period - base) / period - 1e-9)
        return float(base + k * period)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "nodes": [n.name for n in self.nodes],
            "capacity": self.capacity,
            "period_s": self.horizon.period_s if self.horizon else None,
            "epoch": self.epoch,
            "load": self.load.tolist(),
            "jobs": sorted(self.reservations),
        }


class ClusterView:
    """The cluster → node group → node → GPU hierarchy, and which nodes are free."""

    def __init__(self, nodes: Sequence[NodeView], slots: int) -> None:
        names = [n.name for n in nodes]
        if len(set(names)) != len(names) or any(not n.gpus for n in nodes):
            raise InvalidTrace("nodes need distinct names and at least one GPU each")
        self.nodes = {n.name: n for n in nodes}
        self.free: list[str] = list(names)  # in the order given: groups take nodes in order
        self.groups: dict[str, NodeGroup] = {}
        self.slots = slots
        self._next_group = 0
        self.total_gpus = sum(len(n.gpus) for n in nodes)

    @property
    def free_gpus(self) -> int:
        return sum(len(self.nodes[n].gpus) for n in self.free)

    def capacity(self) -> dict:
        """GPUs per level: the cluster, free nodes, each group, each node."""
        return {
            "cluster": self.total_gpus,
            "free": self.free_gpus,
            "groups": {g.name: g.capacity for g in self.groups.values()},
            "nodes": {n.name: len(n.gpus) for n in self.nodes.values()},
        }

    def nodes_for(self, gpus: int, want_nodes: int) -> list[str] | None:
        """Free nodes holding at least ``gpus`` GPUs and, if free nodes allow, ``want_nodes``
        of them; None if the free nodes hold fewer than ``gpus`` GPUs."""
        take, have = [], 0
        for n in self.free:
            if have >= gpus and len(take) >= want_nodes:
                break
            take.append(n)
            have += len(self.nodes[n].gpus)
        return take if have >= gpus else None

    def add_node(self, node: NodeView) -> None:
        """GPUs that joined: a new node, free after the others (groups take nodes in order),
        or more GPUs of a node that is free (its workers register one by one). A node in a
        group cannot grow: its group's capacity is under reservations."""
        known = {g for n in self.nodes.values() for g in n.gpus}
        if not node.gpus or known & set(node.gpus):
            raise PlacementError(f"node {node.name!r}: GPUs {list(node.gpus)} must be new")
        old = self.nodes.get(node.name)
        if old is not None and node.name not in self.free:
            raise PlacementError(f"node {node.name!r} is in a group: it cannot grow now")
        if old is None:
            self.free.append(node.name)
        self.nodes[node.name] = NodeView(node.name, (*(old.gpus if old else ()), *node.gpus))
        self.total_gpus += len(node.gpus)

    def can_add(self, node: str) -> bool:
        """Whether GPUs of ``node`` may join now (a new node, or a free one)."""
        return node not in self.nodes or node in self.free

    def form_group(self, node_names: Sequence[str], now: float) -> NodeGroup:
        """A new group of exactly these free nodes (all of them or, if any is taken, none)."""
        if not node_names or any(n not in self.free for n in node_names):
            raise ReservationConflict(f"nodes {list(node_names)} are not all free")
        name = f"g{self._next_group}"
        self._next_group += 1
        taken = set(node_names)
        self.free = [n for n in self.free if n not in taken]
        group = NodeGroup(name, [self.nodes[n] for n in node_names], self.slots, now)
        self.groups[name] = group
        return group

    def dissolve(self, group: str) -> None:
        g = self.groups.pop(group)
        assert not g.reservations, "dissolving a group that holds reservations"
        order = {n: i for i, n in enumerate(self.nodes)}
        self.free = sorted([*self.free, *(n.name for n in g.nodes)], key=order.__getitem__)


@dataclass
class _Job:
    name: str
    gpus: int  # GPUs it runs on while dedicated (profiling)
    submitted: float
    trace: DemandTrace | None = None
    state: str = "waiting"  # waiting -> profiling -> placed
    group: str = ""
    skips: int = 0
    kind: str = ""
    waited_reason: str = field(default="", repr=False)


class SpatiotemporalPlacer:
    """The two-phase placement policy over a :class:`ClusterView` (module docstring).

    Every method takes the current time and returns the decisions it made, in order; the
    caller (simulator or live plugin) acts on them. Same events in, same decisions out.
    """

    def __init__(self, nodes: Sequence[NodeView], config: PlacementConfig | None = None) -> None:
        self.config = config or PlacementConfig()
        self.cluster = ClusterView(nodes, self.config.slots)
        self.jobs: dict[str, _Job] = {}
        self.queue: list[str] = []
        self.known: dict[str, DemandTrace] = {}  # the last recorded trace of each job kind
        self.inputs: list[dict] = []  # every event, as plain data (see :func:`replay`)
        self.log: list[PlacementDecision] = []

    # --- events ----------------------------------------------------------------------------

    def submit(
        self,
        job: str,
        gpus: int,
        now: float,
        trace: DemandTrace | None = None,
        kind: str = "",
    ) -> list[PlacementDecision]:
        """A new job that runs on ``gpus`` GPUs while dedicated. With a known ``trace`` it
        skips profiling; so it does, with ``reuse_traces``, when a job of the same ``kind``
        (its model and recipe: jobs whose iterations look alike) was profiled before."""
        if job in self.jobs:
            raise ReservationConflict(f"job {job!r} was already submitted")
        if gpus < 1 or (trace is not None and trace.peak_gpus > gpus):
            raise InvalidTrace(
                f"job {job!r}: gpus must be >= 1 and >= its trace's peak, got {gpus}"
            )
        if gpus > self.cluster.total_gpus:
            raise JobDoesNotFit(
                f"job {job!r} needs {gpus} GPUs at once; the cluster has {self.cluster.total_gpus}"
            )
        self._record("submit", job, now, gpus=gpus, kind=kind, trace=trace)
        if trace is None and kind and self.config.reuse_traces:
            trace = self.known.get(kind)
        self.jobs[job] = _Job(job, gpus, now, trace, kind=kind)
        self.queue.append(job)
        out = self._admit(now)
        if self.jobs[job].state == "waiting":
            out.append(self._decide("wait", job, time=now, reason=self.jobs[job].waited_reason))
        return out

    def profiled(self, job: str, trace: DemandTrace, now: float) -> list[PlacementDecision]:
        """``job``'s trace is known: move it from dedicated capacity to a shaped reservation."""
        j = self._job(job, "profiling")
        if trace.peak_gpus > j.gpus:
            raise InvalidTrace(f"{job!r}: its trace peaks at {trace.peak_gpus} > {j.gpus} GPUs")
        self._record("profiled", job, now, trace=trace)
        j.trace = trace
        if j.kind:
            self.known[j.kind] = trace
            if self.config.reuse_traces:  # jobs of its kind still waiting need no profiling
                for name in self.queue:
                    other = self.jobs[name]
                    if (
                        other.kind == j.kind
                        and other.trace is None
                        and trace.peak_gpus <= other.gpus
                    ):
                        other.trace = trace
        old = self.cluster.groups[j.group]
        old.release(job)
        choice = self._best_group(trace, now)
        if choice is None:
            # its own dedicated capacity is free again and holds its peak at every offset; only
            # the padding bound can have excluded it, which does not apply to a job's own place
            shift = old.best_shift(trace, now, float("inf"), self.config.horizon_periods)
            assert shift is not None, "a job's trace must fit its own dedicated capacity"
            choice = (old, shift[1])
        out = [self._commit_shaped(j, *choice, now)]
        if not old.reservations:
            out.append(self._dissolve(old.name, now))
        return out + self._admit(now)

    def add_node(self, node: NodeView, now: float) -> list[PlacementDecision]:
        """GPUs joined the cluster (``node``: a new node, or more GPUs of a free one): they
        are free for new groups, and waiting jobs that now fit are admitted. (A node that
        leaves is not handled: reservations would have to move.)"""
        self.cluster.add_node(node)
        self.inputs.append({"event": "add_node", "node": node.name, "gpus": list(node.gpus),
                            "now": now})  # fmt: skip
        return self._admit(now)

    def finish(self, job: str, now: float) -> list[PlacementDecision]:
        """``job`` ended (or was cancelled): free its reservation, admit waiting jobs."""
        j = self.jobs.pop(job, None)
        if j is None:
            raise JobNotPlaced(f"no job {job!r} to finish")
        self._record("finish", job, now)
        out: list[PlacementDecision] = []
        if j.state == "waiting":
            self.queue.remove(job)
        else:
            g = self.cluster.groups[j.group]
            g.release(job)
            if not g.reservations:
                out.append(self._dissolve(g.name, now))
        return out + self._admit(now)

    # --- queries ---------------------------------------------------------------------------

    def group_of(self, job: str) -> NodeGroup:
        j = self.jobs.get(job)
        if j is None or not j.group:
            raise JobNotPlaced(f"job {job!r} is not placed")
        return self.cluster.groups[j.group]

    def state(self) -> dict:
        """The policy's state as plain data (for status, the dashboard and tests)."""
        return {
            "capacity": self.cluster.capacity(),
            "groups": [g.to_dict() for g in self.cluster.groups.values()],
            "queue": list(self.queue),
            "jobs": {j.name: {"state": j.state, "group": j.group} for j in self.jobs.values()},
        }

    # --- internals -------------------------------------------------------------------------

    def _job(self, job: str, state: str) -> _Job:
        j = self.jobs.get(job)
        if j is None or j.state != state:
            raise JobNotPlaced(f"job {job!r} is {j.state if j else 'unknown'}, not {state}")
        return j

    def _record(self, event: str, job: str, now: float, trace: DemandTrace | None = None,
                **kw: object) -> None:  # fmt: skip
        self.inputs.append(
            {"event": event, "job": job, "now": now,
             "trace": trace.to_dict() if trace else None, **kw}
        )  # fmt: skip

    def _decide(self, kind: str, job: str, **kw) -> PlacementDecision:
        d = PlacementDecision(kind, job, **kw)
        self.log.append(d)
        logger.debug("placement: %s", d)
        return d

    def _admit(self, now: float) -> list[PlacementDecision]:
        out: list[PlacementDecision] = []
        for job in list(self.queue):
            j = self.jobs[job]
            d = self._try_start(j, now)
            if d is not None:
                self.queue.remove(job)
                out.append(d)
                continue
            j.skips += 1
            if j.skips > self.config.max_skips:
                break  # starvation bound: nobody goes ahead of it any more
        return out

    def _try_start(self, j: _Job, now: float) -> PlacementDecision | None:
        if j.trace is not None:
            choice = self._best_group(j.trace, now)
            if choice is None:
                j.waited_reason = "its demand fits no group and too few nodes are free"
                return None
            return self._commit_shaped(j, *choice, now)
        group = self._dedicated_group(j.gpus, now)
        if group is None:
            j.waited_reason = (
                f"no group has {j.gpus} GPUs of slack in every slot and free nodes hold "
                f"{self.cluster.free_gpus} GPUs"
            )
            return None
        group.reserve(Reservation(j.name, group.name, tuple(group.slots * [j.gpus])))
        j.state, j.group = "profiling", group.name
        return self._decide("profile", j.name, group=group.name, gpus=j.gpus, time=now)

    def _dedicated_group(self, gpus: int, now: float) -> NodeGroup | None:
        fits = [g for g in self.cluster.groups.values() if g.capacity - int(g.load.max()) >= gpus]
        if fits:
            sign = -1 if self.config.packing == "spread" else 1  # spread: the most slack
            return min(fits, key=lambda g: (sign * (g.capacity - int(g.load.max())), g.name))
        return self._new_group(gpus, now)

    def _new_group(self, gpus: int, now: float) -> NodeGroup | None:
        per_node = self.cluster.total_gpus / len(self.cluster.nodes)
        want = max(self.config.group_nodes, round(self.config.group_peaks * gpus / per_node))
        nodes = self.cluster.nodes_for(gpus, want)
        return None if nodes is None else self.cluster.form_group(nodes, now)

    def _best_group(self, trace: DemandTrace, now: float) -> tuple[NodeGroup, Reservation] | None:
        best: tuple[tuple, NodeGroup, Reservation] | None = None
        for g in self.cluster.groups.values():
            shift = g.best_shift(trace, now, self.config.max_padding, self.config.horizon_periods)
            if shift is None:
                continue
            score, res = shift
            if self.config.packing == "pack":
                score = (-score[0], -float(g.load.mean()) / g.capacity, *score[1:])
            key = (*score, g.name)
            if best is None or key < best[0]:
                best = (key, g, res)
        if best is not None:
            return best[1], best[2]
        group = self._new_group(trace.peak_gpus, now)
        if group is None:
            return None
        shift = group.best_shift(trace, now, self.config.max_padding, self.config.horizon_periods)
        assert shift is not None, "a fresh group sized for the peak must fit the job"
        return group, shift[1]

    def _commit_shaped(
        self, j: _Job, group: NodeGroup, res: Reservation, now: float
    ) -> PlacementDecision:
        assert j.trace is not None
        if group.horizon is None:
            group.horizon = Horizon(j.trace.period_s * self.config.horizon_periods, group.slots)
            group.epoch = now
        res = Reservation(j.name, group.name, res.profile, res.offset, res.locked_period_s)
        group.reserve(res)
        j.state, j.group = "placed", group.name
        return self._decide(
            "place",
            j.name,
            group=group.name,
            offset=res.offset,
            locked_period_s=float(res.locked_period_s or 0.0),
            gpus=res.peak_gpus,
            time=now,
        )

    def _dissolve(self, group: str, now: float) -> PlacementDecision:
        self.cluster.dissolve(group)
        return self._decide("release", "", group=group, time=now)


class BackfillSchedule:
    """What a group's runtime expects from ``now`` on, for the Backfill test.

    ``releases`` are ``(time, gpus)`` the running phases are expected to free (one expected at
    or before ``now`` is overdue: its GPUs are still held and when they come free is unknown,
    so it is not counted), ``needs`` ``(time, gpus)`` of reserved phases expected to start
    (times before ``now`` mean "now"). Built once (a sort), it answers :meth:`fits` by a
    binary search over the events earlier answers computed, computing more only as needed.
    """

    def __init__(
        self,
        now: float,
        free: int,
        releases: Iterable[tuple[float, int]],
        needs: Iterable[tuple[float, int]],
    ) -> None:
        events = [(t, 1, g) for t, g in releases if t > now]
        events += [(t if t > now else now, 0, -g) for t, g in needs]
        events.sort()  # at one instant, needs (0) come before releases (1): conservative
        self.now = now
        self.free = free
        # The free GPUs after each event, and the least up to it, are computed lazily: only as
        # far as fits has looked (the simulator builds a schedule per dispatch, and most
        # answers are no, decided by the first tens of events). Plain lists, not numpy: a
        # schedule holds tens of events, where numpy's per-call overhead would dominate.
        self._events = events
        self._times = [now]  # times[i + 1]: the time of events[i]
        self._low = [free]  # the least free GPUs up to times[i]
        self._avail = free  # the free GPUs after the last event computed

    def fits(self, gpus: int, duration_s: float) -> bool:
        """May ``gpus`` GPUs run unreserved work for ``duration_s`` from ``now``? Yes if at
        every moment of ``[now, now + duration_s)`` the free GPUs, minus this work, plus what
        has been released, cover what reserved phases have needed so far (over the whole
        schedule if ``duration_s <= 0``)."""
        if gpus > self.free:
            return False
        end = self.now + duration_s
        until = end if end > self.now else math.inf
        last = bisect_left(self._times, until) - 1  # the last event computed before `until`
        if last < len(self._times) - 1:  # the events before `until` are all computed
            return self._low[last] >= gpus
        return self._scan(until, gpus)

    def _scan(self, until: float, gpus: int) -> bool:
        """Compute the events before ``until`` not computed yet (all computed ones are before
        it): True if the free GPUs stay at least ``gpus`` throughout, False as soon as not."""
        times, low, events = self._times, self._low, self._events
        least, avail = low[-1], self._avail
        i = len(times) - 1  # the next event to compute
        n = len(events)
        while least >= gpus and i < n:
            t, _, g = events[i]
            if t >= until:
                break
            avail += g
            if avail < least:
                least = avail
            times.append(t)
            low.append(least)
            i += 1
        self._avail = avail
        return least >= gpus


def backfill_fits(
    now: float,
    free: int,
    gpus: int,
    duration_s: float,
    releases: Iterable[tuple[float, int]],
    needs: Iterable[tuple[float, int]],
) -> bool:
    """The Backfill test (module docstring) for one piece of work: see
    :class:`BackfillSchedule`."""
    return BackfillSchedule(now, free, releases, needs).fits(gpus, duration_s)


def replay(
    nodes: Sequence[NodeView], config: PlacementConfig, inputs: Iterable[dict]
) -> list[PlacementDecision]:
    """The decisions a fresh placer makes for recorded ``inputs`` (``placer.inputs`` of a live
    plugin or of a simulation): equal to the recorder's own ``log`` when both run this code."""
    placer = SpatiotemporalPlacer(nodes, config)
    for i, e in enumerate(inputs):
        try:
            _replay_one(placer, e)
        except (KeyError, TypeError, ValueError) as err:  # (InvalidTrace is a ValueError)
            why = str(err) if isinstance(err, InvalidTrace) else f"malformed ({err!r})"
            raise InvalidTrace(f"placement input {i} ({e!r:.120}): {why}") from err
    return placer.log


def _replay_one(placer: SpatiotemporalPlacer, e: dict) -> None:
    trace = DemandTrace.from_dict(e["trace"]) if e.get("trace") else None
    if e["event"] == "add_node":
        placer.add_node(NodeView(str(e["node"]), tuple(e["gpus"])), float(e["now"]))
    elif e["event"] == "submit":
        placer.submit(e["job"], int(e["gpus"]), float(e["now"]), trace, str(e["kind"]))
    elif e["event"] == "profiled":
        if trace is None:
            raise InvalidTrace("a 'profiled' placement input carries no trace")
        placer.profiled(e["job"], trace, float(e["now"]))
    elif e["event"] == "finish":
        placer.finish(e["job"], float(e["now"]))
    else:
        raise InvalidTrace(f"unknown placement event {e['event']!r}")
