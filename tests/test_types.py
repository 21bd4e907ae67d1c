"""Validation of the request types and the typed errors (no model, no cluster)."""

from __future__ import annotations

import math
import pickle

import pytest

from plexrl_dask import errors
from plexrl_dask.shared.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    PolicyGradient,
    SamplingParams,
    as_batch,
)

# --- Datum --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [(), (5,)])
def test_datum_needs_two_tokens(tokens):
    with pytest.raises(errors.EmptyBatch, match="at least 2 tokens"):
        Datum(tokens=tokens)


@pytest.mark.parametrize("field", ["weights", "advantages", "old_logprobs", "ref_logprobs"])
@pytest.mark.parametrize("length", [2, 4])
def test_datum_per_token_fields_must_match_tokens(field, length):
    with pytest.raises(errors.MismatchedLengths, match=field):
        Datum(tokens=(1, 2, 3), **{field: (0.0,) * length})
    # The right length is accepted and stored as floats.
    d = Datum(tokens=(1, 2, 3), **{field: (0, 1, 1)})
    assert getattr(d, field) == (0.0, 1.0, 1.0)
    assert all(isinstance(v, float) for v in getattr(d, field))


def test_datum_mismatched_lengths_is_an_invalid_batch_and_value_error():
    with pytest.raises(errors.InvalidBatch):
        Datum(tokens=(1, 2, 3), weights=(0.0, 1.0))
    with pytest.raises(ValueError):
        Datum(tokens=(1, 2, 3), weights=(0.0, 1.0))


@pytest.mark.parametrize("first", [1.0, -0.5, math.nan])
def test_datum_first_weight_must_be_zero(first):
    with pytest.raises(errors.MismatchedLengths, match=r"weights\[0\]"):
        Datum(tokens=(1, 2, 3), weights=(first, 1.0, 1.0))


def test_datum_normalises_to_tuples_and_default_weights():
    d = Datum(tokens=[4, 5, 6, 7])
    assert d.tokens == (4, 5, 6, 7) and isinstance(d.tokens, tuple)
    assert d.weights is None
    assert d.token_weights() == (0.0, 1.0, 1.0, 1.0)
    explicit = Datum(tokens=[4, 5, 6, 7], weights=[0, 0, 1, 0.5])
    assert explicit.token_weights() == (0.0, 0.0, 1.0, 0.5)


def test_datum_is_hashable_and_pickles():
    d = Datum(tokens=(1, 2, 3), weights=(0.0, 1.0, 1.0), advantages=(0.0, 0.5, 0.5))
    assert pickle.loads(pickle.dumps(d)) == d
    assert hash(d) == hash(Datum(tokens=[1, 2, 3], weights=[0, 1, 1], advantages=[0, 0.5, 0.5]))


def test_from_prompt_completion_alignment():
    prompt, completion = [10, 11, 12], [20, 21]
    d = Datum.from_prompt_completion(
        prompt, completion, advantage=2.5, old_logprobs=[-0.1, -0.2], ref_logprobs=[-0.3, -0.4]
    )
    assert d.tokens == (10, 11, 12, 20, 21)
    assert d.weights == (0.0, 0.0, 0.0, 1.0, 1.0)
    assert d.advantages == (0.0, 0.0, 0.0, 2.5, 2.5)
    # Per-completion-token logprobs are padded on the prompt side, so that entry i of each
    # per-token field refers to tokens[i]: the completion's k-th token is at len(prompt) + k.
    assert d.old_logprobs == (0.0, 0.0, 0.0, -0.1, -0.2)
    assert d.ref_logprobs == (0.0, 0.0, 0.0, -0.3, -0.4)
    for k, tok in enumerate(completion):
        i = len(prompt) + k
        assert d.tokens[i] == tok
        assert d.old_logprobs[i] == pytest.approx([-0.1, -0.2][k])
        assert d.weights[i] == 1.0


def test_from_prompt_completion_defaults():
    d = Datum.from_prompt_completion([7], [8])
    assert d.tokens == (7, 8)
    assert d.weights == (0.0, 1.0)
    assert d.advantages is None and d.old_logprobs is None and d.ref_logprobs is None


