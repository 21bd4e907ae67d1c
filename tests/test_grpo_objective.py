"""GRPO's options, each checked for what it computes: advantages, learning rates, and the loss of
a tiny batch (hand-computed) through the worker's own loss function."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import plexrl_dask as plexrl
from plexrl_dask.errors import ConfigError, InvalidBatch
from plexrl_dask.rl.episodes import Episode, Turn, episode_data
from plexrl_dask.rl.objective import GRPOConfig, group_advantages, group_data, lr_at
from plexrl_dask.worker.losses import compute_loss

PROMPT = (5, 6)
# two completions of one prompt, of 1 and 3 tokens, rewards 1 and 0
COMPLETIONS = ((7,), (8, 9, 10))
REWARDS = (1.0, 0.0)


def _loss_of(
    config: GRPOConfig, logp_of: dict[int, float], ref_of=None, old_of=None, rewards=REWARDS
) -> float:
    """The worker's loss of the group above (its ``rewards``), the model giving each
    completion token the log-probability ``logp_of[token]``."""
    data, _ = group_data(config, PROMPT, COMPLETIONS, rewards)
    if ref_of is not None or old_of is not None:
        data = [
            plexrl.Datum(
                d.tokens,
                d.weights,
                d.advantages,
                None if old_of is None else tuple(old_of.get(t, 0.0) for t in d.tokens),
                None if ref_of is None else tuple(ref_of.get(t, 0.0) for t in d.tokens),
            )
            for d in data
        ]
    value, _ = compute_loss(config.loss(len(data)), tuple(data), *_predicted(data, logp_of))
    return float(value)


def _predicted(data, logp_of: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, L-1) log-probabilities a model giving each token ``logp_of[token]`` assigns
    to ``data``'s predicted tokens, and their validity."""
    width = max(len(d.tokens) for d in data) - 1
    logp = torch.zeros(len(data), width)
    valid = torch.zeros(len(data), width)
    for i, d in enumerate(data):
        for j, t in enumerate(d.tokens[1:]):
            logp[i, j], valid[i, j] = logp_of.get(t, 0.0), 1.0
    return logp, valid


LOGP = {7: -0.5, 8: -1.0, 9: -2.0, 10: -3.0}


def test_advantages_follow_the_normalisation_asked_for():
    r = [1.0, 0.0, 0.0, 1.0]  # mean 0.5; population std 0.5; sample std sqrt(1/3)
    assert group_advantages(r) == pytest.approx([1, -1, -1, 1], abs=1e-5)
    s = math.sqrt(1 / 3)
    a = 0.5 / s
    assert group_advantages(r, "std-unbiased") == pytest.approx([a, -a, -a, a], abs=1e-5)
    assert group_advantages(r, "none") == [0.5, -0.5, -0.5, 0.5]
    for norm in ("std", "std-unbiased", "none"):
        assert group_advantages([0.1] * 3, norm) == [0.0, 0.0, 0.0]  # equal rewards: nothing
    with pytest.raises(ConfigError, match="advantage_norm"):
        group_advantages(r, "minmax")


def test_each_loss_aggregation_weighs_tokens_as_documented():
    """On-policy (ratio 1): the per-token loss is -A; A = +1 for the 1-token completion and -1
    for the 3-token one."""
    token_mean = _loss_of(GRPOConfig(), LOGP)
    assert token_mean == pytest.approx((-1.0 + 3 * 1.0) / 4, abs=1e-5)  # 4 tokens
    seq_mean = _loss_of(GRPOConfig(loss_aggregation="seq-mean"), LOGP)
    assert seq_mean == pytest.approx((-1.0 + 1.0) / 2, abs=1e-5)  # each completion's mean
    constant = GRPOConfig(loss_aggregation="constant-normalised", prompts_per_step=1,
                          group_size=2, max_tokens=5)  # fmt: skip
    assert _loss_of(constant, LOGP) == pytest.approx(2.0 / 10, abs=1e-5)  # C = 1 * 2 * 5
    given = GRPOConfig(loss_aggregation="constant-normalised", loss_constant=4.0)
    assert _loss_of(given, LOGP) == pytest.approx(2.0 / 4, abs=1e-5)


