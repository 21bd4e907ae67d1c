"""Residency-aware placement and prefetch hints, live, on a 2-worker cluster whose workers each
have room for one model (own cluster: a small memory budget)."""

from __future__ import annotations

import time

import dask
import pytest
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask.worker import ops
from tests.conftest import tiny_spec, unique

# One size for every model here, so that the budget holds exactly one of them.
SIZE = {
    "hidden_size": 192,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "max_positions": 256,
}
SPEC_A, SPEC_B = tiny_spec(seed=41, **SIZE), tiny_spec(seed=42, **SIZE)
PROMPTS = ["1+2=", "3+4="]
PARAMS = plexrl.SamplingParams(n=2, max_tokens=6, seed=7)


@pytest.fixture(scope="module")
def small_runtime():
    budget = int(SPEC_A.memory_bytes("rollout") * 1.5)
    with (
        dask.config.set({"plexrl.worker.memory-budget": budget}),
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield plexrl.Runtime(client, job="test-scheduling")


def _aimed_load(runtime: plexrl.Runtime, dep: plexrl.Deployment, replica: int) -> None:
    """Load ``dep``'s replica ``replica`` (so it is the one model in HBM on its worker)."""
    with dask.annotate(plexrl=dep.annotation(replica=replica)):
        fut = runtime.client.submit(ops.load, dep.name, pure=False)
    plexrl.result(fut, timeout=120)


def _tier(runtime: plexrl.Runtime, name: str, worker: str) -> str:
    rows = runtime.status()["residency"]
    return next(
        (r["tier"] for r in rows if r["deployment"] == name and r["worker"] == worker), "absent"
    )


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _loads(runtime: plexrl.Runtime, workers: list[str]) -> int:
    total = 0
    for w in workers:
        c = runtime.holder(w).status().result(timeout=60)["counters"]
        total += c["loads"] + c["reloads"] + c["prefetches"]
    return total


def test_data_parallel_requests_run_where_their_model_is_resident(small_runtime):
    runtime = small_runtime
    a = runtime.deploy(unique("roll-a"), SPEC_A, role="rollout", replicas=2)
    b = runtime.deploy(unique("roll-b"), SPEC_B, role="rollout", replicas=2)
    w0, w1 = a.info.workers
    assert set(b.info.workers) == {w0, w1}
    expected_a = plexrl.result(a.sample(PROMPTS, PARAMS))
    expected_b = plexrl.result(b.sample(PROMPTS, PARAMS))
    # One model per worker: a on w0, b on the replica of b on w1.
    _aimed_load(runtime, a, 0)
    _aimed_load(runtime, b, b.info.workers.index(w1))
    _wait_for(
        lambda: _tier(runtime, a.name, w0) == "hbm" and _tier(runtime, b.name, w1) == "hbm",
        "residency",
    )
    assert _tier(runtime, a.name, w1) == "dram" and _tier(runtime, b.name, w0) == "dram"
    before = _loads(runtime, [w0, w1])

    for _ in range(3):  # both workers free each time: each request has a choice
        got_a, got_b = plexrl.result([a.sample(PROMPTS, PARAMS), b.sample(PROMPTS, PARAMS)])
        assert got_a == expected_a and got_b == expected_b

    # Every sample ran where its model was in HBM: no load, no reload, and the decisions say so.
    assert _loads(runtime, [w0, w1]) == before
    decisions = [d for d in runtime.status()["decisions"] if d["op"] == "sample"][-6:]
    for d in decisions:
        assert list(d["workers"]) == [w0 if d["deployment"] == a.name else w1]
        assert d["setup_s"] == 0.0
    runtime.undeploy(a.name)
    runtime.undeploy(b.name)


def test_turns_holding_their_worker_run_every_request_to_the_end(small_runtime):
    """plexrl.scheduler.turn-hold through the operator's set_policy (typed errors for bad
    values): turns marked ``holds`` and another job's requests on the same worker all
    complete, the turns with the samples they draw unheld (the hold's rule:
    tests/test_dispatch.py)."""
    runtime = small_runtime
    with pytest.raises(plexrl.errors.ConfigError):
        runtime.set_policy(turn_hold_s=-1.0)
    with pytest.raises(plexrl.errors.ConfigError):
        runtime.set_policy(turn_hold_s=True)
    # (an argument no handler takes: typed by the scheduler, not its TypeError)
    with pytest.raises(plexrl.errors.ConfigError, match="foo"):
        runtime.set_policy(foo=1)
    with pytest.raises(plexrl.errors.ConfigError, match="since"):
        runtime.timeline(since="x")
    assert runtime.set_policy(turn_hold_s=0.5)["turn_hold_s"] == 0.5
    try:
        agent = runtime.deploy(unique("agent"), tiny_spec(seed=45, **SIZE), role="rollout")
        other = plexrl.Runtime(runtime.client, job=unique("other"))
        beside = other.deploy(
            unique("beside"),
            tiny_spec(seed=46, **SIZE),
            role="rollout",
            workers=[agent.info.worker],
        )
        params = plexrl.SamplingParams(n=2, max_tokens=6, seed=3)
        data = [plexrl.Datum(tokens=beside.tokenize("1+2=3"))]
        turns, reads = [], []
        for _ in range(3):
            turns.append(agent.sample(["1+1="], params, holds=True))
            reads += [beside.forward(data) for _ in range(2)]
        done = plexrl.result([*turns, *reads], timeout=120)
        unheld = plexrl.result(agent.sample(["1+1="], params), timeout=120)
        assert all(d.sequences == unheld.sequences for d in done[:3])
        # the status lists the free workers holds keep (none left by now: each lapsed)
        held = runtime.status()["queue"]["held"]
        assert isinstance(held, dict)
        assert all(v["for_s"] >= 0 and v["jobs"] == [runtime.job] for v in held.values())
    finally:
        configured = plexrl.config.get_seconds("scheduler.turn-hold", positive=False)
        assert runtime.set_policy()["turn_hold_s"] == configured


def test_a_model_resident_where_it_runs_next_gets_no_prefetch_hint(small_runtime):
    """A hint is for bringing a model back: one already in HBM where it is predicted to run
    gets none (a job alone on its worker would otherwise get two per request)."""
    runtime = small_runtime
    dep = runtime.deploy(unique("alone"), tiny_spec(seed=44, **SIZE), role="rollout")
    plexrl.result(dep.load())
    data = [plexrl.Datum(tokens=dep.tokenize("1+2=3"))]
    plexrl.result([dep.forward(data) for _ in range(2)], timeout=120)
    hints_before = runtime.status()["counters"].get("prefetch_hints", 0)
    plexrl.result([dep.forward(data) for _ in range(6)], timeout=120)
    assert runtime.status()["counters"].get("prefetch_hints", 0) == hints_before
    runtime.undeploy(dep.name)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "no-lookahead"])
