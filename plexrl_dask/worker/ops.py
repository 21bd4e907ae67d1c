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
sent), so this module is the worker package's torch-free face: what needs the model stack or
the store runs in the backends and :mod:`plexrl_dask.worker.stores`, reached as attributes of
:mod:`plexrl_dask.worker` that load on a worker's first request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from distributed import get_worker
from distributed.utils import sync
from distributed.worker import thread_state

from plexrl_dask import worker as engine
from plexrl_dask.errors import (
    AdapterNotFound,
    CheckpointError,
    DeploymentDoesNotFit,
    InvalidModelSpec,
    InvalidRecipe,
    NoPlexRLWorkers,
    NotRouted,
    OpNotSupported,
    PlexRLError,
    WeightsMismatch,
    from_status,
    raise_for_status,
)
from plexrl_dask.shared.checks import (
    check_rows,
    checked_adamw,
    checked_batch,
    checked_loss,
    checked_sample,
    checked_temperature,
    checked_top,
    checked_weights,
)
from plexrl_dask.shared.records import DeploymentInfo
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

logger = logging.getLogger(__name__)

#: How long a task waits for its worker's holder to appear (a worker that just started).
_HOLDER_WAIT_S = 10.0
#: Deployment records fetched from the scheduler, by uid (records of a uid never change).
_INFO_CACHE: dict[str, DeploymentInfo] = {}


def _worker_and_holder() -> tuple[Any, ReplicaHolder]:
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


def routing(worker: Any, deployment: str) -> dict[str, Any]:
    """The ``plexrl`` annotation the scheduler plugin put on the running task of a request to
    ``deployment`` (:class:`NotRouted` when it did not route it)."""
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
        status = sync(
            worker.loop,
            worker.scheduler.plexrl_get_deployment,
            name=deployment,
            callback_timeout=30,
        )
        info = DeploymentInfo.from_dict(raise_for_status(status)["deployment"])
        _INFO_CACHE[uid] = info
    return info


#: A request op whose function runs other ops on the replica (each checked against it).
_RUNS = {"sample_train": ("sample", "train_step"), "train_scored": ("train_step",)}


