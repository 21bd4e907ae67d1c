"""The cost ledger: what a deployment mode reserved, what it used, and what that bought.

Definitions (written before any number was looked at; docs/measurements.md, "bench.multiplex", repeats them):

- **Cost** = reserved worker-seconds. An isolated job (colocated, split, split-async) holds its
  workers for its whole wall time, and isolated jobs run one after another: the mode's cost is
  ``Σ_jobs workers_j × wall_j``. The multiplexed run holds its pool for the makespan of all
  jobs: ``pool × makespan``. Setup that every mode pays alike (deploying, loading the warm-up
  checkpoint, the first weight sync) is outside both.
- **Idle fraction** = 1 − busy ÷ reserved worker-seconds, busy being the seconds the reserved
  workers ran any request (load/reload setup included) inside the reservation.
- **Rollout-reserved worker-seconds**. Isolated: every worker the job holds for rollout, over
  the whole of each rollout phase (a phase: the run of one step's ``sample`` request, from its
  first part's start to its last part's end; ranks that finished early and wait on the long
  tail count). Multiplexed: the worker-seconds its ``sample`` requests occupied, their setup
  included (in between, those workers serve other jobs).
- **Useful rollout tokens**: every sample's tokens up to its end (stop string or EOS
  included), as the job recorded them.
- **Throughput-to-peak** = useful tokens ÷ Σ_jobs (rollout-reserved worker-seconds × the peak
  tokens/s of one worker decoding that job's model at its best batch size, same thread count,
  measured in the same run; ``bench.multiplex`` measures it right before and right after
  each layout and divides by their mean).

A diagnostic beside them, not a definition of the gain: the **CPU share** of a set of requests
is the CPU seconds their threads spent running (``RequestSpan.cpu_s``) ÷ their wall seconds
after setup. A request that waited for a core (other processes) or for the GIL (the worker's
event loop) reads below 1; comparing the rollout requests' share with the peak requests'
says how much of a to-peak shortfall is such waiting rather than the engine's work.

Everything here is pure: it takes spans and job windows and returns numbers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plexrl_dask.shared.timeline import RequestSpan, clip

ISOLATED_MODES = ("colocated", "split", "split-async")
MODES = (*ISOLATED_MODES, "multiplexed")


@dataclass(frozen=True)
class JobWindow:
    """One job's part of a mode's run: its deployments, the workers it reserved (isolated
    modes; empty when it shared a pool) and its wall-clock window."""

    job: str
    deployments: tuple[str, ...]
    sampler: str  # the deployment that samples (the policy itself when colocated)
    workers: tuple[str, ...]
    rollout_workers: tuple[str, ...]
    t0: float
    t1: float
    useful_tokens: int

    @property
    def wall_s(self) -> float:
        return self.t1 - self.t0


@dataclass(frozen=True)
class ModeLedger:
    """A mode's reservation and use: ``pool`` (multiplexed; empty for isolated modes, whose
    reservations are per job), the window of the whole run, the jobs' windows, and the
    spans that ran inside it."""

    mode: str
    jobs: tuple[JobWindow, ...]
    spans: tuple[RequestSpan, ...]
    t0: float
    t1: float
    pool: tuple[str, ...] = ()
    peak_tokens_per_s: Mapping[str, float] = field(default_factory=dict)  # by job

    @property
    def multiplexed(self) -> bool:
        return bool(self.pool)

    def reserved_worker_seconds(self) -> float:
        """The mode's cost (see the module docstring)."""
        if self.multiplexed:
            return len(self.pool) * (self.t1 - self.t0)
        return sum(len(j.workers) * j.wall_s for j in self.jobs)

    def _reserved_spans(self) -> list[tuple[RequestSpan, float]]:
        """Each span on a reserved worker with its seconds inside the reservation (the pool's
        window, or the window of the job that held the worker)."""
        if self.multiplexed:
            pool = set(self.pool)
            return clip((s for s in self.spans if s.worker in pool), self.t0, self.t1)
        out: list[tuple[RequestSpan, float]] = []
        for j in self.jobs:
            mine = set(j.workers)
            out += clip((s for s in self.spans if s.worker in mine), j.t0, j.t1)
        return out

    def busy_worker_seconds(self) -> float:
        return sum(inside for _, inside in self._reserved_spans())

    def busy_by_op(self) -> dict[str, dict[str, float | None]]:
        """Where the busy worker-seconds went: per request op, its worker-seconds inside the
        reservation (``seconds``; they sum to :meth:`busy_worker_seconds`), the setup part of
        them (``setup_seconds``) and its :func:`cpu_share` (``cpu_share``)."""
        ops: dict[str, list[tuple[RequestSpan, float]]] = {}
        for s, inside in self._reserved_spans():
            ops.setdefault(s.op, []).append((s, inside))
        return {
            op: {
                "seconds": sum(inside for _, inside in pairs),
                "setup_seconds": sum(s.setup_seconds for s, _ in pairs),
                "cpu_share": cpu_share(s for s, _ in pairs),
            }
            for op, pairs in sorted(ops.items())
        }

    def idle_fraction(self) -> float:
        reserved = self.reserved_worker_seconds()
        return 0.0 if reserved <= 0 else max(0.0, 1.0 - self.busy_worker_seconds() / reserved)

    def _spans_of(self, job: str) -> list[RequestSpan]:
        """The spans of ``job``'s deployments that started inside its window."""
        window = self._job(job)
        return [
            s
            for s in self.spans
            if s.deployment in window.deployments and window.t0 <= s.start <= window.t1
        ]

    def _samples_of(self, job: str) -> list[RequestSpan]:
        sampler = self._job(job).sampler
        return [s for s in self._spans_of(job) if s.deployment == sampler and s.op == "sample"]

    def rollout_worker_seconds(self, job: str) -> float:
        """``job``'s rollout-reserved worker-seconds (see the module docstring)."""
        if self.multiplexed:
            return sum(s.seconds for s in self._samples_of(job))
        window = self._job(job)
        held = max(1, len(window.rollout_workers))
        phases = rollout_phases(self._spans_of(job), window.sampler)
        return held * sum(end - start for start, end in phases)

    def rollout_setup_seconds(self, job: str) -> float:
        """The setup (loads and reloads before they ran) inside ``job``'s ``sample`` spans."""
        return sum(s.setup_seconds for s in self._samples_of(job))

    def rollout_cpu_share(self, job: str | None = None) -> float | None:
        """:func:`cpu_share` of ``job``'s ``sample`` requests (default: every job's)."""
        jobs = [j.job for j in self.jobs] if job is None else [job]
        return cpu_share(s for j in jobs for s in self._samples_of(j))

    def useful_tokens(self) -> int:
        return sum(j.useful_tokens for j in self.jobs)

    def throughput_to_peak(self) -> float | None:
        """Useful tokens ÷ what the rollout-reserved time could have decoded at peak; None
        without peak measurements."""
        if not self.peak_tokens_per_s:
            return None
        capacity = sum(
            self.rollout_worker_seconds(j.job) * self.peak_tokens_per_s[j.job] for j in self.jobs
        )
        return None if capacity <= 0 else self.useful_tokens() / capacity

    def isolated_cost_lower_bound(self, workers_per_job: int | Mapping[str, int] = 1) -> float:
        """What the jobs would at least have cost run alone, one after another, each holding
        ``workers_per_job`` workers (1: colocated; 2: split; by job name: each job its own
        training group, plus a rollout worker for split): ``Σ_jobs`` that many × the seconds
        in which any request of the job ran. A synchronous job's requests follow one another,
        and an isolated job holds its workers also while its driver scores and between
        requests, so its real cost is higher."""
        out = 0.0
        for j in self.jobs:
            total = 0.0
            mine = sorted(
                (s.start, s.end)
                for s in self.spans
                if s.deployment in j.deployments and s.end > j.t0 and s.start < j.t1
            )
            end = float("-inf")
            for a, b in mine:  # the union of the job's spans
                a, b = max(a, j.t0, end), min(b, j.t1)
                if b > a:
                    total += b - a
                end = max(end, b)
            held = workers_per_job if isinstance(workers_per_job, int) else workers_per_job[j.job]
            out += held * total
        return out

    def makespan(self) -> float:
        return self.t1 - self.t0

    def blocked_seconds(self, job: str) -> float:
        """How long ``job`` waited on other jobs: between one run of its requests (its
        spans on any worker, merged) and the next, the seconds in which another job's request
        ran on a worker that the next run's first requests (those that started while its
        first one ran: a gang's ranks) took. In a pool a request starts
        only once its workers are free, so this bounds from above the time its chain was
        held up by the others' requests (spans do not say when a request arrived: driver
        work done while the others ran counts too); in an isolated mode it is 0. The rest
        of a gap is the driver's own work and dispatch."""
        mine = sorted(self._spans_of(job), key=lambda s: s.start)
        names = set(self._job(job).deployments)
        others = [s for s in self.spans if s.deployment not in names]
        # [start, end, end of its first request, workers of the requests that started
        # while that one ran: a gang's ranks start within moments of each other]
        runs: list[list[Any]] = []
        for s in mine:
            if runs and s.start <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], s.end)
                if s.start < runs[-1][2]:
                    runs[-1][3].add(s.worker)
            else:
                runs.append([s.start, s.end, s.end, {s.worker}])
        total = 0.0
        for (_, end, _, _), (start, _, _, workers) in zip(runs, runs[1:], strict=False):
            held = sorted(
                (max(end, s.start), min(start, s.end))
                for s in others
                if s.worker in workers and s.end > end and s.start < start
            )
            reach = end
            for a, b in held:  # their union
                a = max(a, reach)
                if b > a:
                    total += b - a
                reach = max(reach, b)
        return total

    def _job(self, job: str) -> JobWindow:
        for j in self.jobs:
            if j.job == job:
                return j
        raise KeyError(job)

    def summary(self) -> dict[str, Any]:
        """The mode's numbers, and per job its rollout-reserved worker-seconds, useful tokens
        and throughput-to-peak (where peaks were measured)."""
        per_job = {}
        for j in self.jobs:
            seconds = self.rollout_worker_seconds(j.job)
            peak = self.peak_tokens_per_s.get(j.job)
            per_job[j.job] = {
                "rollout_worker_seconds": seconds,
                "rollout_setup_seconds": self.rollout_setup_seconds(j.job),
                "useful_tokens": j.useful_tokens,
                "throughput_to_peak": j.useful_tokens / (seconds * peak)
                if peak and seconds > 0
                else None,
                "rollout_cpu_share": self.rollout_cpu_share(j.job),
            }
        return {
            "cost_worker_seconds": self.reserved_worker_seconds(),
            "busy_worker_seconds": self.busy_worker_seconds(),
            "idle_fraction": self.idle_fraction(),
            "makespan_s": self.makespan(),
            "useful_tokens": self.useful_tokens(),
            "rollout_worker_seconds": sum(v["rollout_worker_seconds"] for v in per_job.values()),
            "throughput_to_peak": self.throughput_to_peak(),
            "rollout_cpu_share": self.rollout_cpu_share(),
            "busy_by_op": self.busy_by_op(),
            "jobs": per_job,
        }