@pytest.mark.parametrize("prompt,completion", [([], [1, 2]), ([1, 2], [])])
def test_from_prompt_completion_rejects_empty_parts(prompt, completion):
    with pytest.raises(errors.EmptyBatch):
        Datum.from_prompt_completion(prompt, completion)


@pytest.mark.parametrize("field", ["old_logprobs", "ref_logprobs"])
def test_from_prompt_completion_logprobs_per_completion_token(field):
    # Full-length (per *sequence* token) logprobs are a common mistake: rejected, not truncated.
    with pytest.raises(errors.MismatchedLengths, match=field):
        Datum.from_prompt_completion([1, 2], [3, 4], **{field: [-0.1, -0.2, -0.3, -0.4]})
    with pytest.raises(errors.MismatchedLengths, match=field):
        Datum.from_prompt_completion([1, 2], [3, 4], **{field: [-0.1]})


# --- as_batch -----------------------------------------------------------------------------------


def test_as_batch_normalises():
    d = Datum(tokens=(1, 2))
    assert as_batch(d) == (d,)
    assert as_batch([d, d]) == (d, d)
    assert as_batch(iter([d])) == (d,)


@pytest.mark.parametrize("empty", [[], (), iter([])])
def test_as_batch_rejects_empty(empty):
    with pytest.raises(errors.EmptyBatch, match="empty"):
        as_batch(empty)


@pytest.mark.parametrize("item", [(1, 2, 3), {"tokens": (1, 2)}, "12", None])
def test_as_batch_rejects_wrong_item_type(item):
    with pytest.raises(errors.EmptyBatch, match="Datum"):
        as_batch([Datum(tokens=(1, 2)), item])


# --- SamplingParams -----------------------------------------------------------------------------


def test_sampling_params_defaults_are_valid():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.stop, p.seed) == (1, 1.0, 1.0, 16, (), 0)
    q = SamplingParams(
        n=3, temperature=0.0, top_p=0.5, max_tokens=1, stop=["\n", "END"], seed=2**63 - 1
    )
    assert q.stop == ("\n", "END")


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"n": 0}, "n must be"),
        ({"n": -2}, "n must be"),
        ({"n": 1.5}, "n must be"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("\n", "")}, "stop"),
        ({"stop": (3,)}, "stop"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"temperature": None}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_sampling_params_out_of_range(kwargs, fragment):
    with pytest.raises(errors.InvalidSamplingParams, match=fragment):
        SamplingParams(**kwargs)


def test_sampling_params_reports_every_problem():
    with pytest.raises(errors.InvalidSamplingParams) as info:
        SamplingParams(n=0, top_p=2.0, max_tokens=0)
    message = str(info.value)
    assert "n must be" in message and "top_p" in message and "max_tokens" in message


def test_sampling_params_stop_string_is_not_split_into_characters():
    """``stop="END"`` (a bare string instead of a tuple) must not silently become the three
    one-character stop strings "E", "N", "D" (which would end generation at any of them).
    Either keeping it whole or rejecting it is fine. Regression (shared/types.py,
    SamplingParams.__post_init__: ``tuple(self.stop)`` splits a str)."""
    try:
        p = SamplingParams(stop="END")
    except errors.InvalidSamplingParams:
        return
    assert p.stop == ("END",)


# --- AdamWParams --------------------------------------------------------------------------------


def test_adamw_defaults_are_valid():
    p = AdamWParams()
    assert p.lr > 0 and p.grad_clip == 1.0
    AdamWParams(lr=0.0, beta1=0.0, beta2=0.0, weight_decay=0.1, grad_clip=None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": -1e-3},
        {"lr": math.inf},
        {"lr": math.nan},
        {"beta1": 1.0},
        {"beta1": -0.1},
        {"beta2": 1.0},
        {"beta2": math.nan},
        {"eps": 0.0},
        {"eps": -1e-8},
        {"weight_decay": -0.01},
        {"weight_decay": math.nan},
        {"grad_clip": 0.0},
        {"grad_clip": -1.0},
        {"lr": None},
        {"lr": "1e-3"},
        {"beta1": None},
        {"eps": None},
        {"weight_decay": None},
        {"grad_clip": "1.0"},
    ],
)
def test_adamw_out_of_range(kwargs):
    with pytest.raises(errors.InvalidOptimizerParams):
        AdamWParams(**kwargs)


