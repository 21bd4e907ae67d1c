"""The policy core's dispatch rule: HRRS among per-deployment heads, urgent requests first,
atomic gangs, one request per worker; FIFO as the special case."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl_dask.policy.dispatch import DispatchPolicy, PendingRequest, select_releases
from plexrl_dask.policy.estimates import Estimates
from plexrl_dask.service.runtime import split_prompts

WORKERS = [f"w{i}" for i in range(6)]
HRRS = DispatchPolicy(setup_weight=2.0, patience_factor=8.0, patience_floor_s=2.0)


def req(name: str, *workers: str, ready: bool = True, dep: str = "", t: float = 0.0, s: float = 1.0, c: float = 0.0):
    return PendingRequest(name, tuple(workers), ready, dep or name, t, s, c)


def released(decisions) -> list[str]:
    return [d.request.request for d in decisions]


def test_fifo_per_worker_and_gangs_wait_for_all_their_workers():
    pending = [req("g", "w0", "w1"), req("a", "w1"), req("b", "w2")]
    assert released(select_releases(pending, busy={"w0"}, live=WORKERS)) == ["b"]
    assert released(select_releases(pending, busy=set(), live=WORKERS)) == ["g", "b"]


def test_not_ready_requests_reserve_nothing_and_dead_workers_skip():
    pending = [req("dep", "w0", ready=False), req("x", "w0"), req("gone", "w9")]
    assert released(select_releases(pending, busy=set(), live=WORKERS)) == ["x"]


def test_requests_of_one_deployment_keep_their_order():
    pending = [req("fb", "w0", dep="d", s=5.0), req("step", "w0", dep="d", s=0.01)]
    assert released(select_releases(pending, set(), WORKERS, now=0.5, policy=HRRS)) == ["fb"]
    # ... also when the head is not ready yet (waiting on a dependency).
    pending = [req("fb", "w0", dep="d", ready=False), req("step", "w0", dep="d")]
    assert released(select_releases(pending, set(), WORKERS, now=0.5, policy=HRRS)) == []


def test_short_overtakes_long_and_resident_beats_a_load():
    pending = [req("long", "w0", t=0.0, s=10.0), req("short", "w0", t=0.1, s=0.1)]
    assert released(select_releases(pending, set(), WORKERS, now=1.0, policy=HRRS)) == ["short"]
    assert released(select_releases(pending, set(), WORKERS, now=1.0, policy=DispatchPolicy.fifo())) == ["long"]
    pending = [req("cold", "w0", t=0.0, s=1.0, c=2.0), req("warm", "w0", t=0.2, s=1.0, c=0.0)]
    assert released(select_releases(pending, set(), WORKERS, now=0.5, policy=HRRS)) == ["warm"]


def test_an_urgent_gang_reserves_its_workers_against_fresh_singles():
    gang = req("gang", "w0", "w1", t=0.0, s=1.0)
    singles = [req(f"s{i}", "w1", t=30.0 + i, s=0.01) for i in range(3)]
    # Not yet urgent: the idle w1 goes to a single, the gang waits for w0.
    assert released(select_releases([gang, *singles], {"w0"}, WORKERS, now=5.0, policy=HRRS)) == ["s0"]
    # Urgent (waited > 8 * 1 + 2 s): w1 is reserved for it, nothing overtakes.
    assert released(select_releases([gang, *singles], {"w0"}, WORKERS, now=31.0, policy=HRRS)) == []
    decisions = select_releases([gang, *singles], set(), WORKERS, now=31.0, policy=HRRS)
    assert released(decisions) == ["gang"] and decisions[0].urgent


requests = st.lists(
    st.tuples(
        st.lists(st.sampled_from(WORKERS), min_size=1, max_size=3, unique=True),
        st.booleans(),
        st.sampled_from(["d0", "d1", "d2", "d3", "d4"]),
        st.floats(0.0, 50.0),
        st.floats(0.01, 10.0),
        st.floats(0.0, 5.0),
    ),
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(requests, st.sets(st.sampled_from(WORKERS)), st.sampled_from([HRRS, DispatchPolicy.fifo()]))
def test_properties(raw, busy, policy):
    pending = sorted(
        (req(f"r{i}", *ws, ready=ready, dep=dep, t=t, s=s, c=c) for i, (ws, ready, dep, t, s, c) in enumerate(raw)),
        key=lambda r: r.arrival,
    )
    now = 60.0
    decisions = select_releases(pending, busy, WORKERS, now, policy)
    used = [w for d in decisions for w in d.request.workers]
    assert len(used) == len(set(used))  # never two requests on one worker slot
    assert not set(used) & busy  # never on a busy worker
    assert all(d.request.ready for d in decisions)
    names = {d.request.request for d in decisions}
    for d in decisions:  # per-deployment order: nothing older of the same deployment waits
        earlier = pending[: pending.index(d.request)]
        assert all(e.deployment != d.request.deployment or e.request in names for e in earlier)
    # An urgent request is never overtaken on its workers by a later released one.
    for u in pending:
        if u.request in names or not u.ready or now - u.arrival < policy.patience(u):
            continue
        if u.deployment in {e.deployment for e in pending[: pending.index(u)]}:
            continue  # not a head
        for d in decisions:
            if d.request.arrival > u.arrival or not d.urgent:
                assert not set(d.request.workers) & set(u.workers)


def test_estimates_learn_from_observations_with_priors():
    est = Estimates(service_prior_s=1.0, load_bandwidth=1e9, weight=0.5)
    assert est.service("d", "fb") == 1.0 and est.setup("d", 2 * 10**9) == 2.0
    est.observe_service("d", "fb", 3.0)
    est.observe_service("d", "fb", 1.0)
    assert est.service("d", "fb") == pytest.approx(2.0)
    est.observe_load("d", 0.5)
    assert est.setup("d", 2 * 10**9) == 0.5
    est.forget("d")
    assert est.service("d", "fb") == 1.0


def test_request_workers_must_be_distinct():
    with pytest.raises(ValueError):
        PendingRequest("bad", ("w0", "w0"))


def test_prompt_split_follows_batch_boundaries():
    # n=4, batch 64 -> units of 16 prompts.
    assert split_prompts(40, 2, 4, 64) == [(0, 32), (32, 40)]
    assert split_prompts(10, 3, 4, 64) == [(0, 10)]
    assert split_prompts(100, 4, 1, 8) == [(0, 32), (32, 56), (56, 80), (80, 100)]
    # n=3, batch 8 -> units of 8 prompts (24 rows = 3 whole batches).
    assert split_prompts(17, 2, 3, 8) == [(0, 16), (16, 17)]
