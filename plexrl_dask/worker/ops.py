"""The narrow model API as plain task functions.

Each function runs as an ordinary Dask task on the worker that holds the deployment, and uses
that worker's replica holder in-process. :class:`~plexrl_dask.Deployment` methods submit these;
users can submit them too::

    with dask.annotate(plexrl=policy.annotation()):  # deployment, job, its secret
        fut = client.submit(plexrl_dask.worker.ops.forward, policy.name, batch, pure=False)

The ``plexrl`` annotation is what lets the scheduler plugin park the task and release it, in
order, on the deployment's worker (optional keys: ``replica`` to aim at one of a rollout
deployment's replicas, or ``None`` to let the scheduler pick any replica (for reads: every
replica holds the same weights); ``request``/``rank``/``ranks`` are set by the runtime for multi-rank
calls). A task without it fails with :class:`NotRouted` instead of silently loading a second,
divergent replica somewhere else.

The scheduler unpickles these functions by reference (it deserialises every task it is
sent), so this module imports the model stack and the store (torch, Zarr) only inside the
functions that run on workers: the scheduler stays without them
(``plexrl_dask.models.spec`` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from plexrl_dask.errors import (
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    NoPlexRLWorkers,
    NotAStore,
    NotRouted,
    PermissionDenied,
    PlexRLError,
    WeightsMismatch,
    from_status,
    raise_for_status,
)
from plexrl_dask.shared.checks import (
    checked_adamw,
    checked_batch,
    checked_loss,
    checked_sample,
    checked_temperature,
    checked_weights,
)
from plexrl_dask.shared.records import DeploymentInfo, split_name
from plexrl_dask.shared.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    ForwardBackwardResult,
    ForwardResult,
    Loss,
    NamedWeights,
    SampleResult,
    SamplingParams,
    Streams,
    as_batch,
)
from plexrl_dask.worker.holder import ReplicaHolder, holder_of

if TYPE_CHECKING:
    from plexrl_dask.state_store.store import StateStore
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

logger = logging.getLogger(__name__)

#: How long a task waits for its worker's holder to appear (a worker that just started).
_HOLDER_WAIT_S = 10.0
#: Deployment records fetched from the scheduler, by uid (records of a uid never change).
_INFO_CACHE: dict[str, DeploymentInfo] = {}


def _worker_and_holder() -> tuple[Any, ReplicaHolder]:
    from distributed import get_worker

    worker = get_worker()
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while (holder := holder_of(worker)) is None:
        if time.monotonic() > deadline:
            raise NoPlexRLWorkers(
                f"worker {worker.address} has no PlexRL replica holder: it does not advertise "
                "the GPU resource or the PlexRL worker plugin is not installed"
            )
        time.sleep(0.05)
    return worker, holder


def _routing(worker: Any, deployment: str) -> dict[str, Any]:
    from distributed.worker import thread_state

    ts = worker.state.tasks.get(thread_state.key)
    ann = (ts.annotations or {}).get("plexrl") if ts is not None else None
    if not ann or ann.get("deployment") != deployment:
        raise NotRouted(
            f"this {deployment!r} request was not routed by the PlexRL scheduler plugin: submit "
            f"it inside dask.annotate(plexrl={{'deployment': {deployment!r}}}) or use the "
            "Deployment methods, on a cluster with the PlexRL plugins installed"
        )
    if "error" in ann:
        raise from_status(ann["error"])
    if "uid" not in ann:
        raise NotRouted(
            "the PlexRL scheduler plugin is not installed on this cluster's scheduler: use "
            "plexrl_dask.local_cluster() or plexrl_dask.install(client)"
        )
    return ann


def _deployment_info(worker: Any, deployment: str, uid: str) -> DeploymentInfo:
    info = _INFO_CACHE.get(uid)
    if info is None:
        from distributed.utils import sync

        status = sync(
            worker.loop,
            worker.scheduler.plexrl_get_deployment,
            name=deployment,
            callback_timeout=30,
        )
        info = DeploymentInfo.from_dict(raise_for_status(status)["deployment"])
        _INFO_CACHE[uid] = info
    return info


def _run(deployment: str, op: str, call: Any) -> Any:
    from distributed import get_worker

    ann = _routing(get_worker(), deployment)  # routing errors first: they need no holder
    worker, holder = _worker_and_holder()
    # The record is cached by uid; whether its state was modified since is the plugin's
    # current word, sent along with every request.
    info = _deployment_info(worker, deployment, ann["uid"]).with_(
        modified=bool(ann.get("modified"))
    )
    group = None
    if info.world_size > 1:
        from plexrl_dask.worker.groups import GroupContext

        group = GroupContext(
            uid=info.uid,
            epoch=int(ann["epoch"]),
            rank=int(ann["rank"]),
            world_size=info.world_size,
            replica=int(ann.get("group", 0)),
            token=str(ann.get("rendezvous", "")),
        )
    return holder.run(info, op, call, group)


# --- the API ---------------------------------------------------------------------------------


def load(deployment: str) -> dict[str, Any]:
    """Make the deployment's replica resident on its worker (building it if needed)."""
    return _run(
        deployment,
        "load",
        lambda b: {
            "version": int(b.version),
            "bytes": int(b.state_bytes()),
            "device": str(b.device),
        },
    )


