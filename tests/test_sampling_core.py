"""Seeded token choice (``service.sampling``) and the token-level losses (``service.losses``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plexrl_dask import errors
from plexrl_dask.shared.types import CrossEntropy, Datum, PolicyGradient, SamplingParams
from plexrl_dask.worker.losses import compute_loss
from plexrl_dask.worker.sampling import choose_tokens, uniforms

# --- uniforms -----------------------------------------------------------------------------------


def _u(seed: int, pids, sids, position: int) -> np.ndarray:
    return uniforms(
        seed, np.asarray(pids, dtype=np.int64), np.asarray(sids, dtype=np.int64), position
    )


def test_uniforms_deterministic_and_in_range():
    pids = np.arange(5000) % 97
    sids = np.arange(5000) // 97
    a = _u(123, pids, sids, 7)
    b = _u(123, pids.copy(), sids.copy(), 7)
    assert a.dtype == np.float64 and a.shape == (5000,)
    np.testing.assert_array_equal(a, b)
    assert (a >= 0.0).all() and (a < 1.0).all()
    # Roughly uniform: mean and a coarse histogram (5000 draws, loose bounds).
    assert abs(a.mean() - 0.5) < 0.03
    counts, _ = np.histogram(a, bins=10, range=(0.0, 1.0))
    assert counts.min() > 400 and counts.max() < 600


def test_uniforms_are_a_pure_function_of_the_coordinates():
    # A pair's draw does not depend on what else is in the vector, or where.
    pids = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    sids = np.array([0, 1, 0, 2, 0, 0, 3, 1])
    together = _u(42, pids, sids, 11)
    for k in range(len(pids)):
        alone = _u(42, pids[k : k + 1], sids[k : k + 1], 11)
        assert alone[0] == together[k]
    reversed_ = _u(42, pids[::-1], sids[::-1], 11)
    np.testing.assert_array_equal(reversed_, together[::-1])


@pytest.mark.parametrize(
    "other",
    [
        dict(seed=1, pid=0, sid=0, pos=0),  # seed
        dict(seed=0, pid=1, sid=0, pos=0),  # prompt
        dict(seed=0, pid=0, sid=1, pos=0),  # sample
        dict(seed=0, pid=0, sid=0, pos=1),  # position
    ],
)
def test_uniforms_differ_along_each_coordinate(other):
    base = _u(0, [0], [0], 0)[0]
    changed = _u(other["seed"], [other["pid"]], [other["sid"]], other["pos"])[0]
    assert changed != base


def test_uniforms_many_coordinates_are_distinct():
    # Across a grid of prompts × samples × positions × seeds no two draws collide.
    draws = []
    for seed in (0, 1, 2**40 + 3):
        for pos in range(8):
            pids = np.repeat(np.arange(16), 8)
            sids = np.tile(np.arange(8), 16)
            draws.append(_u(seed, pids, sids, pos))
    flat = np.concatenate(draws)
    assert len(np.unique(flat)) == len(flat)


def test_uniforms_do_not_swap_prompt_and_sample():
    # (prompt 1, sample 2) and (prompt 2, sample 1) are different draws.
    a = _u(5, [1, 2], [2, 1], 0)
    assert a[0] != a[1]


# --- choose_tokens ------------------------------------------------------------------------------


# One row of logits, and one uniform, as the property tests below draw them.
LOGIT_ROWS = st.lists(
    st.floats(min_value=-20.0, max_value=20.0, allow_nan=False, width=32), min_size=2, max_size=40
)
UNIFORMS = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)


def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3.0


def test_greedy_is_argmax_with_unscaled_logprobs():
    logits = _random_logits(32, 57, 0)
    u = _u(0, np.arange(32), np.zeros(32), 0)
    tokens, logprobs = choose_tokens(logits, 0.0, 1.0, u)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, atol=0, rtol=0)
    # Greedy ignores top_p and the uniforms.
    tokens2, _ = choose_tokens(logits, 0.0, 0.3, np.zeros(32))
    assert torch.equal(tokens, tokens2)


def test_sampled_logprob_is_under_the_temperature_scaled_distribution():
    logits = _random_logits(16, 40, 1)
    u = _u(9, np.arange(16), np.zeros(16), 0)
    for temperature in (0.5, 1.0, 2.0):
        tokens, logprobs = choose_tokens(logits, temperature, 0.9, u)
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=0)


def test_choose_tokens_is_deterministic():
    logits = _random_logits(64, 100, 2)
    u = _u(3, np.arange(64), np.arange(64) % 4, 5)
    a = choose_tokens(logits, 0.7, 0.9, u)
    b = choose_tokens(logits.clone(), 0.7, 0.9, u.copy())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (0.0, 1.0)])
def test_row_results_do_not_depend_on_other_rows(temperature, top_p):
    vocab = 203
    target = _random_logits(1, vocab, 100)
    u_target = _u(7, [11], [2], 3)
    alone_tok, alone_lp = choose_tokens(target, temperature, top_p, u_target)
    for trial, (rows, where) in enumerate([(8, 0), (8, 7), (33, 16), (64, 40)]):
        batch = _random_logits(rows, vocab, 200 + trial)
        batch[where] = target[0]
        u = _u(99 + trial, np.arange(rows), np.zeros(rows), 0)
        u[where] = u_target[0]
        tok, lp = choose_tokens(batch, temperature, top_p, u)
        assert tok[where].item() == alone_tok.item()
        assert lp[where].item() == alone_lp.item()


def _probs(logits: torch.Tensor, temperature: float) -> np.ndarray:
    return torch.log_softmax(logits.float() / temperature, dim=-1).double().exp().numpy()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    logits=LOGIT_ROWS,
    temperature=st.floats(min_value=0.05, max_value=4.0),
    top_p=st.floats(min_value=1e-6, max_value=1.0, exclude_max=True),
    u=UNIFORMS,
)
def test_top_p_never_picks_outside_the_nucleus(logits, temperature, top_p, u):
    row = torch.tensor([logits], dtype=torch.float32)
    tokens, logprobs = choose_tokens(row, temperature, top_p, np.array([u]))
    chosen = int(tokens[0])
    p = _probs(row, temperature)[0]
    assert 0 <= chosen < len(logits)
    assert p[chosen] > 0.0
    # The nucleus is the smallest most-probable prefix reaching top_p: the mass of the tokens
    # strictly more probable than the chosen one must be below top_p (ties may go either way).
    above = p[p > p[chosen]].sum()
    assert above < top_p + 1e-9, (chosen, above, top_p)
    assert math.isfinite(float(logprobs[0])) and float(logprobs[0]) <= 0.0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    logits=LOGIT_ROWS,
    temperature=st.floats(min_value=0.05, max_value=4.0),
    top_k=st.integers(min_value=1, max_value=8),
    top_p=st.sampled_from([1.0, 0.5]),
    u=UNIFORMS,
)
def test_top_k_picks_among_the_k_most_probable_and_scores_before_truncation(
    logits, temperature, top_k, top_p, u
):
    row = torch.tensor([logits], dtype=torch.float32)
    tokens, logprobs = choose_tokens(row, temperature, top_p, np.array([u]), top_k)
    chosen = int(tokens[0])
    p = _probs(row, temperature)[0]
    assert p[chosen] > 0.0
    # fewer than top_k tokens are strictly more probable than the chosen one
    assert int((p > p[chosen]).sum()) < top_k
    # and top_p applies to the top_k's own mass (Hugging Face's and vLLM's order): the mass of
    # those more probable than the chosen one is under top_p of it (ties may go either way)
    top = np.sort(p)[::-1][:top_k]
    assert float(p[p > p[chosen]].sum()) < top_p * float(top.sum()) + 1e-9
    # its log-probability is under the whole distribution, as without truncation
    full = torch.log_softmax(row / temperature, dim=-1)[0, chosen]
    assert float(logprobs[0]) == pytest.approx(float(full), abs=1e-5)


def test_top_k_of_one_is_the_most_probable_token_whatever_the_uniform():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3)) * 3
    for u in (0.0, 0.3, np.nextafter(1.0, 0.0)):
        tokens, _ = choose_tokens(logits, 1.3, 1.0, np.full(8, u), top_k=1)
        assert torch.equal(tokens, logits.argmax(dim=-1))
    with pytest.raises(errors.InvalidSamplingParams, match="top_k"):
        SamplingParams(top_k=-1)


@settings(max_examples=60, deadline=None)
@given(
    logits=LOGIT_ROWS,
    u=UNIFORMS,
)
def test_tiny_top_p_is_greedy(logits, u):
    row = torch.tensor([logits], dtype=torch.float32)
    tokens, _ = choose_tokens(row, 1.0, 1e-9, np.array([u]))
    # The most probable token as float32 log_softmax sees it: logits closer than its rounding
    # (~1e-7) tie, and the tie goes to the lowest id.
    probs = _probs(row, 1.0)[0]
    chosen = int(tokens[0])
    assert probs[chosen] == probs.max()
    assert chosen == int(np.flatnonzero(probs == probs.max())[0])
    assert row[0, chosen] >= row[0].max() - 1e-5


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    logits=LOGIT_ROWS,
    temperature=st.floats(min_value=0.005, max_value=4.0),
    u=UNIFORMS,
)
def test_untruncated_choice_is_the_inverse_cdf_in_vocabulary_order(logits, temperature, u):
    # top_p = 1 walks the CDF in vocabulary order: the chosen token is the first whose
    # cumulative mass exceeds u x total, and never one without mass (low temperatures
    # underflow most of the vocabulary to exactly zero).
    row = torch.tensor([logits], dtype=torch.float32)
    tokens, logprobs = choose_tokens(row, temperature, 1.0, np.array([u]))
    chosen = int(tokens[0])
    p = _probs(row, temperature)[0]
    assert p[chosen] > 0.0
    cdf = np.cumsum(p)
    target = u * cdf[-1]
    assert cdf[chosen] > target or chosen == int(np.flatnonzero(p > 0)[-1])
    assert chosen == 0 or cdf[chosen - 1] <= target
    assert math.isfinite(float(logprobs[0])) and float(logprobs[0]) <= 0.0


def test_extreme_uniforms_stay_in_vocabulary():
    logits = _random_logits(4, 30, 5)
    logits[:, 10:] = -1e4  # effectively zero mass on most of the vocabulary
    for u in (0.0, 1.0 - 2**-53):
        for temperature, top_p in ((1.0, 0.95), (0.001, 1.0)):
            tokens, _ = choose_tokens(logits, temperature, top_p, np.full(4, u))
            assert ((tokens >= 0) & (tokens < 10)).all()


def _empirical(
    logits: torch.Tensor, temperature: float, top_p: float, n: int, seed: int
) -> np.ndarray:
    batch = logits.expand(n, -1).contiguous()
    u = _u(seed, np.arange(n), np.zeros(n), 0)
    tokens, _ = choose_tokens(batch, temperature, top_p, u)
    return np.bincount(tokens.numpy(), minlength=logits.shape[-1])


def _chi_square(counts: np.ndarray, expected_p: np.ndarray) -> float:
    n = counts.sum()
    support = expected_p > 0
    assert counts[~support].sum() == 0, "draws outside the support"
    e = n * expected_p[support]
    return float(((counts[support] - e) ** 2 / e).sum())


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 40_000
    counts = _empirical(logits, 1.0, 1.0, n, seed=2024)
    p = _probs(logits, 1.0)[0]
    # df = 5: the 99.99th percentile of chi2(5) is ~25.7; deterministic seeds, so no flakes.
    assert _chi_square(counts, p) < 30.0
    np.testing.assert_allclose(counts / n, p, atol=0.01)


def test_empirical_distribution_with_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -0.5, -2.0, -4.0]])
    temperature, top_p = 0.8, 0.8
    n = 40_000
    counts = _empirical(logits, temperature, top_p, n, seed=7)
    p = _probs(logits, temperature)[0]
    order = np.argsort(-p, kind="stable")
    exclusive = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[exclusive < top_p]] = True
    nucleus = np.where(keep, p, 0.0)
    nucleus /= nucleus.sum()
    assert keep.sum() < len(p)  # the test truncates something
    assert _chi_square(counts, nucleus) < 10.0 + 5.0 * keep.sum()
    np.testing.assert_allclose(counts / n, nucleus, atol=0.01)


# --- compute_loss -------------------------------------------------------------------------------


def _setup(lengths=(4, 6), seed=0, pad=-123.0, **fields):
    """A batch of data of the given lengths, a leaf logp (B, L-1) with ``pad`` (garbage by
    default) on padding, and its validity mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) - 1
    logp = -torch.rand(len(lengths), width, generator=g) * 3.0
    valid = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        valid[i, : n - 1] = 1.0
    logp = (logp * valid + (1 - valid) * pad).requires_grad_(True)
    batch = []
    for i, n in enumerate(lengths):
        per = {k: (0.0,) + tuple(v[i][: n - 1]) for k, v in fields.items()}
        batch.append(Datum(tokens=tuple(range(10, 10 + n)), **per))
    return tuple(batch), logp, valid


