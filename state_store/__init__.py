"""The canonical state store (imported as ``plexrl_dask.state_store``).

- :mod:`~plexrl_dask.state_store.keys`: canonical names, the chunk grid, logical dtypes, manifests;
- :mod:`~plexrl_dask.state_store.store`: :class:`StateStore`, one tier's versions of models as
  chunked Zarr arrays over content-addressed, deduplicated chunks, published atomically.

Not built yet (see the state-store issue): the per-node StateManager that owns the DRAM and
NVMe tiers (capacity, eviction DRAM -> NVMe, promotion, prefetch), and routing the holders'
offload/reload, ``save_state`` and ``sync_weights`` through the store.
"""

from plexrl_dask.state_store.store import StateStore

__all__ = ["StateStore"]
