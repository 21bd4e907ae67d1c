"""PlexRL on a cluster whose Dask comms are TLS (docs/deploying.md, "TLS"):
requests, the groups' rendezvous, weight versions moved between nodes and the dashboard's polls
of the workers all go through Dask's comms, so they run encrypted with the cluster's
``Security``. Certificates come from ``Security.temporary()`` (needs ``cryptography``)."""

from __future__ import annotations

import contextlib
import json
import ssl
import time
import urllib.request

import pytest
import torch
from distributed import Client, Security

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.cli import _client_credentials
from plexrl_dask.cli import main as plexrl_main
from plexrl_dask.cluster import (
    client_security,
    scheduler_process,
    stop_process,
    tls_environment,
    worker_process,
)
from plexrl_dask.state_store.keys import derived_model
from plexrl_dask.state_store.node import NodeState
from tests.conftest import node_state, tiny_spec, unique

pytest.importorskip("cryptography", reason="Security.temporary() makes its certificates with it")

WAIT_S = 120.0


def batch(dep, n: int = 4) -> list[plexrl.Datum]:
    return [plexrl.Datum(tokens=dep.tokenize(f"{i}+{i * 2}={3 * i}")) for i in range(n)]


def fetch_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def train_sync_sample(runtime: plexrl.Runtime, trainer, rollouts) -> dict:
    """One training step on ``trainer``, its weights synced into every rollout replica (each
    then holds exactly them) and sampled from; the trainer's weights."""
    plexrl.result([trainer.forward_backward(batch(trainer)), trainer.optim_step()])
    want = plexrl.result(trainer.get_weights()).tensors
    params = plexrl.SamplingParams(max_tokens=6, n=2, seed=3)
    texts = set()
    for roll in rollouts:
        assert plexrl.result(runtime.sync_weights(trainer, roll)) == 1
        got = plexrl.result(roll.get_weights()).tensors
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        result = plexrl.result(roll.sample(["1+2=", "3+4="], params))
        texts.add(tuple(s.text for seqs in result.sequences for s in seqs))
    assert len(texts) == 1, "the same weights and seeds sampled differently on another worker"
    return want


