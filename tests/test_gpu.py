"""CUDA paths of the torch backend and the holder. They run where a GPU exists and are skipped
elsewhere (CI and the development machines have none)."""

from __future__ import annotations

import importlib.util

import dask
import pytest
import torch

from plexrl_dask.shared.types import AdamWParams, CrossEntropy, Datum, SamplingParams
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.device import default_budget, resolve_device
from tests.conftest import tiny_spec
from tests.test_static_decode import KINDS, PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine"
    ),
]


def test_auto_device_and_budget_use_the_gpu():
    assert resolve_device("auto") == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0.85 * total < default_budget("cuda") < total


def test_offload_frees_device_memory_and_reload_is_bit_identical():
    backend = TorchBackend(tiny_spec(hidden_size=256, num_layers=4), "cuda")
    data = [Datum(tokens=backend.tokenize([f"{i}+{i}={2 * i}"])[0]) for i in range(8)]
    backend.forward_backward(data, CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-3))
    before = backend.get_weights()
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    backend.offload()
    assert torch.cuda.memory_allocated() < used - 0.9 * backend.state_bytes()
    host = backend._host["params"]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in host.values())
    backend.reload()
    after = backend.get_weights()
    assert all(torch.equal(before[n], after[n]) for n in before)
    backend.forward_backward(data, CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-3))  # optimizer state came back to the device


def test_sampling_on_cuda_is_seeded():
    backend = TorchBackend(tiny_spec(), "cuda")
    prompts = backend.tokenize(["1+1=", "22+33="])
    params = SamplingParams(n=2, max_tokens=8, seed=4)
    assert backend.sample(prompts, params, [0, 1]) == backend.sample(prompts, params, [0, 1])


def test_reload_beside_a_busy_default_stream_is_bit_identical():
    """A prefetch reloads on a stream of its own while another request's kernels run on the
    default stream (worker.device.copy_stream): the weights still come back bit for bit."""
    import threading

    backend = TorchBackend(tiny_spec(hidden_size=256, num_layers=4), "cuda")
    data = [Datum(tokens=backend.tokenize([f"{i}+{i}={2 * i}"])[0]) for i in range(8)]
    backend.forward_backward(data, CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-3))
    before = backend.get_weights()
    backend.offload()
    a = torch.randn(2048, 2048, device="cuda")

    def busy() -> None:
        out = a
        for _ in range(100):
            out = torch.mm(a, out).tanh_()
        torch.cuda.synchronize()

    thread = threading.Thread(target=busy)
    thread.start()
    backend.reload()
    thread.join(timeout=120)
    after = backend.get_weights()
    assert all(torch.equal(before[n], after[n]) for n in before)
    backend.forward_backward(data, CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-3))


# --- the static decoder, its steps captured as CUDA graphs ---------------------------------


def _static(capture: bool, engine: str = "static", **spec) -> TorchBackend:
    with dask.config.set(
        {"plexrl.sampling.engine": engine, "plexrl.sampling.cuda-graphs": capture}
    ):
        return TorchBackend(tiny_spec(**spec), "cuda", max_batch_size=6)


def _positions_agreeing(a, b) -> float:
    from plexrl_dask.bench.decode_rates import agreement

    same, total = agreement(a, b)
    return same / total


@pytest.mark.parametrize("params", KINDS.values(), ids=KINDS.keys())
def test_captured_steps_sample_what_op_by_op_steps_and_the_dynamic_decoder_sample(params):
    from plexrl_dask.shared.types import Streams

    captured, eager = _static(True, seed=4), _static(False, seed=4)
    dynamic = _static(False, engine="dynamic", seed=4)
    assert captured.static.capture and not eager.static.capture and dynamic.static is None
    prompts = captured.tokenize(PROMPTS)
    ids = list(range(len(prompts)))
    streams = Streams(rows=14, refill_min_rows=2)  # refills: 14 rows through 6 slots
    got = captured.sample(prompts, params, ids, streams)
    assert captured.static.captures > 0
    assert _positions_agreeing(got, eager.sample(prompts, params, ids, streams)) >= 0.99
    assert _positions_agreeing(got, dynamic.sample(prompts, params, ids, streams)) >= 0.99
    # Replayed graphs: the same request again records nothing and samples the same.
    recorded = captured.static.captures
    assert captured.sample(prompts, params, ids, streams) == got
    assert captured.static.captures == recorded
    if params.temperature > 0:
        batch = [Datum(tokens=tuple(prompts[i]) + s.tokens) for i, g in enumerate(got) for s in g]
        scored = captured.forward(batch, temperature=params.temperature).logprobs
        flat = [s for g in got for s in g]
        for k, s in enumerate(flat):
            i = k // params.n
            assert (
                max(
                    abs(a - b)
                    for a, b in zip(scored[k][len(prompts[i]) :], s.logprobs, strict=True)
                )
                < 1e-3
            )


