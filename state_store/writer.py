"""One writer's part of a publish (:class:`VersionWriter`: one process, or one FSDP rank).

A writer stores the chunks its region of a tensor covers completely as objects (deduplicated),
keeps the parts of chunks it covers partly as fragments for the commit, records every object it
uses before looking it up (:class:`_Touched`, which collection keeps), and leaves its part (chunk
pointers, fragments) in the publish's staging directory.
:meth:`~plexrl_dask.state_store.store.StateStore.writer` opens writers, and
:meth:`~plexrl_dask.state_store.store.StateStore.commit` assembles their parts into a version.
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plexrl_dask.errors import StateMismatch
from plexrl_dask.state_store.keys import (
    DTYPES,
    ROW_SPLITS,
    check_name,
    chunk_shape,
    logical_dtype,
    to_storage,
)
from plexrl_dask.state_store.objects import _io_pool, _scratch, _write_file
from plexrl_dask.state_store.zarr_layout import _ensure_array_metadata, _VersionZarrStore

if TYPE_CHECKING:
    from plexrl_dask.state_store.store import StateStore

#: Bytes of chunks one writer keeps queued on the I/O threads before a write waits: writes of
#: many small tensors overlap (each used to wait for its own chunks), and the host copies
#: they read stay bounded.
INFLIGHT_BYTES = 64 << 20


def _region(
    shape: tuple[int, ...], region: tuple[slice, ...] | None
) -> tuple[tuple[int, int], ...]:
    """Normalized ``(start, stop)`` per dim (full extent where ``region`` is shorter)."""
    region = tuple(region or ())
    if len(region) > len(shape):
        raise StateMismatch(f"region {region} has more dims than shape {shape}")
    out = []
    for d, n in enumerate(shape):
        s = region[d] if d < len(region) else slice(None)
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise StateMismatch(f"regions are unit-step slices, got {s!r} in dim {d}")
        start, stop, _ = s.indices(n)
        if stop < start:
            raise StateMismatch(f"empty or reversed region {s!r} in dim {d} of {shape}")
        out.append((start, stop))
    return tuple(out)


class _Touched:
    """An append-only record of the objects a publish in progress uses (one digest per
    line, flushed at once): what :meth:`StateStore.gc` keeps besides published versions."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()

    def __call__(self, digest: str) -> None:
        self.many((digest,))

    def many(self, digests: Iterable[str]) -> None:
        """Record ``digests`` at once (one write)."""
        with self._lock:
            self._file.write("".join(d + "\n" for d in digests))
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _write_raw(path: Path, block: np.ndarray) -> None:
    np.ascontiguousarray(block).tofile(path)


