"""What the scheduler plugin does when requests, workers and grants go wrong: a paused worker,
a request that is not ready, a revoked grant, a relocation under a running request, a restore
that fails, a gang that loses a rank before it runs, input from the wire of the wrong type.
Each test is a defect found in review, kept fixed."""

from __future__ import annotations

import time

import dask
import pytest
from distributed import Event
from distributed.core import Status

import plexrl_dask as plexrl
from plexrl_dask import errors, protocol
from plexrl_dask.worker import ops
from tests.conftest import hold, tiny_spec, unique

TIMEOUT = 60


def record(runtime, name: str) -> dict:
    return runtime._call(protocol.GET_DEPLOYMENT, name=name)["deployment"]


def wait_until(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def blocking(client, deployment, gate: Event):
    """A request that holds ``deployment``'s worker until ``gate`` is set, once it runs."""
    with dask.annotate(plexrl=deployment.annotation(op="forward")):
        return client.submit(hold, deployment.name, gate.name, 120.0, pure=False)


def running(runtime, future) -> bool:
    return future.key in runtime.status()["queue"]["busy"].values()


def _set_status(status: str, dask_worker=None) -> None:
    dask_worker.memory_manager.memory_pause_fraction = False  # (no monitor undoing it)
    dask_worker.status = Status[status]


def test_a_request_released_to_a_paused_worker_runs_once_it_resumes(client, runtime):
    """Dask holds a task released to a paused worker (paused for memory, say) in no-worker;
    the plugin leaves it aimed there, whatever re-routing happens meanwhile, so it runs when
    the worker does, and the worker serves every job after."""
    dep = runtime.deploy(unique("paused"), tiny_spec(1))
    worker = dep.info.workers[0]
    data = [plexrl.Datum(tokens=dep.tokenize("1+1=2"))]
    client.run(_set_status, "paused", workers=[worker])
    try:
        future = dep.forward(data)
        time.sleep(1.0)
        other = plexrl.Runtime(client, job=unique("other"))
        passing = other.deploy(unique("tmp"), tiny_spec(3))  # (a deploy and an undeploy:
        other.undeploy(passing.name.split("@")[0])  # each re-routes orphans)
        time.sleep(0.5)
    finally:
        client.run(_set_status, "running", workers=[worker])
    assert plexrl.result(future, timeout=TIMEOUT).logprobs
    later = other.deploy(unique("after"), tiny_spec(4), workers=[worker])
    assert plexrl.result(later.forward(data), timeout=TIMEOUT).logprobs


def test_a_request_that_is_not_ready_holds_back_only_its_own_job(client, runtime):
    """Job B's request to a deployment A shared with it waits on an input that never comes:
    A's own requests to that deployment run regardless."""
    dep = runtime.deploy(unique("shared"), tiny_spec(2))
    other = plexrl.Runtime(client, job=unique("borrower"))
    dep.share(other.job, ops=("forward",))
    theirs = other.deployment(dep.name)
    data = [plexrl.Datum(tokens=dep.tokenize("2+2=4"))]
    stuck = client.submit(lambda x: x, 1, resources={"NOPE": 1}, pure=False)
    annotation = {**theirs.annotation(op="forward"), "request": unique("b"), "ranks": 1,
                  "rank": 0, "replica": 0}  # fmt: skip
    with dask.annotate(plexrl=annotation):
        waiting = client.submit(ops.forward, dep.name, stuck, 1.0, None, 0, pure=False)
    try:
        assert plexrl.result(dep.forward(data), timeout=TIMEOUT).logprobs
    finally:
        waiting.cancel()
        stuck.cancel()


def test_a_revoked_grant_fails_the_requests_queued_under_it(client, runtime):
    dep = runtime.deploy(unique("revoked"), tiny_spec(5))
    other = plexrl.Runtime(client, job=unique("borrower"))
    dep.share(other.job, ops=("forward",))
    theirs = other.deployment(dep.name)
    data = [plexrl.Datum(tokens=dep.tokenize("3+3=6"))]
    gate = Event(unique("gate"), client=client)
    blocker = blocking(client, dep, gate)
    wait_until(lambda: running(runtime, blocker))
    behind = blocking(client, dep, gate)  # (released behind it: B's request stays queued)
    wait_until(lambda: behind.key in runtime.status()["queue"]["queued"].values())
    queued = theirs.forward(data)
    time.sleep(0.3)
    assert dep.share(other.job, ops=()) == []
    gate.set()
    with pytest.raises(errors.PermissionDenied):
        plexrl.result(queued, timeout=TIMEOUT)
    assert blocker.result(timeout=TIMEOUT) == behind.result(timeout=TIMEOUT) == dep.name


def test_relocation_is_refused_while_a_request_runs_and_without_a_checkpoint(client, runtime):
    """A request released and running counts as in flight (a relocation then would lose what
    it trains); a deployment with trained state and no checkpoint is not moved."""
    dep = runtime.deploy(unique("moving"), tiny_spec(6))
    gate = Event(unique("gate"), client=client)
    blocker = blocking(client, dep, gate)
    wait_until(lambda: running(runtime, blocker))
    uid = record(runtime, dep.name)["uid"]
    try:
        with pytest.raises(errors.DeploymentBusy, match="in flight"):
            runtime._call(protocol.RELOCATE, name=dep.name, uid=uid, job=runtime.job,
                          checkpoint=None)  # fmt: skip
    finally:
        gate.set()
    blocker.result(timeout=TIMEOUT)
    data = [plexrl.Datum(tokens=dep.tokenize("1+2=3"))]
    plexrl.result(dep.train_step(data, params=plexrl.AdamWParams(lr=0.1)), timeout=TIMEOUT)
    wait_until(lambda: record(runtime, dep.name)["modified"])
    uid = record(runtime, dep.name)["uid"]
    with pytest.raises(errors.DeploymentBusy, match="no checkpoint"):
        runtime._call(protocol.RELOCATE, name=dep.name, uid=uid, job=runtime.job, checkpoint=None)
    assert record(runtime, dep.name)["state"] == "placed"


def test_a_restore_that_fails_leaves_the_deployment_to_be_restored(client, runtime):
    """A relocating deployment's restore fails (its checkpoint is gone): it is relocating
    again, its checkpoint named, and refuses requests, rather than serve its spec's untrained
    weights as its own."""
    dep = runtime.deploy(unique("revived"), tiny_spec(7))
    data = [plexrl.Datum(tokens=dep.tokenize("1+1=2"))]
    plexrl.result(dep.train_step(data, params=plexrl.AdamWParams(lr=0.1)), timeout=TIMEOUT)
    wait_until(lambda: record(runtime, dep.name)["modified"])
    gone = {"path": "/nonexistent/ckpt", "model": "nothing", "version": 1, "format": "store"}
    uid = record(runtime, dep.name)["uid"]
    runtime._call(protocol.RELOCATE, name=dep.name, uid=uid, job=runtime.job, checkpoint=gone)
    with pytest.raises(errors.CheckpointError):
        plexrl.result(dep.load_state(gone), timeout=TIMEOUT)
    wait_until(lambda: record(runtime, dep.name)["state"] == "relocating")
    assert record(runtime, dep.name)["relocation"] == gone
    with pytest.raises(errors.DeploymentRelocating):
        plexrl.result(dep.forward(data), timeout=TIMEOUT)


def test_a_gangs_rank_that_fails_before_it_runs_fails_the_others(client, runtime):
    """Rank 0 of a two-rank request depends on a failing task: rank 1 fails too (typed), and
    the deployment's next request runs."""
    dep = runtime.deploy(unique("gang"), tiny_spec(8), world_size=2)
    data = [plexrl.Datum(tokens=dep.tokenize("1+1=2")), plexrl.Datum(tokens=dep.tokenize("2+3=5"))]

    def fail() -> None:
        raise RuntimeError("an input that failed (in this test)")

    bad = client.submit(fail, pure=False)
    request = unique("gang-req")
    futures = []
    for rank in range(2):
        annotation = {**dep.annotation(op="forward"), "request": request, "ranks": 2,
                      "rank": rank, "replica": 0}  # fmt: skip
        batch = bad if rank == 0 else data
        with dask.annotate(plexrl=annotation):
            futures.append(
                client.submit(ops.forward, dep.name, batch, 1.0, None, 0, pure=False)
            )
    with pytest.raises(RuntimeError):
        futures[0].result(timeout=TIMEOUT)
    with pytest.raises(errors.RankLost):
        futures[1].result(timeout=TIMEOUT)
    assert plexrl.result(dep.forward(data), timeout=TIMEOUT).logprobs
    counters = runtime.status()["jobs"][runtime.job]  # (a request of 2 ranks counts once)
    assert counters["dispatched"] == counters["completed"] >= 1


def test_wire_input_of_the_wrong_type_is_a_typed_error(client, runtime):
    """Handlers and annotations given values of the wrong type answer typed errors, and the
    runtime serves on."""
    dep = runtime.deploy(unique("typed"), tiny_spec(9))
    with pytest.raises(errors.ConfigError):
        runtime._call(protocol.SHARE, name=dep.name, to="x", ops=None, job=runtime.job)
    with pytest.raises(errors.ConfigError):
        runtime._call(protocol.SHARE, name=dep.name, to="x", ops=5, job=runtime.job)
    status = client.sync(
        client.scheduler.plexrl_deploy, name=5, uid="u", spec=tiny_spec(9).to_dict(),
        role="train", backend="torch", owner=runtime.job, memory_bytes=1,
        job=runtime.job, secret=runtime.secret, callback_timeout=TIMEOUT,
    )  # fmt: skip
    assert status["status"] == "error" and "ConfigError" in str(status)
    with dask.annotate(plexrl="not a dict"):
        odd = client.submit(ops.forward, dep.name, [], 1.0, None, 0, pure=False)
    with pytest.raises(errors.NotRouted):
        odd.result(timeout=TIMEOUT)
    data = [plexrl.Datum(tokens=dep.tokenize("1+1=2"))]
    assert plexrl.result(dep.forward(data), timeout=TIMEOUT).logprobs
