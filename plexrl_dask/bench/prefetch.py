"""Benchmark of prefetch hints on a deployment switch (issue: state store).

A real one-worker ``local_cluster``: two deployments A and B of one model size. Each trial
offloads B from the worker and has the node's StateManager evict B's stored state to NVMe,
then submits a long request of A followed at once by a short one of B: the switch. What is
measured is the load time left on B's critical path: the time B's request spent waiting for
its replica to become resident before it ran (``critical_load_seconds`` of the worker's
holder; A is resident, so its part is ~0).

- ``prefetch_critical_path_ratio``: with prefetch hints ÷ without (target <= 0.2), when the
  worker's memory budget has room for B beside A: with hints the scheduler tells the worker
  that B is next while A runs; the manager promotes B's state NVMe -> DRAM and the holder
  reloads it DRAM -> device beside A, so B's request finds it resident.
- ``prefetch_critical_path_ratio_no_room``: the same with a budget of one replica, where only
  the NVMe -> DRAM part can overlap A (B's reload needs A's memory, which A's request holds).

Both arms run on their own cluster (hints are a scheduler setting), trials alternating
nothing else; the arms' mean critical load times are reported too.

Run: ``python -m plexrl_dask.bench.prefetch --json OUT [--quick]``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import dask.config
from distributed import Client
from rich.progress import track

import plexrl_dask as plexrl
from plexrl_dask.bench.common import parser, report
from plexrl_dask.state_store.node import NodeState, StateConfig

logger = logging.getLogger(__name__)

SPEC = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, max_positions=256)


def _node_of(cluster: Any) -> NodeState:
    return NodeState(StateConfig.for_tiers(cluster.plexrl_state))


def _switches(hints: bool, room: bool, trials: int, long_batch: int) -> list[float]:
    """Critical-path load seconds of B's request in each of ``trials`` switches."""
    spec = plexrl.ModelSpec.tiny(**SPEC, seed=0)
    one = spec.memory_bytes("rollout")
    settings = {
        "plexrl.scheduler.prefetch-hints": hints,
        "plexrl.worker.memory-budget": int(one * (2.5 if room else 1.5)),
        "plexrl.state.dram-capacity": int(one * 3),
    }
    out = []
    with (
        dask.config.set(settings),
        plexrl.local_cluster(n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        runtime = plexrl.Runtime(client, job="bench-prefetch")
        a = runtime.deploy("switch-a", spec, role="rollout")
        b = runtime.deploy("switch-b", plexrl.ModelSpec.tiny(**SPEC, seed=1), role="rollout")
        node = _node_of(cluster)
        holder = runtime.holder(a.info.worker)
        text = "".join(str(i % 10) for i in range(200))
        long = [plexrl.Datum(tokens=a.tokenize(text)) for _ in range(long_batch)]
        short = [plexrl.Datum(tokens=b.tokenize("1+1=2"))]
        plexrl.result([a.forward(short), b.forward(short)])
        for _ in track(range(trials), description=f"hints={hints} room={room}", transient=True):
            b.offload()
            stored = holder.status().result(timeout=60)["replicas"][b.name]["stored_as"]
            model, version = stored.rsplit("/", 1)
            node.evict(model, int(version))
            assert node.locate(model, int(version)) == "nvme"
            plexrl.result(a.forward(short))  # A resident, B not
            before = holder.status().result(timeout=60)["critical_load_seconds"]
            plexrl.result([a.forward(long), b.forward(short)])
            after = holder.status().result(timeout=60)["critical_load_seconds"]
            out.append(after - before)
        node.close()
    return out


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    trials = 3 if args.quick else 6
    long_batch = 8 if args.quick else 12
    results: dict[str, Any] = {}
    for room, suffix in ((True, ""), (False, "_no_room")):
        t0 = time.perf_counter()
        without = _switches(False, room, trials, long_batch)
        with_hints = _switches(True, room, trials, long_batch)
        mean_without = sum(without) / len(without)
        mean_with = sum(with_hints) / len(with_hints)
        results[f"prefetch_critical_path_ratio{suffix}"] = mean_with / mean_without
        results[f"critical_load_s_without_hints{suffix}"] = mean_without
        results[f"critical_load_s_with_hints{suffix}"] = mean_with
        logger.info("room=%s done in %.0fs", room, time.perf_counter() - t0)
    report(
        "prefetch",
        results,
        {"prefetch_critical_path_ratio": "<= 0.2"},
        {"trials": trials, "long_batch": long_batch, "spec": SPEC},
        args.json,
    )


if __name__ == "__main__":
    main()
