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
``unchanged_vs_gather_time_ratio`` (below 1: the store path is faster; target for the first:
<= 1.0), with the model's bytes. With ``--tls`` a second pair of nodes whose comms are TLS
runs beside the first, trials of the two interleaved, and ``tls_vs_tcp_*_ratio`` say what
encryption costs each arm.

**Live resharding** (:func:`live_reshard`), on a ``local_cluster`` of two workers: a training
deployment sharded FSDP(2) over both takes a step, then ``sync_weights`` into a tensor-
parallel rollout TP(2) over the same two workers and into two data-parallel replicas DP(2).
Around each sync every rollout worker's state-store reader counts the bytes it fetched
(``IOStats.bytes_read`` of its node's stores) and the most one of its reads allocated
(``IOStats.peak_read_allocation``: the buffers the store made for the read, its outputs and
any scratch buffer it had to grow; a read straight into the parameters makes none); each is
divided by the bytes of the rank's own slice (its local parameters), and the worst rank is
reported: ``reshard_live_fetch_ratio`` and ``reshard_live_peak_alloc_ratio`` (``_tp``,
``_dp``; target <= 1.05 each). ``reshard_live_peak_traced_ratio`` is the peak of every Python
allocation of the worker meanwhile (``tracemalloc``, which sees numpy's buffers but not
torch's allocator), over the same slice: the definition of ``reshard_live_peak_alloc_ratio``
before the store counted its allocations. Then the TP replica and one plain replica holding the same weights sample the
same prompts with the same seeds: ``tp_token_agreement`` is the share of sampled sequences
whose tokens are identical (target >= 0.99), and ``tp_logprob_max_abs_diff`` the largest
log-probability difference over the tokens of identical sequences.

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
from plexrl_dask.state_store.keys import derived_model
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
        imported = node_b.store("dram").versions(derived_model("weights", pair.trainer.name))
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


def rank_probe(start: bool, deployment: str, dask_worker: Any = None) -> dict[str, int]:
    """(Run on a worker.) Its node stores' bytes read so far; with ``start`` restart their
    peak read allocation and begin tracing Python allocations, else the peak of each since,
    and the bytes of ``deployment``'s local parameters on this worker."""
    import tracemalloc

    from plexrl_dask.worker.holder import holder_of

    holder = holder_of(dask_worker)
    stats = [holder.node.store(t).stats for t in ("dram", "nvme")]
    read = sum(s.bytes_read for s in stats)
    if start:
        for s in stats:
            s.reset_peak()
        tracemalloc.start()
        tracemalloc.reset_peak()
        return {"read": read}
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    model = holder._replicas[deployment].backend.model
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in model.parameters()
    )
    peak = max(s.peak_read_allocation for s in stats)
    return {"read": read, "peak": peak, "traced": traced, "slice": local}


def live_reshard(quick: bool) -> dict[str, Any]:
    """FSDP(2) -> TP(2) and FSDP(2) -> DP(2) syncs, counted per rank (module docstring)."""
    spec = plexrl.ModelSpec.tiny(**SPEC, seed=1)
    out: dict[str, Any] = {}
    with (
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        runtime = plexrl.Runtime(client, job="bench-reshard")
        trainer = runtime.deploy("reshard-train", spec, world_size=2)
        data = [plexrl.Datum(tokens=trainer.tokenize(f"{i}+{i}={2 * i}")) for i in range(8)]
        plexrl.result([trainer.forward_backward(data), trainer.optim_step()])
        targets = {
            "tp": runtime.deploy("reshard-tp", spec, role="rollout", tensor_parallel=2),
            "dp": runtime.deploy("reshard-dp", spec, role="rollout", replicas=2),
        }
        for kind, dst in targets.items():
            workers = list(dst.info.workers)
            starts = client.run(rank_probe, True, dst.name, workers=workers)
            plexrl.result(runtime.sync_weights(trainer, dst))
            ends = client.run(rank_probe, False, dst.name, workers=workers)
            fetch = [(e["read"] - starts[w]["read"]) / e["slice"] for w, e in ends.items()]
            out[f"reshard_live_fetch_ratio_{kind}"] = max(fetch)
            for metric, key in (("peak_alloc", "peak"), ("peak_traced", "traced")):
                out[f"reshard_live_{metric}_ratio_{kind}"] = max(
                    e[key] / e["slice"] for e in ends.values()
                )
        for metric in ("fetch", "peak_alloc", "peak_traced"):
            out[f"reshard_live_{metric}_ratio"] = max(
                out[f"reshard_live_{metric}_ratio_{k}"] for k in targets
            )
        prompts = [f"{i}+{2 * i}=" for i in range(8 if quick else 32)]
        params = plexrl.SamplingParams(n=4, max_tokens=16, seed=7)
        tp = plexrl.result(targets["tp"].sample(prompts, params))
        one = plexrl.result(targets["dp"].sample(prompts, params))
        pairs = [
            (a, b)
            for ga, gb in zip(tp.sequences, one.sequences, strict=True)
            for a, b in zip(ga, gb, strict=True)
        ]
        same = [(a, b) for a, b in pairs if a.tokens == b.tokens]
        out["tp_token_agreement"] = len(same) / len(pairs)
        out["tp_sequences_compared"] = len(pairs)
        out["tp_logprob_max_abs_diff"] = max(
            (abs(x - y) for a, b in same for x, y in zip(a.logprobs, b.logprobs, strict=True)),
            default=None,
        )
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tls", action="store_true", help="also over TLS, in the same run")
    args = p.parse_args()
    trials = 3 if args.quick else 8
    results = run(trials, tls=args.tls)
    results.update(live_reshard(args.quick))
    report(
        "weight_sync",
        results,
        {
            "store_vs_gather_time_ratio": "<= 1.0",
            "reshard_live_fetch_ratio": "<= 1.05",
            "reshard_live_peak_alloc_ratio": "<= 1.05",
            "reshard_live_peak_traced_ratio": "<= 1.05",  # (what the store's count cannot see)
            "tp_token_agreement": ">= 0.99",
        },
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
