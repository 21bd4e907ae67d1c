"""CUDA paths of the torch backend and the holder. They run where a GPU exists and are skipped
elsewhere (CI and the development machines have none)."""

from __future__ import annotations

import pytest
import torch

from plexrl_dask.service.backends import TorchBackend
from plexrl_dask.service.holder import default_budget, resolve_device
from plexrl_dask.service.types import AdamWParams, CrossEntropy, Datum, SamplingParams
from tests.conftest import tiny_spec

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
    default stream (TorchBackend's copy_stream): the weights still come back bit for bit."""
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
