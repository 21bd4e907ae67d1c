"""The canonical state store (imported as ``plexrl_dask.state_store``).

- :mod:`~plexrl_dask.state_store.keys`: canonical names, the chunk grid, logical dtypes, manifests;
- :mod:`~plexrl_dask.state_store.store`: :class:`StateStore`, one tier's versions of models as
  chunked Zarr arrays over content-addressed, deduplicated chunks, published atomically; below
  it :mod:`~plexrl_dask.state_store.writer` (one writer's part of a publish),
  :mod:`~plexrl_dask.state_store.reads` (a read planned as verified chunk fetches),
  :mod:`~plexrl_dask.state_store.collection` (garbage collection of unreferenced objects),
  :mod:`~plexrl_dask.state_store.zarr_layout` (a version's Zarr layout and metadata) and
  :mod:`~plexrl_dask.state_store.objects` (the content-addressed chunk objects, verified reads);
- :mod:`~plexrl_dask.state_store.manager`: the per-node StateManager process that owns the DRAM
  and NVMe tiers (election, owner lease, the server clients call), and
  :mod:`~plexrl_dask.state_store.tiers`, its policy (reservations, pins, eviction DRAM -> NVMe,
  promotion, prefetch, collection);
- :mod:`~plexrl_dask.state_store.node`: a process's handle on its node's manager
  (:class:`NodeState`), which finds or starts it and moves bytes directly in the tiers;
- :mod:`~plexrl_dask.state_store.peer`: versions between nodes: a node imports another node's
  version from a worker there (only the objects it lacks, each checked on arrival).
"""

from plexrl_dask.state_store.node import NodeState, StateConfig, node_state
from plexrl_dask.state_store.store import StateStore

__all__ = ["NodeState", "StateConfig", "StateStore", "node_state"]
