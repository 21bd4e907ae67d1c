"""The scheduler plugin on an in-process Dask cluster (``gen_cluster``): holders on GPU
workers, the deployment handlers, routing of annotated tasks, and parking.

Workers run in the test's process and event loop, so torch runs in their executor threads;
models are tiny.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import os
import time
import uuid
from collections.abc import Callable

import dask
import pytest
from dask.utils import parse_timedelta
from distributed import Client, LocalCluster, Nanny, Worker
from distributed.diagnostics.plugin import SchedulerPlugin as SchedulerPluginBase
from distributed.utils_test import gen_cluster, inc

import plexrl_dask
from plexrl_dask import errors
from plexrl_dask.models import ModelSpec
from plexrl_dask.plugins import PlexRLSchedulerPlugin
from plexrl_dask.protocol import PARKED
from plexrl_dask.worker import ops
from plexrl_dask.worker.holder import ReplicaHolder, holder_of

# Scheduler and worker state validation stay on (gen_cluster's default).
GPU = {"resources": {"GPU": 1}}
TWO_GPU_WORKERS = [("127.0.0.1", 1), ("127.0.0.1", 1)]
# gen_cluster resets dask.config to what it was when distributed.utils_test was first imported,
# which may predate plexrl_dask's defaults: pass the whole plexrl namespace explicitly.
_PLEXRL = copy.deepcopy(dask.config.get("plexrl"))
_PLEXRL["deploy"]["worker-report-timeout"] = "5s"
CONFIG = {"plexrl": _PLEXRL}
WAIT_S = 15.0


def spec(seed: int = 0) -> ModelSpec:
    return ModelSpec.tiny(hidden_size=32, num_layers=1, seed=seed)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``predicate`` until it holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


# Registered names (<name>@<job>: names are per-job namespaces) of the test job's deployments.
POLICY = "policy@test-job"
VALUE = "value@test-job"
# The secret of "test-job", registered by install() on each test's plugin.
TEST_JOB: dict[str, str] = {}


async def register(c, s) -> PlexRLSchedulerPlugin:
    """Register the scheduler plugin and the job "test-job" with it."""
    await c.register_plugin(PlexRLSchedulerPlugin())
    plugin = s.plugins[PlexRLSchedulerPlugin.name]
    TEST_JOB["secret"] = plugin.principals.register("test-job")
    return plugin


async def install(c, s, gpu_workers) -> PlexRLSchedulerPlugin:
    plugin = await register(c, s)
    addresses = {w.address for w in gpu_workers}
    await until(
        lambda: addresses <= set(plugin.worker_capacity) and all(holder_of(w) for w in gpu_workers),
        "workers to report capacity",
    )
    return plugin


def deploy_fields(name: str, model: ModelSpec, **overrides) -> dict:
    """The fields Runtime.deploy sends to the plexrl_deploy handler (``name`` qualified by the
    test job unless it names its job)."""
    return {
        "name": name if "@" in name else f"{name}@test-job",
        "uid": uuid.uuid4().hex,
        "spec": model.to_dict(),
        "role": "train",
        "backend": "torch",
        "owner": "test-job",
        "job": "test-job",
        "secret": TEST_JOB["secret"],
        "memory_bytes": model.memory_bytes("train"),
        "exist_ok": False,
        "candidates": None,
        **overrides,
    }


async def deploy(c, name: str, model: ModelSpec | None = None, **overrides) -> dict:
    status = await c.scheduler.plexrl_deploy(**deploy_fields(name, model or spec(), **overrides))
    return errors.raise_for_status(status)


def submit_routed(c, name: str, fn=ops.load, *args):
    ann = {"deployment": name, "job": "test-job", "secret": TEST_JOB["secret"]}
    with dask.annotate(plexrl={**ann, "op": fn.__name__}):
        return c.submit(fn, name, *args, pure=False)


async def scheduler_task(s, fut, timeout: float = WAIT_S):
    await until(lambda: fut.key in s.tasks, f"task {fut.key} on the scheduler", timeout)
    return s.tasks[fut.key]


# --- holders and capacity -----------------------------------------------------------------------


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_gpu_workers_get_holders_and_report_capacity(c, s, a, b):
    plugin = await install(c, s, [a, b])
    for w in (a, b):
        holder = holder_of(w)
        assert isinstance(holder, ReplicaHolder)
        assert holder.worker_address == w.address
        assert holder.device == "cpu"
        assert holder.names() == []
        capacity = plugin.worker_capacity[w.address]
        assert capacity["worker"] == w.address  # added by Dask to worker events
        assert capacity["budget_bytes"] == holder.budget_bytes > 0
        assert capacity["device"] == "cpu"
        assert "plexrl_holder_status" in w.handlers and "plexrl_holder_drop" in w.handlers
    status = await c.scheduler.plexrl_status()
    assert status["status"] == "OK"
    assert set(status["workers"]) == {a.address, b.address}
    # (msgpack turns lists into tuples on the wire)
    assert list(status["deployments"]) == [] and list(status["residency"]) == []


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1, GPU), ("127.0.0.1", 1)],
    config={**CONFIG, "distributed.worker.profile.enabled": True},  # off in gen_cluster
    timeout=60,
)
async def test_workers_without_the_gpu_resource_get_no_holder(c, s, gpu, plain):
    plugin = await install(c, s, [gpu])
    assert holder_of(gpu) is not None
    assert holder_of(plain) is None
    # Dask's profiler samples the GPU worker's requests at plexrl.worker.profile-interval
    # (100ms), the plain worker's at Dask's own interval.
    assert gpu.periodic_callbacks["profile"].callback_time == 100
    dask_ms = 1000 * parse_timedelta(dask.config.get("distributed.worker.profile.interval"))
    assert plain.periodic_callbacks["profile"].callback_time == dask_ms
    assert "plexrl_holder_status" not in plain.handlers
    assert set(plugin.worker_capacity) == {gpu.address}
    # Placement only ever considers the GPU worker.
    for k in range(3):
        info = (await deploy(c, unique(f"d{k}")))["deployment"]
        assert list(info["workers"]) == [gpu.address]
    # Removing the worker plugin gives Dask its own profiler interval back.
    await c.unregister_worker_plugin("plexrl-worker")
    assert gpu.periodic_callbacks["profile"].callback_time == dask_ms


@gen_cluster(
    client=True,
    nthreads=TWO_GPU_WORKERS,
    worker_kwargs={"resources": {"GPU": 1}},  # Dask's worker validation on (the default here)
    config=CONFIG,
    timeout=60,
)
async def test_holder_keeps_worker_state_valid(c, s, a, b):
    """Regression: the holder once went straight into ``worker.state.actors`` without a task of
    that key, breaking the WorkerState invariant "every key in ``actors`` is in ``tasks``". It
    is now a real actor task, submitted by the plugin's own client."""
    await install(c, s, [a, b])
    assert holder_of(a) is not None
    for w in (a, b):
        w.state.validate_state()


