"""Token-level losses of ``forward_backward``: cross-entropy and policy gradient (PPO's
clipped ratio, plain importance sampling, CISPO, DRO: ``PolicyGradient``); a
``GraphLoss`` runs in :mod:`plexrl_dask.worker.loss_graph`.

Inputs are per-token tensors of shape (B, L-1), aligned with the predicted tokens
``tokens[:, 1:]`` (the per-token fields of :class:`~plexrl_dask.Datum` minus their unused
entry 0). Both losses return the scalar to differentiate and metrics as Python floats.
"""

from __future__ import annotations

import numpy as np
import torch

from plexrl_dask.errors import InvalidLoss
from plexrl_dask.shared.types import CrossEntropy, Datum, GraphLoss, Loss, PolicyGradient
from plexrl_dask.worker.loss_graph import graph_loss


def _field(batch: tuple[Datum, ...], name: str, width: int) -> torch.Tensor | None:
    """Stack a per-token field into (B, width) float32, dropping entry 0; None if absent
    everywhere, an error if present on some data only."""
    present = [getattr(d, name) is not None for d in batch]
    if not any(present):
        return None
    if not all(present):
        raise InvalidLoss(f"{name} is set on some data of the batch but not on others")
    out = torch.zeros(len(batch), width, dtype=torch.float32)
    for i, d in enumerate(batch):
        values = getattr(d, name)[1:]
        out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def compute_loss(
    loss: Loss, batch: tuple[Datum, ...], logp: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``batch`` given log-probabilities ``logp`` (B, L-1) of its predicted tokens;
    ``valid`` (B, L-1) is 1 where a real (non-padding) token is predicted."""
    if isinstance(loss, GraphLoss):
        return graph_loss(loss, batch, logp, valid)
    if not isinstance(loss, (CrossEntropy, PolicyGradient)):
        raise InvalidLoss(
            f"unknown loss {type(loss).__name__}: use CrossEntropy, PolicyGradient or GraphLoss"
        )
    width = logp.shape[1]
    weights = torch.zeros(len(batch), width, dtype=torch.float32)
    for i, d in enumerate(batch):
        w = d.token_weights()[1:]
        weights[i, : len(w)] = torch.tensor(w, dtype=torch.float32)
    weights = weights.to(logp.device) * valid
    total_weight = float(weights.sum())
    if total_weight <= 0 and loss.normalizer is None:
        # (with an explicit normalizer a zero-weight part is fine: it is one rank's share of a
        # batch whose weight is elsewhere, and its backward must still run with the others)
        raise InvalidLoss("every token weight in the batch is 0: there is nothing to train on")
    normalizer = loss.normalizer if loss.normalizer is not None else total_weight
    metrics: dict[str, float] = {"num_tokens": float(valid.sum()), "total_weight": total_weight}

    if isinstance(loss, CrossEntropy):
        nll = -(weights * logp).sum()
        value = nll / normalizer
        metrics["nll_per_token"] = float(nll.detach()) / max(total_weight, 1e-12)
    else:
        adv = _field(batch, "advantages", width)
        if adv is None:
            raise InvalidLoss("PolicyGradient needs per-token advantages on every Datum")
        adv = adv.to(logp.device)
        old = _field(batch, "old_logprobs", width)
        old = logp.detach() if old is None else old.to(logp.device)
        mask = weights > 0
        # Unweighted positions get ratio 1: their (padded) old log-probs could overflow exp().
        log_ratio = torch.where(mask, logp - old, torch.zeros_like(logp))
        ratio = torch.exp(log_ratio)
        if loss.ratio_level == "sequence":
            # GSPO-token: the datum's mean log-ratio as every token's value, and each token's
            # own log-probability's gradient scaled by it
            tokens = mask.sum(dim=1, keepdim=True).clamp_min(1)
            sequence = torch.exp(log_ratio.sum(dim=1, keepdim=True).detach() / tokens)
            ratio = sequence * torch.exp(logp - logp.detach())
        # (cispo and dro weigh logp itself: an unweighted position's, padding's, is left out)
        own = torch.where(mask, logp, torch.zeros_like(logp))
        if loss.objective == "cispo":
            low, high = 1.0 - loss.clip_low, 1.0 + loss.clip_high
            per_token = -ratio.clamp(low, high).detach() * adv * own
            clipped = (ratio < low) | (ratio > high)
            metrics["clip_fraction"] = float((clipped & mask).sum()) / max(int(mask.sum()), 1)
        elif loss.objective == "dro":
            per_token = -(adv * own - 0.5 * loss.dro_beta * log_ratio * log_ratio)
        elif loss.clip:
            clipped = ratio.clamp(1.0 - loss.clip_low, 1.0 + loss.clip_high)
            per_token = -torch.minimum(ratio * adv, clipped * adv)
            # Tokens whose clipped term is the one taken (no gradient through them): past
            # the upper bound with A > 0, or under the lower one with A < 0 (TRL's, verl's).
            active = ((ratio > 1.0 + loss.clip_high) & (adv > 0)) | (
                (ratio < 1.0 - loss.clip_low) & (adv < 0)
            )
            metrics["clip_fraction"] = float((active & mask).sum()) / max(int(mask.sum()), 1)
        else:
            per_token = -ratio * adv
        metrics["ratio_mean"] = float((ratio.detach() * weights).sum()) / max(total_weight, 1e-12)
        if loss.kl_coef > 0:
            ref = _field(batch, "ref_logprobs", width)
            if ref is None:
                raise InvalidLoss(
                    "PolicyGradient with kl_coef > 0 needs ref_logprobs on every Datum"
                )
            # Mask the input, not the output: exp() of a huge delta on an unweighted (prompt)
            # token would be inf, and 0 * inf is NaN, in the value and in the gradient.
            delta = torch.where(mask, ref.to(logp.device) - logp, torch.zeros_like(logp))
            if loss.kl_estimator == "k1":
                kl = -delta
            elif loss.kl_estimator == "k2":
                kl = 0.5 * delta * delta
            else:
                kl = torch.exp(delta) - delta - 1.0
            per_token = per_token + loss.kl_coef * kl
            metrics["kl"] = float((kl.detach() * weights).sum()) / max(total_weight, 1e-12)
        value = (weights * per_token).sum() / normalizer
    metrics["loss"] = float(value.detach())
    return value, metrics


def top_per_datum(
    values: torch.Tensor, ids: torch.Tensor, batch: tuple[Datum, ...]
) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Each datum's top tokens from the (B, L-1, k) batch tensors, as ``ForwardResult.top``
    holds them: arrays aligned with its tokens (row 0 ids -1, log-probabilities -inf)."""
    values = values.detach().to("cpu", torch.float32).numpy()
    ids = ids.detach().to("cpu", torch.int32).numpy()
    out = []
    for i, d in enumerate(batch):
        n, k = len(d.tokens) - 1, ids.shape[-1]
        row0_ids, row0_values = np.full((1, k), -1, np.int32), np.full((1, k), -np.inf, np.float32)
        out.append((np.concatenate([row0_ids, ids[i, :n]]),
                    np.concatenate([row0_values, values[i, :n]])))  # fmt: skip
    return tuple(out)


def per_datum(logp: torch.Tensor, batch: tuple[Datum, ...]) -> tuple[tuple[float, ...], ...]:
    """Each datum's log-probabilities from the (B, L-1) batch tensor, aligned with its tokens
    (entry 0, never predicted, is 0.0)."""
    rows = logp.detach().cpu().tolist()
    return tuple(
        (0.0,) + tuple(row[: len(d.tokens) - 1]) for row, d in zip(rows, batch, strict=True)
    )
