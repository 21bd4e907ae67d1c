"""The runtime's state moves through the node's state store, on a real process cluster:
checkpoints are durable store versions, weight sync goes through the DRAM tier, offloaded
replicas of a node share one stored copy, and the scheduler hears where the manager put them."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import dask
import torch

import plexrl_dask as plexrl
from plexrl_dask.cluster import worker_process
from plexrl_dask.state_store.keys import derived_model
from plexrl_dask.state_store.node import NodeState
from tests.conftest import node_state, tiny_spec, unique

WAIT_S = 30.0


def node_of(cluster) -> NodeState:
    return node_state(cluster.plexrl_state)


def batch(dep, n: int = 4) -> list[plexrl.Datum]:
    return [plexrl.Datum(tokens=dep.tokenize(f"{i}+{i * 2}={3 * i}")) for i in range(n)]


def weights_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_sync_weights_goes_through_the_dram_tier_and_skips_unchanged_bytes(cluster, runtime):
    node = node_of(cluster)
    trainer = runtime.deploy(unique("route-train"), tiny_spec(seed=31), world_size=2)
    rollout = runtime.deploy(unique("route-roll"), tiny_spec(seed=32), role="rollout", replicas=2)
    assert runtime.nodes_of(*trainer.info.workers, *rollout.info.workers) == {
        node.call("hello")["node"]
    }
    plexrl.result([trainer.forward_backward(batch(trainer)), trainer.optim_step()])
    assert plexrl.result(runtime.sync_weights(trainer, rollout)) == 1

    model = derived_model("weights", trainer.name)
    dram = node.store("dram")
    versions = dram.versions(model)
    assert len(versions) == 1  # the trainer's ranks published one version, in the DRAM tier
    manifest = dram.manifest(model, versions[0])
    want = plexrl.result(trainer.get_weights()).tensors
    assert manifest.meta["version"] == 1 and set(manifest.tensors) == {f"model/{n}" for n in want}
    assert all(torch.equal(dram.read(model, versions[0], f"model/{n}"), t) for n, t in want.items())
    got = plexrl.result(rollout.get_weights()).tensors
    assert weights_equal(got, want)

    # Nothing changed since: a second sync stores no new bytes (every chunk deduplicated);
    # the version before it stays (a replica's load of it may still be queued), and goes
    # with the next publish.
    used = node.status()["tiers"]["dram"]["used"]
    written_before = dram.stats.bytes_written
    assert plexrl.result(runtime.sync_weights(trainer, rollout)) == 1
    assert dram.versions(model)[0] == versions[0] and len(dram.versions(model)) == 2
    assert plexrl.result(runtime.sync_weights(trainer, rollout)) == 1
    assert versions[0] not in dram.versions(model) and len(dram.versions(model)) == 2
    assert node.status()["tiers"]["dram"]["used"] <= used
    assert dram.stats.bytes_written == written_before
    node.close()


def test_a_checkpoint_is_a_durable_nvme_version_and_survives_the_manager(cluster, runtime):
    node = node_of(cluster)
    spec = tiny_spec(seed=33)
    src = runtime.deploy(unique("route-ckpt"), spec, world_size=2)
    data = batch(src)
    opt = plexrl.AdamWParams(lr=1e-2)
    plexrl.result([src.forward_backward(data), src.optim_step(opt)])
    saved = plexrl.result(src.save_state())
    assert saved["format"] == "store" and saved["version"] == 1
    nvme = node.store("nvme")
    assert saved["path"] == str(nvme.root) and nvme.versions(saved["model"]) == [1]
    manifest = nvme.manifest(saved["model"], 1)
    assert manifest.meta["has_optimizer"] and any(n.startswith("optim/") for n in manifest.tensors)

    # The node's manager dies; the checkpoint is files on disk: a new deployment (another
    # layout) loads it through the next manager, and trains on exactly like the source.
    os.kill(node.call("hello")["pid"], signal.SIGKILL)
    dst = runtime.deploy(unique("route-restore"), spec, world_size=1)
    assert plexrl.result(dst.load_state(saved)) == 1
    assert weights_equal(
        plexrl.result(dst.get_weights()).tensors, plexrl.result(src.get_weights()).tensors
    )
    plexrl.result([src.forward_backward(data), src.optim_step(opt)])
    plexrl.result([dst.forward_backward(data), dst.optim_step(opt)])
    a, b = plexrl.result(src.get_weights()).tensors, plexrl.result(dst.get_weights()).tensors
    assert max(float((a[n] - b[n]).abs().max()) for n in a) <= 1e-6  # FSDP(2) vs 1 rank
    node.close()


def test_replicas_on_one_node_share_one_stored_copy_and_tiers_are_reported(cluster, runtime):
    node = node_of(cluster)
    dep = runtime.deploy(unique("route-share"), tiny_spec(seed=34), role="rollout", replicas=2)
    # weights of their own (an unmodified replica reads its worker's shared copy of the spec's
    # model and stores nothing when offloaded)
    plexrl.result(dep.set_weights(dep.get_weights()))
    workers = dep.info.workers
    assert len(set(workers)) == 2
    probe = [plexrl.Datum(tokens=dep.tokenize("7+8=15"))]
    for replica in range(2):
        with dask.annotate(plexrl=dep.annotation(replica=replica)):
            fut = runtime.client.submit(plexrl.ops.forward, dep.name, probe, pure=False)
        plexrl.result(fut)
    used = node.status()["tiers"]["dram"]["used"]
    assert dep.offload() == {w: True for w in workers}
    stored = []
    for w in workers:
        holder = runtime.holder(w)
        stored.append(holder.status().result(timeout=WAIT_S)["replicas"][dep.name]["stored_as"])
    assert stored[0] != stored[1]  # one version per replica...
    dram = node.status()["tiers"]["dram"]
    nbytes = dep.info.spec.memory_bytes("rollout")
    assert dram["used"] - used <= nbytes * 1.05  # ...and one copy of the bytes
    mine = [v for v in dram["versions"] if f"{v['model']}/{v['version']}" in stored]
    assert len(mine) == 2 and all(v["bytes"] >= nbytes for v in mine)

    # The manager evicts one to NVMe: its worker re-reports the tier to the scheduler.
    model, version = stored[0].rsplit("/", 1)
    assert node.evict(model, int(version))
    deadline = time.monotonic() + WAIT_S
    while True:
        tiers = {
            r["worker"]: r["tier"]
            for r in runtime.status()["residency"]
            if r["deployment"] == dep.name
        }
        if tiers.get(workers[0]) == "nvme" and tiers.get(workers[1]) == "dram":
            break
        assert time.monotonic() < deadline, tiers
        time.sleep(0.2)
    # Both come back bit-identical (one from NVMe).
    out = []
    for replica in range(2):
        with dask.annotate(plexrl=dep.annotation(replica=replica)):
            fut = runtime.client.submit(plexrl.ops.forward, dep.name, probe, pure=False)
        out.append(plexrl.result(fut).logprobs)
    assert out[0] == out[1]
    node.close()


def test_weights_and_checkpoints_cross_nodes_through_the_store(cluster, runtime, tmp_path):
    """A real worker process with its own node tiers ("node-b": another DRAM and NVMe path, as
    on another host) joins the two workers of node A. A trainer with one rank on each node
    publishes through rank 0's node (the other rank sends its shards there); rollout replicas on
    both nodes load it, node B's importing the version once, worker to worker, never through
    the client; a checkpoint written the same way restores onto another two-node layout."""
    here = node_of(cluster)
    b_tiers = {
        "dram-path": str(tmp_path / "b-dram"),
        "nvme-path": str(tmp_path / "b-nvme"),
        "node-id": "node-b",
    }
    worker = worker_process(cluster.scheduler_address, b_tiers)
    node_b = node_state(b_tiers)
    deployed = []
    try:
        deadline = time.monotonic() + 120
        while True:
            known = runtime.status()["workers"]
            b = [w for w, info in known.items() if info.get("node") == "node-b"]
            if b:
                break
            assert time.monotonic() < deadline, "node B's worker never registered its node"
            time.sleep(0.5)
        a = sorted(w for w, info in known.items() if info.get("node") == here.node_id)
        assert len(a) == 2

        def deploy(name, spec, **kw):
            deployed.append(runtime.deploy(unique(name), spec, **kw))
            return deployed[-1]

        spec = tiny_spec(seed=35)
        trainer = deploy("cross-train", spec, world_size=2, workers=[a[0], b[0]])
        roll_a = deploy("cross-roll-a", tiny_spec(seed=36), role="rollout", workers=[a[1]])
        roll_b = deploy("cross-roll-b", tiny_spec(seed=37), role="rollout", workers=b)
        assert runtime.nodes_of(*trainer.info.workers) == {here.node_id, "node-b"}
        home = runtime.status()["workers"][trainer.info.workers[0]]["node"]
        home_node = here if home == here.node_id else node_b
        other = node_b if home_node is here else here
        plexrl.result([trainer.forward_backward(batch(trainer)), trainer.optim_step()])
        want = plexrl.result(trainer.get_weights()).tensors
        for roll in (roll_a, roll_b):
            assert plexrl.result(runtime.sync_weights(trainer, roll)) == 1
            assert weights_equal(plexrl.result(roll.get_weights()).tensors, want)

        model = derived_model("weights", trainer.name)
        *_, version = home_node.store("dram").versions(model)  # the newest (and one before)
        assert len(home_node.store("dram").versions(model)) <= 2
        [imported] = other.store("dram").versions(model)  # imported by the other node
        assert imported == version
        manifest = other.store("dram").manifest(model, version)
        assert manifest.to_json() == home_node.store("dram").manifest(model, version).to_json()
        used = other.status()["tiers"]["dram"]["used"]
        assert used >= sum(e.nbytes for e in manifest.tensors.values())

        # Nothing changed since: the next version shares every object, so nothing new is
        # stored on the importing node; the version before it stays there, as at home.
        roll_other = roll_b if other is node_b else roll_a
        assert plexrl.result(runtime.sync_weights(trainer, roll_other)) == 1
        assert other.store("dram").versions(model)[0] == version
        *_, again = other.store("dram").versions(model)
        assert again != version and len(other.store("dram").versions(model)) == 2
        assert not list((other.dram_path / "imports").glob("*.lock"))  # none left behind
        assert other.status()["tiers"]["dram"]["used"] == used
        assert weights_equal(plexrl.result(roll_other.get_weights()).tensors, want)

        # A checkpoint of the two-node trainer is one version on rank 0's node; another
        # two-node layout (ranks swapped) restores it, its away rank importing it first.
        saved = plexrl.result(trainer.save_state())
        assert saved["node"] == home and home_node.store("nvme").versions(saved["model"]) == [1]
        restored = deploy("cross-restore", spec, world_size=2, workers=[b[0], a[1]])
        assert plexrl.result(restored.load_state(saved)) == 1
        assert weights_equal(plexrl.result(restored.get_weights()).tensors, want)
        assert other.store("nvme").versions(saved["model"]) == [1]
    finally:
        for dep in deployed:
            with contextlib.suppress(Exception):
                runtime.undeploy(dep.name)
        worker.terminate()
        worker.wait(timeout=60)
        with contextlib.suppress(Exception):
            node_b.shutdown()
        here.close()