# --- handlers -----------------------------------------------------------------------------------


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_deployment_handlers(c, s, a, b):
    plugin = await install(c, s, [a, b])
    model = spec(seed=1)
    fields = deploy_fields(POLICY, model)
    status = await c.scheduler.plexrl_deploy(**fields)
    assert status["status"] == "OK" and status["created"] is True
    info = status["deployment"]
    assert info["name"] == POLICY and info["uid"] == fields["uid"]
    assert info["role"] == "train" and info["backend"] == "torch" and info["owner"] == "test-job"
    assert info["memory_bytes"] == model.memory_bytes("train")
    assert info["state"] == "placed" and info["modified"] is False
    assert ModelSpec.from_dict(info["spec"]) == model
    assert len(info["workers"]) == 1 and info["workers"][0] in {a.address, b.address}

    got = await c.scheduler.plexrl_get_deployment(name=POLICY)
    assert got == {"status": "OK", "deployment": info}
    listed = await c.scheduler.plexrl_list_deployments()
    assert listed["status"] == "OK" and list(listed["deployments"]) == [info]

    # A duplicate name fails with DeploymentExists...
    dup = await c.scheduler.plexrl_deploy(**deploy_fields(POLICY, model))
    assert dup["status"] == "error" and dup["error"] == "DeploymentExists"
    assert isinstance(errors.from_status(dup), errors.DeploymentExists)
    assert repr(POLICY) in dup["message"]
    # ...unless exist_ok and the same spec: then the existing one comes back, not created.
    same = await c.scheduler.plexrl_deploy(**deploy_fields(POLICY, model, exist_ok=True))
    assert same["status"] == "OK" and same["created"] is False
    assert same["deployment"] == info
    # exist_ok with a different model is still a conflict.
    other = await c.scheduler.plexrl_deploy(**deploy_fields(POLICY, spec(seed=2), exist_ok=True))
    assert other["error"] == "DeploymentExists"
    other_role = await c.scheduler.plexrl_deploy(
        **deploy_fields(POLICY, model, exist_ok=True, role="rollout")
    )
    assert other_role["error"] == "DeploymentExists"

    # Bad input comes back as a typed error status, not an exception in the handler.
    bad = await c.scheduler.plexrl_deploy(**deploy_fields("has/slash@test-job", model))
    assert bad["status"] == "error" and isinstance(errors.from_status(bad), errors.ConfigError)

    # Each field is checked by the handler, whatever the client checked.
    for field, value in (
        ("memory_bytes", -1), ("world_size", "2"), ("replicas", None), ("vocab_size", 1.5),
        ("spec", {"nope": 1}), ("spec", "tiny"), ("candidates", "tcp://a:1"), ("uid", 7),
    ):  # fmt: skip
        bad_fields = {**deploy_fields("bad-field@test-job", model), field: value}
        bad = await c.scheduler.plexrl_deploy(**bad_fields)
        assert isinstance(errors.from_status(bad), errors.ConfigError), (field, bad)
    assert "bad-field@test-job" not in plugin.deployments

    # A second deployment goes to the other (less committed) worker.
    second = (await deploy(c, VALUE, spec(seed=3)))["deployment"]
    assert second["workers"] != info["workers"]
    assert plugin.counters["deploys"] == 2
    # Two deploys of one name at once: one is made, the other refused.
    racing = await asyncio.gather(
        *(c.scheduler.plexrl_deploy(**deploy_fields("racer@test-job", model)) for _ in range(2))
    )
    assert sorted(r["status"] for r in racing) == ["OK", "error"]
    await c.scheduler.plexrl_undeploy(name="racer@test-job", job="test-job", secret=TEST_JOB["secret"])

    missing = await c.scheduler.plexrl_get_deployment(name="nope")
    assert missing["error"] == "DeploymentNotFound"
    e = errors.from_status(missing)
    assert isinstance(e, errors.DeploymentNotFound) and "'nope'" in str(e)

    # Undeploy: unknown name, and a stale uid, are not found; then the real one.
    assert (
        await c.scheduler.plexrl_undeploy(name="nope", job="test-job", secret=TEST_JOB["secret"])
    )["error"] == "DeploymentNotFound"
    stale = await c.scheduler.plexrl_undeploy(
        name=POLICY, uid="not-the-uid", job="test-job", secret=TEST_JOB["secret"]
    )
    assert stale["error"] == "DeploymentNotFound"
    assert (await c.scheduler.plexrl_get_deployment(name=POLICY))["status"] == "OK"
    assert await c.scheduler.plexrl_undeploy(
        name=POLICY, uid=fields["uid"], job="test-job", secret=TEST_JOB["secret"]
    ) == {"status": "OK"}
    assert (await c.scheduler.plexrl_get_deployment(name=POLICY))["error"] == "DeploymentNotFound"
    listed = await c.scheduler.plexrl_list_deployments()
    assert [d["name"] for d in listed["deployments"]] == [VALUE]
    assert await c.scheduler.plexrl_undeploy(
        name=VALUE, job="test-job", secret=TEST_JOB["secret"]
    ) == {"status": "OK"}
    assert list((await c.scheduler.plexrl_list_deployments())["deployments"]) == []