# --- losses -------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalizer", [0.0, -1.0, math.nan])
def test_cross_entropy_bad_normalizer(normalizer):
    with pytest.raises(errors.InvalidLoss, match="normalizer"):
        CrossEntropy(normalizer=normalizer)


def test_losses_accept_valid_params():
    assert CrossEntropy().normalizer is None
    assert CrossEntropy(normalizer=12.0).normalizer == 12.0
    pg = PolicyGradient(clip_low=0.0, clip_high=0.0, kl_coef=0.0, normalizer=3.0)
    assert (pg.clip_low, pg.clip_high, pg.normalizer) == (0.0, 0.0, 3.0)
    PolicyGradient(clip_low=0.99, clip_high=10.0, kl_coef=0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_low": -0.1},
        {"clip_low": 1.0},
        {"clip_low": math.nan},
        {"clip_high": -0.1},
        {"clip_high": math.nan},
        {"kl_coef": -0.1},
        {"kl_coef": math.inf},
        {"kl_coef": math.nan},
        {"normalizer": 0.0},
        {"normalizer": -2.0},
    ],
)
def test_policy_gradient_bad_params(kwargs):
    with pytest.raises(errors.InvalidLoss):
        PolicyGradient(**kwargs)


def test_request_errors_are_value_errors():
    # Callers that only know the builtin hierarchy still catch bad input as ValueError.
    for cls in (
        errors.InvalidSamplingParams,
        errors.InvalidLoss,
        errors.InvalidOptimizerParams,
        errors.EmptyBatch,
        errors.MismatchedLengths,
    ):
        assert issubclass(cls, ValueError) and issubclass(cls, errors.RequestError)


# --- errors -------------------------------------------------------------------------------------


