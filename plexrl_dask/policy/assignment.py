"""Assigning workers to a deployment: which workers host it when it is deployed (or placed
again after a worker left). "Assignment" here, to keep the word "placement" for placing jobs
into node groups over time (:mod:`plexrl_dask.policy.spatiotemporal`), and "choice" for the
dispatcher's residency-aware choice among a deployment's replicas
(:mod:`plexrl_dask.policy.dispatch`).

Rule: a worker qualifies if its whole memory budget can hold the deployment (others on it can be
offloaded to make room, so current use does not disqualify). Among qualifying workers, pick the
one with the least committed memory relative to its budget, then the fewest deployments, then the
address (deterministic): different models spread over workers instead of all thrashing one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plexrl_dask.errors import DeploymentDoesNotFit, NoPlexRLWorkers


@dataclass(frozen=True)
class WorkerView:
    """What assignment knows of a worker: its budget and what is already assigned to it."""

    address: str
    budget_bytes: int
    committed_bytes: int = 0
    num_deployments: int = 0


def assign_workers(
    name: str,
    need_bytes: int,
    workers: Sequence[WorkerView],
    count: int = 1,
    candidates: Sequence[str] | None = None,
) -> tuple[str, ...]:
    """The ``count`` distinct workers that should host deployment ``name`` (``need_bytes`` on
    each), best first.

    ``candidates``, when given, restricts the choice to those addresses (an operator pinning a
    deployment to certain machines); when all of them are needed, rank ``r`` goes to
    ``candidates[r]``. Raises :class:`NoPlexRLWorkers` when no (candidate)
    worker is available, and :class:`DeploymentDoesNotFit` when fewer than ``count`` workers'
    budgets hold ``need_bytes``.
    """
    if candidates is not None:
        allowed = set(candidates)
        unknown = sorted(allowed - {w.address for w in workers})
        if unknown:
            raise NoPlexRLWorkers(
                f"cannot place {name!r} on {unknown}: not PlexRL workers of this cluster "
                f"(known: {sorted(w.address for w in workers)})"
            )
        workers = [w for w in workers if w.address in allowed]
    if not workers:
        raise NoPlexRLWorkers(
            f"cannot place {name!r}: no worker with a PlexRL replica holder has joined. Start "
            "the cluster with plexrl_dask.local_cluster(), or install the plugins with "
            "plexrl_dask.install(client) on workers that advertise the GPU resource"
        )
    fitting = [w for w in workers if w.budget_bytes >= need_bytes]
    if not fitting:
        largest = max(w.budget_bytes for w in workers)
        raise DeploymentDoesNotFit(
            f"{name!r} needs {need_bytes / 2**20:.1f} MiB of device memory but the largest worker "
            f"budget is {largest / 2**20:.1f} MiB; use a smaller model or dtype, or raise "
            "plexrl.worker.memory-budget on workers that have the memory"
        )
    if len(fitting) < count:
        raise DeploymentDoesNotFit(
            f"{name!r} needs {count} workers with {need_bytes / 2**20:.1f} MiB each but only "
            f"{len(fitting)} of the cluster's {len(workers)} PlexRL workers can hold it; lower "
            "world_size/replicas or add workers"
        )
    if candidates is not None and count == len(fitting) == len(candidates):
        return tuple(candidates)  # every pinned worker is needed: ranks in the order given
    ranked = sorted(
        fitting,
        key=lambda w: (w.committed_bytes / w.budget_bytes, w.num_deployments, w.address),
    )
    return tuple(w.address for w in ranked[:count])


def assign_worker(
    name: str,
    need_bytes: int,
    workers: Sequence[WorkerView],
    candidates: Sequence[str] | None = None,
) -> str:
    """The one worker that should host single-rank deployment ``name`` (see
    :func:`assign_workers`)."""
    return assign_workers(name, need_bytes, workers, 1, candidates)[0]