_QUICK_HOLDERS = copy.deepcopy(_PLEXRL)
_QUICK_HOLDERS["deploy"]["holder-wait"] = "0.3s"


@gen_cluster(
    client=True,
    nthreads=TWO_GPU_WORKERS,
    worker_kwargs=GPU,
    config={"plexrl": _QUICK_HOLDERS},
    timeout=60,
)
async def test_undeploy_does_not_wait_on_a_holder_busy_with_a_request(c, s, a, b):
    """A holder running a request (another job's, say) drops a replica when the request
    ends; the owner's undeploy answers within plexrl.deploy.holder-wait meanwhile, saying
    which workers have yet to drop it."""
    await install(c, s, [a, b])
    (placed,) = (await deploy(c, POLICY))["deployment"]["workers"]
    await asyncio.wait_for(submit_routed(c, POLICY), WAIT_S)  # built on its worker
    holder = holder_of(a if placed == a.address else b)
    assert holder.names() == [POLICY]
    loop = asyncio.get_running_loop()
    owner = {"job": "test-job", "secret": TEST_JOB["secret"]}
    holder._lock.acquire()  # (what a running request holds)
    try:
        t0 = loop.time()  # (offload tells the holders the same way: _tell_holders)
        gone = await c.scheduler.plexrl_undeploy(name=POLICY, **owner)
        assert gone["status"] == "OK" and list(gone["dropping"]) == [placed]
        assert loop.time() - t0 < 10
        assert (await c.scheduler.plexrl_get_deployment(name=POLICY))["status"] == "error"
    finally:
        holder._lock.release()
    await until(lambda: holder.names() == [], "the replica dropped once the request ended")


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_deployment_larger_than_every_budget_does_not_fit(c, s, a, b):
    await install(c, s, [a, b])
    budget = holder_of(a).budget_bytes
    status = await c.scheduler.plexrl_deploy(
        **deploy_fields("huge", spec(), memory_bytes=budget + 1)
    )
    assert status["error"] == "DeploymentDoesNotFit"
    assert "MiB" in status["message"]
    assert list((await c.scheduler.plexrl_list_deployments())["deployments"]) == []


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_deploy_candidates_pin_the_placement(c, s, a, b):
    await install(c, s, [a, b])
    # Both workers are empty: unpinned, the address breaks the tie; pin the other one.
    first, second = sorted([a.address, b.address])
    unpinned = (await deploy(c, unique("free")))["deployment"]
    assert list(unpinned["workers"]) == [first]
    pinned = (await deploy(c, unique("pinned"), candidates=[first]))["deployment"]
    assert list(pinned["workers"]) == [first]  # although `second` is now less committed
    unknown = await c.scheduler.plexrl_deploy(
        **deploy_fields("nowhere", spec(), candidates=["tcp://127.0.0.1:1"])
    )
    assert unknown["error"] == "NoPlexRLWorkers" and "tcp://127.0.0.1:1" in unknown["message"]
    names = {d["name"] for d in (await c.scheduler.plexrl_list_deployments())["deployments"]}
    assert "nowhere" not in names and len(names) == 2
    # Unpinned, the next deployment goes to the emptier worker again.
    assert list((await deploy(c, unique("free")))["deployment"]["workers"]) == [second]


