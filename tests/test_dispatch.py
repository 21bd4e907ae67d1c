"""Runtime dispatch (:mod:`plexrl_dask.policy.dispatch`) and what it stands on.

- unit tests of :class:`Dispatcher` on hand-built requests: gangs, one request per worker,
  order heads, HRRS vs FIFO, residency-aware and blind choice, urgency and reservations,
  workers leaving and joining, hints;
- reference oracles written here from the module docstring, compared with hypothesis against
  the incremental implementation: greedy HRRS while nothing is urgent, and FIFO ("arrival order
  with reservations") for single-group requests;
- the simulator's checks (starvation bound, no overlaps, order) over random and adversarial
  workloads, and the adversarial facts HRRS is there for;
- per-tier :class:`Estimates`, :class:`SetupCosts` and :class:`ResidencyMap`.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from plexrl_dask.driver.deployment import split_prompts
from plexrl_dask.policy.dispatch import Decision, Dispatcher, DispatchPolicy, Request
from plexrl_dask.policy.estimates import DEFAULT_LOAD_BANDWIDTHS, Estimates, SetupCosts
from plexrl_dask.policy.residency import TIERS, ResidencyMap, ResidencyReport
from plexrl_dask.sim.queueing import (
    ADVERSARIAL,
    ClusterModel,
    burst,
    flood,
    gang_vs_singles,
    long_vs_short_stream,
    random_workload,
    simulate,
)

HRRS = DispatchPolicy()  # alpha 2, beta 8, floor 2 s
FIFO = DispatchPolicy.fifo()
CALM = DispatchPolicy(patience_floor_s=1e9)  # HRRS whose requests never turn urgent here
GB = 1_000_000_000


# --- helpers ---------------------------------------------------------------------------------


def _group(g: str | tuple[str, ...]) -> tuple[str, ...]:
    return (g,) if isinstance(g, str) else tuple(g)


def req(
    name: str,
    *groups: str | tuple[str, ...],
    t: float = 0.0,
    s: float = 1.0,
    order: str = "",
    dep: str = "",
) -> Request:
    """A request on ``groups`` (a worker name is a one-worker group)."""
    return Request(
        name,
        tuple(_group(g) for g in groups),
        arrival=t,
        service_s=s,
        order=order,
        deployment=dep or name,
    )


def names(decisions: list[Decision]) -> list[str]:
    return [d.request.request for d in decisions]


def occupy(d: Dispatcher, *workers: str, now: float = 0.0) -> None:
    """Start a blocker request on each of ``workers``."""
    for w in workers:
        d.add(req(f"busy-{w}", w, t=now, dep="blocker"))
    started = d.decide(now)
    assert sorted(names(started)) == sorted(f"busy-{w}" for w in workers)


class TableCosts:
    """``Costs`` from plain tables: setup per (deployment, worker), a group's is its slowest."""

    def __init__(
        self, setup: dict[tuple[str, str], float] | None = None, crowd: dict[str, int] | None = None
    ):
        self.setup = setup or {}
        self.crowd = crowd or {}

    def setup_s(self, deployment: str, group: tuple[str, ...]) -> float:
        return max(self.setup.get((deployment, w), 0.0) for w in group)

    def crowding(self, worker: str) -> int:
        return self.crowd.get(worker, 0)


def residency_costs(hbm: dict[str, list[str]], nbytes: int = GB) -> SetupCosts:
    """``SetupCosts`` with each deployment of ``hbm`` in HBM on the listed workers, absent
    elsewhere (every deployment ``nbytes``: an absent one costs ``nbytes / 0.5 GB/s``)."""
    rmap = ResidencyMap()
    for dep, workers in hbm.items():
        for w in workers:
            rmap.apply(ResidencyReport(dep, 0, "hbm", nbytes, 0.1, worker=w, source="absent"))
    return SetupCosts(rmap, Estimates(), lambda _: nbytes)


# --- Dispatcher: unit tests ------------------------------------------------------------------


def test_gang_starts_on_all_its_workers_in_one_decision_or_not_at_all():
    d = Dispatcher(CALM, workers=["w0", "w1", "w2"])
    occupy(d, "w0")
    d.add(req("gang", ("w0", "w1"), t=0.0))
    assert d.decide(0.5) == []
    assert d.busy == {"w0": "busy-w0"}  # the free w1 is not held by half a gang
    d.add(req("single", "w1", t=1.0))
    assert names(d.decide(1.0)) == ["single"]
    d.release_worker("w0")
    assert d.decide(2.0) == []  # w0 alone is not enough
    d.release_worker("w1")
    [dec] = d.decide(3.0)
    assert dec.request.request == "gang" and dec.group == ("w0", "w1")
    assert d.busy == {"w0": "gang", "w1": "gang"}
    assert len(d) == 0


def test_a_gang_holds_its_workers_for_its_next_request():
    """A rank that ends before its gang, and the gang's workers after its request, are held
    for the gang's next request (expected after the gap its requests left before): another
    job's request starts there only if it is expected to end in time; the gang's own job and
    urgent requests ignore the hold; a wake-up says when the hold ends."""

    def gang(name: str, t: float) -> Request:
        return Request(name, (("w0", "w1"),), t, 1.0, order="g", deployment="g", job="G")

    def single(name: str, t: float, s: float, job: str = "S") -> Request:
        return Request(name, (("w1",),), t, s, order=name, deployment=name, job=job)

    d = Dispatcher(replace(CALM, gang_hold_s=0.5), workers=["w0", "w1"])
    d.add(gang("g1", 0.0))
    assert names(d.decide(0.0)) == ["g1"]
    for w in ("w0", "w1"):
        d.release_worker(w, "g1", 1.0)
    d.add(gang("g2", 1.2))  # the gang's gap: 0.2 s
    assert names(d.decide(1.2)) == ["g2"]
    d.release_worker("w1", "g2", 1.5)  # rank 1 ends early; rank 0 is expected until 2.2
    d.add(single("long", 1.5, 1.0))  # would end at 2.5, after the hold (2.2 + 0.2)
    d.add(single("short", 1.5, 0.5))  # ends at 2.0: fits
    assert names(d.decide(1.5)) == ["short"]
    d.release_worker("w1", "short", 2.0)
    assert d.decide(2.0) == [] and d.next_wakeup(2.0) == pytest.approx(2.4)
    d.add(single("mine", 2.0, 1.0, job="G"))  # the gang's own job is not held back
    assert names(d.decide(2.0)) == ["mine"]
    d.release_worker("w1", "mine", 2.1)
    d.release_worker("w0", "g2", 2.2)  # the gang ended: its next request by 2.4
    assert d.decide(2.2) == [] and d.next_wakeup(2.2) == pytest.approx(2.4)
    d.add(gang("g3", 2.3))
    assert names(d.decide(2.3)) == ["g3"]
    for w in ("w0", "w1"):
        d.release_worker(w, "g3", 3.3)
    assert d.decide(3.3) == []  # held until 3.3 + 0.15 (the gaps' mean)
    assert names(d.decide(3.46)) == ["long"] and d.next_wakeup(3.46) is None
    # Without the hold, the long one takes the early rank's worker at once.
    d = Dispatcher(CALM, workers=["w0", "w1"])
    d.add(gang("g1", 0.0))
    d.decide(0.0)
    d.release_worker("w1", "g1", 0.5)
    d.add(single("long", 0.5, 1.0))
    assert names(d.decide(0.5)) == ["long"]
    # An urgent request ignores the hold.
    d = Dispatcher(DispatchPolicy(patience_floor_s=0.1, gang_hold_s=0.5), workers=["w0", "w1"])
    d.add(gang("g1", 0.0))
    d.decide(0.0)
    d.release_worker("w1", "g1", 0.5)
    d.add(single("long", 0.5, 1.0))
    assert d.decide(0.5) == []
    assert names(d.decide(0.5 + d.policy.patience(1.0, 0.0))) == ["long"]


def test_two_jobs_whose_turns_hold_one_worker_do_not_keep_each_other_out():
    """Two agentic jobs on one worker, each holding it between its turns (each gap learned
    though the other's requests were decided in it): a turn of either starts while the other
    holds it, and a third job's request still starts only in time for the earlier hold."""

    def turn(name: str, t: float, job: str, s: float = 0.2) -> Request:
        return Request(name, (("w0",),), t, s, order=job, deployment=job, job=job, holds=True)

    d = Dispatcher(replace(CALM, turn_hold_s=2.0), workers=["w0"])
    for name, t in (("A1", 0.0), ("B1", 0.2), ("A2", 1.2), ("B2", 1.4)):
        d.add(turn(name, t, name[0]))
        assert names(d.decide(t)) == [name]
        d.release_worker("w0", name, t + 0.2)
    assert d._holds.gap == {
        ("A", ("", True)): pytest.approx(1.0),
        ("B", ("", True)): pytest.approx(1.0),
    }
    # held by A until 2.4 and by B until 2.6 (as the scheduler's status shows it)
    assert d.holds(1.6) == {"w0": (pytest.approx(2.4), frozenset("AB"), frozenset("AB"))}
    d.add(Request("long", (("w0",),), 1.6, 1.0, order="C", deployment="C", job="C"))
    d.add(turn("B3", 1.6, "B", s=1.0))  # ends at 2.6, past A's hold
    assert names(d.decide(1.6)) == ["B3"]  # A's hold does not keep B out
    d.release_worker("w0", "B3", 2.6)
    assert names(d.decide(2.6)) == []  # B holds until 3.6: the long one waits
    assert names(d.decide(3.61)) == ["long"]


def test_a_turn_holds_its_worker_for_the_next_turn():
    """A request marked ``holds`` (an agentic turn, its tools running after it) holds its
    worker for its order's next request, for the gap its turns left before (capped at
    ``turn_hold_s``): another job's request starts there only if it is expected to end
    before then, and the next turn starts at once. The order's unmarked requests go on
    holding for the gap learned after them (none yet here), and the hold is dropped once it
    lapses; with ``turn_hold_s`` 0 nothing holds."""

    def turn(name: str, t: float, holds: bool = True) -> Request:
        return Request(name, (("w0",),), t, 0.2, order="a", deployment="a", job="A", holds=holds)

    def other(name: str, t: float, s: float) -> Request:
        return Request(name, (("w0",),), t, s, order=name, deployment=name, job="B")

    d = Dispatcher(replace(CALM, turn_hold_s=2.0), workers=["w0"])
    d.add(turn("t1", 0.0))
    assert names(d.decide(0.0)) == ["t1"]
    d.release_worker("w0", "t1", 0.2)
    d.add(turn("t2", 1.2))  # the tools took 1 s: the learned gap
    assert names(d.decide(1.2)) == ["t2"]
    d.release_worker("w0", "t2", 1.4)  # held until 2.4
    d.add(other("long", 1.4, 1.5))  # would end at 2.9
    d.add(other("short", 1.4, 0.5))  # ends at 1.9: fits
    assert names(d.decide(1.4)) == ["short"]
    d.release_worker("w0", "short", 1.9)
    assert d.decide(1.9) == [] and d.next_wakeup(1.9) == pytest.approx(2.4)
    d.add(turn("t3", 2.3, holds=False))  # the episode's last turn: no tools after it
    assert names(d.decide(2.3)) == ["t3"]
    d.release_worker("w0", "t3", 2.5)
    assert names(d.decide(2.5)) == ["long"]  # (no gap learned after an unmarked one yet)
    assert d.next_wakeup(2.5) is None and not d._holds.orders  # (no hold left behind)
    # Turned off mid-chain (the operator's set_policy): the hold goes at once.
    d = Dispatcher(replace(CALM, turn_hold_s=2.0), workers=["w0"])
    for name, t in (("t1", 0.0), ("t2", 1.2)):
        d.add(turn(name, t))
        d.decide(t)
        d.release_worker("w0", name, t + 0.2)
    d.add(other("long", 1.4, 1.5))
    assert d.decide(1.4) == []
    d.policy = replace(d.policy, turn_hold_s=0.0)
    assert names(d.decide(1.4)) == ["long"] and not d._holds.orders
    # Off: the long request takes the worker as soon as the turn ends.
    d = Dispatcher(CALM, workers=["w0"])
    for name, t in (("t1", 0.0), ("t2", 1.2)):
        d.add(turn(name, t))
        d.decide(t)
        d.release_worker("w0", name, t + 0.2)
    d.add(other("long", 1.4, 1.5))
    assert names(d.decide(1.4)) == ["long"]


