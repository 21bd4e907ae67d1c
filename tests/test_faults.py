"""A rank killed mid-request: a typed error, never a hang, and a way back (own cluster)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.cluster import JournaledCluster
from tests.conftest import tiny_spec, unique


@pytest.fixture(scope="module")
def fault_client():
    with (
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client


def _processing(client: Client, prefix: str) -> bool:
    def states(dask_scheduler):
        return [ts.state for key, ts in dask_scheduler.tasks.items() if str(key).startswith(prefix)]

    return "processing" in client.run_on_scheduler(states)


def test_rank_killed_mid_request_fails_typed_and_the_deployment_is_restored(fault_client, tmp_path):
    runtime = plexrl.Runtime(fault_client, job="faults")
    spec = tiny_spec(
        seed=3, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=256
    )
    dep = runtime.deploy(unique("victim"), spec, world_size=2)
    small = [plexrl.Datum(tokens=dep.tokenize(f"{i}*{i}={i * i}")) for i in range(4)]
    plexrl.result([dep.forward_backward(small), dep.optim_step()])
    path = str(tmp_path / "ckpt")
    plexrl.result(dep.save_state(path))
    saved = plexrl.result(dep.get_weights()).tensors

    big = [
        plexrl.Datum(tokens=dep.tokenize("".join(str(j % 10) for j in range(200))))
        for _ in range(32)
    ]
    fut = dep.forward_backward(big)
    deadline = time.monotonic() + 60
    while not _processing(fault_client, f"plexrl-forward_backward-{dep.name}"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    victim = dep.info.workers[1]
    pid = fault_client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)

    with pytest.raises((errors.RankLost, errors.DeploymentLost)):
        plexrl.result(fut, timeout=120)
    # Its trained shards died with the worker: typed error, not a silent re-init.
    with pytest.raises(errors.DeploymentLost, match="load_state"):
        plexrl.result(dep.forward(small), timeout=120)
    # Back from the checkpoint once the nanny's restarted worker has its holder, on the workers
    # that exist now, and training goes on.
    deadline = time.monotonic() + 60
    while len(runtime.status()["workers"]) < 2:
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.1)
    assert plexrl.result(dep.load_state(path), timeout=120) == 1
    restored = runtime.deployment(dep.name)
    assert victim not in restored.info.workers
    got = plexrl.result(restored.get_weights(), timeout=120).tensors
    assert all(torch.equal(got[n], t) for n, t in saved.items())
    out = plexrl.result([restored.forward_backward(small), restored.optim_step()], timeout=120)
    assert out[1]["version"] == 2.0


def test_worker_killed_mid_request_the_request_completes_elsewhere(fault_client):
    runtime = plexrl.Runtime(fault_client, job="faults-single")
    _wait_for_workers(runtime, 2)
    spec = tiny_spec(
        seed=5, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=256
    )
    dep = runtime.deploy(unique("single"), spec, role="rollout")  # never modified: rebuildable
    big = [
        plexrl.Datum(tokens=dep.tokenize("".join(str(j % 10) for j in range(200))))
        for _ in range(24)
    ]
    expected = plexrl.result(dep.forward(big), timeout=120)

    fut = dep.forward(big)
    deadline = time.monotonic() + 60
    while not _processing(fault_client, f"plexrl-forward-{dep.name}"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    victim = dep.info.worker
    pid = fault_client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)

    # The scheduler re-places the deployment on a live worker and runs the request there.
    got = plexrl.result(fut, timeout=180)
    assert got == expected  # bit-identical: same model from its spec, same inputs
    moved = runtime.deployment(dep.name)
    assert moved.info.worker != victim and moved.info.state == "placed"


def _wait_for_workers(runtime: plexrl.Runtime, n: int) -> None:
    # (a nanny restarting a killed worker on a loaded 2-core machine: not quick, never a hang)
    deadline = time.monotonic() + 180
    while len((status := runtime.status())["workers"]) < n:
        # (what to look at when it fails: the workers the scheduler has, and the holders')
        joined = sorted(plexrl.worker_info(runtime.client))
        assert time.monotonic() < deadline, (
            f"fewer than {n} workers reported in: the scheduler has {joined}, holders "
            f"{sorted(status['workers'])}, holder errors {status.get('holder_errors')}"
        )
        time.sleep(0.1)


def _split_job(runtime: plexrl.Runtime, tag: str, config, **kwargs):
    """A split GRPO job on fresh deployments (policy and a synced rollout) of one spec."""
    from plexrl_dask.rl import GRPOJob
    from tests.test_grpo import FirstCharIsDigit

    spec = tiny_spec(seed=31)
    policy = runtime.deploy(unique(f"{tag}-policy"), spec)
    rollout = runtime.deploy(unique(f"{tag}-rollout"), spec, role="rollout")
    plexrl.result(runtime.sync_weights(policy, rollout))
    return GRPOJob("faulty", runtime, FirstCharIsDigit(), policy, config, rollout, **kwargs)


def _recovers_exactly(runtime: plexrl.Runtime, steps: int, tmp_path, fault) -> str:
    """A split GRPO job with checkpoints every 2 steps, ``fault(job)`` after its step 2, must
    go back to its checkpoint by itself and end with exactly an uninterrupted run's records
    and weights. Returns why it went back."""
    from plexrl_dask.rl import GRPOConfig, JobCheckpoints

    config = GRPOConfig(
        steps=steps, prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, seed=5
    )
    whole = _split_job(runtime, "whole", config)
    want = whole.run()
    # (read now: a worker about to be killed may hold this one too)
    expected = plexrl.result(whole.policy.get_weights()).tensors
    victim = _split_job(
        runtime, "victim", config, checkpoints=JobCheckpoints.at(tmp_path / "ck", every=2)
    )
    fired: list[bool] = []

    def on_step(record) -> None:
        if record.step == 2 and not fired:
            fault(victim)
            fired.append(True)

    got = victim.run(on_step)
    assert fired and len(victim.recoveries) == 1, victim.recoveries

    def comparable(records):
        return [(r.step, r.reward_mean, r.completion_lengths, r.loss, r.version) for r in records]

    assert comparable(got) == comparable(want)
    final = plexrl.result(runtime.deployment(victim.policy.name).get_weights()).tensors
    assert all(torch.equal(final[n], t) for n, t in expected.items())
    return victim.recoveries[0]


@pytest.mark.parametrize("dies", ["policy", "rollout"])
def test_a_job_whose_worker_dies_goes_back_to_its_checkpoint_and_computes_the_same(
    fault_client, tmp_path, dies
):
    """After step 2 the worker holding the job's policy (or its rollout, synced and so not
    rebuildable from its spec) is killed: the job restores both deployments on the workers
    there are, redoes step 2 and computes what an uninterrupted run computes."""
    runtime = plexrl.Runtime(fault_client, job=unique("faults-grpo"))
    _wait_for_workers(runtime, 2)

    def kill(job) -> None:
        target = job.policy if dies == "policy" else job.rollout
        worker = runtime.deployment(target.name).info.workers[0]
        os.kill(fault_client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)

    assert "Lost" in _recovers_exactly(runtime, 5, tmp_path, kill)


# --- a scheduler killed and started again ---------------------------------------------------


def test_a_restarted_scheduler_has_its_deployments_jobs_and_grants_again(tmp_path):
    """The scheduler process killed (SIGKILL) and started again with the same journal: its
    workers went with it and new ones join; a job's deployments, secret and grants are as
    before; the one it trained is lost until it restores its checkpoint (exactly), the
    untrained one is rebuilt from its spec; another job's grant still holds."""
    from plexrl_dask.driver.runtime import as_another_driver

    with (
        JournaledCluster(tmp_path) as cluster,
        Client(cluster.address, timeout=60, set_as_default=False) as client,
    ):
        cluster.wait(client)
        a = plexrl.Runtime(client, job=unique("restart-a"))
        b = plexrl.Runtime(client, job=unique("restart-b"))
        trained = a.deploy(unique("trained"), tiny_spec(seed=41))
        frozen = a.deploy(unique("frozen"), tiny_spec(seed=42), role="rollout")
        batch = [plexrl.Datum(tokens=trained.tokenize("3+4=7"))]
        plexrl.result([trained.forward_backward(batch), trained.optim_step()])
        saved = plexrl.result(trained.save_state())  # on the node's NVMe tier
        want = plexrl.result(trained.get_weights())
        frozen_out = plexrl.result(frozen.forward(batch))
        trained.share(b.job, ops=("forward",))

        cluster.restart()
        cluster.wait(client)

        mine = {d.name: d.state.value for d in a.deployments()}
        assert mine == {trained.name: "lost", frozen.name: "unplaced"}
        with pytest.raises(errors.DeploymentLost):
            plexrl.result(trained.forward(batch))
        assert plexrl.result(trained.load_state(saved)) == want.version
        got = plexrl.result(trained.get_weights())
        assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())
        assert plexrl.result(frozen.forward(batch)) == frozen_out  # rebuilt from its spec
        # B's grant holds, and only that; A's secret is still A's alone.
        theirs = b.deployment(trained.name)
        assert plexrl.result(theirs.forward(batch)) == plexrl.result(trained.forward(batch))
        with pytest.raises(errors.PermissionDenied):
            plexrl.result(theirs.forward_backward(batch))
        with as_another_driver(), pytest.raises(errors.PermissionDenied, match="another driver"):
            plexrl.Runtime(client, job=a.job).undeploy(trained.name)
        assert a.status()["counters"]["deployments_restored"] == 2


def test_a_job_rides_through_a_scheduler_restart_and_computes_the_same(tmp_path):
    """After step 2 the job's scheduler is killed and started again on its journal (with new
    workers): the job waits for it, goes back to its checkpoint and computes what an
    uninterrupted run computes."""
    with (
        JournaledCluster(tmp_path) as cluster,
        Client(cluster.address, timeout=60, set_as_default=False) as client,
    ):
        cluster.wait(client)
        runtime = plexrl.Runtime(client, job=unique("ride-through"))
        why = _recovers_exactly(runtime, 4, tmp_path, lambda job: cluster.restart())
        assert why.startswith("SchedulerLost")