_SHORT_WAIT = copy.deepcopy(_PLEXRL)
_SHORT_WAIT["deploy"]["worker-report-timeout"] = "0.3s"


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1)],
    config={"plexrl": _SHORT_WAIT},
    timeout=60,
)
async def test_deploy_without_gpu_workers_fails(c, s, plain):
    plugin = await register(c, s)
    status = await c.scheduler.plexrl_deploy(**deploy_fields(POLICY, spec()))
    assert status["error"] == "NoPlexRLWorkers"
    assert isinstance(errors.from_status(status), errors.NoPlexRLWorkers)
    assert plugin.deployments == {} and plugin.worker_capacity == {}
    assert holder_of(plain) is None


# --- routing ------------------------------------------------------------------------------------


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_annotated_task_is_routed_to_the_deployment_worker(c, s, a, b):
    plugin = await install(c, s, [a, b])
    info = (await deploy(c, POLICY))["deployment"]
    (placed,) = info["workers"]
    target, other = (a, b) if placed == a.address else (b, a)

    fut = submit_routed(c, POLICY)
    ts = await scheduler_task(s, fut)
    assert ts.worker_restrictions == {placed}
    assert ts.resource_restrictions == {"GPU": 1}
    assert not ts.loose_restrictions
    ann = ts.annotations["plexrl"]
    assert ann["uid"] == info["uid"] and ann["worker"] == placed and "error" not in ann

    result = await asyncio.wait_for(fut, WAIT_S)
    assert result["version"] == 0 and result["device"] == "cpu" and result["bytes"] > 0
    assert {ws.address for ws in ts.who_has} == {placed}
    assert holder_of(target).names() == [POLICY]
    assert holder_of(other).names() == []
    # The holder's residency report reaches the plugin's map.
    await until(lambda: plugin.residency.tier(POLICY, placed) == "hbm", "residency report")
    assert plugin.residency.get(POLICY, placed).uid == info["uid"]

    # Every later request of the deployment goes to the same worker, and shares its replica.
    futs = [submit_routed(c, POLICY) for _ in range(3)]
    await asyncio.wait_for(c.gather(futs), WAIT_S)
    assert all(s.tasks[f.key].worker_restrictions == {placed} for f in futs)
    assert holder_of(target).status()["counters"]["loads"] == 1
    assert plugin.counters["routed"] == 4

    # Undeploy frees the replica on its worker.
    assert await c.scheduler.plexrl_undeploy(
        name=POLICY, job="test-job", secret=TEST_JOB["secret"]
    ) == {"status": "OK"}
    await until(lambda: holder_of(target).names() == [], "the replica to be dropped")
    assert plugin.residency.tier(POLICY, placed) == "absent"


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_a_request_id_of_another_job_is_refused_and_its_request_kept(c, s, a, b):
    """Request ids are the caller's to choose: a job that sends another job's id (read from
    the queue's view) gets NotRouted, and the queued request keeps its ranks and its job."""
    plugin = await install(c, s, [a, b])
    await deploy(c, POLICY, world_size=2)
    ann = {"deployment": POLICY, "job": "test-job", "secret": TEST_JOB["secret"], "op": "load"}
    with dask.annotate(plexrl={**ann, "request": "shared-id", "ranks": 2, "rank": 0}):
        first = c.submit(ops.load, POLICY, pure=False)  # (rank 1 never comes: it stays queued)
    await until(lambda: plugin.requests.get("shared-id") is not None, "the request queued")
    secret = plugin.principals.register("other-job")
    other = {"job": "other-job", "owner": "other-job", "secret": secret}
    await deploy(c, "mine@other-job", **other)
    theirs = {"deployment": "mine@other-job", "job": "other-job", "secret": secret}
    for extra in ({"request": "shared-id"}, {"request": "shared-id", "ranks": 2, "rank": 1}):
        with dask.annotate(plexrl={**theirs, "op": "load", **extra}):
            fut = c.submit(ops.load, "mine@other-job", pure=False)
        with pytest.raises(errors.NotRouted):
            await asyncio.wait_for(fut, WAIT_S)
    # the same job's own id for another deployment's call, or a rank it already has: refused
    for extra in ({"rank": 0}, {"ranks": 1, "rank": 0}, {"rank": "one"}):
        with dask.annotate(plexrl={**ann, "request": "shared-id", "ranks": 2, **extra}):
            fut = c.submit(ops.load, POLICY, pure=False)
        with pytest.raises(errors.NotRouted):
            await asyncio.wait_for(fut, WAIT_S)
    queued = plugin.requests.get("shared-id")
    assert queued.job == "test-job" and queued.keys == {0: first.key}
    await first.cancel()
    await until(lambda: plugin.requests.get("shared-id") is None, "the request dropped")
    assert holder_of(a).names() == [] and holder_of(b).names() == []


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_what_runs_must_be_the_op_routed_and_scheduler_fields_are_the_schedulers(c, s, a, b):
    """Access is checked against the op an annotation names, so the worker runs only that op
    (a request labelled "forward" that would load a checkpoint is refused); the fields only
    the scheduler writes (the stored state a request may read, the uid, ...) are dropped
    from what a client sends."""
    await install(c, s, [a, b])
    await deploy(c, POLICY)
    ann = {"deployment": POLICY, "job": "test-job", "secret": TEST_JOB["secret"]}
    with dask.annotate(plexrl={**ann, "op": "forward"}):
        fut = c.submit(ops.load, POLICY, pure=False)
    with pytest.raises(errors.NotRouted, match="routed as 'forward'"):
        await asyncio.wait_for(fut, WAIT_S)
    forged = {"readable": ["other@other-job"], "uid": "forged", "worker": "tcp://x:1"}
    with dask.annotate(plexrl={**ann, "op": "load", **forged}):
        fut = c.submit(ops.load, POLICY, pure=False)
    assert (await asyncio.wait_for(fut, WAIT_S))["version"] == 0
    routed = s.tasks[fut.key].annotations["plexrl"]
    assert "readable" not in routed and routed["uid"] != "forged"
    assert routed["worker"] in (a.address, b.address)


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_plain_tasks_are_not_touched(c, s, a, b):
    plugin = await install(c, s, [a, b])
    await deploy(c, POLICY)
    fut = c.submit(inc, 1)
    ts = await scheduler_task(s, fut)
    assert not ts.worker_restrictions
    assert not ts.resource_restrictions
    assert "plexrl" not in (ts.annotations or {})
    assert await asyncio.wait_for(fut, WAIT_S) == 2
    # Other annotations pass through without PlexRL routing either.
    with dask.annotate(priority=5):
        fut2 = c.submit(inc, 2, pure=False)
    assert await asyncio.wait_for(fut2, WAIT_S) == 3
    ts2 = s.tasks[fut2.key]
    assert not ts2.worker_restrictions and not ts2.resource_restrictions
    assert plugin.counters["routed"] == 0 and plugin.counters["routing_errors"] == 0


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_annotated_task_for_unknown_deployment_fails_typed(c, s, a, b):
    plugin = await install(c, s, [a, b])
    fut = submit_routed(c, "ghost")
    with pytest.raises(errors.DeploymentNotFound, match="ghost"):
        await asyncio.wait_for(fut, WAIT_S)
    ts = s.tasks[fut.key]
    assert not ts.worker_restrictions and not ts.resource_restrictions
    assert ts.annotations["plexrl"]["error"]["error"] == "DeploymentNotFound"
    assert plugin.counters["routing_errors"] == 1
    # No replica was built anywhere.
    assert holder_of(a).names() == [] and holder_of(b).names() == []


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_unannotated_op_fails_not_routed(c, s, a, b):
    await install(c, s, [a, b])
    await deploy(c, POLICY)
    fut = c.submit(ops.load, POLICY, pure=False)
    with pytest.raises(errors.NotRouted, match="dask.annotate"):
        await asyncio.wait_for(fut, WAIT_S)
    # Annotated for another deployment than the one it addresses: also not routed.
    with dask.annotate(
        plexrl={"deployment": POLICY, "job": "test-job", "secret": TEST_JOB["secret"]}
    ):
        fut2 = c.submit(ops.load, "other", pure=False)
    with pytest.raises(errors.NotRouted):
        await asyncio.wait_for(fut2, WAIT_S)
    # Nothing was loaded by the failed requests.
    assert holder_of(a).names() == [] and holder_of(b).names() == []


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_annotated_op_without_the_plugin_fails_not_routed(c, s, a, b):
    fut = submit_routed(c, POLICY)
    with pytest.raises(errors.NotRouted, match="plugin is not installed"):
        await asyncio.wait_for(fut, WAIT_S)


