"""How much device memory a job's training needs, and so its smallest training group.

On real clusters memory, not preference, decides a job's layout: a 7B model trained with AdamW
in fp32 holds 16 bytes per parameter (weights, gradients, two moments: 112 GB) before any
activation, more than one 80 GB device, so its training shards over at least two. The same
rule here: :func:`training_memory` counts a job's training state and the activations of its
step's batch; :meth:`TrainingMemory.per_rank` is what each of ``k`` FSDP ranks holds (a 1/k
shard of the state and 1/k of the batch); :meth:`TrainingMemory.smallest_group` is the fewest
ranks whose share fits a worker's budget. The layout search (:func:`plexrl_dask.rl.modes.layouts`)
offers no layout that puts a job's training on fewer workers, nor one whose sampling does not
fit (:func:`sampling_memory`: a rollout replica, or a tensor-parallel rank of one, holding the
weights and the batch's keys and values; a training group sampling on gathered weights with
its gradients and moments offloaded, as the worker does where the copy does not fit beside
them).

The activation count is an estimate, stated here so its assumptions can be checked: per token
and decoder layer, the tensors autograd keeps for the backward of a Qwen2 layer as
transformers runs it (eager attention path of SDPA on the CPU, no recomputation), in the
model's dtype: the residual input and both norms' outputs (3h), q, k and v (h + 2·kv), the
attention probabilities (heads × sequence), the attention output and its projection (2h), and
the MLP's gate, up, activation and product (4i); per token of the batch, the fp32 logits and
their log-softmax (2 × vocab × 4 bytes). Every row is padded to the batch's widest.
"""

from __future__ import annotations

from dataclasses import dataclass

import dask.utils

from plexrl_dask.errors import ConfigError
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.worker.device import default_budget, resolve_device

#: Bytes per parameter of training state beyond the weights: a gradient in the weights'
#: dtype is counted apart; AdamW's two fp32 moments.
_ADAM_BYTES = 8


