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
import numpy as np
import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.models import ModelSpec
from plexrl_dask.shared.types import Datum, SamplingParams, Streams
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.decode import StreamDecoder, output_cache
from tests.conftest import tiny_spec

PROMPTS = ["12+3=", "4+5=", "99+1=", "7*8=", "1+1=", "60-7="]
# Any of these characters ends a completion: with a random model, lengths vary a lot.
PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=14, stop=("1", "5", "9"), seed=7)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def backend_of(spec: ModelSpec, batch: int, decode_step: str = "auto") -> TorchBackend:
    with dask.config.set({"plexrl.sampling.decode-step": decode_step}):
        backend = TorchBackend(spec, "cpu", max_batch_size=batch)
    assert (backend.decode_step is None) == (decode_step == "hf")
    return backend


class ModelCalls:
    """Records the token shape of every call of the backend's model: a forward pre-hook on
    its real embedding module, which every call embeds its tokens through once, the HF
    forward and the decode step alike."""

    def __init__(self, backend: TorchBackend):
        self.shapes: list[tuple[int, int]] = []
        self.handle = backend.model.model.embed_tokens.register_forward_pre_hook(self._record)

    def _record(self, module, args) -> None:
        self.shapes.append(tuple(args[0].shape))

    def close(self) -> None:
        self.handle.remove()

    @property
    def prefills(self) -> list[tuple[int, int]]:
        return [s for s in self.shapes if s[1] > 1]

    @property
    def steps(self) -> list[tuple[int, int]]:
        return [s for s in self.shapes if s[1] == 1]