def _all_error_classes() -> list[type[errors.PlexRLError]]:
    found: list[type[errors.PlexRLError]] = []
    todo = [errors.PlexRLError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_error_class_is_registered_by_name():
    registered = set(errors._BY_NAME.values())
    for cls in _all_error_classes():
        assert errors._BY_NAME.get(cls.__name__) is cls, cls
    assert registered == set(_all_error_classes())
    # NotRouted is defined after the first collection pass; it must still be decodable.
    assert errors._BY_NAME["NotRouted"] is errors.NotRouted


@pytest.mark.parametrize("name", sorted(errors._BY_NAME))
def test_status_round_trip(name):
    cls = errors._BY_NAME[name]
    message = f"something about {name!r} went wrong: fix it"
    status = errors.to_status(cls(message))
    assert status == {"status": "error", "error": name, "message": message}
    back = errors.from_status(status)
    assert type(back) is cls
    assert str(back) == message
    with pytest.raises(cls) as info:
        errors.raise_for_status(status)
    assert str(info.value) == message
    # The decoded error survives pickling (it crosses processes on task futures).
    again = pickle.loads(pickle.dumps(back))
    assert type(again) is cls and str(again) == message


def test_from_status_of_unknown_error_is_the_base_class():
    back = errors.from_status({"status": "error", "error": "NoSuchError", "message": "m"})
    assert type(back) is errors.PlexRLError and str(back) == "m"
    assert "unknown" in str(errors.from_status({"status": "error"}))


def test_raise_for_status_passes_ok_through():
    ok = {"status": "OK", "deployment": {"name": "x"}}
    assert errors.raise_for_status(ok) is ok


def test_deployment_not_found_str_has_no_extra_quotes():
    e = errors.DeploymentNotFound("no deployment named 'policy'")
    assert str(e) == "no deployment named 'policy'"
    assert isinstance(e, KeyError)  # still catchable as a KeyError
    # A plain KeyError would add quotes around the message.
    assert str(KeyError("no deployment named 'policy'")) != str(e)
    assert str(errors.DeploymentNotFound()) == ""
    decoded = errors.from_status(errors.to_status(e))
    assert str(decoded) == "no deployment named 'policy'"


def test_checks_rebuild_values_that_skipped_their_constructor():
    import copy

    import dask
    import torch

    from plexrl_dask.shared import checks

    def bypassed(value, **fields):
        out = copy.copy(value)
        for name, v in fields.items():
            object.__setattr__(out, name, v)
        return out

    with pytest.raises(errors.InvalidSamplingParams, match="top_p"):
        checks.checked_sample(["a"], bypassed(SamplingParams(), top_p=2.0))
    with pytest.raises(errors.InvalidOptimizerParams, match="lr"):
        checks.checked_adamw(bypassed(AdamWParams(), lr=float("nan")))
    with pytest.raises(errors.InvalidLoss):
        checks.checked_loss(bypassed(PolicyGradient(), kl_coef=-1.0))
    with pytest.raises(errors.InvalidBatch, match="batch item 1"):
        checks.checked_batch(
            [Datum(tokens=[1, 2]), bypassed(Datum(tokens=[1, 2]), tokens=("x", 2))]
        )
    with pytest.raises(errors.InvalidSamplingParams, match="temperature"):
        checks.checked_temperature(True)
    with pytest.raises(errors.WeightsMismatch, match="NaN"):
        checks.checked_weights({"w": torch.tensor([1.0, float("inf")])})
    assert checks.checked_weights({"w": torch.ones(2), "i": torch.zeros(2, dtype=torch.long)})

    prompts, params, ids, streams = checks.checked_sample(
        [[1, 2], "b"], SamplingParams(n=2), (5, 6)
    )
    assert prompts == [[1, 2], "b"] and params == SamplingParams(n=2) and ids == [5, 6]
    assert streams is None
    assert checks.checked_sample([], SamplingParams(), [], part=True)[0] == []
    with pytest.raises(errors.InvalidSamplingParams, match="non-empty"):
        checks.checked_sample([], SamplingParams())
    with pytest.raises(errors.InvalidSamplingParams, match="prompt_ids"):
        checks.checked_sample(["a"], SamplingParams(), ["x"])

    with dask.config.set({"plexrl.quotas.max-request-rows": 8}):
        checks.checked_sample(["a", "b"], SamplingParams(n=4))
        with pytest.raises(errors.RequestTooLarge, match="max-request-rows = 8"):
            checks.checked_sample(["a", "b", "c"], SamplingParams(n=3))
        with pytest.raises(errors.RequestTooLarge):
            checks.checked_batch([Datum(tokens=[1, 2])] * 9)
    with dask.config.set({"plexrl.quotas.max-request-rows": 0}), pytest.raises(errors.ConfigError):
        checks.check_rows(1, "a request")


def test_token_ids_are_integers_never_rounded_nor_read_digit_by_digit():
    import numpy as np

    assert Datum(tokens=np.array([3, 4], dtype=np.int64)).tokens == (3, 4)
    for bad in ((1.7, 2.9), "123", ("5", "6"), (True, 2), None):
        with pytest.raises(errors.InvalidBatch):
            Datum(tokens=bad)
    with pytest.raises(errors.InvalidBatch, match=r"tokenize text first \(Deployment.tokenize"):
        Datum.from_prompt_completion("12+3=", "15")


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 1e-40}, {"ignore_eos": "no"}, {"stop": None}, {"n": True},
     {"max_tokens": True}, {"seed": False}, {"stop_token_ids": 5}],  # fmt: skip
)
def test_sampling_params_that_would_break_on_a_worker_are_refused_here(kwargs):
    """A temperature so small that the logits divided by it overflow (every log-probability
    NaN), a string where a flag belongs (truthy: EOS silently ignored), a bool for a count."""
    with pytest.raises(errors.InvalidSamplingParams):
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.0).temperature == 0.0  # (greedy)


def test_a_lora_spec_of_values_that_break_later_is_refused():
    from plexrl_dask.models.spec import LoraSpec

    for bad in ({"alpha": math.inf}, {"alpha": True}, {"seed": "x"}, {"targets": "q_proj"}):
        with pytest.raises(errors.InvalidModelSpec):
            LoraSpec(4, **bad)
    assert LoraSpec(4, targets=["q_proj"]).targets == ("q_proj",)
