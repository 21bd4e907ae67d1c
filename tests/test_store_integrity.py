"""What stored state survives: manifests from elsewhere, deletions while read, writers that
disagree, crashed deletions, accounting under concurrent writes, damaged job checkpoints and
failed exports. Each test is a defect found in review, kept fixed."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.rl.job_checkpoint import read_checkpoint, read_steps
from plexrl_dask.serve.checkpoints import Checkpoint, SavedCheckpoints, write_export
from plexrl_dask.serve.state import ServeState
from plexrl_dask.state_store import peer
from plexrl_dask.state_store.keys import Manifest, TensorEntry
from plexrl_dask.state_store.manager import ManagerConfig
from plexrl_dask.state_store.objects import digest_of
from plexrl_dask.state_store.store import StateStore
from plexrl_dask.state_store.tiers import CLIENTS_DIR, TierManager
from plexrl_dask.worker.stores import checked_checkpoint


def tier_manager(tmp_path: Path) -> TierManager:
    return TierManager(
        ManagerConfig(str(tmp_path / "dram"), str(tmp_path / "nvme"), 1 << 30, None, "n1")
    )


# --- manifests that come from another process ----------------------------------------------


def test_an_imported_manifest_names_no_path_outside_the_store(tmp_path):
    """A peer's manifest whose tensor name or chunk digest is a path is refused before any of
    it names a file: nothing is written or touched outside the store, nothing published."""
    store = StateStore(tmp_path / "st", create=True, durable=False)
    data = np.arange(4, dtype=np.float32).tobytes()
    good = digest_of(data)
    victim = tmp_path / "victim.txt"
    victim.write_text("x")
    os.utime(victim, (0, 0))
    hostile = {
        "name": {
            "../../../escaped/arr": TensorEntry(
                "../../../escaped/arr", (4,), "float32", (4,), {"c/0": good}
            )
        },
        "digest": {"t": TensorEntry("t", (1,), "float32", (1,), {"c/0": "../victim.txt"})},
        "grid": {"t": TensorEntry("t", (8,), "float32", (4,), {"c/0": good})},
        "dtype": {"t": TensorEntry("t", (4,), "complex64", (4,), {"c/0": good})},
    }
    for what, tensors in hostile.items():
        manifest = Manifest.from_json(Manifest("m", 1, tensors).to_json())
        with pytest.raises(errors.CorruptState):
            store.import_version(manifest, lambda ds: dict.fromkeys(ds, data))
        assert store.versions("m") == [], what
    assert not (tmp_path / "escaped").exists()
    assert os.stat(victim).st_mtime == 0
    with pytest.raises(errors.CorruptState, match="asked for"):  # (another version than asked)
        Manifest("m", 2, {}).check("m", 1)
    ok = Manifest("m", 1, {"t": TensorEntry("t", (4,), "float32", (4,), {"c/0": good})})
    assert store.import_version(ok, lambda ds: dict.fromkeys(ds, data)) == len(data)
    assert store.read("m", 1, "t").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_an_import_of_a_malformed_model_name_touches_nothing(tmp_path):
    """``pull_version`` checks the model and version before they name its lock file."""
    victim = tmp_path / "keep" / "data@3.lock"
    victim.parent.mkdir()
    victim.write_text("precious")
    node = SimpleNamespace(
        dram_path=tmp_path / "dram", node_id="n1", cfg=SimpleNamespace(transfer_timeout_s=5.0)
    )
    for model in ("../../keep/data", "../../made/by/peer/x"):
        with pytest.raises(errors.InvalidStateKey):
            peer.pull_version(node, None, "tcp://127.0.0.1:1", model, 3)
    assert victim.read_text() == "precious"
    assert not (tmp_path / "made").exists() and not (tmp_path / "dram").exists()


def test_a_checkpoint_with_a_source_names_its_model_and_version():
    """Ranks off a checkpoint's node import ``model``@``version`` from its source: one that
    lacks them is refused on every rank alike (typed), not with a KeyError on some."""
    with pytest.raises(errors.CheckpointError, match="model and version"):
        checked_checkpoint({"path": "/x/state", "node": "other", "source": "tcp://127.0.0.1:1"})
    with pytest.raises(errors.CheckpointError, match="model and version"):
        checked_checkpoint(
            {"path": "/x/state", "node": "other", "source": "tcp://127.0.0.1:1", "model": "m"}
        )
    checked_checkpoint(
        {"path": "/x/state", "node": "o", "source": "tcp://127.0.0.1:1", "model": "m", "version": 2}
    )


# --- deletions, writers and collection -------------------------------------------------------


def test_a_pinned_version_is_deleted_from_no_tier(tmp_path):
    """A version being read (pinned where it is, NVMe included, or pinned in a live client's
    record that a restarted manager honours) is refused deletion on every tier."""
    tm = tier_manager(tmp_path)
    tm.nvme.publish("m", 1, {"w": torch.randn(64, 64)})
    assert tm.pin("reader", "m", 1, promote=False)["tier"] == "nvme"
    with pytest.raises(errors.StateStoreError, match="being read"):
        tm.delete("m", 1, ["nvme"])
    assert tm.nvme.read("m", 1, "w").shape == (64, 64)
    tm.dram.publish("m", 2, {"w": torch.randn(64, 64)})
    clients = tmp_path / "dram" / CLIENTS_DIR
    clients.mkdir(exist_ok=True)
    (clients / f"{os.getppid()}.json").write_text(json.dumps({"pins": [["m", 2, 1]]}))
    assert tm.evict("m", 2) is False
    with pytest.raises(errors.StateStoreError, match="being read"):
        tm.delete("m", 2, ["dram"])
    (clients / f"{os.getppid()}.json").unlink()
    assert tm.delete("m", 2, ["dram"]) == {"dram": True}


def test_writers_whose_parts_overlap_with_other_bytes_conflict(tmp_path):
    """Two writers' parts of one chunk that overlap must agree where they overlap (as for a
    whole chunk written twice): other bytes are a VersionConflict, the same bytes are fine."""
    store = StateStore(tmp_path / "st", create=True, durable=False)
    for version, second in ((1, torch.full((3, 4), 2.0)), (2, torch.ones(3, 4))):
        with store.writer("m", version, "p") as a:
            a.write("t", torch.ones(3, 4), region=(slice(0, 3),), shape=(5, 4))
        with store.writer("m", version, "p") as b:
            b.write("t", second, region=(slice(2, 5),), shape=(5, 4))
        if version == 1:
            with pytest.raises(errors.VersionConflict):
                store.commit("m", version, "p", expected_parts=2)
            assert store.versions("m") == []
        else:
            store.commit("m", version, "p", expected_parts=2)
            assert store.read("m", version, "t").eq(1.0).all()


def test_a_collection_removes_what_a_crashed_deletion_left(tmp_path):
    store = StateStore(tmp_path / "st", create=True, durable=False)
    store.publish("m", 1, {f"t{i}": torch.ones(4) for i in range(5)})
    trash = store.root / "staging" / ".deleted-deadbeef"
    os.rename(store.root / "versions" / "m" / "1", trash)  # (crashed before its rmtree)
    assert store.gc(grace_s=0, staging_grace_s=0)["staging_removed"] >= 1
    assert not trash.exists()


def test_a_failed_publish_leaves_no_staging_and_frees_its_room(tmp_path):
    """A publish that fails part-way (a tensor of an unstorable type after one that was
    written) leaves no staging behind, and its pending objects stop counting."""
    store = StateStore(tmp_path / "st", create=True, durable=True, capacity_bytes=10 << 20)
    for _ in range(3):
        with pytest.raises(errors.PlexRLError):
            store.publish(
                "m", 1, {"a": torch.randn(1 << 20), "b": torch.zeros(4, dtype=torch.complex64)}
            )
    assert list((store.root / "staging").glob("*/*")) == []
    assert store.objects.used_bytes() == 0
    store.publish("m", 1, {"a": torch.randn(2 << 20)})  # (8 MiB: fits the 10 MiB)


def test_the_managers_accounting_holds_under_concurrent_and_collected_writes(tmp_path):
    """The bytes a tier's manager counts equal what its objects hold: after two writes of one
    process at once (each counts only its own objects), and after a write that a collection
    walked in the middle of."""
    from plexrl_dask.state_store.node import NodeState
    from tests.test_state_manager import make_config

    node = NodeState(
        make_config(str(tmp_path / "dram"), str(tmp_path / "nvme"), dram_capacity=1 << 30)
    )
    try:
        go = threading.Barrier(2)

        def publish(i: int) -> None:
            go.wait()
            node.publish(f"m{i}", 1, {"w": torch.randn(512, 1024)}, tiers=("dram",))

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join(timeout=60) for t in threads]
        used = node.status()["tiers"]["dram"]["used"]
        assert used == node.store("dram").objects.scan_bytes() == 2 * 512 * 1024 * 4
    finally:
        node.shutdown()

    tm = tier_manager(tmp_path / "second")
    real_gc, box = tm.dram.gc, {}

    def gc_beside_a_write(**kw):
        lease = tm.reserve("client", 4 << 20, ["dram"])["lease"]
        tm.dram.publish("m", 1, {"w": torch.randn(1024, 1024)})
        box["lease"] = lease
        return real_gc(**kw)

    tm.dram.gc = gc_beside_a_write
    tm.collect("dram")
    tm.dram.gc = real_gc
    tm.release(box["lease"], 4 << 20, published=("m", 1))
    assert tm.used["dram"] == tm.dram.objects.scan_bytes() == 4 << 20


# --- job checkpoints and exports ---------------------------------------------------------------


def test_damaged_job_checkpoints_are_typed_errors(tmp_path):
    (tmp_path / "steps.jsonl").write_text('{"step": 0}\n[1]\n')
    with pytest.raises(errors.CheckpointIncomplete, match="not a step"):
        read_steps(tmp_path, 2)
    fields = {"format": 1, "job": "j", "config": {}, "task": "t", "model": {}, "steps_done": 1,
              "version": 1, "rollout": None}  # fmt: skip
    for policy, kept in (({}, []), ({"model": "m", "version": 1}, [[{"version": 1}]]),
                         ({"model": "m", "version": 1}, [{"model": "m"}])):  # fmt: skip
        (tmp_path / "job.json").write_text(json.dumps({**fields, "policy": policy, "kept": kept}))
        with pytest.raises(errors.CheckpointError):
            read_checkpoint(tmp_path)
    good = {"model": "m", "version": 1}
    (tmp_path / "job.json").write_text(
        json.dumps({**fields, "policy": good, "kept": [[good, None]]})
    )
    assert read_checkpoint(tmp_path).kept == [[good, None]]


def test_a_failed_export_leaves_nothing_and_exports_at_once_keep_the_limit(tmp_path):
    """An export that fails part-way leaves no files and is a typed error; two exports of
    one tenant written at once cannot both pass its limit."""
    target = tmp_path / "tenant-a" / "0123"
    with pytest.raises(errors.CheckpointError):
        write_export(target, {"w": torch.zeros(100, 100)}, str(tmp_path / "no-such-base"), None)
    assert not target.exists() and list((tmp_path / "tenant-a").iterdir()) == []

    saved = SavedCheckpoints(ServeState(None), tmp_path / "exports")
    saved.reserve_export("alice", 4_000_000, 5_000_000, "tinker://run/external_weights/a")
    with pytest.raises(errors.TenantLimitExceeded):
        saved.reserve_export("alice", 4_000_000, 5_000_000, "tinker://run/external_weights/b")
    saved.reserve_export("bob", 4_000_000, 5_000_000, "tinker://run2/external_weights/a")
    export = {"format": "external", "dir": str(tmp_path / "x"), "files": []}
    saved.add(
        Checkpoint("tinker://run/external_weights/a", "alice", "base", export, None,
                   size_bytes=4_000_000), reserved=4_000_000,
    )  # fmt: skip
    with pytest.raises(errors.TenantLimitExceeded):  # (the export now counts by its size)
        saved.reserve_export("alice", 2_000_000, 5_000_000, "tinker://run/external_weights/b")
    # replacing it under its own path frees its bytes for the new one
    saved.reserve_export("alice", 4_500_000, 5_000_000, "tinker://run/external_weights/a")
    saved.release_export("alice", 4_500_000)
    assert saved.exported_bytes("alice") == 4_000_000
