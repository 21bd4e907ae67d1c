"""Checkpoints of a replica's state: versions of a state store, and torch DCP.

**Store checkpoints** (the primary format; ``save_state()``): parameters and optimizer
moments are published as one durable version of a state store (the node's NVMe tier, or a
store on a shared filesystem), every rank writing only its own shard regions in canonical
coordinates and rank 0 committing once all have: the version becomes visible atomically,
after every byte is fsynced. Loading reads only the regions a rank's layout holds, so a
checkpoint written at one world size loads at any other without a rank materialising a tensor
it does not own.

**DCP** (``save_state(path, format="dcp")``), import/export for interoperability:

``save_state(path)`` writes the model's parameters and, once it has one, the AdamW state as a
DCP checkpoint: every rank of a sharded deployment writes only its own shards, in canonical
(unsharded) coordinates, so the checkpoint loads onto any world size (DCP reshards on read).
Loading reads whole tensors on every rank and keeps what the layout needs (not yet
zero-redundancy). ``plexrl.json`` is written last, by rank 0, once every rank has finished,
with the SHA-256 of every other file of the checkpoint: a directory without it is an
unfinished checkpoint and is refused.

**Pickle.** DCP's ``.metadata`` file is a pickle: unpickling it runs whatever code its writer
put there, and DCP carries no checksums. So a DCP import first checks that the directory and
its files belong to the user the worker runs as and are writable by no one else, then every
file against the digests of ``plexrl.json``, all before DCP reads a byte: a file changed since
the export (a flipped byte, a swapped ``.metadata``) or added to it is
:class:`CheckpointCorrupt`. That protects against damage and against other users, not
against whoever wrote the checkpoint: import DCP checkpoints you (or a job you trust) wrote.
Store checkpoints hold no pickle (JSON manifests and raw tensor bytes checked against their
content digests), and loading one never unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from plexrl_dask.errors import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointIncomplete,
    CheckpointNotFound,
    PermissionDenied,
    VersionNotFound,
)
from plexrl_dask.state_store.keys import DTYPES, ROW_SPLITS, split_dims_from_tp_plan
from plexrl_dask.state_store.store import StateStore, VersionWriter

META_FILE = "plexrl.json"
FORMAT = "plexrl-dcp-2"  # (1: without the digests of its files)


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
        digests = {name: _sha256(os.path.join(path, name)) for name in _files(path)}
        tmp = os.path.join(path, META_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(
                {
                    "format": FORMAT,
                    "has_optimizer": optimizer is not None,
                    **meta,
                    "digests": digests,
                },
                f,
            )
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
    _check_private(path)
    try:
        with open(marker) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorrupt(f"{marker!r} is not the JSON PlexRL wrote: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointIncompatible(
            f"{path!r} has format {found!r}, expected {FORMAT!r} (a checkpoint of format "
            "plexrl-dcp-1 carries no digests: load it where it was written and export it again)"
        )
    _check_digests(path, meta.get("digests"))
    return meta


def _files(path: str) -> list[str]:
    """The checkpoint's files besides the marker (relative names, sorted)."""
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel not in (META_FILE, META_FILE + ".tmp"):
                out.append(rel)
    return sorted(out)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _check_private(path: str) -> None:
    """:class:`PermissionDenied` unless ``path``, its files and its subdirectories belong to
    the user this process runs as and no one else may write them (another local user could
    otherwise plant a pickle for this worker to run)."""
    uid = os.geteuid()
    for root, dirs, names in os.walk(path):
        for entry in [root, *(os.path.join(root, n) for n in dirs + names)]:
            st = os.lstat(entry)
            if st.st_uid != uid or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
                raise PermissionDenied(
                    f"{entry!r} is not this worker's own (uid {st.st_uid}, mode "
                    f"{stat.filemode(st.st_mode)}; a link, or writable by others): a DCP "
                    "checkpoint's metadata is a pickle, so one is imported only from a "
                    "directory its user alone can write"
                )


