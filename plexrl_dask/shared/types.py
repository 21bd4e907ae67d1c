"""The data that crosses the narrow API: batches, losses, optimizer and sampling parameters,
and results.

Everything here is a small frozen dataclass of Python scalars and lists so that it pickles
cheaply and identically everywhere. Validation that needs no model (ranges, lengths) happens in
``__post_init__``, so a bad value fails on the caller's side, before anything is submitted; checks
that need the model (vocabulary, positions) happen on the worker and raise the same typed errors.

Per-token conventions: every per-token field (``weights``, ``advantages``, ``old_logprobs``,
``ref_logprobs``, and returned ``logprobs``) is aligned with ``tokens``: entry ``i`` refers to
token ``i`` as predicted from ``tokens[:i]``. Entry 0 has no prediction; its weight must be 0 and
its returned log-probability is 0.0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plexrl_dask import config
from plexrl_dask.errors import (
    ConfigError,
    EmptyBatch,
    InvalidBatch,
    InvalidLoss,
    InvalidOptimizerParams,
    InvalidSamplingParams,
    MismatchedLengths,
    SequenceTooLong,
    TokenOutOfVocabulary,
)
from plexrl_dask.shared.loss_graph import GraphLoss


def _real(value: object) -> bool:
    """A finite real number (not a bool): what every numeric parameter here must be."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _floats(values: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


