"""Rollout time from decode efficiency by batch: how long one GRPO step's generation takes on a
layout, and how long its training takes.

The simulator's older workloads give rollout durations directly (seconds on the job's rollout
GPUs). A workload may instead describe the rollout (``rollout:`` in a model class of the YAML):
the model's shape, the responses per step, the response-length distribution, the rollout's
tensor-parallel degree, on a cluster whose GPU is described by :class:`Hardware`. Then every
layout's rollout time follows from one decode model, and colocated, split and pooled layouts
differ the way they do on real GPUs: by the batch each GPU decodes.

**Decode step** (one replica of ``tp`` GPUs, ``a`` sequences in flight at context ``c``; the
roofline of Pope et al., "Efficiently Scaling Transformer Inference", arXiv:2211.05102, §2):

    step_s(a, c) = max(bytes(a, c) / (HBM bandwidth * MBU),
                       2 * N_active * a / tp / (peak bf16 FLOP/s * decode MFU)) + overhead
    bytes(a, c) = weights read per step / tp + a * c * KV bytes per token per GPU

Weights are bf16 (2 bytes each) and so is the KV cache, unless the shape says otherwise
(``weight_bytes``, ``kv_bytes``: 1 for FP8). Weights read per step are the dense weights for a
dense model; for a mixture of experts the shared part plus the experts at least one of the
``a`` tokens routes to (``1 - (1 - k/E)^a`` of them, routing taken as uniform). KV heads shard
over ``tp`` up to their count and replicate beyond it. Tokens/s per GPU at ``b`` sequences per
GPU is ``b / step_s(b * tp, c)``: linear in ``b`` while the weights dominate the bytes,
saturating once the KV cache (or compute) does.

**Concurrency.** A replica holds at most ``c_max`` sequences: the KV budget (``kv_memory_fraction``
of HBM, vLLM's ``gpu_memory_utilization``, less the weights and an activation reserve) over the
KV bytes of one sequence at the larger of the synchronous batch's peak footprint and the mean
in-flight context of continuous batching (see below).

**One replica's rollout** of ``n`` responses (the step's responses spread evenly over the
layout's replicas, as verl's rollout workers split a batch by data-parallel rank):

- if ``n > c_max``, a *saturated* stretch first: continuous batching keeps ``c_max`` sequences
  in flight (a finished one is replaced at once) until the queue is empty; it decodes the first
  ``n - c_max`` responses' tokens (``(n - c_max) * E[L]``, a fluid approximation) at the step
  time of ``c_max`` sequences at the length-biased mean context ``p + E[L^2] / (2 E[L])``;
- then the *drain*: the last ``min(n, c_max)`` sequences decode together, ``alive(s) = n'
  S(s)`` of them still going at step ``s`` (``S``: the length distribution's survival
  function; at least one, the longest, runs to the end), context ``p + s``; integrated over
  ``s`` up to the step's longest response (the maximum of the step's ``B`` responses, drawn per
  step as ``F^-1(U^(1/B))``, capped at ``max_tokens``).

The layout holds its GPUs for the whole rollout (colocated, split). A *pooled* layout
(PlexRL's rollout service) hands back all but ``tail_gpu_fraction`` of them once the alive
share falls to that fraction and consolidates the rest there: the *bulk* ends at that point,
the *tail* is the rest (the per-GPU batch is unchanged by the consolidation, so the tail lasts
what it would have lasted unconsolidated; the re-prefill of moved sequences is not charged).

**Lengths.** A capped lognormal: ``min(max_tokens, median * scale * exp(sigma * Z))``, with a
per-step ``scale`` (lognormal, ``iteration_sigma``: how a step's prompts vary in difficulty).

**Training** on ``t`` GPUs: ``10 * N_active * tokens / (t * peak * train MFU)``: 6 N FLOPs per
token for the policy's forward and backward, 2 N each for the old-policy and reference
log-probability forwards of GRPO (the 6N / 2N rule: Kaplan et al., "Scaling Laws for Neural
Language Models", arXiv:2001.08361, §2.1), ``tokens`` the step's prompts and responses.

**Checked** against published decode measurements (vLLM, NIM, TensorRT-LLM on H100 and A100):
:mod:`plexrl_dask.sim.measured`, ``sim/workloads/decode-measurements.yaml``.

Pure numpy; deterministic (randomness comes in as arrays the caller drew).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from plexrl_dask.errors import InvalidTrace

#: Points of the drain's integral over decode steps (midpoint rule).
DRAIN_POINTS = 128
_NORMAL = NormalDist()


def _phi(x: np.ndarray) -> np.ndarray:
    """The standard normal CDF, elementwise (Abramowitz and Stegun 7.1.26 for erf, absolute
    error below 1.5e-7: numpy has no erf, and this runs on millions of points per study)."""
    z = np.asarray(x, dtype=float) / math.sqrt(2.0)
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    erf = 1.0 - poly * np.exp(-a * a)
    return 0.5 * (1.0 + np.sign(z) * erf)


def _positive(name: str, **values: float) -> None:
    for k, v in values.items():
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise InvalidTrace(f"{name}: {k} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class Hardware:
    """One GPU of the cluster, and how close decode and training get to its peaks."""

    hbm_gb: float
    hbm_tbps: float
    bf16_tflops: float
    mbu: float  # achieved share of HBM bandwidth in decode
    decode_mfu: float  # achieved share of peak FLOP/s in compute-bound decode
    step_overhead_ms: float = 0.0  # per decode step (scheduling, sampling, launches)
    kv_memory_fraction: float = 0.9  # of HBM the engine may use (weights + KV cache)
    activation_reserve_gb: float = 2.0  # of that, kept for activations

    @classmethod
    def from_dict(cls, d: dict) -> Hardware:
        try:
            hw = cls(**{k.replace("-", "_"): float(v) for k, v in d.items()})
        except TypeError as e:
            raise InvalidTrace(f"hardware: {e}") from e
        _positive("hardware", hbm_gb=hw.hbm_gb, hbm_tbps=hw.hbm_tbps,
                  bf16_tflops=hw.bf16_tflops, mbu=hw.mbu, decode_mfu=hw.decode_mfu,
                  kv_memory_fraction=hw.kv_memory_fraction)  # fmt: skip
        if hw.mbu > 1 or hw.decode_mfu > 1 or hw.kv_memory_fraction > 1:
            raise InvalidTrace("hardware: mbu, decode_mfu and kv_memory_fraction are shares <= 1")
        if hw.step_overhead_ms < 0 or hw.activation_reserve_gb < 0:
            raise InvalidTrace("hardware: step_overhead_ms and activation_reserve_gb >= 0")
        return hw


@dataclass(frozen=True)
class ModelShape:
    """What decode reads per step: parameters (total, active), KV cache per token, experts;
    bytes per weight and per KV-cache element (2: bf16, the workloads'; 1: FP8, for the
    measured points of :mod:`plexrl_dask.sim.measured`)."""

    params_b: float
    active_b: float
    layers: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    experts_active: int = 0
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0

    @classmethod
    def from_dict(cls, d: dict, params_b: float) -> ModelShape:
        try:
            shape = cls(
                params_b=params_b,
                active_b=float(d.get("active_b", params_b)),
                layers=int(d["layers"]),
                kv_heads=int(d["kv_heads"]),
                head_dim=int(d["head_dim"]),
                experts=int(d.get("experts", 0)),
                experts_active=int(d.get("experts_active", 0)),
                weight_bytes=float(d.get("weight_bytes", 2.0)),
                kv_bytes=float(d.get("kv_bytes", 2.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidTrace(f"model shape lacks or mistypes {e}") from e
        _positive("model shape", params_b=shape.params_b, active_b=shape.active_b,
                  layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                  weight_bytes=shape.weight_bytes, kv_bytes=shape.kv_bytes)  # fmt: skip
        if shape.active_b > shape.params_b:
            raise InvalidTrace("model shape: active_b exceeds params_b")
        if shape.experts and not 0 < shape.experts_active <= shape.experts:
            raise InvalidTrace("model shape: experts_active must be in (0, experts]")
        return shape

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V, every layer, ``kv_bytes`` each (bf16 unless told)."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    def weight_bytes_read(self, tokens: np.ndarray) -> np.ndarray:
        """Bytes of weights one decode step reads for ``tokens`` tokens (module docstring)."""
        tokens = np.asarray(tokens, dtype=float)
        per_b = 1e9 * self.weight_bytes  # bytes per billion parameters
        if not self.experts:
            return np.full(tokens.shape, per_b * self.params_b)
        k, e = self.experts_active, self.experts
        expert_params = (self.params_b - self.active_b) * e / (e - k) if e > k else 0.0
        dense = self.params_b - expert_params
        touched = 1.0 - (1.0 - k / e) ** np.maximum(tokens, 1.0)
        return per_b * (dense + expert_params * touched)


@dataclass(frozen=True)
class LengthModel:
    """Response lengths: ``min(max_tokens, median * scale * exp(sigma * Z))``; prompts of
    ``prompt_tokens``; ``scale`` per step, lognormal with ``iteration_sigma``."""

    median: float
    sigma: float
    max_tokens: float
    prompt_tokens: float
    iteration_sigma: float = 0.0

    def __post_init__(self) -> None:
        _positive("lengths", median=self.median, sigma=self.sigma, max_tokens=self.max_tokens,
                  prompt_tokens=self.prompt_tokens)  # fmt: skip
        if self.max_tokens < self.median or self.iteration_sigma < 0:
            raise InvalidTrace("lengths: max_tokens >= median and iteration_sigma >= 0")

    def survival(self, s: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """``P(L > s)`` for a step of ``scale`` (0 at and beyond ``max_tokens``)."""
        s = np.asarray(s, dtype=float)
        z = np.log(np.maximum(s, 1e-9) / (self.median * scale)) / self.sigma
        return np.where(s < self.max_tokens, 1.0 - _phi(z), 0.0)

    def mean(self, scale: np.ndarray) -> np.ndarray:
        """``E[L]`` of the capped lognormal."""
        m = self.median * np.asarray(scale, dtype=float)
        c, s2 = self.max_tokens, self.sigma**2
        a = np.log(c / m) / self.sigma
        return m * math.exp(s2 / 2) * _phi(a - self.sigma) + c * (1.0 - _phi(a))

    def residual_context(self, scale: np.ndarray) -> np.ndarray:
        """Mean context of a sequence in flight under continuous batching: the prompt plus
        half the length-biased mean length, ``E[L^2] / (2 E[L])`` (cap ignored: an upper
        bound)."""
        m = self.median * np.asarray(scale, dtype=float)
        return self.prompt_tokens + np.minimum(0.5 * m * math.exp(1.5 * self.sigma**2),
                                               self.max_tokens)  # fmt: skip

    def longest(self, scale: np.ndarray, u: np.ndarray, responses: int) -> np.ndarray:
        """The longest of ``responses`` lengths of a step, from uniforms ``u`` (the maximum of
        ``n`` uniforms is ``U^(1/n)``)."""
        top = np.clip(np.asarray(u, dtype=float) ** (1.0 / responses), 1e-12, 1 - 1e-15)
        z = np.array([_NORMAL.inv_cdf(float(x)) for x in np.ravel(top)]).reshape(top.shape)
        return np.minimum(self.max_tokens, self.median * scale * np.exp(self.sigma * z))


@dataclass
class RolloutTimes:
    """Per step: the whole rollout, its bulk and tail (pooled layout), tokens generated."""

    total_s: np.ndarray
    bulk_s: np.ndarray
    tail_s: np.ndarray
    tokens: np.ndarray


class DecodeModel:
    """Decode of one model on one kind of GPU, at a tensor-parallel degree (module docstring)."""

    def __init__(self, hw: Hardware, shape: ModelShape, lengths: LengthModel, tp: int) -> None:
        if tp < 1:
            raise InvalidTrace(f"rollout tp must be >= 1, got {tp}")
        self.hw, self.shape, self.lengths, self.tp = hw, shape, lengths, tp
        self.bandwidth = hw.hbm_tbps * 1e12 * hw.mbu
        self.flops = hw.bf16_tflops * 1e12 * hw.decode_mfu
        self.kv_per_gpu = shape.kv_bytes_per_token / min(tp, shape.kv_heads)
        weights_gpu = 1e9 * shape.weight_bytes * shape.params_b / tp
        self.kv_budget = (
            hw.hbm_gb * 1e9 * hw.kv_memory_fraction - weights_gpu - hw.activation_reserve_gb * 1e9
        )
        if self.kv_budget <= 0:
            raise InvalidTrace(
                f"a {shape.params_b} B model's weights ({weights_gpu / 1e9:.1f} GB per GPU at "
                f"tp={tp}) leave no KV cache in {hw.hbm_gb} GB: raise tp"
            )

    def step_terms(self, alive: np.ndarray, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The roofline's two terms of one decode step, seconds: memory traffic and compute."""
        alive = np.asarray(alive, dtype=float)
        mem = (self.shape.weight_bytes_read(alive) / self.tp
               + alive * context * self.kv_per_gpu) / self.bandwidth  # fmt: skip
        compute = 2e9 * self.shape.active_b * alive / self.tp / self.flops
        return mem, compute

    def step_s(self, alive: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Seconds of one decode step of a replica with ``alive`` sequences at ``context``."""
        mem, compute = self.step_terms(alive, context)
        return np.maximum(mem, compute) + self.hw.step_overhead_ms / 1e3

    def tokens_per_s_per_gpu(self, batch_per_gpu: np.ndarray, context: float) -> np.ndarray:
        """Decode throughput per GPU at ``batch_per_gpu`` sequences per GPU (the curve)."""
        a = np.asarray(batch_per_gpu, dtype=float) * self.tp
        return a / self.step_s(a, np.full(a.shape, float(context))) / self.tp

    def max_batch(self, scale: np.ndarray) -> np.ndarray:
        """Sequences one replica holds at once (``c_max`` of the module docstring)."""
        scale = np.atleast_1d(np.asarray(scale, dtype=float))
        s = np.linspace(0.0, self.lengths.max_tokens, 256)[None, :]
        peak = (self.lengths.survival(s, scale[:, None]) * (self.lengths.prompt_tokens + s)).max(1)
        per_seq = np.maximum(peak, self.lengths.residual_context(scale)) * self.kv_per_gpu
        return np.floor(self.kv_budget / per_seq)

    def peak_tokens_per_s_per_gpu(self) -> float:
        """The curve's top: throughput per GPU at the largest batch that fits, mean context."""
        c = float(self.max_batch(np.ones(1))[0])
        ctx = float(self.lengths.residual_context(np.ones(1))[0])
        return float(self.tokens_per_s_per_gpu(np.array([c / self.tp]), ctx)[0])

    def rollout(
        self,
        gpus: int,
        responses: int,
        scale: np.ndarray,
        longest: np.ndarray,
        tail_fraction: float,
    ) -> RolloutTimes:
        """The rollout of ``responses`` per step on ``gpus`` GPUs, for each step's ``scale``
        and longest response (arrays of one shape)."""
        if gpus < self.tp or gpus % self.tp:
            raise InvalidTrace(f"a rollout on {gpus} GPUs needs a multiple of tp={self.tp}")
        scale = np.asarray(scale, dtype=float)
        n = responses / (gpus // self.tp)  # per replica
        c = np.maximum(1.0, np.minimum(n, self.max_batch(scale)))
        lm = self.lengths
        # saturated stretch (continuous batching, c in flight) while the queue lasts
        ctx1 = lm.residual_context(scale)
        t1 = np.maximum(n - c, 0.0) * lm.mean(scale) * self.step_s(c, ctx1) / c
        # drain: c sequences together until the longest ends
        k = (np.arange(DRAIN_POINTS) + 0.5) / DRAIN_POINTS
        s = longest[:, None] * k[None, :]
        surv = lm.survival(s, scale[:, None])
        alive = np.maximum(c[:, None] * surv, 1.0)
        dt = self.step_s(alive, lm.prompt_tokens + s) * (longest / DRAIN_POINTS)[:, None]
        t2 = dt.sum(1)
        in_bulk = (surv > tail_fraction) & (c[:, None] * surv > 1.0)
        t2_bulk = (dt * in_bulk).sum(1)
        total = t1 + t2
        bulk = t1 + t2_bulk
        return RolloutTimes(total, bulk, total - bulk, responses * lm.mean(scale))

    def split_gpus(self, responses: int, train_s: float, sync_s: float, train_gpus: int,
                   limit: int) -> int:  # fmt: skip
        """The rollout GPUs (``tp`` times a power of two, at most ``limit``) of the cheapest
        split-async deployment of a median step: ``(r + t) * max(sync + rollout(r), train)``
        GPU-seconds, smallest ``r`` on a tie (the paper's cost baseline at its own best)."""
        one = np.ones(1)
        longest = self.lengths.longest(one, np.full(1, 0.5), responses)
        best, best_cost, gpus = self.tp, math.inf, self.tp
        while gpus <= limit:
            roll = float(self.rollout(gpus, responses, one, longest, 1.0).total_s[0])
            cost = (gpus + train_gpus) * max(sync_s + roll, train_s)
            if cost < best_cost * (1 - 1e-9):
                best, best_cost = gpus, cost
            gpus *= 2
        return best


def train_seconds(shape: ModelShape, hw: Hardware, gpus: int, tokens: np.ndarray,
                  mfu: float) -> np.ndarray:  # fmt: skip
    """Seconds of one GRPO training step over ``tokens`` on ``gpus`` GPUs (module docstring)."""
    _positive("train", mfu=mfu, gpus=gpus)
    return 10.0 * shape.active_b * 1e9 * np.asarray(tokens) / (gpus * hw.bf16_tflops * 1e12 * mfu)