@dataclass(frozen=True)
class TrainingMemory:
    """A job's training memory, in bytes: state (weights, gradients, moments) and the
    activations of one step's whole batch."""

    weights: int
    gradients: int
    moments: int
    activations: int
    #: The largest FSDP unit (a decoder layer, or the root's embedding) whole.
    unit: int = 0

    @property
    def state(self) -> int:
        return self.weights + self.gradients + self.moments

    @property
    def total(self) -> int:
        return self.state + self.activations

    def per_rank(self, k: int) -> int:
        """What each of ``k`` FSDP ranks holds: its shard of the state, 1/k of the batch's
        activations, and over one rank, the unit being computed gathered whole with its
        unsharded gradient (FSDP2 gathers one unit at a time)."""
        if k < 1:
            raise ConfigError(f"a training group has at least one rank, got {k}")
        share = -(-self.state // k) + -(-self.activations // k)
        return share if k == 1 else share + 2 * self.unit

    def smallest_group(self, budget: int, max_ranks: int) -> int | None:
        """The fewest ranks (1..``max_ranks``) whose per-rank share fits ``budget``; None if
        none does."""
        for k in range(1, max_ranks + 1):
            if self.per_rank(k) <= budget:
                return k
        return None


def training_memory(spec: ModelSpec, rows: int, width: int) -> TrainingMemory:
    """``spec``'s training memory for a step of ``rows`` sequences padded to ``width`` tokens
    (the activation count is the module docstring's)."""
    if rows < 1 or width < 1:
        raise ConfigError(f"a training batch has rows >= 1 and width >= 1, got {rows}x{width}")
    cfg = dict(spec.hf_config().to_dict())
    n = spec.num_parameters()
    dtype = spec.torch_dtype.itemsize
    h, i = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = h // heads * int(cfg.get("num_key_value_heads") or heads)
    per_token_layer = 3 * h + (h + 2 * kv) + heads * width + 2 * h + 4 * i
    tokens = rows * width
    activations = tokens * (
        int(cfg["num_hidden_layers"]) * per_token_layer * dtype + 2 * int(cfg["vocab_size"]) * 4
    )
    layers = int(cfg["num_hidden_layers"])
    embedding = int(cfg["vocab_size"]) * h
    unit = max(embedding, (n - embedding - h) // layers) * dtype
    return TrainingMemory(
        weights=n * dtype,
        gradients=n * dtype,
        moments=n * _ADAM_BYTES,
        activations=activations,
        unit=unit,
    )


@dataclass(frozen=True)
class SamplingMemory:
    """What sampling a step's batch holds, in bytes: the weights, the keys and values of every
    row at the batch's widest, and each row's fp32 logits over the vocabulary; and the AdamW
    moments a training deployment that samples on its own weights keeps beside them."""

    weights: int
    kv_cache: int
    logits: int
    moments: int = 0

    def per_replica(self, t: int = 1) -> int:
        """What each of ``t`` tensor-parallel ranks of one rollout replica holds while it
        decodes the whole batch: 1/t of the weights (whole heads and MLP columns) and of the
        keys and values (whole key-value heads), and the logits whole (gathered to choose)."""
        if t < 1:
            raise ConfigError(f"a rollout replica has at least one rank, got {t}")
        return -(-self.weights // t) + -(-self.kv_cache // t) + self.logits

    def hybrid_per_rank(self, k: int) -> int:
        """What each of ``k`` ranks of a training group holds while it samples. Over several
        ranks, on gathered weights (the hybrid engine) with its gradients and AdamW moments
        offloaded, the least it can hold: its shard of the weights, the gathered copy, and its
        share of the rows' keys, values and logits. On one, on its own weights, beside its
        moments (its gradients are freed after each step): no copy, nothing offloaded."""
        if k < 1:
            raise ConfigError(f"a training group has at least one rank, got {k}")
        if k == 1:
            return self.weights + self.moments + self.kv_cache + self.logits
        return -(-self.weights // k) + self.weights + -(-(self.kv_cache + self.logits) // k)


def sampling_memory(spec: ModelSpec, rows: int, width: int) -> SamplingMemory:
    """``spec``'s sampling memory for ``rows`` sequences of up to ``width`` tokens."""
    if rows < 1 or width < 1:
        raise ConfigError(f"a sampling batch has rows >= 1 and width >= 1, got {rows}x{width}")
    cfg = dict(spec.hf_config().to_dict())
    dtype = spec.torch_dtype.itemsize
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg["hidden_size"]) // heads * int(cfg.get("num_key_value_heads") or heads)
    layers = int(cfg["num_hidden_layers"])
    return SamplingMemory(
        weights=spec.num_parameters() * dtype,
        kv_cache=rows * width * layers * 2 * kv * dtype,
        logits=rows * int(cfg["vocab_size"]) * 4,
        moments=spec.num_parameters() * _ADAM_BYTES,
    )


@dataclass(frozen=True)
class StepWork:
    """A GRPO step's compute, in FLOPs: its rollout (prefill and decode of every row) and its
    training (forward and backward of the same rows)."""

    sample: float
    train: float

    @property
    def total(self) -> float:
        return self.sample + self.train


def step_work(spec: ModelSpec, rows: int, width: int) -> StepWork:
    """``spec``'s compute for a step of ``rows`` sequences of ``width`` tokens, by the usual
    count of 2 FLOPs per parameter and token for a forward and 6 for a forward and backward
    (attention's own products left out: short sequences). An estimate for placing work
    (:func:`plexrl_dask.rl.modes.pool_placement`), not a measurement: ``width`` is an upper
    bound when completions may end before ``max_tokens``, and the same bound for every job."""
    if rows < 1 or width < 1:
        raise ConfigError(f"a step has rows >= 1 and width >= 1, got {rows}x{width}")
    tokens = rows * width
    n = spec.num_parameters()
    return StepWork(sample=2.0 * n * tokens, train=6.0 * n * tokens)


def budget_bytes(setting: str) -> int:
    """A worker's memory budget in bytes, ``setting`` read as ``plexrl.worker.memory-budget``
    is ("auto": the default of the device a worker on this machine gets)."""
    if setting == "auto":
        return default_budget(resolve_device("auto"))
    try:
        return int(dask.utils.parse_bytes(setting))
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"a memory budget is 'auto' or a size such as '8 GiB': {setting!r}"
        ) from e
