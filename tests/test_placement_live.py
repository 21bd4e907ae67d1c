"""Spatiotemporal placement live: a job on a real process cluster is profiled on dedicated
workers, then micro-shifted into its group; its recorded trace replays in the simulator, and
the plugin's placement decisions are exactly what the policy core decides for the recorded
events."""

from __future__ import annotations

import time

import plexrl_dask as plexrl
from plexrl_dask.cluster import worker_process
from plexrl_dask.plugins.placement import nodes_of
from plexrl_dask.policy.spatiotemporal import PlacementConfig, replay
from plexrl_dask.sim.simulator import simulate
from plexrl_dask.sim.workload import WorkloadSpec, generate, load_trace
from tests.conftest import tiny_spec, unique


def run_iterations(dep: plexrl.Deployment, n: int) -> None:
    """``n`` on-policy iterations: sample (rollout), then forward_backward + optim_step."""
    data = [plexrl.Datum(tokens=dep.tokenize("12+21=33"))]
    params = plexrl.SamplingParams(n=2, max_tokens=4, seed=1)
    for _ in range(n):
        plexrl.result(dep.sample(["1+1="], params))
        plexrl.result([dep.forward_backward(data), dep.optim_step()])


def test_a_job_is_profiled_then_placed_and_its_trace_replays(runtime, tmp_path):
    job = runtime.job
    dep = runtime.deploy(unique("placed"), tiny_spec(seed=3))
    state = runtime.placement(job)
    assert state["enabled"] and state["state"]["jobs"][job]["state"] == "profiling"
    group = state["state"]["jobs"][job]["group"]
    [g] = [x for x in state["state"]["groups"] if x["name"] == group]
    assert set(dep.info.workers) <= {w for n in state["nodes"] for w in n["gpus"]}
    config = PlacementConfig(**state["config"])
    run_iterations(dep, config.profile_iterations + 1)  # the last rollout closes the 3rd
    state = runtime.placement(job)
    assert state["state"]["jobs"][job]["state"] == "placed"
    mine = [d for d in state["decisions"] if d["job"] == job]
    assert [d["kind"] for d in mine] == ["profile", "place"]
    assert mine[1]["locked_period_s"] > 0 and mine[1]["group"] == group
    # the plugin decided exactly what the policy core decides for the recorded events
    nodes = nodes_of({w: n["name"] for n in state["nodes"] for w in n["gpus"]})
    again = [d.to_dict() for d in replay(nodes, config, state["inputs"])]
    assert again == list(state["decisions"])  # (msgpack sends lists as tuples)
    assert g["capacity"] >= 1
    # the recorded trace, in the simulator's replay format, drives a simulation
    its = runtime.save_trace(tmp_path / "live.json")
    assert len(its) >= config.profile_iterations
    assert [p.kind for p in its[0]] == ["rollout", "train"]
    assert load_trace(tmp_path / "live.json") == its
    spec = WorkloadSpec.from_dict(
        {
            "name": "live-replay",
            "cluster": {"gpus": 8},
            "models": [{"name": "tiny", "params_b": 0.001, "weight": 1, "rollout_gpus": 1,
                        "train_gpus": 1, "replay": "live.json"}],
            "iterations": 6,
            "jobs": 3,
            "arrival": {"offered_load": 1.0},
        },
        base=tmp_path,
    )  # fmt: skip
    out = simulate(generate(spec, 0), spec.cluster, "spread+backfill", config)
    assert len(out.jobs) == 3 and out.double_bookings == 0
    # its last deployment gone, the job leaves the placer
    runtime.undeploy(dep.name)
    assert job not in runtime.placement()["state"]["jobs"]


def test_a_worker_on_a_new_host_joins_placement_while_a_job_is_placed(runtime, cluster, tmp_path):
    """A real worker process on another loopback address, with its own tiers and node name
    (another machine) joins while a job profiles: the scheduler adds its node as a free node
    at once (a recorded input that replays), and the job keeps its group."""
    dep = runtime.deploy(unique("joined"), tiny_spec(seed=4))
    before = runtime.placement()
    assert before["state"]["jobs"][runtime.job]["state"] == "profiling"
    tiers = {"dram-path": str(tmp_path / "dram"), "nvme-path": str(tmp_path / "nvme"),
             "node-id": "node-b"}  # fmt: skip
    worker = worker_process(cluster.scheduler_address, tiers, host="127.0.0.2")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = runtime.placement()
            added = [e for e in state["inputs"] if e["event"] == "add_node"]
            if added:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the new worker's host never joined placement")
        [e] = added
        assert e["node"] == "node-b" and len(e["gpus"]) == 1
        assert state["state"]["capacity"]["cluster"] == before["state"]["capacity"]["cluster"] + 1
        assert state["state"]["jobs"][runtime.job] == before["state"]["jobs"][runtime.job]
        nodes = nodes_of({w: n["name"] for n in state["nodes"] for w in n["gpus"]})
        config = PlacementConfig(**state["config"])
        again = [d.to_dict() for d in replay(nodes, config, state["inputs"])]
        assert again == list(state["decisions"])
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        runtime.undeploy(dep.name)
