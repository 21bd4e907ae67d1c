"""Benchmark of weight sync between nodes through the state store (issue: state store).

A real process ``local_cluster`` of one worker (node A, its own tiers) plus a ``dask worker``
process with tiers of its own (node B, as on another host: another DRAM and NVMe path and
node id; on this machine the "network" between them is loopback TCP). A trainer deployment on
A, a rollout deployment of the same model on B. Per trial, in alternating order:

- ``store``: a training step, then ``runtime.sync_weights(trainer, rollout)``: A publishes the
  version to its DRAM tier, B's replica imports the objects B lacks from A's worker (all of
  them: a step changes every parameter), then loads it from B's DRAM tier;
- ``gather``: the path ``sync_weights`` takes when it cannot use the store (and took across
  nodes before): ``rollout.set_weights(trainer.get_weights())``, whole tensors moved by Dask
  from worker to worker;
- ``store_unchanged``: ``sync_weights`` again with no step in between: every object is already
  on B, so only the manifest crosses (what a frozen reference model or frozen layers cost).

Reported: median seconds of each arm and the ratios ``store_vs_gather_time_ratio`` and
``unchanged_vs_gather_time_ratio`` (below 1: the store path is faster), with the model's
bytes. No target is set by the issue for this one; it shows what the cross-node path costs.

Run: ``python -m plexrl_dask.bench.weight_sync --json OUT [--quick]``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import dask.config
from distributed import Client
from rich.progress import track

import plexrl_dask as plexrl
from plexrl_dask.bench.common import median, parser, report, time_call
from plexrl_dask.cluster import worker_process
from plexrl_dask.state_store.node import NodeState, StateConfig

logger = logging.getLogger(__name__)

SPEC = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, max_positions=256)
NODE_B = "bench-node-b"
REGISTER_TIMEOUT_S = 120.0


def _worker_of(runtime: plexrl.Runtime, node: str) -> str:
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while time.monotonic() < deadline:
        found = [w for w, i in runtime.status()["workers"].items() if i.get("node") == node]
        if found:
            return found[0]
        time.sleep(0.5)
    raise TimeoutError(f"no worker of node {node!r} registered in {REGISTER_TIMEOUT_S:.0f} s")


def run(trials: int) -> dict[str, Any]:
    spec = plexrl.ModelSpec.tiny(**SPEC, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="plexrl-bench-sync-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    tiers = {
        "dram-path": tempfile.mkdtemp(prefix="plexrl-bench-b-dram-", dir=shm),
        "nvme-path": str(tmp / "b-nvme"),
        "node-id": NODE_B,
    }
    times: dict[str, list[float]] = {"store": [], "gather": [], "store_unchanged": []}
    worker = None
    try:
        with (
            plexrl.local_cluster(n_workers=1) as cluster,
            Client(cluster, set_as_default=False) as client,
        ):
            runtime = plexrl.Runtime(client, job="bench-weight-sync")
            worker = worker_process(cluster.scheduler_address, tiers)
            b = _worker_of(runtime, NODE_B)
            a = [w for w in runtime.status()["workers"] if w != b]
            trainer = runtime.deploy("sync-trainer", spec, workers=a)
            rollout = runtime.deploy("sync-rollout", spec, role="rollout", workers=[b])
            data = [plexrl.Datum(tokens=trainer.tokenize(f"{i}+{i}={2 * i}")) for i in range(8)]

            def step() -> None:
                plexrl.result([trainer.forward_backward(data), trainer.optim_step()])

            def store() -> None:
                plexrl.result(runtime.sync_weights(trainer, rollout))

            def gather() -> None:
                plexrl.result(rollout.set_weights(trainer.get_weights()))

            step()
            store()  # warm: both workers' stores, connections, and the first import
            gather()
            for trial in track(range(trials), description="weight sync trials"):
                step()
                arms = [("store", store), ("gather", gather)]
                for name, fn in arms if trial % 2 == 0 else arms[::-1]:
                    times[name].append(time_call(fn))
                times["store_unchanged"].append(time_call(store))
            got = plexrl.result(rollout.get_weights()).tensors
            want = plexrl.result(trainer.get_weights()).tensors
            assert all(got[n].equal(want[n]) for n in want), "the replica's weights differ"
            model_bytes = sum(t.numel() * t.element_size() for t in want.values())
            with dask.config.set({f"plexrl.state.{k}": v for k, v in tiers.items()}):
                node_b = NodeState(StateConfig.from_dask_config())
            imported = node_b.store("dram").versions(f"weights.{trainer.name}")
            node_b.close()
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=60)
        with (
            dask.config.set({f"plexrl.state.{k}": v for k, v in tiers.items()}),
            contextlib.suppress(Exception),
        ):
            NodeState(StateConfig.from_dask_config()).shutdown()
        shutil.rmtree(tiers["dram-path"], ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("samples: %s", {k: [round(x, 3) for x in v] for k, v in times.items()})
    m = {k: median(v) for k, v in times.items()}
    return {
        "store_s": m["store"],
        "gather_s": m["gather"],
        "store_unchanged_s": m["store_unchanged"],
        "store_vs_gather_time_ratio": m["store"] / m["gather"],
        "unchanged_vs_gather_time_ratio": m["store_unchanged"] / m["gather"],
        "model_mb": model_bytes / 1e6,
        "store_gb_s": model_bytes / 1e9 / m["store"],
        "gather_gb_s": model_bytes / 1e9 / m["gather"],
        "versions_on_node_b": len(imported),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    trials = 3 if args.quick else 8
    results = run(trials)
    report(
        "weight_sync",
        results,
        {},
        {"trials": trials, "model": SPEC, "nodes": ["local_cluster worker", NODE_B]},
        args.json,
    )


if __name__ == "__main__":
    main()