def forward(deployment: str, batch: Sequence[Datum], temperature: float = 1.0) -> ForwardResult:
    """Per-token log-probabilities of each datum (aligned with its tokens)."""

    def call(backend: Any) -> ForwardResult:
        args = backend._checked(lambda: (checked_batch(batch), checked_temperature(temperature)))
        out = backend.forward(*args)
        return ForwardResult(logprobs=()) if _echo(backend) else out

    return _run(deployment, "forward", call)


def _echo(backend: Any) -> bool:
    """Whether this rank computed a result its rank 0 returns (a tensor-parallel rank)."""
    return getattr(backend, "whole_on_every_rank", False) and backend._rank() != 0


def forward_backward(
    deployment: str, batch: Sequence[Datum], loss: Loss = CrossEntropy(), logprobs: bool = False
) -> dict[str, float] | ForwardBackwardResult:
    """Accumulate the gradient of ``loss`` over ``batch``; returns the loss and metrics (with
    ``logprobs``: a :class:`ForwardBackwardResult`, the per-token log-probabilities too)."""

    def call(backend: Any) -> dict[str, float] | ForwardBackwardResult:
        args = backend._checked(lambda: (checked_batch(batch), checked_loss(loss)))
        return backend.forward_backward(*args, logprobs is True)

    return _run(deployment, "forward_backward", call)


def optim_step(deployment: str, params: AdamWParams = AdamWParams()) -> dict[str, float]:
    """Apply the accumulated gradients (AdamW, gradient clipping) and clear them."""
    return _run(
        deployment, "optim_step", lambda b: b.optim_step(b._checked(lambda: checked_adamw(params)))
    )


def train_step(
    deployment: str,
    batch: Sequence[Datum],
    loss: Loss = CrossEntropy(),
    params: AdamWParams = AdamWParams(),
) -> dict[str, dict[str, float]]:
    """:func:`forward_backward` then :func:`optim_step` in one request: both checked before
    either runs, the same arithmetic as the two requests. Returns ``{"forward_backward":
    ..., "optim_step": ...}``, each what its request would have returned."""

    def call(backend: Any) -> dict[str, dict[str, float]]:
        args = backend._checked(
            lambda: (checked_batch(batch), checked_loss(loss), checked_adamw(params))
        )
        return backend.train_step(*args)

    return _run(deployment, "train_step", call)


def sample(
    deployment: str,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams = SamplingParams(),
    prompt_ids: Sequence[int] | None = None,
    streams: Streams | None = None,
) -> SampleResult:
    """``params.n`` completions of each prompt (strings or token ids).

    ``prompt_ids`` key each prompt's randomness (default: its position); a caller that splits
    one logical request into several passes the global positions, so the split changes nothing.
    ``streams``: how rows are continuously batched (default: the worker's
    ``plexrl.sampling.*``).
    """

    def call(backend: Any) -> SampleResult:
        args = backend._checked(
            lambda: checked_sample(prompts, params, prompt_ids, streams, part=True)
        )
        tokens = backend.tokenize(args[0])
        groups = backend.sample(tokens, *args[1:])
        if _echo(backend):
            return SampleResult(prompt_tokens=(), sequences=())
        return SampleResult(
            prompt_tokens=tuple(tuple(t) for t in tokens),
            sequences=tuple(tuple(g) for g in groups),
        )

    return _run(deployment, "sample", call)


def get_weights(deployment: str, names: Sequence[str] | None = None) -> NamedWeights:
    """Host copies of the parameters by canonical name, with the replica's version."""
    return _run(
        deployment,
        "get_weights",
        lambda b: NamedWeights(version=int(b.version), tensors=b.get_weights(names)),
    )