def _run(deployment: str, op: str, call: Any) -> Any:
    ann = routing(get_worker(), deployment)  # routing errors first: they need no holder
    routed = ann.get("op")
    if routed and op not in _RUNS.get(routed, (routed,)):
        # The scheduler checked the job's access against the op the annotation names; the
        # function is what runs: they must agree (a job shared only "sample" cannot send
        # set_weights labelled "sample").
        raise NotRouted(
            f"this task runs {op!r} on {deployment!r} but was routed as {routed!r}: annotate "
            "each request with the op it runs (the Deployment methods do)"
        )
    worker, holder = _worker_and_holder()
    # The record is cached by uid; whether its state was modified since is the plugin's
    # current word, sent along with every request.
    info = _deployment_info(worker, deployment, ann["uid"]).with_(
        modified=bool(ann.get("modified"))
    )
    group = None
    if info.world_size > 1:
        group = engine.groups.GroupContext(
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


def forward(
    deployment: str,
    batch: Sequence[Datum],
    temperature: float = 1.0,
    adapter: str | None = None,
    top: int = 0,
) -> ForwardResult:
    """Per-token log-probabilities of each datum (aligned with its tokens); ``adapter``: an
    adapter bank's adapter to score with; ``top``: each position's most probable tokens too."""

    def call(backend: Any) -> ForwardResult:
        args = backend._checked(lambda: (checked_batch(batch), checked_temperature(temperature)))
        k = backend._checked(lambda: checked_top(top))
        extra = {"top": k} if k else {}  # (a backend that cannot is asked only when it must)
        if adapter is not None:
            return _bank(backend, deployment).forward(*args, adapter=str(adapter), **extra)
        out = backend.forward(*args, **extra)
        return ForwardResult(logprobs=()) if _echo(backend) else out

    return _run(deployment, "forward", call)


def _bank(backend: Any, deployment: str) -> Any:
    """``backend`` if it is an adapter bank; :class:`OpNotSupported` otherwise."""
    if not isinstance(backend, engine.backends.AdapterBank):
        raise OpNotSupported(
            f"{deployment!r} is not an adapter bank (deploy one with backend='adapters')"
        )
    return backend


def load_adapter(
    deployment: str, key: str, spec: Mapping[str, Any], saved: Mapping[str, Any]
) -> int:
    """Load LoRA adapter ``key`` (``spec``: its ``ModelSpec`` as a dict) into the adapter bank
    from ``saved`` (what its deployment's ``save_state`` returned): the stored state must be
    readable by this bank's job (its owner shared ``get_weights``). Returns its version."""
    from plexrl_dask.models.spec import ModelSpec

    def find(backend: Any) -> Any:
        bank = _bank(backend, deployment)
        if not isinstance(key, str) or not key:
            raise InvalidModelSpec(f"an adapter key is a non-empty string, got {key!r}")
        try:
            lora = ModelSpec.from_dict(dict(spec))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidModelSpec(f"adapter {key!r}: not a model spec ({e!r})") from None
        source = engine.stores.readable_source(deployment, saved, None, None, "load_adapter")
        if isinstance(source, str):
            raise CheckpointError("an adapter is loaded from a store checkpoint, not DCP")
        # The bank grows by the adapter: room is made for it first, as for a replica loaded
        # (other replicas offloaded); where none can be, it is refused, the bank unchanged.
        _, holder = _worker_and_holder()
        adding = lora.adapter_bytes("rollout")
        if not holder.room_for(adding, keep=deployment):
            raise DeploymentDoesNotFit(
                f"adapter {key!r} ({adding} bytes) does not fit beside the bank {deployment!r} "
                f"in its worker's budget of {holder.budget_bytes} bytes: drop an adapter first"
            )
        return bank, lora, source

    def call(backend: Any) -> int:
        bank, lora, source = find(backend)
        return bank.load_adapter(key, lora, source)

    return _run(deployment, "load_adapter", call)


def drop_adapter(deployment: str, key: str) -> bool:
    """Unload adapter ``key`` from the adapter bank; whether it was loaded."""
    return _run(deployment, "drop_adapter", lambda b: _bank(b, deployment).drop_adapter(key))


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


def train_scored(
    deployment: str, samples: SampleResult, recipe: bytes, rank: int = 0, ranks: int = 1
) -> dict[str, Any]:
    """Score a GRPO step's ``samples`` with ``recipe`` (sealed: :mod:`plexrl_dask.rl.scoring`) and
    :func:`train_step` on rank ``rank``'s share of the batch, in one request (``ranks``: the
    policy's world size, which the worker checks against its own). Returns
    ``{"scored": ScoredSummary}`` and, when a group taught something, ``train_step``'s
    result; with nothing to learn from, nothing trains (every rank sees the same scores)."""
    return _run(deployment, "train_step", _scored_training(samples, recipe, rank, ranks))


def _scored_training(samples: Any, recipe: Any, rank: int, ranks: int) -> Any:
    """:func:`train_scored`'s call on the backend (``recipe``: sealed, or unsealed here)."""
    # (imported here: plexrl_dask.rl imports the driver, which imports this module)
    from plexrl_dask.rl.scoring import checked_recipe, scored_training

    def call(backend: Any) -> dict[str, Any]:
        def prepare() -> tuple[Any, Any]:
            here = backend._rank(), getattr(backend, "world_size", 1)
            if (rank, ranks) != here:
                raise InvalidRecipe(f"rank {rank} of {ranks} sent to rank {here[0]} of {here[1]}")
            summary, training = scored_training(*checked_recipe(recipe, samples), rank, ranks)
            if training is not None:
                check_rows(len(summary.rewards), "the scored samples")
            return summary, training

        # (one agreement for every rank: the same checks, the same scores, the same data;
        # the batch's tokens are checked by the training itself, as any batch's)
        summary, training = backend._checked(prepare)
        if training is None:
            return {"scored": summary}
        return {"scored": summary, **backend.train_step(*training)}

    return call


def sample_train(
    deployment: str,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams,
    prompt_ids: Sequence[int] | None,
    streams: Streams | None,
    recipe: bytes,
) -> dict[str, Any]:
    """:func:`sample` then :func:`train_scored` on those samples, in one request of a
    single-worker deployment: a colocated GRPO step with no hand-off between its two halves
    (the scheduler would otherwise release the training only once the samples were in). The
    holder runs them as two requests (``sample``, then ``train_step``: their own spans,
    checks, and the weights' change after the second), so every ledger and timeline sees
    what the two requests would show, and the result is :func:`train_scored`'s. A recipe
    that does not unseal fails before anything runs."""
    from plexrl_dask.rl.scoring import unseal_recipe

    opened = unseal_recipe(recipe)
    samples = _run(deployment, "sample", _sampling(prompts, params, prompt_ids, streams))
    return _run(deployment, "train_step", _scored_training(samples, opened, 0, 1))


def sample(
    deployment: str,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams = SamplingParams(),
    prompt_ids: Sequence[int] | None = None,
    streams: Streams | None = None,
    adapters: Sequence[str | None] | None = None,
) -> SampleResult:
    """``params.n`` completions of each prompt (strings or token ids).

    ``prompt_ids`` key each prompt's randomness (default: its position); a caller that splits
    one logical request into several passes the global positions, so the split changes nothing.
    ``streams``: how rows are continuously batched (default: the worker's
    ``plexrl.sampling.*``). ``adapters`` (an adapter bank's): per prompt, the key of the
    adapter it samples with (None: the base).
    """
    call = _sampling(prompts, params, prompt_ids, streams, adapters, deployment)
    return _run(deployment, "sample", call)


def _sampling(
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams,
    prompt_ids: Sequence[int] | None,
    streams: Streams | None,
    adapters: Sequence[str | None] | None = None,
    deployment: str = "",
) -> Any:
    """:func:`sample`'s call on the backend."""

    def call(backend: Any) -> SampleResult:
        args = backend._checked(
            lambda: checked_sample(prompts, params, prompt_ids, streams, part=True)
        )
        tokens = backend.tokenize(args[0], args[1].special_tokens)
        if adapters is not None:
            keys = list(adapters)
            if not all(k is None or isinstance(k, str) for k in keys):
                raise AdapterNotFound("adapter keys are strings (or None: the base)")
            groups = _bank(backend, deployment).sample(tokens, *args[1:], adapters=keys)
        else:
            groups = backend.sample(tokens, *args[1:])
        if _echo(backend):
            return SampleResult(prompt_tokens=(), sequences=())
        return SampleResult(
            prompt_tokens=tuple(tuple(t) for t in tokens),
            sequences=tuple(tuple(g) for g in groups),
        )

    return call


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
    weights_only: bool = False,
) -> dict[str, Any]:
    """Checkpoint the deployment (parameters + optimizer state, or with ``weights_only`` the
    parameters alone, in the store format only); every rank of a sharded
    deployment writes only its own shards. ``format="store"``: a durable version of a state
    store, the node's NVMe tier when ``path`` is None (else a store at ``path``, e.g. on a
    shared filesystem), named after the deployment and numbered by its version; every rank
    passes the same ``publish_id`` (``model``: the store model, default the deployment's
    :func:`~plexrl_dask.state_store.keys.model_key`). ``format="dcp"``: torch DCP at ``path`` (export).
    Ranks on other nodes than rank 0's send their shards to rank 0, which writes them there.
    Returns ``{"path", "model", "version", "format"}`` (and, on the node's tier, ``"node"`` and
    ``"source"``: its node and a worker there), which :func:`load_state` accepts."""
    if format == "dcp":
        if path is None:
            raise CheckpointError("a DCP checkpoint needs a path")
        return _run(deployment, "save_state", lambda b: b.save_state(path))
    if format != "store":
        raise CheckpointError(f"unknown checkpoint format {format!r}: 'store' or 'dcp'")
    if not isinstance(weights_only, bool):
        raise CheckpointError(f"weights_only is true or false, got {weights_only!r}")
    call = engine.stores.saving(deployment, path, publish_id, model, weights_only)
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
    call = engine.stores.restoring(deployment, checkpoint, model, version, optimizer)
    return _run(deployment, "load_state", call)