def test_a_runtime_on_a_scheduler_without_the_plugins_says_to_install_them(capsys):
    from plexrl_dask.cli import main as cli_main

    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        runtime = plexrl_dask.Runtime(client, job="no-plugins")
        for call in (runtime.status, runtime.deployments, lambda: runtime.deployment("x")):
            with pytest.raises(errors.PluginsNotInstalled, match="install the PlexRL plugins"):
                call()
        assert cli_main(["status", "--scheduler", cluster.scheduler_address]) == 2
        assert "PluginsNotInstalled" in capsys.readouterr().err  # (errors on stderr)


# --- parking ------------------------------------------------------------------------------------


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1, GPU), ("127.0.0.1", 1)],
    config=CONFIG,
    timeout=60,
)
async def test_request_without_gpu_workers_is_parked_then_rerouted(c, s, gpu, plain):
    """Regression test of parking: a request for a registered deployment while the cluster has
    no GPU worker must wait in ``no-worker`` (not run on the plain worker, not fail), and run
    once a GPU worker joins."""
    plugin = await install(c, s, [gpu])
    info = (await deploy(c, POLICY))["deployment"]
    assert list(info["workers"]) == [gpu.address]

    # The only GPU worker leaves: the cluster now has a worker, but no GPU worker.
    await gpu.close()
    await until(lambda: gpu.address not in s.workers, "the GPU worker to leave")
    await until(
        lambda: plugin.deployments[POLICY].state == "unplaced", "the deployment to be unplaced"
    )
    assert plugin.worker_capacity == {}
    assert list(s.workers) == [plain.address]

    fut = submit_routed(c, POLICY)
    ts = await scheduler_task(s, fut)
    await until(lambda: ts.state == "no-worker", "the request to be parked")
    assert ts.worker_restrictions == {PARKED}
    assert not ts.loose_restrictions
    # It stays parked (a bounded wait; nothing else can place it).
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(fut), 0.5)
    assert ts.state == "no-worker" and not fut.done()
    assert ts.processing_on is None

    # A GPU worker joins: the deployment is placed on it and the parked request runs there.
    async with Worker(s.address, nthreads=1, **GPU) as fresh:
        result = await asyncio.wait_for(fut, WAIT_S)
        assert result["version"] == 0
        assert ts.worker_restrictions == {fresh.address}
        assert plugin.deployments[POLICY].workers == (fresh.address,)
        assert plugin.deployments[POLICY].state == "placed"
        assert plugin.counters["replacements"] == 1
        assert holder_of(fresh).names() == [POLICY]
        assert holder_of(plain) is None
        del fut