def test_a_queued_request_makes_its_worker_prefetch_its_model(small_runtime, lookahead):
    runtime = small_runtime
    runtime.set_policy(lookahead=lookahead)
    slow = runtime.deploy(unique("slow"), tiny_spec(seed=43, **SIZE), role="rollout")
    worker = slow.info.worker
    other = runtime.deploy(unique("other"), SPEC_B, role="rollout", workers=[worker])
    plexrl.result(slow.load())  # slow in HBM, other offloaded (one model fits)
    _wait_for(
        lambda: _tier(runtime, other.name, worker) == "dram", "the other model to be offloaded"
    )
    # The property needs `queued` to reach the scheduler while `blocker` runs. Both batches are
    # built first, so that only two submits lie between them, and the blocker takes about half
    # a second here (a CI run once lost the race with a blocker a quarter as long).
    big = [
        plexrl.Datum(tokens=slow.tokenize("".join(str(j % 10) for j in range(200))))
        for _ in range(32)
    ]
    small = [plexrl.Datum(tokens=other.tokenize("2+2=4"))]
    holder = runtime.holder(worker)
    before = holder.status().result(timeout=60)["counters"]
    hints_before = runtime.status()["counters"].get("prefetch_hints", 0)

    blocker = slow.forward(big)
    queued = other.forward(small)
    plexrl.result([blocker, queued], timeout=120)

    # While the blocker ran, the scheduler predicted `other` next on that worker (with
    # lookahead: queued it there) and said so, then, once it ran, that nothing more is
    # predicted there (two hints).
    decision = [d for d in runtime.status()["decisions"] if d["deployment"] == other.name][-1]
    assert decision["op"] == "forward"
    if lookahead:
        assert decision["behind"] is not None, "the request was not queued behind the blocker"
    else:
        assert decision["wait_s"] > 0, "the queued request did not wait for the blocker"
    _wait_for(
        lambda: runtime.status()["counters"].get("prefetch_hints", 0) >= hints_before + 2,
        "hints",
    )
    assert worker not in runtime.status()["hints"]
    status = holder.status().result(timeout=60)
    assert status["hint"] is None
    # `other` was brought back exactly once: by the prefetch when the blocker ended, or (if
    # the request won the race) by the request itself, never both.
    after = status["counters"]
    assert (after["prefetches"] - before["prefetches"]) + (
        after["reloads"] - before["reloads"]
    ) == 1
    runtime.undeploy(slow.name)
    runtime.undeploy(other.name)
    runtime.set_policy(lookahead=True)
