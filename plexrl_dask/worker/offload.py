"""Offloaded replica state kept in the node's tiers instead of the worker's own memory.

A backend offloads by copying its device state to host tensors (pinned buffers on CUDA; on
the CPU the tensors themselves) as a nested dict; :class:`Stasher` writes that dict as one
version of the state store on the node's DRAM tier (the NVMe tier when DRAM has no room) and
the worker drops its copy. The backend keeps a :class:`StoredState` handle and reads the
version back on reload. What this buys:

- **one copy per node**: chunks are content-addressed, so replicas of one model on several
  workers of a node, and a frozen tensor across offloads, are stored once;
- **no rewrite of unchanged state**: a replica offloaded again without a state-changing
  request in between (a rollout replica swapped in and out) reuses its stored version;
- **deeper tiers**: under DRAM pressure the node's manager evicts offloaded state to NVMe, and
  promotes it back on a prefetch hint or a read.

Names: one store model per (deployment incarnation, worker, rank) — ``stash..<deployment>..
<uid>..<worker tag>..r<rank>`` (:func:`~plexrl_dask.state_store.keys.derived_model`), versions numbered by offload — and tensors named by their path in the
backend's dict (``params/<parameter>``, ``optim/<parameter>/exp_avg``, ...). A sharded rank
stores its local shards as they are (offloads of ranks are not collective, so there is no
moment at which the canonical tensor exists); checkpoints and weight publishing, which are
collective, write canonical regions instead (:mod:`plexrl_dask.worker.replica_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch
import xxhash

from plexrl_dask.state_store.keys import DTYPES, derived_model
from plexrl_dask.state_store.node import NodeState

logger = logging.getLogger(__name__)

_TUPLE = "__tuple__"


def _encode(value: Any) -> Any:
    """JSON for the non-tensor leaves (optimizer hyper-parameters keep their tuples)."""
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def flatten(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a backend's nested host dict into tensors by path and the JSON rest. Keys are
    paths' segments, so they must not contain ``/`` (parameter names use dots)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return {"__tensor__": path}
        if isinstance(node, dict) and all(isinstance(k, str) for k in node):
            for k in node:
                if "/" in k:
                    raise ValueError(f"state key {k!r} contains '/'")
            return {k: walk(v, f"{path}/{k}" if path else k) for k, v in node.items()}
        return _encode(node)

    skeleton = walk(state, "")
    return tensors, skeleton


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors[skeleton["__tensor__"]]
        if set(skeleton) == {_TUPLE}:
            return _decode(skeleton)
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    return _decode(skeleton)


class StoredState:
    """An offloaded state: one version in the node's tiers (see the module docstring)."""

    def __init__(
        self, node: NodeState, model: str, version: int, skeleton: Any, nbytes: int
    ) -> None:
        self.node = node
        self.model = model
        self.version = version
        self.skeleton = skeleton
        self.nbytes = nbytes
        self.source = ""  # the tier the last load read from

    def __getitem__(self, key: str) -> Any:
        """Non-tensor fields without a load (``state["bytes"]``)."""
        value = self.skeleton[key]
        if isinstance(value, dict) and "__tensor__" in value:
            raise KeyError(f"{key!r} is a tensor: load() the state")
        return _decode(value)

    def tier(self) -> str | None:
        """Where the version is now (``"dram"``, ``"nvme"``), None if gone."""
        return self.node.locate(self.model, self.version)

    def load(self, pin_memory: bool = False) -> dict[str, Any]:
        """The backend's host dict, read back (digests verified; promoted to DRAM on the way
        when it fits). ``pin_memory``: read into page-locked buffers (CUDA reloads)."""
        with self.node.pinned(self.model, self.version) as (store, where):
            manifest = store.manifest(self.model, self.version)
            outs = None
            if pin_memory:
                outs = {
                    name: torch.empty(e.shape, dtype=DTYPES[e.dtype][0], pin_memory=True)
                    for name, e in manifest.tensors.items()
                }
            # Every chunk of every tensor at once on the store's I/O threads.
            tensors = store.read_many(
                self.model, self.version, dict.fromkeys(manifest.tensors), out=outs
            )
            self.source = where["source"]
        return unflatten(self.skeleton, tensors)

    def delete(self) -> None:
        """Free the stored version (its chunks stay while another version shares them)."""
        try:
            self.node.delete(self.model, self.version)
        except Exception:  # freeing space must never fail a request
            logger.warning(
                "could not delete offloaded state %s v%d", self.model, self.version, exc_info=True
            )


class Stasher:
    """Writes one replica's offloads into the node's tiers (one per replica and worker)."""

    def __init__(self, node: NodeState, deployment: str, uid: str, worker: str, rank: int) -> None:
        tag = xxhash.xxh3_64_hexdigest(worker.encode())[:10]
        self.node = node
        self.model = derived_model("stash", deployment, uid[:12], tag, f"r{rank}")
        self._next = 1
        self._lock = threading.Lock()

    def __call__(self, state: dict[str, Any]) -> StoredState:
        """Store ``state`` as the next version; returns its handle."""
        tensors, skeleton = flatten(state)
        with self._lock:
            version, self._next = self._next, self._next + 1
        self.node.publish(self.model, version, tensors, meta={"skeleton": json.dumps(skeleton)})
        nbytes = int(
            state.get("bytes", sum(t.numel() * t.element_size() for t in tensors.values()))
        )
        return StoredState(self.node, self.model, version, skeleton, nbytes)
