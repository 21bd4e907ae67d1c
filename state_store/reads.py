"""The fast read path: a read of tensors (or regions) of one version, planned as chunk fetches.

A read resolves each tensor's region (canonical coordinates) to the chunks of the grid it
overlaps, using Zarr's on-disk layout (:mod:`~plexrl_dask.state_store.zarr_layout`: a regular
grid, edge chunks padded, raw little-endian bytes) without Zarr's per-chunk asyncio pipeline.
:func:`plan_read` turns one tensor's read into fetches, one per chunk, and :func:`run_reads`
runs the fetches of any number of tensors together on the I/O threads. Every fetched chunk is
checked against its digest (:class:`CorruptState` names the tensor and chunk).

From a memory tier (``durable=False``) a fetch maps the object and checks it, and returns the
copy that puts it into place; those copies run only once every chunk of the read was checked,
so a failed read writes nothing into its outputs. From a disk tier a fetch reads the chunk
straight into the output where the chunk lies whole and contiguous in it, else into a warm
per-thread buffer, and checks and places it at once.

:meth:`~plexrl_dask.state_store.store.StateStore.read` and
:meth:`~plexrl_dask.state_store.store.StateStore.read_many` are the callers.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import numpy as np
import torch

from plexrl_dask.errors import CorruptState, StateMismatch, TensorNotFound
from plexrl_dask.state_store.keys import (
    DTYPES,
    Manifest,
    TensorEntry,
    check_name,
    from_storage,
    to_storage,
)
from plexrl_dask.state_store.objects import Allocation, Objects, _run_fetches, _scratch
from plexrl_dask.state_store.writer import _region

#: One chunk's fetch: reads and checks it, and returns the copy that puts it into place (None
#: when the fetch put it there itself).
Fetch = Callable[[], Callable[[], None] | None]


def run_reads(objects: Objects, fetches: list[Fetch], allocation: Allocation) -> None:
    """Run the chunk fetches of :func:`plan_read` on the I/O threads, then the copies into
    place that they return (all of them checked by then); count what the read allocated in
    ``objects``' statistics, whether or not it succeeded."""
    fetch_reads(objects, fetches, allocation)()


def fetch_reads(
    objects: Objects, fetches: list[Fetch], allocation: Allocation
) -> Callable[[], None]:
    """:func:`run_reads` up to the copies into place: every chunk fetched and checked; returns
    what runs the copies (from a memory tier, all of them: nothing is in place before)."""
    try:
        places = [p for p in _run_fetches(fetches, objects.durable) if p is not None]
    finally:
        objects.stats.read_allocated(allocation.nbytes)

    def copy() -> None:
        _run_fetches(places, disk=False)

    return copy


