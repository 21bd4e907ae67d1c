"""The canonical state store: versions of models as chunked Zarr arrays over content-addressed,
deduplicated chunks, published atomically.

Layout of a store root (one tier: a DRAM tier lives on a shared-memory filesystem, an NVMe tier
on a local disk; :mod:`plexrl_dask.state_store.keys` defines names and the chunk grid)::

    plexrl-store.json                      marker: this directory is a store
    objects/ab/abcdef...                   chunk bytes, named by their 128-bit content digest
    versions/<model>/<version>/            a published version (visible = this directory exists)
        manifest.json                      tensors: shape, logical dtype, chunk grid, digests
        arrays/<name>/zarr.json            Zarr v3 array metadata (chunks resolve via manifest)
    staging/<model>/<version>-<publish>/   a publish in progress: parts, fragments, metadata

**Dedup.** A chunk is stored once per store whatever wrote it: every replica, job and version
that produces identical bytes at a chunk of the canonical grid shares one object (a frozen
tensor is hashed, found, and not written again). Chunks are the unit because ranks write only
their own shard regions: a writer stores the chunks its region covers completely, and keeps the
parts of chunks it covers partly as *fragments*; the commit assembles each such chunk from its
fragments (at most one chunk per shard boundary is touched twice). Objects no manifest refers
to are garbage: :meth:`StateStore.gc` counts references from every manifest and deletes the
rest (mark and sweep, so counts can never drift; :mod:`~plexrl_dask.state_store.collection`).

**Atomic versions.** Writers (:mod:`~plexrl_dask.state_store.writer`) write objects (immutable,
never visible partly written: :mod:`~plexrl_dask.state_store.objects`) and their parts into a
staging directory; the commit writes the manifest there, fsyncs, and renames the staging
directory to ``versions/<model>/<version>`` in one ``rename``. A crash at any point before
leaves the previous versions untouched and nothing visible; of two concurrent publishers of one
version the first rename wins and the second finds an identical version (fine) or a different
one (:class:`VersionConflict`).

**Reads** go through Zarr's layout (:mod:`~plexrl_dask.state_store.zarr_layout`): a region of a
tensor fetches exactly the chunks it overlaps, and every fetched chunk is checked against its
digest (:class:`CorruptState` names the tensor); from a memory tier all of them are checked
before any is copied out (planned and run by :mod:`~plexrl_dask.state_store.reads`).

This module: :class:`StateStore` (versions, publish and commit with the assembly of partly
written chunks, reads, imports and tier copies; its collection methods come from
:class:`~plexrl_dask.state_store.collection.CollectionMixin`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from plexrl_dask.errors import (
    CorruptState,
    NotAStore,
    PublishIncomplete,
    StateMismatch,
    TensorNotFound,
    VersionConflict,
    VersionNotFound,
)
from plexrl_dask.state_store.collection import CollectionMixin
from plexrl_dask.state_store.keys import (
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    ROW_SPLITS,
    Manifest,
    TensorEntry,
    check_model,
    check_name,
    check_version,
    chunk_keys,
    from_storage,
)
from plexrl_dask.state_store.objects import (
    Allocation,
    IOStats,
    Objects,
    Tally,
    _fsync_dir,
    _io_pool,
    _syncfs,
    _write_file,
)
from plexrl_dask.state_store.objects import digest_of as digest_of  # re-exported
from plexrl_dask.state_store.reads import fetch_reads, plan_read, run_reads
from plexrl_dask.state_store.writer import VersionWriter, _region, _Touched
from plexrl_dask.state_store.zarr_layout import _byte_range as _byte_range  # re-exported
from plexrl_dask.state_store.zarr_layout import (
    _ensure_array_metadata,
    _VersionZarrStore,
)

logger = logging.getLogger(__name__)

MARKER = "plexrl-store.json"
FORMAT = 1

#: How many object bytes one request of an import asks its source for: small enough that
#: the transfers of the next batches overlap the storing of one (64 MiB batches, two at a
#: time, left a 126 MB import nothing to overlap) and that Dask (de)serializes a reply on its
#: event loop rather than handing it to a thread (above 10 MiB), large enough that the
#: per-request round trip stays a small part of it.
IMPORT_BATCH_BYTES = 8 << 20
#: Requests an import keeps in flight while it stores what arrived.
IMPORT_AHEAD = 4
#: Batches an import stores at once (on the I/O threads).
IMPORT_STORING = 2


def _check_fragments_cover(
    tensors: dict[str, dict[str, Any]],
    fragments: list[dict[str, Any]],
    pointers: dict[str, str],
    what: str,
) -> None:
    """Every chunk that fragments touch must be covered completely by them (else its missing
    part would silently read as zeros): :class:`PublishIncomplete` otherwise."""
    masks: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
    for frag in fragments:
        name = frag["name"]
        shape, chunks = tuple(tensors[name]["shape"]), tuple(tensors[name]["chunks"])
        region = [tuple(r) for r in frag["region"]]
        ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(region, chunks, strict=True)]
        for idx in itertools.product(*ranges):
            origin = [i * c for i, c in zip(idx, chunks, strict=True)]
            extent = [min(c, n - o) for c, n, o in zip(chunks, shape, origin, strict=True)]
            mask = masks.setdefault((name, idx), np.zeros(extent, dtype=bool))
            mask[
                tuple(
                    slice(max(a, o) - o, min(b, o + e) - o)
                    for (a, b), o, e in zip(region, origin, extent, strict=True)
                )
            ] = True
    for (name, idx), mask in masks.items():
        key = f"{name}/c/" + "/".join(map(str, idx))
        if key in pointers:
            raise VersionConflict(
                f"{what}: chunk {key} was written whole by one writer and in part by another"
            )
        if not mask.all():
            raise PublishIncomplete(
                f"tensor {name!r} of {what}: {int((~mask).sum())} elements of chunk {key} were written by no writer"
            )


def _assembled_chunks(
    staging: Path, tensors: dict[str, dict[str, Any]], fragments: list[dict[str, Any]]
) -> Iterator[tuple[str, np.ndarray]]:
    """Each chunk that ``fragments`` cover, assembled from their files: ``(key, chunk)`` laid
    out as Zarr stores a chunk (C order, padded past the array's edge with the fill value 0),
    one chunk in memory at a time. The fragments cover each of these chunks completely and
    no writer wrote one whole (:func:`_check_fragments_cover`), so nothing is read back.
    Where fragments overlap (a replicated part written by several ranks), their bytes must
    agree: :class:`VersionConflict` otherwise, as for a whole chunk written twice.

    (Not through Zarr: a read-modify-write per fragment on Zarr's event loop costs ~4 ms,
    most of a small model's FSDP publish.)"""
    by_chunk: dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]] = {}
    for frag in fragments:
        chunks = tensors[frag["name"]]["chunks"]
        spans = [
            range(a // c, -(-b // c)) for (a, b), c in zip(frag["region"], chunks, strict=True)
        ]
        for idx in itertools.product(*spans):
            by_chunk.setdefault((frag["name"], idx), []).append(frag)
    for (name, idx), frags in by_chunk.items():
        t = tensors[name]
        chunks = tuple(t["chunks"])
        origin = [i * c for i, c in zip(idx, chunks, strict=True)]
        chunk = np.zeros(chunks, dtype=DTYPES[t["dtype"]][1])
        key = "/".join((name, "c", *map(str, idx)))
        written = np.zeros(chunks, dtype=bool) if len(frags) > 1 else None
        for frag in frags:
            region = [tuple(r) for r in frag["region"]]
            lo = [max(a, o) for (a, _), o in zip(region, origin, strict=True)]
            hi = [min(b, o + c) for (_, b), o, c in zip(region, origin, chunks, strict=True)]
            shape = [b - a for a, b in region]
            # (mapped: a fragment across several chunks is read once per chunk, in part)
            data = np.memmap(staging / frag["file"], dtype=chunk.dtype, mode="r", shape=shape)
            into = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin, strict=True))
            part = data[
                tuple(slice(a - r, b - r) for a, b, (r, _) in zip(lo, hi, region, strict=True))
            ]
            if written is not None:
                both = written[into]
                if both.any() and chunk[into][both].tobytes() != np.asarray(part)[both].tobytes():
                    raise VersionConflict(f"two writers wrote different bytes to parts of {key}")
                written[into] = True
            chunk[into] = part
        yield key, chunk