def test_cross_entropy_equals_manual_weighted_mean():
    weights = [[0.0, 1.0, 0.5], [1.0, 1.0, 0.0, 2.0, 1.0]]
    batch, logp, valid = _setup(weights=weights)
    value, metrics = compute_loss(CrossEntropy(), batch, logp, valid)
    w = torch.zeros_like(logp)
    for i, row in enumerate(weights):
        w[i, : len(row)] = torch.tensor(row)
    manual = -(w * logp.detach()).sum() / w.sum()
    torch.testing.assert_close(value.detach(), manual)
    assert metrics["loss"] == pytest.approx(float(manual), rel=1e-6)
    assert metrics["total_weight"] == pytest.approx(6.5)
    assert metrics["num_tokens"] == 3 + 5
    assert metrics["nll_per_token"] == pytest.approx(float(manual), rel=1e-6)
    value.backward()
    torch.testing.assert_close(logp.grad, -w / w.sum())
    # Padding positions get no gradient even though their logp is garbage.
    assert (logp.grad[valid == 0] == 0).all()


def test_cross_entropy_default_weights_and_explicit_normalizer():
    batch, logp, valid = _setup()
    value, _ = compute_loss(CrossEntropy(), batch, logp, valid)
    torch.testing.assert_close(value.detach(), -(logp.detach() * valid).sum() / valid.sum())
    value2, metrics2 = compute_loss(CrossEntropy(normalizer=100.0), batch, logp, valid)
    torch.testing.assert_close(value2.detach(), -(logp.detach() * valid).sum() / 100.0)
    # nll_per_token stays per token, whatever the normalizer.
    assert metrics2["nll_per_token"] == pytest.approx(float(value.detach()), rel=1e-6)