def assert_scores_match_forward(backend: TorchBackend, prompts, result, temperature=1.0) -> None:
    """Sampling log-probabilities (under ``temperature``; greedy ones under the raw logits,
    temperature 1) equal teacher-forced scoring of the same text."""
    for prompt, group in zip(prompts, result, strict=True):
        for seq in group:
            full = backend.forward(
                [Datum(tokens=prompt + list(seq.tokens))], temperature=temperature or 1.0
            )
            scored = full.logprobs[0][len(prompt) :]
            torch.testing.assert_close(
                torch.tensor(seq.logprobs), torch.tensor(scored), atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("decode_step", ["auto", "hf"])
def test_a_stream_refills_its_batch_and_scores_like_forward(decode_step):
    backend = backend_of(tiny_spec(seed=5), batch=4, decode_step=decode_step)
    prompts = backend.tokenize(PROMPTS)
    ids = list(range(len(prompts)))
    rows = len(prompts) * PARAMS.n
    calls = ModelCalls(backend)
    streamed = backend.sample(prompts, PARAMS, ids, Streams(rows, 1))
    calls.close()
    batched_calls = ModelCalls(backend)
    batched = backend.sample(prompts, PARAMS, ids, Streams(4, 1))  # one batch per stream
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
    assert backend.sample(prompts, PARAMS, ids, Streams(rows, 1)) == streamed


def test_a_request_split_at_stream_boundaries_samples_bit_identically():
    backend = backend_of(tiny_spec(seed=6), batch=4)
    prompts = backend.tokenize(PROMPTS)
    # Streams of 8 rows = 2 prompts x 4 samples: cut after prompt 2 or 4, nothing changes.
    whole = backend.sample(prompts, PARAMS, list(range(6)), Streams(8, 2))
    parts = backend.sample(prompts[:2], PARAMS, [0, 1], Streams(8, 2)) + backend.sample(
        prompts[2:], PARAMS, [2, 3, 4, 5], Streams(8, 2)
    )
    assert whole == parts


def test_refill_threshold_batches_admissions():
    backend = backend_of(tiny_spec(seed=5), batch=4)
    prompts = backend.tokenize(PROMPTS)
    steps = {}
    for threshold in (1, 4):
        calls = ModelCalls(backend)
        out = backend.sample(prompts, PARAMS, list(range(6)), Streams(24, threshold))
        calls.close()
        assert max(b for b, _ in calls.shapes) <= 4
        assert_scores_match_forward(backend, prompts, out)
        steps[threshold] = calls.steps
    # Waiting for 4 free slots (the whole batch) admits only into an empty batch: between
    # two prefills the batch only shrinks, never refilled.
    sizes = [b for b, _ in calls.shapes]
    prefill_at = [k for k, (_, width) in enumerate(calls.shapes) if width > 1]
    for a, b in zip(prefill_at, prefill_at[1:] + [len(sizes)], strict=True):
        run = sizes[a + 1 : b]
        assert run == sorted(run, reverse=True)
    assert len(steps[4]) > len(steps[1])


@pytest.mark.parametrize("decode_step", ["auto", "hf"])
def test_mixed_prompts_share_prefills_and_score_like_forward(decode_step):
    """Several prompts per prefill (n=3 does not divide the batch of 5), prompts of very
    different lengths, refilling at every free slot; then the edge cases of the length and
    stop rules."""
    backend = backend_of(tiny_spec(seed=9), batch=5, decode_step=decode_step)
    texts = ["1=", "123456789+987654321=", "45*6=", "7-", "31415+2718=", "0="]
    prompts = backend.tokenize(texts)
    params = SamplingParams(n=3, temperature=0.9, max_tokens=12, stop=("3", "8"), seed=2)
    calls = ModelCalls(backend)
    out = backend.sample(prompts, params, list(range(6)), Streams(18, 1))
    calls.close()
    assert max(b for b, _ in calls.shapes) <= 5
    # Prefills hold one row per distinct prompt: 5 rows span 2 or 3 prompts.
    assert any(b > 1 for b, _ in calls.prefills)
    assert sum(b for b, _ in calls.prefills) < len(prompts) * params.n
    assert_scores_match_forward(backend, prompts, out, params.temperature)
    for edge in (
        SamplingParams(n=3, temperature=1.0, max_tokens=1, seed=4),
        SamplingParams(n=1, temperature=0.0, max_tokens=7, stop=("2",), seed=4),
        SamplingParams(n=2, temperature=1.0, max_tokens=9, ignore_eos=True, seed=4),
    ):
        result = backend.sample(prompts, edge, list(range(6)), Streams(7, 1))
        assert_scores_match_forward(backend, prompts, result, edge.temperature)
        if edge.ignore_eos or edge.max_tokens == 1:
            assert all(len(s.tokens) == edge.max_tokens for g in result for s in g)


def test_sliding_window_models_decode_through_the_fallback():
    spec = tiny_spec(seed=8)
    config = dict(spec.config)
    config.update(use_sliding_window=True, sliding_window=6, max_window_layers=0)
    backend = TorchBackend(
        dataclasses.replace(spec, config=tuple(sorted(config.items()))), "cpu", max_batch_size=4
    )
    assert backend.decode_step is None  # sliding windows: the HF forward, always
    prompts = backend.tokenize(PROMPTS[:3])
    rows = [(i, j) for i in range(3) for j in range(PARAMS.n)]
    calls = ModelCalls(backend)
    with torch.inference_mode():
        decoder = StreamDecoder(backend, prompts, rows, PARAMS, [0, 1, 2], refill_min_rows=1)
        sequences = decoder.run()
    calls.close()
    assert not decoder.spliceable  # the fallback ran: batches one after another
    assert max(b for b, _ in calls.shapes) <= 4
    out = [sequences[i * PARAMS.n : (i + 1) * PARAMS.n] for i in range(3)]
    assert out == backend.sample(prompts, PARAMS, [0, 1, 2], Streams(12, 1))
    assert_scores_match_forward(backend, prompts, out)


@pytest.mark.parametrize("key", ["stream-rows", "refill-min-rows"])
@pytest.mark.parametrize("value", [0, -3, "many", True, 2.5])
def test_bad_stream_settings_are_config_errors(key, value):
    with (
        dask.config.set({f"plexrl.sampling.{key}": value}),
        pytest.raises(errors.ConfigError, match=key),
    ):
        Streams.from_config()
    with pytest.raises(errors.ConfigError, match="stream-rows"):
        Streams(0, 1)
    assert Streams(np.int64(8), 2) == Streams(8, 2)


@pytest.mark.parametrize("rows", [5, 40])
def test_the_decode_step_computes_what_the_hf_forward_computes(rows):
    """One step over left-padded rows with a grown cache, against the HF forward of the same
    model on the same cache: equal logits (to float rounding) and equal caches. Through SDPA
    (5 rows) and through the written-out attention (40 rows)."""
    from transformers.cache_utils import DynamicCache

    from plexrl_dask.worker.decode_step import MANUAL_ATTENTION_MIN_ROWS

    assert 5 < MANUAL_ATTENTION_MIN_ROWS <= 40
    backend = backend_of(tiny_spec(seed=3, num_layers=3), batch=8)
    model, g = backend.model, torch.Generator().manual_seed(0)
    ids = torch.randint(3, backend.vocab_size, (rows, 9), generator=g)
    mask = torch.ones(rows, 9, dtype=torch.long)
    mask[1, :4] = mask[3, :7] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        cache = output_cache(model(input_ids=ids, attention_mask=mask, position_ids=positions))
        keys = [layer.keys.clone() for layer in cache.layers]
        values = [layer.values.clone() for layer in cache.layers]
        token = torch.randint(3, backend.vocab_size, (rows,), generator=g)
        grown = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
        at = positions[:, -1:] + 1
        want = model(
            input_ids=token[:, None],
            attention_mask=grown,
            position_ids=at,
            **{backend.cache_kw: cache},
        )
        logits, new_keys, new_values = backend.decode_step.bind()(token, grown, at, keys, values)
    torch.testing.assert_close(logits, want.logits[:, -1].float(), atol=1e-5, rtol=0)
    grown_cache = output_cache(want)
    assert isinstance(grown_cache, DynamicCache)
    for layer, k, v in zip(grown_cache.layers, new_keys, new_values, strict=True):
        torch.testing.assert_close(k, layer.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(v, layer.values, atol=1e-6, rtol=0)


def test_the_decode_step_is_used_only_where_it_is_the_same_math():
    from plexrl_dask.worker.decode_step import DecodeStep

    spec = tiny_spec(seed=3)
    model = spec.build_model("cpu")
    assert DecodeStep.for_model(model) is not None
    with dask.config.set({"plexrl.sampling.decode-step": "hf"}):
        assert DecodeStep.for_model(model) is None
    with (
        dask.config.set({"plexrl.sampling.decode-step": "fast"}),
        pytest.raises(errors.ConfigError, match="decode-step"),
    ):
        DecodeStep.for_model(model)
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "linear"}
    assert DecodeStep.for_model(model) is None  # scaled rotary embeddings: not this math


@pytest.mark.parametrize("fuse", ["64MiB", 0])
def test_a_prefill_through_the_decode_step_computes_what_the_hf_forward_computes(fuse):
    """Left-padded prompts of several lengths through a bound step (fused projections or
    not): the HF forward's last-token logits, and its keys and values wherever a row has a
    token (padding is never attended to, so what is stored there does not matter)."""
    with dask.config.set({"plexrl.sampling.fused-weights-max-bytes": fuse}):
        backend = backend_of(tiny_spec(seed=4, num_layers=2), batch=8)
    step = backend.decode_step.bind()
    assert all((layer.qkv is not None) == (fuse != 0) for layer in step.layers)
    model, g = backend.model, torch.Generator().manual_seed(1)
    ids = torch.randint(3, backend.vocab_size, (4, 7), generator=g)
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[0, :3] = mask[2, :6] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions)
        logits, keys, values = step(ids, mask, positions, None, None)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, want.logits[:, -1].float(), atol=1e-5, rtol=0)
    held = mask.bool()[:, None, :, None]
    for layer, k, v in zip(output_cache(want).layers, keys, values, strict=True):
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        torch.testing.assert_close(k * held, layer.keys * held, atol=1e-5, rtol=0)
        torch.testing.assert_close(v * held, layer.values * held, atol=1e-5, rtol=0)


