"""GRPO's objective as researchers configure it: :class:`GRPOConfig` and the pure functions that
turn one step's samples and rewards into training data, a loss and an optimizer step.

Pure code (no Dask, no torch): :class:`~plexrl_dask.rl.grpo.GRPOJob` calls it every step, and
the tests compute each option's loss by hand against it (``tests/test_grpo_objective.py``).

**Temperature**: log-probabilities are scored at the sampling ``temperature`` on every side of
the ratio and the KL (:meth:`GRPOConfig.scoring_temperature`, carried by the loss), the
distribution the completions came from, as TRL and verl score them.

**Advantages** (:func:`group_advantages`), per group of ``group_size`` completions of one
prompt with rewards ``r``: ``A = (r - mean(r)) / (std(r) + advantage_eps)`` with
``advantage_norm``:

- ``"std"`` (default): the population standard deviation;
- ``"std-unbiased"``: the sample standard deviation (``n - 1``), as some trainers compute it;
- ``"none"``: centred only, ``A = r - mean(r)`` (Dr. GRPO: no per-group rescaling).

A group whose rewards are all equal has ``A = 0`` everywhere and teaches nothing; it is dropped
from the batch unless ``keep_zero_advantage`` (then its tokens still carry the KL term and count
in the loss's normaliser). In a group that teaches every completion stays, those at the mean
(``A = 0``) included. ``advantage_eps`` only adds to the std.

**Loss aggregation** (``loss_aggregation``; the per-token loss is the clipped importance-weighted
advantage plus ``kl_coef`` times the KL estimate, :class:`~plexrl_dask.PolicyGradient`), over the
batch's completions ``i`` of lengths ``|o_i|``, ``N`` of them:

- ``"token-mean"`` (default): ``sum_i sum_t l_it / sum_i |o_i|``, every token counts the same
  (DAPO);
- ``"seq-mean"``: ``(1/N) sum_i (1/|o_i|) sum_t l_it``, every completion counts the same
  (GRPO as published): token weights ``1 / |o_i|``, normaliser ``N``;
- ``"constant-normalised"``: ``sum_i sum_t l_it / C`` with ``C = loss_constant``, by default
  ``prompts_per_step * group_size * max_tokens`` (Dr. GRPO: no length bias from the divisor).

**Clipping**: the ratio is clipped to ``[1 - clip, 1 + clip_high]`` (``clip_high`` None: ``clip``,
symmetric; DAPO's clip-higher, e.g. ``clip=0.2, clip_high=0.28``). ``ratio_level``: ``"token"``
(default; PPO, GRPO) gives each token its own ratio; ``"sequence"`` gives each completion one,
the geometric mean of its tokens' (GSPO: the completion is clipped as a whole; its paper uses
``clip=3e-4, clip_high=4e-4`` and ``"seq-mean"``).

**KL** to the reference (``kl_coef > 0`` needs a ``reference`` deployment), per token with
``d = ref_logp - logp``: ``"k1"`` ``-d``; ``"k2"`` ``d^2 / 2``; ``"k3"`` (default)
``exp(d) - d - 1``, the unbiased non-negative estimator.

**Optimizer**: AdamW with ``beta1``, ``beta2``, ``adam_eps``, ``weight_decay`` (on every
parameter, or, with ``no_decay="biases-and-norms"``, not on biases and normalisation weights,
as Hugging Face's ``Trainer`` and TRL) and ``grad_clip`` (max global L2 norm, None: none), at the learning rate of :func:`lr_at`: a linear warm-up over
``lr_warmup_steps`` steps from ``lr / lr_warmup_steps`` to ``lr`` (reached on the warm-up's
last step), then ``lr_schedule`` ``"constant"``, ``"linear"`` or ``"cosine"`` decay from there
to ``min_lr_ratio * lr`` on the last step.
``epochs`` optimizer steps per batch; from the second on, the importance ratio is against the
log-probabilities of the policy that sampled (scored before the first epoch).

**Stopping**: completions stop at EOS and at the task's stop string, or at the strings of
``stop`` in its place (any of them), or with ``eos_only`` at EOS only (and at ``max_tokens``
in every case).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from plexrl_dask.errors import ConfigError, InvalidLoss, InvalidOptimizerParams
from plexrl_dask.shared.types import (
    KL_ESTIMATORS,
    MIN_TEMPERATURE,
    AdamWParams,
    Datum,
    PolicyGradient,
)

LOSS_AGGREGATIONS = ("token-mean", "seq-mean", "constant-normalised")
ADVANTAGE_NORMS = ("std", "std-unbiased", "none")
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class GRPOConfig:
    """A GRPO job's hyper-parameters (all of what makes two runs comparable; the module
    docstring says what each option computes)."""

    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    max_tokens: int = 32
    lr: float = 1e-4
    #: The ratio's clip range below 1 (and above, unless ``clip_high`` is set).
    clip: float = 0.2
    clip_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    ratio_level: str = "token"
    epochs: int = 1
    #: 0: synchronous (on-policy); 1: split-async, the rollout one step ahead.
    staleness: int = 0
    seed: int = 0
    #: Where problems start in the task's index space (keep clear of a warm-up's indices).
    problem_offset: int = 1_000_000
    loss_aggregation: str = "token-mean"
    loss_constant: float | None = None
    advantage_norm: str = "std"
    advantage_eps: float = 1e-6
    keep_zero_advantage: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: str = "none"
    grad_clip: float | None = 1.0
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    eos_only: bool = False
    #: The strings a completion stops at (besides EOS); None: the task's ``stop``.
    stop: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "epochs", "max_tokens", "seed",
                     "staleness", "lr_warmup_steps"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{name} is an integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # (a numpy integer given: a plain one)
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (isinstance(self.temperature, int | float) and not isinstance(self.temperature, bool)
                and math.isfinite(self.temperature) and self.temperature >= 0):  # fmt: skip
            raise ConfigError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(
                f"temperature is 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature!r}"
            )
        if min(self.steps, self.prompts_per_step, self.group_size, self.epochs) < 1:
            raise ConfigError(
                f"steps, prompts_per_step, group_size and epochs must be >= 1: {self}"
            )
        if self.staleness not in (0, 1):
            raise ConfigError(
                f"staleness is 0 (synchronous) or 1 (split-async), got {self.staleness}"
            )
        if self.group_size < 2:
            raise ConfigError("GRPO needs group_size >= 2 (advantages are relative to the group)")
        for name, value, allowed in (
            ("loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS),
            ("advantage_norm", self.advantage_norm, ADVANTAGE_NORMS),
            ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
            ("lr_schedule", self.lr_schedule, LR_SCHEDULES),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} is one of {allowed}, got {value!r}")
        if not (self.advantage_eps >= 0 and math.isfinite(self.advantage_eps)):
            raise ConfigError(f"advantage_eps must be finite and >= 0, got {self.advantage_eps}")
        if self.loss_constant is not None and not (
            self.loss_constant > 0 and math.isfinite(self.loss_constant)
        ):
            raise ConfigError(f"loss_constant must be finite and > 0, got {self.loss_constant}")
        if not (0 <= self.lr_warmup_steps <= self.steps):
            raise ConfigError(f"lr_warmup_steps must be in [0, steps], got {self.lr_warmup_steps}")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.stop is not None:
            if isinstance(self.stop, str) or not all(isinstance(x, str) and x for x in self.stop):
                raise ConfigError(f"stop is a tuple of non-empty strings, got {self.stop!r}")
            if self.eos_only and self.stop:
                raise ConfigError(f"eos_only stops at EOS alone: it takes no stop {self.stop!r}")
            object.__setattr__(self, "stop", tuple(self.stop))  # (a list given: hashable)
        try:  # the worker's own checks, run here first: a bad value fails before any step
            self.loss(1)
            self.optimizer(0)
        except (InvalidLoss, InvalidOptimizerParams) as e:
            raise ConfigError(str(e)) from e

    def loss(self, sequences: int) -> PolicyGradient:
        """The loss of a batch of ``sequences`` completions (its normaliser follows
        ``loss_aggregation``)."""
        normalizer = None
        if self.loss_aggregation == "seq-mean":
            normalizer = float(max(sequences, 1))
        elif self.loss_aggregation == "constant-normalised":
            normalizer = self.loss_constant or float(
                self.prompts_per_step * self.group_size * self.max_tokens
            )
        return PolicyGradient(
            clip_low=self.clip,
            clip_high=self.clip if self.clip_high is None else self.clip_high,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            normalizer=normalizer,
            temperature=self.scoring_temperature,
            ratio_level=self.ratio_level,
        )

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probabilities are scored at: the sampling temperature (the
        distribution the completions came from), 1 for greedy sampling."""
        return self.temperature if self.temperature > 0 else 1.0

    def stops(self, task_stop: str) -> tuple[str, ...]:
        """The strings a completion stops at, the task's being ``task_stop`` (see Stopping)."""
        if self.eos_only:
            return ()
        if self.stop is not None:
            return self.stop
        return (task_stop,) if task_stop else ()  # (a task's "" is no stop string)

    def optimizer(self, step: int) -> AdamWParams:
        """The AdamW step of GRPO step ``step`` (its learning rate: :func:`lr_at`)."""
        return AdamWParams(
            lr=lr_at(self, step),
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.adam_eps,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
            no_decay=self.no_decay,
        )


