"""Continuous batching of sampling streams, on a real tiny Qwen2 in-process.

The checks that matter: a refilled batch never exceeds ``max_batch_size``; refilling really
happens (fewer model calls than decoding batch by batch); the samples of one prompt share its
prefill; every completion's log-probabilities are what teacher-forced scoring of the same text
gives (so spliced caches, positions and padding are right); a request split at stream
boundaries samples bit-identically; and a model whose cache cannot be spliced (sliding-window
layers) decodes correctly through the fallback.
"""

from __future__ import annotations

import dataclasses

import dask
import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.models import ModelSpec
from plexrl_dask.service.backends import TorchBackend
from plexrl_dask.service.decode import stream_settings
from plexrl_dask.service.types import Datum, SamplingParams
from tests.conftest import tiny_spec

PROMPTS = ["12+3=", "4+5=", "99+1=", "7*8=", "1+1=", "60-7="]
# Any of these characters ends a completion: with a random model, lengths vary a lot.
PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=14, stop=("1", "5", "9"), seed=7)


def backend_of(spec: ModelSpec, batch: int) -> TorchBackend:
    torch.set_num_threads(1)
    return TorchBackend(spec, "cpu", max_batch_size=batch)


class ModelCalls:
    """Records the ``input_ids`` shape of every call of the backend's model (a forward
    pre-hook on the real module)."""

    def __init__(self, backend: TorchBackend):
        self.shapes: list[tuple[int, int]] = []
        self.handle = backend.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))

    def close(self) -> None:
        self.handle.remove()

    @property
    def prefills(self) -> list[tuple[int, int]]:
        return [s for s in self.shapes if s[1] > 1]

    @property
    def steps(self) -> list[tuple[int, int]]:
        return [s for s in self.shapes if s[1] == 1]


def assert_scores_match_forward(backend: TorchBackend, prompts, result) -> None:
    for prompt, group in zip(prompts, result, strict=True):
        for seq in group:
            full = backend.forward([Datum(tokens=prompt + list(seq.tokens))], temperature=1.0)
            scored = full.logprobs[0][len(prompt) :]
            torch.testing.assert_close(
                torch.tensor(seq.logprobs), torch.tensor(scored), atol=1e-4, rtol=0
            )


def test_a_stream_refills_its_batch_and_scores_like_forward():
    backend = backend_of(tiny_spec(seed=5), batch=4)
    prompts = backend.tokenize(PROMPTS)
    ids = list(range(len(prompts)))
    rows = len(prompts) * PARAMS.n
    with dask.config.set({"plexrl.sampling.refill-min-rows": 1}):
        calls = ModelCalls(backend)
        streamed = backend.sample(prompts, PARAMS, ids, stream_rows=rows)
        calls.close()
        batched_calls = ModelCalls(backend)
        batched = backend.sample(prompts, PARAMS, ids, stream_rows=4)  # one batch per stream
        batched_calls.close()

    lengths = sorted(len(s.tokens) for g in streamed for s in g)
    assert lengths[0] < lengths[-1]  # the lengths vary, so there is something to refill
    assert max(b for b, _ in calls.shapes) <= 4  # never more than max_batch_size rows
    # The 4 samples of a prompt share one prefill row: 24 rows, 6 prefills of 1 row each.
    assert calls.prefills and all(b == 1 for b, _ in calls.prefills)
    assert sum(b for b, _ in calls.prefills) == len(prompts)
    # Refilling keeps the batch fuller: fewer decode steps than batch after batch.
    assert len(calls.steps) < len(batched_calls.steps)
    assert sum(b for b, _ in calls.steps) / len(calls.steps) > sum(
        b for b, _ in batched_calls.steps
    ) / len(batched_calls.steps)
    # Finish reasons and lengths follow the rules whatever the batching.
    for group in streamed:
        for seq in group:
            if seq.finish_reason == "length":
                assert len(seq.tokens) == PARAMS.max_tokens
            else:  # a stop string completed by the last token, or the end-of-sequence token
                text = backend.tokenizer.decode(list(seq.tokens), skip_special_tokens=True)
                ended = seq.tokens[-1] == backend.eos_token_id
                assert ended or any(text.endswith(s) for s in PARAMS.stop)
    assert_scores_match_forward(backend, prompts, streamed)
    assert_scores_match_forward(backend, prompts, batched)
    # The same request again is bit-identical.
    with dask.config.set({"plexrl.sampling.refill-min-rows": 1}):
        assert backend.sample(prompts, PARAMS, ids, stream_rows=rows) == streamed


def test_a_request_split_at_stream_boundaries_samples_bit_identically():
    backend = backend_of(tiny_spec(seed=6), batch=4)
    prompts = backend.tokenize(PROMPTS)
    # Streams of 8 rows = 2 prompts x 4 samples: cut after prompt 2 or 4, nothing changes.
    whole = backend.sample(prompts, PARAMS, list(range(6)), stream_rows=8)
    parts = backend.sample(prompts[:2], PARAMS, [0, 1], stream_rows=8) + backend.sample(
        prompts[2:], PARAMS, [2, 3, 4, 5], stream_rows=8
    )
    assert whole == parts


def test_refill_threshold_batches_admissions():
    backend = backend_of(tiny_spec(seed=5), batch=4)
    prompts = backend.tokenize(PROMPTS)
    by_threshold = {}
    for threshold in (1, 4):
        with dask.config.set({"plexrl.sampling.refill-min-rows": threshold}):
            calls = ModelCalls(backend)
            out = backend.sample(prompts, PARAMS, list(range(6)), stream_rows=24)
            calls.close()
        by_threshold[threshold] = (out, calls)
        assert max(b for b, _ in calls.shapes) <= 4
    # Waiting for 4 free slots (the whole batch) admits only into an empty batch, so the
    # stream decodes batch after batch: at least as many steps as refilling at once.
    assert len(by_threshold[4][1].steps) >= len(by_threshold[1][1].steps)
    assert_scores_match_forward(backend, prompts, by_threshold[4][0])


def test_sliding_window_models_decode_through_the_fallback():
    spec = tiny_spec(seed=8)
    config = dict(spec.config)
    config.update(use_sliding_window=True, sliding_window=6, max_window_layers=0)
    backend = backend_of(dataclasses.replace(spec, config=tuple(sorted(config.items()))), 4)
    prompts = backend.tokenize(PROMPTS[:3])
    calls = ModelCalls(backend)
    out = backend.sample(prompts, PARAMS, [0, 1, 2], stream_rows=12)
    calls.close()
    assert max(b for b, _ in calls.shapes) <= 4
    assert_scores_match_forward(backend, prompts, out)


@pytest.mark.parametrize("key", ["stream-rows", "refill-min-rows"])
@pytest.mark.parametrize("value", [0, -3, "many", True, 2.5])
def test_bad_stream_settings_are_config_errors(key, value):
    with (
        dask.config.set({f"plexrl.sampling.{key}": value}),
        pytest.raises(errors.ConfigError, match=key),
    ):
        stream_settings()
    with pytest.raises(errors.ConfigError, match="stream-rows"):
        stream_settings(0)