# --- installing on a running cluster -------------------------------------------------------------


async def _block_event_loop(marker: str, seconds: float) -> None:
    """Run by ``client.run`` on a worker's event loop: say so, then keep the loop busy (a
    blocking sleep inside a coroutine blocks the loop that runs it)."""
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=TWO_GPU_WORKERS,
    worker_kwargs=GPU,
    config=CONFIG,
    timeout=90,
)
async def test_registering_on_a_running_cluster_hears_every_worker(c, s, a, b, tmp_path):
    """Regression (plugins/scheduler.py, ``start``): ``register_scheduler_plugin`` awaits
    ``plugin.start()`` *before* adding the plugin to ``scheduler.plugins``, and ``start`` awaits
    the worker-plugin broadcast. A worker whose holder reports its capacity (a worker event)
    while the broadcast still waits for a slower worker reports to a scheduler on which the
    plugin is not yet installed: the report is dropped, and that worker is never used.

    Made deterministic here by keeping one worker's event loop busy during the broadcast; in
    practice fresh worker processes importing torch at different speeds do the same."""
    workers = [a.worker_address, b.worker_address]
    # Imports done up front, so only the blocked loop makes a difference.
    await c.run(importlib.import_module, "plexrl_dask.plugins")
    marker = str(tmp_path / "blocked")
    await c.run(_block_event_loop, marker, 3.0, workers=[workers[1]], wait=False)
    await until(lambda: os.path.exists(marker), "the second worker's loop to be busy")

    await c.register_plugin(PlexRLSchedulerPlugin())
    plugin = s.plugins[PlexRLSchedulerPlugin.name]
    # Both workers did log their capacity...
    await until(
        lambda: {e[1].get("worker") for e in s.get_events("plexrl-worker")} == set(workers),
        "both capacity events to be logged",
    )
    # ...and both must reach the plugin.
    await until(
        lambda: set(plugin.worker_capacity) == set(workers),
        f"capacity of both workers in the plugin (has {sorted(plugin.worker_capacity)})",
        timeout=5.0,
    )


