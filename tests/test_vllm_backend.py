"""The vLLM backend's parts that run without a GPU: row seeds, the conversion of vLLM's
completions, configuration, and how a cluster without CUDA refuses a vLLM deployment (typed,
leaving the runtime as it was). The engine itself runs in ``tests/test_gpu.py`` where CUDA and
the ``vllm`` package exist."""

from __future__ import annotations

from dataclasses import dataclass

import dask
import pytest

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.shared.records import DeploymentInfo
from plexrl_dask.worker.backends.vllm_backend import (
    VLLMBackend,
    VLLMConfig,
    row_seeds,
    to_sequence,
    unavailable_reason,
)
from tests.conftest import tiny_spec, unique


@dataclass
class Logprob:
    """The shape of vLLM's ``vllm.logprobs.Logprob`` that :func:`to_sequence` reads (vLLM
    itself needs CUDA, so its class is not importable here)."""

    logprob: float
    rank: int | None = None


def test_row_seeds_are_a_function_of_the_row_only():
    whole = row_seeds(7, [10, 11, 12], 4)
    assert len(whole) == 3 and all(len(g) == 4 for g in whole)
    # a request split over replicas gives every row the seed it has in the whole request
    assert row_seeds(7, [11], 4) == [whole[1]]
    assert row_seeds(7, [12, 10], 4) == [whole[2], whole[0]]
    flat = [s for g in whole for s in g]
    assert len(set(flat)) == len(flat)
    assert all(0 <= s < 2**63 for s in flat)
    assert row_seeds(8, [10, 11, 12], 4) != whole


def test_a_completion_becomes_a_sampled_sequence():
    seq = to_sequence(
        [5, 9, 2], [{5: Logprob(-0.5)}, {9: Logprob(-1.25), 3: Logprob(-0.1)}, {2: Logprob(-2.0)}],
        "stop", lambda toks: "|".join(map(str, toks)),
    )  # fmt: skip
    assert seq.tokens == (5, 9, 2)
    assert seq.logprobs == (-0.5, -1.25, -2.0)
    assert seq.text == "5|9|2"
    assert seq.finish_reason == "stop"
    assert to_sequence([], [], "length", str).tokens == ()


@pytest.mark.parametrize(
    "tokens, logprobs, reason, match",
    [
        ([1, 2], [{1: Logprob(-1.0)}, {2: Logprob(-1.0)}], "abort", "abort"),
        ([1, 2], [{1: Logprob(-1.0)}], "stop", "1 log-probabilities for 2 tokens"),
        ([1, 2], None, "stop", "0 log-probabilities"),
        ([1, 2], [{1: Logprob(-1.0)}, {7: Logprob(-1.0)}], "stop", "sampled token 2"),
    ],
)
def test_a_completion_vllm_did_not_finish_or_score_is_refused(tokens, logprobs, reason, match):
    with pytest.raises(errors.RequestError, match=match):
        to_sequence(tokens, logprobs, reason, str)


def test_config_and_the_budget_of_a_replica():
    cfg = VLLMConfig.from_dask_config()
    assert cfg.device_bytes(1000) == 1000 + cfg.kv_cache_bytes + cfg.overhead_bytes
    for key, value, match in [
        ("kv-cache-memory", "0B", "kv-cache-memory"),
        ("batch-invariant", "yes", "batch-invariant"),
        ("kv-cache-memory", "lots", "plexrl.vllm"),
    ]:
        with (
            dask.config.set({f"plexrl.vllm.{key}": value}),
            pytest.raises(errors.ConfigError, match=match),
        ):
            VLLMConfig.from_dask_config()


def test_without_cuda_the_backend_says_why():
    assert "CUDA" in unavailable_reason("cpu")
    with pytest.raises(errors.BackendUnavailable, match="CUDA"):
        VLLMBackend(tiny_spec(), "cpu")


def test_the_registry_names_every_backend_the_workers_have():
    from plexrl_dask.shared.records import BACKEND_NAMES, WEIGHTS_ONLY_BACKENDS
    from plexrl_dask.worker.backends import BACKENDS

    assert set(BACKEND_NAMES) == set(BACKENDS)
    assert set(WEIGHTS_ONLY_BACKENDS) == {n for n, cls in BACKENDS.items() if not cls.stashes}


def test_the_registry_takes_vllm_for_rollout_only():
    base = dict(
        name="r", uid="u", spec=tiny_spec(), owner="j", memory_bytes=1, role="rollout"
    )  # fmt: skip
    info = DeploymentInfo(**base, backend="vllm")
    assert info.weights_only and info.revived_by("load_weights") and info.revived_by("load_state")
    assert not info.revived_by("sample")
    torch_info = DeploymentInfo(**base, backend="torch")
    # (a torch rollout replica is not weights-only, yet its weights are all its state: a
    # published version brings it back; set_weights, which may set a subset, does not)
    assert not torch_info.weights_only and torch_info.revived_by("load_weights")
    assert not torch_info.revived_by("set_weights")
    with pytest.raises(errors.ConfigError, match="role='rollout'"):
        DeploymentInfo(**{**base, "role": "train"}, backend="vllm")
    with pytest.raises(errors.ConfigError, match="backend must be one of"):
        DeploymentInfo(**base, backend="tensorrt")


def test_a_cluster_without_cuda_refuses_a_vllm_deployment_and_stays_usable(runtime):
    name = unique("vllm")
    with pytest.raises(errors.BackendUnavailable, match="CUDA"):
        runtime.deploy(name, tiny_spec(), role="rollout", backend="vllm")
    assert name not in {d.name for d in runtime.deployments()}  # unregistered again
    with pytest.raises(errors.ConfigError, match="role='rollout'"):
        runtime.deploy(unique("vllm"), tiny_spec(), role="train", backend="vllm")
    with pytest.raises(errors.ConfigError, match="backend must be one of"):
        runtime.deploy(unique("other"), tiny_spec(), role="rollout", backend="tensorrt")
    # the same model on the torch backend deploys and samples as before
    policy = runtime.deploy(unique("torch"), tiny_spec(), role="rollout")
    out = plexrl.result(policy.sample(["1+1="], plexrl.SamplingParams(n=2, max_tokens=4)))
    assert len(out.sequences[0]) == 2
