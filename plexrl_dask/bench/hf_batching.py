"""Transformers' own continuous batching, measured on an in-memory causal LM.

What is measured: greedy decoding of token-id prompts by ``transformers``' continuous-batching
manager (``model.init_continuous_batching``: a background thread schedules requests onto a paged
KV cache), exactly ``max_new_tokens`` per prompt with EOS disabled, at most ``batch`` sequences at
a time. The cache is sized explicitly (``num_blocks`` for ``batch`` rows of the longest prompt +
``max_new_tokens``), not from a fraction of free device memory. One manager serves an untimed
warm-up (the first ``batch`` prompts, a few tokens each) and then the timed run: the wall time
from submitting the first prompt to receiving the last finished output, and the tokens in those
outputs. Written against the API of transformers 5.17 and 5.24 (both tested on the CPU): 5.17
needs a ``paged|`` attention implementation (``paged|sdpa``, set here before the manager is made,
which also keeps it from switching to flash attention on its own) and names the page size
``block_size``; 5.24 runs ``sdpa`` on the paged cache itself, calls it ``page_size`` and is kept
on ``sdpa`` by ``auto_switch_to_flash=False``. Config fields a version lacks are not passed. A
model loaded with flash attention keeps it (then the manager may use CUDA graphs).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

_PREFIX = "paged|"
# A stop waits for the step in flight: never less than this, however short ``timeout_s`` is.
_MIN_STOP_WAIT_S = 10.0


def _cb_attn_implementation(current: str) -> str:
    """The attention implementation continuous batching runs with, for a model using ``current``:
    the same kernel family on the paged cache (flash stays flash, anything else becomes sdpa)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if current.startswith(_PREFIX):
        return current
    if current == "eager":
        return "paged|eager"
    base = current if current.startswith("flash_attention") else "sdpa"
    # 5.17 registers the paged kernels as "paged|<impl>"; 5.24 runs the plain names on the cache.
    return _PREFIX + base if _PREFIX + "sdpa" in ALL_ATTENTION_FUNCTIONS else base