def set_weights(
    deployment: str,
    weights: NamedWeights | Mapping[str, Any],
    version: int | None = None,
    strict: bool = True,
) -> int:
    """Overwrite parameters by canonical name; returns the replica's new version (that of
    ``weights`` when it is :class:`NamedWeights` and ``version`` is not given)."""
    if isinstance(weights, NamedWeights):
        version = weights.version if version is None else version
        weights = weights.tensors

    def call(backend: Any) -> int:
        def check() -> None:
            checked_weights(weights)
            if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
                raise WeightsMismatch(f"version must be an int or None, got {version!r}")

        backend._checked(check)
        backend.set_weights(weights, version=version, strict=strict)
        return int(backend.version)

    return _run(deployment, "set_weights", call)


def save_state(
    deployment: str,
    path: str | None = None,
    publish_id: str = "solo",
    format: str = "store",
    model: str | None = None,
) -> dict[str, Any]:
    """Checkpoint the deployment (parameters + optimizer state); every rank of a sharded
    deployment writes only its own shards. ``format="store"``: a durable version of a state
    store, the node's NVMe tier when ``path`` is None (else a store at ``path``, e.g. on a
    shared filesystem), named after the deployment and numbered by its version; every rank
    passes the same ``publish_id`` (``model``: the store model, default the deployment's
    :func:`checkpoint_model`). ``format="dcp"``: torch DCP at ``path`` (export).
    Ranks on other nodes than rank 0's send their shards to rank 0, which writes them there.
    Returns ``{"path", "model", "version", "format"}`` (and, on the node's tier, ``"node"`` and
    ``"source"``: its node and a worker there), which :func:`load_state` accepts."""
    from distributed import get_worker

    if format == "dcp":
        if path is None:
            raise CheckpointError("a DCP checkpoint needs a path")
        return _run(deployment, "save_state", lambda b: b.save_state(path))
    if format != "store":
        raise CheckpointError(f"unknown checkpoint format {format!r}: 'store' or 'dcp'")

    name = model or checkpoint_model(deployment)

    def call(backend: Any) -> dict[str, Any]:
        from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

        model = name

        def open_target() -> tuple[Any, StoreCheckpoint]:
            if path is None:
                node = _node(deployment)
                target = StoreCheckpoint(
                    node.store("nvme"), model, node=node, tier="nvme", deployment=deployment
                )
                return node, target
            try:
                store = _open_store(path, create=True)
                return None, StoreCheckpoint(store, model, deployment=deployment)
            except OSError as e:
                raise CheckpointError(f"cannot write a checkpoint at {path!r}: {e}") from e

        # Every rank opens the store before any collective: one that cannot (the path on its
        # node, its manager) fails together with the others, whose state stays as it was.
        node, target = backend._checked(
            open_target, CheckpointError("another rank could not open the checkpoint store")
        )
        store = target.store
        if path is None:

            def opener(version: int, nbytes: int) -> Any:
                return node.writing(model, version, nbytes, tiers=("nvme",), publish_id=publish_id)
        else:

            def opener(version: int, nbytes: int) -> Any:
                return store.writer(model, version, publish_id)

        ref = backend.save_state(target, publish_id, opener)
        if path is None:  # on this node's tier: where ranks on other nodes import it from
            ref["node"], ref["source"] = node.node_id, get_worker().address
        return ref

    return _run(deployment, "save_state", call)


def load_state(
    deployment: str,
    checkpoint: str | Mapping[str, Any],
    model: str | None = None,
    version: int | None = None,
    optimizer: bool = True,
) -> int:
    """Restore a checkpoint written at any world size; returns its version. ``checkpoint``:
    what :func:`save_state` returned, a DCP directory, or the path of a state store (then
    ``model``, default the deployment's own name or the store's only model, and ``version``,
    default the latest). Each rank reads only the regions its layout holds. Without
    ``optimizer``, parameters only: the optimizer starts afresh."""

    def call(backend: Any) -> int:
        # Finding the checkpoint may import it from another node: a rank that fails there
        # fails with the others, not alone (they would wait for it in a collective).
        def find() -> Any:
            source = _checkpoint_source(deployment, checkpoint, model, version)
            if not isinstance(source, str):  # (a store version: whose state it is)
                found = None
                with contextlib.suppress(PlexRLError):  # (missing: the backend says so)
                    found = source.store.manifest(source.model, source.version)
                if found is not None:
                    _check_readable(deployment, found.meta, "load_state")
            return source

        source = backend._checked(
            find,
            CheckpointError("another rank of this deployment could not reach the checkpoint"),
        )
        if optimizer is not True:  # (a rollout backend has no optimizer to leave out)
            return backend.load_state(source, optimizer=False)
        return backend.load_state(source)

    return _run(deployment, "load_state", call)


