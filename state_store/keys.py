"""Canonical names, the chunk grid, logical dtypes and manifests of the state store.

Every tensor of a model version is named logically, ``<model>/<version>/<name>`` (parameter
names as the model names them; optimizer state under ``optim/<slot>/<parameter>``), and stored
in canonical, unsharded coordinates on a chunk grid that depends only on its shape and dtype,
never on the layout (FSDP shard, tensor-parallel shard, replica) that wrote it. That is what
lets identical bytes written by different layouts land in identical chunks (dedup) and lets a
reader fetch exactly the chunks its slice needs (resharding).

**Chunk grid.** It depends on a tensor's shape, dtype and ``split_dims``: the dims its readers
may split it along. Every layout splits dim 0 (FSDP shards, tensor-parallel output rows), so
that is the default; a tensor the model's tensor-parallel plan splits by input columns (a
row-parallel linear's weight ``[out, in]``: o and down projections) also has dim 1
(:func:`split_dims_from_tp_plan`). The hint comes from the model's configuration and the
tensor's name, so every writer of a tensor (any layout, any replica, the reference model and
the policy alike) chooses the same grid. A tensor larger than 1/256 of ``target_bytes`` (16 KiB
of 4 MiB: below it, one chunk; Zarr's per-chunk overhead makes many small chunks slow,
NOTES-dask.md, but a chunk that two FSDP shards each cover half of is kept as fragments and
assembled at the commit, which cost a 2-rank publish of the 3 MB countdown4 model about half
its CPU on rank 0) has each split dim halved
where even (so 2-way shards of each align with chunk boundaries), then the largest of them
halved again while a chunk exceeds the target: big tensors align with 4-, 8-, ...-way shards too (a
tensor whose rows alone exceed the target is cut by columns too, to keep chunks bounded). A
smaller tensor is one chunk (a slice of it fetches it whole: few bytes).

Why not split dim 1 everywhere: a chunk that spans whole rows is one contiguous run of the
tensor, so a full or dim-0 read lands straight in the output with one kernel copy; a chunk cut
by columns must go through a buffer and a strided copy, which measured 2.5x slower on the DRAM
tier (``benchmarks/RESULTS.md``). Only the tensors that tensor-parallel readers really cut by
columns pay that.

**Logical dtypes.** Zarr 3.1 has no bfloat16: such tensors are stored as their raw bits
(uint16) with the logical dtype recorded, and come back bit-exactly.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from plexrl_dask.errors import CorruptState, InvalidStateKey

#: Model and tensor names: path-safe segments (no ``..``, no empty segments, no leading ``.``).
_SEGMENT = r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*"
_NAME = re.compile(rf"^{_SEGMENT}(/{_SEGMENT})*$")
_MODEL = re.compile(rf"^{_SEGMENT}$")

#: logical dtype -> (torch dtype, numpy storage dtype)
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "float32"),
    "float64": (torch.float64, "float64"),
    "float16": (torch.float16, "float16"),
    "bfloat16": (torch.bfloat16, "uint16"),
    "int64": (torch.int64, "int64"),
    "int32": (torch.int32, "int32"),
    "int16": (torch.int16, "int16"),
    "int8": (torch.int8, "int8"),
    "uint8": (torch.uint8, "uint8"),
    "bool": (torch.bool, "bool"),
}
_BY_TORCH = {t: name for name, (t, _) in DTYPES.items()}

DEFAULT_CHUNK_BYTES = 4 << 20
#: Tensors above 1/16 of the chunk target are cut in two along each split dim at least, so
#: 2-way shards of a 4 MB projection fetch only their half; smaller ones stay one chunk.
_SPLIT_FRACTION = 256


def check_model(model: str) -> str:
    if not isinstance(model, str) or not _MODEL.fullmatch(model):
        raise InvalidStateKey(
            f"model names are one path-safe segment ([A-Za-z0-9_.-]), got {model!r}"
        )
    return model


#: A deployment name passes into store model names as it is when it is this short and made of
#: path-safe characters without ``..``; any other is hashed (:func:`model_key`).
MODEL_KEY_MAX = 64
_KEY_PLAIN = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")
#: What a store model derived from a deployment holds (:func:`derived_model`).
DERIVED_KINDS = ("weights", "stash", "relocate")


def model_key(name: str) -> str:
    """The store model name of the deployment (or job) ``name``: ``name`` itself when it is
    at most :data:`MODEL_KEY_MAX` path-safe characters without ``..`` (a checkpoint keeps the
    name its deployment has), else a readable prefix, ``..`` and 24 hex digits of the
    name's SHA-256. Injective: a name that passes has no ``..``; a hashed one has exactly one,
    and its prefix (path-safe characters, dots made ``-``, at most 38) is never a
    :data:`DERIVED_KINDS` word, since only that very name, which passes, would sanitise to one.
    At most :data:`MODEL_KEY_MAX` characters: long names never make file names too long."""
    if not isinstance(name, str) or not name:
        raise InvalidStateKey(f"a deployment name is a non-empty string, got {name!r}")
    if len(name) <= MODEL_KEY_MAX and ".." not in name and _KEY_PLAIN.fullmatch(name):
        return name
    prefix = re.sub(r"[^A-Za-z0-9_\-]", "-", name)[:38]
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return f"{prefix}..{digest}"


def derived_model(kind: str, name: str, *parts: str) -> str:
    """The store model of what ``kind`` (:data:`DERIVED_KINDS`) keeps for deployment ``name``:
    ``kind..<model_key(name)>..<part>...``. Distinct (kind, name, parts) give distinct names,
    and none equals a :func:`model_key`: each kind has a fixed number of ``parts``, none
    containing ``..``, so the name parses back from both ends."""
    if kind not in DERIVED_KINDS:
        raise InvalidStateKey(f"derived model kinds are {DERIVED_KINDS}, got {kind!r}")
    for part in parts:
        if not part or ".." in part or not _KEY_PLAIN.fullmatch(part):
            raise InvalidStateKey(f"a derived model's parts are path-safe, without '..': {part!r}")
    return "..".join((kind, model_key(name), *parts))


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name.split("/"):
        raise InvalidStateKey(f"tensor names are '/'-separated path-safe segments, got {name!r}")
    return name


def check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidStateKey(f"versions are integers >= 0, got {version!r}")
    return version


def logical_dtype(tensor: torch.Tensor) -> str:
    name = _BY_TORCH.get(tensor.dtype)
    if name is None:
        raise InvalidStateKey(f"dtype {tensor.dtype} is not storable; supported: {sorted(DTYPES)}")
    return name


def to_storage(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a numpy array of its storage dtype (a view where possible)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def from_storage(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The tensor with logical ``dtype`` whose bits are ``array``."""
    torch_dtype, storage = DTYPES[dtype]
    t = torch.from_numpy(np.require(array, dtype=storage, requirements="C"))  # keeps 0-d
    return t.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else t


