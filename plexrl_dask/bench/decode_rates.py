"""Decode throughput of the rollout engines on one device, against the device's own roofline:
the measurements behind ``bench.device``'s ``decode_*`` figures (that module's docstring
defines them; this one holds the code).

- **Models** (:data:`SHAPES`): the shapes of Qwen2.5-0.5B and Qwen2.5-1.5B (hidden size,
  layers, heads, KV heads, MLP width, the 151,936-token vocabulary, tied embeddings), random
  init, bf16, built from the config alone (nothing is downloaded). The weights' values do not
  matter to speed: every row decodes ``max_tokens`` tokens (``ignore_eos``).
- **Engines** on the same model object, arms interleaved per repetition: ``eager`` the dynamic
  decoder (:mod:`plexrl_dask.worker.decode`, what every GPU replica ran before the static
  one), ``static`` the static decoder op by op, ``captured`` the static decoder with its steps
  recorded as CUDA graphs (:mod:`plexrl_dask.worker.static_decode`), and ``hf_cb``
  transformers' own continuous-batching generation (:mod:`plexrl_dask.bench.hf_batching`).
- **Roofline**: the bytes one step must move from device memory (every parameter once, the
  tied embedding as the output head; each row's keys and values up to its position) at the
  rate a device-to-device ``copy_`` moves bytes, reads and writes counted
  (:func:`copy_rate` × 2): ``batch`` tokens per that time is the most a step can make.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from plexrl_dask.models.build import hf
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.shared.types import SampledSequence, SamplingParams, Streams
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.static_decode import StaticEngine

logger = logging.getLogger(__name__)

_QWEN25 = {
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_dropout": 0.0,
}
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    },
    "1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
    },
    # What the tests and ``--quick`` on the CPU run: the vocabulary kept, the rest shrunk.
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
}


def shape_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of shape ``name`` (:data:`SHAPES`), bf16."""
    cfg = {**_QWEN25, **SHAPES[name]}
    return ModelSpec(config=tuple(sorted(cfg.items())), dtype="bfloat16", label=f"qwen2.5-{name}")


class _BuiltOnDevice(TorchBackend):
    """A replica whose random init runs on its device (seconds instead of a minute on the
    host for 1.5B parameters; the values differ from a host-built replica of the same spec,
    which speed does not care about)."""

    def _build_model(self) -> torch.nn.Module:
        with torch.device(self.device):
            model = hf("AutoModelForCausalLM").from_config(
                self.spec.hf_config(), attn_implementation="sdpa"
            )
        return model.to(self.spec.torch_dtype)