def test_clip_higher_clips_each_side_at_its_own_bound():
    """Old log-probabilities 0.7 below the new ones: ratio e^0.7 = 2.01. A positive advantage is
    clipped at 1 + clip_high, a negative one is not clipped (min picks the unclipped term)."""
    old = {t: v - 0.7 for t, v in LOGP.items()}
    r = math.exp(0.7)
    for clip_high, pos in ((None, 1.2), (0.28, 1.28)):
        config = GRPOConfig(clip=0.2, clip_high=clip_high)
        want = (-pos * 1.0 + 3 * r * 1.0) / 4
        assert _loss_of(config, LOGP, old_of=old) == pytest.approx(want, abs=1e-5)


def test_a_sequence_level_ratio_is_the_completions_geometric_mean_gspo():
    """``ratio_level="sequence"`` (GSPO): the 3-token completion's tokens are 0.1, 1.3 and 0.7
    above their old log-probabilities; each takes the completion's ratio e^0.7 (their mean)
    instead of its own. Its advantage is negative, so min picks the unclipped term."""
    old = {7: LOGP[7] - 0.7, 8: LOGP[8] - 0.1, 9: LOGP[9] - 1.3, 10: LOGP[10] - 0.7}
    token = (-1.2 + math.exp(0.1) + math.exp(1.3) + math.exp(0.7)) / 4
    sequence = (-1.2 + 3 * math.exp(0.7)) / 4
    assert _loss_of(GRPOConfig(), LOGP, old_of=old) == pytest.approx(token, abs=1e-5)
    gspo = GRPOConfig(ratio_level="sequence")
    assert gspo.loss(2).ratio_level == "sequence"
    assert _loss_of(gspo, LOGP, old_of=old) == pytest.approx(sequence, abs=1e-5)


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [
        ("k1", lambda d: -d),
        ("k2", lambda d: d * d / 2),
        ("k3", lambda d: math.exp(d) - d - 1),
    ],
)
def test_each_kl_estimator_adds_its_documented_term(estimator, per_token):
    ref = {t: v + 0.3 for t, v in LOGP.items()}  # d = ref - logp = 0.3 on every token
    config = GRPOConfig(kl_coef=0.5, kl_estimator=estimator)
    base = _loss_of(GRPOConfig(), LOGP)
    assert _loss_of(config, LOGP, ref_of=ref) == pytest.approx(
        base + 0.5 * per_token(0.3), abs=1e-5
    )


