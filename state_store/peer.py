"""Versions between nodes: a node imports a version from another node's tiers over Dask.

A node's tiers are local directories, so a version published on node A (a trainer's weights)
is not visible on node B (a rollout replica's). B gets it by **importing** it: one process of B
asks a worker of A for the version's manifest, then for the objects B's tier lacks, in batches
(several in flight while those that arrived are written), and publishes the version in its own
DRAM tier (:meth:`StateStore.import_version`). So:

- only bytes B does not hold cross the network: tensors unchanged since the last version B
  imported (frozen layers, a reference model's weights) are deduplicated, not sent again;
- one copy per node crosses it, however many replicas of B then read the version (an import
  lock per version on the node: the others wait for it, then find it there);
- every object is checked against its digest on arrival, so bytes corrupted in transit or at
  the source are a :class:`~plexrl_dask.errors.CorruptState` naming the version, never wrong
  weights.

The serving side is two worker handlers (:data:`MANIFEST_HANDLER`, :data:`OBJECTS_HANDLER`),
added by the PlexRL worker plugin to GPU workers. They read with the version pinned on the
serving node (its manager neither evicts nor collects it meanwhile), objects of a memory tier
as views of their files (sent from the tier's pages, not copied first), and answer status dicts:
``{"status": "OK", ...}`` or ``{"status": "error", "error": <PlexRL error name>, "message": ...}``.
Every call is bounded by ``plexrl.state.transfer-timeout``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from plexrl_dask import protocol
from plexrl_dask.errors import (
    ManagerUnavailable,
    PlexRLError,
    StateStoreError,
    raise_for_status,
    to_status,
)
from plexrl_dask.state_store.keys import Manifest, check_model, check_version
from plexrl_dask.state_store.node import NodeState

logger = logging.getLogger(__name__)

MANIFEST_HANDLER = protocol.STORE_MANIFEST
OBJECTS_HANDLER = protocol.STORE_OBJECTS
#: Where a node's imports in progress hold their per-version locks (in the DRAM tier's dir).
IMPORTS_DIR = "imports"
_LOCK_POLL_S = 0.05


def _error(e: Exception) -> dict[str, Any]:
    if not isinstance(e, PlexRLError):
        logger.warning("serving a peer failed", exc_info=e)
        e = StateStoreError(f"{type(e).__name__}: {e}")
    return to_status(e)


def serve_manifest(node: NodeState, model: str, version: int) -> dict[str, Any]:
    """The manifest of ``model`` ``version`` on this node (any tier), as a status dict."""
    try:
        check_model(model), check_version(version)
        with node.pinned(model, version) as (store, _):
            return {"status": "OK", "manifest": store.manifest(model, version).to_json()}
    except Exception as e:  # every failure goes back typed, never as a broken comm
        return _error(e)


def serve_objects(node: NodeState, model: str, version: int, digests: list[str]) -> dict[str, Any]:
    """The objects ``digests`` of ``model`` ``version`` on this node, each verified, as a
    status dict (``objects``: digest -> bytes, or a read-only view of the object's file mapped
    from a memory tier: sent from the tier's own pages, with no copy in this process; it stays
    valid after the pin is released, objects being immutable). Only digests of that version
    are served: a peer cannot read objects of versions it was not given."""
    try:
        check_model(model), check_version(version)
        with node.pinned(model, version) as (store, _):
            known = store.manifest(model, version).digests()
            stray = [d for d in digests if d not in known]
            if stray:
                raise StateStoreError(
                    f"{model!r} v{version} has no objects {stray[:3]} ({len(stray)} asked for)"
                )
            what = f"{model!r} v{version} (served to a peer)"
            return {"status": "OK", "objects": {d: store.objects.share(d, what) for d in digests}}
    except Exception as e:
        return _error(e)


@contextlib.contextmanager
def _import_lock(node: NodeState, model: str, version: int, timeout: float) -> Iterator[None]:
    """One import of a version at a time on a node (other processes wait, bounded)."""
    path = node.dram_path / IMPORTS_DIR / f"{model}@{version}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ManagerUnavailable(
                        f"another process of node {node.node_id} has been importing {model!r} "
                        f"v{version} for over {timeout:.0f} s"
                    ) from None
                time.sleep(_LOCK_POLL_S)
        try:
            yield
        finally:
            # One lock file per version would pile up (a sync makes a version): remove it. A
            # process already waiting on this file then locks an unlinked one beside a newer
            # file's holder: at worst the version is imported twice, which is idempotent.
            path.unlink(missing_ok=True)
            fcntl.flock(f, fcntl.LOCK_UN)


def pull_version(
    node: NodeState,
    worker: Any,
    source: str,
    model: str,
    version: int,
    tiers: tuple[str, ...] = ("dram", "nvme"),
) -> tuple[str, int]:
    """Import ``model`` ``version`` into the first of this node's ``tiers`` with room (DRAM,
    else NVMe, by default; a checkpoint goes to NVMe) from the node of the worker at
    ``source``, called from a task running on ``worker``;
    returns (tier, bytes that crossed the network). A version this node already has costs
    nothing. Raises the serving side's typed error (e.g. :class:`VersionNotFound`), or
    :class:`ManagerUnavailable` when the source does not answer in time."""
    from distributed.utils import sync

    timeout = node.cfg.transfer_timeout_s

    def call(handler: str, **args: Any) -> dict[str, Any]:
        async def rpc() -> dict[str, Any]:
            return await getattr(worker.rpc(source), handler)(**args)

        try:
            reply = sync(worker.loop, rpc, callback_timeout=timeout)
        except (OSError, TimeoutError) as e:
            raise ManagerUnavailable(
                f"worker {source} did not serve {model!r} v{version} ({type(e).__name__}: {e})"
            ) from None
        return raise_for_status(reply)

    check_model(model), check_version(version)  # (before they name the import's lock file)
    with _import_lock(node, model, version, timeout):
        for tier in tiers:
            if node.store(tier).has_version(model, version):
                return tier, 0
        manifest = Manifest.from_json(
            call(MANIFEST_HANDLER, model=model, version=version)["manifest"],
            f"{source}'s manifest of {model!r} v{version}",
        ).check(model, version)

        def fetch(digests: list[str]) -> Mapping[str, bytes | memoryview]:
            return call(OBJECTS_HANDLER, model=model, version=version, digests=digests)["objects"]

        t0 = time.perf_counter()
        tier, fetched = node.import_version(manifest, fetch, tiers=tiers)
        logger.info(
            "imported %s v%d from %s: %.1f MB in %.2f s (%d MB of it already here)",
            model,
            version,
            source,
            fetched / 1e6,
            time.perf_counter() - t0,
            (sum(e.nbytes for e in manifest.tensors.values()) - fetched) // 10**6,
        )
        return tier, fetched
