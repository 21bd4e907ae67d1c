"""The replica's prefix cache for multi-turn prompts (``TurnPrompt``), on a real tiny Qwen2
in-process: a conversation's next turn prefills only its new tokens, and a hit, a miss, an
eviction and a weight change all sample the same bits, scoring like teacher-forced forward."""

from __future__ import annotations

import pickle

import dask
import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.shared.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    SamplingParams,
    Streams,
    TurnPrompt,
)
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.prefix_cache import Prefix, PrefixCache
from tests.conftest import tiny_spec
from tests.test_decode import (
    ModelCalls,
    assert_scores_match_forward,
    one_thread,  # noqa: F401  (autouse: one torch thread)
)

PARAMS = SamplingParams(n=1, temperature=1.0, max_tokens=6, stop=("=",), seed=11)
OBSERVATION = [40, 41, 42]  # a tool's output, appended after each turn


def backend_of(cache_bytes="auto", batch=4) -> TorchBackend:
    with dask.config.set({"plexrl.sampling.prefix-cache-bytes": cache_bytes}):
        return TorchBackend(tiny_spec(seed=4), "cpu", max_batch_size=batch)


def conversations(backend: TorchBackend, turns: int = 3):
    """Four conversations (two pairs with the same first prompt) over ``turns`` model
    turns; every turn's samples and the prompts it sampled from."""
    first = backend.tokenize(["12+3=", "12+3=", "7*8=", "7*8="])
    prompts = [TurnPrompt(p, [len(p)]) for p in first]
    out = []
    for t in range(turns):
        params = SamplingParams(**{**PARAMS.__dict__, "seed": PARAMS.seed + t})
        result = backend.sample(prompts, params, list(range(len(prompts))), Streams(4, 1))
        out.append((prompts, result))
        prompts = [
            p.then([*g[0].tokens, *OBSERVATION]) for p, g in zip(prompts, result, strict=True)
        ]
    return out


def tokens_of(run):
    return [[(s.tokens, s.logprobs) for g in result for s in g] for _, result in run]


def test_turn_prompts_are_checked_and_travel_whole():
    p = TurnPrompt([5, 6, 7], [2, 3])
    assert p == (5, 6, 7) and p.turns == (2, 3) and p.then([8]).turns == (2, 3, 4)
    again = pickle.loads(pickle.dumps(p))
    assert type(again) is TurnPrompt and again.turns == (2, 3)
    for tokens, turns in (([5, 6], [1]), ([5, 6], [2, 1, 2]), ([5, 6], []), ([5, True], [2])):
        with pytest.raises(errors.InvalidSamplingParams):
            TurnPrompt(tokens, turns)


def test_a_hit_samples_the_bits_a_miss_samples_and_prefills_only_new_turns():
    cached = backend_of()
    calls = ModelCalls(cached)
    run = conversations(cached)
    calls.close()
    stats = cached.prefix_cache.stats()
    # Turn 0: the second prompt of each pair hits the first; later turns hit the whole
    # previous prompt and prefill only the new tokens.
    assert stats["hits"] == 2 + 4 + 4 and stats["lookups"] == 12
    assert stats["hit_tokens"] >= stats["tokens"] / 2
    # one-row forwards of several tokens: the turn prefills, one per miss and per new turn
    assert sum(1 for b, n in calls.shapes if b == 1 and n > 1) == 2 + 4 + 4
    for prompts, result in run:
        assert_scores_match_forward(cached, [list(p) for p in prompts], result)

    cold = backend_of()  # every prompt a miss: turn by turn from the start
    replay = []
    for prompts, _ in run:
        cold.forget_prefixes()
        params = SamplingParams(**{**PARAMS.__dict__, "seed": PARAMS.seed + len(replay)})
        replay.append((prompts, cold.sample(prompts, params, [0, 1, 2, 3], Streams(4, 1))))
    assert tokens_of(replay) == tokens_of(run)
    tight = backend_of(cache_bytes=1)  # nothing fits: always a miss
    assert tokens_of(conversations(tight)) == tokens_of(run)
    assert tight.prefix_cache.stats()["hits"] == 0 and tight.prefix_cache.nbytes() == 0


def test_the_cache_is_bounded_counted_and_dropped_with_old_weights():
    backend = backend_of()
    conversations(backend, turns=2)
    held = backend.prefix_cache.nbytes()
    assert held > 0 and len(backend.prefix_cache) == 2 + 4  # (pairs share a first prompt)
    with_cache = backend.state_bytes()  # (counted in the replica's bytes)
    backend.forget_prefixes()
    assert backend.state_bytes() == with_cache - held
    conversations(backend, turns=2)
    # a step changes the weights: the next lookup finds nothing
    backend.forward_backward([Datum(tokens=[5, 6, 7, 8])], CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-2))
    assert backend.prefix_cache.lookup(backend.version, [5, 6], [2]) == (0, None)
    assert backend.prefix_cache.nbytes() == 0
    backend.offload()
    assert backend.prefix_cache.nbytes() == 0
    backend.reload()

    small = PrefixCache(max_bytes=300)
    t = torch.zeros(1, 1, 4, 4)  # 64 bytes each
    small.put(0, [1], [1], Prefix((t,), (t,), torch.zeros(4)))  # 144 bytes
    small.put(0, [2], [1], Prefix((t,), (t,), torch.zeros(4)))
    small.lookup(0, [1], [1])  # [1] is the more recent now
    small.put(0, [3], [1], Prefix((t,), (t,), torch.zeros(4)))  # evicts [2]
    assert small.lookup(0, [2], [1]) == (0, None) and small.lookup(0, [3], [1])[0] == 1
    assert small.nbytes() <= 300


def test_without_a_decode_step_or_a_cache_turn_prompts_are_plain_prompts():
    with dask.config.set({"plexrl.sampling.decode-step": "hf"}):
        hf = TorchBackend(tiny_spec(seed=4), "cpu", max_batch_size=4)
    off = backend_of(cache_bytes=0)
    assert hf.prefix_cache is None and off.prefix_cache is None
    for backend in (hf, off):
        run = conversations(backend, turns=2)
        for prompts, result in run:
            assert_scores_match_forward(backend, [list(p) for p in prompts], result)