def _episode(turns: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Episode:
    return Episode(PROMPT, tuple(Turn(t, (0.0,) * len(t), "", observation=o) for t, o in turns))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_an_episodes_observations_carry_no_loss_and_no_gradient(aggregation):
    """Two episodes of a group, rewards 1 and 0 (A = +1, -1): the first a call (2 tokens), its
    observation (3) and an answer (1); the second one turn of 2 tokens. Old log-probabilities
    0.5 below the new on the policy's tokens (ratio e^0.5, clipped at 1.2 for A > 0, not for
    A < 0); on the observations' tokens old and new are far apart (e^3): were they not
    masked, the loss would move. The loss is the hand-computed one over the policy's tokens
    alone, and the observations' log-probabilities get a gradient of exactly 0."""
    first = _episode([((11, 12), (20, 21, 22)), ((13,), ())])
    second = _episode([((14, 15), ())])
    config = GRPOConfig(loss_aggregation=aggregation)
    prompt, completions, masks = episode_data([first, second])
    data, _ = group_data(config, prompt, completions, (1.0, 0.0), masks)
    new = {11: -1.0, 12: -1.5, 13: -0.2, 14: -0.7, 15: -0.9, 20: -5.0, 21: -6.0, 22: -7.0}
    old = {t: v - 0.5 for t, v in new.items()} | {20: -2.0, 21: -3.0, 22: -4.0}
    data = [
        plexrl.Datum(d.tokens, d.weights, d.advantages, tuple(old.get(t, 0.0) for t in d.tokens))
        for d in data
    ]
    logp, valid = _predicted(data, new)
    logp.requires_grad_(True)
    value, _ = compute_loss(config.loss(len(data)), tuple(data), logp, valid)
    value.backward()
    r = math.exp(0.5)
    # token-mean: 3 policy tokens at -1.2 (A > 0, clipped), 2 at +r, over 5; seq-mean: each
    # episode's mean over its policy tokens, then over the 2 episodes
    want = (3 * -1.2 + 2 * r) / 5 if aggregation == "token-mean" else (-1.2 + r) / 2
    assert float(value.detach()) == pytest.approx(want, abs=1e-5)
    observed = [(i, j) for i, d in enumerate(data) for j, t in enumerate(d.tokens[1:]) if t >= 20]
    assert len(observed) == 3
    assert all(float(logp.grad[i, j]) == 0.0 for i, j in observed)
    # (the second episode's tokens are not clipped: a gradient of -A * r / n there)
    assert float(logp.grad[1, len(PROMPT) - 1]) != 0.0


def test_zero_advantage_groups_are_dropped_unless_kept():
    config = GRPOConfig()
    assert group_data(config, PROMPT, COMPLETIONS, (1.0, 1.0)) == ([], False)
    kept, teaches = group_data(
        GRPOConfig(keep_zero_advantage=True), PROMPT, COMPLETIONS, (1.0, 1.0)
    )
    assert not teaches and len(kept) == 2
    assert all(a == 0.0 for d in kept for a in d.advantages)


def test_advantage_eps_is_added_to_the_std_and_nothing_else():
    """As TRL's and verl's: a spread under ``advantage_eps`` still teaches (scaled down by
    it); only equal rewards give zero advantages."""
    assert group_advantages([1.0, 0.0], "std", eps=0.5) == pytest.approx([0.5, -0.5])
    # std 0.005: 0.005 / 0.015
    assert group_advantages([1.0, 0.99], "std", eps=0.01) == pytest.approx([1 / 3, -1 / 3])
    assert group_advantages([0.0, 0.1], "std", eps=0.1) == pytest.approx([-1 / 3, 1 / 3])
    assert group_advantages([1.0, 0.99], "std", eps=0.001) == pytest.approx(
        [0.8333, -0.8333], abs=1e-3
    )
    data, teaches = group_data(GRPOConfig(advantage_eps=0.5), PROMPT, COMPLETIONS, REWARDS)
    assert teaches and [d.advantages[-1] for d in data] == pytest.approx([0.5, -0.5])


def test_a_completion_at_its_groups_mean_stays_in_a_group_that_teaches():
    """Rewards (1, 0, 0.5, 0.5): the two completions at the mean have advantage 0, but their
    group teaches, so they stay (their tokens count in the normaliser, as in TRL, verl and
    the GRPO paper); only groups whose rewards are all equal are dropped."""
    completions = [COMPLETIONS[0], COMPLETIONS[1], COMPLETIONS[0], COMPLETIONS[1]]
    data, teaches = group_data(GRPOConfig(), PROMPT, completions, (1.0, 0.0, 0.5, 0.5))
    assert teaches and len(data) == 4
    assert [d.advantages[-1] for d in data][2:] == [0.0, 0.0]


def test_a_kept_zero_advantage_group_carries_its_kl_term_and_nothing_else():
    """Kept (``keep_zero_advantage``), a group whose rewards are equal adds its KL term over
    all its tokens (token mean: k2 of d = 0.3 on each); dropped (the default), nothing."""
    ref = {t: v + 0.3 for t, v in LOGP.items()}
    kept = GRPOConfig(keep_zero_advantage=True, kl_coef=0.5, kl_estimator="k2")
    loss = _loss_of(kept, LOGP, ref_of=ref, rewards=(1.0, 1.0))
    assert loss == pytest.approx(0.5 * 0.3 * 0.3 / 2, abs=1e-6)
    assert group_data(
        replace(kept, keep_zero_advantage=False), PROMPT, COMPLETIONS, (1.0, 1.0)
    ) == (
        [],
        False,
    )


def test_a_completion_stops_at_the_tasks_string_the_configs_or_eos_alone():
    assert GRPOConfig().stops("\n") == ("\n",)
    assert GRPOConfig(stop=["</answer>", "\n\n"]).stops("\n") == ("</answer>", "\n\n")
    assert GRPOConfig(stop=()).stops("\n") == GRPOConfig(eos_only=True).stops("\n") == ()
    assert hash(GRPOConfig(stop=["a"])) == hash(GRPOConfig(stop=("a",)))


def test_the_learning_rate_warms_up_then_follows_its_schedule():
    base = dict(steps=11, lr=1.0)
    assert [lr_at(GRPOConfig(**base), s) for s in (0, 10)] == [1.0, 1.0]
    warm = GRPOConfig(**base, lr_warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.1)
    # the peak on the warm-up's last step (1), then 9 steps of decay to the floor at step 10
    assert [lr_at(warm, s) for s in (0, 1, 2, 10)] == pytest.approx([0.5, 1.0, 0.9, 0.1])
    assert lr_at(warm, 6) == pytest.approx(0.1 + 0.9 * (4 / 9))
    edge = GRPOConfig(steps=10, lr=1.0, lr_warmup_steps=9, lr_schedule="cosine")
    assert lr_at(edge, 8) == 1.0 and lr_at(edge, 9) == pytest.approx(0.0, abs=1e-12)
    cosine = GRPOConfig(**base, lr_schedule="cosine")
    assert [lr_at(cosine, s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-9)
    opt = GRPOConfig(**base, beta2=0.95, weight_decay=0.1, grad_clip=None).optimizer(3)
    assert (opt.lr, opt.beta2, opt.weight_decay, opt.grad_clip) == (1.0, 0.95, 0.1, None)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"advantage_norm": "rank"}, "advantage_norm"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"ratio_level": "sentence"}, "ratio_level"),
        ({"lr_schedule": "step"}, "lr_schedule"),
        ({"clip_high": -0.1}, "clip"),
        ({"beta2": 1.0}, "beta"),
        ({"loss_constant": 0.0}, "loss_constant"),
        ({"lr_warmup_steps": 50}, "lr_warmup_steps"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"stop": "\n"}, "stop"),
        ({"stop": ("\n", "")}, "stop"),
        ({"stop": ("\n",), "eos_only": True}, "eos_only"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"epochs": 1.5}, "epochs"),
        ({"group_size": 2.5}, "group_size"),
        ({"seed": 1.5}, "seed"),
        ({"staleness": True}, "staleness"),
    ],
)
def test_a_bad_option_is_a_config_error_before_any_step(bad, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**bad)