class VersionWriter:
    """One writer's part of a publish (one process or rank); see :meth:`StateStore.writer`."""

    def __init__(
        self,
        store: StateStore,
        model: str,
        version: int,
        staging: Path,
        counted: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.counted = counted  # (told the size of each new object this writer stores)
        self.model = model
        self.version = version
        self.staging = staging
        self.id = uuid.uuid4().hex
        self.pointers: dict[str, str] = {}
        self.tensors: dict[str, dict[str, Any]] = {}
        self.fragments: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.touched = _Touched(staging / "touched" / self.id)
        self.pending = staging / "pending" if store.durable else None
        self._zarr = _VersionZarrStore(
            staging / "arrays",
            store.objects,
            self.pointers,
            read_only=False,
            touch=self.touched,
            pending=self.pending,
            counted=counted,
        )
        self._closed = False
        self._inflight: deque[tuple[Future, int]] = deque()  # (queued work, its chunk bytes)
        self._inflight_bytes = 0

    def write(
        self,
        name: str,
        tensor: torch.Tensor,
        region: tuple[slice, ...] | None = None,
        shape: tuple[int, ...] | None = None,
        split_dims: tuple[int, ...] = ROW_SPLITS,
    ) -> None:
        """Write ``tensor`` as the ``region`` (canonical coordinates) of tensor ``name`` of full
        ``shape`` (default: the whole tensor). Chunks the region covers completely are queued
        for storing (deduplicated) on the I/O threads, done by :meth:`close` at the latest;
        partly covered chunks are kept as fragments for the commit. ``tensor`` must not
        change until then.
        ``split_dims``: the dims readers may split the tensor along, which choose its chunk
        grid (:mod:`~plexrl_dask.state_store.keys`); every writer of a tensor must give the
        same (else :class:`StateMismatch`, here or at the commit)."""
        if self._closed:
            raise StateMismatch("this writer is closed")
        check_name(name)
        dtype = logical_dtype(tensor)
        full = tuple(int(n) for n in (shape if shape is not None else tensor.shape))
        bounds = _region(full, region)
        if tuple(b - a for a, b in bounds) != tuple(tensor.shape):
            raise StateMismatch(
                f"tensor {name!r}: data of shape {tuple(tensor.shape)} does not fill region "
                f"{[slice(a, b) for a, b in bounds]} of shape {full}"
            )
        chunks = chunk_shape(
            full, np.dtype(DTYPES[dtype][1]).itemsize, self.store.chunk_bytes, split_dims
        )
        known = self.tensors.setdefault(
            name, {"shape": list(full), "dtype": dtype, "chunks": list(chunks)}
        )
        if known != {"shape": list(full), "dtype": dtype, "chunks": list(chunks)}:
            raise StateMismatch(
                f"tensor {name!r} written as {full} {dtype} in chunks {chunks} and as {known}"
            )
        # The array's metadata file on an I/O thread, beside the chunks (file system calls
        # release the GIL).
        self._submit(0, _ensure_array_metadata, self._zarr.meta_root, name, full, dtype, chunks)
        self._write_data(name, tensor, bounds, full, chunks)

    def _submit(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the store's I/O threads; :meth:`close` waits for it (and
        raises its error). A write waits for the oldest while more than
        :data:`INFLIGHT_BYTES` of chunks are queued: the tensors they read stay alive until
        then."""
        self._inflight.append((_io_pool().submit(fn, *args), nbytes))
        self._inflight_bytes += nbytes
        while self._inflight_bytes > INFLIGHT_BYTES:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        future, nbytes = self._inflight.popleft()
        self._inflight_bytes -= nbytes
        future.result()

    def _drain(self, quiet: bool = False) -> None:
        """Wait for everything queued; its first error is raised unless ``quiet``."""
        error = None
        while self._inflight:
            try:
                self._wait_oldest()
            except Exception as e:  # noqa: BLE001 (the first is raised, after all are done)
                error = error or e
        if error is not None and not quiet:
            raise error

    def _write_data(
        self,
        name: str,
        tensor: torch.Tensor,
        bounds: tuple[tuple[int, int], ...],
        full: tuple[int, ...],
        chunks: tuple[int, ...],
    ) -> None:
        """Store ``tensor``'s chunks and fragments (see :meth:`write`)."""
        data = to_storage(tensor)
        if not full:  # a scalar: one chunk, key "c", its bytes as they are
            digest = self.store.objects.put(
                np.ascontiguousarray(data).tobytes(),
                touch=self.touched,
                pending=self.pending,
                counted=self.counted,
            )
            with self._lock:
                self.pointers[f"{name}/c"] = digest
            return
        # The aligned interior: chunk boundaries inside the region, per dim.
        inner = []
        for (a, b), c in zip(bounds, chunks, strict=True):
            lo = -(-a // c) * c
            hi = (b // c) * c if b != full[len(inner)] else b
            inner.append((lo, max(lo, hi)))
        if all(hi > lo for lo, hi in inner):
            self._put_chunks(name, data, bounds, inner, full, chunks)
        # The rest of the region (a shell around the interior) becomes fragments: split the
        # region into boxes, one per combination of [before, inner, after] per dim.
        pieces = []
        for (a, b), (lo, hi) in zip(bounds, inner, strict=True):
            if hi <= lo:
                pieces.append([(a, b)])
            else:
                pieces.append([p for p in ((a, lo), (lo, hi), (hi, b)) if p[1] > p[0]])
        for box in itertools.product(*pieces):
            if all(box[d] == inner[d] for d in range(len(box))) and all(
                hi > lo for lo, hi in inner
            ):
                continue
            sl = tuple(slice(s - a, e - a) for (s, e), (a, _) in zip(box, bounds, strict=True))
            folder = self.staging / "fragments" / self.id
            if not self.fragments:
                folder.mkdir(parents=True, exist_ok=True)
            # Raw C-order bytes (the commit knows the shape and dtype), on an I/O thread.
            path = folder / f"{len(self.fragments)}.bin"
            block = data[sl]
            self._submit(block.nbytes, _write_raw, path, block)
            self.fragments.append(
                {
                    "name": name,
                    "region": [list(p) for p in box],
                    "file": str(path.relative_to(self.staging)),
                }
            )

    def _put_chunks(
        self,
        name: str,
        data: np.ndarray,
        bounds: tuple[tuple[int, int], ...],
        inner: list[tuple[int, int]],
        full: tuple[int, ...],
        chunks: tuple[int, ...],
    ) -> None:
        """Store the chunks of the aligned ``inner`` box, in Zarr's layout (C order, edge
        chunks padded with the fill value 0), on a few threads."""
        storage = data.dtype

        def put(idx: tuple[int, ...]) -> None:
            origin = [i * c for i, c in zip(idx, chunks, strict=True)]
            extent = [min(c, n - o) for c, n, o in zip(chunks, full, origin, strict=True)]
            block = data[
                tuple(
                    slice(o - a, o - a + e)
                    for o, (a, _), e in zip(origin, bounds, extent, strict=True)
                )
            ]
            if extent == list(chunks) and block.flags.c_contiguous:
                buf = block  # (whole rows: the chunk is already laid out as stored)
            else:
                nbytes = int(np.prod(chunks, dtype=np.int64)) * storage.itemsize
                buf = _scratch(nbytes).view(storage).reshape(chunks)
                if extent != list(chunks):
                    buf.fill(0)  # Zarr pads edge chunks with the fill value
                buf[tuple(slice(0, e) for e in extent)] = block
            digest = self.store.objects.put(
                memoryview(buf).cast("B"),
                touch=self.touched,
                pending=self.pending,
                counted=self.counted,
            )
            with self._lock:
                self.pointers["/".join((name, "c", *map(str, idx)))] = digest

        nbytes = int(np.prod(chunks, dtype=np.int64)) * storage.itemsize
        for idx in itertools.product(
            *(range(lo // c, -(-hi // c)) for (lo, hi), c in zip(inner, chunks, strict=True))
        ):
            self._submit(nbytes, put, idx)

    def close(self) -> None:
        """Record this writer's part (its chunk pointers and fragments) for the commit."""
        if self._closed:
            return
        self._drain()
        self.touched.close()
        part = {"tensors": self.tensors, "pointers": self.pointers, "fragments": self.fragments}
        _write_file(
            self.staging / "parts" / f"{self.id}.json",
            json.dumps(part).encode(),
            self.store.durable,
        )
        self._closed = True

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # not a part of the publish; but nothing of it keeps writing after this
            self._drain(quiet=True)
