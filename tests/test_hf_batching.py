"""transformers' continuous batching (``bench.hf_batching``) on a tiny model, on the CPU."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from plexrl_dask.bench.hf_batching import hf_continuous_batching_rate  # noqa: E402
from plexrl_dask.models.spec import ModelSpec  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    spec = ModelSpec.tiny(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model, tok = spec.build_model("cpu"), spec.build_tokenizer()
    # The seeded init decodes every prompt into a repeat of its last character; weights redrawn
    # at std 0.02 give rows that differ, and one whose first greedy token is EOS (id 2).
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    prompts = [tok.encode(s) for s in ["hello world", "abc", "the quick brown fox", "zz"]]
    return model, prompts


def test_greedy_rows_match_generate_and_nothing_is_left_running(tiny):
    model, prompts = tiny
    attn_before, threads_before = model.config._attn_implementation, set(threading.enumerate())
    model.train()

    result = hf_continuous_batching_rate(
        model, prompts, NEW_TOKENS, batch=4, eos_token_id=2, timeout_s=60
    )

    assert result["tokens"] == len(prompts) * NEW_TOKENS
    assert [len(row) for row in result["outputs"]] == [NEW_TOKENS] * len(prompts)
    assert result["seconds"] > 0 and result["tokens_per_s"] > 0
    assert result["attn_implementation"] in ("sdpa", "paged|sdpa")
    assert result["transformers"]
    # The model is left as it was found: its attention implementation, its train mode, no thread.
    assert model.config._attn_implementation == attn_before
    assert model.training
    new_threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    assert new_threads == []

    # Greedy rows equal plain generate's (EOS disabled there too). Measured: identical on every
    # position, row 0 starting with EOS (so the run went on past it).
    assert result["eos_tokens"] >= 1
    model.eval()
    same = total = 0
    for prompt, row in zip(prompts, result["outputs"], strict=True):
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        assert len(ref) == NEW_TOKENS
        same += sum(a == b for a, b in zip(ref, row, strict=True))
        total += NEW_TOKENS
    assert same / total >= 0.9, (same, total)


def test_a_wait_past_the_timeout_raises_and_stops_the_thread(tiny):
    model, prompts = tiny
    threads_before = set(threading.enumerate())
    with pytest.raises(TimeoutError):
        hf_continuous_batching_rate(model, prompts * 50, 64, batch=2, timeout_s=0.5)
    new_threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    assert new_threads == []
    assert model.config._attn_implementation == "sdpa"
