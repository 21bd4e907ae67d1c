"""Isolated baselines: each job on private GPUs, FIFO with EASY backfill of whole jobs.

A job's iteration on its own GPUs, per deployment mode (``r`` rollout and ``t`` training GPUs,
``s`` the weight-sync time, ``L`` the time to move the training state between HBM and host):

- ``colocated`` on ``g`` GPUs: rollout on all of them, training offloaded to host during
  rollout and back (``2 L``), weights resharded to the rollout layout (``s``), then training:
  ``rollout_g + w + 2 L + s + train``. A job with a described rollout
  (:mod:`plexrl_dask.sim.decode`) is colocated on its training group (``g = t``) and
  ``rollout_g`` is the decode model's time at the batch each of those GPUs holds; otherwise
  ``g = max(r, t)`` and ``rollout_g = bulk * r / g + tail`` (the bulk shortened in proportion,
  the tail not: the longest response takes as long whatever the batch).
- ``split`` on ``r + t`` GPUs: ``s + bulk + tail + w + train`` (each pool idles while the other
  works).
- ``split-async`` (staleness 1) on ``r + t`` GPUs: rollout of step ``i + 1`` overlaps training of
  step ``i``: ``max(s + bulk + tail + w, train)``.

``w`` is the tool waits on the step's critical path (agentic jobs; 0 otherwise): the rollout's
GPUs hold through them.

``isolated`` gives each job the mode with the fewest GPU-seconds (its own best).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from plexrl_dask.sim.simulator import GpuLedger, JobOutcome, SimOutcome
from plexrl_dask.sim.workload import ClusterSpec, SimJob

logger = logging.getLogger(__name__)

MODES = ("colocated", "split", "split-async")


@dataclass(frozen=True)
class IsolatedRun:
    """A job alone on private GPUs in one mode."""

    mode: str
    gpus: int
    duration_s: float

    @property
    def gpu_seconds(self) -> float:
        return self.gpus * self.duration_s


def iteration_times(job: SimJob, mode: str, cluster: ClusterSpec) -> np.ndarray:
    """Seconds of each of ``job``'s iterations in ``mode`` (module docstring)."""
    r, t, s = job.rollout_gpus, job.train_gpus, job.sync_s
    w = 0.0 if job.stall is None else job.stall
    if mode == "colocated":
        g = job.colocated_gpus
        move = job.train_bytes_per_gpu * t / g / (cluster.h2d_gbps * 1e9)
        rollout = job.bulk * r / g + job.tail if job.coloc_rollout is None else job.coloc_rollout
        return rollout + w + 2 * move + s + job.train
    if mode == "split":
        return s + job.bulk + job.tail + w + job.train
    if mode == "split-async":
        return np.maximum(s + job.bulk + job.tail + w, job.train)
    raise ValueError(f"unknown mode {mode!r}")


def isolated_run(job: SimJob, mode: str, cluster: ClusterSpec) -> IsolatedRun:
    """``job`` alone in ``mode`` (``"best"``: its cheapest mode in GPU-seconds)."""
    if mode == "best":
        return min((isolated_run(job, m, cluster) for m in MODES), key=lambda x: x.gpu_seconds)
    gpus = job.colocated_gpus if mode == "colocated" else (job.rollout_gpus + job.train_gpus)
    return IsolatedRun(mode, gpus, float(iteration_times(job, mode, cluster).sum()))


def fastest_s(job: SimJob, cluster: ClusterSpec) -> float:
    """``job``'s shortest isolated run on an empty cluster (the reference of its slowdown)."""
    return min(isolated_run(job, m, cluster).duration_s for m in MODES)


def simulate_isolated(
    jobs: list[SimJob], cluster: ClusterSpec, policy: str, progress: bool = False
) -> SimOutcome:
    """FIFO + EASY backfill over private allocations (module docstring of
    :mod:`plexrl_dask.sim.simulator`)."""
    mode = "best" if policy == "isolated" else policy
    runs = [isolated_run(j, mode, cluster) for j in jobs]
    ends: dict[str, list[float]] = {}
    ideal = [fastest_s(j, cluster) for j in jobs]
    ledger = GpuLedger(cluster)
    free = np.ones(cluster.gpus, dtype=bool)
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
    arrivals = [(jobs[i].arrival_s, i) for i in order]
    queue: list[int] = []
    running: list[tuple[float, int]] = []  # (end, job) heap
    held: dict[int, np.ndarray] = {}
    start = [0.0] * len(jobs)
    outcomes: list[JobOutcome | None] = [None] * len(jobs)
    events = 0
    a = 0
    bar = tqdm(total=len(jobs), desc=policy, disable=not progress, leave=False)

    def launch(i: int, now: float) -> None:
        gids = np.flatnonzero(free)[: runs[i].gpus]
        free[gids] = False
        ledger.take(i, gids)
        held[i] = gids
        start[i] = now
        heapq.heappush(running, (now + runs[i].duration_s, i))

    def schedule(now: float) -> None:
        n_free = int(free.sum())
        while queue and runs[queue[0]].gpus <= n_free:
            i = queue.pop(0)
            launch(i, now)
            n_free -= runs[i].gpus
        if not queue:
            return
        # EASY: the head's reserved start (shadow) and the GPUs spare at that time
        need = runs[queue[0]].gpus
        avail, shadow = n_free, float("inf")
        for end, i in sorted(running):
            avail += runs[i].gpus
            if avail >= need:
                shadow = end
                break
        extra = avail - need
        for i in list(queue[1:]):
            g = runs[i].gpus
            if g > n_free:
                continue
            ends_before = now + runs[i].duration_s <= shadow
            if ends_before or g <= extra:
                queue.remove(i)
                launch(i, now)
                n_free -= g
                if not ends_before:
                    extra -= g

    while a < len(arrivals) or running:
        next_arrival = arrivals[a][0] if a < len(arrivals) else float("inf")
        if running and running[0][0] <= next_arrival:
            now, i = heapq.heappop(running)
            ledger.give(held[i], start[i], now)
            free[held.pop(i)] = True
            its = iteration_times(jobs[i], runs[i].mode, cluster)
            ends[jobs[i].name] = (start[i] + np.cumsum(its)).tolist()
            outcomes[i] = JobOutcome(
                jobs[i].name, jobs[i].arrival_s, start[i], now,
                runs[i].gpu_seconds, ideal[i],
            )  # fmt: skip
            bar.update()
        else:
            now, i = arrivals[a]
            a += 1
            queue.append(i)
        events += 1
        schedule(now)
    bar.close()
    done = [o for o in outcomes if o is not None]
    assert len(done) == len(jobs), "every job runs: each fits the cluster alone"
    held_s = sum(r.gpu_seconds for r in runs)
    return SimOutcome(
        policy=policy,
        jobs=done,
        held_gpu_seconds=held_s,
        busy_gpu_seconds=ledger.busy_gpu_seconds,
        double_bookings=ledger.double_bookings,
        events=events,
        wall_s=0.0,
        heatmap=ledger.heatmap(max(o.end_s for o in done)),
        bin_s=ledger.bin_s,
        iteration_ends=ends,
    )