def test_tls_environment_carries_a_roles_own_settings_and_nothing_without_tls():
    sec = Security.temporary(tls_min_version=ssl.TLSVersion.TLSv1_3)
    worker = tls_environment(sec, "worker")
    assert worker["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"] == sec.tls_ca_file
    assert worker["DASK_DISTRIBUTED__COMM__TLS__WORKER__KEY"] == sec.tls_worker_key
    assert worker["DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT"] == sec.tls_client_cert
    assert worker["DASK_DISTRIBUTED__COMM__TLS__MIN_VERSION"] == "1.3"
    assert worker["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
    assert not any("SCHEDULER" in k for k in worker)  # a worker never gets its key
    scheduler = tls_environment(sec, "scheduler")
    assert scheduler["DASK_DISTRIBUTED__COMM__TLS__SCHEDULER__KEY"] == sec.tls_scheduler_key
    assert not any("WORKER" in k for k in scheduler)
    assert tls_environment(None, "worker") == {} and tls_environment(Security(), "worker") == {}
    with pytest.raises(errors.ConfigError, match="role"):
        tls_environment(sec, "client")


def role(sec: Security, name: str) -> Security:
    """``sec`` with one role's certificate only, as ``dask scheduler|worker --tls-ca-file
    --tls-cert --tls-key`` sets it."""
    return Security(
        tls_ca_file=sec.tls_ca_file,
        require_encryption=True,
        **{f"tls_{name}_cert": getattr(sec, f"tls_{name}_cert")},
        **{f"tls_{name}_key": getattr(sec, f"tls_{name}_key")},
    )


def test_a_tls_local_cluster_trains_a_group_and_syncs_its_replicas(tmp_path, capsys):
    """``local_cluster(security=..., protocol="tls")``: a two-rank trainer (its rendezvous
    through the scheduler), a rollout replica synced from it and sampled, the dashboard's
    Timeline filled by polls of both workers; ``plexrl status`` from the client credentials
    saved for other processes."""
    sec = Security.temporary()
    with (
        plexrl.local_cluster(n_workers=2, security=sec, protocol="tls") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        assert cluster.scheduler_address.startswith("tls://")
        runtime = plexrl.Runtime(client, job=unique("tls"))
        trainer = runtime.deploy(unique("tls-train"), tiny_spec(seed=41), world_size=2)
        roll = runtime.deploy(unique("tls-roll"), tiny_spec(seed=42), role="rollout")
        train_sync_sample(runtime, trainer, [roll])

        base = cluster.dashboard_link.rsplit("/", 1)[0]
        deadline = time.monotonic() + WAIT_S
        while True:
            timeline = fetch_json(f"{base}/plexrl/timeline.json")
            workers = {s["worker"] for s in timeline["spans"]}
            if workers == set(trainer.info.workers):
                break
            assert time.monotonic() < deadline, f"the Timeline saw only {workers}"
            time.sleep(0.5)
        assert all(w.startswith("tls://") for w in workers)

        # a client in another process: through the credentials `plexrl slurm` writes
        with _client_credentials(cluster, str(tmp_path)) as connect:
            saved = tmp_path / cluster.scheduler_address[len("tls://") :].replace(":", "-")
            assert str(saved) in connect
            assert saved.stat().st_mode & 0o777 == 0o700
            assert all(f.stat().st_mode & 0o777 == 0o600 for f in saved.iterdir())
            address = cluster.scheduler_address
            assert plexrl_main(["status", "--scheduler", address, "--tls", str(saved)]) == 0
            shown = capsys.readouterr().out  # (its workers table)
            assert all(w in shown for w in trainer.info.workers)
        assert not saved.exists()  # (gone with the cluster)
        with pytest.raises(errors.ConfigError, match="ca.pem"):
            client_security(saved)


def test_a_tls_shared_cluster_moves_weights_between_nodes(tmp_path):
    """The shared-cluster path: ``dask scheduler --protocol tls --preload plexrl_dask.plugins``
    and two ``dask worker`` processes on different nodes (own tiers), each with its own
    role's certificate alone, as the command lines of docs/deploying.md, "TLS", give them (the plugin's own client
    then uses the scheduler's). A trainer with a rank on each node publishes on rank 0's node;
    the rollout replica on the other node imports that version worker to worker, over TLS."""
    sec = Security.temporary()
    workers = []

    def tiers_of(node: str) -> NodeState:
        return node_state(
            {"dram-path": tmp_path / f"{node}-dram", "nvme-path": tmp_path / f"{node}-nvme"}
        )

    with scheduler_process(tmp_path, security=role(sec, "scheduler")) as info:
        address = info["address"]
        assert address.startswith("tls://")
        try:
            for node in ("node-a", "node-b"):
                tiers = {
                    "dram-path": str(tmp_path / f"{node}-dram"),
                    "nvme-path": str(tmp_path / f"{node}-nvme"),
                    "node-id": node,
                }
                workers.append(worker_process(address, tiers, security=role(sec, "worker")))
            with Client(address, security=sec, set_as_default=False, timeout=60) as client:
                client.wait_for_workers(2, timeout=WAIT_S)
                runtime = plexrl.Runtime(client, job=unique("tls-shared"))
                deadline = time.monotonic() + WAIT_S
                while True:  # the holders register their nodes as they start
                    known = runtime.status()["workers"]
                    nodes = {info.get("node"): w for w, info in known.items()}
                    if {"node-a", "node-b"} <= set(nodes):
                        break
                    assert time.monotonic() < deadline, f"nodes never registered: {known}"
                    time.sleep(0.5)
                trainer = runtime.deploy(
                    unique("tls-x-train"),
                    tiny_spec(seed=43),
                    world_size=2,
                    workers=[nodes["node-a"], nodes["node-b"]],
                )
                rolls = [
                    runtime.deploy(
                        unique(f"tls-x-roll-{n}"), tiny_spec(seed=44), role="rollout", workers=[w]
                    )
                    for n, w in sorted(nodes.items())
                ]
                train_sync_sample(runtime, trainer, rolls)
                # The newest version was published on rank 0's node and imported by the other
                # (the publishing node also keeps the one before it: a load may be queued).
                model = derived_model("weights", trainer.name)
                stored = {}
                for node in nodes:
                    with contextlib.closing(tiers_of(node)) as state:
                        stored[node] = state.store("dram").versions(model)
                newest = {versions[-1] for versions in stored.values() if versions}
                assert len(newest) == 1 and len(stored) == 2, stored
                assert all(1 <= len(v) <= 2 for v in stored.values()), stored
        finally:
            for proc in workers:
                with contextlib.suppress(Exception):
                    stop_process(proc, timeout=60)
            for node in ("node-a", "node-b"):  # their managers outlive the workers
                with contextlib.suppress(Exception):
                    tiers_of(node).shutdown()
