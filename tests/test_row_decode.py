"""Batch-invariant decoding (plexrl_dask/worker/row_decode.py), on a real tiny Qwen2 in-process.

What it promises: a row's completion is the same bits whatever it is decoded with: alone,
beside other prompts of other lengths, at any ``max_batch_size``, in any position of the
request; its log-probabilities still equal teacher-forced scoring; the products' row counts
stay where the probe found them invariant.
"""

from __future__ import annotations

import dask
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl_dask import errors
from plexrl_dask.shared.types import SamplingParams, Streams
from plexrl_dask.worker import row_decode
from plexrl_dask.worker.backends import TorchBackend
from tests.conftest import tiny_spec
from tests.test_decode import assert_scores_match_forward, one_thread  # noqa: F401 (autouse)

PROMPTS = ["12+3=", "4+5=", "99+1=", "7*8=", "1+1=", "60-7=", "123+456=", "5="]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=12, stop=("1", "5", "9"), seed=3)
INVARIANT = Streams(128, 16, invariant=True)


def backend(batch: int, seed: int = 5) -> TorchBackend:
    return TorchBackend(tiny_spec(seed=seed), "cpu", max_batch_size=batch)


def test_a_row_samples_the_same_bits_whatever_it_is_batched_with():
    b = backend(batch=64)
    prompts = b.tokenize(PROMPTS)
    ids = [101 + i for i in range(len(prompts))]
    together = b.sample(prompts, PARAMS, ids, INVARIANT)
    # each prompt alone, with its own id, at several batch sizes
    for batch in (1, 2, 5, 64):
        b.max_batch_size = batch
        for i, prompt in enumerate(prompts):
            alone = b.sample([prompt], PARAMS, [ids[i]], INVARIANT)
            assert alone[0] == together[i], (batch, i)
    # in another order, among other companions
    b.max_batch_size = 7
    order = [5, 0, 7, 2]
    picked = b.sample([prompts[i] for i in order], PARAMS, [ids[i] for i in order], INVARIANT)
    assert picked == [together[i] for i in order]
    lengths = {len(s.tokens) for g in together for s in g}
    assert len(lengths) > 2, "completions of varied lengths (rows finish at different steps)"
    assert_scores_match_forward(b, prompts, together)


def test_greedy_and_nucleus_rows_are_invariant_too():
    b = backend(batch=4)
    prompts = b.tokenize(PROMPTS[:5])
    for params in (
        SamplingParams(n=2, temperature=0.0, max_tokens=6, seed=1),
        SamplingParams(n=3, temperature=0.8, top_p=0.7, max_tokens=8, seed=2),
    ):
        together = b.sample(prompts, params, list(range(5)), INVARIANT)
        for i in range(5):
            assert b.sample([prompts[i]], params, [i], INVARIANT)[0] == together[i]
        assert_scores_match_forward(b, prompts, together, temperature=params.temperature)


def test_config_turns_it_on_and_off_and_is_checked():
    with dask.config.set({"plexrl.sampling.batch-invariant": True}):
        assert Streams.from_config().invariant is True
        assert Streams.from_config(invariant=False).invariant is False
    assert Streams.from_config().invariant is False
    with pytest.raises(errors.ConfigError, match="batch-invariant"):
        Streams(8, 1, invariant="yes")  # type: ignore[arg-type]


def test_the_products_stay_on_probed_row_counts():
    b = backend(batch=4)
    bound = b.decode_step.bind(64)
    rows = row_decode.invariance(bound)
    seen: list[int] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x * 2

    for m in (1, 2, rows.cap, rows.cap + 1, 3 * rows.cap + 5):
        seen.clear()
        x = torch.randn(m, 4)
        assert torch.equal(rows.apply(record, x), x * 2)
        assert all(2 <= s <= rows.cap for s in seen) or (
            rows.exact and all(s == rows.cap for s in seen)
        ), (m, seen)
    exact = row_decode.ProductRows(16, exact=True)
    seen.clear()
    x = torch.randn(21, 4)
    assert torch.equal(exact.apply(record, x), x * 2)
    assert seen == [16, 16]


def test_without_the_decode_step_each_prompt_samples_what_it_would_alone():
    with dask.config.set({"plexrl.sampling.decode-step": "hf"}):
        b = backend(batch=4)
    prompts = b.tokenize(PROMPTS[:3])
    merged = b.sample(prompts, PARAMS, [0, 1, 2], INVARIANT)
    for i in range(3):
        assert b.sample([prompts[i]], PARAMS, [i], Streams(128, 16))[0] == merged[i]


def test_a_lora_replica_decodes_rows_invariantly_with_its_adapter():
    from plexrl_dask.models.spec import LORA_TARGETS
    from plexrl_dask.worker.backends.lora import LoraBackend

    # every linear layer adapted, the output head too (Tinker's default LoRA config)
    spec = tiny_spec(seed=5).with_lora(4, alpha=16, targets=(*LORA_TARGETS, "lm_head"), seed=2)
    b = LoraBackend(spec, "cpu", max_batch_size=8)
    assert b.decode_step is None and b.row_step().adapters
    with torch.no_grad():  # an adapter that changes the outputs (B starts at zero)
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    prompts = b.tokenize(PROMPTS[:5])
    together = b.sample(prompts, PARAMS, list(range(5)), INVARIANT)
    for i in range(5):
        assert b.sample([prompts[i]], PARAMS, [i], INVARIANT)[0] == together[i]
    # the adapter is in the products: scoring through PEFT's forward agrees
    assert_scores_match_forward(b, prompts, together)
    base = backend(batch=8)
    assert base.sample(prompts, PARAMS, list(range(5)), INVARIANT) != together
    # an offload drops the step with the module tree; a reload builds one on the new tree
    b.offload()
    assert b._adapter_step is None
    b.reload()
    assert b.sample(prompts, PARAMS, list(range(5)), INVARIANT) == together


@pytest.fixture(scope="module")
def shared_backend():
    return backend(batch=64, seed=9)


@settings(max_examples=12, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(3, 99), min_size=1, max_size=12), min_size=1, max_size=6),
    n=st.integers(1, 3),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.8]),
    batch=st.integers(1, 9),
    data=st.data(),
)
def test_any_request_samples_each_prompt_as_it_samples_alone(
    shared_backend, prompts, n, temperature, top_p, batch, data
):
    """Property: whatever the prompts beside it, their order, the replica's batch size and the
    sampling parameters, a prompt's completions are the bits it gets in a request alone."""
    params = SamplingParams(
        n=n, temperature=temperature, top_p=top_p, max_tokens=8, stop=("5",), seed=4
    )
    b = shared_backend
    assert b.vocab_size == 100  # (the token ids drawn: tests/conftest.py's tiny model)
    ids = list(range(len(prompts)))
    order = data.draw(st.permutations(ids))
    b.max_batch_size = batch
    together = b.sample([prompts[i] for i in order], params, order, INVARIANT)
    b.max_batch_size = 64
    for k, i in enumerate(order):
        assert b.sample([prompts[i]], params, [i], INVARIANT)[0] == together[k]
