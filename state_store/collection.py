"""Garbage collection of a store's objects: mark and sweep, safe against concurrent writers.

An object (:mod:`~plexrl_dask.state_store.objects`) is garbage when nothing refers to it: no
published version's manifest, no closed writer's part and no publish in progress (whose writers
record every object they use in ``staging/.../touched/`` *before* looking it up or writing it).
:meth:`CollectionMixin.gc` recomputes those references from the files every time
(:meth:`~CollectionMixin.live_digests`), so counts can never drift, and removes the staging
directories of crashed publishes. A collection and a commit exclude each other through the
store's collection lock (:meth:`~CollectionMixin._collection_lock`: exclusive for a
collection, shared by commits and imports), so the objects a publish deduplicated against
cannot vanish before it is visible.

This module: :class:`CollectionMixin`, the collection half of
:class:`~plexrl_dask.state_store.store.StateStore`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl_dask.errors import StoreBusy, VersionNotFound
from plexrl_dask.state_store.objects import _object_files

if TYPE_CHECKING:
    from plexrl_dask.state_store.keys import Manifest
    from plexrl_dask.state_store.objects import Objects

#: Bound on waiting for a store's collection lock (a collection walks every object once).
_COLLECTION_LOCK_TIMEOUT_S = 120.0


def _last_activity(staging: Path) -> float:
    """When a staging directory last changed (its records of use grow as it writes)."""
    times = [0.0]
    for p in (staging, *(staging / "touched").glob("*")):
        with contextlib.suppress(FileNotFoundError):
            times.append(p.stat().st_mtime)
    return max(times)


def _touched_digests(staging: Path) -> set[str]:
    """The objects that the writers and the commit of the publish in ``staging`` recorded
    as used (``touched/*``: one digest a line)."""
    out: set[str] = set()
    for path in (staging / "touched").glob("*"):
        with contextlib.suppress(FileNotFoundError):
            out.update(line for line in path.read_text().split() if line)
    return out


class CollectionMixin:
    """Reference counting and collection of a store's objects (see the module docstring);
    mixed into :class:`~plexrl_dask.state_store.store.StateStore`, which provides the store
    root, its objects and its published versions."""

    if TYPE_CHECKING:
        root: Path
        objects: Objects

        def models(self) -> list[str]: ...

        def versions(self, model: str) -> list[int]: ...

        def manifest(self, model: str, version: int | None = None) -> Manifest: ...

    def refcounts(self) -> dict[str, int]:
        """How many (version, chunk) places refer to each object."""
        counts: dict[str, int] = {}
        for model in self.models():
            for version in self.versions(model):
                for entry in self.manifest(model, version).tensors.values():
                    for digest in entry.chunk_digests.values():
                        counts[digest] = counts.get(digest, 0) + 1
        return counts

    def live_digests(
        self, exclude: tuple[str, int] | None = None, staging_grace_s: float = 3600.0
    ) -> set[str]:
        """Every object something may still refer to: published versions (but ``exclude``),
        closed writers' parts and the records of use of publishes in progress (staging
        directories active within ``staging_grace_s``; older ones are abandoned)."""
        live: set[str] = set()
        now = time.time()
        staging_root = self.root / "staging"
        for st in staging_root.glob("*/*") if staging_root.is_dir() else ():
            if st.parent.name.startswith(".") or now - _last_activity(st) > staging_grace_s:
                continue
            live |= _touched_digests(st)
            for part in (st / "parts").glob("*.json"):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    live.update(json.loads(part.read_text())["pointers"].values())
        # Versions after staging: a publish renames its staging directory into versions/, so
        # one that moves while we look is seen on one side or the other, never on neither.
        for model in self.models():
            for version in self.versions(model):
                if (model, version) != exclude:
                    with contextlib.suppress(VersionNotFound):
                        live |= self.manifest(model, version).digests()
        return live

    def gc(self, grace_s: float = 3600.0, staging_grace_s: float = 3600.0) -> dict[str, int]:
        """Delete objects nothing refers to (:meth:`live_digests`) and untouched for
        ``grace_s``; remove staging directories inactive for ``staging_grace_s`` (a crashed
        publish).

        Exact without a grace period. A writer records each object it uses in its staging
        directory *before* it looks the object up (and writes it when absent); a commit
        verifies and names its objects under a shared lock. A collection holds that lock
        exclusively and: takes the live set; renames every other object out of the way;
        takes the live set again; renames back what became live meanwhile (a writer that
        found it before the rename recorded it before, so the second look sees it; a writer
        that looked after the rename found nothing and wrote its own copy) and deletes the
        rest. No commit can see the objects renamed in between."""
        now = time.time()
        keep_after = now - grace_s
        removed_staging = 0
        staging_root = self.root / "staging"
        for st in list(staging_root.glob("*/*")) if staging_root.is_dir() else ():
            if not st.parent.name.startswith(".") and now - _last_activity(st) > staging_grace_s:
                shutil.rmtree(st, ignore_errors=True)
                removed_staging += 1
        # Versions a deletion renamed out of sight and did not finish removing (it crashed):
        # nothing reads them, and each would hold a version's metadata for good.
        for trash in list(staging_root.glob(".deleted-*")) if staging_root.is_dir() else ():
            shutil.rmtree(trash, ignore_errors=True)
            removed_staging += 1
        objects_root = self.root / "objects"
        freed = deleted = 0
        with self._collection_lock(shared=False):
            live = self.live_digests(staging_grace_s=staging_grace_s)
            doomed: list[tuple[Path, Path, int]] = []
            for file in _object_files(objects_root):
                try:
                    st = file.stat()
                except FileNotFoundError:
                    continue
                if file.name.startswith("."):
                    if now - st.st_mtime > staging_grace_s:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(file.path)  # a temporary of a crashed writer
                    continue
                if file.name in live or st.st_mtime >= keep_after:
                    continue
                path = Path(file.path)
                aside = path.with_name(f".gc-{path.name}-{uuid.uuid4().hex[:8]}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, aside)
                    doomed.append((path, aside, st.st_size))
            if doomed:
                live = self.live_digests(staging_grace_s=staging_grace_s)
            for path, aside, size in doomed:
                if path.name in live:
                    with contextlib.suppress(FileExistsError):  # a writer stored it again
                        os.link(aside, path)
                else:
                    freed += size
                    deleted += 1
                aside.unlink(missing_ok=True)
            # A full walk: exact again, whoever wrote meanwhile.
            kept = self.objects.scan_bytes()
        return {
            "objects_deleted": deleted,
            "bytes_freed": freed,
            "staging_removed": removed_staging,
            "objects_live": len(live),
            "object_bytes": kept,
        }

    @contextlib.contextmanager
    def _collection_lock(self, shared: bool) -> Any:
        """The store's collection lock (an ``flock`` on ``<root>/gc.lock``, across
        processes): shared by commits, exclusive for :meth:`gc`. Waits at most
        ``_COLLECTION_LOCK_TIMEOUT_S``, then raises :class:`StoreBusy`."""
        fd = os.open(self.root / "gc.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
            deadline = time.monotonic() + _COLLECTION_LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreBusy(
                            f"store {self.root}: the collection lock stayed taken for "
                            f"{_COLLECTION_LOCK_TIMEOUT_S:.0f}s; nothing was changed"
                        ) from None
                    time.sleep(0.002)
            yield
        finally:
            os.close(fd)  # releases the lock