def publish_weights(deployment: str, store_version: int, publish_id: str) -> dict[str, Any]:
    """Publish the deployment's parameters to the node's DRAM tier as ``store_version`` of
    ``weights.<deployment>`` (each rank its own shard regions; tensors unchanged since an
    earlier publish are deduplicated, not rewritten), and drop its older published versions.
    Returns the reference :func:`load_weights` takes: the version, its node, and a worker of
    that node that serves it to other nodes."""
    from distributed import get_worker

    from plexrl_dask.state_store.keys import derived_model

    model = derived_model("weights", deployment)

    def call(backend: Any) -> dict[str, Any]:
        node = _node(deployment)

        def opener(version: int, nbytes: int) -> Any:
            # DRAM only: the writers of one publish must share a tier (a rank diverted to
            # NVMe would leave the commit without its part); the manager evicts to make room.
            return node.writing(model, version, nbytes, tiers=("dram",), publish_id=publish_id)

        from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

        target = StoreCheckpoint(
            node.store("dram"), model, store_version, node=node, tier="dram", deployment=deployment
        )
        ref = backend.publish_weights(target, publish_id, opener)
        ref["node"] = node.node_id
        ref["source"] = get_worker().address
        if backend._rank() == 0:
            _drop_older(node, model, store_version)
        return ref

    return _run(deployment, "publish_weights", call)


def _check_readable(deployment: str, meta: Mapping[str, Any], op: str) -> None:
    """:class:`PermissionDenied` unless the stored state described by ``meta`` (written by
    deployment ``meta["deployment"]``) belongs to ``deployment``'s job, or its owner shared
    ``get_weights`` with the job that runs this request (the scheduler lists those
    deployments in the request's ``readable``). State written without an owner (before
    owners were recorded, or by other tools) is anyone's."""
    from distributed import get_worker

    writer = meta.get("deployment")
    if not isinstance(writer, str) or writer == deployment:
        return
    try:
        if split_name(writer)[1] == split_name(deployment)[1]:
            return  # the same job's
    except PlexRLError:
        pass
    ann = _routing(get_worker(), deployment)
    if writer in (ann.get("readable") or ()):
        return
    raise PermissionDenied(
        f"{op}: that state is deployment {writer!r}'s, of another job; its owner can share it "
        f"with job {ann.get('job')!r}: share(job, ops=('get_weights',)) on {writer!r}"
    )


def _drop_older(node: Any, model: str, keep: int) -> None:
    """Delete ``model``'s DRAM versions other than ``keep`` on ``node`` (weights versions:
    only the newest is read again)."""
    for old in node.store("dram").versions(model):
        if old != keep:
            with contextlib.suppress(PlexRLError):  # one being read stays until later
                node.delete(model, old, tiers=("dram",))


def load_weights(deployment: str, ref: Mapping[str, Any]) -> int:
    """Overwrite the parameters with a version :func:`publish_weights` made, reading only what
    this replica's layout holds; returns the weights' version. A version published on another
    node is first imported into this node's tiers from the worker that published it, once per
    node and only the objects this node lacks (:mod:`plexrl_dask.state_store.peer`)."""
    from distributed import get_worker

    from plexrl_dask.state_store import peer
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

    model, version = str(ref["model"]), int(ref["version"])

    def call(backend: Any) -> int:
        node = _node(deployment)
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
        backend._checked(
            fetch, WeightsMismatch("another rank of this deployment could not import the weights")
        )
        with node.pinned(model, version, promote=True) as (store, _):
            _check_readable(deployment, store.manifest(model, version).meta, "load_weights")
            loaded = backend.load_weights(StoreCheckpoint(store, model, version))
        if not here:
            # The version before this one stayed until now: its objects deduplicated the
            # import (unchanged tensors did not cross the network again). Dropped after the
            # load, so that collecting its objects does not compete with the load.
            _drop_older(node, model, version)
        return loaded

    return _run(deployment, "load_weights", call)


async def drop_checkpoint(model: str, version: int, dask_worker: Any = None) -> bool:
    """Delete version ``version`` of store model ``model`` from this worker's node tiers (run
    with ``Client.run``: a relocation's transient checkpoint); False if the node had none."""
    holder = holder_of(dask_worker)
    if holder is None or holder.node is None:
        return False

    def delete() -> bool:
        try:
            return any(holder.node.delete(model, version).values())
        except PlexRLError as e:  # being read right now, or the manager is gone: left there
            logger.warning("could not delete %s v%d on this node: %s", model, version, e)
            return False

    # (a call to the node's manager: not on the worker's event loop)
    return await asyncio.get_running_loop().run_in_executor(None, delete)


