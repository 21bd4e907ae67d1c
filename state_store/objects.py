"""Content-addressed objects: the chunk bytes of one store, each named by its digest.

An object is the bytes of one chunk of the canonical grid (:mod:`~plexrl_dask.state_store.keys`),
stored as ``objects/ab/abcdef...`` under its 128-bit content digest (:func:`digest_of`): identical
bytes are stored once, whatever wrote them. Objects are immutable. One is written completely to
an unnamed or temporary file (fsynced on a durable tier, or all at once by a durable publish's
commit), then linked into place, never replacing an existing one: readers and dedup never see a
partial object. Every read checks the bytes against their digest (:class:`CorruptState`). On a
memory tier an object is read by mapping its file (:meth:`Objects.view`): no copy until the
bytes land where they go (a tensor, a socket, another tier).

Also here: the I/O threads and per-thread scratch buffers that writers and readers share, and
the file helpers (atomic writes, fsyncs) of the layers above.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import xxhash

from plexrl_dask.errors import CorruptState, TierFull

logger = logging.getLogger(__name__)


def digest_of(data: bytes | memoryview) -> str:
    """A chunk's content digest: XXH3-128. It is not cryptographic. It detects corruption and
    identifies identical chunks for dedup, where an accidental collision is about 2^-128
    likely. It runs at ~11 GB/s on one core here, against blake2b's 0.7, and the tier
    bandwidth targets include the hashing. Stores inside one cluster's trust boundary need
    no more."""
    return xxhash.xxh3_128_hexdigest(data)


_LIBC: Any = None
with contextlib.suppress(OSError, AttributeError):
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.syncfs  # noqa: B018 (present on Linux)


def _syncfs(path: Path) -> bool:
    """Flush the whole filesystem holding ``path`` (Linux ``syncfs``); False if unavailable."""
    if _LIBC is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return _LIBC.syncfs(fd) == 0
    finally:
        os.close(fd)


def _through_temp(
    path: Path, data: bytes | memoryview, sync: bool, place: Callable[[Path, Path], None]
) -> None:
    """Write ``data`` completely (fsynced if ``sync``) to a temporary file beside ``path``,
    then ``place(temporary, path)``: ``os.link`` never replaces (a name appears only with all
    its bytes), ``os.replace`` does, atomically."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        place(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | memoryview, durable: bool) -> None:
    """Write ``path`` atomically (temporary name, then rename), fsynced when ``durable``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class Tally:
    """The bytes of the new objects one write stored (``put``'s ``counted``, told from the
    I/O threads): that write's share of what the tier gained, whatever other writes of the
    process do at the same time."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes


@dataclass
class IOStats:
    """Bytes moved by one store object (instrumentation for the benchmarks and tests)."""

    objects_written: int = 0
    bytes_written: int = 0
    dedup_hits: int = 0
    bytes_deduplicated: int = 0
    objects_repaired: int = 0  # stored objects found damaged by a write that reused them
    bytes_read: int = 0
    chunks_read: int = 0
    #: Bytes of the buffers reads allocated: the tensors a read without ``out`` returns, and
    #: the growth of the I/O threads' scratch buffers a read needed (a read into ``out`` from
    #: a memory tier allocates none: chunks are mapped and copied into place).
    bytes_allocated: int = 0
    #: The most one read (one ``read`` or ``read_many``) allocated, since the store was made
    #: or :meth:`reset_peak`: a reader's peak extra memory for the read, as the store counts it.
    peak_read_allocation: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def read_allocated(self, nbytes: int) -> None:
        """Count one read's allocation (see :attr:`peak_read_allocation`)."""
        with self.lock:
            self.bytes_allocated += nbytes
            self.peak_read_allocation = max(self.peak_read_allocation, nbytes)

    def reset_peak(self) -> None:
        """Start :attr:`peak_read_allocation` again from 0 (as ``tracemalloc.reset_peak``)."""
        with self.lock:
            self.peak_read_allocation = 0


