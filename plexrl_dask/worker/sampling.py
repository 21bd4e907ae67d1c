"""Seeded token choice: randomness as a pure function of (seed, prompt, sample, position).

A stateful generator per worker would make a sample depend on what that worker ran before, and
one generator per batch would make it depend on the batch's composition. Instead every draw is a
counter-based hash (SplitMix64) of its coordinates, so a request samples identical tokens on any
worker, in any batch, split over any number of replicas.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + _GOLDEN) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def row_keys(seed: int, prompt_ids: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
    """The hash of (seed, prompt_id, sample_id) for each pair: what :func:`uniforms_at` needs
    to draw that row's uniform at any position. A decoder computes it once per row, not once
    per row and step."""
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full(prompt_ids.shape, seed, dtype=np.uint64))
        h = _splitmix64(h ^ prompt_ids.astype(np.uint64))
        return _splitmix64(h ^ sample_ids.astype(np.uint64))


def uniforms_at(keys: np.ndarray, position: int | np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row key (:func:`row_keys`) at ``position`` (the token's index
    in its completion: one for all rows, or one per row), as float64."""
    with np.errstate(over="ignore"):
        h = _splitmix64(keys ^ np.asarray(position).astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def uniforms(
    seed: int, prompt_ids: np.ndarray, sample_ids: np.ndarray, position: int | np.ndarray
) -> np.ndarray:
    """One uniform in [0, 1) per (prompt_id, sample_id) pair at ``position`` (the token's
    index in its completion: one for all pairs, or one per pair), as float64."""
    return uniforms_at(row_keys(seed, prompt_ids, sample_ids), position)


def _as_int64(value: int) -> int:
    """The int64 with the bits of the uint64 ``value`` (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_I64 = _as_int64(0x9E3779B97F4A7C15)
_MIX1_I64 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2_I64 = _as_int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int64 ``x`` read as uint64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    # :func:`_splitmix64` on int64 tensors: additions and products wrap modulo 2**64 in two's
    # complement exactly as in uint64, so the bits are the same.
    x = x + _GOLDEN_I64
    x = (x ^ _shift_right(x, 30)) * _MIX1_I64
    x = (x ^ _shift_right(x, 27)) * _MIX2_I64
    return x ^ _shift_right(x, 31)


def keys_tensor(keys: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Row keys (:func:`row_keys`, uint64) as an int64 tensor of the same bits on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(keys, dtype=np.uint64).view(np.int64)).to(device)


def uniforms_on_device(keys: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """:func:`uniforms_at` computed on ``keys``' device (int64 keys from :func:`keys_tensor`,
    int64 positions), bit for bit the same float64 values, with no host round trip: what a
    decode step captured as a CUDA graph draws its uniforms with."""
    h = _splitmix64_torch(keys ^ position)
    return _shift_right(h, 11).to(torch.float64) * (1.0 / (1 << 53))


def choose_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, u: np.ndarray, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` (B, V) by inverse-CDF sampling with uniforms ``u``
    (the CDF in vocabulary order when ``top_p >= 1`` and ``top_k`` is 0; otherwise in
    descending probability, truncated to the ``top_k`` most probable, then to the nucleus of
    what they hold).

    Returns ``(tokens, logprobs)``: the log-probability is under ``log_softmax(logits /
    temperature)`` (before truncation), or under ``log_softmax(logits)`` when greedy.
    Every operation is row-wise, so a row's result does not depend on the other rows.
    """
    target_u = torch.from_numpy(u).to(logits.device)
    return choose_tokens_on_device(
        logits,
        temperature,
        top_p,
        target_u,
        greedy=temperature == 0.0,
        nucleus=top_p < 1.0 or top_k > 0,
        check_end=True,
        top_k=top_k,
    )


def choose_tokens_on_device(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
    u: torch.Tensor,
    *,
    greedy: bool,
    nucleus: bool,
    check_end: bool = False,
    top_k: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`choose_tokens` with the uniforms ``u`` (float64, (B,)) already on the device and
    ``temperature``/``top_p``/``top_k`` as Python numbers or 0-d tensors (float32 / float64
    / int64: the same arithmetic as the numbers; a ``top_k`` of 0 or past the vocabulary
    keeps every token), the kind of choice (``greedy``, ``nucleus``: truncated by ``top_p``
    or ``top_k``) fixed by the caller. With ``check_end`` False nothing waits for the device (no value is read back), so
    the choice can be captured in a CUDA graph; the result is the same either way."""
    logits = logits.float()
    if greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logprobs
    logp = torch.log_softmax(logits / temperature, dim=-1)
    # float64 for the CDF so that the inverse lookup is not at the mercy of fp32 rounding.
    probs = logp.double().exp()
    if not nucleus:
        # No truncation: the CDF in vocabulary order is as exact an inverse as the sorted one,
        # without a sort per step (which cost as much as the rest of the choice together).
        cdf = probs.cumsum(dim=-1)
        target = u[:, None] * cdf[:, -1:]
        idx = torch.searchsorted(cdf, target, right=True)
        # The token found has mass (its CDF entry exceeds the target, the one before does
        # not), unless rounding put the target at the very top (u within 2^-53 of 1): then
        # it is past the end, and the last token with mass is meant (below that, the bound
        # changes nothing). With ``check_end`` it is applied only when needed: five
        # operations a step for a case almost never met, where a read-back is cheap (CPU).
        vocab = probs.shape[-1]
        if not check_end or int(idx.max()) >= vocab:
            last = (vocab - 1) - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)
            idx = torch.minimum(idx, last)
        tokens = idx[:, 0]
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    mass: float | torch.Tensor = 1.0
    if isinstance(top_k, torch.Tensor) or top_k > 0:
        # The top_k most probable first; top_p then takes a share of their mass (Hugging
        # Face's and vLLM's order). A top_k of 0 leaves the mass at 1, as without it.
        rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
        sorted_p = sorted_p * ((rank < top_k) | (top_k <= 0))
        kept = sorted_p.sum(dim=-1, keepdim=True)
        mass = torch.where(top_k > 0, kept, 1.0) if isinstance(top_k, torch.Tensor) else kept
    cdf = sorted_p.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p of it (the first token always stays).
    keep = (cdf - sorted_p) < top_p * mass
    sorted_p = sorted_p * keep
    cdf = sorted_p.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = u[:, None] * total
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    # Never land on a zero-probability (truncated) token through rounding at the boundary.
    idx = torch.minimum(idx, (sorted_p > 0).sum(dim=-1, keepdim=True) - 1)
    tokens = order.gather(-1, idx)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