def test_install_on_a_running_cluster():
    """``plexrl_dask.install(client)`` installs the plugins on a cluster started without them
    (idempotently). Regression (plexrl_dask/cluster.py, ``install``): it passes ``idempotent=True`` to
    ``Client.register_plugin``, which distributed 2026.8 does not accept (TypeError)."""
    with (
        dask.config.set(CONFIG),
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=False,
            resources={"GPU": 1},
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):

        def capacity(dask_scheduler=None):
            plugin = dask_scheduler.plugins.get("plexrl")
            return None if plugin is None else sorted(plugin.worker_capacity)

        plexrl_dask.install(client)
        deadline = time.monotonic() + WAIT_S
        while client.run_on_scheduler(capacity) != list(cluster.scheduler_info["workers"]):
            assert time.monotonic() < deadline, "the worker never reported its capacity"
            time.sleep(0.05)
        plexrl_dask.install(client)  # idempotent
        assert client.run_on_scheduler(capacity) == list(cluster.scheduler_info["workers"])


class _TransitionLog(SchedulerPluginBase):
    """Records every transition of every key, in order."""

    name = "test-transition-log"

    def __init__(self) -> None:
        self.log: dict = {}

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        self.log.setdefault(key, []).append((start, finish))


@gen_cluster(client=True, nthreads=TWO_GPU_WORKERS, worker_kwargs=GPU, config=CONFIG, timeout=60)
async def test_a_plexrl_task_is_parked_before_dask_first_places_it(c, s, a, b):
    """The mechanism's assumption about Dask: ``update_graph`` plugins run before the new
    tasks' first transitions, so a PlexRL task goes waiting -> no-worker (parked) and reaches
    ``processing`` only when the plugin releases it, never straight from ``waiting``."""
    plugin = await install(c, s, [a, b])
    await deploy(c, POLICY)
    log = _TransitionLog()
    s.add_plugin(log)
    futs = [submit_routed(c, POLICY) for _ in range(3)]
    plain = c.submit(inc, 1)
    await asyncio.wait_for(c.gather([*futs, plain]), WAIT_S)
    for fut in futs:
        path = log.log[fut.key]
        assert ("waiting", "processing") not in path, path
        first_placement = next(f for start, f in path if start == "waiting" and f != "waiting")
        assert first_placement == "no-worker", path
        assert path.index(("no-worker", "processing")) > path.index(("waiting", "no-worker"))
    # A plain task in the same graph stream is placed by Dask as usual.
    assert ("waiting", "processing") in log.log[plain.key]
    assert plugin.counters["dispatched"] == 3