@pytest.mark.parametrize("value", [-1, "lots", True, 1.5])
def test_a_bad_fused_weights_budget_is_a_config_error(value):
    with (
        dask.config.set({"plexrl.sampling.fused-weights-max-bytes": value}),
        pytest.raises(errors.ConfigError, match="fused-weights-max-bytes"),
    ):
        backend_of(tiny_spec(seed=4), batch=4)


def test_the_weight_layout_is_kept_until_the_weights_change():
    """``bind`` lays the weights out once and reuses the layout while no parameter was
    written; after an optimizer step or ``set_weights`` it lays them out again, and sampling
    then gives what a backend built with those weights gives. Offloading drops the layout."""
    from plexrl_dask.shared.types import AdamWParams, CrossEntropy

    backend = backend_of(tiny_spec(seed=6), batch=8)
    step = backend.decode_step
    first = step.bind(32).layers
    assert step.bind(32).layers is first
    prompts, ids = backend.tokenize(PROMPTS), list(range(len(PROMPTS)))
    before = backend.sample(prompts, PARAMS, ids, Streams(8, 1))

    data = [Datum.from_prompt_completion(*backend.tokenize(["12+3=", "15\n"]))]
    backend.forward_backward(data, CrossEntropy())
    backend.optim_step(AdamWParams(lr=0.05))
    trained = step.bind(32).layers
    assert trained is not first
    fresh = backend_of(tiny_spec(seed=6), batch=8)
    fresh.set_weights(backend.get_weights())
    after = backend.sample(prompts, PARAMS, ids, Streams(8, 1))
    assert after == fresh.sample(prompts, PARAMS, ids, Streams(8, 1))
    assert after != before  # the step changed what is sampled, so a stale layout would show

    backend.set_weights(fresh.get_weights())
    assert step.bind(32).layers is not trained
    backend.offload()
    assert step._layout is None
    backend.reload()
    assert backend.sample(prompts, PARAMS, ids, Streams(8, 1)) == after


