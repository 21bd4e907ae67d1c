"""The cyclic time horizon: a job's periodic demand, and a node group's load over one period.

An RL job repeats one iteration: rollout on ``r`` GPUs (a bulk phase, then a long tail in which
only a few replicas still generate), weight sync, training on ``t`` GPUs, perhaps a gap. A
:class:`DemandTrace` is that iteration as the GPUs it holds over time, repeating every
``period_s``. A node group looks at all of its jobs over one period ``H`` of its
:class:`Horizon`, cut into ``slots`` equal slots; a job's demand there is its *profile*: per slot,
the most GPUs it holds at any moment of that slot (conservative: a profile never under-states
the demand it stands for).

Periods rarely match. A job whose period ``P`` differs from the group's ``H`` is *locked* to a
period that does: ``m * H`` for the smallest integer ``m`` with ``m * H >= P`` when ``P > H``,
else ``H / m`` for the largest ``m`` with ``H / m >= P`` (so it runs ``m`` iterations per
horizon). The difference is a gap the job waits out each iteration: its *padding*, which the
placement scores. A locked period longer than ``H`` covers several horizons; its profile is the
slot-wise maximum over them (at any moment the job is in exactly one of them, so the maximum
bounds its demand).

Pure: numpy only, no Dask.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plexrl_dask.errors import InvalidTrace

#: Phase kinds of an iteration, in the order an on-policy iteration runs them.
PHASE_KINDS = ("sync", "rollout", "tail", "train", "gap")

_EPS = 1e-9


@dataclass(frozen=True)
class Phase:
    """``gpus`` GPUs held for ``duration_s`` seconds (``gpus`` may be 0 for a gap)."""

    kind: str
    gpus: int
    duration_s: float

    def __post_init__(self) -> None:
        if self.kind not in PHASE_KINDS:
            raise InvalidTrace(f"phase kind {self.kind!r} is not one of {PHASE_KINDS}")
        if self.gpus < 0 or not math.isfinite(self.duration_s) or self.duration_s < 0:
            raise InvalidTrace(
                f"a {self.kind} phase needs gpus >= 0 and a finite duration >= 0, got "
                f"gpus={self.gpus}, duration_s={self.duration_s}"
            )


@dataclass(frozen=True)
class DemandTrace:
    """One iteration of a job as GPUs held over time; it repeats every ``period_s``.

    ``period_s`` defaults to the phases' total duration and may be longer (a gap at the end).
    """

    phases: tuple[Phase, ...]
    period_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.phases:
            raise InvalidTrace("a demand trace needs at least one phase")
        busy = sum(p.duration_s for p in self.phases)
        if busy <= 0:
            raise InvalidTrace("a demand trace must last longer than 0 s")
        if self.period_s == 0.0:
            object.__setattr__(self, "period_s", busy)
        if not math.isfinite(self.period_s) or self.period_s < busy - _EPS:
            raise InvalidTrace(
                f"period_s={self.period_s} is shorter than the phases it repeats ({busy} s)"
            )

    @property
    def peak_gpus(self) -> int:
        """The most GPUs the job holds at any moment."""
        return max(p.gpus for p in self.phases)

    @property
    def gpu_seconds(self) -> float:
        """GPU-seconds one iteration holds."""
        return sum(p.gpus * p.duration_s for p in self.phases)

    def intervals(self) -> list[tuple[float, float, int]]:
        """``(start, end, gpus)`` of each phase within one period, in order."""
        out, t = [], 0.0
        for p in self.phases:
            out.append((t, t + p.duration_s, p.gpus))
            t += p.duration_s
        return out

    def to_dict(self) -> dict:
        return {
            "period_s": self.period_s,
            "phases": [[p.kind, p.gpus, p.duration_s] for p in self.phases],
        }

    @classmethod
    def from_dict(cls, d: dict) -> DemandTrace:
        try:
            phases = tuple(Phase(str(k), int(g), float(s)) for k, g, s in d["phases"])
            return cls(phases, float(d.get("period_s", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidTrace(f"not a demand trace ({e!r}): {d!r}"[:300]) from e

    @classmethod
    def from_iterations(
        cls, iterations: Sequence[Sequence[Phase]], quantile: float = 0.9
    ) -> DemandTrace:
        """The trace a placement reserves for a job whose recorded iterations are given.

        Iterations must have the same phase kinds in the same order (the job's structure);
        each phase lasts the ``quantile`` of its recorded durations and holds the most GPUs it
        was recorded with. A higher quantile reserves the long tail too (fewer overruns into
        other jobs' windows, less room for them).
        """
        if not iterations:
            raise InvalidTrace("no recorded iterations to build a trace from")
        if not 0.0 < quantile <= 1.0:
            raise InvalidTrace(f"quantile must be in (0, 1], got {quantile}")
        kinds = [p.kind for p in iterations[0]]
        for it in iterations:
            if [p.kind for p in it] != kinds:
                raise InvalidTrace(
                    f"recorded iterations differ in structure: {kinds} vs {[p.kind for p in it]}"
                )
        phases = []
        for i, kind in enumerate(kinds):
            durations = np.array([it[i].duration_s for it in iterations])
            gpus = max(it[i].gpus for it in iterations)
            phases.append(Phase(kind, gpus, float(np.quantile(durations, quantile))))
        return cls(tuple(phases))


@dataclass(frozen=True)
class Horizon:
    """A node group's cyclic view of time: period ``period_s`` cut into ``slots`` slots."""

    period_s: float
    slots: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s > 0) or self.slots < 1:
            raise InvalidTrace(
                f"a horizon needs period_s > 0 and slots >= 1, got {self.period_s}, {self.slots}"
            )

    @property
    def slot_s(self) -> float:
        return self.period_s / self.slots

    def locked_period(self, period_s: float) -> float:
        """The period a job of period ``period_s`` runs at in this horizon (module docstring)."""
        h = self.period_s
        if period_s > h * (1 + 1e-6):
            return math.ceil(period_s / h - 1e-6) * h
        return h / max(1, math.floor(h / period_s + 1e-6))

    def padding(self, period_s: float) -> float:
        """Slowdown of a job locked to this horizon: locked period / own period (>= 1)."""
        return self.locked_period(period_s) / period_s

    def slot_of(self, t: float, epoch: float) -> int:
        """The slot that absolute time ``t`` falls in, for a horizon that started at ``epoch``."""
        return int(((t - epoch) % self.period_s) // self.slot_s) % self.slots

    def profile(self, trace: DemandTrace) -> np.ndarray:
        """GPUs per slot of ``trace`` locked to this horizon, starting at slot 0 (int64)."""
        locked = self.locked_period(trace.period_s)
        span = max(locked, self.period_s)
        n = round(span / self.slot_s)
        out = np.zeros(n, dtype=np.int64)
        ivs = trace.intervals()
        # one iteration every `locked` seconds over the span (a locked period shorter than H
        # repeats within it)
        for k in range(max(1, round(span / locked))):
            base = k * locked
            for start, end, gpus in ivs:
                if gpus == 0 or end - start <= _EPS:
                    continue
                a = int((base + start) / self.slot_s + _EPS)
                b = math.ceil((base + end) / self.slot_s - _EPS)
                out[a:b] = np.maximum(out[a:b], gpus)
        return out.reshape(-1, self.slots).max(axis=0)

    def flat(self, gpus: int) -> np.ndarray:
        """A profile holding ``gpus`` in every slot (a dedicated reservation)."""
        return np.full(self.slots, gpus, dtype=np.int64)


#: How the runtime's ops map onto phase kinds (ops not listed are not part of a job's trace).
OP_PHASES = {
    "sample": "rollout",
    "forward": "train",  # reference / old-policy log-probabilities, on the training side
    "forward_backward": "train",
    "optim_step": "train",
    "train_step": "train",
    "publish_weights": "sync",
    "load_weights": "sync",
    "load_adapter": "sync",
}
#: Ops that are a whole iteration in one request (``sample_train``: a colocated GRPO step's
#: sampling then training on the same worker). The scheduler does not see where one half
#: ends, so such an iteration records a rollout of no duration and a training phase over the
#: request: its demand (the same workers, throughout) is what the two requests' would be.
WHOLE_ITERATION_OPS = frozenset({"sample_train"})


class TraceRecorder:
    """Turns a job's completed requests into iterations of phases (the live runtime's side of
    two-phase placement; the simulator records the same :class:`Phase` tuples).

    An iteration is the ops from one rollout to the next: a ``rollout`` op after a ``train``
    op starts a new one. Within an iteration, each kind becomes one phase lasting from its
    first op's start to its last op's end, holding as many GPUs as distinct workers ran it,
    in the order the kinds first appeared. An iteration is complete when the next one starts.
    """

    def __init__(self, keep: int = 64) -> None:
        self._current: list[tuple[str, str, float, float]] = []  # (kind, worker, start, end)
        self.iterations: deque[tuple[Phase, ...]] = deque(maxlen=keep)  # the most recent

    def add(self, op: str, worker: str, start: float, end: float) -> bool:
        """Record one request (one rank of it); True if it completed an iteration."""
        if op in WHOLE_ITERATION_OPS and end >= start:
            done = self.add("sample", worker, start, start)
            self._current.append(("train", worker, start, end))
            return done
        kind = OP_PHASES.get(op)
        if kind is None or end < start:
            return False
        done = False
        if kind == "rollout" and any(k == "train" for k, *_ in self._current):
            self.iterations.append(self._phases(self._current))
            self._current = []
            done = True
        self._current.append((kind, worker, start, end))
        return done

    @staticmethod
    def _phases(records: list[tuple[str, str, float, float]]) -> tuple[Phase, ...]:
        order: list[str] = []
        for kind, *_ in records:
            if kind not in order:
                order.append(kind)
        out = []
        for kind in order:
            rs = [r for r in records if r[0] == kind]
            span = max(r[3] for r in rs) - min(r[2] for r in rs)
            out.append(Phase(kind, len({r[1] for r in rs}), span))
        return tuple(out)

    def trace(self, count: int, quantile: float) -> DemandTrace | None:
        """The trace of the last ``count`` complete iterations (None until there are that
        many with one structure)."""
        its = list(self.iterations)[-count:]
        if len(its) < count or len({tuple(p.kind for p in it) for it in its}) != 1:
            return None
        return DemandTrace.from_iterations(its, quantile)