def build(name: str, device: torch.device, max_batch_size: int) -> TorchBackend:
    """A replica of shape ``name`` on ``device``, built there."""
    return _BuiltOnDevice(shape_spec(name), device, max_batch_size=max_batch_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rate(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes per second a device-to-device ``copy_`` of ``nbytes`` moves (median of ``reps``;
    each byte is read once and written once, so the memory traffic is twice this)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def step_bytes(model: torch.nn.Module, batch: int, mean_columns: float) -> float:
    """Bytes one decode step of ``batch`` rows must read: every parameter once (tied weights
    once) and each row's keys and values over ``mean_columns`` positions."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    dtype_bytes = next(model.parameters()).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_column = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes
    return weights + batch * mean_columns * per_column


def prompts_for(batch: int, length: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``length`` tokens (ids inside the character tokenizer's
    vocabulary, so completions decode to text as in a real request)."""
    return [[5 + (7 * i + 3 * j) % 90 for j in range(length)] for i in range(batch)]


def engines(backend: TorchBackend) -> dict[str, StaticEngine | None]:
    """The arms that run through the backend's own ``sample``: which static engine (None: the
    dynamic decoder) it holds during the arm."""
    limit = 1 << 40
    return {
        "eager": None,
        "static": StaticEngine(backend.model, backend.decode_step, backend.device, False, limit),
        "captured": StaticEngine(backend.model, backend.decode_step, backend.device, True, limit),
    }


def sample_with(
    backend: TorchBackend,
    engine: StaticEngine | None,
    prompts: list[list[int]],
    params: SamplingParams,
) -> list[list[SampledSequence]]:
    """``backend.sample`` of one stream of every row, through ``engine``."""
    backend.static = engine
    rows = len(prompts) * params.n
    return backend.sample(prompts, params, list(range(len(prompts))), Streams(rows, rows))


def rates(
    backend: TorchBackend,
    batches: list[int],
    prompt_len: int,
    max_tokens: int,
    reps: int,
    hf_cb: Callable[..., dict[str, Any]] | None = None,
) -> dict[str, dict[int, float]]:
    """Decode tokens/s by arm and batch (median of ``reps``, arms interleaved, one untimed
    warm-up each: it records the captured arm's graphs). ``hf_cb``: transformers'
    continuous batching (:func:`plexrl_dask.bench.hf_batching.hf_continuous_batching_rate`),
    measured after the others at each batch."""
    arms, own = engines(backend), backend.static
    params = SamplingParams(n=1, max_tokens=max_tokens, ignore_eos=True, seed=0)
    out: dict[str, dict[int, float]] = {name: {} for name in arms}
    if hf_cb is not None:
        out["hf_cb"] = {}
    device = backend.device
    try:
        for batch in batches:
            prompts = prompts_for(batch, prompt_len)
            times: dict[str, list[float]] = {name: [] for name in arms}
            for rep in range(reps + 1):
                for name, engine in arms.items():
                    _sync(device)
                    t0 = time.perf_counter()
                    got = sample_with(backend, engine, prompts, params)
                    _sync(device)
                    if rep:  # the first is the warm-up
                        times[name].append(time.perf_counter() - t0)
                    assert sum(len(s.tokens) for g in got for s in g) == batch * max_tokens
            for name, ts in times.items():
                out[name][batch] = batch * max_tokens / statistics.median(ts)
            if hf_cb is not None:
                backend.static = None
                got_cb = hf_cb(backend.model, prompts, max_tokens, batch=batch, timeout_s=60.0)
                out["hf_cb"][batch] = float(got_cb["tokens_per_s"])
            logger.warning(
                "decode %s b%d: %s",
                backend.spec.name,
                batch,
                {k: round(v[batch]) for k, v in out.items() if batch in v},
            )
        captured = arms["captured"]
        if captured is not None and captured.capture_error:
            out["capture_error"] = {0: captured.capture_error}  # type: ignore[dict-item]
    finally:
        for engine in arms.values():
            if engine is not None:
                engine.release()
        backend.static = own
    return out


def agreement(a: list[list[SampledSequence]], b: list[list[SampledSequence]]) -> tuple[int, int]:
    """``(equal, compared)``: positions where two requests' rows chose the same token, each
    row compared up to and including its first difference (after it, the two rows continue
    different texts and their positions are not comparable)."""
    same = total = 0
    for ga, gb in zip(a, b, strict=True):
        for sa, sb in zip(ga, gb, strict=True):
            for x, y in zip(sa.tokens, sb.tokens, strict=False):
                total += 1
                if x != y:
                    break
                same += 1
    return same, total


def engine_agreement(
    backend: TorchBackend,
    requests: list[tuple[list[list[int]], SamplingParams]],
) -> dict[str, float]:
    """Token agreement of the captured arm with the eager (dynamic) and the op-by-op static
    arms over ``requests`` (same prompts, same seeds): :func:`agreement` summed."""
    arms, own = engines(backend), backend.static
    counts = {"eager": [0, 0], "static": [0, 0]}
    try:
        for prompts, params in requests:
            captured = sample_with(backend, arms["captured"], prompts, params)
            for name in counts:
                same, total = agreement(captured, sample_with(backend, arms[name], prompts, params))
                counts[name][0] += same
                counts[name][1] += total
    finally:
        for engine in arms.values():
            if engine is not None:
                engine.release()
        backend.static = own
    return {
        "captured_vs_eager": counts["eager"][0] / max(1, counts["eager"][1]),
        "captured_vs_static": counts["static"][0] / max(1, counts["static"][1]),
        "positions": float(counts["eager"][1]),
    }


def step_anatomy(
    backend: TorchBackend, batch: int, prompt_len: int, max_tokens: int, replays: int = 50
) -> dict[str, Any]:
    """Where a captured step's time goes, at ``batch`` rows (CUDA only): ``replay_us`` one
    graph replay alone (CUDA events over ``replays`` back-to-back replays: the device's time
    per step without the host), and, from the same step run op by op under torch's profiler,
    ``kernels`` (CUDA kernels and copies it launches), ``kernel_us`` (their summed device
    time: the step's time if nothing waited between them) and ``top`` (the eight costliest
    kernels, device µs per step). The stream's full per-step time is the ``captured`` arm's
    (``batch`` ÷ tokens/s)."""
    engine = StaticEngine(backend.model, backend.decode_step, backend.device, True, 1 << 40)
    own = backend.static
    try:
        params = SamplingParams(n=1, max_tokens=max_tokens, ignore_eos=True, seed=0)
        sample_with(backend, engine, prompts_for(batch, prompt_len), params)  # records graphs
        key = max((k for k in engine._graphs if k[0] == batch), key=lambda k: k[1])
        graph = engine._graphs[key]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(backend.device)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        replay_us = start.elapsed_time(end) * 1000 / replays
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode():
                engine._step(*key)
            torch.cuda.synchronize(backend.device)
        rows = []
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            if us > 0:
                rows.append((e.key, int(e.count), float(us)))
        rows.sort(key=lambda r: -r[2])
        return {
            "key": list(key),
            "replay_us": replay_us,
            "kernels": sum(r[1] for r in rows),
            "kernel_us": sum(r[2] for r in rows),
            "top": {name[:80]: us for name, _, us in rows[:8]},
        }
    finally:
        engine.release()
        backend.static = own
