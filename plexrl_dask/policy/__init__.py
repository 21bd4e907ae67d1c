"""The policy core: pure decisions over plain state, no Dask import.

The live scheduler plugin and (later) the simulator both call into this package, so what the
simulator evaluates is exactly what the cluster runs.
"""

from plexrl_dask.policy.assignment import WorkerView, assign_worker
from plexrl_dask.policy.residency import TIERS, ResidencyMap, ResidencyReport

__all__ = ["TIERS", "ResidencyMap", "ResidencyReport", "WorkerView", "assign_worker"]