@dataclass(frozen=True)
class Datum:
    """One sequence to score or train on.

    ``weights`` default to 1 on every predicted token (all but the first), i.e. plain language
    modelling; set them to 0 on prompt tokens to train on completions only. ``inputs``: the
    named values a :class:`~plexrl_dask.shared.loss_graph.GraphLoss` reads, each a number or
    one per token (aligned with ``tokens`` as the other per-token fields, entry 0 unused);
    given as a mapping, kept as sorted pairs.
    """

    tokens: tuple[int, ...]
    weights: tuple[float, ...] | None = None
    advantages: tuple[float, ...] | None = None
    old_logprobs: tuple[float, ...] | None = None
    ref_logprobs: tuple[float, ...] | None = None
    inputs: tuple[tuple[str, float | tuple[float, ...]], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", token_ids(self.tokens, "Datum.tokens"))
        for name in ("weights", "advantages", "old_logprobs", "ref_logprobs"):
            object.__setattr__(self, name, _floats(getattr(self, name)))
        if len(self.tokens) < 2:
            raise EmptyBatch(
                f"a Datum needs at least 2 tokens (one to predict from, one to predict); "
                f"got {len(self.tokens)}"
            )
        for name in ("weights", "advantages", "old_logprobs", "ref_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.tokens):
                raise MismatchedLengths(
                    f"Datum.{name} has {len(values)} entries but tokens has {len(self.tokens)}; "
                    "per-token fields are aligned with tokens (entry 0 is unused)"
                )
        if self.weights is not None and self.weights[0] != 0.0:
            raise MismatchedLengths("Datum.weights[0] must be 0: token 0 is never predicted")
        if self.inputs is not None:
            object.__setattr__(self, "inputs", _named_inputs(self.inputs, len(self.tokens)))

    def input(self, name: str) -> float | tuple[float, ...] | None:
        """The named input ``name`` (None when the datum has none of that name)."""
        return dict(self.inputs or ()).get(name)

    @classmethod
    def from_prompt_completion(
        cls,
        prompt: Sequence[int],
        completion: Sequence[int],
        advantage: float | None = None,
        old_logprobs: Sequence[float] | None = None,
        ref_logprobs: Sequence[float] | None = None,
    ) -> Datum:
        """A datum that trains on ``completion`` only. ``old_logprobs``/``ref_logprobs``, when
        given, are per completion token (as :meth:`Deployment.sample` returns them)."""
        prompt, completion = token_ids(prompt, "the prompt"), token_ids(completion, "completion")
        n_p, n_c = len(prompt), len(completion)
        if n_p < 1 or n_c < 1:
            raise EmptyBatch("prompt and completion each need at least one token")

        def pad(values: Sequence[float] | None, what: str) -> tuple[float, ...] | None:
            if values is None:
                return None
            if len(values) != n_c:
                raise MismatchedLengths(
                    f"{what} has {len(values)} entries for {n_c} completion tokens"
                )
            return (0.0,) * n_p + tuple(values)

        return cls(
            tokens=tuple(prompt) + tuple(completion),
            weights=(0.0,) * n_p + (1.0,) * n_c,
            advantages=None if advantage is None else (0.0,) * n_p + (float(advantage),) * n_c,
            old_logprobs=pad(old_logprobs, "old_logprobs"),
            ref_logprobs=pad(ref_logprobs, "ref_logprobs"),
        )

    def token_weights(self) -> tuple[float, ...]:
        return (
            self.weights if self.weights is not None else (0.0,) + (1.0,) * (len(self.tokens) - 1)
        )


def _named_inputs(inputs: Any, n: int) -> tuple[tuple[str, float | tuple[float, ...]], ...]:
    """``Datum.inputs`` as sorted ``(name, value)`` pairs: each value a finite number or
    ``n`` finite numbers; :class:`InvalidLoss` otherwise."""
    pairs = inputs.items() if isinstance(inputs, Mapping) else inputs
    try:
        pairs = sorted((name, value) for name, value in pairs)
    except (TypeError, ValueError):
        raise InvalidLoss("Datum.inputs maps names to numbers or per-token lists") from None
    out: list[tuple[str, float | tuple[float, ...]]] = []
    for name, value in pairs:
        if not isinstance(name, str) or (out and out[-1][0] == name):
            raise InvalidLoss(f"Datum.inputs: {name!r} is not a name, or is given twice")
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            values: float | tuple[float, ...] = float(value)
            finite = math.isfinite(values)
        elif isinstance(value, Iterable) and not isinstance(value, str | bytes):
            values = tuple(float(v) for v in value)
            if len(values) != n:
                raise MismatchedLengths(
                    f"Datum.inputs[{name!r}] has {len(values)} entries but tokens has {n}; "
                    "per-token inputs are aligned with tokens (entry 0 is unused)"
                )
            finite = all(math.isfinite(v) for v in values)
        else:
            raise InvalidLoss(f"Datum.inputs[{name!r}] is a number or a list of numbers")
        if not finite:
            raise InvalidLoss(f"Datum.inputs[{name!r}] has NaN or infinite values")
        out.append((name, values))
    return tuple(out)


def check_tokens(
    seqs: Sequence[Sequence[int]],
    vocab_size: int,
    max_positions: int,
    extra: int = 0,
    what: str = "sequence",
) -> None:
    """Reject empty sequences, ids outside ``[0, vocab_size)`` and sequences that with ``extra``
    generated tokens exceed ``max_positions``, with the typed error that says which."""
    if not seqs:
        raise EmptyBatch(f"no {what}s given")
    for i, seq in enumerate(seqs):
        if len(seq) == 0:
            raise EmptyBatch(f"{what} {i} has no tokens")
        lo, hi = min(seq), max(seq)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise TokenOutOfVocabulary(
                f"{what} {i} contains token id {bad}, outside this model's vocabulary "
                f"[0, {vocab_size})"
            )
        if len(seq) + extra > max_positions:
            more = f" + max_tokens {extra}" if extra else ""
            raise SequenceTooLong(
                f"{what} {i} has {len(seq)} tokens{more}, more than the model's "
                f"{max_positions} positions; shorten it" + (" or lower max_tokens" if extra else "")
            )


def token_ids(values: Any, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints if it is a sequence of integers (a numpy integer is one;
    a bool, a float, a string of digits is not: never rounded or read digit by digit);
    else :class:`InvalidBatch` naming ``what``."""
    if isinstance(values, (str, bytes)):
        raise InvalidBatch(
            f"{what} is a sequence of token ids, got {type(values).__name__}: tokenize text "
            "first (Deployment.tokenize(text); a completion with special_tokens=False)"
        )
    if isinstance(values, Mapping) or not isinstance(values, Iterable):
        raise InvalidBatch(f"{what} is a sequence of token ids, got {type(values).__name__}")
    ids = tuple(values)
    if not all(type(t) is int for t in ids) and not all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids
    ):
        bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral))
        raise InvalidBatch(f"{what}: token ids are integers, got {bad!r:.40}")
    return tuple(map(int, ids))


def as_batch(batch: Sequence[Datum] | Datum) -> tuple[Datum, ...]:
    """Normalise a batch argument and reject an empty one."""
    if isinstance(batch, Datum):
        batch = (batch,)
    if isinstance(batch, (str, bytes, Mapping)) or not isinstance(batch, Iterable):
        raise EmptyBatch(f"a batch is a list of plexrl_dask.Datum, got {type(batch).__name__}")
    batch = tuple(batch)
    if not batch:
        raise EmptyBatch("the batch is empty: pass at least one Datum")
    for d in batch:
        if not isinstance(d, Datum):
            raise EmptyBatch(f"batch items must be plexrl_dask.Datum, got {type(d).__name__}")
    return batch


# --- losses ---------------------------------------------------------------------------------



def _positive(value: Any) -> bool:
    """Whether ``value`` is a finite number > 0 (a loss's normaliser)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )

@dataclass(frozen=True)
class CrossEntropy:
    """Weighted next-token cross-entropy (warm-up / SFT).

    ``loss = -sum_i w_i log p(token_i) / normalizer``; ``normalizer`` defaults to the batch's
    total weight. Pass the whole step's total weight when a step is split over several
    ``forward_backward`` calls, so that the accumulated gradient equals the one-call gradient.
    """

    normalizer: float | None = None

    def __post_init__(self) -> None:
        if self.normalizer is not None and not _positive(self.normalizer):
            raise InvalidLoss(f"normalizer must be finite and > 0, got {self.normalizer!r}")


#: The estimators of KL(policy || reference) that :class:`PolicyGradient` can add.
KL_ESTIMATORS = ("k1", "k2", "k3")


#: What ``PolicyGradient.objective`` may say.
PG_OBJECTIVES = ("ppo", "cispo", "dro")
#: What ``PolicyGradient.ratio_level`` may say.
RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class PolicyGradient:
    """Importance-sampled policy gradient with PPO/GRPO clipping and an optional KL penalty.

    Per predicted token with ratio ``r = exp(logp - old_logp)`` and advantage ``A``:
    ``l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef * k`` where, with
    ``d = ref - logp``, ``k`` is ``kl_estimator``'s estimate of KL(policy || reference):
    ``"k1"`` ``-d``, ``"k2"`` ``d^2 / 2``, ``"k3"`` ``exp(d) - d - 1`` (the unbiased,
    non-negative one; default).
    ``loss = sum_i w_i l_i / normalizer`` (default: total weight, i.e. a token-level mean).
    Without ``old_logprobs`` the ratio is 1 with the gradient of ``logp`` (on-policy REINFORCE).
    ``clip=False``: no clipping, ``l = -r A`` (plain importance sampling, Tinker's
    ``importance_sampling``); ``clip_low``/``clip_high`` are then unused.
    ``objective`` (with the KL penalty above added to each): ``"ppo"`` (the rule above;
    default); ``"cispo"``, ``l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp`` (CISPO,
    Tinker's ``cispo``: the clipped ratio, without its gradient, weighs the log-probability's,
    so a token past the bounds keeps a gradient where PPO's clip drops it); ``"dro"``,
    ``l = -(A logp - dro_beta / 2 (logp - old_logp)^2)`` (DRO, Tinker's ``dro``: a quadratic
    penalty on the distance from the sampler instead of a clip; the advantages are the
    caller's, as Tinker's).
    ``ratio_level``: ``"token"`` (default) gives each token its own ratio ``r``;
    ``"sequence"`` (GSPO, the ``ppo`` objective only) gives every token of a datum the
    datum's length-normalised ratio ``s = exp(mean(logp - old_logp))`` over its weighted
    tokens, with the gradient of GSPO-token (``sg(s) exp(logp - sg(logp))``: each token's
    log-probability's gradient times ``s``), so a datum is clipped as a whole and every token
    of it moves by the same factor (GSPO's paper clips to ``[1 - 3e-4, 1 + 4e-4]``).
    ``temperature``: ``logp`` is under ``softmax(logits / temperature)``, the distribution the
    completions were sampled from (TRL's and verl's rule); ``old_logprobs`` and
    ``ref_logprobs`` are to be scored at the same temperature.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    normalizer: float | None = None
    kl_estimator: str = "k3"
    clip: bool = True
    temperature: float = 1.0
    objective: str = "ppo"
    dro_beta: float = 0.05
    ratio_level: str = "token"

    def __post_init__(self) -> None:
        if not isinstance(self.clip, bool):
            raise InvalidLoss(f"clip is True or False, got {self.clip!r}")
        if self.objective not in PG_OBJECTIVES:
            raise InvalidLoss(f"objective is one of {PG_OBJECTIVES}, got {self.objective!r}")
        if self.objective == "cispo" and not self.clip:
            raise InvalidLoss("the cispo objective clips its ratio: clip must be True")
        if self.ratio_level not in RATIO_LEVELS:
            raise InvalidLoss(f"ratio_level is one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        if self.ratio_level == "sequence" and self.objective != "ppo":
            raise InvalidLoss("a sequence-level ratio (GSPO) is for the ppo objective")
        b = self.dro_beta
        if isinstance(b, bool) or not isinstance(b, int | float) or not (
            math.isfinite(b) and b >= 0
        ):
            raise InvalidLoss(f"dro_beta must be finite and >= 0, got {b!r}")
        if not (0.0 <= self.clip_low < 1.0) or not (self.clip_high >= 0.0):
            raise InvalidLoss(
                f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, "
                f"{self.clip_high}"
            )
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise InvalidLoss(f"kl_coef must be finite and >= 0, got {self.kl_coef}")
        if self.normalizer is not None and not _positive(self.normalizer):
            raise InvalidLoss(f"normalizer must be finite and > 0, got {self.normalizer!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise InvalidLoss(f"kl_estimator is one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t > 0):
            raise InvalidLoss(f"temperature must be finite and > 0, got {t!r}")


Loss = CrossEntropy | PolicyGradient | GraphLoss


#: What ``AdamWParams.no_decay`` may say.
NO_DECAY = ("none", "biases-and-norms")


@dataclass(frozen=True)
class AdamWParams:
    """Hyperparameters of one ``optim_step`` (AdamW); ``grad_clip`` is the max global L2 norm
    (``None``: no clipping). ``no_decay``: which parameters ``weight_decay`` leaves alone:
    ``"none"`` (torch's AdamW: it decays every parameter) or ``"biases-and-norms"`` (as
    Hugging Face's ``Trainer`` and TRL do: biases and normalisation weights, by the names
    ``Trainer.get_decay_parameter_names`` matches)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    no_decay: str = "none"

    def __post_init__(self) -> None:
        betas = (self.beta1, self.beta2)
        clip = self.grad_clip
        # Each check first asks for a finite number, so a None or a string fails it with a
        # message (not a TypeError from the comparison).
        checks = {
            "lr must be finite and >= 0": _real(self.lr) and self.lr >= 0,
            "beta1 and beta2 must be in [0, 1)": all(_real(b) and 0 <= b < 1 for b in betas),
            "eps must be > 0": _real(self.eps) and self.eps > 0,
            "weight_decay must be >= 0": _real(self.weight_decay) and self.weight_decay >= 0,
            "grad_clip must be None or > 0": clip is None or (_real(clip) and clip > 0),
            f"no_decay must be one of {NO_DECAY}": self.no_decay in NO_DECAY,
        }
        for message, ok in checks.items():
            if not ok:
                raise InvalidOptimizerParams(f"{message}: got {self}")


# --- sampling -------------------------------------------------------------------------------


class TurnPrompt(tuple):
    """A token prompt that is a multi-turn conversation so far: its token ids (it is a tuple
    of them, and any replica may treat it as a plain prompt) and ``turns``, the offsets where
    each turn's context ends (increasing, the last one the prompt's length): the first
    prompt's end, then after each model turn and its tool output. A replica with a prefix
    cache prefills it turn by turn and keeps it, so the next turn's prompt, which starts with
    this one, prefills only its new turns (:mod:`plexrl_dask.worker.prefix_cache`).
    Checked wherever it is built, unpickling on a worker included."""

    turns: tuple[int, ...]

    def __new__(cls, tokens: Iterable[int], turns: Iterable[int]) -> TurnPrompt:
        ids, ends = tuple(tokens), tuple(turns)
        if not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in (*ids, *ends)
        ):
            raise InvalidSamplingParams(f"a TurnPrompt's tokens and turns are ints: {ends!r:.80}")
        self = super().__new__(cls, (int(t) for t in ids))
        ends = tuple(int(t) for t in ends)
        increasing = bool(ends) and all(b > a for a, b in zip((0, *ends[:-1]), ends, strict=True))
        if not increasing or ends[-1] != len(self):
            raise InvalidSamplingParams(
                f"a TurnPrompt's turns increase from above 0 to its length {len(self)}: "
                f"{ends!r:.80}"
            )
        self.turns = ends
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (TurnPrompt, (tuple(self), self.turns))

    def then(self, tokens: Iterable[int]) -> TurnPrompt:
        """This conversation followed by one more turn of ``tokens``."""
        more = tuple(tokens)
        return TurnPrompt((*self, *more), (*self.turns, len(self) + len(more)))


@dataclass(frozen=True)
class Chat:
    """A prompt given as chat messages. Replicas render it with the model's own chat template
    (Hugging Face's ``apply_chat_template`` with the generation prompt, tokenized as it
    tokenizes it), so a chat-tuned checkpoint sees the format it was tuned on; a model without
    a template refuses it (:class:`~plexrl_dask.errors.NoChatTemplate`). ``messages``:
    ``(role, content)`` pairs, in order (:meth:`of` takes Hugging Face's dicts)."""

    messages: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        try:
            pairs = tuple((m[0], m[1]) for m in self.messages if len(m) == 2)
        except (TypeError, KeyError, IndexError):
            pairs = ()
        if (
            not pairs
            or len(pairs) != len(self.messages)
            or not all(isinstance(r, str) and r and isinstance(c, str) for r, c in pairs)
        ):
            raise InvalidSamplingParams(
                "Chat.messages is a non-empty sequence of (role, content) strings, got "
                f"{self.messages!r:.80}"
            )
        object.__setattr__(self, "messages", pairs)

    @classmethod
    def of(cls, messages: Sequence[Mapping[str, str]]) -> Chat:
        """From Hugging Face's form: ``[{"role": ..., "content": ...}, ...]``."""
        try:
            return cls(tuple((m["role"], m["content"]) for m in messages))
        except (TypeError, KeyError) as e:
            raise InvalidSamplingParams(
                f"chat messages are dicts with 'role' and 'content', got {messages!r:.80}"
            ) from e

    def as_dicts(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


#: the most stop token ids one request may name
MAX_STOP_TOKENS = 1024


#: The smallest temperature above 0 (greedy) a sample may use: below it the logits divided
#: by it overflow float32, and every log-probability is NaN.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions.

    ``n`` samples per prompt; ``temperature`` 0 is greedy; among the ``top_k`` most probable
    tokens (0: all), then nucleus sampling with ``top_p`` of what that leaves (its mass
    renormalised, as Hugging Face and vLLM apply the two);
    generation stops after ``max_tokens``, at the end-of-sequence token or one of
    ``stop_token_ids`` (a chat template's end-of-turn token, say), or once the completion text
    contains one of the ``stop`` strings (the tokens up to and including the one that
    completed it are kept). Randomness is a pure function of ``(seed, prompt id, sample index,
    position)``, never of the worker or batch, so a request samples the same tokens anywhere.
    ``ignore_eos`` decodes past the end-of-sequence token (as vLLM's flag of that name; the
    ``stop_token_ids`` still stop): without those, every completion runs to a stop string or
    ``max_tokens``, which is how decode throughput at a fixed batch size is measured.
    ``special_tokens``: whether text prompts get the tokenizer's special tokens (a BOS, say)
    as Hugging Face adds them; None: ``plexrl.sampling.special-tokens`` where the request is
    made (``Deployment.sample`` fills it in from the driver's configuration, so that a
    worker tokenizes as the driver's own ``Deployment.tokenize`` does).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    special_tokens: bool | None = None
    top_k: int = 0

    def __post_init__(self) -> None:
        # A lone string is one stop string, not a set of characters.
        if not isinstance(self.stop, (str, list, tuple)):
            raise InvalidSamplingParams(
                f"stop is a string or a list of them, got {self.stop!r:.80}"
            )
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidSamplingParams(
                f"stop_token_ids is a list of ints, got {self.stop_token_ids!r:.80}"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = []
        if len(self.stop_token_ids) > MAX_STOP_TOKENS or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            problems.append(
                f"stop_token_ids are at most {MAX_STOP_TOKENS} ints >= 0 "
                f"(got {self.stop_token_ids!r:.80})"
            )
        if isinstance(self.n, bool) or not (isinstance(self.n, int) and self.n >= 1):
            problems.append(f"n must be an int >= 1 (got {self.n!r})")
        if not (_real(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be finite and >= 0 (got {self.temperature!r})")
        elif 0 < self.temperature < MIN_TEMPERATURE:  # (logits ÷ it overflow: NaN log-probs)
            problems.append(
                f"temperature is 0 (greedy) or at least {MIN_TEMPERATURE} (got {self.temperature!r})"
            )
        if not (_real(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        k = self.top_k
        if isinstance(k, bool) or not (isinstance(k, int) and 0 <= k < 2**31):
            problems.append(f"top_k must be an int in [0, 2**31), 0 for no limit (got {k!r})")
        if isinstance(self.max_tokens, bool) or not (
            isinstance(self.max_tokens, int) and self.max_tokens >= 1
        ):
            problems.append(f"max_tokens must be an int >= 1 (got {self.max_tokens!r})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if isinstance(self.seed, bool) or not (
            isinstance(self.seed, int) and 0 <= self.seed < 2**63
        ):
            problems.append(f"seed must be an int in [0, 2**63) (got {self.seed!r})")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be true or false (got {self.ignore_eos!r})")
        if not (self.special_tokens is None or isinstance(self.special_tokens, bool)):
            problems.append(
                f"special_tokens must be true, false or None (got {self.special_tokens!r})"
            )
        if problems:
            raise InvalidSamplingParams("; ".join(problems))

    @property
    def truncated(self) -> bool:
        """Whether sampling is limited to a part of the vocabulary (``top_p`` or ``top_k``)."""
        return self.top_p < 1.0 or self.top_k > 0

    def stop_ids(self, eos_token_ids: int | Iterable[int] | None) -> frozenset[int]:
        """The token ids that end a completion on a model whose end-of-sequence tokens are
        ``eos_token_ids`` (one id, several, or None)."""
        if self.ignore_eos or eos_token_ids is None:
            eos: tuple[int, ...] = ()
        elif isinstance(eos_token_ids, int):
            eos = (eos_token_ids,)
        else:
            eos = tuple(eos_token_ids)
        return frozenset((*self.stop_token_ids, *eos))


@dataclass(frozen=True)
class Streams:
    """How a request's rows are decoded: ``rows`` per stream, waiting rows admitted once
    ``refill_min_rows`` slots are free; ``invariant``: each row decoded as if alone
    (:mod:`plexrl_dask.worker.row_decode`, where the backend has it). Chosen by the client and
    sent with the request, so the split over replicas and the decoding agree whatever the
    workers' configuration."""

    rows: int
    refill_min_rows: int
    invariant: bool = False

    def __post_init__(self) -> None:
        for name, value in (("stream-rows", self.rows), ("refill-min-rows", self.refill_min_rows)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"plexrl.sampling.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.invariant, bool):
            raise ConfigError(
                f"plexrl.sampling.batch-invariant must be true or false, got {self.invariant!r}"
            )
        object.__setattr__(self, "rows", int(self.rows))
        object.__setattr__(self, "refill_min_rows", int(self.refill_min_rows))

    @classmethod
    def from_config(cls, invariant: bool | None = None) -> Streams:
        """``plexrl.sampling.stream-rows``, ``refill-min-rows`` and ``batch-invariant``
        (``invariant`` overrides it); :class:`~plexrl_dask.errors.ConfigError` unless the
        first two are positive integers and the third a boolean."""
        return cls(
            config.get("sampling.stream-rows"),  # type: ignore[arg-type]
            config.get("sampling.refill-min-rows"),  # type: ignore[arg-type]
            config.get("sampling.batch-invariant") if invariant is None else invariant,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class SampledSequence:
    """One completion: its tokens, their log-probabilities under the sampling distribution
    (``log_softmax(logits / temperature)``, before top-p truncation; raw logits when greedy),
    its decoded text and why it ended (``"stop"`` or ``"length"``)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class SampleResult:
    """Completions per prompt, in prompt order: ``sequences[i][j]`` is sample ``j`` of prompt
    ``i``; ``prompt_tokens[i]`` is prompt ``i`` as tokenized."""

    prompt_tokens: tuple[tuple[int, ...], ...]
    sequences: tuple[tuple[SampledSequence, ...], ...]

    def num_tokens(self) -> int:
        return sum(len(s.tokens) for group in self.sequences for s in group)


@dataclass(frozen=True)
class ForwardResult:
    """Per-token log-probabilities of each datum (aligned with its tokens, entry 0 is 0.0);
    ``top`` (asked for with ``top=k``): per datum ``(ids, logprobs)``, numpy arrays (int32,
    float32) of shape ``(len(tokens), k)`` whose row ``i`` holds the ``k`` most probable
    tokens at position ``i``, most probable first (row 0, where nothing is predicted: ids -1,
    log-probabilities -inf). Arrays, not lists: a long prompt's top 100 are millions of
    pairs. Results compare by their log-probabilities only."""

    logprobs: tuple[tuple[float, ...], ...]
    top: tuple[tuple[Any, Any], ...] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ForwardBackwardResult:
    """What ``forward_backward(..., logprobs=True)`` returns: the loss metrics, and the
    per-token log-probabilities of each datum under the weights the gradient was taken at
    (aligned with its tokens, entry 0 is 0.0, as in :class:`ForwardResult`)."""

    metrics: dict
    logprobs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class NamedWeights:
    """Parameters by canonical name, with the version of the replica they came from."""

    version: int
    tensors: dict

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
