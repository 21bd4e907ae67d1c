"""The scheduler plugin's durable state: a journal in one SQLite file, so that a restarted
scheduler knows the deployments, the jobs and the grants it had.

What is journaled is what cannot be rebuilt from the workers: the deployment registry (every
record, as it changes: registered, placed, lost, relocating, undeployed), the ops owners shared
(:class:`~plexrl_dask.shared.access.Shares`) and the registered jobs (the digests of their
secrets, :class:`~plexrl_dask.shared.access.Principals`). Each change is one transaction,
durable when it returns (WAL, ``synchronous=FULL``); a change that does not alter a record
writes nothing, so requests do not touch the disk.

What is not journaled: requests in flight (their futures fail when the scheduler goes; drivers
submit them again), residency and estimates (the holders report again, the estimates learn
again), the placement of jobs into node groups (jobs are placed again as they deploy), the
operator secret (configured, or written anew). On restart, every restored deployment's
workers are gone (Dask workers do not outlive their scheduler): one whose state was modified
since deploy is ``lost`` until its job restores a checkpoint, the rest are placed again on the
next request (:meth:`plexrl_dask.plugins.deployments.DeploymentRegistry.restore`).

``plexrl.scheduler.journal`` names the file (null: no journal). It must be on a disk that
outlives the scheduler's process (its host's, or a shared one) and is the cluster's alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from plexrl_dask.errors import ConfigError

logger = logging.getLogger(__name__)

V = TypeVar("V")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (kind, key)
)
"""


class Journal:
    """Records by (kind, key), each a JSON value; every write a durable transaction."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise ConfigError(f"plexrl.scheduler.journal: no directory {parent!r}")
        fresh = not os.path.exists(self.path)
        # (the scheduler's event loop and executor threads may write: one lock serialises)
        self._lock = threading.Lock()
        if fresh:
            # Grants and job digests: the cluster's owner's alone, from the first byte (made
            # 0600 before SQLite opens it; its -wal and -shm files take the database's mode).
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def put(self, kind: str, key: str, value: Any) -> None:
        text = json.dumps(value, sort_keys=True)
        with self._lock:
            self._db.execute(
                "INSERT INTO records (kind, key, value) VALUES (?, ?, ?) "
                "ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value",
                (kind, key, text),
            )

    def delete(self, kind: str, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM records WHERE kind = ? AND key = ?", (kind, key))

    def load(self, kind: str) -> dict[str, Any]:
        """Every record of ``kind``; one that is not JSON is skipped with a warning."""
        with self._lock:
            rows = self._db.execute(
                "SELECT key, value FROM records WHERE kind = ? ORDER BY key", (kind,)
            ).fetchall()
        out = {}
        for key, text in rows:
            try:
                out[key] = json.loads(text)
            except ValueError:
                logger.warning(
                    "journal %s: record %s/%s is not JSON; skipped", self.path, kind, key
                )
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()


class JournaledMap(MutableMapping[str, V], Generic[V]):
    """A dict whose every change is written through to a journal (``kind``), each value as
    ``encode(value)``; a set that does not change the encoded value writes nothing."""

    def __init__(
        self,
        journal: Journal | None,
        kind: str,
        encode: Callable[[V], Any],
    ) -> None:
        self._data: dict[str, V] = {}
        self._written: dict[str, Any] = {}
        self.unwritten: set[str] = set()  # keys whose last change the journal failed to take
        self._journal = journal
        self._kind = kind
        self._encode = encode

    def restore(self, decode: Callable[[Any], V]) -> list[str]:
        """Fill this (empty) map with the journal's records, each as ``decode(record)``,
        writing nothing; a record that does not decode is dropped (and said). Returns the
        keys restored."""
        if self._journal is None:
            return []
        for key, record in self._journal.load(self._kind).items():
            try:
                self._data[key] = decode(record)
            except Exception as e:
                logger.warning(
                    "journal: %s record %r does not decode (%s); dropped", self._kind, key, e
                )
                self._journal.delete(self._kind, key)
                continue
            self._written[key] = record
        return list(self._data)

    def __getitem__(self, key: str) -> V:
        return self._data[key]

    def __setitem__(self, key: str, value: V) -> None:
        """Set ``key``; a value that cannot be journaled (not JSON once encoded) is refused
        (:class:`ConfigError`) before anything changes. A journal that fails to write (a
        full disk, a lock) leaves the change made in memory, said in the log: the cluster
        keeps running, and the record is written again with the map's next write that
        succeeds (until then it would not outlive a restart: :attr:`unwritten`)."""
        encoded = None
        if self._journal is not None:
            encoded = self._encode(value)
            try:
                json.dumps(encoded, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"a {self._kind} record is JSON when journaled: {e}") from None
        self._data[key] = value
        if encoded is not None and self._written.get(key) != encoded:
            self._written.pop(key, None)
            if self._write(key, lambda: self._journal.put(self._kind, key, encoded)):
                self._written[key] = encoded

    def __delitem__(self, key: str) -> None:
        del self._data[key]
        if self._journal is not None:
            self._written.pop(key, None)
            self._write(key, lambda: self._journal.delete(self._kind, key))

    def _write(self, key: str, write: Callable[[], None]) -> bool:
        try:
            write()
        except sqlite3.Error as e:
            self.unwritten.add(key)
            logger.error(
                "journal: the %s record %r was not written (%s); it will not outlive a "
                "restart of the scheduler until a later write succeeds", self._kind, key, e,
            )  # fmt: skip
            return False
        self.unwritten.discard(key)
        if self.unwritten:
            self._catch_up()
        return True

    def _catch_up(self) -> None:
        """Write the records whose last change failed to write (the journal works again)."""
        assert self._journal is not None
        for key in list(self.unwritten):
            try:
                if key in self._data:
                    encoded = self._encode(self._data[key])
                    self._journal.put(self._kind, key, encoded)
                    self._written[key] = encoded
                else:
                    self._journal.delete(self._kind, key)
            except sqlite3.Error:
                return  # (still failing: the next write tries again)
            self.unwritten.discard(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"JournaledMap({self._kind!r}, {self._data!r})"


def open_journal(path: str | None) -> Journal | None:
    """The journal at ``path`` (``plexrl.scheduler.journal``), or ``None`` without one."""
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"plexrl.scheduler.journal must be a file path or null, got {path!r}")
    return Journal(os.path.expanduser(path))