def _check_digests(path: str, digests: Any) -> None:
    """Every file of the checkpoint as exported: the same names, each with its digest."""
    if not isinstance(digests, dict):
        raise CheckpointCorrupt(f"{path!r}: its {META_FILE} lists no digests")
    present = _files(path)
    if sorted(digests) != present:
        extra = sorted(set(present) - set(digests))
        missing = sorted(set(digests) - set(present))
        raise CheckpointCorrupt(
            f"{path!r} does not hold the files it was exported with (added: {extra[:5]}, "
            f"missing: {missing[:5]})"
        )
    for name in present:
        if _sha256(os.path.join(path, name)) != digests[name]:
            raise CheckpointCorrupt(
                f"{os.path.join(path, name)!r} changed since the export (its SHA-256 differs "
                f"from {META_FILE}'s); nothing of it was read"
            )


def check_compatible(model: torch.nn.Module, path: str) -> None:
    """Refuse a checkpoint whose parameter names or (global) shapes differ from ``model``'s."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    shapes = {
        k.removeprefix("model."): tuple(v.size) for k, v in stored.items() if k.startswith("model.")
    }
    _check_parameters(model, shapes, repr(path))


#: The model configuration's fields that say how its weights are read: two models whose
#: parameters have the same names and shapes can still differ in these (4 heads of 32 or 8
#: of 16 in a 128-wide layer), and a checkpoint of one would load into the other unnoticed.
ARCHITECTURE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "hidden_act",
    "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_bias", "mlp_bias",
)  # fmt: skip


def architecture(model: torch.nn.Module) -> dict[str, Any]:
    """``model``'s :data:`ARCHITECTURE_KEYS` that its configuration has (as JSON keeps them)."""
    config = getattr(model, "config", None)
    raw = config.to_dict() if hasattr(config, "to_dict") else {}
    return {
        k: raw[k]
        for k in ARCHITECTURE_KEYS
        if isinstance(raw.get(k), (str, int, float, bool)) and raw[k] is not None
    }


def check_architecture(model: torch.nn.Module, meta: dict[str, Any], where: str) -> None:
    """:class:`CheckpointIncompatible` where the checkpoint's recorded architecture (its
    ``meta``; none in one written before it was recorded) differs from ``model``'s in a field
    both have."""
    stored = meta.get("architecture")
    if not isinstance(stored, dict):
        return
    mine = architecture(model)
    differ = sorted(k for k in stored.keys() & mine.keys() if stored[k] != mine[k])
    if differ:
        shown = ", ".join(f"{k} {stored[k]!r} (this model {mine[k]!r})" for k in differ)
        raise CheckpointIncompatible(f"{where} is of another architecture: {shown}")