def test_a_held_order_learns_its_gap_per_kind_of_request():
    """The gap after a chain's last turn (its driver scores) and after its training (its
    next turn is sent while the training runs: no gap) are learned apart, so while the
    training runs another job's request that would fit the scoring gap is not queued behind
    it (lookahead): the next turn is."""

    def mine(name: str, t: float, op: str, holds: bool = False) -> Request:
        return Request(
            name, (("w0",),), t, 0.2, order="a", deployment="a", op=op, job="A", holds=holds
        )

    d = Dispatcher(replace(CALM, turn_hold_s=2.0, lookahead=True), workers=["w0"])
    for step, t in ((0, 0.0), (1, 1.4)):
        d.add(mine(f"turn{step}", t, "sample", holds=True))
        assert names(d.decide(t)) == [f"turn{step}"]
        d.release_worker("w0", f"turn{step}", t + 0.2)
        d.add(mine(f"last{step}", t + 0.5, "sample"))  # its tools ran 0.3 s
        assert names(d.decide(t + 0.5)) == [f"last{step}"]
        d.release_worker("w0", f"last{step}", t + 0.7)
        if step == 1:
            d.add(Request("other", (("w0",),), 2.2, 0.45, order="b", deployment="b", job="B"))
            assert d.decide(2.2) == []  # ends at 2.65, after the scoring gap (2.1 + 0.5)
        d.add(mine(f"train{step}", t + 1.15, "train_step"))  # scored for 0.45 s
        assert names(d.decide(t + 1.15)) == [f"train{step}"]  # (and not "other" behind it)
        if step == 0:
            d.add(mine("turn1", 1.25, "sample", holds=True))  # sent while it trains
            assert d._holds.gap == {
                ("a", ("sample", True)): pytest.approx(0.3),
                ("a", ("sample", False)): pytest.approx(0.45),
                ("a", ("train_step", False)): 0.0,
            }
            d.remove("turn1")
            d.release_worker("w0", "train0", 1.35)
    assert d.queued == {}
    d.add(mine("turn2", 2.6, "sample", holds=True))
    assert names(d.decide(2.6)) == ["turn2"] and d.queued == {"w0": "turn2"}


def test_a_busy_workers_hold_is_its_holders_by_name_not_by_part_of_it():
    """Regression: the hold on a busy worker (lookahead) named its job and order as strings,
    so a job whose name is part of the holder's (``job-1`` of ``job-12``) passed for the
    holder and was queued behind its turn though it would run past the hold."""

    def turn(name: str, t: float) -> Request:
        return Request(
            name, (("w0",),), t, 0.2, order="a", deployment="a", job="job-12", holds=True
        )

    def other(name: str, t: float, s: float) -> Request:
        return Request(name, (("w0",),), t, s, order=name, deployment=name, job="job-1")

    d = Dispatcher(replace(CALM, turn_hold_s=2.0, lookahead=True), workers=["w0"])
    d.add(turn("t1", 0.0))
    assert names(d.decide(0.0)) == ["t1"]
    d.release_worker("w0", "t1", 0.2)
    d.add(turn("t2", 1.2))  # the tools took 1 s: the learned gap
    assert names(d.decide(1.2)) == ["t2"]  # runs until 1.4, then holds until 2.4
    d.add(other("long", 1.25, 1.5))  # would end at 2.9
    assert d.decide(1.25) == []
    d.add(other("short", 1.3, 0.5))  # ends at 1.9: queued behind the turn
    assert names(d.decide(1.3)) == ["short"] and d.queued == {"w0": "short"}


@pytest.mark.parametrize("policy", [HRRS, FIFO], ids=["hrrs", "fifo"])
def test_a_busy_worker_gets_nothing_until_it_is_released(policy):
    d = Dispatcher(policy, workers=["w0"])
    d.add(req("a", "w0", t=0.0))
    d.add(req("b", "w0", t=0.0))
    assert names(d.decide(0.0)) == ["a"]
    assert d.decide(50.0) == []  # b is urgent by now, still nothing on a busy worker
    assert d.busy == {"w0": "a"} and "b" in d
    d.release_worker("w0")
    d.release_worker("w0")  # releasing a free worker again changes nothing
    assert names(d.decide(51.0)) == ["b"]
    assert d.decide(52.0) == []


@pytest.mark.parametrize("policy", [HRRS, CALM, FIFO], ids=["hrrs", "calm", "fifo"])
def test_requests_of_one_order_run_in_arrival_order(policy):
    d = Dispatcher(policy, workers=["w0", "w1"])
    occupy(d, "w0")
    d.add(req("fb", "w0", t=0.0, s=5.0, order="o", dep="m"))
    d.add(req("step", "w1", t=0.1, s=0.01, order="o", dep="m"))
    # w1 is free and step is tiny, but only the head (fb) of the order is a candidate.
    assert d.decide(0.5) == []
    assert d.decide(40.0) == []
    d.release_worker("w0")
    # fb starts; step becomes the head and starts on the free w1 in the same decision.
    assert names(d.decide(41.0)) == ["fb", "step"]


@pytest.mark.parametrize(
    ("policy", "first"), [(HRRS, "short"), (FIFO, "long")], ids=["hrrs", "fifo"]
)
def test_short_overtakes_long_under_hrrs_but_not_under_fifo(policy, first):
    d = Dispatcher(policy, workers=["w0"])
    occupy(d, "w0")
    d.add(req("long", "w0", t=0.0, s=10.0))
    d.add(req("short", "w0", t=0.1, s=0.1))
    d.release_worker("w0")
    [dec] = d.decide(1.0)
    assert dec.request.request == first
    if policy is HRRS:
        assert not dec.urgent and dec.ratio == pytest.approx((0.9 + 0.1) / 0.1)
    else:
        assert dec.urgent and dec.wait_s == 1.0


@pytest.mark.parametrize(
    ("policy", "first"), [(HRRS, "warm"), (FIFO, "cold")], ids=["hrrs", "fifo"]
)
def test_a_resident_model_wins_over_one_that_needs_a_load(policy, first):
    costs = residency_costs({"warm": ["w0"]})  # cold: absent, 1 GB at 0.5 GB/s = 2 s
    d = Dispatcher(policy, costs, workers=["w0"])
    assert costs.setup_s("cold", ("w0",)) == pytest.approx(2.0)
    occupy(d, "w0")
    d.add(req("cold", "w0", t=0.0))
    d.add(req("warm", "w0", t=0.2))
    d.release_worker("w0")
    [dec] = d.decide(0.5)
    assert dec.request.request == first
    if first == "warm":
        assert dec.setup_s == 0.0 and dec.ratio == pytest.approx(1.3)
    else:
        assert dec.setup_s == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("policy", "group", "setup"),
    [
        (HRRS, ("w1",), 0.0),
        (FIFO, ("w1",), 0.0),
        (DispatchPolicy(choice="blind"), ("w0",), 2.0),
        (DispatchPolicy.fifo("blind"), ("w0",), 2.0),
    ],
    ids=["hrrs", "fifo", "hrrs-blind", "fifo-blind"],
)
def test_data_parallel_request_goes_to_its_resident_group_unless_blind(policy, group, setup):
    d = Dispatcher(policy, residency_costs({"m": ["w1"]}), workers=["w0", "w1", "w2"])
    d.add(req("dp", "w0", "w1", "w2", dep="m"))
    [dec] = d.decide(0.0)
    assert dec.group == group and dec.setup_s == pytest.approx(setup)


@pytest.mark.parametrize("policy", [HRRS, FIFO], ids=["hrrs", "fifo"])
def test_equal_setup_spreads_to_the_worker_with_fewest_models_in_hbm(policy):
    costs = residency_costs({"x": ["w0", "w2"], "y": ["w0", "w2"], "z": ["w0", "w1"]})
    assert [costs.crowding(w) for w in ("w0", "w1", "w2")] == [3, 1, 2]
    d = Dispatcher(policy, costs, workers=["w0", "w1", "w2"])
    d.add(req("dp", "w0", "w1", "w2", dep="new"))  # absent everywhere: equal setup
    [dec] = d.decide(0.0)
    assert dec.group == ("w1",)
    # With w1 taken, the next least crowded free worker.
    d.add(req("dp2", "w0", "w2", dep="new2"))
    assert [x.group for x in d.decide(0.0)] == [("w2",)]


def test_urgent_gang_reserves_its_workers_against_a_stream_of_singles():
    d = Dispatcher(HRRS, workers=["w0", "w1"])
    occupy(d, "w0")
    assert d.add(req("gang", ("w0", "w1"), t=0.0, s=1.0)) == pytest.approx(8 * 1.0 + 2.0)
    assert d.decide(0.0) == []
    # Before its patience (10 s) the free w1 goes to fresh singles.
    d.add(req("s1", "w1", t=1.0, s=0.1))
    assert names(d.decide(1.0)) == ["s1"]
    d.release_worker("w1")
    d.add(req("s2", "w1", t=2.0, s=0.1))
    assert names(d.decide(2.0)) == ["s2"] and not d.is_urgent("gang")
    # After it, w1 is reserved: the freed worker idles and the fresh single waits.
    d.release_worker("w1")
    d.add(req("s3", "w1", t=10.5, s=0.1))
    assert d.decide(10.5) == []
    assert d.is_urgent("gang") and "s3" in d and d.busy == {"w0": "busy-w0"}
    assert d.hint("w1", 10.5) == "gang"
    assert d.decide(11.0) == []
    # When its workers free, the gang starts on both, before the single.
    d.release_worker("w0")
    [dec] = d.decide(12.0)
    assert dec.request.request == "gang" and dec.group == ("w0", "w1") and dec.urgent
    assert dec.wait_s == 12.0
    d.release_worker("w0")
    d.release_worker("w1")
    assert names(d.decide(13.0)) == ["s3"]