def test_all_zero_weights_is_invalid():
    batch, logp, valid = _setup(weights=[[0.0] * 3, [0.0] * 5])
    with pytest.raises(errors.InvalidLoss, match="nothing to train"):
        compute_loss(CrossEntropy(), batch, logp, valid)


def _adv(lengths, values):
    return [[values[i]] * (n - 1) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("with_old", [True, False])
def test_policy_gradient_on_policy_value_and_gradient(with_old):
    lengths = (4, 6)
    per_token_adv = [[1.0, -0.5, 2.0], [0.3, 0.3, -1.0, 0.0, 4.0]]
    batch, logp, valid = _setup(lengths, advantages=per_token_adv)
    if with_old:
        # old_logprobs == the current logp, exactly (float32 -> float -> float32 round trip).
        rows = logp.detach().tolist()
        batch = tuple(
            Datum(
                tokens=d.tokens,
                advantages=d.advantages,
                old_logprobs=(0.0,) + tuple(rows[i][: len(d.tokens) - 1]),
            )
            for i, d in enumerate(batch)
        )
    value, metrics = compute_loss(PolicyGradient(), batch, logp, valid)
    a = torch.zeros_like(logp)
    for i, row in enumerate(per_token_adv):
        a[i, : len(row)] = torch.tensor(row)
    normalizer = valid.sum()
    expected = -(a * valid).sum() / normalizer  # -mean(A) over the predicted tokens
    torch.testing.assert_close(value.detach(), expected)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    value.backward()
    # d loss / d logp_i = -A_i w_i / normalizer
    torch.testing.assert_close(logp.grad, -a * valid / normalizer)


def test_policy_gradient_normalizer_scales_value_and_gradient():
    lengths = (3, 3)
    batch, logp, valid = _setup(lengths, advantages=_adv(lengths, [1.0, 2.0]))
    value, _ = compute_loss(PolicyGradient(normalizer=8.0), batch, logp, valid)
    torch.testing.assert_close(value.detach(), torch.tensor(-(2 * 1.0 + 2 * 2.0) / 8.0))


def _one_token_rows(advantages, shifts):
    """Rows of one predicted token each, with that advantage and an old log-probability of
    ``logp + shift`` (so a ratio of ``exp(-shift)``); the batch, logp, valid, logp's rows."""
    lengths = (2,) * len(advantages)
    batch, logp, valid = _setup(lengths, advantages=_adv(lengths, advantages))
    rows = logp.detach().tolist()
    batch = tuple(
        Datum(tokens=d.tokens, advantages=d.advantages, old_logprobs=(0.0, rows[i][0] + shifts[i]))
        for i, d in enumerate(batch)
    )
    return batch, logp, valid, rows


def test_policy_gradient_clipping_zeroes_gradient_beyond_the_trust_region():
    # Row 0: ratio e (> 1 + clip_high) with A > 0 -> clipped, no gradient.
    # Row 1: ratio e with A < 0 -> the unclipped term is the minimum, gradient flows.
    # Row 2: ratio 1/e (< 1 - clip_low) with A < 0 -> clipped, no gradient.
    # Row 3: ratio 1/e with A > 0 -> gradient flows.
    advantages = [1.0, -1.0, -1.0, 1.0]
    shifts = [-1.0, -1.0, 1.0, 1.0]  # old = logp + shift  ->  ratio = exp(-shift)
    batch, logp, valid, rows = _one_token_rows(advantages, shifts)
    loss = PolicyGradient(clip_low=0.2, clip_high=0.2)
    value, metrics = compute_loss(loss, batch, logp, valid)
    value.backward()
    g = logp.grad[:, 0]
    assert g[0] == 0.0 and g[2] == 0.0
    ratio = torch.exp(-torch.tensor(shifts))
    # Unclipped rows: d/dlogp of -(r A)/N = -r A / N
    torch.testing.assert_close(g[1], -ratio[1] * advantages[1] / 4)
    torch.testing.assert_close(g[3], -ratio[3] * advantages[3] / 4)
    # every ratio is outside [0.8, 1.2], but only rows 0 and 2 take the clipped term
    assert metrics["clip_fraction"] == 0.5
    # Value: clipped rows contribute -(clip(r) A), unclipped ones -(r A).
    expected = -(1.2 * 1.0 + math.e * -1.0 + 0.8 * -1.0 + math.exp(-1) * 1.0) / 4
    assert float(value.detach()) == pytest.approx(expected, rel=1e-5)


def test_gspo_gives_a_datum_one_ratio_clipped_as_a_whole():
    """GSPO (``ratio_level="sequence"``): every weighted token of a datum takes the datum's
    ratio ``s = exp(mean(logp - old))``; a datum whose clipped term is taken (``s`` past
    ``1 + clip_high`` with ``A > 0``) gives no gradient to any of its tokens, the others give
    each token ``-s A w / N``."""
    gen = torch.Generator().manual_seed(3)
    lengths, advantages = (4, 5, 3), (0.5, 1.0, -2.0)
    shifts = ([0.1, -0.2, 0.05], [0.4, 0.3, 0.5, 0.2], [0.3, -0.1])  # logp - old
    batch, width = [], max(lengths) - 1
    logp = -torch.rand(3, width, generator=gen) - 0.5
    for n, a, d, row in zip(lengths, advantages, shifts, logp.tolist(), strict=True):
        old = [0.0] + [x - y for x, y in zip(row, d, strict=False)]
        batch.append(Datum(tokens=range(n), advantages=[0.0] + [a] * (n - 1), old_logprobs=old))
    valid = torch.zeros(3, width)
    for i, n in enumerate(lengths):
        valid[i, : n - 1] = 1.0
    logp.requires_grad_(True)
    loss = PolicyGradient(clip_low=0.2, clip_high=0.2, ratio_level="sequence")
    value, _ = compute_loss(loss, tuple(batch), logp, valid)
    value.backward()
    s = [math.exp(sum(d) / len(d)) for d in shifts]  # 0.983, 1.419 (clipped: A > 0), 1.105
    total = sum(n - 1 for n in lengths)
    want = -sum(min(r * a, min(max(r, 0.8), 1.2) * a) * len(d)
                for r, a, d in zip(s, advantages, shifts, strict=True)) / total  # fmt: skip
    assert float(value.detach()) == pytest.approx(want, rel=1e-5)
    grad = logp.grad
    torch.testing.assert_close(grad[0, :3], torch.full((3,), -s[0] * 0.5 / total))
    assert torch.equal(grad[1], torch.zeros(width))  # clipped as a whole
    torch.testing.assert_close(grad[2, :2], torch.full((2,), -s[2] * -2.0 / total))
    assert torch.equal(grad[2, 2:], torch.zeros(width - 2))  # (padding)
    # on-policy (no old log-probs): the ratio is 1, the gradient REINFORCE's
    on = [dataclasses.replace(d, old_logprobs=None) for d in batch]
    fresh = logp.detach().requires_grad_(True)
    value, _ = compute_loss(loss, tuple(on), fresh, valid)
    value.backward()
    want = -torch.tensor(advantages)[:, None] * valid / total
    torch.testing.assert_close(fresh.grad, want)
    with pytest.raises(errors.InvalidLoss, match="ppo objective"):
        PolicyGradient(objective="cispo", ratio_level="sequence")
    with pytest.raises(errors.InvalidLoss, match="ratio_level"):
        PolicyGradient(ratio_level="sentence")


def test_cispo_weighs_every_tokens_gradient_by_its_clipped_ratio_without_its_gradient():
    """CISPO (Tinker's ``cispo``): ``l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp``.
    Unlike PPO's clip, a token past the bounds keeps its gradient, weighed by the bound."""
    advantages = [1.0, -1.0, -1.0, 1.0]
    shifts = [-1.0, -1.0, 1.0, 0.1]  # old = logp + shift  ->  ratio = exp(-shift)
    batch, logp, valid, rows = _one_token_rows(advantages, shifts)
    value, metrics = compute_loss(
        PolicyGradient(objective="cispo", clip_low=0.2, clip_high=0.2, normalizer=1.0),
        batch,
        logp,
        valid,
    )
    value.backward()
    coef = [1.2, 1.2, 0.8, math.exp(-0.1)]  # (the ratio, clipped into [0.8, 1.2])
    lp = [r[0] for r in rows]
    expected = -sum(c * a * x for c, a, x in zip(coef, advantages, lp, strict=True))
    assert float(value.detach()) == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(
        logp.grad[:, 0], -torch.tensor(coef) * torch.tensor(advantages), rtol=1e-5, atol=1e-6
    )
    assert metrics["clip_fraction"] == 0.75  # (every ratio outside the bounds: rows 0-2)


def test_dro_is_the_advantage_weighted_log_probability_less_a_quadratic_penalty():
    """DRO (Tinker's ``dro``): ``l = -(A logp - beta / 2 (logp - old)^2)``."""
    lengths = (3, 4)
    advantages = [[0.5, -1.0], [2.0, 0.0, -0.5]]
    batch, logp, valid = _setup(lengths, pad=0.0, advantages=advantages)
    rows = logp.detach().tolist()
    shifts = [[0.3, -0.2], [0.0, 1.0, 0.5]]
    batch = tuple(
        Datum(
            tokens=d.tokens,
            advantages=d.advantages,
            old_logprobs=(0.0,) + tuple(v + s for v, s in zip(rows[i], shifts[i], strict=False)),
        )
        for i, d in enumerate(batch)
    )
    beta = 0.7
    value, _ = compute_loss(
        PolicyGradient(objective="dro", dro_beta=beta, normalizer=1.0), batch, logp, valid
    )
    value.backward()
    expected, grads = 0.0, []
    for i, row in enumerate(advantages):
        for j, a in enumerate(row):
            x, d = rows[i][j], -shifts[i][j]  # (logp - old)
            expected -= a * x - 0.5 * beta * d * d
            grads.append((i, j, -(a - beta * d)))
    assert float(value.detach()) == pytest.approx(expected, rel=1e-5)
    for i, j, g in grads:
        assert float(logp.grad[i, j]) == pytest.approx(g, rel=1e-5, abs=1e-6)
    assert float(logp.grad[0, 2]) == 0.0  # (padding)


def test_policy_gradient_objectives_are_checked():
    with pytest.raises(errors.InvalidLoss, match="objective"):
        PolicyGradient(objective="gspo")
    with pytest.raises(errors.InvalidLoss, match="dro_beta"):
        PolicyGradient(objective="dro", dro_beta=-1.0)
    with pytest.raises(errors.InvalidLoss, match="clip"):
        PolicyGradient(objective="cispo", clip=False)


def test_policy_gradient_kl_penalty():
    lengths = (3, 4)
    # Padding logp is 0, as the backend passes it (log-probabilities masked by validity).
    batch, logp, valid = _setup(lengths, pad=0.0, advantages=_adv(lengths, [0.0, 0.0]))
    ref_shift = 0.3
    rows = logp.detach().tolist()
    batch = tuple(
        Datum(
            tokens=d.tokens,
            advantages=d.advantages,
            ref_logprobs=(0.0,) + tuple(v + ref_shift for v in rows[i][: len(d.tokens) - 1]),
        )
        for i, d in enumerate(batch)
    )
    value, metrics = compute_loss(PolicyGradient(kl_coef=0.5), batch, logp, valid)
    k3 = math.exp(ref_shift) - ref_shift - 1.0
    assert metrics["kl"] == pytest.approx(k3, rel=1e-4)
    assert float(value.detach()) == pytest.approx(0.5 * k3, rel=1e-4)
    value.backward()
    # d k3 / d logp = 1 - exp(ref - logp)
    torch.testing.assert_close(
        logp.grad, 0.5 * (1.0 - math.exp(ref_shift)) * valid / valid.sum(), atol=1e-6, rtol=1e-4
    )


def test_zero_weight_tokens_cannot_make_the_kl_loss_non_finite():
    """Prompt tokens have weight 0 and ref_logprobs padded with 0.0 (from_prompt_completion).
    A prompt token the model finds very unlikely (logp -100: ref - logp = 100, exp overflows
    float32) must not turn the loss into NaN through ``0 * inf``: it does not count.
    Regression (worker/losses.py, compute_loss: k3 is computed on every position, then weighted)."""
    prompt, completion = [5, 6, 7], [8, 9]
    d = Datum.from_prompt_completion(prompt, completion, advantage=1.0, ref_logprobs=[-1.0, -1.0])
    logp = torch.tensor([[-100.0, -2.0, -1.0, -1.0]], requires_grad=True)  # predicts tokens[1:]
    valid = torch.ones_like(logp)
    value, metrics = compute_loss(PolicyGradient(kl_coef=0.1), (d,), logp, valid)
    assert math.isfinite(float(value.detach())), metrics
    assert math.isfinite(metrics["kl"]) and metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    value.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] == 0.0  # prompt tokens get no gradient