def lr_at(config: GRPOConfig, step: int) -> float:
    """The learning rate of step ``step`` (from 0): see the module docstring."""
    lr, warm = config.lr, config.lr_warmup_steps
    if step < warm:
        return lr * (step + 1) / warm
    if config.lr_schedule == "constant":
        return lr
    # The decay starts at the peak, the warm-up's last step (or step 0), and ends at the
    # floor on the last step: no step repeats the peak, and the last is never at it.
    start = max(warm - 1, 0)
    progress = min(max((step - start) / max(config.steps - 1 - start, 1), 0.0), 1.0)
    floor = config.min_lr_ratio
    if config.lr_schedule == "linear":
        return lr * (floor + (1.0 - floor) * (1.0 - progress))
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def group_advantages(rewards: Sequence[float], norm: str = "std", eps: float = 1e-6) -> list[float]:
    """The advantages of one group's completions (see the module docstring); all 0 when the
    group's rewards are equal."""
    n = len(rewards)
    if n == 0 or max(rewards) == min(rewards):
        return [0.0] * n
    mean = sum(rewards) / n
    if norm == "none":
        return [r - mean for r in rewards]
    if norm not in ("std", "std-unbiased"):
        raise ConfigError(f"advantage_norm is one of {ADVANTAGE_NORMS}, got {norm!r}")
    if not math.isfinite(mean):  # (each is finite: rewards.score checks; their sum overflowed)
        raise ConfigError(f"a group's rewards are too large to average: {rewards!r:.80}")
    dof = n - 1 if norm == "std-unbiased" else n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(dof, 1))
    if std + eps == 0:  # (rewards apart by less than floats resolve: nothing to tell apart)
        return [0.0] * n
    return [(r - mean) / (std + eps) for r in rewards]