def publish_weights(deployment: str, store_version: int, publish_id: str) -> dict[str, Any]:
    """Publish the deployment's parameters to the node's DRAM tier as ``store_version`` of
    ``weights.<deployment>`` (each rank its own shard regions; tensors unchanged since an
    earlier publish are deduplicated, not rewritten), and drop its older published versions.
    Returns the reference :func:`load_weights` takes: the version, its node, and a worker of
    that node that serves it to other nodes."""
    call = engine.stores.publishing(deployment, store_version, publish_id)
    return _run(deployment, "publish_weights", call)


def load_weights(deployment: str, ref: Mapping[str, Any]) -> int:
    """Overwrite the parameters with a version :func:`publish_weights` made, reading only what
    this replica's layout holds; returns the weights' version. A version published on another
    node is first imported into this node's tiers from the worker that published it, once per
    node and only the objects this node lacks (:mod:`plexrl_dask.state_store.peer`)."""
    return _run(deployment, "load_weights", engine.stores.weights_loading(deployment, ref))


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


# --- combining the tasks of one request -------------------------------------------------------

_SUMMED = ("loss", "num_tokens", "total_weight")


def combine(op: str, *results: Any, keep: int | None = None) -> Any:
    """The result of a request run as several tasks (ranks of a group, or replicas), from the
    per-task results in rank/replica order (``keep``: a forward's first ``keep`` data, the
    rest being the fillers of ranks past a short batch). Runs as a small plain task."""
    if op == "forward":
        tops = [r.top for r in results if r.logprobs]  # (an echoing rank has neither)
        top = None if any(t is None for t in tops) else tuple(x for t in tops for x in t)
        logprobs = tuple(lp for r in results for lp in r.logprobs)
        if keep is not None:
            logprobs, top = logprobs[:keep], None if top is None else top[:keep]
        return ForwardResult(logprobs=logprobs, top=top)
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
        # Each rank's loss is its share of the whole batch's loss (same normalizer): sum them,
        # and a graph loss's ":sum" metrics; per-token averages are re-weighted by each
        # rank's token weight (a graph loss's ":mean" ones by its data: its total_weight).
        total = sum(r["total_weight"] for r in results)
        summed = {*_SUMMED, *(k for r in results for k in r if k.endswith(":sum"))}
        merged = {k: float(sum(r.get(k, 0.0) for r in results)) for k in sorted(summed)}
        for key in sorted(set().union(*results) - summed):
            merged[key] = float(sum(r.get(key, 0.0) * r["total_weight"] for r in results) / total)
        return merged
    if op == "train_step":
        # (a scored step's ranks agree on its scores; with nothing to learn, none trained)
        if "forward_backward" not in results[0]:
            return results[0]
        return {
            **results[0],
            "forward_backward": combine(
                "forward_backward", *(r["forward_backward"] for r in results)
            ),
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
    "train_scored",
    "train_step",
    "publish_weights",
    "save_state",
    "sample",
    "sample_train",
    "set_weights",
]
