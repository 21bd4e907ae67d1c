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
With ``--tls`` a second pair of nodes whose comms are TLS runs beside the first, trials of the
two interleaved, and ``tls_vs_tcp_*_ratio`` say what encryption costs each arm.

Run: ``python -m plexrl_dask.bench.weight_sync --json OUT [--quick] [--tls]``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client, Security
from rich.progress import track

import plexrl_dask as plexrl
from plexrl_dask.bench.common import median, parser, report, time_call
from plexrl_dask.cluster import stop_process, worker_process
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


@dataclass
class NodePair:
    """A trainer on node A and a rollout replica on node B, and the calls the arms time."""

    runtime: plexrl.Runtime
    trainer: plexrl.Deployment
    rollout: plexrl.Deployment
    tiers_b: dict[str, str]

    def step(self) -> None:
        data = [plexrl.Datum(tokens=self.trainer.tokenize(f"{i}+{i}={2 * i}")) for i in range(8)]
        plexrl.result([self.trainer.forward_backward(data), self.trainer.optim_step()])

    def store(self) -> None:
        plexrl.result(self.runtime.sync_weights(self.trainer, self.rollout))

    def gather(self) -> None:
        plexrl.result(self.rollout.set_weights(self.trainer.get_weights()))


@contextlib.contextmanager
def node_pair(spec: plexrl.ModelSpec, security: Security | None) -> Iterator[NodePair]:
    """Nodes A (a one-worker ``local_cluster``) and B (a ``dask worker`` process with tiers of
    its own), over TLS with ``security``; removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="plexrl-bench-sync-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    tiers = {
        "dram-path": tempfile.mkdtemp(prefix="plexrl-bench-b-dram-", dir=shm),
        "nvme-path": str(tmp / "b-nvme"),
        "node-id": NODE_B,
    }
    tls = {"security": security, "protocol": "tls"} if security is not None else {}
    worker = None
    try:
        with (
            plexrl.local_cluster(n_workers=1, **tls) as cluster,
            Client(cluster, set_as_default=False) as client,
        ):
            runtime = plexrl.Runtime(client, job="bench-weight-sync")
            worker = worker_process(cluster.scheduler_address, tiers, security=security)
            b = _worker_of(runtime, NODE_B)
            a = [w for w in runtime.status()["workers"] if w != b]
            trainer = runtime.deploy("sync-trainer", spec, workers=a)
            rollout = runtime.deploy("sync-rollout", spec, role="rollout", workers=[b])
            pair = NodePair(runtime, trainer, rollout, tiers)
            pair.step()
            pair.store()  # warm: both workers' stores, connections, and the first import
            pair.gather()
            yield pair
    finally:
        if worker is not None:
            stop_process(worker, timeout=60)
        with contextlib.suppress(Exception):
            _node(tiers).shutdown()
        shutil.rmtree(tiers["dram-path"], ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _node(tiers: dict[str, str]) -> NodeState:
    return NodeState(StateConfig.for_tiers(tiers))


def _checked(pair: NodePair) -> tuple[int, int]:
    """The model's bytes and the versions node B holds, once B's weights equal A's."""
    got = plexrl.result(pair.rollout.get_weights()).tensors
    want = plexrl.result(pair.trainer.get_weights()).tensors
    assert all(got[n].equal(want[n]) for n in want), "the replica's weights differ"
    node_b = _node(pair.tiers_b)
    try:
        imported = node_b.store("dram").versions(f"weights.{pair.trainer.name}")
    finally:
        node_b.close()
    return sum(t.numel() * t.element_size() for t in want.values()), len(imported)


def run(trials: int, tls: bool = False) -> dict[str, Any]:
    """The arms on plain TCP, and with ``tls`` also on a second pair of nodes whose comms are
    TLS (``Security.temporary()``), both pairs up at once and their trials interleaved."""
    spec = plexrl.ModelSpec.tiny(**SPEC, seed=0)
    links = ["tcp", "tls"] if tls else ["tcp"]
    times = {(link, arm): [] for link in links for arm in ("store", "gather", "store_unchanged")}
    with contextlib.ExitStack() as stack:
        pairs = {
            link: stack.enter_context(
                node_pair(spec, Security.temporary() if link == "tls" else None)
            )
            for link in links
        }
        for trial in track(range(trials), description="weight sync trials"):
            for link in links if trial % 2 == 0 else links[::-1]:
                pair = pairs[link]
                pair.step()
                arms = [("store", pair.store), ("gather", pair.gather)]
                for name, fn in arms if trial % 2 == 0 else arms[::-1]:
                    times[link, name].append(time_call(fn))
                times[link, "store_unchanged"].append(time_call(pair.store))
        checked = {link: _checked(pair) for link, pair in pairs.items()}
    logger.info("samples: %s", {k: [round(x, 3) for x in v] for k, v in times.items()})
    m = {k: median(v) for k, v in times.items()}
    model_bytes, versions = checked["tcp"]
    results = {
        "store_s": m["tcp", "store"],
        "gather_s": m["tcp", "gather"],
        "store_unchanged_s": m["tcp", "store_unchanged"],
        "store_vs_gather_time_ratio": m["tcp", "store"] / m["tcp", "gather"],
        "unchanged_vs_gather_time_ratio": m["tcp", "store_unchanged"] / m["tcp", "gather"],
        "model_mb": model_bytes / 1e6,
        "store_gb_s": model_bytes / 1e9 / m["tcp", "store"],
        "gather_gb_s": model_bytes / 1e9 / m["tcp", "gather"],
        "versions_on_node_b": versions,
    }
    if tls:
        results.update(
            {
                "tls_store_s": m["tls", "store"],
                "tls_gather_s": m["tls", "gather"],
                "tls_store_unchanged_s": m["tls", "store_unchanged"],
                "tls_vs_tcp_store_ratio": m["tls", "store"] / m["tcp", "store"],
                "tls_vs_tcp_gather_ratio": m["tls", "gather"] / m["tcp", "gather"],
                "tls_vs_tcp_unchanged_ratio": (
                    m["tls", "store_unchanged"] / m["tcp", "store_unchanged"]
                ),
            }
        )
    return results


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tls", action="store_true", help="also over TLS, in the same run")
    args = p.parse_args()
    trials = 3 if args.quick else 8
    results = run(trials, tls=args.tls)
    report(
        "weight_sync",
        results,
        {},
        {
            "trials": trials,
            "model": SPEC,
            "nodes": ["local_cluster worker", NODE_B],
            "tls": args.tls,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