class Allocation:
    """The bytes one read allocates, added from the I/O threads that run its fetches."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.nbytes += nbytes


T = TypeVar("T")

_POOL: ThreadPoolExecutor | None = None
_DISK_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


_SCRATCH = threading.local()


def _scratch(nbytes: int, allocation: Allocation | None = None) -> np.ndarray:
    """A reusable byte buffer of this thread (fresh multi-MB allocations page-fault on every
    touch: reusing one keeps chunk copies at memory speed); a buffer it has to make (the
    thread's first, or a larger one) is counted in ``allocation``."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 4 << 20), dtype=np.uint8)
        if allocation is not None:
            allocation.add(buf.nbytes)
    return buf[:nbytes]


def _run_fetches(fetches: list[Callable[[], T]], disk: bool) -> list[T]:
    """Run chunk fetches on the I/O threads (inline when there is one) and return their
    results; ``disk``: they read a store on a disk, whose reads wait on the device more than
    they compute."""
    if len(fetches) <= 1:
        return [f() for f in fetches]
    return list((_disk_read_pool() if disk else _io_pool()).map(lambda f: f(), fetches))


def _io_pool() -> ThreadPoolExecutor:
    """Threads that overlap chunk writes and memory-tier reads (file I/O and hashing release
    the GIL)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                # One per core (at least 2, to overlap file I/O with hashing and copying): more
                # threads than cores made tmpfs writes 2x slower here (GIL contention).
                max_workers=max(2, min(8, os.cpu_count() or 1)),
                thread_name_prefix="plexrl-store",
            )
        return _POOL


def _disk_read_pool() -> ThreadPoolExecutor:
    """Threads for reads from a disk tier: twice as many as cores (at least 4), so the device
    sees several requests at once while other threads hash. Cold NVMe-tier reads here went
    from 0.76-0.84 to 0.87-1.25 of a raw sequential read with 4 threads instead of 2
    (``benchmarks/RESULTS.md``)."""
    global _DISK_POOL
    with _POOL_LOCK:
        if _DISK_POOL is None:
            _DISK_POOL = ThreadPoolExecutor(
                max_workers=max(4, min(16, 2 * (os.cpu_count() or 1))),
                thread_name_prefix="plexrl-store-disk",
            )
        return _DISK_POOL


def _object_files(root: Path) -> Iterator[os.DirEntry[str]]:
    """Every file of an objects directory (``ab/abcdef...``; temporaries, dot files, too),
    found with ``scandir``: a collection walks every object twice, and ``Path.glob`` cost
    about as much as the rest of it."""
    try:
        shards = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for shard in shards:
        try:
            files = list(os.scandir(shard.path))
        except FileNotFoundError:
            continue
        yield from files


class Objects:
    """Content-addressed chunk bytes of one store, with an optional capacity."""

    def __init__(
        self, root: Path, durable: bool, capacity_bytes: int | None, stats: IOStats
    ) -> None:
        self.root = root
        self.durable = durable
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self._lock = threading.Lock()
        self._used: int | None = None
        self._dirs: set[Path] = set()
        # Unnamed temporaries (O_TMPFILE, linked into place when complete): no name to
        # create and remove per object. Off where the filesystem or /proc does not allow it.
        self._tmpfile = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def used_bytes(self) -> int:
        with self._lock:
            return self._used_locked()

    def unreserve(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` of pending objects that their publish discarded."""
        with self._lock:
            if self._used is not None:
                self._used -= nbytes

    def scan_bytes(self) -> int:
        """Walk the objects and return their total size (exact, whoever wrote them)."""
        total = self._walk_bytes()
        with self._lock:
            self._used = total
        return total

    def _walk_bytes(self) -> int:
        total = 0
        for file in _object_files(self.root):
            if not file.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    total += file.stat().st_size
        return total

    def _used_locked(self) -> int:
        if self._used is None:
            self._used = self._walk_bytes()
        return self._used

    def refresh(self, digest: str) -> bool:
        """Whether object ``digest`` is stored, refreshing its age if it is (collection never
        deletes an object younger than its grace period: see :meth:`put`)."""
        try:
            os.utime(self.path(digest))
        except FileNotFoundError:
            return False
        return True

    def put(
        self,
        data: bytes | memoryview,
        touch: Callable[[str], None] | None = None,
        pending: Path | None = None,
        counted: Callable[[int], None] | None = None,
    ) -> str:
        """Store ``data`` once; returns its digest. ``counted(nbytes)`` runs when this call
        wrote a new object (not when it found one): what a write added to the tier. Safe to
        call from several threads: the capacity is reserved before the bytes are written.
        ``touch(digest)`` runs before the object is looked up or written: a writer records
        there that it uses the object, so that collection keeps it (see :meth:`StateStore.gc`). ``pending``: a durable
        publish's directory of new objects, which its commit makes durable all at once and
        names in the store (:meth:`StateStore._settle`); until then only that publish sees
        them."""
        digest = digest_of(data)
        if touch is not None:
            touch(digest)
        path = self.path(digest)
        n = len(data)
        try:
            # Refresh its age: gc never deletes an object younger than its grace period, so an
            # unreferenced object a new publish is about to refer to survives a concurrent gc.
            os.utime(path)
        except FileNotFoundError:
            pass  # not stored (or collected just now): store it
        else:
            # Reused only once its bytes are checked: a publish that deduplicated onto a
            # damaged object would report success and never load. Hashing what is stored
            # costs less than the write it saves (~11 GB/s).
            if self._intact(path, digest, n):
                self.stats.add(dedup_hits=1, bytes_deduplicated=n)
            else:
                self._repair(path, data, sync=self.durable)
            return digest
        with self._lock:
            used = self._used_locked()
            if self.capacity_bytes is not None and used + n > self.capacity_bytes:
                raise TierFull(
                    f"store {self.root.parent} is full: {used} of {self.capacity_bytes} bytes used, "
                    f"{n} more needed; stored versions are intact (free some with delete_version "
                    "+ gc, or raise the capacity)"
                )
            self._used = used + n  # reserved
        stored = False
        try:
            target = path if pending is None else pending / digest
            if target.parent not in self._dirs:
                target.parent.mkdir(parents=True, exist_ok=True)
                self._dirs.add(target.parent)
            # Written completely (and fsynced on a durable tier, unless the commit does it for
            # the whole publish) before it gets its name: readers and dedup never see a
            # partial object. Linking never replaces: of two writers of the same bytes, the
            # first wins.
            with contextlib.suppress(FileExistsError):
                stored = self._write_new(target, data, sync=self.durable and pending is None)
            if stored:
                self.stats.add(objects_written=1, bytes_written=n)
                if counted is not None:
                    counted(n)
            else:
                self.stats.add(dedup_hits=1, bytes_deduplicated=n)
        finally:
            if not stored:
                with self._lock:
                    self._used -= n  # release the reservation
        return digest

    @staticmethod
    def _intact(path: Path, digest: str, nbytes: int) -> bool:
        """Whether the object at ``path`` holds exactly the ``nbytes`` bytes of ``digest``."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size != nbytes:
                return False
            if nbytes == 0:  # (mmap refuses an empty file)
                return digest_of(b"") == digest
            with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as view:
                return digest_of(view) == digest
        finally:
            os.close(fd)

    def _repair(self, path: Path, data: bytes | memoryview, sync: bool) -> None:
        """Put ``data`` in place of the damaged object at ``path`` (atomically: a reader sees
        the old file or the whole new one; one that mapped the old file keeps it)."""
        _through_temp(path, data, sync, os.replace)
        if sync:
            _fsync_dir(path.parent)
        with self._lock:
            self._used = None  # (the damaged file's size may have differed: walk again)
        self.stats.add(objects_repaired=1, objects_written=1, bytes_written=len(data))
        logger.warning("repaired damaged chunk object %s in %s", path.name, self.root)

    def _write_new(self, path: Path, data: bytes | memoryview, sync: bool) -> bool:
        if self._tmpfile:
            dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                try:
                    fd = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o644, dir_fd=dirfd)
                except OSError:
                    self._tmpfile = False  # (e.g. a filesystem without O_TMPFILE)
                else:
                    try:
                        _write_all(fd, data)
                        if sync:
                            os.fsync(fd)
                        # linkat(..., AT_SYMLINK_FOLLOW): CPython uses linkat (which follows
                        # the /proc link to the open file) only when given a dir fd.
                        os.link(
                            f"/proc/self/fd/{fd}", path.name, dst_dir_fd=dirfd, follow_symlinks=True
                        )
                        return True
                    finally:
                        os.close(fd)
            finally:
                os.close(dirfd)
        _through_temp(path, data, sync, os.link)
        return True

    def _open_sized(self, digest: str, what: str, nbytes: int | None) -> tuple[int, int]:
        """An open descriptor of object ``digest`` and its size, which must be ``nbytes``
        (None: any); :class:`CorruptState` if it is missing or of another size."""
        try:
            fd = os.open(self.path(digest), os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptState(
                f"{what}: chunk object {digest} is missing from {self.root}"
            ) from None
        size = os.fstat(fd).st_size
        if nbytes is not None and size != nbytes:
            os.close(fd)
            raise CorruptState(f"{what}: chunk object {digest} has {size} bytes, expected {nbytes}")
        return fd, size

    def _verified(self, data: bytes | memoryview, digest: str, what: str) -> None:
        """:class:`CorruptState` unless ``data`` (an object's bytes just read) is ``digest``'s;
        counts the read."""
        if digest_of(data) != digest:
            raise CorruptState(
                f"{what}: chunk object {digest} does not match its digest (corrupted bytes)"
            )
        nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
        self.stats.add(bytes_read=nbytes, chunks_read=1)

    def get_into(self, digest: str, what: str, out: memoryview) -> None:
        """Read object ``digest``, which must be exactly ``len(out)`` bytes, into ``out`` and
        verify it (``what`` names it in errors)."""
        fd, size = self._open_sized(digest, what, len(out))
        try:
            done = 0
            while done < size:
                got = os.readv(fd, [out[done:]])
                if got == 0:
                    raise CorruptState(f"{what}: chunk object {digest} ended early")
                done += got
        finally:
            os.close(fd)
        self._verified(out, digest, what)

    def view(self, digest: str, what: str, nbytes: int | None = None) -> memoryview:
        """Object ``digest`` as a read-only view of its file mapped into memory, verified
        (``what`` names it in errors; ``nbytes``: the size it must have). Nothing is copied:
        on a memory tier the view is the tier's own pages. Mapped, hashed and copied in user
        space, a shared-memory object was read here at 2.6 GB/s, against 1.2 GB/s through
        ``read`` into a buffer. Objects are immutable, so the view stays valid until it is
        released, even if the object is collected meanwhile."""
        fd, size = self._open_sized(digest, what, nbytes)
        try:
            # (mmap refuses an empty file; no chunk is empty, and the digest says so)
            view = memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b"")
        finally:
            os.close(fd)
        self._verified(view, digest, what)
        return view

    def share(self, digest: str, what: str) -> bytes | memoryview:
        """The verified bytes of ``digest`` to hand on (to another tier, to a peer node): its
        mapped :meth:`view` on a memory tier (no copy), read into memory from a disk tier
        (one sequential read rather than page faults)."""
        return self.get(digest, what) if self.durable else self.view(digest, what)

    def get(self, digest: str, what: str, pending: Path | None = None) -> bytes:
        """The bytes of ``digest``, verified (``what`` names them in errors); ``pending``: a
        publish's own new objects, looked at too."""
        try:
            try:
                data = self.path(digest).read_bytes()
            except FileNotFoundError:
                if pending is None:
                    raise
                data = (pending / digest).read_bytes()
        except FileNotFoundError:
            raise CorruptState(
                f"{what}: chunk object {digest} is missing from {self.root}"
            ) from None
        self._verified(data, digest, what)
        return data


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]
