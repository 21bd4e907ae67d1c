"""A replica's state in the state stores, as the request functions of
:mod:`plexrl_dask.worker.ops` need it: checkpoints on the node's NVMe tier or in a store at a
path, published weights on the node's DRAM tier, versions imported from another node's tiers,
and who may read them. Each builder returns the call a request runs on its backend.

Part of the worker's engine (:mod:`plexrl_dask.worker`): it imports the store (Zarr, torch)
at its top and is loaded only on workers, where the rest of the worker reaches the node's
handle (:func:`node_state`) and the exchange of versions between nodes (``peer``) through it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from distributed import get_worker

from plexrl_dask.errors import (
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    InvalidStateKey,
    NotAStore,
    PermissionDenied,
    PlexRLError,
    WeightsMismatch,
)
from plexrl_dask.shared.records import split_name
from plexrl_dask.state_store import peer
from plexrl_dask.state_store.keys import check_model, check_version, derived_model, model_key
from plexrl_dask.state_store.node import NodeState, node_state
from plexrl_dask.state_store.store import MARKER as STORE_MARKER
from plexrl_dask.state_store.store import StateStore
from plexrl_dask.worker.holder import holder_of
from plexrl_dask.worker.ops import routing
from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

logger = logging.getLogger(__name__)

__all__ = [
    "drop_older",
    "node_state",
    "peer",
    "publishing",
    "restoring",
    "saving",
    "weights_loading",
]

Call = Callable[[Any], Any]


def saving(
    deployment: str,
    path: str | None,
    publish_id: str,
    model: str | None,
    weights_only: bool = False,
) -> Call:
    """The call of ``ops.save_state(format="store")``: a version of ``model`` (default the
    deployment's :func:`~plexrl_dask.state_store.keys.model_key`) on this node's NVMe tier, or in the store at
    ``path``; returns its reference. ``weights_only``: the parameters without the optimizer
    state (what a sampler of them needs)."""
    name = model or model_key(deployment)

    def open_target() -> tuple[NodeState | None, StoreCheckpoint]:
        if path is None:
            node = node_of(deployment)
            target = StoreCheckpoint(
                node.store("nvme"), name, node=node, tier="nvme", deployment=deployment
            )
            return node, target
        try:
            store = open_store(path, create=True)
            return None, StoreCheckpoint(store, name, deployment=deployment)
        except OSError as e:
            raise CheckpointError(f"cannot write a checkpoint at {path!r}: {e}") from e

    def call(backend: Any) -> dict[str, Any]:
        # Every rank opens the store before any collective: one that cannot (the path on its
        # node, its manager) fails together with the others, whose state stays as it was.
        node, target = backend._checked(open_target)
        if node is not None:

            def opener(version: int, nbytes: int) -> Any:
                return node.writing(name, version, nbytes, tiers=("nvme",), publish_id=publish_id)
        else:

            def opener(version: int, nbytes: int) -> Any:
                return target.store.writer(name, version, publish_id)

        if weights_only:
            ref = backend.publish_weights(target, publish_id, opener)
        else:
            ref = backend.save_state(target, publish_id, opener)
        if node is not None:  # on this node's tier: where ranks on other nodes import it from
            ref["node"], ref["source"] = node.node_id, get_worker().address
        return ref

    return call


def restoring(
    deployment: str,
    checkpoint: str | Mapping[str, Any],
    model: str | None,
    version: int | None,
    optimizer: bool,
) -> Call:
    """The call of ``ops.load_state``: find the checkpoint (importing it from another node's
    tier if it is there), check the deployment may read it, load it."""
    if isinstance(checkpoint, Mapping):
        checked_checkpoint(checkpoint)

    def find() -> str | StoreCheckpoint:
        return readable_source(deployment, checkpoint, model, version, "load_state")

    def call(backend: Any) -> int:
        # Finding the checkpoint may import it from another node: a rank that fails there
        # fails with the others, not alone (they would wait for it in a collective).
        source = backend._checked(find)
        if optimizer is not True:  # (a rollout backend has no optimizer to leave out)
            return backend.load_state(source, optimizer=False)
        return backend.load_state(source)

    return call


def publishing(deployment: str, store_version: int, publish_id: str) -> Call:
    """The call of ``ops.publish_weights``: the parameters as ``store_version`` of
    ``weights.<deployment>`` on this node's DRAM tier; rank 0 drops the versions before the
    previous one (:func:`drop_older`)."""
    model = derived_model("weights", deployment)

    def call(backend: Any) -> dict[str, Any]:
        node = node_of(deployment)

        def opener(version: int, nbytes: int) -> Any:
            # DRAM only: the writers of one publish must share a tier (a rank diverted to
            # NVMe would leave the commit without its part); the manager evicts to make room.
            return node.writing(model, version, nbytes, tiers=("dram",), publish_id=publish_id)

        target = StoreCheckpoint(
            node.store("dram"), model, store_version, node=node, tier="dram", deployment=deployment
        )
        ref = backend.publish_weights(target, publish_id, opener)
        ref["node"] = node.node_id
        ref["source"] = get_worker().address
        if backend._rank() == 0:
            drop_older(node, model, store_version)
        return ref

    return call


def weights_loading(deployment: str, ref: Mapping[str, Any]) -> Call:
    """The call of ``ops.load_weights``: import the published version into this node's tiers
    if it was published on another node, check the deployment may read it, load it."""
    model, version = checked_reference(ref)

    def call(backend: Any) -> int:
        node = node_of(deployment)
        here = ref.get("node") == node.node_id

        def fetch() -> None:
            if here:
                return
            if not ref.get("source"):
                raise WeightsMismatch(
                    f"weights published on node {ref.get('node')!r} name no worker to import "
                    f"them from onto node {node.node_id!r}"
                )
            peer.pull_version(node, get_worker(), str(ref["source"]), model, version)

        # Every rank takes part, so a rank that fails to import fails with the others rather
        # than leaving them waiting for it in a collective.
        backend._checked(fetch)
        with node.pinned(model, version, promote=True) as (store, _):
            check_readable(deployment, store.manifest(model, version).meta, "load_weights")
            loaded = backend.load_weights(StoreCheckpoint(store, model, version))
        if not here:
            # The version before this one stayed until now: its objects deduplicated the
            # import (unchanged tensors did not cross the network again). Dropped after the
            # load, so that collecting its objects does not compete with the load.
            drop_older(node, model, version)
        return loaded

    return call


def checked_reference(ref: Any) -> tuple[str, int]:
    """The (store model, version) of a reference :func:`publishing` returned, checked on the
    worker before anything reads it (every rank gets the same reference, so every rank
    refuses it alike, before any collective): :class:`WeightsMismatch` if it is malformed."""
    if not isinstance(ref, Mapping):
        raise WeightsMismatch(f"a weights reference is a mapping, got {type(ref).__name__}")
    try:
        model, version = check_model(ref["model"]), check_version(ref["version"])
    except (KeyError, InvalidStateKey) as e:
        raise WeightsMismatch(f"a malformed weights reference ({e!r}): {dict(ref)!r}") from None
    _optional_strings(ref, ("node", "source"), WeightsMismatch)
    return model, version


def checked_checkpoint(ckpt: Mapping[str, Any]) -> None:
    """:class:`CheckpointError` unless ``ckpt`` has the shape :func:`saving` gives a checkpoint
    (a ``path``; ``model``, ``version``, ``node`` and ``source`` where given), checked before
    any rank's path depends on it: a rank on the checkpoint's node reads ``path`` where the
    others import from ``source``, so a malformed one must fail on every rank alike."""
    if not isinstance(ckpt.get("path"), str) or not ckpt["path"]:
        raise CheckpointError(f"a checkpoint names its path, got {dict(ckpt)!r}")
    try:
        if ckpt.get("model") is not None:
            check_model(ckpt["model"])
        if ckpt.get("version") is not None:
            check_version(ckpt["version"])
    except InvalidStateKey as e:
        raise CheckpointError(f"a malformed checkpoint ({e}): {dict(ckpt)!r}") from None
    _optional_strings(ckpt, ("node", "source", "format"), CheckpointError)
    if ckpt.get("source") and (ckpt.get("model") is None or ckpt.get("version") is None):
        # (a rank off the checkpoint's node imports model@version from the source)
        raise CheckpointError(
            f"a checkpoint with a source names its model and version: {dict(ckpt)!r}"
        )


def _optional_strings(record: Mapping[str, Any], keys: tuple[str, ...], error: type) -> None:
    for key in keys:
        if record.get(key) is not None and not isinstance(record[key], str):
            raise error(f"{key!r} is a string where given, got {record[key]!r}")


def readable_source(
    deployment: str,
    checkpoint: str | Mapping[str, Any],
    model: str | None,
    version: int | None,
    op: str,
) -> str | StoreCheckpoint:
    """What ``op`` of ``deployment`` reads ``checkpoint`` from (:func:`checkpoint_source`),
    once :func:`check_readable` allows a stored version (one that is missing is left for the
    backend's read to report)."""
    source = checkpoint_source(deployment, checkpoint, model, version)
    if not isinstance(source, str):  # (a store version: whose state it is)
        found = None
        with contextlib.suppress(PlexRLError):
            found = source.store.manifest(source.model, source.version)
        if found is not None:
            check_readable(deployment, found.meta, op)
    return source


def check_readable(deployment: str, meta: Mapping[str, Any], op: str) -> None:
    """:class:`PermissionDenied` unless the stored state described by ``meta`` (written by
    deployment ``meta["deployment"]``) belongs to ``deployment``'s job, or its owner shared
    ``get_weights`` with the job that runs this request (the scheduler lists those
    deployments in the request's ``readable``). State written without an owner (before
    owners were recorded, or by other tools) is anyone's."""
    writer = meta.get("deployment")
    if not isinstance(writer, str) or writer == deployment:
        return
    try:
        if split_name(writer)[1] == split_name(deployment)[1]:
            return  # the same job's
    except PlexRLError:
        pass
    ann = routing(get_worker(), deployment)
    if writer in (ann.get("readable") or ()):
        return
    raise PermissionDenied(
        f"{op}: that state is deployment {writer!r}'s, of another job; its owner can share it "
        f"with job {ann.get('job')!r}: share(job, ops=('get_weights',)) on {writer!r}"
    )


def drop_older(node: NodeState, model: str, newest: int) -> None:
    """Delete ``model``'s versions on ``node`` older than the one before ``newest``
    (weights versions, increasing). The one before stays: a rollout replica may still have
    its load of it queued behind another job's request on its worker while another replica
    already sampled the next step, whose training then published ``newest``; it goes with
    the next publish. Newer versions than ``newest`` are never touched. Both tiers: the
    version before, unused while it waits, is what DRAM evicts first, and one left on NVMe
    would stay there for good (a copy of the weights per sync)."""
    versions = sorted({v for tier in ("dram", "nvme") for v in node.store(tier).versions(model)})
    before = [v for v in versions if v < newest]
    for old in before[:-1]:
        with contextlib.suppress(PlexRLError):  # one being read stays until later
            node.delete(model, old, tiers=("dram", "nvme"))


def node_of(deployment: str) -> NodeState:
    """This worker's node state store (:class:`CheckpointError` where it has none)."""
    holder = holder_of(get_worker())
    if holder is None or holder.node is None:
        raise CheckpointError(
            f"{deployment!r}: this worker has no node state store; pass a checkpoint path"
        )
    return holder.node


def open_store(path: str, create: bool = False) -> StateStore:
    """The state store at ``path`` (created if ``create``), with the checkpoint errors a
    caller expects."""
    try:
        return StateStore(path, create=create)
    except NotAStore as e:
        if not create and not os.path.exists(path):
            raise CheckpointNotFound(f"no checkpoint at {path!r}") from None
        raise CheckpointIncompatible(str(e)) from None


def checkpoint_source(
    deployment: str, ckpt: str | Mapping[str, Any], model: str | None, version: int | None
) -> str | StoreCheckpoint:
    """What a backend loads from: a DCP directory, or a version of a store."""
    if isinstance(ckpt, Mapping):
        if ckpt.get("format") == "dcp":
            return str(ckpt["path"])
        elsewhere = import_from_peer(deployment, ckpt, model, version)
        if elsewhere is not None:
            return elsewhere
        path, model, version = (
            str(ckpt["path"]),
            model or ckpt.get("model"),
            (ckpt.get("version") if version is None else version),
        )
    else:
        path = os.fspath(ckpt)
        if not os.path.isfile(os.path.join(path, STORE_MARKER)):
            return path  # DCP (or nothing: the DCP reader says which)
    node = None
    with contextlib.suppress(CheckpointError):
        node = node_of(deployment)
    if node is not None and os.path.realpath(path) == os.path.realpath(node.store("nvme").root):
        store = node.store("nvme")
    else:
        store = open_store(path)
    if model is None:
        models = store.models()
        own = model_key(deployment)
        model = own if own in models or len(models) != 1 else models[0]
    return StoreCheckpoint(store, str(model), None if version is None else int(version))


def import_from_peer(
    deployment: str, ckpt: Mapping[str, Any], model: str | None, version: int | None
) -> StoreCheckpoint | None:
    """A checkpoint ``ops.save_state`` wrote on another node's tier, imported into this node's
    NVMe tier from the worker that wrote it (only the objects this node lacks); None when
    ``ckpt`` is on this node or names no node."""
    if "node" not in ckpt or not ckpt.get("source"):
        return None
    node = node_of(deployment)
    if ckpt["node"] == node.node_id:
        return None
    name = str(model or ckpt["model"])
    number = int(ckpt["version"] if version is None else version)
    tier, _ = peer.pull_version(
        node, get_worker(), str(ckpt["source"]), name, number, tiers=("nvme",)
    )
    return StoreCheckpoint(node.store(tier), name, number)