def plan_read(
    objects: Objects,
    manifest: Manifest,
    name: str,
    region: tuple[slice, ...] | None,
    shape: tuple[int, ...] | None,
    dtype: torch.dtype | None,
    out: torch.Tensor | None,
    allocation: Allocation,
) -> tuple[list[Fetch], Callable[[], torch.Tensor]]:
    """The chunk fetches of one read of tensor ``name`` of ``manifest``'s version from
    ``objects`` (to run on the I/O threads, :func:`run_reads`) and its result. ``shape`` and
    ``dtype``: what the caller expects of the whole tensor (else :class:`StateMismatch`);
    ``out``: where the region goes (else a new array). What the read allocates is counted in
    ``allocation``."""
    model, version = manifest.model, manifest.version
    entry = _entry(manifest, name, shape, dtype)
    bounds = _region(entry.shape, region)
    storage = np.dtype(DTYPES[entry.dtype][1])
    dst_array = _destination(name, entry, bounds, out, allocation)
    chunk_bytes = int(np.prod(entry.chunks, dtype=np.int64)) * storage.itemsize

    def overlap(origin: list[int]) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """The part of the chunk at ``origin`` the read wants, and where it goes."""
        src = tuple(
            slice(max(a, o) - o, min(b, o + c) - o)
            for (a, b), o, c in zip(bounds, origin, entry.chunks, strict=True)
        )
        dst = tuple(
            slice(max(a, o) - a, min(b, o + c) - a)
            for (a, b), o, c in zip(bounds, origin, entry.chunks, strict=True)
        )
        return src, dst

    def fetch(idx: tuple[int, ...]) -> Callable[[], None] | None:
        key = "/".join(("c", *map(str, idx)))
        digest = entry.chunk_digests.get(key)
        what = f"tensor {name!r} of {model!r} v{version}, chunk {key}"
        if digest is None:
            raise CorruptState(f"{what}: not in the manifest")
        origin = [i * c for i, c in zip(idx, entry.chunks, strict=True)]
        if not objects.durable:
            # A memory tier: the object's own pages, mapped and checked now, copied into
            # place once every chunk of the read has been checked.
            view = objects.view(digest, what, chunk_bytes)
            src, dst = overlap(origin)

            def place() -> None:
                chunk = np.frombuffer(view, dtype=storage).reshape(entry.chunks)
                dst_array[dst] = chunk[src]

            return place
        whole = all(
            a <= o and o + c <= b for (a, b), o, c in zip(bounds, origin, entry.chunks, strict=True)
        )
        if whole and dst_array.ndim:
            dst_view = dst_array[
                tuple(
                    slice(o - a, o - a + c)
                    for (a, _), o, c in zip(bounds, origin, entry.chunks, strict=True)
                )
            ]
            if dst_view.flags.c_contiguous:  # straight into the output, no second copy
                objects.get_into(digest, what, memoryview(dst_view).cast("B"))
                return None
        # Into a warm per-thread buffer, checked there, then copied into place (reading
        # straight into the output's rows with one readv measured slower).
        raw = _scratch(chunk_bytes, allocation)
        objects.get_into(digest, what, memoryview(raw))
        src, dst = overlap(origin)
        dst_array[dst] = raw.view(storage).reshape(entry.chunks)[src]
        return None

    indices = itertools.product(
        *(range(a // c, -(-b // c)) for (a, b), c in zip(bounds, entry.chunks, strict=True))
    )
    fetches = [functools.partial(fetch, idx) for idx in indices]
    return fetches, lambda: out if out is not None else from_storage(dst_array, entry.dtype)


def _entry(
    manifest: Manifest, name: str, shape: tuple[int, ...] | None, dtype: torch.dtype | None
) -> TensorEntry:
    """Tensor ``name``'s entry in ``manifest``, checked against the ``shape`` and ``dtype`` a
    reader expects: :class:`TensorNotFound` or :class:`StateMismatch` otherwise."""
    model, version = manifest.model, manifest.version
    entry = manifest.tensors.get(check_name(name))
    if entry is None:
        raise TensorNotFound(
            f"{model!r} v{version} has no tensor {name!r} ({len(manifest.tensors)} tensors, e.g. "
            f"{sorted(manifest.tensors)[:3]})"
        )
    if shape is not None and tuple(shape) != entry.shape:
        raise StateMismatch(
            f"{name!r} of {model!r} v{version} has shape {entry.shape}, expected {tuple(shape)}"
        )
    if dtype is not None and DTYPES[entry.dtype][0] != dtype:
        raise StateMismatch(
            f"{name!r} of {model!r} v{version} has dtype {entry.dtype}, expected {dtype}"
        )
    return entry


def _destination(
    name: str,
    entry: TensorEntry,
    bounds: tuple[tuple[int, int], ...],
    out: torch.Tensor | None,
    allocation: Allocation,
) -> np.ndarray:
    """The array a read of region ``bounds`` of tensor ``name`` (``entry``) lands in, in storage dtype: a view
    of ``out`` (a contiguous CPU tensor of the region's shape and the tensor's dtype, else
    :class:`StateMismatch`), or a new array counted in ``allocation``."""
    storage = np.dtype(DTYPES[entry.dtype][1])
    want = tuple(b - a for a, b in bounds)
    if out is None:
        dst_array = np.empty(want, dtype=storage)
        allocation.add(dst_array.nbytes)
        return dst_array
    if (
        tuple(out.shape) != want
        or out.dtype != DTYPES[entry.dtype][0]
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        raise StateMismatch(
            f"out for {name!r} must be a contiguous CPU {DTYPES[entry.dtype][0]} tensor of "
            f"shape {want}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return to_storage(out)  # a view: reads land in ``out``