def test_urgent_data_parallel_request_starts_on_another_free_unreserved_group():
    costs = TableCosts({("dp", "w0"): 0.0, ("dp", "w1"): 3.0})
    d = Dispatcher(HRRS, costs, workers=["w0", "w1"])
    occupy(d, "w0", "w1")
    assert d.add(req("dp", "w0", "w1", t=0.0, s=1.0)) == pytest.approx(10.0)  # cheapest setup 0
    assert d.decide(10.5) == [] and d.is_urgent("dp")  # reserves (w0,): cheapest setup
    d.add(req("fresh", "w1", t=10.5, s=0.1))  # resident, tiny: ratio 1 vs dp's 11.5 / 7
    d.release_worker("w1")
    [dec] = d.decide(11.0)
    assert dec.request.request == "dp" and dec.group == ("w1",) and dec.urgent
    assert dec.setup_s == 3.0
    assert "fresh" in d


def test_removed_worker_makes_an_urgent_reserver_choose_again():
    d = Dispatcher(HRRS, workers=["w0", "w1", "w2", "w3"])
    occupy(d, "w0", "w1", "w2", "w3")
    d.add(req("gang", ("w0", "w1"), ("w2", "w3"), t=0.0, s=1.0))
    assert d.decide(11.0) == [] and d.is_urgent("gang")  # reserved (w0, w1): the first
    # w2 is not reserved: a single may use it.
    d.release_worker("w2")
    d.add(req("s1", "w2", t=11.0, s=0.1))
    assert names(d.decide(11.0)) == ["s1"]
    # w0 leaves: the gang reserves (w2, w3) instead, and w2 now idles for it.
    d.remove_worker("w0")
    d.release_worker("w2")
    d.add(req("s2", "w2", t=12.0, s=0.1))
    assert d.decide(12.0) == []
    assert d.hint("w2", 12.0) == "gang"
    d.release_worker("w3")
    [dec] = d.decide(13.0)
    assert dec.request.request == "gang" and dec.group == ("w2", "w3") and dec.urgent


@pytest.mark.parametrize("policy", [HRRS, FIFO], ids=["hrrs", "fifo"])
def test_requests_only_on_dead_workers_wait_until_a_worker_joins(policy):
    d = Dispatcher(policy, workers=["w0", "w1"])
    d.add(req("lost", "w9", t=0.0))
    d.add(req("dp", "w1", "w0", t=0.0))
    d.remove_worker("w1")
    d.remove_worker("w1")  # twice: no-op
    decisions = d.decide(0.0)
    assert names(decisions) == ["dp"] and decisions[0].group == ("w0",)  # not on the dead w1
    assert d.decide(100.0) == [] and "lost" in d
    assert d.ratio(req("lost", "w9"), 100.0) == (0.0, math.inf)  # no live group
    d.add_worker("w9")
    [dec] = d.decide(101.0)
    assert dec.request.request == "lost" and dec.group == ("w9",)
    # A removed busy worker is free again only once it joins again.
    d.remove_worker("w9")
    d.release_worker("w9")
    d.add(req("later", "w9", t=102.0))
    assert d.decide(102.0) == []
    d.add_worker("w9")
    assert names(d.decide(103.0)) == ["later"]


def test_removing_a_head_promotes_the_next_of_its_order():
    d = Dispatcher(CALM, workers=["w0", "w1"])
    occupy(d, "w0")
    first = req("first", "w0", t=0.0, order="o")
    d.add(first)
    d.add(req("second", "w1", t=0.0, order="o"))
    assert d.decide(1.0) == []
    assert d.remove("first") == first
    assert d.remove("first") is None and "first" not in d
    assert names(d.decide(1.0)) == ["second"]


def test_removing_a_non_head_keeps_the_head():
    d = Dispatcher(CALM, workers=["w0", "w1"])
    occupy(d, "w0")
    d.add(req("a", "w0", order="o"))
    d.add(req("b", "w1", order="o"))
    d.add(req("c", "w1", order="o"))
    d.remove("b")
    assert [r.request for r in d.pending()] == ["a", "c"]
    d.release_worker("w0")
    assert names(d.decide(1.0)) == ["a", "c"]


def test_add_raises_an_arrival_older_than_its_orders_last():
    d = Dispatcher(CALM, workers=["w0"])
    occupy(d, "w0")
    d.add(req("a", "w0", t=5.0, order="o"))
    d.add(req("b", "w0", t=3.0, order="o"))
    d.add(req("c", "w0", t=1.0, order="other"))
    assert [(r.request, r.arrival) for r in d.pending()] == [("a", 5.0), ("b", 5.0), ("c", 1.0)]
    d.remove("a")
    d.remove("b")
    d.add(req("d", "w0", t=2.0, order="o"))  # the order is empty again: nothing to raise
    assert dict((r.request, r.arrival) for r in d.pending())["d"] == 2.0


def test_adding_a_pending_request_again_raises():
    d = Dispatcher(FIFO, workers=["w0"])
    d.add(req("a", "w9"))
    with pytest.raises(ValueError, match="already pending"):
        d.add(req("a", "w0"))
    d.add(req("b", "w0"))
    assert names(d.decide(0.0)) == ["b"]
    d.add(req("b", "w0"))  # started, so no longer pending: a new request of that name
    assert "b" in d


@pytest.mark.parametrize(
    "groups",
    [(), (("w0", "w0"),), ((),), (("w0",), ("w1", "w2"))],
    ids=["no-groups", "repeated-worker", "empty-group", "mixed-sizes"],
)
def test_request_rejects_malformed_groups(groups):
    with pytest.raises(ValueError):
        Request("r", groups)


@pytest.mark.parametrize("service", [0.0, -1.0, math.nan])
def test_request_rejects_non_positive_service(service):
    with pytest.raises(ValueError, match="service time"):
        Request("r", (("w0",),), service_s=service)


def test_request_order_defaults_to_the_request():
    assert Request("r", (("w0",),)).order_key == "r"
    assert Request("r", (("w0",),), order="o").order_key == "o"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(setup_weight=-1.0),
        dict(patience_factor=-0.1),
        dict(patience_floor_s=-2.0),
        dict(choice="random"),
    ],
)
def test_dispatch_policy_rejects_bad_knobs(kwargs):
    with pytest.raises(ValueError):
        DispatchPolicy(**kwargs)


def test_dispatch_policy_formulas_and_fifo():
    p = DispatchPolicy(setup_weight=2.0, patience_factor=8.0, patience_floor_s=2.0)
    assert p.ratio(3.0, 1.0, 0.5) == pytest.approx(4.0 / 2.0)
    assert p.ratio(-5.0, 1.0, 0.0) == 1.0  # a negative wait counts as 0
    assert p.patience(1.0, 0.5) == pytest.approx(8 * 1.5 + 2)
    f = DispatchPolicy.fifo("blind")
    assert (f.setup_weight, f.patience_factor, f.patience_floor_s, f.choice) == (
        0.0,
        0.0,
        0.0,
        "blind",
    )
    assert f.patience(100.0, 100.0) == 0.0
    assert Dispatcher().policy == DispatchPolicy.fifo()


def test_hint_names_the_top_urgent_reserver_else_the_best_head_else_nothing():
    policy = DispatchPolicy(setup_weight=10.0, patience_factor=0.0, patience_floor_s=1.0)
    costs = TableCosts({("heavy", "w0"): 5.0})
    d = Dispatcher(policy, costs, workers=["w0", "w1"])
    occupy(d, "w0", "w1")
    assert d.hint("w0", 0.0) is None
    d.add(req("slow", "w0", t=1.5, s=10.0, dep="slow"))
    d.add(req("quick", "w0", t=1.5, s=0.1, dep="quick"))
    assert d.hint("w0", 2.0) == "quick"  # by ratio: (0.5 + 0.1) / 0.1 > (0.5 + 10) / 10
    assert d.hint("w0", 1.5) == "slow"  # equal ratios (1): the earlier added
    assert d.hint("w1", 2.0) is None  # no head may run there
    # A gang needing a 5 s load on w0, urgent from t = 1, has the lowest ratio,
    # (2 + 1) / (1 + 10 * 5), but once it has reserved (w0, w1) its hint wins on both.
    d.add(req("gang", ("w0", "w1"), t=0.0, s=1.0, dep="heavy"))
    assert d.hint("w0", 2.0) == "quick" and d.hint("w1", 2.0) == "heavy"
    assert d.decide(2.0) == []
    assert d.is_urgent("gang") and not d.is_urgent("quick")
    assert d.hint("w0", 2.0) == "heavy" and d.hint("w1", 2.0) == "heavy"
    # A later urgent reserver of w0 queues behind it; the first in arrival order is named.
    d.add(req("next", "w0", t=0.5, s=1.0, dep="second"))
    assert d.decide(2.0) == [] and d.is_urgent("next")
    assert d.hint("w0", 2.0) == "heavy"
    d.remove("gang")
    assert d.hint("w0", 2.0) == "second" and d.hint("w1", 2.0) is None
    d.remove("next")
    assert d.hint("w0", 2.0) == "quick"
    d.add(req("anon", "w1", t=2.0, dep="x"))
    assert d.hint("w1", 2.0) == "x"


def test_hint_of_a_request_without_deployment_is_none():
    d = Dispatcher(CALM, workers=["w0"])
    occupy(d, "w0")
    d.add(Request("r", (("w0",),)))
    assert d.hint("w0", 0.0) is None


def test_decision_to_dict():
    d = Dispatcher(HRRS, TableCosts({("m", "w1"): 0.5}), workers=["w0", "w1"])
    d.add(
        Request(
            "r",
            (("w0", "w1"),),
            arrival=1.0,
            service_s=2.0,
            order="o",
            deployment="m",
            op="fb",
            job="j",
        )
    )
    [dec] = d.decide(3.0)
    assert dec.to_dict() == {
        "request": "r",
        "deployment": "m",
        "op": "fb",
        "job": "j",
        "workers": ["w0", "w1"],
        "wait_s": 2.0,
        "ratio": pytest.approx((2.0 + 2.0) / (2.0 + 2 * 0.5)),
        "service_s": 2.0,
        "setup_s": 0.5,
        "urgent": False,
        "behind": None,
        "tag": 0.0,
    }


# --- regressions: bugs found by these tests, fixed ---------------------------------------


def test_fifo_next_head_of_an_order_goes_before_a_younger_request():
    d = Dispatcher(FIFO, workers=["w0", "w1"])
    occupy(d, "w0", "w1")
    d.add(req("a1", "w0", t=0.1, order="A"))
    d.add(req("a2", "w1", t=0.2, order="A"))
    d.add(req("b1", "w1", t=0.5, order="B"))
    assert d.decide(0.5) == []
    d.release_worker("w0")
    d.release_worker("w1")
    assert names(d.decide(1.0)) == ["a1", "a2"]


def test_fifo_releases_every_request_as_urgent():
    d = Dispatcher(FIFO, workers=["w0", "w1"])
    d.add(req("a1", "w0", order="A"))
    d.add(req("a2", "w1", order="A"))
    decisions = d.decide(0.0)
    assert names(decisions) == ["a1", "a2"]
    assert [x.urgent for x in decisions] == [True, True]