@pytest.mark.parametrize(
    "settings",
    [
        {"plexrl.sampling.decode-step": "auto"},
        {"plexrl.sampling.decode-step": "hf"},
        {"plexrl.sampling.engine": "static"},
    ],
)
def test_stop_token_ids_end_a_completion_where_their_token_is_drawn(settings):
    """A completion stops at the first of ``stop_token_ids`` it draws (kept, finish reason
    "stop") and is, up to there, the completion drawn without it; ids outside the vocabulary
    and malformed ones are typed errors."""
    with dask.config.set(settings):
        backend = TorchBackend(tiny_spec(seed=9), "cpu", max_batch_size=1)
    prompts = backend.tokenize(["12+3="])
    free = SamplingParams(n=1, temperature=1.0, max_tokens=20, ignore_eos=True, seed=5)
    [[long]] = backend.sample(prompts, free, [0], Streams(1, 1))
    first = long.tokens.index(long.tokens[6])
    stopping = dataclasses.replace(free, stop_token_ids=(long.tokens[6],))
    [[short]] = backend.sample(prompts, stopping, [0], Streams(1, 1))
    assert short.tokens == long.tokens[: first + 1] and short.finish_reason == "stop"
    assert short.logprobs == long.logprobs[: first + 1]
    beyond = dataclasses.replace(free, stop_token_ids=(backend.vocab_size,))
    with pytest.raises(errors.TokenOutOfVocabulary):
        backend.sample(prompts, beyond, [0])
    for bad in ((-1,), (True,), ("7",)):
        with pytest.raises(errors.InvalidSamplingParams):
            SamplingParams(stop_token_ids=bad)
