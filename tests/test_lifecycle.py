"""Memory budget eviction and worker restarts on a dedicated 1-worker process cluster."""

from __future__ import annotations

import contextlib
import time

import dask
import pytest
import torch
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.state_store.keys import model_key
from plexrl_dask.worker.backends import TorchBackend
from tests.conftest import node_state, tiny_spec, unique

SPEC_A, SPEC_B = tiny_spec(seed=1), tiny_spec(seed=2)


@pytest.fixture(scope="module")
def small_client():
    # Room for one training replica, not two: alternating requests force offload/reload.
    budget = int(SPEC_A.memory_bytes("train") * 1.5)
    with (
        dask.config.set({"plexrl.worker.memory-budget": budget}),
        plexrl.local_cluster(n_workers=1) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client


def test_eviction_and_reload_continue_training_bit_identically(small_client):
    runtime = plexrl.Runtime(small_client, job="evict")
    a = runtime.deploy(unique("evict-a"), SPEC_A)
    b = runtime.deploy(unique("evict-b"), SPEC_B)
    assert a.info.worker == b.info.worker
    data = [plexrl.Datum(tokens=a.tokenize(f"{i}+{i}={2 * i}")) for i in range(4)]
    opt = plexrl.AdamWParams(lr=1e-2)
    for _ in range(3):  # alternate: each request evicts the other deployment
        plexrl.result([a.forward_backward(data), a.optim_step(opt)])
        plexrl.result([b.forward_backward(data), b.optim_step(opt)])

    holder = runtime.holder(a.info.worker).status().result(timeout=30)
    c = holder["counters"]
    assert c["offloads"] >= 4 and c["reloads"] + c["prefetches"] >= 4
    assert holder["resident_bytes"] <= holder["budget_bytes"]
    tiers = {r["deployment"]: r["tier"] for r in runtime.status()["residency"]}
    assert tiers[b.name] == "hbm" and tiers[a.name] == "dram"

    # The same steps in one process without any eviction give the same bits.
    torch.set_num_threads(1)
    for dep, spec in ((a, SPEC_A), (b, SPEC_B)):
        ref = TorchBackend(spec, "cpu")
        for _ in range(3):
            ref.forward_backward(data, plexrl.CrossEntropy())
            ref.optim_step(opt)
        got = plexrl.result(dep.get_weights())
        expected = ref.get_weights()
        assert got.version == 3
        assert all(torch.equal(got.tensors[n], expected[n]) for n in expected), dep.name


def test_a_damaged_offloaded_copy_does_not_block_restoring_a_checkpoint(small_client):
    runtime = plexrl.Runtime(small_client, job="damaged-stash")
    a = runtime.deploy(unique("stash-a"), SPEC_A)
    b = runtime.deploy(unique("stash-b"), SPEC_B)
    data = [plexrl.Datum(tokens=a.tokenize(f"{i}+1={i + 1}")) for i in range(4)]
    opt = plexrl.AdamWParams(lr=1e-2)
    plexrl.result([a.forward_backward(data), a.optim_step(opt)])
    saved = plexrl.result(a.save_state())
    want = plexrl.result(a.get_weights())
    plexrl.result([a.forward_backward(data), a.optim_step(opt)])  # on past the checkpoint
    plexrl.result([b.forward_backward(data), b.optim_step(opt)])  # a is offloaded
    damaged = 0
    with contextlib.closing(node_state(small_client.cluster.plexrl_state)) as node:
        for tier in ("dram", "nvme"):
            store = node.store(tier)
            for model in store.models():
                if not model.startswith(f"stash..{model_key(a.name)}.."):
                    continue
                for version in store.versions(model):
                    for entry in store.manifest(model, version).tensors.values():
                        for digest in entry.chunk_digests.values():
                            path = store.objects.path(digest)
                            path.write_bytes(
                                bytes([path.read_bytes()[0] ^ 0xFF]) + path.read_bytes()[1:]
                            )
                            damaged += 1
    assert damaged
    # what the damaged copy held is gone: the deployment is lost (its job goes back to its
    # checkpoint), not stuck failing every request ...
    with pytest.raises(errors.DeploymentLost, match="does not match its digest"):
        plexrl.result(a.forward(data))
    with pytest.raises(errors.DeploymentLost):
        plexrl.result(a.forward(data))
    # ...but restoring the checkpoint does not need it.
    assert plexrl.result(a.load_state(saved)) == want.version
    got = plexrl.result(a.get_weights())
    assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())
    plexrl.result([a.forward_backward(data), a.optim_step(opt)])  # and it trains on


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_worker_restart_recreates_holder_and_replaces_deployments(small_client):
    runtime = plexrl.Runtime(small_client, job="restart")
    fresh = runtime.deploy(unique("fresh"), SPEC_A, role="rollout")
    trained = runtime.deploy(unique("trained"), SPEC_B)
    data = [plexrl.Datum(tokens=trained.tokenize("4+4=8"))]
    plexrl.result([trained.forward_backward(data), trained.optim_step()])
    params = plexrl.SamplingParams(n=2, max_tokens=6, seed=3)
    before = plexrl.result(fresh.sample(["1+2="], params))
    old = fresh.info.worker
    _wait_for(
        lambda: any(
            r["deployment"] == trained.name and r["modified"] for r in runtime.status()["residency"]
        )
    )

    small_client.restart_workers([old], timeout=120)
    _wait_for(
        lambda: (
            len(plexrl.worker_info(small_client)) == 1
            and old not in plexrl.worker_info(small_client)
        )
    )
    new = next(iter(plexrl.worker_info(small_client)))

    # The restarted worker got a fresh holder (cluster side, not from this client).
    _wait_for(lambda: new in runtime.status()["workers"])
    assert runtime.holder(new).status().result(timeout=30)["replicas"] == {}

    # An unmodified deployment is rebuilt from its spec on the new worker: same samples.
    assert plexrl.result(fresh.sample(["1+2="], params)) == before
    assert runtime.deployment(fresh.name).info.worker == new
    # A trained one cannot be rebuilt: typed error, registry kept, nothing hangs.
    with pytest.raises(errors.DeploymentLost, match="left the cluster"):
        plexrl.result(trained.forward(data))
    runtime.undeploy(trained.name)


