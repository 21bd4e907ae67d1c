"""What runs in a PlexRL worker process: the replica holder and its memory budget
(:mod:`~plexrl_dask.worker.holder`), the request functions Dask runs as tasks
(:mod:`~plexrl_dask.worker.ops`), the backends (torch, FSDP2, vLLM), decoding and seeded
sampling, offload to the node's store, process groups and replica checkpoints. The Dask worker
plugin that sets a worker up is ``plugins/worker.py`` (:mod:`plexrl_dask.plugins.worker`).

Two kinds of module live here. ``ops`` (task functions) and ``holder`` (the holder's type)
are the package's face to the rest of the cluster: the scheduler deserialises every task it is
sent, which imports the module of each function by reference, so those two import neither
torch nor Zarr. Everything else is the worker's engine and imports the model stack at its top.
The face reaches the engine as attributes of this package (``worker.backends``,
``worker.stores``, ...), which import their module on first use (PEP 562, as scientific
Python's lazy loading does): on a worker, when a request needs it, never on the scheduler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plexrl_dask.worker import backends, device, groups, offload, stores

#: The engine's modules, loaded on first attribute access.
ENGINE = ("backends", "device", "groups", "offload", "stores")


def __getattr__(name: str) -> Any:
    if name in ENGINE:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["backends", "device", "groups", "offload", "stores"]
