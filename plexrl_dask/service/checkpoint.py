"""Checkpoints of a replica's state through torch distributed checkpoint (DCP).

``save_state(path)`` writes the model's parameters and, once it has one, the AdamW state as a
DCP checkpoint: every rank of a sharded deployment writes only its own shards, in canonical
(unsharded) coordinates, so the checkpoint loads onto any world size (DCP reshards on read).
Loading reads whole tensors on every rank and keeps what the layout needs (not yet
zero-redundancy). ``plexrl.json`` is written last, by rank 0, once every rank has finished: a directory without it
is an unfinished checkpoint and is refused. (The state store issue makes a durable version in
the store the primary checkpoint; DCP stays as the import/export format.)
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from plexrl_dask.errors import CheckpointIncompatible, CheckpointIncomplete, CheckpointNotFound

META_FILE = "plexrl.json"
FORMAT = "plexrl-dcp-1"


def _state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    return {"model": msd, "optim": osd} if optimizer is not None else {"model": msd}


def save(
    model: torch.nn.Module,
    optimizer: Any,
    path: str,
    meta: dict[str, Any],
    distributed: bool,
    writer: bool,
) -> None:
    """Write ``model`` (and ``optimizer``) to ``path``; ``writer`` (rank 0) writes the marker."""
    os.makedirs(path, exist_ok=True)
    if writer:
        # Saving over an older checkpoint: it stops being a finished one before any byte of the
        # new one is written, so a crash mid-save never leaves a "finished" mix of both.
        marker = os.path.join(path, META_FILE)
        if os.path.exists(marker):
            os.remove(marker)
    if distributed:
        torch.distributed.barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=path, no_dist=not distributed)
    if distributed:
        torch.distributed.barrier()  # every rank's shards are on disk before the marker
    if writer:
        tmp = os.path.join(path, META_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "has_optimizer": optimizer is not None, **meta}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, META_FILE))


def read_meta(path: str) -> dict[str, Any]:
    """The checkpoint's metadata, or the typed error saying why it cannot be loaded."""
    if not os.path.isdir(path):
        raise CheckpointNotFound(f"no checkpoint at {path!r}")
    marker = os.path.join(path, META_FILE)
    if not os.path.isfile(marker) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointIncomplete(
            f"{path!r} is not a finished checkpoint (no {META_FILE} / .metadata): its writer "
            "stopped before the end; use an earlier checkpoint"
        )
    with open(marker) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointIncompatible(
            f"{path!r} has format {meta.get('format')!r}, expected {FORMAT!r}"
        )
    return meta


def check_compatible(model: torch.nn.Module, path: str) -> None:
    """Refuse a checkpoint whose parameter names or (global) shapes differ from ``model``'s."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, p in model.named_parameters():
        entry = stored.get(f"model.{name}")
        if entry is None:
            raise CheckpointIncompatible(
                f"{path!r} has no parameter {name!r}: it holds another model"
            )
        if tuple(entry.size) != tuple(p.shape):
            raise CheckpointIncompatible(
                f"{name}: the checkpoint has shape {tuple(entry.size)}, the model {tuple(p.shape)}"
            )


def load(model: torch.nn.Module, optimizer: Any, path: str, place: Any) -> None:
    """Read ``path`` into ``model`` (and ``optimizer``) for any layout.

    Every process reads whole tensors (templates sized from the checkpoint's own metadata) and
    ``place(param, whole)`` turns each into what its layout holds (the local FSDP shard, or the
    tensor itself); the state store issue replaces this with zero-redundancy slice reads.
    """
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    params = dict(model.named_parameters())

    def empty(key: str) -> torch.Tensor:
        meta = stored[key]
        return torch.empty(tuple(meta.size), dtype=meta.properties.dtype)

    state: dict[str, Any] = {"model": {n: empty(f"model.{n}") for n in params}}
    if optimizer is not None:
        state["optim"] = {
            "state": {
                n: {
                    k: empty(f"optim.state.{n}.{k}")
                    for k in _OPTIM_KEYS
                    if f"optim.state.{n}.{k}" in stored
                }
                for n in params
            }
        }
    dcp.load(state, checkpoint_id=path, no_dist=True)
    with torch.no_grad():
        for n, p in params.items():
            place(p, state["model"][n].to(p.device, p.dtype))
        if optimizer is not None:
            for n, p in params.items():
                entries = state["optim"]["state"][n]
                optimizer.state[p] = {
                    k: (v if k == "step" else place_like(p, v.to(p.device)))
                    for k, v in entries.items()
                }


_OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def local_shard(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` that parameter ``p`` holds on this rank (``whole`` itself for an
    unsharded ``p``), cut with FSDP2's ``torch.chunk`` convention.

    The rank comes from ``get_local_rank`` (the live process group). Meshes of successive
    groups must not compare equal (see :mod:`..groups`): an interned mesh from an earlier group
    reported this process's old coordinate, and slicing by it took another rank's chunk."""
    if not hasattr(p, "device_mesh"):
        return whole
    part = whole
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            chunks = torch.chunk(part, p.device_mesh.size(mesh_dim), dim=placement.dim)
            index = p.device_mesh.get_local_rank(mesh_dim)
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    expected = tuple(p.to_local().shape)
    if tuple(part.shape) != expected:
        raise ValueError(
            f"local shard shape {tuple(part.shape)} does not match the parameter's {expected}"
        )
    return part


def place_like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out like parameter ``p`` (its local shard as a DTensor if ``p`` is one)."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local_shard(p, whole).clone(),
            p.device_mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
        )
    return whole.clone()