def cpu_share(spans: Iterable[RequestSpan]) -> float | None:
    """CPU seconds ÷ wall seconds after setup, summed over the ``spans`` that measured their
    CPU time (see the module docstring); None when none did or they ran no time."""
    cpu = wall = 0.0
    for s in spans:
        if s.cpu_s is not None:
            cpu += s.cpu_s
            wall += s.run_seconds
    return cpu / wall if wall > 0 else None


def rollout_phases(spans: Iterable[RequestSpan], sampler: str) -> list[tuple[float, float]]:
    """The rollout phases of the deployment ``sampler``: maximal runs of its ``sample``
    spans, in start order, with none of its other requests (a weight load, a scoring pass, a
    training step when it samples for itself) starting in between; each phase is ``(first
    start, last end)``."""
    phases: list[tuple[float, float]] = []
    current: tuple[float, float] | None = None
    for s in sorted((s for s in spans if s.deployment == sampler), key=lambda s: s.start):
        if s.op == "sample":
            current = (s.start, s.end) if current is None else (current[0], max(current[1], s.end))
        elif current is not None:
            phases.append(current)
            current = None
    if current is not None:
        phases.append(current)
    return phases


def longest_job_bound(colocated: ModeLedger, pool: int) -> tuple[str, float]:
    """The job with the longest wall time when colocated, and what a pool of ``pool``
    workers would cost if that job ran there as fast as alone and the others' requests all
    fit around it: ``max(pool × its wall, the colocated busy worker-seconds)``. With a fixed
    set of synchronous jobs the pool holds its workers until the last job ends, so unless
    the pool makes that job itself faster (a rollout replica instead of its hybrid engine),
    its cost is not below this. A diagnostic, not a floor: see ``blocked_seconds``."""
    longest = max(colocated.jobs, key=lambda j: (j.wall_s, j.job))
    return longest.job, max(pool * longest.wall_s, colocated.busy_worker_seconds())


