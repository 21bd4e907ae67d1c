"""A request's arguments, checked where they are used: by the driver before it submits them
and again by the worker that runs them, with the same functions.

The worker cannot trust the driver's checks. A request's arguments reach it pickled, and
unpickling a dataclass restores its fields without running its constructor, so a
``SamplingParams`` with ``top_p=2`` or an ``AdamWParams`` with a negative learning rate
arrives intact from any client that built one around ``__post_init__`` (or from a client
with other code). Each check here rebuilds such values through their constructors, so every
rule the types state runs in the worker's process too, and refuses with the request's typed
error (never a bare ``TypeError`` from deep in the backend).

``plexrl.quotas.max-request-rows`` bounds the rows of one request: a replica runs one
request at a time, so an unbounded one (``n=10**6``) would hold it, and every other job's
requests behind it, for as long as it takes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from plexrl_dask import config
from plexrl_dask.errors import (
    ConfigError,
    EmptyBatch,
    InvalidBatch,
    InvalidLoss,
    InvalidOptimizerParams,
    InvalidSamplingParams,
    PlexRLError,
    RequestTooLarge,
    WeightsMismatch,
)
from plexrl_dask.shared.types import (
    AdamWParams,
    Chat,
    CrossEntropy,
    Datum,
    GraphLoss,
    Loss,
    PolicyGradient,
    SamplingParams,
    Streams,
)

T = TypeVar("T")


def rebuilt(
    value: Any, kinds: type[T] | tuple[type, ...], error: type[PlexRLError], what: str
) -> T:
    """``value`` built again through its dataclass constructor, so that its own checks run
    in this process; ``error`` when it is not one of ``kinds`` or its fields are not of the
    types they convert from (the constructor's typed error when they are out of range)."""
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise error(f"{what} must be {names}, got {type(value).__name__}")
    try:
        return dataclasses.replace(value)  # type: ignore[type-var]
    except PlexRLError as e:  # (the constructor's own: its class, and which value it was)
        raise type(e)(f"{what}: {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise error(f"{what}: {e}") from None


def max_request_rows() -> int:
    """``plexrl.quotas.max-request-rows`` (:class:`ConfigError` unless an integer >= 1)."""
    return config.count("plexrl.quotas.max-request-rows", config.get("quotas.max-request-rows"))


def check_rows(rows: int, what: str) -> None:
    """:class:`RequestTooLarge` when a request of ``rows`` rows exceeds the quota."""
    limit = max_request_rows()
    if rows > limit:
        raise RequestTooLarge(
            f"{what} has {rows} rows, more than plexrl.quotas.max-request-rows = {limit}: "
            "split it into several requests"
        )


def checked_batch(batch: Any) -> tuple[Datum, ...]:
    """A non-empty batch of :class:`Datum` (one alone is a batch of one), each rebuilt, within
    the rows quota."""
    if isinstance(batch, Datum):
        batch = (batch,)
    if isinstance(batch, (str, bytes, Mapping)) or not isinstance(batch, Sequence):
        raise EmptyBatch(f"a batch is a list of plexrl_dask.Datum, got {type(batch).__name__}")
    if not batch:
        raise EmptyBatch("the batch is empty: pass at least one Datum")
    check_rows(len(batch), "the batch")
    return tuple(rebuilt(d, Datum, EmptyBatch, f"batch item {i}") for i, d in enumerate(batch))


def checked_loss(loss: Any) -> Loss:
    return rebuilt(loss, (CrossEntropy, PolicyGradient, GraphLoss), InvalidLoss, "loss")


def checked_adamw(params: Any) -> AdamWParams:
    return rebuilt(params, AdamWParams, InvalidOptimizerParams, "optimizer params")


#: The most top log-probabilities a ``forward`` may ask for at each position.
MAX_TOP_LOGPROBS = 100


def checked_top(top: Any) -> int:
    """How many top log-probabilities a position asks for: an int in [0, MAX_TOP_LOGPROBS]."""
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidBatch(f"top is an int in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
    return top


def checked_temperature(temperature: Any) -> float:
    """A scoring temperature: finite and > 0."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not (math.isfinite(float(temperature)) and temperature > 0)
    ):
        raise InvalidSamplingParams(
            f"forward temperature must be finite and > 0, got {temperature!r}"
        )
    return float(temperature)


def checked_sample(
    prompts: Any, params: Any, prompt_ids: Any = None, streams: Any = None, part: bool = False
) -> tuple[list[Any], SamplingParams, list[int], Streams | None]:
    """A sample request's arguments: a non-empty list of prompts, each a string, a
    :class:`Chat` or a sequence of integer token ids; rebuilt ``params`` (and ``streams``); one integer id per prompt
    (default: positions); ``len(prompts) * n`` within the rows quota. Returns them as the
    worker uses them (``prompt_ids`` as a list of ints). ``part``: one worker's part of a
    request, which may be empty (a rank of a training group with no share of the streams)."""
    params = rebuilt(params, SamplingParams, InvalidSamplingParams, "params")
    if (
        isinstance(prompts, (str, bytes, Mapping))
        or not isinstance(prompts, Sequence)
        or not (prompts or part)
    ):
        raise InvalidSamplingParams("prompts must be a non-empty list of strings or token lists")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, Chat)) and not (
            hasattr(prompt, "__len__")  # a list, tuple or array of token ids
            and hasattr(prompt, "__iter__")
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)
        ):
            raise InvalidSamplingParams(
                f"prompt {i} must be a string, a Chat or a list of token ids, got {prompt!r:.80}"
            )
    if prompt_ids is None:
        ids = list(range(len(prompts)))
    else:
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise InvalidSamplingParams(
                f"prompt_ids must be a list of ints, got {prompt_ids!r:.80}"
            )
        if len(prompt_ids) != len(prompts):
            raise InvalidSamplingParams(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")
        if not all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and -(2**63) <= i < 2**63
            for i in prompt_ids
        ):
            raise InvalidSamplingParams(
                f"prompt_ids must be ints of 64 bits (they seed the sampling), got "
                f"{prompt_ids!r:.80}"
            )
        ids = [int(i) for i in prompt_ids]
    check_rows(
        len(prompts) * params.n, f"a sample request of {len(prompts)} prompts x n={params.n}"
    )
    if streams is not None:
        streams = rebuilt(streams, Streams, ConfigError, "streams")
    return list(prompts), params, ids, streams


def checked_weights(weights: Any) -> Mapping[str, Any]:
    """Weights by name whose floating-point tensors hold only finite values (names, shapes
    and dtypes are checked against the model by the backend)."""
    import torch  # (the scheduler never imports this module's callers that need it)

    if not isinstance(weights, Mapping):
        raise WeightsMismatch(
            f"weights are a mapping of name to tensor, got {type(weights).__name__}"
        )
    for name, t in weights.items():
        if isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_meta):
            raise WeightsMismatch(f"{name}: a dense tensor holding data is needed")
        if (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and not bool(torch.isfinite(t).all())
        ):
            raise WeightsMismatch(f"{name}: NaN or infinite values; nothing was written")
    return weights


def rank_shares(
    batch: Sequence[Datum], ranks: int, pad: bool = False
) -> list[tuple[Datum, ...]]:
    """``batch`` split into ``ranks`` contiguous shares, rank ``r``'s at ``r`` (sizes differ
    by at most one). With fewer sequences than ranks: :class:`InvalidBatch`, or with ``pad``
    (a training step whose loss has an explicit normaliser: :func:`whole_batch_loss`) the
    ranks past the batch each get a filler, two tokens of its last datum with weight 0,
    which adds nothing to the loss or its gradient (every rank must take part in the step's
    collectives); its one position counts in ``num_tokens``."""
    if len(batch) < ranks and pad and batch:
        batch = (*batch, *[_filler(batch[-1])] * (ranks - len(batch)))
    if len(batch) < ranks:
        raise InvalidBatch(
            f"a batch of {len(batch)} sequences cannot be split over {ranks} ranks: give at "
            f"least {ranks}"
        )
    bounds = [round(i * len(batch) / ranks) for i in range(ranks + 1)]
    return [tuple(batch[bounds[i] : bounds[i + 1]]) for i in range(ranks)]


def _filler(datum: Datum) -> Datum:
    """A two-token, zero-weight datum shaped like ``datum`` (see :func:`rank_shares`)."""
    cut = {
        name: getattr(datum, name)[:2]
        for name in ("advantages", "old_logprobs", "ref_logprobs")
        if getattr(datum, name) is not None
    }
    inputs = None
    if datum.inputs is not None:
        inputs = tuple((k, v[:2] if isinstance(v, tuple) else v) for k, v in datum.inputs)
    return dataclasses.replace(
        datum, tokens=datum.tokens[:2], weights=(0.0, 0.0), inputs=inputs, **cut
    )


def whole_batch_loss(loss: Any, batch: Sequence[Datum], ranks: int) -> Any:
    """``loss`` as every rank of a sharded policy computes it: normalised by the whole
    batch's token weight (unless it names a normaliser), so the summed gradient is one
    process's gradient of the whole batch."""
    if ranks > 1 and loss.normalizer is None:
        return dataclasses.replace(loss, normalizer=sum(sum(d.token_weights()) for d in batch))
    return loss