def test_captured_steps_follow_weight_updates_offloads_and_reloads():
    captured = _static(True, seed=2)
    prompts = captured.tokenize(PROMPTS[:3])
    params = SamplingParams(n=2, max_tokens=16, seed=5)
    before = captured.sample(prompts, params, [0, 1, 2])
    data = [Datum(tokens=captured.tokenize([f"{i}+{i}={2 * i}"])[0]) for i in range(8)]
    captured.forward_backward(data, CrossEntropy())
    captured.optim_step(AdamWParams(lr=1e-2))  # new weights, written in place
    fresh = _static(False, seed=2)
    fresh.set_weights(captured.get_weights())
    after = captured.sample(prompts, params, [0, 1, 2])
    assert after != before
    assert _positions_agreeing(after, fresh.sample(prompts, params, [0, 1, 2])) >= 0.99
    captured.offload()
    assert captured.static.nbytes() == 0
    captured.reload()  # the weights at new addresses: recorded again, same samples
    assert captured.sample(prompts, params, [0, 1, 2]) == after


def test_the_uniforms_and_the_choice_on_the_gpu_are_the_hosts():
    import numpy as np

    from plexrl_dask.worker.sampling import (
        choose_tokens,
        choose_tokens_on_device,
        keys_tensor,
        row_keys,
        uniforms_at,
        uniforms_on_device,
    )

    keys = row_keys(2**62 + 5, np.arange(64), np.arange(64) % 8)
    pos = np.arange(64, dtype=np.int64) * 977
    on_gpu = uniforms_on_device(keys_tensor(keys, "cuda"), torch.from_numpy(pos).cuda())
    assert np.array_equal(on_gpu.cpu().numpy(), uniforms_at(keys, pos))
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    u = uniforms_at(keys, pos)
    want = choose_tokens(logits, 0.8, 1.0, u)
    got = choose_tokens_on_device(
        logits.cuda(), torch.tensor(0.8, device="cuda"), 1.0, on_gpu, greedy=False, nucleus=False
    )
    # The same choice; the log-probabilities within float rounding of the CPU's kernels.
    assert torch.equal(want[0], got[0].cpu())
    assert torch.allclose(want[1], got[1].cpu(), atol=1e-5)


# --- the vLLM backend (also needs the vllm package) ----------------------------------------

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="needs the vllm package (CUDA builds only; not installed on this machine)",
)
# head_dim 64 and bf16: shapes and a dtype every vLLM attention backend takes.
VLLM_SPEC = dict(
    hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=256, dtype="bfloat16"
)


@pytest.fixture(scope="module")
def vllm_replica():
    from plexrl_dask.worker.backends import VLLMBackend

    with dask.config.set(
        {"plexrl.vllm.enforce-eager": True, "plexrl.vllm.kv-cache-memory": "1GiB"}
    ):
        backend = VLLMBackend(tiny_spec(**VLLM_SPEC), "cuda", max_batch_size=64)
    yield backend
    backend.close()


def _trainer_logprobs(trainer: TorchBackend, prompt: list[int], seq) -> list[float]:
    datum = Datum.from_prompt_completion(prompt, list(seq.tokens))
    return list(trainer.forward([datum]).logprobs[0][len(prompt) :])


@needs_vllm
def test_vllm_samples_each_row_from_its_own_seed(vllm_replica):
    prompts = vllm_replica.tokenize(["1+1=", "22+33=", "7*8="])
    params = SamplingParams(n=3, max_tokens=12, seed=4)
    first = vllm_replica.sample(prompts, params, [0, 1, 2])
    assert vllm_replica.sample(prompts, params, [0, 1, 2]) == first
    # a request split over replicas samples every row as the whole request does
    assert vllm_replica.sample([prompts[2], prompts[0]], params, [2, 0]) == [first[2], first[0]]
    for group in first:
        for seq in group:
            assert 1 <= len(seq.tokens) <= 12 and seq.finish_reason in ("stop", "length")
            assert all(lp <= 0.0 for lp in seq.logprobs)
            assert seq.text == vllm_replica.text(seq.tokens)


