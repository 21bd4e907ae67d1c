"""A weights-only rollout (the vLLM backend's contract) in a GRPO job on a real cluster (own).

vLLM needs CUDA, so on these machines a stand-in takes its place in every worker's backend
registry, restarted workers included: the torch backend, refusing what a vLLM replica refuses
(checkpoints, scoring, training, reading weights back), keeping its own host copy and having a
``close``. The job code, the scheduler plugin and the holders are the real ones: a job with a
vLLM rollout checkpoints only its policy, and when the rollout's worker dies it goes back to
that checkpoint, loads the policy's weights into a new rollout and computes what an
uninterrupted run computes.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import dask
import pytest
from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.rl import GRPOConfig, GRPOJob, JobCheckpoints
from plexrl_dask.rl.job_checkpoint import read_checkpoint
from plexrl_dask.worker.backends import TorchBackend
from tests.conftest import tiny_spec, unique
from tests.test_grpo import FirstCharIsDigit


class WeightsOnlyTorch(TorchBackend):
    """Stands in for :class:`~plexrl_dask.worker.backends.VLLMBackend` (which needs CUDA)."""

    stashes = False

    def _refused(self, *args: Any, **kwargs: Any) -> Any:
        raise errors.OpNotSupported("a weights-only rollout (stand-in for vLLM) refuses this")

    save_state = load_state = forward = forward_backward = optim_step = get_weights = _refused

    def close(self) -> None:
        pass


class StandInForVLLM(WorkerPlugin):
    """Puts :class:`WeightsOnlyTorch` under the name "vllm" on every worker, present and future."""

    name = "plexrl-test-vllm-stand-in"

    def setup(self, worker: Any) -> None:
        from plexrl_dask.worker import backends

        backends.BACKENDS["vllm"] = WeightsOnlyTorch


@pytest.fixture(scope="module")
def client():
    with (
        dask.config.set(
            {"plexrl.vllm.kv-cache-memory": "1MiB", "plexrl.vllm.overhead-memory": "0B"}
        ),
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        client.register_plugin(StandInForVLLM())
        yield client


CONFIG = GRPOConfig(steps=4, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, seed=5)


def _job(runtime: plexrl.Runtime, tag: str, backend: str, **kwargs: Any) -> GRPOJob:
    spec = tiny_spec(seed=31)
    policy = runtime.deploy(unique(f"{tag}-policy"), spec)
    rollout = runtime.deploy(unique(f"{tag}-rollout"), spec, role="rollout", backend=backend)
    plexrl.result(runtime.sync_weights(policy, rollout))
    config = kwargs.pop("config", CONFIG)
    return GRPOJob("weights-only", runtime, FirstCharIsDigit(), policy, config, rollout, **kwargs)


def comparable(records: list) -> list:
    return [(r.step, r.reward_mean, r.completion_lengths, r.loss, r.version) for r in records]


def test_a_job_whose_vllm_rollout_dies_resyncs_it_from_its_checkpoint(client, tmp_path):
    runtime = plexrl.Runtime(client, job=unique("weights-only"))
    want = _job(runtime, "torch", "torch").run()
    victim = _job(runtime, "vllm", "vllm", checkpoints=JobCheckpoints.at(tmp_path / "ck", every=2))
    assert victim.rollout.info.weights_only
    killed: list[str] = []

    def kill(record: Any) -> None:
        if record.step == 2 and not killed:
            worker = runtime.deployment(victim.rollout.name).info.workers[0]
            pid = client.run(os.getpid, workers=[worker])[worker]
            os.kill(pid, signal.SIGKILL)
            killed.append(worker)

    got = victim.run(kill)
    assert killed and len(victim.recoveries) == 1, victim.recoveries
    assert "sync_weights" in victim.recoveries[0]  # the weights-only loss, named as such
    assert comparable(got) == comparable(want)
    saved = read_checkpoint(tmp_path / "ck")
    assert saved is not None and saved.rollout is None  # only the policy was checkpointed
    deadline = time.monotonic() + 60
    while len(runtime.status()["workers"]) < 2:  # (the killed worker's nanny restarts it)
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_split_async_job_cannot_score_on_a_vllm_rollout(client):
    runtime = plexrl.Runtime(client, job=unique("weights-only-async"))
    with pytest.raises(errors.ConfigError, match="scores its samples' old log-probabilities"):
        _job(runtime, "async", "vllm", config=GRPOConfig(steps=2, staleness=1))


def _load_estimates(deployment: str, dask_scheduler=None) -> dict:
    est = dask_scheduler.plugins["plexrl"].estimates
    learned = {tier: t for (dep, tier), t in est._load.items() if dep == deployment}
    return {"learned": learned, "bandwidth": dict(est._bandwidth)}


def test_a_weights_only_wake_is_learned_as_its_own_time_not_a_tier_bandwidth(client):
    """A vLLM replica's wake allocates its KV cache and overhead rather than copying them, so
    its load times teach the scheduler that deployment's setup, not the tier's bandwidth that
    every other deployment's first estimate divides by."""
    runtime = plexrl.Runtime(client, job=unique("weights-only-wake"))
    spec = tiny_spec(seed=33)
    policy = runtime.deploy(unique("wake-policy"), spec)
    rollout = runtime.deploy(unique("wake-rollout"), spec, role="rollout", backend="vllm")
    plexrl.result(runtime.sync_weights(policy, rollout))
    before = client.run_on_scheduler(_load_estimates, rollout.name)
    assert set(before["learned"]) == {"absent"}  # its start

    assert rollout.offload() == {rollout.info.workers[0]: True}
    params = plexrl.SamplingParams(max_tokens=4, seed=1)
    plexrl.result(rollout.sample(["1+1="], params))  # wakes it from host memory
    deadline = time.monotonic() + 60
    while (
        "dram" not in (after := client.run_on_scheduler(_load_estimates, rollout.name))["learned"]
    ):
        assert time.monotonic() < deadline, f"the wake was never observed: {after}"
        time.sleep(0.05)
    assert after["learned"]["dram"] > 0
    assert after["bandwidth"].get("dram") == before["bandwidth"].get("dram")