def test_policy_gradient_kl_without_ref_logprobs_is_invalid():
    lengths = (3, 4)
    batch, logp, valid = _setup(lengths, advantages=_adv(lengths, [1.0, 1.0]))
    with pytest.raises(errors.InvalidLoss, match="ref_logprobs"):
        compute_loss(PolicyGradient(kl_coef=0.1), batch, logp, valid)
    # kl_coef 0 does not need them.
    compute_loss(PolicyGradient(kl_coef=0.0), batch, logp, valid)


def test_policy_gradient_without_advantages_is_invalid():
    batch, logp, valid = _setup()
    with pytest.raises(errors.InvalidLoss, match="advantages"):
        compute_loss(PolicyGradient(), batch, logp, valid)


def test_policy_gradient_advantages_on_some_data_only_is_invalid():
    batch, logp, valid = _setup((3, 3))
    partial = (Datum(tokens=batch[0].tokens, advantages=(0.0, 1.0, 1.0)), batch[1])
    with pytest.raises(errors.InvalidLoss, match="some data"):
        compute_loss(PolicyGradient(), partial, logp, valid)


def test_unknown_loss_is_invalid():
    """Regression (worker/losses.py, compute_loss: ``loss.normalizer`` is read before the type check,
    so a wrong loss object raises AttributeError instead of the typed InvalidLoss)."""
    batch, logp, valid = _setup()
    with pytest.raises(errors.InvalidLoss, match="unknown loss"):
        compute_loss("cross-entropy", batch, logp, valid)  # type: ignore[arg-type]