def _check_parameters(
    model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], where: str
) -> None:
    """Every parameter of ``model`` is in ``shapes`` (a checkpoint's) with its shape."""
    for name, p in model.named_parameters():
        shape = shapes.get(name)
        if shape is None:
            raise CheckpointIncompatible(
                f"{where} has no parameter {name!r}: it holds another model"
            )
        if tuple(shape) != tuple(p.shape):
            raise CheckpointIncompatible(
                f"{name}: the checkpoint has shape {tuple(shape)}, the model {tuple(p.shape)}"
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
        return DTensor.from_local(
            local_shard(p, whole).clone(),
            p.device_mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
        )
    return whole.clone()


# --- checkpoints as versions of a state store (the primary format) ---------------------------

STORE_FORMAT = "plexrl-store-1"


@dataclass(frozen=True)
class StoreCheckpoint:
    """A checkpoint that is one version of a state store: ``model`` version ``version``
    (``None`` when loading: the latest) of ``store``."""

    store: StateStore
    model: str
    version: int | None = None
    #: The node's manager when ``store`` is one of its tiers (``tier``): commits then hold a
    #: reservation like writes do (assembling chunks stores objects too).
    node: Any = None
    tier: str | None = None
    #: The deployment whose state this is (its registered name, ``name@job``): recorded in
    #: the version's metadata, so that a load into another job's deployment can be refused.
    deployment: str | None = None

    def commit(
        self, version: int, publish_id: str, expected_parts: int, meta: dict[str, Any]
    ) -> Any:
        if self.deployment is not None:
            meta = {**meta, "deployment": self.deployment}
        if self.node is not None:
            return self.node.commit(
                self.tier, self.model, version, publish_id, expected_parts, meta
            )
        return self.store.commit(
            self.model, version, publish_id, expected_parts=expected_parts, meta=meta
        )


def shard_region(p: torch.Tensor) -> tuple[slice, ...] | None:
    """The region of the canonical (unsharded) tensor that ``p``'s local part holds, by
    FSDP2's ``torch.chunk`` convention; None for an unsharded tensor (all of it)."""
    if not hasattr(p, "device_mesh"):
        return None
    region = [slice(None)] * p.dim()
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            d = placement.dim
            n = p.shape[d]
            ways = p.device_mesh.size(mesh_dim)
            size = -(-n // ways)
            start = min(p.device_mesh.get_local_rank(mesh_dim) * size, n)
            region[d] = slice(start, min(start + size, n))
    expected = tuple(p.to_local().shape)
    got = tuple(len(range(*s.indices(n))) for s, n in zip(region, p.shape, strict=True))
    if got != expected:
        raise ValueError(f"shard region {region} has shape {got}, the local shard {expected}")
    return tuple(region)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def split_dims(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Per parameter name, the dims tensor-parallel readers split besides rows, from the
    model's own tensor-parallel plan (Hugging Face's ``base_model_tp_plan``); parameters not
    listed are split by rows only. This chooses each tensor's chunk grid in the store
    (:mod:`~plexrl_dask.state_store.keys`)."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    plan.update(getattr(model, "_tp_plan", None) or {})
    return split_dims_from_tp_plan([n for n, _ in model.named_parameters()], plan)


@dataclass(frozen=True)
class Entry:
    """One tensor a rank writes into a version: its local ``data``, the ``region`` of the
    canonical tensor of full ``shape`` it is (None: all of it), and its chunk-grid hint."""

    name: str
    data: torch.Tensor
    region: tuple[slice, ...] | None
    shape: tuple[int, ...]
    split: tuple[int, ...]

    def write(self, writer: VersionWriter) -> None:
        writer.write(self.name, self.data, self.region, self.shape, self.split)


def state_entries(model: torch.nn.Module, optimizer: Any, rank: int) -> list[Entry]:
    """This rank's part of the parameters and optimizer state, in canonical coordinates (each
    rank only its own shard regions; an empty shard nothing), in the same order on every rank.
    Optimizer moments take their parameter's chunk grid; scalar state (Adam's step) is the
    same on every rank and written by rank 0."""
    dims = split_dims(model)
    out = []
    with torch.no_grad():
        for n, p in model.named_parameters():
            split = dims.get(n, ROW_SPLITS)
            local = _local(p.detach())
            if local.numel():
                out.append(Entry(f"model/{n}", local, shard_region(p), tuple(p.shape), split))
            for k, v in (optimizer.state.get(p, {}) if optimizer is not None else {}).items():
                if not isinstance(v, torch.Tensor):
                    continue
                if v.dim() == 0:
                    if rank == 0:
                        out.append(Entry(f"optim/{n}/{k}", v.detach(), None, (), ROW_SPLITS))
                elif _local(v).numel():
                    out.append(
                        Entry(
                            f"optim/{n}/{k}",
                            _local(v.detach()),
                            shard_region(v),
                            tuple(v.shape),
                            split,
                        )
                    )
    return out


def send_entries(entries: list[Entry], dst: int) -> None:
    """Send ``entries`` to rank ``dst`` of the process group (which writes them for this rank,
    :func:`recv_entries`): their descriptions first, then each tensor as it is, its local
    shard only."""
    meta = [
        (
            e.name,
            tuple(e.data.shape),
            str(e.data.dtype).removeprefix("torch."),
            e.region,
            e.shape,
            e.split,
        )
        for e in entries
    ]
    torch.distributed.send_object_list([meta], dst=dst)
    for e in entries:
        torch.distributed.send(e.data.contiguous(), dst=dst)


def recv_entries(src: int, device: torch.device) -> Iterator[Entry]:
    """The entries rank ``src`` sends with :func:`send_entries`, one tensor at a time (one
    shard in memory at once)."""
    box: list[Any] = [None]
    torch.distributed.recv_object_list(box, src=src)
    for name, local_shape, dtype, region, shape, split in box[0]:
        data = torch.empty(local_shape, dtype=getattr(torch, dtype), device=device)
        torch.distributed.recv(data, src=src)
        yield Entry(name, data, region, tuple(shape), tuple(split))


def store_meta(model: torch.nn.Module, ckpt: StoreCheckpoint) -> tuple[int, dict[str, Any]]:
    """The version and metadata of a store checkpoint, after checking it holds ``model``'s
    parameters with their shapes (:class:`CheckpointNotFound` / ``Incompatible`` otherwise)."""

    try:
        manifest = ckpt.store.manifest(ckpt.model, ckpt.version)
    except VersionNotFound as e:
        raise CheckpointNotFound(str(e)) from None
    if manifest.meta.get("format") != STORE_FORMAT:
        raise CheckpointIncompatible(
            f"{ckpt.model!r} v{manifest.version} of {ckpt.store.root} is not a checkpoint "
            f"(format {manifest.meta.get('format')!r})"
        )
    shapes = {
        k.removeprefix("model/"): e.shape
        for k, e in manifest.tensors.items()
        if k.startswith("model/")
    }
    _check_parameters(model, shapes, f"{ckpt.model!r} v{manifest.version}")
    check_architecture(model, manifest.meta, f"{ckpt.model!r} v{manifest.version}")
    return manifest.version, dict(manifest.meta)


def read_state(
    model: torch.nn.Module,
    optimizer: Any,
    ckpt: StoreCheckpoint,
    version: int,
    agreed: Callable[[Callable[[], Any]], Any] | None = None,
) -> None:
    """Load parameters (and the optimizer's moments, if ``optimizer``) reading only this
    rank's shard regions from the store (zero-redundancy resharding from any layout), all
    in one batch of chunk reads. A read that fails (a corrupt chunk) changes nothing.

    ``agreed`` (a multi-rank replica's ``_checked``): the ranks agree that every one of them
    can read its regions before any copies them into place, so a read that fails on one rank
    changes nothing on any. From a memory tier every rank checks its chunks, the ranks
    agree, and each then copies them straight into its parameters (no copy of the weights is
    held meanwhile); from a disk tier each reads into new tensors first."""

    store, name = ckpt.store, ckpt.model
    stored = store.manifest(name, version).tensors
    params = dict(model.named_parameters())
    owner: dict[str, torch.Tensor] = {}  # store key -> the parameter it belongs to
    for n, p in params.items():
        owner[f"model/{n}"] = p
        if optimizer is not None:
            for key in stored:
                if key.startswith(f"optim/{n}/") and key.count("/") == 2:
                    owner[key] = p
    regions: dict[str, tuple[slice, ...] | None] = {}
    empty: dict[str, torch.Tensor] = {}
    for key, p in owner.items():
        if stored[key].shape == ():
            regions[key] = None  # a scalar (Adam's step): the same on every rank
            continue
        region = shard_region(p)
        if region is not None and any(s.stop - s.start == 0 for s in region if s.start is not None):
            empty[key] = torch.empty(tuple(_local(p).shape), dtype=p.dtype)  # an empty shard
        else:
            regions[key] = region
    # Parameters in host memory are read straight into place when the store checks every
    # chunk before it copies any (a memory tier: see StateStore.read_many), so a corrupt
    # version still leaves the model as it was. Others are read into new tensors first.
    direct: dict[str, torch.Tensor] = {}
    if not store.durable:
        for n, p in params.items():
            key, local = f"model/{n}", _local(p.detach())
            if (
                key in regions
                and local.device.type == "cpu"
                and local.is_contiguous()
                and local.dtype == DTYPES[stored[key].dtype][0]
            ):
                direct[key] = local
    def read() -> dict[str, torch.Tensor]:
        return {**store.read_many(name, version, regions, out=direct), **empty}

    if agreed is None:
        got = read()
    elif store.durable:
        got = agreed(read)
    else:  # (checked on every rank before any copies into its parameters)
        copy = agreed(lambda: store.read_many_checked(name, version, regions, direct))
        got = {**copy(), **empty}

    with torch.no_grad():
        for n, p in params.items():
            if f"model/{n}" not in direct:
                _local(p).copy_(got[f"model/{n}"].to(p.device, p.dtype))
        for local in direct.values():
            # (written through numpy, which autograd does not see: an in-place write, as copy_)
            increment_version(local)
        if optimizer is None:
            return
        for n, p in params.items():
            entries = {}
            for key in (k for k in owner if k.startswith(f"optim/{n}/")):
                k = key.rsplit("/", 1)[1]
                if stored[key].shape == ():
                    entries[k] = got[key]
                else:
                    local = got[key].to(p.device)
                    entries[k] = (
                        DTensor.from_local(
                            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                        )
                        if hasattr(p, "device_mesh")
                        else local
                    )
            if entries:
                optimizer.state[p] = entries