def where_cost_goes(pool: ModeLedger, colocated: ModeLedger) -> dict[str, Any]:
    """Where a pool's cost goes against colocated's, for a fixed set of jobs (both benchmarks
    of mixes report it): ``longest_job`` and ``longest_job_bound_ratio_vs_colocated``
    (:func:`longest_job_bound` ÷ colocated's cost); ``longest_job_wall_ratio``, the pool's
    makespan ÷ that job's colocated wall; ``longest_job_blocked_s``
    (:meth:`ModeLedger.blocked_seconds`); ``busy_ratio_vs_colocated``, the pool's busy
    worker-seconds ÷ colocated's (the same requests, slower where they share the cores with
    more); and ``no_idle_cost_ratio_vs_colocated``, the pool's busy worker-seconds ÷
    colocated's cost: what the pool would cost with no idle time at all, its requests as slow
    as they ran (cost ratio = this ÷ (1 − pool idle))."""
    longest, bound = longest_job_bound(colocated, len(pool.pool))
    cost = colocated.reserved_worker_seconds()
    return {
        "longest_job": longest,
        "longest_job_bound_ratio_vs_colocated": bound / cost,
        "busy_ratio_vs_colocated": pool.busy_worker_seconds() / colocated.busy_worker_seconds(),
        "no_idle_cost_ratio_vs_colocated": pool.busy_worker_seconds() / cost,
        "longest_job_wall_ratio": pool.makespan() / colocated._job(longest).wall_s,
        "longest_job_blocked_s": pool.blocked_seconds(longest),
    }