def test_worker_profile_interval_is_positive_or_null():
    from plexrl_dask.config import WorkerConfig

    with dask.config.set({"plexrl.worker.profile-interval": "250ms"}):
        assert WorkerConfig.from_dask_config().profile_interval_s == 0.25
    with dask.config.set({"plexrl.worker.profile-interval": None}):
        assert WorkerConfig.from_dask_config().profile_interval_s is None
    with (
        dask.config.set({"plexrl.worker.profile-interval": "0s"}),
        pytest.raises(errors.ConfigError, match="profile-interval"),
    ):
        WorkerConfig.from_dask_config()


def test_a_gpu_worker_process_keeps_what_it_started_with_out_of_full_collections(client):
    """A worker with a nanny (a process of its own) freezes what exists once the plugin set
    it up (Dask's worker, torch, the store): a full garbage collection walks only what
    requests made since."""
    import gc

    counts = client.run(gc.get_freeze_count)
    assert counts and all(n > 10_000 for n in counts.values()), counts


def test_a_gpu_worker_process_encodes_prompts_on_its_own_threads(client):
    """Tokenizers' pool is off in a worker (plexrl_dask.worker.device.fix_threads): its
    threads would spin beside the worker's fixed torch threads."""
    import os

    values = client.run(lambda: os.environ.get("TOKENIZERS_PARALLELISM"))
    assert values and set(values.values()) == {"false"}, values