def test_head_made_by_an_urgent_start_competes_by_ratio_in_the_same_decision():
    d = Dispatcher(HRRS, workers=["w0", "w1", "w2"])
    occupy(d, "w0", "w1", "w2")
    d.add(req("U", "w2", "w0", t=0.0, s=1.0, order="o"))  # urgent at 10, reserves (w2,)
    d.add(req("N", "w1", t=10.5, s=0.1, order="o"))  # patience 2.8: not urgent at 11
    d.add(req("C", "w1", t=10.0, s=5.0))
    assert d.decide(10.5) == [] and d.is_urgent("U")
    d.release_worker("w0")
    d.release_worker("w1")
    decisions = d.decide(11.0)
    # U starts on the free (w0,) it did not reserve; then N, (0.5 + 0.1) / 0.1 = 6, beats C,
    # (1 + 5) / 5 = 1.2, on w1.
    assert [(x.request.request, x.group) for x in decisions] == [("U", ("w0",)), ("N", ("w1",))]


def test_request_added_again_is_not_urgent_before_its_own_patience():
    d = Dispatcher(DispatchPolicy(patience_factor=0.0, patience_floor_s=10.0), workers=["w0"])
    occupy(d, "w0")
    d.add(req("x", "w0", t=0.0))  # urgent at 10
    d.remove("x")
    d.add(req("x", "w0", t=8.0))  # urgent at 18
    assert d.decide(12.0) == []
    assert not d.is_urgent("x")


@pytest.mark.parametrize("field", ["setup_weight", "patience_factor", "patience_floor_s"])
def test_dispatch_policy_rejects_nan(field):
    with pytest.raises(ValueError):
        DispatchPolicy(**{field: math.nan})


# --- reference oracles -----------------------------------------------------------------------

ORACLE_WORKERS = ("w0", "w1", "w2", "w3", "w4")
MODELS = ("m0", "m1", "m2")


class Model:
    """The state an oracle needs: pending queues per order, live and busy workers."""

    def __init__(self, policy: DispatchPolicy, costs, workers) -> None:
        self.policy, self.costs = policy, costs
        self.live, self.busy = set(workers), set()
        self.busy_until: dict[str, float] = {}  # worker -> estimated end (start + setup + service)
        self.queues: dict[str, list[Request]] = {}
        self.last: dict[str, float] = {}  # the order's last arrival while it has pending requests
        self.seq: dict[str, int] = {}
        self.counter = itertools.count()

    def add(self, r: Request) -> None:
        order = r.order_key
        if order in self.last and r.arrival < self.last[order]:
            r = replace(r, arrival=self.last[order])
        self.last[order] = r.arrival
        self.queues.setdefault(order, []).append(r)
        self.seq[r.request] = next(self.counter)

    def remove(self, rid: str) -> None:
        for order, q in list(self.queues.items()):
            q[:] = [r for r in q if r.request != rid]
            if not q:
                del self.queues[order]
                self.last.pop(order, None)

    def start(self, r: Request, group, end: float | None = None) -> None:
        self.remove(r.request)
        self.busy |= set(group)
        for w in group:
            if end is None:
                self.busy_until.pop(w, None)
            else:
                self.busy_until[w] = end

    def release(self, worker: str) -> None:
        self.busy.discard(worker)
        self.busy_until.pop(worker, None)

    def waits_for_its_own(self, r: Request, free_setup: float, now: float) -> bool:
        """The residency-aware choice: a head skips the free group if one of its busy groups is
        expected to free up and set it up sooner (nothing is reserved in this oracle)."""
        if self.policy.choice == "blind" or len(r.groups) < 2:
            return False
        free = self.live - self.busy
        for g in r.groups:
            if set(g) <= free or not set(g) <= self.live:
                continue
            if any(w in self.busy and w not in self.busy_until for w in g):
                continue
            wait = max(max(0.0, self.busy_until.get(w, now) - now) for w in g)
            if wait + self.costs.setup_s(r.deployment or r.order_key, g) < free_setup:
                return True
        return False

    def pending(self) -> list[Request]:
        return sorted(
            (r for q in self.queues.values() for r in q), key=lambda r: self.seq[r.request]
        )

    def greedy(self, now: float, _decisions=None) -> list[tuple]:
        """HRRS with no urgent request, from scratch: among heads not yet passed over, the one
        of highest ratio (ties: earlier arrival, then earlier add) goes next. If it has a free
        group it may use (free, and ending before any hold on its workers; cheapest setup, then
        least crowded, then first; blind: the first) and does not rather wait for a busy group
        of its own, it starts there; otherwise (ratio at its cheapest live group) it holds the
        free workers of the group it can start on soonest until that group's busy workers end,
        and is passed over. A start can change what a passed-over head would do (it may have
        taken the busy group that head waited for, or changed which group it starts on
        soonest), so after each start every head is looked at again.

        Like ``Dispatcher.decide``, the pass is repeated, its holds made afresh, until it
        starts nothing: a decision releases everything that may start now, so deciding again
        at the same instant releases nothing (and a hold made before a head of higher ratio
        became a head does not bind that head)."""
        out: list[tuple] = []
        while step := self._greedy_pass(now):
            out += step
        return out

    def _greedy_pass(self, now: float) -> list[tuple]:
        """One pass of :meth:`greedy`."""
        out = []
        held: dict[str, float] = {}
        passed: set[str] = set()
        inf = float("inf")
        while True:
            free = self.live - self.busy
            best = None
            for q in self.queues.values():
                r = q[0]
                if r.request in passed:
                    continue
                options = [
                    (
                        self.costs.setup_s(r.deployment or r.order_key, g),
                        sum(self.costs.crowding(w) for w in g),
                        i,
                        g,
                    )
                    for i, g in enumerate(r.groups)
                    if set(g) <= free
                    and all(
                        now + self.costs.setup_s(r.deployment or r.order_key, g) + r.service_s
                        <= held.get(w, inf)
                        for w in g
                    )
                ]
                group = None
                if options:
                    setup, _, _, group = (
                        options[0] if self.policy.choice == "blind" else min(options)
                    )
                    if self.waits_for_its_own(r, setup, now):
                        group = None
                if group is None:
                    live = [g for g in r.groups if set(g) <= self.live]
                    if not live:
                        continue
                    setup = min(self.costs.setup_s(r.deployment or r.order_key, g) for g in live)
                ratio = self.policy.ratio(now - r.arrival, r.service_s, setup)
                key = (-ratio, r.arrival, self.seq[r.request])
                if best is None or key < best[0]:
                    best = (key, r, group, setup, ratio)
            if best is None:
                return out
            _, r, group, setup, ratio = best
            if group is not None:
                self.start(r, group, now + setup + r.service_s)
                out.append((r.request, group, setup, ratio, False))
                passed.clear()
                continue
            passed.add(r.request)
            soonest = None
            for i, g in enumerate(r.groups):
                if not set(g) <= self.live:
                    continue
                start = max(max(now, self.busy_until.get(w, now)) for w in g)
                key = (start + self.costs.setup_s(r.deployment or r.order_key, g), i)
                if soonest is None or key < soonest[0]:
                    soonest = (key, g, start)
            if soonest is not None and soonest[2] > now:
                for w in soonest[1]:
                    if w in free:
                        held[w] = min(held.get(w, inf), soonest[2])

    def fifo(self, now: float, _decisions=None) -> list[tuple]:
        """FIFO, single-group requests: in arrival order (then add order), each head that has
        arrived reserves its group if all its workers live (nothing otherwise) and starts if no
        worker of the group is busy or reserved by an earlier request; otherwise its order
        waits."""
        out = []
        taken = set(self.busy)
        waiting: set[str] = set()
        for r in sorted(self.pending(), key=lambda r: (r.arrival, self.seq[r.request])):
            order, group = r.order_key, r.groups[0]
            if order in waiting:
                continue
            waiting.add(order)
            if r.arrival > now or not set(group) <= self.live:
                continue
            if not set(group) & taken:
                self.start(r, group)
                out.append(
                    (
                        r.request,
                        group,
                        0.0,
                        self.policy.ratio(now - r.arrival, r.service_s, 0.0),
                        True,
                    )
                )
                waiting.discard(order)
            taken |= set(group)
        return out


def _groups(k: int, max_groups: int):
    group = st.lists(st.sampled_from(ORACLE_WORKERS), min_size=k, max_size=k, unique=True).map(
        tuple
    )
    return st.lists(group, min_size=1, max_size=max_groups).map(tuple)


def ops(max_groups: int, orders):
    """Random event sequences: steps of a few arrivals (up to 1.5 s before they are added, so
    arrivals within an order may need raising), a few workers freed, now and then a request
    removed or a worker leaving or joining, then time advancing and a decision."""
    add = st.tuples(
        st.just("add"),
        st.integers(1, 2).flatmap(lambda k: _groups(k, max_groups)),
        orders,
        st.sampled_from(MODELS),
        st.sampled_from([0.0, 0.5, 1.5]),
        st.sampled_from([0.1, 0.5, 1.0, 2.0, 4.0]),
    )
    extra = st.tuples(
        st.sampled_from(["none"] * 5 + ["remove", "kill", "revive"]),
        st.integers(0, 40),
        st.sampled_from(ORACLE_WORKERS),
    ).map(lambda x: [] if x[0] == "none" else [(x[0], x[1] if x[0] == "remove" else x[2])])
    step = st.tuples(
        extra,
        st.lists(add, max_size=3),
        st.lists(st.sampled_from(ORACLE_WORKERS), max_size=3).map(
            lambda ws: [("release", w) for w in ws]
        ),
        st.sampled_from([0.0, 0.25, 1.0, 3.0]).map(lambda dt: [("decide", dt)]),
    ).map(lambda parts: [ev for part in parts for ev in part])
    return st.lists(step, min_size=1, max_size=25).map(
        lambda steps: [ev for s in steps for ev in s]
    )


def residencies():
    """A random residency map and per-model sizes, as ``SetupCosts``."""
    tiers = st.dictionaries(
        st.tuples(st.sampled_from(MODELS), st.sampled_from(ORACLE_WORKERS)),
        st.sampled_from(TIERS),
        max_size=15,
    )
    sizes = st.lists(st.sampled_from([0, GB, 4 * GB]), min_size=len(MODELS), max_size=len(MODELS))
    return st.builds(setup_costs, tiers, sizes)


def setup_costs(tiers: dict[tuple[str, str], str], sizes: list[int]) -> SetupCosts:
    """``SetupCosts`` with deployment ``m`` in ``tiers[m, w]`` on worker ``w`` (absent where not
    listed), model ``MODELS[i]`` of ``sizes[i]`` bytes."""
    rmap = ResidencyMap()
    for (m, w), tier in sorted(tiers.items()):
        rmap.apply(ResidencyReport(m, 0, tier, 0, 0.0, worker=w))
    by_model = dict(zip(MODELS, sizes, strict=True))
    return SetupCosts(rmap, Estimates(), lambda m: by_model.get(m, 0))


