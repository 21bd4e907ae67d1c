"""The narrow model API as plain task functions.

Each function runs as an ordinary Dask task on the worker that holds the deployment, and uses
that worker's replica holder in-process. :class:`~plexrl_dask.Deployment` methods submit these;
users can submit them too::

    with dask.annotate(plexrl={"deployment": "policy", "job": "my-job"}):
        fut = client.submit(plexrl_dask.ops.forward, "policy", batch, pure=False)

The ``plexrl`` annotation is what lets the scheduler plugin park the task and release it, in
order, on the deployment's worker (optional keys: ``replica`` to aim at one of a rollout
deployment's replicas, or ``None`` to let the scheduler pick any replica (for reads: every
replica holds the same weights); ``request``/``rank``/``ranks`` are set by the runtime for multi-rank
calls). A task without it fails with :class:`NotRouted` instead of silently loading a second,
divergent replica somewhere else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from plexrl_dask.errors import NoPlexRLWorkers, NotRouted, from_status, raise_for_status
from plexrl_dask.service.groups import GroupContext
from plexrl_dask.service.holder import ReplicaHolder, holder_of
from plexrl_dask.service.registry import DeploymentInfo
from plexrl_dask.service.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    ForwardResult,
    Loss,
    NamedWeights,
    SampleResult,
    SamplingParams,
    as_batch,
)

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
        group = GroupContext(
            uid=info.uid, epoch=int(ann["epoch"]), rank=int(ann["rank"]), world_size=info.world_size
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
    return _run(deployment, "forward", lambda b: b.forward(batch, temperature))


def forward_backward(
    deployment: str, batch: Sequence[Datum], loss: Loss = CrossEntropy()
) -> dict[str, float]:
    """Accumulate the gradient of ``loss`` over ``batch``; returns the loss and metrics."""
    return _run(deployment, "forward_backward", lambda b: b.forward_backward(batch, loss))


def optim_step(deployment: str, params: AdamWParams = AdamWParams()) -> dict[str, float]:
    """Apply the accumulated gradients (AdamW, gradient clipping) and clear them."""
    return _run(deployment, "optim_step", lambda b: b.optim_step(params))


def sample(
    deployment: str,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams = SamplingParams(),
    prompt_ids: Sequence[int] | None = None,
) -> SampleResult:
    """``params.n`` completions of each prompt (strings or token ids).

    ``prompt_ids`` key each prompt's randomness (default: its position); a caller that splits
    one logical request into several passes the global positions, so the split changes nothing.
    """
    ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]

    def call(backend: Any) -> SampleResult:
        tokens = backend.tokenize(prompts)
        groups = backend.sample(tokens, params, ids)
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
        backend.set_weights(weights, version=version, strict=strict)
        return int(backend.version)

    return _run(deployment, "set_weights", call)


def save_state(deployment: str, path: str) -> dict[str, Any]:
    """Write a checkpoint (parameters + optimizer state) of the deployment to ``path``."""
    return _run(deployment, "save_state", lambda b: b.save_state(path))


def load_state(deployment: str, path: str) -> int:
    """Restore the checkpoint at ``path`` (written at any world size); returns its version."""
    return _run(deployment, "load_state", lambda b: b.load_state(path))


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
    if op == "forward_backward":
        # Each rank's loss is its share of the whole batch's loss (same normalizer): sum them;
        # per-token averages are re-weighted by each rank's token weight.
        total = sum(r["total_weight"] for r in results)
        merged = {k: float(sum(r[k] for r in results)) for k in _SUMMED}
        for key in sorted(set().union(*results) - set(_SUMMED)):
            merged[key] = float(sum(r.get(key, 0.0) * r["total_weight"] for r in results) / total)
        return merged
    return results[0]  # optim_step, get_weights, set_weights, load: rank 0 speaks for all


__all__ = [
    "as_batch",
    "combine",
    "forward",
    "forward_backward",
    "get_weights",
    "load",
    "load_state",
    "optim_step",
    "save_state",
    "sample",
    "set_weights",
]