#: The dims every reader may split a tensor along (see the module docstring).
ROW_SPLITS: tuple[int, ...] = (0,)
#: Row-parallel tensor-parallel weights: split by rows (FSDP) and by input columns.
ROW_AND_COLUMN_SPLITS: tuple[int, ...] = (0, 1)


def check_split_dims(split_dims: tuple[int, ...]) -> tuple[int, ...]:
    dims = tuple(sorted(set(split_dims)))
    if not dims or any(isinstance(d, bool) or d not in (0, 1) for d in dims):
        raise InvalidStateKey(f"split_dims must be (0,) or (0, 1), got {split_dims!r}")
    return dims


def chunk_shape(
    shape: tuple[int, ...],
    itemsize: int,
    target_bytes: int = DEFAULT_CHUNK_BYTES,
    split_dims: tuple[int, ...] = ROW_SPLITS,
) -> tuple[int, ...]:
    """The chunk grid of a tensor whose readers may split ``split_dims`` (see the module
    docstring)."""
    if not shape:
        return ()
    dims = [d for d in check_split_dims(split_dims) if d < len(shape)]
    chunks = [max(1, n) for n in shape]

    def nbytes() -> int:
        return int(np.prod(chunks)) * itemsize

    if nbytes() > target_bytes // _SPLIT_FRACTION:
        for d in dims:
            if shape[d] % 2 == 0:
                chunks[d] = shape[d] // 2
    while nbytes() > target_bytes:
        candidates = [d for d in dims if chunks[d] % 2 == 0]
        if not candidates:  # few, very long rows: keep chunks bounded, cut columns too
            candidates = [d for d in range(min(2, len(shape))) if chunks[d] % 2 == 0]
        if not candidates:
            break
        d = max(candidates, key=lambda d: (chunks[d], -d))
        chunks[d] //= 2
    return tuple(chunks)