def checkpoint_model(deployment: str) -> str:
    """The store model name of a deployment's checkpoints (:func:`~plexrl_dask.state_store.keys.model_key`)."""
    from plexrl_dask.state_store.keys import model_key  # (the scheduler unpickles this module)

    return model_key(deployment)


def _node(deployment: str) -> Any:
    from distributed import get_worker

    holder = holder_of(get_worker())
    if holder is None or holder.node is None:
        raise CheckpointError(
            f"{deployment!r}: this worker has no node state store; pass a checkpoint path"
        )
    return holder.node


def _open_store(path: str, create: bool = False) -> StateStore:
    from plexrl_dask.state_store.store import StateStore

    try:
        return StateStore(path, create=create)
    except NotAStore as e:
        if not create and not os.path.exists(path):
            raise CheckpointNotFound(f"no checkpoint at {path!r}") from None
        raise CheckpointIncompatible(str(e)) from None


def _checkpoint_source(
    deployment: str, ckpt: str | Mapping[str, Any], model: str | None, version: int | None
) -> str | StoreCheckpoint:
    """What a backend loads from: a DCP directory, or a version of a store."""
    from plexrl_dask.state_store.store import MARKER as STORE_MARKER
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

    if isinstance(ckpt, Mapping):
        if ckpt.get("format") == "dcp":
            return str(ckpt["path"])
        elsewhere = _import_from_peer(deployment, ckpt, model, version)
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
        node = _node(deployment)
    if node is not None and os.path.realpath(path) == os.path.realpath(node.store("nvme").root):
        store = node.store("nvme")
    else:
        store = _open_store(path)
    if model is None:
        models = store.models()
        own = checkpoint_model(deployment)
        model = own if own in models or len(models) != 1 else models[0]
    return StoreCheckpoint(store, str(model), None if version is None else int(version))


def _import_from_peer(
    deployment: str, ckpt: Mapping[str, Any], model: str | None, version: int | None
) -> StoreCheckpoint | None:
    """A checkpoint :func:`save_state` wrote on another node's tier, imported into this node's
    NVMe tier from the worker that wrote it (only the objects this node lacks); None when
    ``ckpt`` is on this node or names no node."""
    from distributed import get_worker

    from plexrl_dask.state_store import peer
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

    if "node" not in ckpt or not ckpt.get("source"):
        return None
    node = _node(deployment)
    if ckpt["node"] == node.node_id:
        return None
    name = str(model or ckpt["model"])
    number = int(ckpt["version"] if version is None else version)
    tier, _ = peer.pull_version(
        node, get_worker(), str(ckpt["source"]), name, number, tiers=("nvme",)
    )
    return StoreCheckpoint(node.store(tier), name, number)


# --- combining the tasks of one request -------------------------------------------------------

_SUMMED = ("loss", "num_tokens", "total_weight")


def combine(op: str, *results: Any) -> Any:
    """The result of a request run as several tasks (ranks of a group, or replicas), from the
    per-task results in rank/replica order. Runs as a small plain task."""
    if op == "forward":
        return ForwardResult(logprobs=tuple(lp for r in results for lp in r.logprobs))
    if op == "sample":
        return SampleResult(
            prompt_tokens=tuple(t for r in results for t in r.prompt_tokens),
            sequences=tuple(g for r in results for g in r.sequences),
        )
    if op == "forward_backward" and isinstance(results[0], ForwardBackwardResult):
        return ForwardBackwardResult(
            metrics=combine(op, *(r.metrics for r in results)),
            logprobs=tuple(lp for r in results for lp in r.logprobs),
        )
    if op == "forward_backward":
        # Each rank's loss is its share of the whole batch's loss (same normalizer): sum them;
        # per-token averages are re-weighted by each rank's token weight.
        total = sum(r["total_weight"] for r in results)
        merged = {k: float(sum(r[k] for r in results)) for k in _SUMMED}
        for key in sorted(set().union(*results) - set(_SUMMED)):
            merged[key] = float(sum(r.get(key, 0.0) * r["total_weight"] for r in results) / total)
        return merged
    if op == "train_step":
        return {
            "forward_backward": combine(
                "forward_backward", *(r["forward_backward"] for r in results)
            ),
            "optim_step": results[0]["optim_step"],
        }
    return results[0]  # optim_step, get_weights, set_weights, load: rank 0 speaks for all


__all__ = [
    "as_batch",
    "combine",
    "forward",
    "forward_backward",
    "get_weights",
    "load",
    "load_state",
    "load_weights",
    "optim_step",
    "train_step",
    "publish_weights",
    "save_state",
    "sample",
    "set_weights",
]
