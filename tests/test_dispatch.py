"""The policy core's dispatch rule: atomic gangs, one request per worker, no overtaking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl_dask.policy.dispatch import PendingRequest, select_releases
from plexrl_dask.service.runtime import split_prompts

WORKERS = [f"w{i}" for i in range(6)]


def req(name: str, *workers: str, ready: bool = True) -> PendingRequest:
    return PendingRequest(name, tuple(workers), ready)


def test_fifo_per_worker_and_gangs_wait_for_all_their_workers():
    pending = [req("g", "w0", "w1"), req("a", "w1"), req("b", "w2")]
    assert [r.request for r in select_releases(pending, busy={"w0"}, live=WORKERS)] == ["b"]
    assert [r.request for r in select_releases(pending, busy=set(), live=WORKERS)] == ["g", "b"]


def test_not_ready_requests_reserve_nothing_and_dead_workers_skip():
    pending = [req("dep", "w0", ready=False), req("x", "w0"), req("gone", "w9")]
    assert [r.request for r in select_releases(pending, busy=set(), live=WORKERS)] == ["x"]


def test_request_workers_must_be_distinct():
    with pytest.raises(ValueError):
        PendingRequest("bad", ("w0", "w0"))


requests = st.lists(
    st.tuples(st.lists(st.sampled_from(WORKERS), min_size=1, max_size=3, unique=True), st.booleans()),
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(requests, st.sets(st.sampled_from(WORKERS)))
def test_properties(raw, busy):
    pending = [req(f"r{i}", *ws, ready=ready) for i, (ws, ready) in enumerate(raw)]
    released = select_releases(pending, busy, WORKERS)
    used = [w for r in released for w in r.workers]
    assert len(used) == len(set(used))  # never two requests on one worker slot
    assert not set(used) & busy  # never on a busy worker
    assert all(r.ready for r in released)
    # No overtaking: a released request shares no worker with an earlier ready request that
    # was held back.
    order = {r.request: i for i, r in enumerate(pending)}
    released_names = {r.request for r in released}
    for r in released:
        for earlier in pending[: order[r.request]]:
            if earlier.ready and earlier.request not in released_names:
                assert not set(earlier.workers) & set(r.workers)


def test_prompt_split_follows_batch_boundaries():
    # n=4, batch 64 -> units of 16 prompts.
    assert split_prompts(40, 2, 4, 64) == [(0, 32), (32, 40)]
    assert split_prompts(10, 3, 4, 64) == [(0, 10)]
    assert split_prompts(100, 4, 1, 8) == [(0, 32), (32, 56), (56, 80), (80, 100)]
    # n=3, batch 8 -> units of 8 prompts (24 rows = 3 whole batches).
    assert split_prompts(17, 2, 3, 8) == [(0, 16), (16, 17)]