def split_dims_from_tp_plan(
    names: list[str], plan: dict[str, str] | None
) -> dict[str, tuple[int, ...]]:
    """The parameters among ``names`` that a tensor-parallel ``plan`` (Hugging Face's
    ``base_model_tp_plan`` form: module patterns with ``*`` for a layer index -> style) splits
    by input columns: the weights of modules whose style is row-wise (``"rowwise"``,
    ``"rowwise_rep"``, ...; an embedding's row-wise split is by vocabulary rows, dim 0). Those
    map to :data:`ROW_AND_COLUMN_SPLITS`; every other name is left out (it takes the default,
    :data:`ROW_SPLITS`). Patterns match at the end of a module path, after any prefix (the base
    model's attribute, ``model.``)."""
    rowwise = [
        re.compile(r"(^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + r"\.weight$")
        for pattern, style in (plan or {}).items()
        if "rowwise" in style and "embedding" not in style
    ]
    return {n: ROW_AND_COLUMN_SPLITS for n in names if any(r.search(n) for r in rowwise)}


def chunk_keys(shape: tuple[int, ...], chunks: tuple[int, ...]) -> list[str]:
    """The Zarr keys of a tensor's chunks, in grid order (``c`` for a scalar)."""
    if not shape:
        return ["c"]
    grid = [range(-(-n // c)) for n, c in zip(shape, chunks, strict=True)]
    return ["c/" + "/".join(map(str, idx)) for idx in itertools.product(*grid)]


#: What a chunk's content digest looks like (``objects.digest_of``: XXH3-128, hex).
_DIGEST = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: where its chunks are (chunk index key -> content digest)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    chunk_digests: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """The tensor's content digest: over its shape, dtype and chunk digests in order."""
        import xxhash

        h = xxhash.xxh3_128()
        h.update(json.dumps([list(self.shape), self.dtype, list(self.chunks)]).encode())
        for key in sorted(self.chunk_digests):
            h.update(key.encode())
            h.update(self.chunk_digests[key].encode())
        return h.hexdigest()

    @property
    def nbytes(self) -> int:
        storage = DTYPES[self.dtype][1]
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(storage).itemsize

    def to_dict(self) -> dict[str, Any]:
        # (built by hand: dataclasses.asdict deep-copies recursively, and a publish writes a
        # manifest of every tensor)
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunks": list(self.chunks),
            "chunk_digests": dict(self.chunk_digests),
            "digest": self.digest,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorEntry:
        return cls(
            name=d["name"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            chunks=tuple(d["chunks"]),
            chunk_digests=dict(d["chunk_digests"]),
        )


@dataclass(frozen=True)
class Manifest:
    """A published version: every tensor with its shape, logical dtype and content digests."""

    model: str
    version: int
    tensors: dict[str, TensorEntry]
    created: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def digests(self) -> set[str]:
        return {d for t in self.tensors.values() for d in t.chunk_digests.values()}

    def check(self, model: str | None = None, version: int | None = None) -> Manifest:
        """This manifest, when it is one a store could have written (of ``model`` ``version``
        where given): path-safe names, known dtypes, a whole chunk grid, and digests that
        name objects, never paths. :class:`CorruptState` otherwise. A manifest from another
        process (a peer's import) is checked before any of it names a file."""
        try:
            check_model(self.model), check_version(self.version)
            if (model is not None and self.model != model) or (
                version is not None and self.version != version
            ):
                raise InvalidStateKey(f"asked for {model!r} v{version}")
            for name, entry in self.tensors.items():
                _check_entry(name, entry)
        except InvalidStateKey as e:
            raise CorruptState(
                f"the manifest of {self.model!r} v{self.version} is not a store's: {e}"
            ) from None
        return self

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": 1,
                "model": self.model,
                "version": self.version,
                "created": self.created,
                "meta": self.meta,
                "tensors": {n: t.to_dict() for n, t in sorted(self.tensors.items())},
            },
            separators=(",", ":"),  # compact: json's C encoder (an indent takes the Python one)
        )

    @classmethod
    def from_json(cls, text: str | bytes, what: str = "a manifest") -> Manifest:
        """The manifest ``text`` holds; :class:`CorruptState` for anything that is not one
        (a garbled or truncated file), never a bare parsing error."""
        try:
            d = json.loads(text)
            return cls(
                model=d["model"],
                version=int(d["version"]),
                tensors={n: TensorEntry.from_dict(t) for n, t in d["tensors"].items()},
                created=float(d.get("created", 0.0)),
                meta=dict(d.get("meta", {})),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptState(
                f"{what} is not a readable manifest ({type(e).__name__}: {e})"
            ) from None


def _check_entry(name: str, entry: TensorEntry) -> None:
    """:class:`InvalidStateKey` unless ``entry`` is tensor ``name`` as a store writes one."""
    check_name(name)
    if entry.name != name or entry.dtype not in DTYPES:
        raise InvalidStateKey(f"tensor {name!r} is listed as {entry.name!r} of {entry.dtype!r}")
    dims = (*entry.shape, *entry.chunks)
    if (
        len(entry.chunks) != len(entry.shape)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in dims)
        or not all(c > 0 for c in entry.chunks)
    ):
        raise InvalidStateKey(f"tensor {name!r}: shape {entry.shape}, chunks {entry.chunks}")
    if set(entry.chunk_digests) != set(chunk_keys(entry.shape, entry.chunks)):
        raise InvalidStateKey(f"tensor {name!r}: its chunks are not its grid's")
    if not all(isinstance(d, str) and _DIGEST.match(d) for d in entry.chunk_digests.values()):
        raise InvalidStateKey(f"tensor {name!r}: a chunk digest that is not one")
