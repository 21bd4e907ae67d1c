"""Relocation: a job's deployments follow its placement, their trained state with them.

A process LocalCluster (host 127.0.0.1, two GPU workers, one node group per node) is full
with another job's dedicated reservation, so a new job waits and runs best effort on those
workers. A worker on another "host" (127.0.0.2, with node tiers of its own) joins, the job is
admitted to a group there, and ``Runtime.relocate`` moves its deployments: the trained one
through a checkpoint imported across nodes, the unmodified one rebuilt from its spec. Training
after the move ends on the very bits of a run that never moved.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import dask
import pytest
import torch
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask.cluster import worker_process
from plexrl_dask.errors import DeploymentNotFound, DeploymentRelocating
from plexrl_dask.state_store.keys import model_key
from tests.conftest import node_state, tiny_spec
from tests.test_weights_only_rollout import StandInForVLLM

WAIT_S = 120.0


@pytest.fixture(scope="module")
def cluster():
    with (
        dask.config.set({"plexrl.placement.group-nodes": 1}),
        plexrl.local_cluster(n_workers=2) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster, set_as_default=False) as c:
        yield c


def train(dep: plexrl.Deployment, steps: int) -> None:
    data = [plexrl.Datum(tokens=dep.tokenize(f"{i}+{i}={2 * i}")) for i in range(3)]
    for _ in range(steps):
        plexrl.result([dep.forward_backward(data), dep.optim_step(plexrl.AdamWParams(lr=1e-2))])


def weights(dep: plexrl.Deployment) -> dict[str, torch.Tensor]:
    return dict(plexrl.result(dep.get_weights()).tensors)


def job_state(runtime: plexrl.Runtime) -> dict:
    return runtime.placement(runtime.job)["state"]["jobs"][runtime.job]


def until(what: str, check) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.5)


def test_a_job_that_ran_best_effort_moves_into_its_group_with_its_trained_state(
    cluster, client, tmp_path, monkeypatch
):
    # what four steps give, on a deployment that never moves
    reference = plexrl.Runtime(client, job="reloc-reference")
    dep = reference.deploy("reloc-reference", tiny_spec(seed=41))
    train(dep, 4)
    expected = weights(dep)
    reference.undeploy(dep.name)

    hog = plexrl.Runtime(client, job="reloc-hog")  # both workers of host 127.0.0.1
    hog.deploy("reloc-hog", tiny_spec(seed=42), role="rollout", replicas=2)
    assert job_state(hog)["state"] == "profiling"

    mover = plexrl.Runtime(client, job="reloc-mover")
    policy = mover.deploy("reloc-policy", tiny_spec(seed=41))
    frozen = mover.deploy("reloc-frozen", tiny_spec(seed=43))
    # a weights-only rollout (vLLM's contract; a CPU stand-in here, on every worker to come)
    client.register_plugin(StandInForVLLM())
    with dask.config.set({"plexrl.vllm.kv-cache-memory": "1MiB", "plexrl.vllm.overhead-memory": 0}):
        rollout = mover.deploy("reloc-rollout", tiny_spec(seed=41), role="rollout", backend="vllm")
    assert job_state(mover)["state"] == "waiting"
    train(policy, 2)  # best effort, on the hog's workers
    plexrl.result(mover.sync_weights(policy, rollout))
    plexrl.result(frozen.forward([plexrl.Datum(tokens=frozen.tokenize("1+1=2"))]))
    assert mover.relocate() == []  # no group yet: nothing to follow

    b_tiers = {
        "dram-path": str(tmp_path / "b-dram"),
        "nvme-path": str(tmp_path / "b-nvme"),
        "node-id": "node-b",
    }
    # (the new worker unpickles the stand-in's plugin from this repository's tests)
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    worker = worker_process(cluster.scheduler_address, b_tiers, host="127.0.0.2")
    try:
        until("the job is admitted on the new host", lambda: job_state(mover)["state"] != "waiting")
        b = [w for w in plexrl.worker_info(client) if "127.0.0.2" in w]
        assert len(b) == 1
        until("the new worker reports its node", lambda: b[0] in mover.status()["workers"])

        moves = {m["name"]: m for m in mover.relocate()}
        assert set(moves) == {policy.name, frozen.name, rollout.name}
        assert moves[policy.name]["restored"] and moves[policy.name]["now"] == b
        assert not moves[frozen.name]["restored"]
        assert not moves[frozen.name]["needs_weights"]
        assert moves[rollout.name]["needs_weights"] and not moves[rollout.name]["restored"]
        assert set(moves[policy.name]["workers"]) <= set(hog.deployment("reloc-hog").info.workers)
        assert mover.relocate() == []  # done: nothing outside the group any more
        assert mover.status()["counters"]["relocations"] == 3

        # the trained state came along bit for bit (optimizer moments included)
        train(policy, 2)
        assert mover.deployment("reloc-policy").info.workers == tuple(b)
        got = weights(policy)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got)
        # the weights-only rollout refuses to sample until it is given weights, which place
        # it in the group
        params = plexrl.SamplingParams(n=4, max_tokens=6, seed=2)
        with pytest.raises(DeploymentRelocating, match="sync_weights"):
            plexrl.result(rollout.sample(["12+3="], params))
        plexrl.result(mover.sync_weights(policy, rollout))
        assert mover.deployment("reloc-rollout").info.workers == tuple(b)
        sampled = plexrl.result(rollout.sample(["12+3="], params))
        assert sampled == plexrl.result(policy.sample(["12+3="], params))
        # the unmodified one is rebuilt there by its next request
        plexrl.result(frozen.forward([plexrl.Datum(tokens=frozen.tokenize("1+1=2"))]))
        assert mover.deployment("reloc-frozen").info.workers == tuple(b)
        # the move's checkpoint was written on the old node, imported on the new one, and
        # both copies are gone
        for tiers in (cluster.plexrl_state, b_tiers):
            store = node_state(tiers).store("nvme")
            prefix = f"relocate..{model_key(policy.name)}.."
            [model] = [m for m in store.models() if m.startswith(prefix)]
            assert store.versions(model) == []

        # while relocating, only restoring the state is served
        saved = plexrl.result(policy.save_state())
        uid = mover.deployment("reloc-policy").info.uid
        with pytest.raises(DeploymentNotFound):
            mover._call(
                "plexrl_relocate", name=policy.name, uid="another-incarnation", job=mover.job
            )
        moved = mover._call(
            "plexrl_relocate", name=policy.name, uid=uid, job=mover.job, checkpoint=saved
        )
        assert moved["state"] == "relocating"
        with pytest.raises(DeploymentRelocating, match="deployment.info.relocation"):
            plexrl.result(policy.get_weights())
        # the driver that moved it is gone: the one that takes over finds the checkpoint in
        # the record (the scheduler's journal keeps it)
        relocation = mover.deployment("reloc-policy").info.relocation
        assert relocation == dict(saved)
        plexrl.result(policy.load_state(relocation))
        assert mover.deployment("reloc-policy").info.relocation is None
        assert all(torch.equal(v, got[k]) for k, v in weights(policy).items())
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        for name in ("reloc-policy", "reloc-frozen", "reloc-rollout"):
            mover.undeploy(name)
        hog.undeploy("reloc-hog")