def replay(events, dispatcher: Dispatcher, model: Model, oracle) -> None:
    """Apply ``events`` to both; at each decision compare the releases (and check that a second
    decision at the same instant releases nothing); after each event, the pending requests (with
    their arrivals, as raised) and the busy workers."""
    now, added = 0.0, []
    for ev in events:
        kind = ev[0]
        if kind == "add":
            _, groups, order, dep, lag, service = ev
            r = Request(
                f"r{len(added)}",
                groups,
                arrival=now - lag,
                service_s=service,
                order=order,
                deployment=dep,
            )
            added.append(r.request)
            dispatcher.add(r)
            model.add(r)
        elif kind == "decide":
            now += ev[1]
            decisions = dispatcher.decide(now)
            got = [(d.request.request, d.group, d.setup_s, d.ratio, d.urgent) for d in decisions]
            assert got == oracle(model, now, decisions)
            assert dispatcher.decide(now) == []
        elif kind == "release":
            dispatcher.release_worker(ev[1])
            model.release(ev[1])
        elif kind == "remove":
            if added:
                rid = added[ev[1] % len(added)]
                dispatcher.remove(rid)
                model.remove(rid)
        elif kind == "kill":
            dispatcher.remove_worker(ev[1])
            model.live.discard(ev[1])
            model.release(ev[1])
        else:
            dispatcher.add_worker(ev[1])
            model.live.add(ev[1])
        assert [(r.request, r.arrival) for r in dispatcher.pending()] == [
            (r.request, r.arrival) for r in model.pending()
        ]
        assert set(dispatcher.busy) == model.busy


@settings(max_examples=150, deadline=None)
@given(
    ops(max_groups=3, orders=st.sampled_from(["", "", "o0", "o1", "o2"])),
    residencies(),
    st.sampled_from([0.0, 0.5, 2.0, 10.0]),
    st.sampled_from([0.0, 8.0]),
    st.sampled_from(["residency", "blind"]),
)
# Regressions (the oracle lagged the documented rule; the dispatcher was right). A read waits
# for its replica (w0 free, w1 overdue: no hold), a lower-ratio single then takes w0, so the read
# no longer waits and loads on w2+w4 in the same decision.
@example(
    events=[
        ("add", (("w0", "w1"),), "", "m0", 0.0, 0.1),
        ("decide", 0.0),
        ("release", "w0"),
        ("decide", 3.0),
        ("add", (("w0",),), "", "m0", 0.0, 4.0),
        ("add", (("w2", "w4"), ("w0", "w1")), "", "m0", 0.0, 0.1),
        ("decide", 0.25),
    ],
    costs=setup_costs({("m0", "w0"): "nvme", ("m0", "w1"): "hbm"}, [4 * GB, 0, 0]),
    alpha=0.0,
    beta=8.0,
    choice="residency",
)
# A start on w3 makes the blocked r2 start soonest on w0+w4 instead: it holds w4 against r4.
@example(
    events=[
        ("add", (("w0",),), "", "m2", 0.0, 0.1),
        ("add", (("w0", "w1"),), "", "m0", 0.0, 0.1),
        ("add", (("w0", "w4"), ("w3", "w1")), "", "m0", 0.0, 0.1),
        ("add", (("w3",),), "", "m0", 0.0, 0.1),
        ("add", (("w4",),), "", "m0", 0.0, 0.1),
        ("decide", 0.0),
    ],
    costs=setup_costs({}, [GB, 0, 0]),
    alpha=0.0,
    beta=0.0,
    choice="residency",
)
# r3 becomes a head (r1 started) after the gang r2 held w1; r3 has the higher ratio, so that
# hold does not bind it: it starts (in the dispatcher's next pass of the same decision).
@example(
    events=[
        ("add", (("w0",),), "", "m0", 0.0, 0.1),
        ("decide", 0.0),
        ("add", (("w2",),), "o0", "m0", 0.0, 0.1),
        ("add", (("w0", "w1"),), "", "m0", 0.0, 0.5),
        ("add", (("w1",),), "o0", "m0", 0.0, 1.0),
        ("decide", 0.0),
    ],
    costs=setup_costs({}, [GB, 0, 0]),
    alpha=0.5,
    beta=0.0,
    choice="residency",
)
def test_hrrs_matches_greedy_oracle_while_nothing_is_urgent(events, costs, alpha, beta, choice):
    policy = DispatchPolicy(
        setup_weight=alpha, patience_factor=beta, patience_floor_s=1e9, choice=choice
    )
    d = Dispatcher(policy, costs, ORACLE_WORKERS)
    replay(events, d, Model(policy, costs, ORACLE_WORKERS), Model.greedy)


@settings(max_examples=120, deadline=None)
@given(ops(max_groups=1, orders=st.just("")), st.sampled_from(["residency", "blind"]))
def test_fifo_matches_arrival_order_oracle_for_single_group_requests(events, choice):
    policy = DispatchPolicy.fifo(choice)
    d = Dispatcher(policy, workers=ORACLE_WORKERS)
    replay(events, d, Model(policy, d.costs, ORACLE_WORKERS), Model.fifo)


@settings(max_examples=100, deadline=None, derandomize=True, database=None, phases=[Phase.generate])
@given(ops(max_groups=1, orders=st.sampled_from(["o0", "o1", "o2"])))
def test_fifo_matches_arrival_order_oracle_with_shared_orders(events):
    d = Dispatcher(FIFO, workers=ORACLE_WORKERS)
    replay(events, d, Model(FIFO, d.costs, ORACLE_WORKERS), Model.fifo)


def safety(model: Model, now: float, decisions: list[Decision]) -> list[tuple]:
    """Not an oracle of which requests start, but what every decision must satisfy: heads
    only, on one of their groups, on free live workers, one request per worker."""
    for dec in decisions:
        r = dec.request
        assert model.queues[r.order_key][0] == r
        assert dec.group in r.groups
        assert set(dec.group) <= model.live - model.busy
        model.start(r, dec.group)
    return [(x.request.request, x.group, x.setup_s, x.ratio, x.urgent) for x in decisions]


def urgency_policies(lookahead: bool = False, floors=(0.0, 0.5, 2.0)):
    """HRRS policies whose requests turn urgent soon, late or (floor 1e9) never."""
    return st.builds(
        DispatchPolicy,
        setup_weight=st.sampled_from([0.0, 2.0]),
        patience_factor=st.sampled_from([0.0, 1.0, 8.0]),
        patience_floor_s=st.sampled_from(floors),
        choice=st.sampled_from(["residency", "blind"]),
        lookahead=st.just(lookahead),
    )


@settings(max_examples=100, deadline=None)
@given(
    ops(max_groups=3, orders=st.sampled_from(["", "o0", "o1"])), residencies(), urgency_policies()
)
def test_decisions_with_urgency_start_heads_on_free_groups_only(events, costs, policy):
    d = Dispatcher(policy, costs, ORACLE_WORKERS)
    replay(events, d, Model(policy, costs, ORACLE_WORKERS), safety)


# --- simulated workloads ---------------------------------------------------------------------

POLICIES = {"hrrs": HRRS, "fifo": FIFO, "fifo-blind": DispatchPolicy.fifo("blind")}

hrrs_policies = st.builds(
    DispatchPolicy,
    setup_weight=st.floats(0.0, 10.0),
    patience_factor=st.floats(0.0, 30.0),
    patience_floor_s=st.floats(0.0, 20.0),
    choice=st.sampled_from(["residency", "blind"]),
    fair_share=st.booleans(),
    job_weights=st.sampled_from([(), (("j0", 3.0),), (("j1", 0.25), ("A", 2.0))]),
    gang_hold_s=st.sampled_from([0.0, 0.5, 5.0]),
    turn_hold_s=st.sampled_from([0.0, 0.5, 5.0]),
)
any_policy = st.one_of(st.sampled_from(list(POLICIES.values())), hrrs_policies)


def check_promises(workload, result) -> None:
    assert len(result.records) == len(workload)
    for rec in result.records:
        assert math.isfinite(rec.start) and math.isfinite(rec.finish)
        assert rec.start >= rec.request.arrival - 1e-9 and rec.finish > rec.start
        assert rec.group in rec.request.groups
    assert result.max_wait_over_bound() <= 1 + 1e-9
    assert result.overlaps() == []
    assert result.order_violations() == []


def _as_turns(workload):
    """The workload with its single-worker samples marked as agentic turns (``holds``)."""
    return [
        replace(r, request=replace(r.request, holds=True))
        if r.request.op == "sample" and len(r.request.groups) == 1
        else r
        for r in workload
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([(6, 150), (2, 40), (4, 80)]),
    any_policy,
    st.booleans(),
)
def test_random_workloads_keep_the_dispatch_promises(seed, size, policy, turns):
    cluster, workload = random_workload(seed, *size)
    if turns:
        workload = _as_turns(workload)
    check_promises(workload, simulate(workload, cluster, policy))


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("name", ADVERSARIAL)
def test_adversarial_workloads_keep_the_dispatch_promises(name, policy):
    cluster, workload = ADVERSARIAL[name]()
    check_promises(workload, simulate(workload, cluster, policy))


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(sorted(ADVERSARIAL)), hrrs_policies)
def test_adversarial_workloads_keep_the_promises_under_any_hrrs_parameters(name, policy):
    cluster, workload = ADVERSARIAL[name]()
    check_promises(workload, simulate(workload, cluster, policy))


def _records(workload_fn, policy):
    cluster, workload = workload_fn()
    return {r.request.request: r for r in simulate(workload, cluster, policy).records}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_gang_starts_against_a_stream_of_singles(policy):
    gang = _records(gang_vs_singles, policy)["gang"]
    assert math.isfinite(gang.start) and gang.group == ("w0", "w1")
    assert gang.wait < gang.patience + 0.5  # its patience, then one single (0.45 s) per worker


def test_short_requests_overtake_a_long_one_under_hrrs_only():
    def overtakers(policy) -> list[str]:
        recs = _records(long_vs_short_stream, policy)
        long = recs["long"]
        return [
            name
            for name, r in recs.items()
            if name.startswith("short")
            and r.request.arrival > long.request.arrival
            and r.start < long.start
        ]

    assert len(overtakers(HRRS)) > 0
    assert overtakers(FIFO) == []


def test_flood_delays_the_other_jobs_first_request_less_under_hrrs():
    hrrs, fifo = _records(flood, HRRS)["b0"], _records(flood, FIFO)["b0"]
    assert hrrs.wait < fifo.wait


