"""The static-shape decoder (``plexrl.sampling.engine: static``) on the CPU, op by op: what it
samples against the dynamic decoder and against teacher-forced scoring, its slots and buckets,
its cache in the replica's memory, and the on-device token choice against the host's. The
captured (CUDA graph) path is checked in ``tests/test_gpu.py``."""

from __future__ import annotations

import dask
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from plexrl_dask import errors
from plexrl_dask.bench.decode_rates import agreement
from plexrl_dask.shared.types import Datum, SamplingParams, Streams
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.sampling import (
    choose_tokens,
    choose_tokens_on_device,
    keys_tensor,
    row_keys,
    uniforms_at,
    uniforms_on_device,
)
from plexrl_dask.worker.static_decode import batch_buckets
from tests.conftest import tiny_spec
from tests.test_decode import one_thread  # noqa: F401  (autouse: one torch thread)

PROMPTS = ["12+3=", "4+5=", "99+1=", "7*8=", "1+1=", "60-7=", "123456+654321="]


def backend_of(engine: str, batch: int, **spec) -> TorchBackend:
    with dask.config.set({"plexrl.sampling.engine": engine}):
        return TorchBackend(tiny_spec(**spec), "cpu", max_batch_size=batch)


# Each kind of token choice, with stop strings and rows of very different lengths.
KINDS = {
    "sample-stop": SamplingParams(n=4, max_tokens=24, stop=("1", "5"), seed=7),
    "greedy": SamplingParams(n=3, max_tokens=12, temperature=0.0),
    "nucleus": SamplingParams(n=5, max_tokens=40, temperature=0.7, top_p=0.8, seed=3),
    "top-k": SamplingParams(n=5, max_tokens=30, temperature=1.2, top_k=3, seed=5),
    "top-k-and-p": SamplingParams(n=4, max_tokens=30, temperature=1.0, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("params", KINDS.values(), ids=KINDS.keys())
def test_static_samples_what_dynamic_samples_and_scores_like_forward(params):
    static = backend_of("static", batch=6, seed=4)
    dynamic = backend_of("dynamic", batch=6, seed=4)
    assert static.static is not None and dynamic.static is None
    prompts = static.tokenize(PROMPTS)
    ids = list(range(len(prompts)))
    streams = Streams(rows=14, refill_min_rows=2)  # refills: 14 rows through 6 slots
    got = static.sample(prompts, params, ids, streams)
    want = dynamic.sample(prompts, params, ids, streams)
    same, total = agreement(got, want)
    # The same math to float rounding: on these models no choice flips.
    assert same == total > 0
    assert [[s.finish_reason for s in g] for g in got] == [
        [s.finish_reason for s in g] for g in want
    ]
    # Every completion's log-probabilities are what scoring the text gives.
    batch = [Datum(tokens=tuple(prompts[i]) + s.tokens) for i, g in enumerate(got) for s in g]
    scored = static.forward(
        batch, temperature=1.0 if params.temperature == 0 else params.temperature
    )
    k = 0
    for i, group in enumerate(got):
        for s in group:
            ref = scored.logprobs[k][len(prompts[i]) :]
            k += 1
            if params.temperature == 0:
                continue  # greedy: log-probabilities at temperature 1 of the argmax, checked above
            assert np.allclose(ref, s.logprobs, atol=1e-4), (ref, s.logprobs)
    assert static.static.captures == 0  # nothing is captured off CUDA


def test_slots_buckets_and_the_cache_in_the_replicas_memory():
    backend = backend_of("static", batch=6, seed=2, max_positions=512)
    engine = backend.static
    assert batch_buckets(6) == (1, 2, 4, 6) and batch_buckets(128)[-1] == 128
    assert batch_buckets(1) == (1,)
    state = backend.state_bytes()
    prompts = backend.tokenize(PROMPTS[:3])
    params = SamplingParams(n=2, max_tokens=100, seed=1)
    first = backend.sample(prompts, params, [0, 1, 2])
    # One cache, sized to the stream (longest prompt + max_tokens, rounded up to 2^k >= 64),
    # counted in the replica's memory.
    assert engine._cache is not None and engine._cache.length == 128
    assert engine.nbytes() == engine.cache_bytes(6, 128) > 0
    layout = backend.decode_step.nbytes()  # (the decode step's weight layout, kept too)
    assert backend.state_bytes() == state + engine.nbytes() + layout
    # Offload drops the cache; the reloaded replica samples the same completions.
    backend.offload()
    assert engine.nbytes() == 0 and backend.state_bytes() == state
    backend.reload()
    assert backend.sample(prompts, params, [0, 1, 2]) == first
    # A smaller batch limit (bench.sampling's arms set it per request) keeps the cache.
    backend.max_batch_size = 2
    fewer = backend.sample(prompts, params, [0, 1, 2])
    assert engine._cache.slots == 6 and agreement(fewer, first)[0] == agreement(fewer, first)[1]
    backend.max_batch_size = 6
    # A request split into streams samples what one stream does (streams are independent).
    one = backend.sample(prompts, params, [0, 1, 2], Streams(rows=6, refill_min_rows=1))
    two = backend.sample(prompts, params, [0, 1, 2], Streams(rows=2, refill_min_rows=1))
    assert agreement(one, two)[0] == agreement(one, two)[1]


def test_a_stream_that_would_overflow_the_cache_limit_decodes_dynamically():
    with dask.config.set({"plexrl.sampling.static-cache-max-bytes": "1KiB"}):
        backend = backend_of("static", batch=4, seed=1)
    prompts = backend.tokenize(PROMPTS[:2])
    params = SamplingParams(n=2, max_tokens=8, seed=2)
    assert not backend.static.fits(4, max(map(len, prompts)), 8)
    out = backend.sample(prompts, params, [0, 1])
    assert backend.static.nbytes() == 0  # nothing allocated: the dynamic decoder ran
    assert out == backend_of("dynamic", batch=4, seed=1).sample(prompts, params, [0, 1])


@pytest.mark.parametrize(
    "setting",
    [
        {"plexrl.sampling.engine": "fast"},
        {"plexrl.sampling.cuda-graphs": "yes"},
        {"plexrl.sampling.static-cache-max-bytes": "lots"},
        {"plexrl.sampling.static-cache-max-bytes": -1},
    ],
)
def test_bad_engine_settings_are_config_errors(setting):
    with dask.config.set(setting), pytest.raises(errors.ConfigError):
        TorchBackend(tiny_spec(), "cpu", max_batch_size=2)


@given(
    seed=st.integers(0, 2**63 - 1),
    prompt=st.integers(0, 2**40),
    sample=st.integers(0, 2**20),
    position=st.integers(0, 2**20),
)
def test_uniforms_on_the_device_are_the_hosts_bit_for_bit(seed, prompt, sample, position):
    keys = row_keys(seed, np.array([prompt, prompt + 1]), np.array([sample, sample]))
    pos = np.array([position, position + 7], dtype=np.int64)
    host = uniforms_at(keys, pos)
    device = uniforms_on_device(keys_tensor(keys, "cpu"), torch.from_numpy(pos))
    assert device.dtype == torch.float64
    assert np.array_equal(device.numpy(), host)


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 1.0, 0), (0.9, 0.5, 0), (1.0, 1.0, 7), (0.8, 0.6, 40)],
)
def test_the_choice_without_read_back_is_the_hosts(temperature, top_p, top_k):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 300, generator=gen) * 4
    logits[3, 250:] = float("-inf")  # a row whose last tokens have no mass
    u = np.random.default_rng(1).random(16)
    u[3] = np.nextafter(1.0, 0.0)  # the top of the CDF: the last token with mass
    want = choose_tokens(logits, temperature, top_p, u, top_k)
    got = choose_tokens_on_device(
        logits,
        torch.tensor(max(temperature, 1.0) if temperature == 0 else temperature),
        torch.tensor(top_p, dtype=torch.float64),
        torch.from_numpy(u),
        greedy=temperature == 0,
        nucleus=top_p < 1 or top_k > 0,
        top_k=torch.tensor(top_k),
    )
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert int(got[0][3]) < 250