def group_data(
    config: GRPOConfig,
    prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    masks: Sequence[Sequence[float]] | None = None,
) -> tuple[list[Datum], bool]:
    """One group's training data (its completions with their advantage, token weights as
    ``loss_aggregation`` says; none for a zero-advantage group unless ``keep_zero_advantage``)
    and whether the group teaches something (a non-zero advantage). ``masks``: per completion
    token, 1 where the policy produced it and 0 where it did not (an agentic episode's tool
    observations: :mod:`plexrl_dask.rl.episodes`), multiplying its weight; "seq-mean" then
    averages over the policy's tokens."""
    advantages = group_advantages(rewards, config.advantage_norm, config.advantage_eps)
    teaches = any(advantages)
    if not teaches and not config.keep_zero_advantage:
        return [], False
    data = []
    for k, (tokens, advantage) in enumerate(zip(completions, advantages, strict=True)):
        # (a completion whose reward is its group's mean stays: its tokens count in the
        # normaliser and carry the KL term, as in every other trainer)
        if not tokens:
            continue
        datum = Datum.from_prompt_completion(prompt, tokens, advantage=advantage)
        mask = tuple(masks[k]) if masks is not None else (1.0,) * len(tokens)
        if len(mask) != len(tokens):
            raise ConfigError(f"a mask of {len(mask)} for a completion of {len(tokens)} tokens")
        w = 1.0 / max(1.0, sum(mask)) if config.loss_aggregation == "seq-mean" else 1.0
        if masks is not None or w != 1.0:
            datum = Datum(
                datum.tokens, (0.0,) * len(prompt) + tuple(w * m for m in mask), datum.advantages
            )
        data.append(datum)
    return data, teaches