def test_share_tags_interleave_jobs_follow_weights_and_orders():
    d = Dispatcher(DispatchPolicy(patience_floor_s=1e9, job_weights=(("W", 2.0),)), workers=["w0"])
    occupy(d, "w0")
    for i in range(3):
        d.add(replace(req(f"a{i}", "w0"), job="A"))
    d.add(replace(req("b0", "w0"), job="B"))
    d.add(replace(req("w0-0", "w0"), job="W"))
    d.add(replace(req("w0-1", "w0"), job="W"))
    assert [d.tag(r) for r in ("a0", "a1", "a2", "b0", "w0-0", "w0-1")] == [0, 1, 2, 0, 0, 0.5]
    # an order shared by two jobs never goes back: B's next request on A's order follows a2
    d.add(replace(req("a3", "w0", order="oa"), job="A"))
    d.add(replace(req("b1", "w0", order="oa"), job="B"))
    assert d.tag("a3") == 3 and d.tag("b1") == 3 and d.tag("nope") is None
    assert d.clock == 0
    for r in ("a0", "b0", "w0-0"):
        d.remove(r)
    assert d.clock == 0.5  # the smallest pending tag; a job idle until now starts there
    d.add(replace(req("c0", "w0"), job="C"))
    assert d.tag("c0") == 0.5
    assert DispatchPolicy.fifo().fair_share is False
    with pytest.raises(ValueError):
        DispatchPolicy(job_weights=(("A", 0.0),))


def test_urgent_requests_go_in_share_order_not_arrival_order():
    d = Dispatcher(DispatchPolicy(patience_factor=0.0, patience_floor_s=0.0), workers=["w0"])
    occupy(d, "w0")
    for i in range(4):
        d.add(replace(req(f"a{i}", "w0", t=0.1 * i), job="A"))
    d.add(replace(req("b0", "w0", t=0.5), job="B"))
    started = []
    for t in range(1, 7):
        d.release_worker("w0")
        started += names(d.decide(float(t)))
    assert started == ["a0", "b0", "a1", "a2", "a3"]


def _burst_waits(policy: DispatchPolicy, n_burst: int) -> dict[str, float]:
    cluster, workload = burst(n_burst)
    result = simulate(workload, cluster, policy)
    assert result.max_wait_over_bound() <= 1 + 1e-9
    recs = {r.request.request: r for r in result.records}
    b_max = max(r.finish - r.start for r in recs.values())
    p_max = max(r.patience for r in recs.values())
    waits = {name: r.wait for name, r in recs.items() if name.startswith("b")}
    for k, name in enumerate(sorted(waits), start=1):
        if policy.fair_share:  # dispatch's "What a flood can do", two jobs of weight 1
            assert waits[name] <= p_max + 4 * k * b_max + 1e-9
    return waits


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_burst_delays_another_jobs_requests_by_the_share_bound_not_its_length(lookahead):
    """Job B's five requests behind job A's burst: in share order they wait about their
    patience whatever the burst's length; in arrival order, behind the whole burst."""
    fair = DispatchPolicy(lookahead=lookahead)
    arrival = DispatchPolicy(lookahead=lookahead, fair_share=False)
    short, long = (max(_burst_waits(fair, n).values()) for n in (500, 2000))
    assert long < short * 1.05
    unfair_short, unfair_long = (max(_burst_waits(arrival, n).values()) for n in (500, 2000))
    assert unfair_long > 3.5 * unfair_short
    assert short < unfair_short and long < unfair_long / 6


# --- estimates, setup costs, residency -------------------------------------------------------


def test_service_estimate_starts_at_the_prior_then_follows_an_ewma():
    est = Estimates(service_prior_s=1.5, weight=0.5)
    assert est.service("d", "fb") == 1.5
    est.observe_service("d", "fb", 3.0)
    assert est.service("d", "fb") == 3.0  # the first observation replaces the prior
    est.observe_service("d", "fb", 1.0)
    assert est.service("d", "fb") == pytest.approx(2.0)
    assert est.service("e", "fb") == 1.5  # (and "d", "step": d's other ops, below)
    assert est.service("d", "step") == pytest.approx(2.0)
    est.observe_service("d", "step", 0.0)
    assert est.service("d", "step") == pytest.approx(1e-6)  # clamped above 0
    est.forget("d")
    assert est.service("d", "fb") == 1.5


def test_an_unseen_service_is_estimated_from_its_op_elsewhere_then_its_other_ops():
    """A (deployment, op) not yet observed: its bytes times the seconds per byte its op took
    on the other deployments; else its own other ops; else any op's seconds per byte; the
    prior only without bytes or observations."""
    est = Estimates(service_prior_s=1.0, weight=0.5)
    assert est.service("new", "sample", 1000) == 1.0
    est.observe_service("a", "load", 0.4, nbytes=1000)  # 4e-4 s a byte
    assert est.service("new", "sample", 500) == pytest.approx(0.2)  # any op's rate
    est.observe_service("a", "sample", 0.02, nbytes=1000)  # 2e-5 s a byte
    est.observe_service("b", "sample", 0.06, nbytes=1000)  # 6e-5: EWMA 4e-5
    assert est.service("new", "sample", 2000) == pytest.approx(0.08)
    assert est.service("b", "train", 1000) == pytest.approx(0.06)  # b's other ops
    assert est.service("new", "train", 1000) == pytest.approx(est._rate[""] * 1000)
    est.observe_service("a", "train", 0.1, nbytes=1000)
    assert est.service("b", "train", 1000) == pytest.approx(0.1)  # the op elsewhere first
    assert est.service("new", "sample") == 1.0  # bytes unknown: the prior
    assert est.service("a", "sample", 2000) == pytest.approx(0.02)  # learned: its own
    est.forget("b")
    assert est.service("b", "load") == 1.0


def test_setup_estimate_per_tier_prior_then_learned_per_deployment_and_tier():
    est = Estimates(weight=0.5)
    n = 4 * GB
    assert est.setup("a", "hbm", n) == 0.0
    assert {t: est.setup("a", t, n) for t in ("dram", "nvme", "absent")} == pytest.approx(
        {t: n / DEFAULT_LOAD_BANDWIDTHS[t] for t in ("dram", "nvme", "absent")}
    )
    est.observe_load("a", "nvme", 1.0, n)  # 4 GB/s
    assert est.setup("a", "nvme", n) == 1.0
    assert est.setup("a", "nvme", 2 * n) == 1.0  # learned per (deployment, tier): a time
    assert est.setup("b", "nvme", 2 * n) == pytest.approx(2.0)  # learned bandwidth of the tier
    assert est.setup("a", "dram", n) == pytest.approx(n / 10e9)  # other tiers keep their prior
    assert est.setup("a", "hbm", n) == 0.0
    est.observe_load("a", "nvme", 3.0, n)
    assert est.setup("a", "nvme", n) == pytest.approx(2.0)
    assert est.setup("b", "nvme", n) == pytest.approx(n / (0.5 * 4e9 + 0.5 * n / 3.0))
    est.forget("a")  # forgets the deployment's time, not the tier's bandwidth
    assert est.setup("a", "nvme", n) == est.setup("b", "nvme", n)


@pytest.mark.parametrize(
    ("source", "seconds"),
    [("hbm", 5.0), ("", 5.0), ("bogus", 5.0), ("dram", 0.0), ("dram", -1.0),
     ("dram", math.inf), ("dram", math.nan)],  # fmt: skip
)
def test_loads_that_are_not_a_tiers_load_are_ignored(source, seconds):
    est = Estimates()
    est.observe_load("a", source, seconds, GB)
    assert est.setup("a", "dram", GB) == pytest.approx(0.1)
    assert est.setup("b", "dram", GB) == pytest.approx(0.1)


def test_a_residency_report_of_a_non_finite_load_or_size_is_refused():
    """A load of inf seconds made the deployment's setup estimate, and with it its patience,
    infinite: it then waited behind any flood with no bound. Such a report is refused (the
    scheduler drops it), and an infinite service time is no observation."""
    for bad in ({"load_s": math.inf}, {"load_s": math.nan}, {"bytes": -1}, {"bytes": "1"}):
        with pytest.raises(ValueError):
            ResidencyReport(**{"deployment": "b", "version": 0, "tier": "hbm", "bytes": 10,
                               "load_s": 1.0, "source": "dram", **bad})  # fmt: skip
    est = Estimates()
    est.observe_service("a", "sample", 0.5)
    est.observe_service("a", "sample", math.inf)
    assert est.service("a", "sample") == 0.5


def test_load_without_bytes_learns_the_time_not_the_bandwidth():
    est = Estimates()
    est.observe_load("a", "absent", 7.0)
    assert est.setup("a", "absent", GB) == 7.0
    assert est.setup("b", "absent", GB) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "bandwidths",
    [
        {"dram": 1.0, "nvme": 1.0},
        {"dram": 0.0, "nvme": 1.0, "absent": 1.0},
        {"dram": 1.0, "nvme": -1.0, "absent": 1.0},
    ],
    ids=["missing-tier", "zero", "negative"],
)
def test_invalid_bandwidth_priors_raise(bandwidths):
    with pytest.raises(ValueError, match="bandwidth"):
        Estimates(load_bandwidths=bandwidths)


def test_setup_costs_take_the_slowest_worker_and_count_hbm_models():
    rmap = ResidencyMap()
    for w, tier in (("w0", "hbm"), ("w1", "dram"), ("w2", "nvme")):
        rmap.apply(ResidencyReport("m", 0, tier, 4 * GB, 0.0, worker=w))
    rmap.apply(ResidencyReport("other", 0, "hbm", GB, 0.0, worker="w0"))
    rmap.apply(ResidencyReport("third", 0, "dram", GB, 0.0, worker="w0"))
    asked: list[str] = []

    def bytes_of(dep: str) -> int:
        asked.append(dep)
        return 4 * GB

    costs = SetupCosts(rmap, Estimates(), bytes_of)
    assert costs.setup_s("m", ("w0",)) == 0.0 and asked == []
    assert costs.setup_s("m", ("w0", "w1")) == pytest.approx(0.4)
    assert costs.setup_s("m", ("w1", "w0", "w2")) == pytest.approx(2.0)
    assert costs.setup_s("m", ("w2", "w3")) == pytest.approx(8.0)  # w3: absent
    assert [costs.crowding(w) for w in ("w0", "w1", "w3")] == [2, 0, 0]  # models in HBM only
    costs.estimates.observe_load("m", "nvme", 0.5, 4 * GB)
    assert costs.setup_s("m", ("w0", "w1", "w2")) == pytest.approx(0.5)


