"""The policy core: deploy-time placement and the residency map (pure, no Dask)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl_dask import errors
from plexrl_dask.policy import TIERS, ResidencyMap, ResidencyReport, WorkerView, assign_worker

MiB = 2**20

# --- assign_worker ---------------------------------------------------------------------------


def test_no_workers():
    with pytest.raises(errors.NoPlexRLWorkers, match="'policy'"):
        assign_worker("policy", 10, [])


def test_nothing_fits_names_the_sizes():
    workers = [WorkerView("tcp://a:1", 100 * MiB), WorkerView("tcp://b:1", 300 * MiB)]
    with pytest.raises(errors.DeploymentDoesNotFit) as info:
        assign_worker("big", 512 * MiB, workers)
    message = str(info.value)
    assert "'big'" in message
    assert "512.0 MiB" in message  # what it needs
    assert "300.0 MiB" in message  # the largest budget
    assert "memory-budget" in message  # what to change


def test_exact_fit_qualifies():
    workers = [WorkerView("tcp://a:1", 99), WorkerView("tcp://b:1", 100)]
    assert assign_worker("x", 100, workers) == "tcp://b:1"


def test_full_workers_still_qualify():
    # Others on a worker can be offloaded, so committed memory never disqualifies.
    workers = [WorkerView("tcp://a:1", 100, committed_bytes=1000, num_deployments=10)]
    assert assign_worker("x", 100, workers) == "tcp://a:1"


def test_least_committed_fraction_wins():
    workers = [
        WorkerView("tcp://a:1", budget_bytes=100, committed_bytes=50, num_deployments=1),
        WorkerView("tcp://b:1", budget_bytes=1000, committed_bytes=400, num_deployments=1),
        WorkerView("tcp://c:1", budget_bytes=200, committed_bytes=90, num_deployments=1),
    ]
    # Fractions 0.5, 0.4, 0.45: b wins although it has the most committed bytes.
    assert assign_worker("x", 10, workers) == "tcp://b:1"


def test_ties_broken_by_fewest_deployments_then_address():
    workers = [
        WorkerView("tcp://c:1", 100, committed_bytes=20, num_deployments=1),
        WorkerView("tcp://a:1", 100, committed_bytes=20, num_deployments=2),
        WorkerView("tcp://b:1", 200, committed_bytes=40, num_deployments=1),
    ]
    assert assign_worker("x", 10, workers) == "tcp://b:1"  # c and b tie on 1 deployment
    empty = [WorkerView(f"tcp://{h}:1", 100) for h in "dcab"]
    assert assign_worker("x", 10, empty) == "tcp://a:1"


def test_unfit_worker_is_skipped_even_if_emptiest():
    workers = [
        WorkerView("tcp://small:1", 50),  # empty, but too small
        WorkerView("tcp://big:1", 500, committed_bytes=400, num_deployments=3),
    ]
    assert assign_worker("x", 100, workers) == "tcp://big:1"


def test_placement_is_deterministic_and_order_independent():
    rng = random.Random(0)
    workers = [
        WorkerView(
            f"tcp://w{i}:1", rng.choice([100, 200, 400]), rng.randrange(0, 300), rng.randrange(4)
        )
        for i in range(12)
    ]
    first = assign_worker("x", 100, workers)
    for _ in range(20):
        shuffled = workers[:]
        rng.shuffle(shuffled)
        assert assign_worker("x", 100, shuffled) == first


def test_spreads_deployments_over_workers():
    # Placing one deployment after another (committing each) spreads equal models evenly.
    workers = {f"tcp://w{i}:1": WorkerView(f"tcp://w{i}:1", 1000) for i in range(3)}
    placed = []
    for k in range(6):
        addr = assign_worker(f"d{k}", 100, list(workers.values()))
        w = workers[addr]
        workers[addr] = dataclasses.replace(
            w, committed_bytes=w.committed_bytes + 100, num_deployments=w.num_deployments + 1
        )
        placed.append(addr)
    assert sorted(placed) == sorted(list(workers) * 2)


def test_candidates_restrict_the_choice():
    workers = [
        WorkerView("tcp://a:1", 100),  # empty: would win unrestricted
        WorkerView("tcp://b:1", 100, committed_bytes=90, num_deployments=3),
        WorkerView("tcp://c:1", 100, committed_bytes=50, num_deployments=1),
    ]
    assert assign_worker("x", 10, workers) == "tcp://a:1"
    assert assign_worker("x", 10, workers, candidates=["tcp://b:1"]) == "tcp://b:1"
    assert assign_worker("x", 10, workers, candidates=["tcp://b:1", "tcp://c:1"]) == "tcp://c:1"
    assert assign_worker("x", 10, workers, candidates=None) == "tcp://a:1"


def test_unknown_candidates_are_no_workers():
    workers = [WorkerView("tcp://a:1", 100)]
    with pytest.raises(errors.NoPlexRLWorkers) as info:
        assign_worker("x", 10, workers, candidates=["tcp://a:1", "tcp://gone:1"])
    assert "tcp://gone:1" in str(info.value) and "tcp://a:1" in str(info.value)
    with pytest.raises(errors.NoPlexRLWorkers):
        assign_worker("x", 10, workers, candidates=[])


def test_candidates_that_do_not_fit():
    workers = [WorkerView("tcp://small:1", 50 * MiB), WorkerView("tcp://big:1", 500 * MiB)]
    with pytest.raises(errors.DeploymentDoesNotFit) as info:
        assign_worker("x", 100 * MiB, workers, candidates=["tcp://small:1"])
    # The largest budget it could have used is the candidate's, not the cluster's.
    assert "50.0 MiB" in str(info.value) and "500.0 MiB" not in str(info.value)


_worker = st.builds(
    WorkerView,
    address=st.integers(min_value=0, max_value=40).map(lambda i: f"tcp://10.0.0.{i}:8786"),
    budget_bytes=st.integers(min_value=1, max_value=10**6),
    committed_bytes=st.integers(min_value=0, max_value=3 * 10**6),
    num_deployments=st.integers(min_value=0, max_value=8),
)


@settings(max_examples=300, deadline=None)
@given(
    workers=st.lists(_worker, min_size=1, max_size=12, unique_by=lambda w: w.address),
    need=st.integers(min_value=1, max_value=10**6),
    pin=st.none() | st.sets(st.integers(min_value=0, max_value=11)),
)
def test_placement_property(workers, need, pin):
    def key(w):
        return (w.committed_bytes / w.budget_bytes, w.num_deployments, w.address)

    candidates = None if pin is None else [workers[i].address for i in pin if i < len(workers)]
    allowed = workers if candidates is None else [w for w in workers if w.address in candidates]
    fitting = [w for w in allowed if w.budget_bytes >= need]
    if not allowed:
        with pytest.raises(errors.NoPlexRLWorkers):
            assign_worker("d", need, workers, candidates)
        return
    if not fitting:
        with pytest.raises(errors.DeploymentDoesNotFit):
            assign_worker("d", need, workers, candidates)
        return
    chosen_addr = assign_worker("d", need, workers, candidates)
    (chosen,) = [w for w in allowed if w.address == chosen_addr]
    assert chosen.budget_bytes >= need
    assert all(key(chosen) <= key(w) for w in fitting)
    assert assign_worker("d", need, list(reversed(workers)), candidates) == chosen_addr


# --- ResidencyReport ----------------------------------------------------------------------------


def _report(**kw) -> ResidencyReport:
    base = dict(deployment="policy", version=3, tier="hbm", bytes=1234, load_s=0.25)
    return ResidencyReport(**{**base, **kw})


@pytest.mark.parametrize("tier", TIERS)
def test_report_accepts_every_tier(tier):
    assert _report(tier=tier).tier == tier


@pytest.mark.parametrize("tier", ["HBM", "gpu", "", "disk"])
def test_report_rejects_bad_tier(tier):
    with pytest.raises(ValueError, match="tier"):
        _report(tier=tier)


def test_event_schema_and_round_trip():
    r = _report(worker="tcp://w:1", uid="u-1", modified=True)
    event = r.to_event()
    # The schema of docs/architecture.md, "Residency reports", without `worker` (Dask adds it to worker events).
    assert event == {
        "deployment": "policy",
        "version": 3,
        "tier": "hbm",
        "bytes": 1234,
        "load_s": 0.25,
        "uid": "u-1",
        "modified": True,
        "lost": False,
        "source": "",
    }
    back = ResidencyReport.from_event({**event, "worker": "tcp://w:1"})
    assert back == r
    assert ResidencyReport.from_event(event) == dataclasses.replace(r, worker="")


def test_from_event_ignores_unknown_keys():
    event = {**_report().to_event(), "worker": "tcp://w:1", "topic": "x", "future_field": [1, 2]}
    back = ResidencyReport.from_event(event)
    assert back == _report(worker="tcp://w:1")


def test_from_event_still_validates_tier():
    with pytest.raises(ValueError):
        ResidencyReport.from_event({**_report().to_event(), "tier": "moon"})


# --- ResidencyMap -------------------------------------------------------------------------------


def test_map_apply_keeps_latest_per_deployment_and_worker():
    m = ResidencyMap()
    assert m.tier("a", "w1") == "absent" and m.get("a", "w1") is None
    m.apply(_report(deployment="a", worker="w1", tier="hbm", version=1))
    m.apply(_report(deployment="a", worker="w2", tier="dram", version=1))
    m.apply(_report(deployment="a", worker="w1", tier="dram", version=2))
    assert m.tier("a", "w1") == "dram" and m.get("a", "w1").version == 2
    assert m.tier("a", "w2") == "dram"
    assert [(r.deployment, r.worker) for r in m.reports()] == [("a", "w1"), ("a", "w2")]


def test_map_absent_removes():
    m = ResidencyMap()
    m.apply(_report(deployment="a", worker="w1", tier="hbm"))
    m.apply(_report(deployment="a", worker="w1", tier="absent", bytes=0))
    assert m.tier("a", "w1") == "absent" and m.get("a", "w1") is None
    assert m.reports() == []
    # Absent for something unknown is a no-op.
    m.apply(_report(deployment="zzz", worker="w9", tier="absent"))
    assert m.reports() == []


def test_map_forget_worker_and_deployment():
    m = ResidencyMap()
    for d in ("a", "b"):
        for w in ("w1", "w2"):
            m.apply(_report(deployment=d, worker=w))
    m.forget_worker("w1")
    assert [(r.deployment, r.worker) for r in m.reports()] == [("a", "w2"), ("b", "w2")]
    m.forget_deployment("a")
    assert [(r.deployment, r.worker) for r in m.reports()] == [("b", "w2")]
    m.forget_worker("nobody")
    m.forget_deployment("nothing")
    assert len(m.reports()) == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["apply", "forget_worker", "forget_deployment"]),
            st.sampled_from("abc"),
            st.sampled_from(["w1", "w2"]),
            st.sampled_from(TIERS),
            st.integers(0, 1000),
        ),
        max_size=40,
    )
)
def test_map_hbm_bytes_follow_every_change(steps):
    """The per-worker HBM total kept with each change equals the sum of the reports."""
    m = ResidencyMap()
    for op, d, w, tier, nbytes in steps:
        if op == "apply":
            m.apply(_report(deployment=d, worker=w, tier=tier, bytes=nbytes))
        elif op == "forget_worker":
            m.forget_worker(w)
        else:
            m.forget_deployment(d)
        for worker in ("w1", "w2"):
            assert m.hbm_bytes(worker) == m.bytes_by_tier(worker)["hbm"]


def test_map_bytes_by_tier():
    m = ResidencyMap()
    assert m.bytes_by_tier("w1") == {"hbm": 0, "dram": 0, "nvme": 0}
    m.apply(_report(deployment="a", worker="w1", tier="hbm", bytes=100))
    m.apply(_report(deployment="b", worker="w1", tier="hbm", bytes=50))
    m.apply(_report(deployment="c", worker="w1", tier="dram", bytes=7))
    m.apply(_report(deployment="d", worker="w1", tier="nvme", bytes=3))
    m.apply(_report(deployment="a", worker="w2", tier="hbm", bytes=1000))
    assert m.bytes_by_tier("w1") == {"hbm": 150, "dram": 7, "nvme": 3}
    assert m.bytes_by_tier("w2") == {"hbm": 1000, "dram": 0, "nvme": 0}
    # A transition moves the bytes between tiers; absent removes them.
    m.apply(_report(deployment="a", worker="w1", tier="dram", bytes=100))
    m.apply(_report(deployment="c", worker="w1", tier="absent", bytes=0))
    assert m.bytes_by_tier("w1") == {"hbm": 50, "dram": 100, "nvme": 3}