def _cb_config(batch: int, longest_prompt: int, max_new_tokens: int) -> Any:
    """A ``ContinuousBatchingConfig`` whose cache holds ``batch`` rows of the longest sequence."""
    from transformers.generation import ContinuousBatchingConfig

    fields = {f.name: f.default for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_key = "page_size" if "page_size" in fields else "block_size"
    page = fields[page_key] if isinstance(fields[page_key], int) else 256
    blocks_per_row = math.ceil((longest_prompt + max_new_tokens) / page)
    wanted = {
        page_key: page,
        "num_blocks": batch * blocks_per_row,
        # Tokens in one forward pass: every row's decode step, prefills chunked beyond 8192.
        "max_batch_tokens": max(batch, min(batch * longest_prompt, 8192)),
        "max_requests_per_batch": batch,
        "safety_margin": 0.0,  # admit rows while blocks are free: the cache is sized for them
        "allow_block_sharing": False,  # no prefix caching: every row prefills its own prompt
        "auto_switch_to_flash": False,  # keep the implementation chosen here
    }
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


def _generate(
    manager: Any, prompts: list[list[int]], max_new_tokens: int, tag: str, timeout_s: float
) -> list[list[int]]:
    """Submit ``prompts`` to the running ``manager`` and wait for all of them (in prompt order)."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        if (
            manager.add_request(
                list(prompt), request_id=rid, max_new_tokens=max_new_tokens, eos_token_id=-1
            )
            is None
        ):
            raise RuntimeError(f"the continuous-batching manager refused request {rid}")
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"continuous batching ({tag}): {len(done)}/{len(ids)} requests "
                f"finished in {timeout_s:.0f} s"
            )
        out = manager.get_result(timeout=min(left, 0.5))
        if out is None:
            if not manager.is_running():
                error = manager.background_thread_status.fatal_error
                raise RuntimeError(f"the continuous-batching thread stopped: {error!r}")
            continue
        if out.error is not None:
            raise RuntimeError(f"continuous batching request {out.request_id} failed: {out.error}")
        if out.is_finished() and out.request_id in ids:
            done[out.request_id] = out
    return [list(done[rid].generated_tokens) for rid in ids]


def hf_continuous_batching_rate(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    batch: int,
    eos_token_id: int | None = None,
    timeout_s: float = 120.0,
) -> dict:
    """Greedy generation rate of transformers' continuous batching on ``model``.

    ``model`` is a Hugging Face causal LM already on its device and in its dtype; ``prompts`` are
    token-id lists. Every prompt gets exactly ``max_new_tokens`` greedy tokens (EOS never stops a
    row), with at most ``batch`` sequences in the paged cache at once. ``eos_token_id``, when
    given, is only counted: ``eos_tokens`` in the result is how many generated tokens equal it.

    The model's attention implementation is switched for the run where continuous batching needs
    another one, and restored after it, as is its train/eval mode; the manager's thread is
    stopped and joined before returning. The warm-up and the timed run each wait at most
    ``timeout_s``: past it the manager is hard-stopped and ``TimeoutError`` raised; the thread's
    stop waits at most ``max(timeout_s, 10 s)`` (``TimeoutError`` if it is still running then).

    Returns ``tokens`` (generated tokens of the timed run, counted from its outputs), ``seconds``,
    ``tokens_per_s``, ``attn_implementation`` (the one the run used), ``transformers`` (its
    version), ``outputs`` (the generated ids per prompt, in prompt order) and ``eos_tokens``.
    """
    import torch
    import transformers
    from transformers.generation import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if not prompts or batch < 1 or max_new_tokens < 1:
        raise ValueError("need prompts, batch >= 1 and max_new_tokens >= 1")
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        raise RuntimeError("the model holds a persistent continuous-batching manager already")
    longest = max(len(p) for p in prompts)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=longest, max_generated_length=max_new_tokens, num_requests=len(prompts)
    )
    original_attn, was_training = model.config._attn_implementation, model.training
    manager, stop_wait = None, max(timeout_s, _MIN_STOP_WAIT_S)
    try:
        attn = _cb_attn_implementation(original_attn)
        if attn != original_attn:
            model.set_attn_implementation(attn)
        # no_grad, as generate_batch: 5.17's thread runs outside inference mode and fails on
        # inference tensors made here (by warmup()); 5.24's thread copies the caller's mode.
        with torch.no_grad():
            manager = model.init_continuous_batching(
                generation_config=gen_config,
                continuous_batching_config=_cb_config(batch, longest, max_new_tokens),
                workload_hints=hints,
            )
            attn = model.config._attn_implementation
            manager.warmup()  # captures CUDA graphs / compiles where the config uses them
            manager.start()
            warm_tokens = max(1, min(max_new_tokens, 4))
            _generate(manager, prompts[:batch], warm_tokens, "warmup", timeout_s)
            start = time.perf_counter()
            outputs = _generate(manager, prompts, max_new_tokens, "timed", timeout_s)
            seconds = time.perf_counter() - start
    except BaseException:
        if manager is not None and manager.is_running():  # drop the queued work, don't flush it
            manager.stop(block=True, timeout=stop_wait, hard_stop=True)
        raise
    finally:
        if manager is not None and manager.is_running():
            manager.stop(block=True, timeout=stop_wait)
        if model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)
        model.train(was_training)
        if manager is not None:
            if manager.is_running():  # a step stuck on the device: nothing left but to report it
                raise TimeoutError(
                    f"the continuous-batching thread did not stop in {stop_wait:.0f} s"
                )
            manager.destroy()
    tokens = sum(len(o) for o in outputs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"),
        "attn_implementation": attn,
        "transformers": transformers.__version__,
        "outputs": outputs,
        "eos_tokens": 0 if eos_token_id is None else sum(o.count(eos_token_id) for o in outputs),
    }