def test_residency_count_in_and_forgetting():
    rmap = ResidencyMap()
    for dep, w, tier in [
        ("a", "w0", "hbm"),
        ("b", "w0", "hbm"),
        ("c", "w0", "dram"),
        ("a", "w1", "nvme"),
    ]:
        rmap.apply(ResidencyReport(dep, 0, tier, GB, 0.0, worker=w))
    assert [rmap.count_in("w0", t) for t in TIERS] == [2, 1, 0, 0]
    rmap.apply(ResidencyReport("b", 0, "dram", GB, 0.0, worker="w0"))
    assert rmap.count_in("w0", "hbm") == 1 and rmap.count_in("w0", "dram") == 2
    rmap.forget_deployment("a")
    assert rmap.count_in("w0", "hbm") == 0 and rmap.count_in("w1", "nvme") == 0
    assert rmap.tier("a", "w1") == "absent"
    rmap.forget_worker("w0")
    assert rmap.count_in("w0", "dram") == 0 and rmap.reports() == []
    assert rmap.count_in("never", "hbm") == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("apply"),
                st.sampled_from("abc"),
                st.sampled_from(["w0", "w1", "w2"]),
                st.sampled_from(TIERS),
                st.integers(0, 5),
            ),
            st.tuples(st.just("forget_worker"), st.sampled_from(["w0", "w1", "w2"])),
            st.tuples(st.just("forget_deployment"), st.sampled_from("abc")),
        ),
        max_size=40,
    )
)
def test_residency_map_per_worker_index_stays_consistent(events):
    rmap, naive = ResidencyMap(), {}
    for ev in events:
        if ev[0] == "apply":
            _, dep, w, tier, nbytes = ev
            rmap.apply(ResidencyReport(dep, 0, tier, nbytes, 0.0, worker=w))
            if tier == "absent":
                naive.pop((dep, w), None)
            else:
                naive[(dep, w)] = (tier, nbytes)
        elif ev[0] == "forget_worker":
            rmap.forget_worker(ev[1])
            naive = {k: v for k, v in naive.items() if k[1] != ev[1]}
        else:
            rmap.forget_deployment(ev[1])
            naive = {k: v for k, v in naive.items() if k[0] != ev[1]}
        for w in ("w0", "w1", "w2"):
            for tier in TIERS:
                assert rmap.count_in(w, tier) == sum(
                    1 for (_, x), (t, _) in naive.items() if x == w and t == tier
                )
            assert rmap.bytes_by_tier(w) == {
                t: sum(b for (_, x), (tier, b) in naive.items() if x == w and tier == t)
                for t in TIERS[:-1]
            }
            for dep in "abc":
                assert rmap.tier(dep, w) == naive.get((dep, w), ("absent", 0))[0]
        assert [(r.deployment, r.worker) for r in rmap.reports()] == sorted(naive)


def test_residency_report_source_is_validated_and_round_trips():
    report = ResidencyReport("m", 3, "hbm", GB, 1.5, worker="w0", source="nvme")
    event = report.to_event()
    assert event["source"] == "nvme" and "worker" not in event
    assert ResidencyReport.from_event({**event, "worker": "w0", "extra": 1}) == report
    assert ResidencyReport("m", 0, "hbm", 0, 0.0).source == ""
    with pytest.raises(ValueError):
        ResidencyReport("m", 0, "hbm", 0, 0.0, source="disk")
    with pytest.raises(ValueError):
        ResidencyReport("m", 0, "gpu", 0, 0.0)


# --- unchanged: prompt splitting ---------------------------------------------------------------


def test_prompt_split_follows_batch_boundaries():
    # n=4, batch 64 -> units of 16 prompts.
    assert split_prompts(40, 2, 4, 64) == [(0, 32), (32, 40)]
    assert split_prompts(10, 3, 4, 64) == [(0, 10)]
    assert split_prompts(100, 4, 1, 8) == [(0, 32), (32, 56), (56, 80), (80, 100)]
    # n=3, batch 8 -> units of 8 prompts (24 rows = 3 whole batches).
    assert split_prompts(17, 2, 3, 8) == [(0, 16), (16, 17)]


def test_a_read_waits_for_its_busy_replica_when_that_is_sooner_than_a_load_elsewhere():
    residency = ResidencyMap()
    residency.apply(ResidencyReport("m", 0, "hbm", GB, 0.0, worker="w0"))
    costs = SetupCosts(residency, Estimates(), lambda _: GB)  # absent: 1 GB at 0.5 GB/s = 2 s
    d = Dispatcher(DispatchPolicy(), costs, workers=["w0", "w1"])
    d.add(req("first", "w0", s=0.5, dep="m"))
    assert names(d.decide(0.0)) == ["first"]  # w0 busy until ~0.5 s
    d.add(req("read", "w0", "w1", t=0.1, s=0.5, order="m#any", dep="m"))
    assert d.decide(0.1) == []  # waiting ~0.4 s for w0 beats a 2 s load on the idle w1
    assert d.hint("w1", 0.1) == "m"  # still eligible there: the prediction says so
    d.release_worker("w0")
    (decision,) = d.decide(0.5)
    assert decision.group == ("w0",) and decision.setup_s == 0.0
    # Urgent, it takes whatever is free.
    d.add(req("late", "w0", "w1", t=0.5, s=0.5, order="m#any", dep="m"))
    assert [x.group for x in d.decide(100.0)] == [("w1",)]


def test_a_load_that_displaces_residents_costs_their_reload_too():
    residency = ResidencyMap()
    residency.apply(ResidencyReport("big", 0, "hbm", 3 * GB, 0.0, worker="w0"))
    residency.apply(ResidencyReport("new", 0, "dram", 2 * GB, 0.0, worker="w0"))
    residency.apply(ResidencyReport("new", 0, "dram", 2 * GB, 0.0, worker="w1"))
    est = Estimates()
    costs = SetupCosts(residency, est, lambda m: 2 * GB, budget_of=lambda w: 4 * GB)
    own = est.setup("new", "dram", 2 * GB)
    # w0 has 1 GB free: loading 2 GB pushes out "big", whose reload (3 GB from DRAM) is added.
    assert costs.setup_s("new", ("w0",)) == pytest.approx(own + est.setup("big", "dram", 3 * GB))
    assert costs.setup_s("new", ("w1",)) == pytest.approx(own)  # room: no displacement
    assert costs.setup_s("big", ("w0",)) == 0.0
    no_budget = SetupCosts(residency, est, lambda m: 2 * GB)
    assert no_budget.setup_s("new", ("w0",)) == pytest.approx(own)


def test_cached_setup_costs_follow_every_change_they_depend_on():
    """The per-(deployment, worker) cache is invisible: after any sequence of residency
    reports, forgotten workers and deployments, observed loads, and changes of a deployment's
    bytes or a worker's budget, every cost equals a fresh, uncached computation's."""
    rng = random.Random(7)
    workers, models = ["w0", "w1", "w2"], ["a", "b", "c", "d"]
    residency, est = ResidencyMap(), Estimates()
    sizes = {m: rng.randint(1, 4) * GB for m in models}
    budgets = {w: 6 * GB for w in workers}
    cached = SetupCosts(residency, est, sizes.__getitem__, budgets.__getitem__)
    for _ in range(600):
        kind = rng.randrange(7)
        m, w = rng.choice(models), rng.choice(workers)
        if kind <= 2:
            tier = rng.choice(("hbm", "dram", "nvme", "absent"))
            residency.apply(ResidencyReport(m, 0, tier, sizes[m], 0.1, worker=w))
        elif kind == 3:
            est.observe_load(m, rng.choice(("dram", "nvme", "absent")), rng.uniform(0.1, 3), GB)
        elif kind == 4:
            sizes[m] = rng.randint(1, 4) * GB
        elif kind == 5:
            budgets[w] = rng.randint(2, 8) * GB
        elif rng.random() < 0.5:
            residency.forget_worker(w)
        else:
            residency.forget_deployment(m)
            est.forget(m)
        fresh = SetupCosts(residency, est, sizes.__getitem__, budgets.__getitem__)
        for group in (("w0",), ("w1",), ("w2",), ("w0", "w2")):
            for model in models:
                assert cached.setup_s(model, group) == fresh.setup_s(model, group)


def test_a_gang_with_the_best_ratio_holds_its_free_worker_but_lets_short_work_backfill():
    d = Dispatcher(CALM, workers=["w0", "w1"])
    d.add(req("busy", "w0", s=2.0))
    assert names(d.decide(0.0)) == ["busy"]  # w0 expected busy until 2.0
    d.add(req("gang", ("w0", "w1"), t=-10.0, s=1.0))  # waited long: the best ratio
    d.add(req("long", "w1", t=0.0, s=3.0))  # would end at 3.0, after the gang could start
    d.add(req("short", "w1", t=0.0, s=1.0))  # ends at 1.0: fits before
    assert names(d.decide(0.0)) == ["short"]
    d.release_worker("w1")
    assert d.decide(1.0) == []  # "long" would still delay the gang
    d.release_worker("w0")
    assert names(d.decide(2.0)) == ["gang"]
    # Without a waiting gang the same single starts at once.
    free = Dispatcher(CALM, workers=["w0", "w1"])
    free.add(req("long", "w1", s=3.0))
    assert names(free.decide(0.0)) == ["long"]


def test_a_read_waiting_for_its_replica_moves_when_that_worker_dies():
    """Regression (found by the HRRS oracle in CI): a data-parallel read waits for the busy
    worker that holds its model; when that worker died, nothing re-examined the read, which
    then never started on the idle replica."""
    rmap = ResidencyMap()
    rmap.apply(ResidencyReport("m1", 0, "hbm", 0, 0.0, worker="w0"))
    sizes = {"m1": 10**9}
    costs = SetupCosts(rmap, Estimates(), lambda m: sizes.get(m, 0))
    policy = DispatchPolicy(setup_weight=0.0, patience_factor=0.0, patience_floor_s=1e9)
    d = Dispatcher(policy, costs, ("w0", "w1"))
    d.add(Request("r0", (("w0",),), arrival=0.0, service_s=0.1, deployment="m0"))
    d.add(Request("r1", (("w0",), ("w1",)), arrival=0.0, service_s=0.1, deployment="m1"))
    assert [x.request.request for x in d.decide(0.0)] == ["r0"]  # r1 waits for w0
    d.remove_worker("w0")
    assert [(x.request.request, x.group) for x in d.decide(0.0)] == [("r1", ("w1",))]


# --- lookahead: one single-worker request queued behind a running one -----------------------

AHEAD = replace(CALM, lookahead=True)


def test_lookahead_queues_the_next_request_behind_the_running_one():
    d = Dispatcher(AHEAD, workers=["w0"])
    d.add(req("a", "w0", s=1.0))
    d.add(req("b", "w0", s=1.0))
    d.add(req("c", "w0", s=1.0))
    decisions = d.decide(0.0)
    assert names(decisions) == ["a", "b"]  # b queued: one slot only
    assert decisions[0].behind is None and decisions[1].behind == "a"
    assert decisions[1].to_dict()["behind"] == "a"
    assert d.busy == {"w0": "a"} and d.queued == {"w0": "b"} and "c" in d
    assert d.hint("w0", 0.0) == "b"  # what comes next there is known
    assert d.decide(0.5) == []
    d.release_worker("w0", "a")  # a ends; b runs; the slot opens for c
    assert d.busy == {"w0": "b"} and d.queued == {}
    [dec] = d.decide(1.0)
    assert dec.request.request == "c" and dec.behind == "b"
    d.release_worker("w0", "b")
    d.release_worker("w0", "c")
    assert d.busy == {} and d.decide(3.0) == []
    # Without lookahead, the same requests wait for the worker to be free.
    off = Dispatcher(CALM, workers=["w0"])
    off.add(req("a", "w0"))
    off.add(req("b", "w0"))
    assert names(off.decide(0.0)) == ["a"] and off.queued == {}


