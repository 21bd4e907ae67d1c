"""A deployment's handle in the driver: :class:`Deployment`.

Every model call on a :class:`Deployment` is submitted as a task of :mod:`plexrl_dask.worker.ops`
inside ``dask.annotate(plexrl={...})`` and returns a ``distributed.Future`` at once; the scheduler
plugin routes it to the deployment's worker. Handles come from a
:class:`~plexrl_dask.driver.runtime.Runtime` (``deploy``, ``deployment``), which owns the client.

Layouts: a training deployment with ``world_size=k`` is one FSDP2 group over k workers; each
call runs as k rank tasks (the batch split in contiguous chunks) and one small task that combines
their results. A rollout deployment with ``replicas=R`` is R single-worker replicas; ``sample``
splits its prompts at batch boundaries into up to R data-parallel parts
(:func:`split_prompts`), each run by whichever replica the scheduler picks, so the result
equals one replica's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import dask
from distributed import Future

from plexrl_dask import config, protocol
from plexrl_dask.errors import (
    AdapterNotFound,
    CheckpointError,
    ConfigError,
    InvalidBatch,
    InvalidLoss,
    InvalidModelSpec,
    InvalidOptimizerParams,
    InvalidRecipe,
)
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.models.tokenizer import encode_prompts, special_tokens_default
from plexrl_dask.shared.access import READ_OPS
from plexrl_dask.shared.checks import (
    check_rows,
    checked_sample,
    checked_temperature,
    checked_top,
    rank_shares,
    whole_batch_loss,
)
from plexrl_dask.shared.records import DeploymentInfo
from plexrl_dask.shared.types import (
    AdamWParams,
    Chat,
    CrossEntropy,
    Datum,
    GraphLoss,
    Loss,
    NamedWeights,
    PolicyGradient,
    SamplingParams,
    Streams,
    as_batch,
    check_tokens,
)
from plexrl_dask.worker import ops

if TYPE_CHECKING:
    from plexrl_dask.driver.runtime import Runtime

logger = logging.getLogger(__name__)


def _adamw(params: Any) -> AdamWParams:
    if not isinstance(params, AdamWParams):
        raise InvalidOptimizerParams(f"params must be AdamWParams, got {type(params).__name__}")
    return params


def split_prompts(
    num_prompts: int, replicas: int, n: int, stream_rows: int
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` prompt ranges, one per replica that gets work.

    Ranges start at multiples of the smallest prompt count whose ``n`` samples fill whole
    sampling streams (:mod:`~plexrl_dask.worker.decode`), so every replica decodes exactly the
    streams one replica would have: the split changes no bit of the result."""
    unit = stream_rows // math.gcd(n, stream_rows)
    units = math.ceil(num_prompts / unit)
    per = [units // replicas + (1 if i < units % replicas else 0) for i in range(replicas)]
    out, start = [], 0
    for count in per:
        end = min(num_prompts, start + count * unit)
        if end > start:
            out.append((start, end))
        start = end
    return out


def _tokenized_here(params: SamplingParams) -> SamplingParams:
    """``params`` with ``special_tokens`` as this process's ``plexrl.sampling.special-tokens``
    where it is None: text prompts are tokenized on the worker as :meth:`Deployment.tokenize`
    tokenizes them here, whatever the worker's own configuration says."""
    if params.special_tokens is not None:
        return params
    return dataclasses.replace(params, special_tokens=special_tokens_default())


def _sealed(recipe: Any) -> bytes:
    """A scoring recipe as the bytes a request carries (:func:`~plexrl_dask.rl.scoring.seal_recipe`;
    bytes pass as they are, the worker checks them); :class:`InvalidRecipe` for anything else."""
    from plexrl_dask.rl.scoring import ScoringRecipe, seal_recipe  # (rl imports this module)

    if isinstance(recipe, ScoringRecipe):
        recipe = seal_recipe(recipe)
    if not isinstance(recipe, bytes):
        raise InvalidRecipe(f"recipe must be a ScoringRecipe, got {type(recipe).__name__}")
    return recipe


class Deployment:
    """A handle on a registered deployment; every model call returns a ``Future``."""

    def __init__(self, runtime: Runtime, info: DeploymentInfo):
        self.runtime = runtime
        self.info = info
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The deployment's tokenizer, built locally from its spec (on the driver)."""
        if self._tokenizer is None:
            self._tokenizer = self.info.spec.build_tokenizer()
        return self._tokenizer

    def tokenize(self, text: str | Chat, special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text`` as the replicas tokenize a prompt: with the tokenizer's special
        tokens, as Hugging Face adds them (``special_tokens``, default
        ``plexrl.sampling.special-tokens``); a completion: ``special_tokens=False``. A
        :class:`Chat` is rendered with the model's chat template."""
        if not isinstance(text, (str, Chat)):
            raise InvalidBatch(f"tokenize takes a string or a Chat, got {type(text).__name__}")
        return encode_prompts(self.tokenizer, [text], special_tokens)[0]

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"<Deployment {self.name!r} {self.info.role} {self.info.spec.name} on {list(self.info.workers)}>"

    def share(self, job: str, ops: Sequence[str] = READ_OPS) -> list[str]:
        """Let ``job`` run ``ops`` on this deployment (default: the ops that read it and change
        nothing; replaces what ``job`` was granted; ``ops=()`` revokes). Only its owner may
        share it (:class:`PermissionDenied`); returns the ops granted. The other job looks it
        up with ``runtime.deployment(name)``."""
        status = self.runtime._call(
            protocol.SHARE, name=self.name, to=job, ops=config.strings("ops", ops),
            job=self.runtime.job,
        )  # fmt: skip
        return list(status["ops"])

    def annotation(self, **extra: Any) -> dict[str, Any]:
        """The ``plexrl`` task annotation that makes a task submitted with plain Dask a request
        of this deployment in this runtime's job (``extra``: e.g. ``replica``)::

            with dask.annotate(plexrl=policy.annotation()):
                fut = client.submit(plexrl_dask.ops.forward, policy.name, batch, pure=False)
        """
        return {
            "deployment": self.name,
            "job": self.runtime.job,
            "secret": self.runtime.secret,
            "incarnation": self.info.incarnation,
            **extra,
        }

    def offload(self, replica: int | None = None) -> dict[str, bool]:
        """Offload this deployment (every replica, or ``replica``) to host memory now, as its
        holders do under memory pressure: its next request reloads it (for experiments with
        cold starts). Only its owner may. Returns worker -> whether it was resident there."""
        status = self.runtime._call(
            protocol.OFFLOAD, name=self.name, job=self.runtime.job, replica=replica
        )
        return dict(status["offloaded"])

    def _submit(
        self,
        op: str,
        fn: Any,
        per_task_args: Sequence[tuple],
        replica_of: Sequence[int | None] | None = None,
        holds: bool = False,
        keep: int | None = None,
    ) -> Future:
        """Submit ``op`` as one task per element of ``per_task_args`` and return the future of
        their combined result (``keep``: of its first ``keep`` data, the rest fillers).

        Single-rank replicas: each task is a request of its own, for replica ``replica_of[i]``
        (default: replica 0; ``None``: any replica, chosen by the scheduler). Multi-rank
        (a sharded training deployment, a tensor-parallel rollout): every ``world_size``
        consecutive tasks are one gang request, task ``r`` of it rank ``r``, and
        ``replica_of[g]`` is the replica of gang request ``g``."""
        info = self.info
        k = info.world_size
        request = f"plexrl-{op}-{self.name}-{uuid.uuid4().hex}"
        per = [per_task_args[i : i + k] for i in range(0, len(per_task_args), k)]
        futures = []
        for g, tasks in enumerate(per):
            # (one gang: its ranks share the request id; otherwise each task is a request)
            rid = request if len(per) == 1 and k > 1 else f"{request}-{g}"
            for rank, args in enumerate(tasks):
                annotation = {
                    **self.annotation(**({"holds": True} if holds else {})),
                    "op": op,
                    "request": rid,
                    "ranks": k,
                    "rank": rank,
                    "replica": 0 if replica_of is None else replica_of[g],
                }
                key = f"{rid}-{rank}" if k > 1 else rid
                with dask.annotate(plexrl=annotation):
                    futures.append(
                        self.runtime.client.submit(fn, self.name, *args, key=key, pure=False)
                    )
        if len(futures) == 1:
            return futures[0]
        return self.runtime.client.submit(
            ops.combine, op, *futures, keep=keep, key=f"{request}-combine", pure=False
        )

    def _every(self, op: str, fn: Any, args: tuple) -> Future:
        """``op`` on every replica (every rank of each)."""
        n, replicas = self.info.num_workers, self.info.replicas
        return self._submit(op, fn, [args] * n, replica_of=range(replicas if self._gang else n))

    @property
    def _gang(self) -> bool:
        return self.info.world_size > 1

    @property
    def _tensor_parallel(self) -> bool:
        """Its replicas span several workers, each rank computing every request whole."""
        return self._gang and self.info.role == "rollout"

    def _validated(self, batch: Sequence[Datum] | Datum) -> tuple[Datum, ...]:
        """The batch, checked here against the model's vocabulary and positions (so a bad
        sequence fails before anything is submitted, and never strands the other ranks)."""
        batch = as_batch(batch)
        check_rows(len(batch), "the batch")
        if self.info.vocab_size:
            check_tokens([d.tokens for d in batch], self.info.vocab_size, self.info.max_positions)
        return batch

    def _ranks(self, *args: Any) -> list[tuple]:
        """The same arguments for every rank (or the single task)."""
        return [args] * self.info.world_size

    def load(self) -> Future:
        """Make every rank and replica resident on its worker; the result describes rank 0."""
        return self._every("load", ops.load, ())

    def forward(
        self,
        batch: Sequence[Datum] | Datum,
        temperature: float = 1.0,
        adapter: str | None = None,
        top: int = 0,
    ) -> Future:
        """Future of a :class:`ForwardResult`: per-token log-probabilities (``adapter``: an
        adapter bank's loaded adapter to score with; ``top``: each position's ``top`` most
        probable tokens and their log-probabilities too, up to 100)."""
        temperature = checked_temperature(temperature)
        top = checked_top(top)
        batch = self._validated(batch)
        if adapter is not None:
            parts = rank_shares(batch, min(len(batch), self.info.replicas))
            return self._submit(
                "forward",
                ops.forward,
                [(p, temperature, str(adapter), top) for p in parts],
                replica_of=[None if self.info.replicas > 1 else 0] * len(parts),
            )
        if self._tensor_parallel:  # every rank scores the whole batch; rank 0's is returned
            return self._submit("forward", ops.forward, self._ranks(batch, temperature, None, top))
        # (fewer sequences than ranks: the ranks past them score fillers, left out of the result)
        parts = rank_shares(batch, self.info.world_size, pad=True)
        keep = len(batch) if len(batch) < self.info.world_size else None
        return self._submit(
            "forward", ops.forward, [(p, temperature, None, top) for p in parts], keep=keep
        )

    def forward_backward(
        self, batch: Sequence[Datum] | Datum, loss: Loss = CrossEntropy(), logprobs: bool = False
    ) -> Future:
        """Future of the loss metrics; gradients accumulate until :meth:`optim_step`. With
        ``logprobs``, of a :class:`ForwardBackwardResult`: the metrics and each datum's
        per-token log-probabilities under the weights the gradient was taken at."""
        parts, loss = self._training_parts(batch, loss)
        return self._submit(
            "forward_backward",
            ops.forward_backward,
            [(p, loss, bool(logprobs)) for p in parts],
        )

    def optim_step(self, params: AdamWParams = AdamWParams()) -> Future:
        """Future of the step metrics (grad norm, new version)."""
        return self._submit("optim_step", ops.optim_step, self._ranks(_adamw(params)))

    def train_step(
        self,
        batch: Sequence[Datum] | Datum,
        loss: Loss = CrossEntropy(),
        params: AdamWParams = AdamWParams(),
    ) -> Future:
        """:meth:`forward_backward` then :meth:`optim_step` as one request (one round trip
        and, on a sharded deployment, one gang instead of two): the same arithmetic and
        results. Future of ``{"forward_backward": ..., "optim_step": ...}``."""
        parts, loss = self._training_parts(batch, loss, pad=True)
        params = _adamw(params)
        return self._submit("train_step", ops.train_step, [(p, loss, params) for p in parts])

    def _training_parts(
        self, batch: Sequence[Datum] | Datum, loss: Loss, pad: bool = False
    ) -> tuple[list[tuple[Datum, ...]], Loss]:
        """``batch`` checked and split over the ranks, and ``loss`` as every rank computes it
        (``pad``: fewer sequences than ranks get zero-weight fillers, for a built-in loss,
        whose weights they zero: :func:`~plexrl_dask.shared.checks.rank_shares`)."""
        if not isinstance(loss, (CrossEntropy, PolicyGradient, GraphLoss)):
            raise InvalidLoss(
                f"loss must be CrossEntropy, PolicyGradient or GraphLoss, got "
                f"{type(loss).__name__}"
            )
        batch = self._validated(batch)
        k = self.info.world_size
        pad = pad and not isinstance(loss, GraphLoss)  # (a graph loss reads no weights)
        return rank_shares(batch, k, pad=pad), whole_batch_loss(loss, batch, k)

    def train_scored(self, samples: Future, recipe: Any) -> Future:
        """Score a synchronous GRPO step's samples where they are and train on them, in one
        request (:mod:`plexrl_dask.rl.scoring`): ``samples`` is the future of this job's
        ``sample`` request (never fetched by the driver), ``recipe`` a
        :class:`~plexrl_dask.rl.scoring.ScoringRecipe` (or one already sealed:
        :func:`~plexrl_dask.rl.scoring.seal_recipe`). Future of ``{"scored": ScoredSummary}``
        plus, when a group taught something, what :meth:`train_step` returns
        (``forward_backward``, ``optim_step``)."""
        recipe = _sealed(recipe)
        if not isinstance(samples, Future):
            raise InvalidRecipe(
                f"samples must be the future of a sample request, got {type(samples).__name__}"
            )
        k = self.info.world_size
        return self._submit(
            "train_step", ops.train_scored, [(samples, recipe, r, k) for r in range(k)]
        )

    def sample_train(
        self,
        prompts: Sequence[str | Chat | Sequence[int]],
        params: SamplingParams,
        recipe: Any,
        prompt_ids: Sequence[int] | None = None,
    ) -> Future:
        """:meth:`sample` then :meth:`train_scored` on those samples, as one request of this
        single-worker deployment: a colocated GRPO step whose training starts the moment its
        samples are drawn, with no hand-off through the scheduler between the two (the
        worker records them as a ``sample`` and a ``train_step`` request all the same).
        Future of what :meth:`train_scored` returns. A deployment of several workers (a
        sharded policy, replicas) refuses it (:class:`InvalidRecipe`): sample, then
        :meth:`train_scored` on the samples' future."""
        if self.info.world_size != 1 or self.info.replicas != 1:
            raise InvalidRecipe(
                f"sample_train runs on a single-worker deployment; {self.name!r} has "
                f"world_size {self.info.world_size} and {self.info.replicas} replicas"
            )
        recipe = _sealed(recipe)
        prompts, params, ids, _ = checked_sample(prompts, params, prompt_ids)
        params = _tokenized_here(params)
        task = (list(prompts), params, ids, Streams.from_config(), recipe)
        return self._submit("sample_train", ops.sample_train, [task])

    def sample(
        self,
        prompts: Sequence[str | Chat | Sequence[int]],
        params: SamplingParams = SamplingParams(),
        prompt_ids: Sequence[int] | None = None,
        holds: bool = False,
        invariant: bool | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> Future:
        """Future of a :class:`SampleResult` (``params.n`` completions per prompt: text,
        chat messages rendered with the model's chat template, or token ids). ``holds``: the
        caller's next request follows once its tools have run (an agentic turn), so the
        scheduler may keep the worker for it (``plexrl.scheduler.turn-hold``). ``invariant``:
        decode every row as if alone (default ``plexrl.sampling.batch-invariant``), so that
        its tokens do not depend on the other prompts of the request. ``adapters`` (an
        adapter bank's): per prompt, the key of the loaded adapter it samples with (None:
        the base)."""
        prompts, params, ids, _ = checked_sample(prompts, params, prompt_ids)
        params = _tokenized_here(params)
        streams = Streams.from_config(invariant)
        if adapters is not None:
            return self._sample_adapters(prompts, params, ids, streams, adapters, holds)
        k = self.info.world_size
        if self._tensor_parallel:
            # Each part to one replica's gang, every rank of it decoding the whole part.
            chunks = split_prompts(len(prompts), self.info.replicas, params.n, streams.rows)
            tasks = [(list(prompts[a:b]), params, ids[a:b], streams) for a, b in chunks]
            replica = None if self.info.replicas > 1 else 0
            return self._submit(
                "sample",
                ops.sample,
                [t for t in tasks for _ in range(k)],
                replica_of=[replica] * len(tasks),
                holds=holds,
            )
        if k > 1:
            # On the training group (the hybrid engine): every rank decodes its share of the
            # streams on gathered weights; a rank with no share still takes part.
            chunks = split_prompts(len(prompts), k, params.n, streams.rows)
            chunks += [(len(prompts), len(prompts))] * (k - len(chunks))
            tasks = [(list(prompts[a:b]), params, ids[a:b], streams) for a, b in chunks]
            return self._submit("sample", ops.sample, tasks, holds=holds)
        chunks = split_prompts(len(prompts), self.info.replicas, params.n, streams.rows)
        # The streams travel with the request, so the split and the decoding agree whatever
        # the workers' configuration (their max-batch-size, a memory bound, is theirs).
        tasks = [(list(prompts[a:b]), params, ids[a:b], streams) for a, b in chunks]
        # Parts are data-parallel (replica None): the scheduler runs each on whichever replica
        # frees up first and holds the model warmest; any replica gives the same bits.
        any_replica = [None if self.info.replicas > 1 else 0] * len(tasks)
        return self._submit("sample", ops.sample, tasks, replica_of=any_replica, holds=holds)

    def _sample_adapters(
        self,
        prompts: Sequence[Any],
        params: SamplingParams,
        ids: Sequence[int],
        streams: Streams,
        adapters: Sequence[str | None],
        holds: bool,
    ) -> Future:
        """An adapter bank's sample: parts split as for any data-parallel rollout, each part
        with its prompts' adapter keys."""
        keys = [None if a is None else str(a) for a in adapters]
        if len(keys) != len(prompts):
            raise AdapterNotFound(f"{len(keys)} adapter keys for {len(prompts)} prompts")
        chunks = split_prompts(len(prompts), self.info.replicas, params.n, streams.rows)
        tasks = [(list(prompts[a:b]), params, ids[a:b], streams, keys[a:b]) for a, b in chunks]
        any_replica = [None if self.info.replicas > 1 else 0] * len(tasks)
        return self._submit("sample", ops.sample, tasks, replica_of=any_replica, holds=holds)

    def load_adapter(self, key: str, spec: ModelSpec, saved: Mapping[str, Any]) -> Future:
        """An adapter bank's: load LoRA adapter ``key`` of ``spec`` (a LoRA spec on this
        bank's base) from ``saved`` (what that deployment's ``save_state`` returned, or its
        future; its owner shares ``get_weights`` with this bank's job where they differ) on every
        replica, replacing a loaded one of that key. Future of the adapter's version."""
        if not isinstance(spec, ModelSpec):
            raise InvalidModelSpec(f"spec must be a ModelSpec, got {type(spec).__name__}")
        pending = hasattr(saved, "key") and hasattr(saved, "client")  # (save_state's future)
        if not pending and (not isinstance(saved, Mapping) or "path" not in saved):
            raise CheckpointError("load_adapter takes what save_state returned (with a 'path')")
        return self._every("load_adapter", ops.load_adapter, (str(key), spec.to_dict(), saved))

    def drop_adapter(self, key: str) -> Future:
        """An adapter bank's: unload adapter ``key`` on every replica. Future of whether it
        was loaded (on the first replica)."""
        return self._every("drop_adapter", ops.drop_adapter, (str(key),))

    def save_state(
        self,
        path: str | os.PathLike[str] | None = None,
        format: str = "store",
        model: str | None = None,
        weights_only: bool = False,
    ) -> Future:
        """Future of ``{"path", "model", "version", "format"}`` once a checkpoint of parameters
        and optimizer state (``weights_only``: parameters alone, store format) is durable. Default: a version in the state store of the node's
        NVMe tier (``path=None``) or of a store at ``path`` (a directory every rank's worker
        can reach, e.g. a shared filesystem, for a deployment spanning nodes); published
        atomically, each rank of a sharded deployment writing only its own shards.
        ``format="dcp"``: torch DCP at ``path``, for other tools. Either loads onto any world
        size with :meth:`load_state`. ``model``: the store's model name for it (default: the
        deployment's name, made safe for a store)."""
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"save_state's path is a directory path, got {path!r:.80}")
        target = None if path is None else os.fspath(path)
        publish_id = uuid.uuid4().hex
        if weights_only and format != "store":
            raise CheckpointError("a weights-only checkpoint is in the store format")
        return self._submit(
            "save_state",
            ops.save_state,
            self._ranks(target, publish_id, format, model, weights_only),
        )

    def load_state(
        self,
        checkpoint: str | os.PathLike[str] | Mapping[str, Any],
        model: str | None = None,
        version: int | None = None,
        optimizer: bool = True,
    ) -> Future:
        """Future of the restored version. ``checkpoint``: what :meth:`save_state` returned,
        a DCP directory, or a state store path (``model``: default this deployment's name or
        the store's only model; ``version``: default the latest). Every rank (or replica)
        reads only what its layout holds. ``optimizer=False``: parameters only, the optimizer
        starts afresh (a new run from saved weights)."""
        if isinstance(checkpoint, Mapping):
            if "path" not in checkpoint:
                raise CheckpointError(
                    "a checkpoint mapping is what save_state returned and has a 'path'; got "
                    f"keys {sorted(checkpoint)}"
                )
        else:
            try:
                checkpoint = os.fspath(checkpoint)
            except TypeError as e:
                raise CheckpointError(f"a checkpoint path is needed, got {checkpoint!r}") from e
        args = (checkpoint, model, version) + (() if optimizer is True else (False,))
        return self._every("load_state", ops.load_state, args)

    def get_weights(self, names: Sequence[str] | None = None) -> Future:
        """Future of :class:`NamedWeights` (host tensors by canonical name + version)."""
        return self._submit("get_weights", ops.get_weights, self._ranks(names))

    def set_weights(
        self,
        weights: NamedWeights | Mapping[str, Any] | Future,
        version: int | None = None,
        strict: bool = True,
    ) -> Future:
        """Future of the new version. ``weights`` may be a future (e.g. another deployment's
        ``get_weights()``): Dask then moves the tensors between workers directly."""
        # every rank takes its shard, every replica a copy
        return self._every("set_weights", ops.set_weights, (weights, version, strict))