class StateStore(CollectionMixin):
    """One tier's store of model versions (see the module docstring).

    ``durable``: fsync what a publish writes (persistent tiers); ``capacity_bytes``: refuse
    writes beyond that many object bytes (:class:`TierFull`); ``chunk_bytes``: the chunk target.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        create: bool = False,
        durable: bool = True,
        capacity_bytes: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.root = Path(root)
        self.durable = durable
        self.chunk_bytes = int(chunk_bytes)
        marker = self.root / MARKER
        if not marker.is_file():
            if not create:
                raise NotAStore(
                    f"{self.root} is not a PlexRL state store (no {MARKER}); pass create=True to make one"
                )
            # (dot files: the temporary of a marker another process is creating right now;
            # other files with a marker seen after them: a store another process made since
            # the first look, which two ranks saving into a new store at once both see)
            if (
                self.root.exists()
                and any(
                    p.name != MARKER and not p.name.startswith(".") for p in self.root.iterdir()
                )
                and not marker.is_file()
            ):
                raise NotAStore(
                    f"{self.root} is a non-empty directory that is not a state store; refusing to use it"
                )
            if not marker.is_file():
                self.root.mkdir(parents=True, exist_ok=True)
                _write_file(
                    marker, json.dumps({"format": FORMAT, "created": time.time()}).encode(), durable
                )
        try:
            fmt = json.loads(marker.read_text()).get("format")
        except (ValueError, OSError) as e:
            raise NotAStore(f"{marker} is unreadable: {e}") from e
        if fmt != FORMAT:
            raise NotAStore(f"{self.root} has store format {fmt!r}; this version reads {FORMAT}")
        self.stats = IOStats()
        self.objects = Objects(self.root / "objects", durable, capacity_bytes, self.stats)
        self._manifests: dict[tuple[str, int], tuple[tuple[int, int], Manifest]] = {}

    # --- versions --------------------------------------------------------------------------

    def _version_dir(self, model: str, version: int) -> Path:
        return self.root / "versions" / check_model(model) / str(check_version(version))

    def models(self) -> list[str]:
        d = self.root / "versions"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def versions(self, model: str) -> list[int]:
        d = self.root / "versions" / check_model(model)
        if not d.is_dir():
            return []
        return sorted(
            int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "manifest.json").is_file()
        )

    def manifest(self, model: str, version: int | None = None) -> Manifest:
        """The manifest of a published version (default: the latest)."""
        if version is None:
            published = self.versions(model)
            if not published:
                raise VersionNotFound(f"no published version of {model!r} in {self.root}")
            version = published[-1]
        key = (model, version)
        path = self._version_dir(model, version) / "manifest.json"
        try:
            # Another process may have deleted and re-published this version since it was
            # cached (a tier shared by a node's workers): the file's identity says.
            st = path.stat()
            stamp = (st.st_ino, st.st_mtime_ns)
            cached = self._manifests.get(key)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            manifest = Manifest.from_json(path.read_bytes(), f"{model!r} v{version} ({path})")
        except FileNotFoundError:
            self._manifests.pop(key, None)
            raise VersionNotFound(
                f"{model!r} has no published version {version} in {self.root} (published: {self.versions(model)})"
            ) from None
        self._manifests[key] = (stamp, manifest)
        return manifest

    def has_version(self, model: str, version: int) -> bool:
        return (self._version_dir(model, version) / "manifest.json").is_file()

    # --- publishing --------------------------------------------------------------------------

    def _staging(self, model: str, version: int, publish_id: str) -> Path:
        if not publish_id.replace("-", "").isalnum():
            raise StateMismatch(f"publish ids are alphanumeric (and '-'), got {publish_id!r}")
        return self.root / "staging" / check_model(model) / f"{check_version(version)}-{publish_id}"

    def writer(
        self,
        model: str,
        version: int,
        publish_id: str = "solo",
        counted: Callable[[int], None] | None = None,
    ) -> VersionWriter:
        """A writer for (part of) a publish of ``model`` version ``version``. Every writer of
        one publish (e.g. each FSDP rank) uses the same ``publish_id``; one of them calls
        :meth:`commit` once all have closed their writers. ``counted(nbytes)`` is told the
        size of each new object the writer stores (its share of what the tier gains)."""
        staging = self._staging(model, version, publish_id)
        (staging / "parts").mkdir(parents=True, exist_ok=True)
        return VersionWriter(self, model, version, staging, counted)

    def publish(
        self,
        model: str,
        version: int,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any] | None = None,
        split_dims: Mapping[str, tuple[int, ...]] | None = None,
    ) -> Manifest:
        """Write whole tensors and commit (one writer). ``split_dims``: per tensor name, the
        dims its readers may split (default :data:`~.keys.ROW_SPLITS`)."""
        publish_id = uuid.uuid4().hex
        pending = Tally()
        try:
            with self.writer(model, version, publish_id, counted=pending) as w:
                for name, t in tensors.items():
                    w.write(name, t, split_dims=(split_dims or {}).get(name, ROW_SPLITS))
            return self.commit(
                model, version, publish_id, expected_parts=1, meta=meta, counted=pending
            )
        except BaseException:
            # Nothing else writes this publish: its staging (chunks and fragments, and a
            # durable tier's new objects, not yet in the store) goes at once.
            staging = self._staging(model, version, publish_id)
            unsettled = (staging / "pending").is_dir()  # (settled ones are in the store)
            shutil.rmtree(staging, ignore_errors=True)
            if self.durable and unsettled:
                self.objects.unreserve(pending.bytes)
            raise

    def commit(
        self,
        model: str,
        version: int,
        publish_id: str = "solo",
        expected_parts: int | None = None,
        meta: dict[str, Any] | None = None,
        counted: Callable[[int], None] | None = None,
    ) -> Manifest:
        """Make the publish ``publish_id`` visible as ``model`` version ``version``: assemble
        partly written chunks from fragments, check every chunk of every tensor is there,
        write the manifest and rename the staging directory into place (atomically).
        ``counted``: as :meth:`writer`'s, for the chunks assembled here."""
        staging = self._staging(model, version, publish_id)
        parts = sorted((staging / "parts").glob("*.json")) if staging.is_dir() else []
        if expected_parts is not None and len(parts) != expected_parts:
            raise PublishIncomplete(
                f"publish {publish_id} of {model!r} v{version} has {len(parts)} closed writers, expected {expected_parts}"
            )
        if not parts:
            raise PublishIncomplete(
                f"publish {publish_id} of {model!r} v{version} has no closed writer"
            )
        tensors: dict[str, dict[str, Any]] = {}
        pointers: dict[str, str] = {}
        fragments: list[dict[str, Any]] = []
        for path in parts:
            part = json.loads(path.read_text())
            for name, t in part["tensors"].items():
                if tensors.setdefault(name, t) != t:
                    raise StateMismatch(
                        f"writers disagree on tensor {name!r}: {tensors[name]} vs {t}"
                    )
            for key, digest in part["pointers"].items():
                if pointers.setdefault(key, digest) != digest:
                    raise VersionConflict(
                        f"two writers wrote different bytes to {key} of {model!r} v{version}"
                    )
            fragments.extend(part["fragments"])
        _check_fragments_cover(tensors, fragments, pointers, f"{model!r} v{version}")
        # From here to the rename into place, no collection runs (see gc): the objects this
        # publish deduplicated against cannot vanish under it.
        with self._collection_lock(shared=True):
            return self._commit_locked(
                staging, model, version, tensors, pointers, fragments, meta, counted
            )

    def _commit_locked(
        self,
        staging: Path,
        model: str,
        version: int,
        tensors: dict[str, dict[str, Any]],
        pointers: dict[str, str],
        fragments: list[dict[str, Any]],
        meta: dict[str, Any] | None,
        counted: Callable[[int], None] | None = None,
    ) -> Manifest:
        touched = _Touched(staging / "touched" / f"commit-{uuid.uuid4().hex}")
        pending = staging / "pending" if self.durable else None
        for key, chunk in _assembled_chunks(staging, tensors, fragments):
            pointers[key] = self.objects.put(
                memoryview(chunk).cast("B"), touch=touched, pending=pending, counted=counted
            )
        entries = {}
        for name, t in tensors.items():
            shape, chunks = tuple(t["shape"]), tuple(t["chunks"])
            digests = {}
            missing = []
            for ck in chunk_keys(shape, chunks):
                digest = pointers.get(f"{name}/{ck}")
                if digest is None:
                    missing.append(ck)
                else:
                    digests[ck] = digest
            if missing:
                raise PublishIncomplete(
                    f"tensor {name!r} of {model!r} v{version}: chunks {missing[:5]} (of {len(missing)} "
                    "missing) were written by no writer"
                )
            entries[name] = TensorEntry(name, shape, t["dtype"], chunks, digests)
        self._settle(staging)
        # Every object is there (a defect elsewhere would show here as a typed refusal, never
        # as a visible version with a hole).
        gone = [
            d
            for e in entries.values()
            for d in e.chunk_digests.values()
            if not self.objects.path(d).exists()
        ]
        if gone:
            raise PublishIncomplete(
                f"{model!r} v{version}: {len(gone)} chunk objects vanished before the commit (collected?); publish again"
            )
        manifest = Manifest(model, version, entries, created=time.time(), meta=dict(meta or {}))
        _write_file(staging / "manifest.json", manifest.to_json().encode(), self.durable)
        shutil.rmtree(staging / "fragments", ignore_errors=True)
        shutil.rmtree(staging / "parts", ignore_errors=True)
        touched.close()
        return self._finish_publish(staging, model, version, manifest)

    def _settle(self, staging: Path) -> None:
        """Make a durable publish's new objects durable and name them in the store: one
        ``syncfs`` for all of them (not an fsync per chunk), then links, then a second
        ``syncfs`` for the links. Until then no other publish dedups against them, so an
        object name in the store always holds durable bytes."""
        pending = staging / "pending"
        names = sorted(os.listdir(pending)) if pending.is_dir() else []
        if not names:
            return
        if not _syncfs(pending):
            for name in names:
                fd = os.open(pending / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        dirs = set()
        for name in names:
            dst = self.objects.path(name)
            if dst.parent not in self.objects._dirs:
                dst.parent.mkdir(parents=True, exist_ok=True)
                self.objects._dirs.add(dst.parent)
            with contextlib.suppress(FileExistsError):
                os.link(pending / name, dst)
            dirs.add(dst.parent)
        if not _syncfs(pending):
            for d in dirs:
                _fsync_dir(d)
        shutil.rmtree(pending, ignore_errors=True)

    def _finish_publish(
        self, staging: Path, model: str, version: int, manifest: Manifest
    ) -> Manifest:
        """Rename a complete staging directory into place (durable first on a durable tier:
        one ``syncfs`` for every array's metadata and directory, where an fsync of each cost
        a fifth of a small model's checkpoint); a version already there is fine if identical,
        a :class:`VersionConflict` if not."""
        final = self._version_dir(model, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        if self.durable and not _syncfs(staging):
            dirs = {staging}
            for p in (staging / "arrays").rglob("zarr.json"):
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
                dirs.update(p.parents[: len(p.relative_to(staging).parts) - 1])
            for d in dirs:  # the entries of every directory on the way, too
                _fsync_dir(d)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():
                raise
            existing = self.manifest(model, version)
            shutil.rmtree(staging, ignore_errors=True)
            if {n: e.digest for n, e in existing.tensors.items()} != {
                n: e.digest for n, e in manifest.tensors.items()
            }:
                raise VersionConflict(
                    f"{model!r} v{version} was already published with other content; publish a new version"
                ) from None
            return existing
        if self.durable:
            _fsync_dir(final.parent)
        # The manifest refers to every object now: the publish's records of use can go.
        shutil.rmtree(final / "touched", ignore_errors=True)
        logger.info(
            "published %s v%d (%d tensors) in %s", model, version, len(manifest.tensors), self.root
        )
        return manifest

    # --- reading -----------------------------------------------------------------------------

    def read(
        self,
        model: str,
        version: int,
        name: str,
        region: tuple[slice, ...] | None = None,
        *,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` of a published version, or its ``region`` (canonical coordinates):
        only the chunks the region overlaps are fetched, each checked against its digest.
        ``shape``/``dtype``: what the caller expects of the whole tensor (else
        :class:`StateMismatch`). ``out``: a contiguous CPU tensor of the region's shape and
        the tensor's dtype to read into (e.g. a pinned buffer); it is returned. From a memory
        tier, nothing lands in ``out`` unless every chunk was found intact (see
        :meth:`read_many`)."""
        manifest = self.manifest(model, version)
        allocation = Allocation()
        fetches, result = plan_read(
            self.objects, manifest, name, region, shape, dtype, out, allocation
        )
        run_reads(self.objects, fetches, allocation)
        return result()

    def read_many(
        self,
        model: str,
        version: int,
        regions: dict[str, tuple[slice, ...] | None],
        out: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Several tensors (or regions) of one version at once: every chunk of every tensor
        shares the I/O threads (no wait between tensors). ``out``: tensors to read into, by
        name (as :meth:`read`'s ``out``).

        From a memory tier (``durable=False``) every chunk is mapped and checked before any
        is copied, so a corrupt or missing chunk raises with nothing written to ``out``: a
        caller may read straight into live tensors. From a disk tier chunks land and are
        checked one by one (straight into the output, without a buffer between), so ``out``
        may be partly written when one of them fails."""
        return self._read_many(model, version, regions, out)()

    def read_many_checked(
        self,
        model: str,
        version: int,
        regions: dict[str, tuple[slice, ...] | None],
        out: dict[str, torch.Tensor] | None = None,
    ) -> Callable[[], dict[str, torch.Tensor]]:
        """:meth:`read_many` from a memory tier in two steps: every chunk mapped and checked
        now (a corrupt or missing one raises here), nothing copied into ``out`` yet; the
        function returned copies them and returns the tensors. The ranks of a group agree
        between the two that each could read its part, so that none reads into its
        parameters unless all can."""
        if self.durable:
            raise ValueError("a disk tier's read writes as it checks: read_many alone")
        return self._read_many(model, version, regions, out)

    def _read_many(
        self,
        model: str,
        version: int,
        regions: dict[str, tuple[slice, ...] | None],
        out: dict[str, torch.Tensor] | None,
    ) -> Callable[[], dict[str, torch.Tensor]]:
        manifest = self.manifest(model, version)  # (once: every tensor's entry is in it)
        allocation = Allocation()
        plans = [
            plan_read(
                self.objects, manifest, name, region, None, None, (out or {}).get(name), allocation
            )
            for name, region in regions.items()
        ]
        copy = fetch_reads(self.objects, [f for fetches, _ in plans for f in fetches], allocation)

        def finish() -> dict[str, torch.Tensor]:
            copy()
            return {name: result() for name, (_, result) in zip(regions, plans, strict=True)}

        return finish

    def read_with_zarr(
        self, model: str, version: int, name: str, region: tuple[slice, ...] | None = None
    ) -> torch.Tensor:
        """The same as :meth:`read`, through Zarr's own array machinery (slower): proof that a
        version is a valid Zarr array, and the oracle of the fast path in the tests."""
        entry = self.manifest(model, version).tensors.get(check_name(name))
        if entry is None:
            raise TensorNotFound(f"{model!r} v{version} has no tensor {name!r}")
        bounds = _region(entry.shape, region)
        pointers = {f"{name}/{ck}": d for ck, d in entry.chunk_digests.items()}
        zstore = _VersionZarrStore(
            self._version_dir(model, version) / "arrays", self.objects, pointers, read_only=True
        )
        arr = zarr.open_array(store=zstore, path=name, mode="r")
        data = arr[tuple(slice(a, b) for a, b in bounds)] if entry.shape else arr[...]
        return from_storage(np.asarray(data), entry.dtype)

    def read_all(self, model: str, version: int) -> dict[str, torch.Tensor]:
        return self.read_many(model, version, dict.fromkeys(self.manifest(model, version).tensors))

    def copy_version_from(self, src: StateStore, model: str, version: int) -> int:
        """Publish ``src``'s ``model`` version ``version`` here, bit for bit (a tier move:
        DRAM -> NVMe eviction, NVMe -> DRAM promotion). Only objects this store lacks are
        copied, each verified against its digest on the way; the version appears atomically
        like any publish. Returns the bytes copied (0: already here)."""
        if self.has_version(model, version):
            return 0
        what = f"{model!r} v{version} (copy to {self.root})"
        return self.import_version(
            src.manifest(model, version),
            lambda digests: {d: src.objects.share(d, what) for d in digests},
        )

    def import_version(
        self,
        manifest: Manifest,
        fetch: Callable[[list[str]], Mapping[str, bytes | memoryview]],
        batch_bytes: int = IMPORT_BATCH_BYTES,
        counted: Callable[[int], None] | None = None,
    ) -> int:
        """Publish the version ``manifest`` describes, taking the objects this store lacks from
        ``fetch`` (a list of digests -> their bytes; another tier, another node's store). They
        are asked for in batches of about ``batch_bytes``, in the order the tensors list them,
        :data:`IMPORT_AHEAD` of them in flight while those that arrived are stored (the
        transfers overlap the writes), and each is checked against its digest on arrival
        (:class:`CorruptState` naming it otherwise, and nothing is published); the version
        appears atomically like any publish. Returns the bytes fetched (0: the version was
        already here). ``counted``: as :meth:`writer`'s."""
        model, version = manifest.check().model, manifest.version
        if self.has_version(model, version):
            return 0
        publish_id = f"import-{uuid.uuid4().hex}"
        staging = self._staging(model, version, publish_id)
        touched = _Touched(staging / "touched" / "import")
        pending = staging / "pending" if self.durable else None
        sizes: dict[str, int] = {}
        for entry in manifest.tensors.values():
            itemsize = np.dtype(DTYPES[entry.dtype][1]).itemsize
            nbytes = int(np.prod(entry.chunks, dtype=np.int64)) * itemsize
            for digest in entry.chunk_digests.values():
                sizes.setdefault(digest, nbytes)
        what = f"{model!r} v{version} (import to {self.root})"

        def store_batch(batch: list[str], got: Mapping[str, bytes | memoryview]) -> int:
            total = 0
            for digest in batch:
                data = got.get(digest)
                if data is None:
                    raise CorruptState(f"{what}: the source has no object {digest}")
                if self.objects.put(data, pending=pending, counted=counted) != digest:
                    raise CorruptState(
                        f"{what}: object {digest} arrived with other bytes (corrupted in transit "
                        "or at the source)"
                    )
                total += len(data)
            return total

        try:
            touched.many(sizes)  # (before looking: see Objects.put)
            missing = [d for d in sizes if not self.objects.refresh(d)]
            batches: list[list[str]] = []
            size = batch_bytes
            for digest in missing:
                if size + sizes[digest] > batch_bytes:
                    batches.append([])
                    size = 0
                batches[-1].append(digest)
                size += sizes[digest]
            # Threads of their own for the requests, which mostly wait on the source; the
            # batches that arrived are stored on the I/O threads meanwhile, a few at a time
            # (each holds its bytes until it is stored).
            requests = ThreadPoolExecutor(IMPORT_AHEAD, thread_name_prefix="plexrl-import")
            storing: deque[Future[int]] = deque()
            try:
                todo = iter(batches)
                ahead = deque(
                    (b, requests.submit(fetch, b)) for b in itertools.islice(todo, IMPORT_AHEAD)
                )
                # The version's metadata while the first batches are on their way.
                for name, entry in manifest.tensors.items():
                    _ensure_array_metadata(
                        staging / "arrays", name, entry.shape, entry.dtype, entry.chunks
                    )
                staging.mkdir(parents=True, exist_ok=True)
                _write_file(staging / "manifest.json", manifest.to_json().encode(), self.durable)
                fetched = 0
                while ahead:
                    batch, arriving = ahead.popleft()
                    got = arriving.result()
                    ahead.extend((b, requests.submit(fetch, b)) for b in itertools.islice(todo, 1))
                    storing.append(_io_pool().submit(store_batch, batch, got))
                    if len(storing) > IMPORT_STORING:
                        fetched += storing.popleft().result()
                while storing:
                    fetched += storing.popleft().result()
            finally:
                # After a failure: no more requests, and no store left writing behind it.
                requests.shutdown(cancel_futures=True)
                wait([f for f in storing if not f.cancel()])
            touched.close()
            with self._collection_lock(shared=True):
                self._settle(staging)
                gone = [d for d in sizes if not self.objects.path(d).exists()]
                if gone:  # pragma: no cover - the protocol of gc() rules it out
                    raise PublishIncomplete(f"import of {what}: {len(gone)} objects vanished")
                self._finish_publish(staging, model, version, manifest)
        finally:
            touched.close()
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return fetched

    # --- space -------------------------------------------------------------------------------

    def delete_version(self, model: str, version: int) -> None:
        """Unpublish a version (its objects are freed by the next :meth:`gc` if unshared)."""
        final = self._version_dir(model, version)
        if not final.is_dir():
            raise VersionNotFound(f"{model!r} has no published version {version}")
        trash = self.root / "staging" / f".deleted-{uuid.uuid4().hex}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.rename(final, trash)  # invisible at once, then removed
        shutil.rmtree(trash, ignore_errors=True)
        self._manifests.pop((model, version), None)

    def usage(self) -> dict[str, int]:
        return {
            "object_bytes": self.objects.used_bytes(),
            "versions": sum(len(self.versions(m)) for m in self.models()),
        }
