"""The device machine's script (``bench.device``) runs end to end here, on the CPU with gloo,
so that the one run a GPU session gets is not spent finding its bugs; a group of one forms
without a scheduler; NCCL gets a device with an index."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plexrl_dask.errors import GroupTimeout
from plexrl_dask.worker.groups import GroupContext, ProcessGroupManager, indexed

ROOT = Path(__file__).resolve().parents[1]


def test_device_checks_run_on_the_cpu(tmp_path):
    out = tmp_path / "device.json"
    proc = subprocess.run(
        [sys.executable, "-m", "plexrl_dask.bench.device", "--device", "cpu", "--quick",
         "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    results, setup = payload["results"], payload["config"]
    assert setup["device"] == "cpu" and setup["model"]["parameters"] > 0
    assert results["reload_bit_identical"] is True
    assert results["state_bytes"] > 0 and results["offload_gbps"] > 0
    # the offload's parts beyond a plain copy are timed apart (what the H200 run left open)
    assert results["per_tensor_offload_ratio"] > 0 and results["release_ms"] >= 0
    assert results["release_share_of_offload"] >= 0
    # a reload beside a busy thread comes back bit for bit (its timing needs a GPU to mean much)
    assert results["overlap_bit_identical"] is True
    assert results["overlap_reload_ratio"] > 0 and results["overlap_kernels_ratio"] > 0
    # one rank of FSDP2 over gloo computes what the plain model computes
    assert results["fsdp_backend"] == "gloo"
    losses = results["fsdp_losses"]
    assert len(losses["fsdp"]) == len(losses["plain"]) == 3  # 2 steps, offload, rebuild, 1
    assert results["fsdp_rebuilt_bit_identical"] is True
    assert results["fsdp_offload_released"] is True  # nothing kept the offloaded module alive
    assert results["fsdp_max_loss_diff"] <= 1e-6 and results["fsdp_max_weight_diff"] <= 1e-6
    assert results["add2_peak_tokens_per_s"] > 0
    assert results["add2_to_peak_b128"] > 0 and 0 < results["add2_tail_bound_b128"] <= 1
    assert "CUDA" in results["vllm_skipped"]  # the vLLM check says why it did not run
    # batch-invariant decoding: a prompt samples alone what it samples among 15 others
    assert results["row_invariant_identical"] is True
    assert results["row_invariant_identical_bf16"] is True
    assert results["row_invariant_cap"] >= 2 and results["row_invariant_merged_speedup"] > 0
    # an adapter bank: four adapters' prompts in one request, each the bits it samples alone
    assert results["bank_identical"] is True and results["bank_row_invariant"] is True
    assert results["bank_merged_speedup"] > 0
    # The static decoder (op by op here: no graphs off CUDA) chooses what the dynamic one does
    # on the job's requests, and every decode arm and the roofline are measured.
    assert results["captured_token_agreement"] >= 0.99 and results["grpo_request_to_peak"] > 0
    for arm in ("eager", "static", "captured", "hf_cb"):
        assert results[f"decode_tiny_{arm}_tokens_per_s_b8"] > 0
    assert results["decode_roofline_fraction_b1"] > 0 and results["copy_gbps"] > 0
    assert not [k for k in results if k.endswith("_error")]


def test_a_failing_device_check_keeps_the_others_numbers(tmp_path, monkeypatch):
    """The device run is rare: one check that fails is recorded (``<check>_error``, exit 1)
    and the others still run and land in the JSON, which is written after every check."""
    from plexrl_dask.bench import device

    def broken(*args):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(device, "check_fsdp", broken)
    out = tmp_path / "device.json"
    monkeypatch.setattr(
        sys,
        "argv",
        ["device", "--device", "cpu", "--quick", "--jobs", "0", "--shapes", "", "--json", str(out)],
    )
    threads = torch.get_num_threads()  # (main sets one thread, as a worker has)
    try:
        with pytest.raises(SystemExit) as stop:
            device.main()
    finally:
        torch.set_num_threads(threads)
    assert stop.value.code == 1
    results = json.loads(out.read_text())["results"]
    assert results["fsdp_error"] == "RuntimeError: NCCL error: unhandled system error"
    assert results["reload_bit_identical"] is True and results["overlap_bit_identical"] is True


def test_a_larger_group_needs_a_worker_to_meet():
    groups = ProcessGroupManager(None, "cpu")
    with pytest.raises(GroupTimeout, match="needs a Dask worker"):
        groups.join(GroupContext(uid="u", epoch=0, rank=0, world_size=2))
    assert groups.current is None


def test_an_nccl_device_id_carries_an_index():
    assert indexed(torch.device("cpu")) == torch.device("cpu")
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)  # no CUDA call needed
    if torch.cuda.is_available():
        assert indexed(torch.device("cuda")).index == torch.cuda.current_device()


def test_a_sharded_rank_refuses_a_cuda_device_other_than_the_current_one():
    from plexrl_dask.errors import ConfigError
    from plexrl_dask.worker.backends.fsdp import check_device

    def current() -> int:
        return 0

    for ok in (torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 0)):
        check_device(ok, current)  # no CUDA call: the current device is given
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        check_device(torch.device("cuda", 1), current)