def test_a_cancelled_queued_request_reopens_the_slot_and_its_estimate():
    d = Dispatcher(AHEAD, workers=["w0", "w1"])
    d.add(req("a", "w0", s=1.0))
    d.add(req("b", "w0", s=5.0))
    assert names(d.decide(0.0)) == ["a", "b"]
    d.release_worker("w0", "b")  # cancelled while queued: a still runs
    assert d.busy == {"w0": "a"} and d.queued == {}
    d.release_worker("w0", "zzz")  # a stale report changes nothing
    assert d.busy == {"w0": "a"}
    # w0 is expected free at 1.0 again (not 6.0): a read resident there waits for it rather
    # than loading on the idle w1 (2 s), and is queued behind a.
    d.costs = TableCosts({("m", "w1"): 2.0})
    d.add(req("read", "w0", "w1", t=0.0, s=0.5, dep="m"))
    [dec] = d.decide(0.1)
    assert dec.request.request == "read" and dec.group == ("w0",) and dec.behind == "a"


def test_lookahead_never_lets_a_single_overtake_a_gang_that_comes_first():
    d = Dispatcher(AHEAD, workers=["w0", "w1"])
    d.add(req("x", "w0", s=1.0))
    assert names(d.decide(0.0)) == ["x"]
    d.add(req("gang", ("w0", "w1"), t=-10.0, s=1.0))  # waited long: the best ratio on w0
    d.add(req("single", "w0", t=0.0, s=1.0))
    assert d.decide(0.0) == [] and d.queued == {}  # (w1 is held for the gang meanwhile)
    d.release_worker("w0", "x")
    gang, single = d.decide(1.0)  # the gang starts, then the single is queued behind it
    assert gang.request.request == "gang" and gang.behind is None
    assert single.request.request == "single" and single.behind == "gang"
    # A single that comes first on the gang's busy worker is queued there.
    e = Dispatcher(AHEAD, workers=["w0", "w1"])
    e.add(req("x", "w0", s=1.0))
    assert names(e.decide(0.0)) == ["x"]
    e.add(req("gang", ("w0", "w1"), t=0.0, s=1.0))
    e.add(req("single", "w0", t=-10.0, s=1.0))
    [dec] = e.decide(0.0)
    assert dec.request.request == "single" and dec.behind == "x"


def test_lookahead_respects_reservations_and_queues_an_urgent_single_on_its_worker():
    policy = replace(HRRS, lookahead=True)
    d = Dispatcher(policy, workers=["w0", "w1"])
    d.add(req("x", "w0", s=1.0))
    d.add(req("y", "w1", s=1.0))
    assert names(d.decide(0.0)) == ["x", "y"]
    d.add(req("gang", ("w0", "w1"), t=0.0, s=1.0))
    d.add(req("late", "w0", t=0.0, s=0.1))
    # Past the gang's patience (8 * 1 + 2 s) it reserves both workers: nothing may be queued
    # there but the reserver, and a gang is never queued.
    decisions = d.decide(11.0)
    assert d.is_urgent("gang") and names(decisions) == [] and d.queued == {}
    d.release_worker("w0", "x")
    d.release_worker("w1", "y")
    gang, late = d.decide(12.0)  # the gang starts; late, urgent too, reserved w0 after it
    assert gang.request.request == "gang" and late.behind == "gang" and late.urgent
    # An urgent single that reserved a busy worker alone is queued there once the slot opens.
    u = Dispatcher(policy, workers=["w0"])
    u.add(req("x", "w0", s=100.0))
    u.add(req("y", "w0", s=100.0))
    assert names(u.decide(0.0)) == ["x", "y"]
    u.add(req("z", "w0", t=0.0, s=1.0))
    assert u.decide(11.0) == [] and u.is_urgent("z")  # slot taken by y
    u.release_worker("w0", "x")
    [dec] = u.decide(12.0)
    assert dec.request.request == "z" and dec.urgent and dec.behind == "y"


def test_the_predicted_single_goes_where_it_is_expected_to_start_soonest():
    # m is resident on w0 (busy until 0.5) and would load for 2 s on w1 (busy until 0.2): it
    # is queued behind w0's request, not w1's.
    costs = TableCosts({("m", "w1"): 2.0})
    d = Dispatcher(AHEAD, costs, workers=["w0", "w1"])
    d.add(req("on0", "w0", s=0.5))
    d.add(req("on1", "w1", s=0.2))
    assert names(d.decide(0.0)) == ["on0", "on1"]
    d.add(req("read", "w0", "w1", t=0.0, s=0.5, dep="m"))
    [dec] = d.decide(0.0)
    assert dec.group == ("w0",) and dec.behind == "on0"
    assert d.queued == {"w0": "read"}


def lookahead_safety(model: Model, queued: dict, decisions: list[Decision]) -> None:
    """What every decision with lookahead must satisfy: heads only, on one of their groups;
    either on free live workers, or (single-worker) behind the request running on a live busy
    worker with nothing queued yet, which takes no inputs."""
    for dec in decisions:
        r = dec.request
        assert model.queues[r.order_key][0] == r
        assert dec.group in r.groups
        if dec.behind is None:
            assert set(dec.group) <= model.live - model.busy
            model.start(r, dec.group)
            for w in dec.group:
                model.running[w] = r.request
        else:
            (w,) = dec.group
            assert w in model.live and w in model.busy and w not in queued
            assert model.running[w] == dec.behind
            assert not model.inputs[dec.behind]
            model.remove(r.request)
            queued[w] = r.request


@settings(max_examples=100, deadline=None)
@given(
    ops(max_groups=3, orders=st.sampled_from(["", "o0", "o1"])),
    residencies(),
    urgency_policies(lookahead=True, floors=(0.0, 0.5, 2.0, 1e9)),
)
def test_lookahead_decisions_keep_one_running_and_one_queued_per_worker(events, costs, policy):
    d = Dispatcher(policy, costs, ORACLE_WORKERS)
    model = Model(policy, costs, ORACLE_WORKERS)
    model.running, model.inputs = {}, {}
    queued: dict[str, str] = {}
    now, added = 0.0, []

    def end(w: str, rid: str | None) -> None:
        """The request ``rid`` (default: the running one) on ``w`` ended."""
        if rid is not None and queued.get(w) == rid:
            del queued[w]
        elif w in queued:
            model.running[w] = queued.pop(w)
        else:
            model.release(w)
            model.running.pop(w, None)

    for ev in events:
        kind = ev[0]
        if kind == "add":
            _, groups, order, dep, lag, service = ev
            inputs = len(added) % 3 == 0
            r = Request(f"r{len(added)}", groups, now - lag, service, order, dep, inputs=inputs)
            model.inputs[r.request] = inputs
            added.append(r.request)
            d.add(r)
            model.add(r)
        elif kind == "decide":
            now += ev[1]
            lookahead_safety(model, queued, d.decide(now))
            assert d.decide(now) == []
        elif kind == "release":
            if ev[1] in model.busy:
                d.release_worker(ev[1], model.running.get(ev[1]))
                end(ev[1], None)
        elif kind == "remove" and added:
            rid = added[ev[1] % len(added)]
            where = [w for w, q in queued.items() if q == rid]
            if where:  # cancelled while queued
                d.release_worker(where[0], rid)
                end(where[0], rid)
            elif rid in d:
                d.remove(rid)
                model.remove(rid)
        elif kind == "kill":
            d.remove_worker(ev[1])
            model.live.discard(ev[1])
            model.release(ev[1])
            model.running.pop(ev[1], None)
            queued.pop(ev[1], None)
        elif kind == "revive":
            d.add_worker(ev[1])
            model.live.add(ev[1])
        assert set(d.busy) == model.busy
        assert d.queued == queued
        assert [r.request for r in d.pending()] == [r.request for r in model.pending()]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(6, 150), (2, 40), (4, 80)]), any_policy)
def test_random_workloads_keep_the_dispatch_promises_with_lookahead(seed, size, policy):
    cluster, workload = random_workload(seed, *size)
    result = simulate(workload, cluster, replace(policy, lookahead=True))
    check_promises(workload, result)


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_single_worker_requests_do_queue_some(seed):
    # A fixed sample, not a property: a random workload may hold gangs only (seed 162 does),
    # and then nothing can be queued behind anything.
    cluster, workload = random_workload(seed, 6, 150)
    assert any(all(len(g) == 1 for g in r.request.groups) for r in workload)
    result = simulate(workload, cluster, AHEAD)
    assert sum(r.start > r.released for r in result.records) > len(workload) // 4


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("name", ADVERSARIAL)
def test_adversarial_workloads_keep_the_dispatch_promises_with_lookahead(name, policy):
    cluster, workload = ADVERSARIAL[name]()
    check_promises(workload, simulate(workload, cluster, replace(policy, lookahead=True)))


def test_nothing_is_queued_behind_a_request_that_takes_inputs():
    # Its worker may still be fetching them when the request is released: a request queued
    # behind it would start first (a sample overtaking the weight load before it).
    d = Dispatcher(AHEAD, workers=["w0"])
    d.add(replace(req("load", "w0", s=1.0), inputs=True))
    d.add(req("sample", "w0", s=1.0))
    assert names(d.decide(0.0)) == ["load"] and d.queued == {}
    d.release_worker("w0", "load")
    d.add(req("after", "w0", s=1.0))
    assert names(d.decide(1.0)) == ["sample", "after"]  # after a request without inputs: yes
    # A request with inputs may itself be queued; once it runs, nothing goes behind it.
    d.add(replace(req("load2", "w0", s=1.0), inputs=True))
    d.release_worker("w0", "sample")  # "after" runs; load2 is queued behind it
    assert [x.request.request for x in d.decide(2.0)] == ["load2"]
    d.add(req("last", "w0", s=1.0))
    d.release_worker("w0", "after")  # load2 runs
    assert d.decide(3.0) == [] and d.busy == {"w0": "load2"}
    d.release_worker("w0", "load2")
    assert names(d.decide(4.0)) == ["last"]


# --- the live benchmark's mix, simulated ----------------------------------------------------


def test_the_live_benchmarks_mix_in_the_simulator_keeps_the_promises_and_gains():
    """bench.scheduler's live workload (a 2-rank trainer's steps among short and long samples
    of two rollout models, one of which fits beside the trainer per worker) replayed in the
    simulator: HRRS answers faster on average and loads fewer models than FIFO, and every
    wait stays within the proven bound."""
    from plexrl_dask.bench.scheduler import (
        POLICIES,
        _sim_live_requests,
        live_schedule,
        simulated_live_mix,
    )

    service = {"train": 0.317, "sample_a": 0.031, "sample_b": 0.030, "sample_b_long": 0.111}
    schedules = [live_schedule(service, 20.0, seed=seed) for seed in range(2)]
    out = simulated_live_mix(schedules, service, load_s=0.085)
    assert out["sim_live_mix_hrrs_vs_fifo_mean_response_ratio"] < 1
    assert out["sim_live_mix_hrrs_model_loads"] < out["sim_live_mix_fifo_model_loads"]
    cluster = ClusterModel(("w0", "w1"), hbm_models=2)
    for name in ("hrrs", "fifo"):
        res = simulate(_sim_live_requests(schedules[0], service), cluster, POLICIES[name])
        assert res.max_wait_over_bound() <= 1.0 + 1e-9
        assert res.overlaps() == [] and res.order_violations() == []