@needs_vllm
def test_vllm_logprobs_are_the_trainers_at_the_temperature(vllm_replica):
    trainer = TorchBackend(tiny_spec(**VLLM_SPEC), "cuda")
    prompts = vllm_replica.tokenize(["12+34=", "5-3="])
    out = vllm_replica.sample(prompts, SamplingParams(n=4, max_tokens=10, seed=1), [0, 1])
    gaps = [
        abs(a - b)
        for prompt, group in zip(prompts, out, strict=True)
        for seq in group
        for a, b in zip(seq.logprobs, _trainer_logprobs(trainer, prompt, seq), strict=True)
    ]
    assert max(gaps) < 0.1  # the same model in bf16 through other kernels


@needs_vllm
def test_vllm_sleep_frees_the_gpu_and_wake_samples_the_same(vllm_replica):
    prompts = vllm_replica.tokenize(["3+4="])
    params = SamplingParams(n=4, max_tokens=8, seed=2)
    before = vllm_replica.sample(prompts, params, [0])
    free_awake = torch.cuda.mem_get_info()[0]
    vllm_replica.offload()
    assert not vllm_replica.resident
    assert torch.cuda.mem_get_info()[0] > free_awake + vllm_replica.cfg.kv_cache_bytes // 2
    vllm_replica.reload()
    assert vllm_replica.resident
    assert vllm_replica.sample(prompts, params, [0]) == before


@needs_vllm
def test_vllm_loads_published_weights_and_refuses_what_it_cannot_do(vllm_replica, tmp_path):
    from plexrl_dask import errors
    from plexrl_dask.state_store.store import StateStore
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

    trainer = TorchBackend(tiny_spec(**VLLM_SPEC), "cuda")
    data = [Datum(tokens=trainer.tokenize([f"{i}+{i}={2 * i}"])[0]) for i in range(16)]
    for _ in range(5):
        trainer.forward_backward(data, CrossEntropy())
        trainer.optim_step(AdamWParams(lr=3e-3))
    store = StateStore(tmp_path / "store", create=True)
    trainer.save_state(StoreCheckpoint(store, "policy", trainer.version))
    assert vllm_replica.load_weights(StoreCheckpoint(store, "policy")) == trainer.version == 5
    prompts = vllm_replica.tokenize(["4+4="])
    out = vllm_replica.sample(prompts, SamplingParams(n=4, max_tokens=8, seed=3), [0])
    for seq in out[0]:
        trained = _trainer_logprobs(trainer, prompts[0], seq)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, trained, strict=True)) < 0.1

    with pytest.raises(errors.InvalidSamplingParams, match="top_p"):
        vllm_replica.sample(prompts, SamplingParams(top_p=0.9), [0])
    with pytest.raises(errors.InvalidSamplingParams, match="temperature"):
        vllm_replica.sample(prompts, SamplingParams(temperature=0.005), [0])
    with pytest.raises(errors.WeightsMismatch, match="every parameter or none"):
        vllm_replica.set_weights({"model.norm.weight": torch.ones(256)}, strict=False)
    with pytest.raises(errors.WeightsMismatch):
        vllm_replica.set_weights({"model.norm.weight": torch.ones(3)})
    with pytest.raises(errors.OpNotSupported):
        vllm_replica.get_weights()
    with pytest.raises(errors.OpNotSupported):
        vllm_replica.forward(data)
    # set_weights goes through the same engine call: back to the untrained weights
    fresh = TorchBackend(tiny_spec(**VLLM_SPEC), "cuda")
    vllm_replica.set_weights(fresh.get_weights(), version=0)
    assert vllm_replica.version == 0
    for seq in vllm_replica.sample(prompts, SamplingParams(n=4, max_tokens=8, seed=3), [0])[0]:
        untrained = _trainer_logprobs(fresh, prompts[0], seq)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, untrained, strict=True)) < 0.1