@pytest.fixture(scope="module")
def tight_pair():
    # Per worker: room for one 2-rank shard of SPEC_A (6N at rest) or one whole training
    # replica of SPEC_B (16N while it holds gradients), never both at rest (6N + 12N).
    n = SPEC_A.num_parameters()
    with (
        dask.config.set({"plexrl.worker.memory-budget": 17 * n}),
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client


def test_sharded_rank_offload_and_reload_continue_bit_identically(tight_pair):
    runtime = plexrl.Runtime(tight_pair, job="evict-ranks")
    sharded = runtime.deploy(unique("sharded"), SPEC_A, world_size=2)
    w0, w1 = sharded.info.workers
    single = runtime.deploy(unique("single"), SPEC_B, workers=[w0])
    data = [plexrl.Datum(tokens=sharded.tokenize(f"{i}+{i}={2 * i}")) for i in range(4)]
    opt = plexrl.AdamWParams(lr=1e-2)
    for _ in range(3):  # each single step evicts rank 0's shard; each sharded step evicts single
        plexrl.result([sharded.forward_backward(data), sharded.optim_step(opt)])
        plexrl.result([single.forward_backward(data), single.optim_step(opt)])
    counters = runtime.holder(w0).status().result(timeout=30)["counters"]
    # (a reload of `single` may happen early, as a prefetch the scheduler hinted)
    assert counters["offloads"] >= 5 and counters["reloads"] + counters["prefetches"] >= 5
    runtime.undeploy(single.name)

    # The same steps on an identical 2-rank deployment that is never evicted: the same bits.
    twin = runtime.deploy(unique("twin"), SPEC_A, world_size=2, workers=[w0, w1])
    for _ in range(3):
        plexrl.result([twin.forward_backward(data), twin.optim_step(opt)])
    got, want = plexrl.result([sharded.get_weights(), twin.get_weights()])
    assert got.version == want.version == 3
    assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())


def test_a_replica_is_held_to_the_budget_by_what_it_measures_not_what_it_declared(small_client):
    import uuid

    from plexrl_dask import protocol
    from plexrl_dask.driver.deployment import Deployment
    from plexrl_dask.shared.records import DeploymentInfo

    runtime = plexrl.Runtime(small_client, job="declared")
    honest = runtime.deploy(unique("honest"), SPEC_A, role="rollout")  # (the holder is up)
    worker = honest.info.worker
    big = plexrl.ModelSpec.tiny(hidden_size=128, num_layers=2, seed=5)
    holder = runtime.holder(worker).status().result(timeout=30)
    assert big.memory_bytes("rollout") > holder["budget_bytes"]
    hf, name = big.hf_config(), f"{unique('understated')}@{runtime.job}"
    # Registered around the driver, declaring 1 KiB for a replica of a few MiB.
    status = runtime._call(
        protocol.DEPLOY,
        name=name,
        uid=uuid.uuid4().hex,
        spec=big.to_dict(),
        role="rollout",
        backend="torch",
        owner=runtime.job,
        job=runtime.job,
        memory_bytes=1024,
        exist_ok=False,
        candidates=None,
        world_size=1,
        replicas=1,
        vocab_size=int(hf.vocab_size),
        max_positions=int(hf.max_position_embeddings),
    )
    understated = Deployment(runtime, DeploymentInfo.from_dict(status["deployment"]))
    with pytest.raises(errors.DeploymentDoesNotFit, match="declared"):
        plexrl.result(understated.load())
    runtime.undeploy(name)
    holder = runtime.holder(worker).status().result(timeout=30)
    assert name not in holder["replicas"]
    assert holder["resident_bytes"] <= holder["budget_bytes"]
    # The worker serves an honest deployment as before.
    assert plexrl.result(honest.sample(["1+1="], plexrl.SamplingParams(max_tokens=2))).sequences