def test_advantages_of_rewards_floats_cannot_tell_apart_are_zero_and_huge_ones_refused():
    assert group_advantages([0.0, 1e-300], "std", 0.0) == [0.0, 0.0]
    with pytest.raises(ConfigError, match="too large"):
        group_advantages([1e308, 1e308, 0.0])


def test_a_loss_normaliser_is_finite():
    from plexrl_dask.errors import InvalidLoss

    for loss in (plexrl.CrossEntropy, plexrl.PolicyGradient):
        with pytest.raises(InvalidLoss, match="finite"):
            loss(normalizer=math.inf)


def test_a_task_without_a_repr_of_its_own_is_named_by_its_class():
    """``object``'s repr holds an address another process does not share: a job checkpoint
    must still match the same task in the next process."""
    from plexrl_dask.tasks.base import describe_task

    class Plain:
        stop = "\n"

    assert describe_task(Plain()) == describe_task(Plain())
    assert "Plain" in describe_task(Plain()) and "0x" not in describe_task(Plain())


def test_a_sharded_steps_fillers_add_nothing():
    """Fewer sequences than ranks: the ranks past the batch train on zero-weight fillers,
    which change neither the loss nor the gradient."""
    from plexrl_dask.shared.checks import rank_shares, whole_batch_loss

    datum = plexrl.Datum.from_prompt_completion([5, 6], [7, 8, 9], advantage=0.5)
    shares = rank_shares([datum], 3, pad=True)
    assert shares[0] == (datum,) and all(len(s) == 1 for s in shares)
    loss = whole_batch_loss(plexrl.PolicyGradient(), [datum], 3)
    logp = torch.tensor([[-1.0, -2.0, -0.5, -0.7]], requires_grad=True)
    value, _ = compute_loss(loss, (datum,), logp, torch.ones_like(logp))
    filler = torch.tensor([[-1.0]], requires_grad=True)
    nothing, _ = compute_loss(loss, shares[1], filler, torch.ones_like(filler))
    nothing.backward()
    assert float(nothing) == 0.0 and float(filler.grad.abs().sum()) == 0.0
    assert float(value) != 0.0
    with pytest.raises(InvalidBatch):
        rank_shares([datum], 3)