def cost_ratio(multiplexed: ModeLedger, baseline: ModeLedger) -> float:
    """Multiplexed cost ÷ a baseline's (below 1: multiplexing is cheaper)."""
    return multiplexed.reserved_worker_seconds() / baseline.reserved_worker_seconds()


def seed_difference(baseline: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """Compare one result (e.g. final reward) of two algorithms over seeds: the difference of
    the means (``other - baseline``), its standard error (independent samples:
    ``sqrt(s_a² / n_a + s_b² / n_b)``) and whether the difference is within two of them.
    Needs at least two seeds per side.

    When both sides ran the same seeds in the same order (equal lengths), the seed-by-seed
    view is reported as well: the standard error of the mean of the paired differences,
    whether the difference is within two of those, and how many pairs went each way. Pairs
    share their problems and first samples, so this view sees a small effect that the
    spread between seeds hides."""
    if min(len(baseline), len(other)) < 2:
        raise ValueError("a standard error needs at least two seeds per side")
    diff = statistics.fmean(other) - statistics.fmean(baseline)
    se = math.sqrt(
        statistics.variance(baseline) / len(baseline) + statistics.variance(other) / len(other)
    )
    out: dict[str, Any] = {
        "baseline": list(baseline),
        "other": list(other),
        "difference": diff,
        "standard_error": se,
        "within_2se": abs(diff) <= 2 * se,
    }
    if len(baseline) == len(other):
        pairs = [o - b for b, o in zip(baseline, other, strict=True)]
        paired_se = statistics.stdev(pairs) / math.sqrt(len(pairs))
        out.update(
            paired_standard_error=paired_se,
            paired_within_2se=abs(diff) <= 2 * paired_se,
            pairs_higher=sum(d > 0 for d in pairs),
            pairs_lower=sum(d < 0 for d in pairs),
        )
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by the nearest-rank rule."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 1))))
    return float(ordered[rank - 1])
