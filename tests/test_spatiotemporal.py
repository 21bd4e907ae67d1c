"""The spatiotemporal policy core: horizon profiles, atomic reservations, micro-shifting,
two-phase placement, Spread vs Pack, backfill tests, the queue."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl_dask.errors import (
    InvalidTrace,
    JobDoesNotFit,
    JobNotPlaced,
    PlacementError,
    PlexRLError,
    ReservationConflict,
)
from plexrl_dask.plugins.placement import LivePlacement, nodes_of
from plexrl_dask.policy.horizon import DemandTrace, Horizon, Phase, TraceRecorder
from plexrl_dask.policy.spatiotemporal import (
    ClusterView,
    NodeGroup,
    NodeView,
    PlacementConfig,
    Reservation,
    SpatiotemporalPlacer,
    backfill_fits,
    replay,
)


def cfg(**kw: object) -> PlacementConfig:
    """A placement config whose horizon is one period of the first job (the analytic cases)."""
    return PlacementConfig(**{"horizon_periods": 1, "max_padding": 1.5, **kw})


def nodes(n: int, per: int = 8) -> list[NodeView]:
    return [NodeView(f"n{i}", tuple(f"n{i}/{k}" for k in range(per))) for i in range(n)]


def on_off(gpus: int, on_s: float, off_s: float) -> DemandTrace:
    """Busy on ``gpus`` for ``on_s``, then nothing for ``off_s`` (e.g. waiting on rewards)."""
    return DemandTrace((Phase("train", gpus, on_s), Phase("gap", 0, off_s)))


# --- horizon ---------------------------------------------------------------------------------


def test_profile_is_the_slot_maximum_and_never_understates():
    h = Horizon(period_s=8.0, slots=8)
    trace = DemandTrace((Phase("rollout", 8, 2.5), Phase("tail", 2, 1.5), Phase("train", 4, 4.0)))
    p = h.profile(trace)
    # slot 2 holds the end of rollout (8 GPUs) and the start of the tail: the max is reserved
    assert p.tolist() == [8, 8, 8, 2, 4, 4, 4, 4]
    t = np.linspace(0, 7.999, 4000)
    demand = np.select([t < 2.5, t < 4.0], [8, 2], 4)
    assert (p[(t // 1).astype(int)] >= demand).all()


def test_locked_period_and_padding():
    h = Horizon(period_s=10.0, slots=10)
    assert h.locked_period(10.0) == pytest.approx(10.0)
    assert h.locked_period(12.0) == pytest.approx(20.0)  # two horizons per iteration
    assert h.locked_period(4.0) == pytest.approx(5.0)  # two iterations per horizon
    assert h.padding(4.0) == pytest.approx(1.25)
    # a period longer than the horizon folds by the slot maximum over the horizons it spans
    long = DemandTrace((Phase("train", 4, 3.0), Phase("gap", 0, 9.0)))
    assert h.profile(long).tolist() == [4, 4, 4, 0, 0, 0, 0, 0, 0, 0]
    short = DemandTrace((Phase("train", 4, 2.0), Phase("gap", 0, 2.0)))
    assert h.profile(short).tolist() == [4, 4, 0, 0, 0, 4, 4, 0, 0, 0]


def test_trace_from_iterations_takes_the_quantile_and_checks_structure():
    its = [
        (Phase("rollout", 8, d), Phase("train", 8, 10.0)) for d in (10.0, 12.0, 14.0, 16.0, 100.0)
    ]
    t = DemandTrace.from_iterations(its, quantile=0.5)
    assert t.phases[0].duration_s == 14.0 and t.period_s == 24.0
    with pytest.raises(InvalidTrace, match="structure"):
        DemandTrace.from_iterations([its[0], (Phase("train", 8, 1.0),)])
    with pytest.raises(InvalidTrace):
        DemandTrace.from_iterations([])
    with pytest.raises(InvalidTrace):
        Phase("nap", 1, 1.0)
    with pytest.raises(InvalidTrace):
        DemandTrace((Phase("train", 1, 2.0),), period_s=1.0)
    assert DemandTrace.from_dict(t.to_dict()) == t
    assert issubclass(InvalidTrace, PlexRLError)


# --- reservations ----------------------------------------------------------------------------


def test_reservations_are_all_or_nothing():
    g = NodeGroup("g", nodes(1), slots=4, now=0.0)
    g.reserve(Reservation("a", "g", (8, 4, 0, 0), 0, 4.0))
    before = g.load.copy()
    with pytest.raises(ReservationConflict, match="slot 1"):
        g.reserve(Reservation("b", "g", (0, 5, 2, 2), 0, 4.0))  # one slot over
    assert (g.load == before).all() and set(g.reservations) == {"a"}
    with pytest.raises(ReservationConflict):
        g.reserve(Reservation("a", "g", (0, 0, 1, 1), 0, 4.0))  # a job reserves once
    g.reserve(Reservation("b", "g", (0, 4, 8, 8), 0, 4.0))
    assert g.load.tolist() == [8, 8, 8, 8]
    g.release("a")
    assert g.load.tolist() == [0, 4, 8, 8]
    with pytest.raises(JobNotPlaced):
        g.release("a")


def test_forming_a_group_takes_every_node_or_none():
    c = ClusterView(nodes(3), slots=4)
    c.form_group(["n1"], 0.0)
    with pytest.raises(ReservationConflict):
        c.form_group(["n0", "n1"], 0.0)  # n1 is taken
    assert c.free == ["n0", "n2"]
    assert c.capacity()["free"] == 16


def test_two_anti_correlated_jobs_interleave_at_half_the_isolated_cost():
    placer = SpatiotemporalPlacer(nodes(1), cfg(slots=8, group_nodes=1))
    trace = on_off(8, 4.0, 4.0)
    [a] = placer.submit("a", 8, now=0.0, trace=trace)  # known traces: no profiling
    [b] = placer.submit("b", 8, now=0.0, trace=trace)
    assert a.kind == b.kind == "place" and a.group == b.group
    assert (b.offset - a.offset) % 8 == 4  # b runs while a is off
    g = placer.cluster.groups[a.group]
    assert g.load.tolist() == [8] * 8  # one node's 8 GPUs, every slot full
    isolated = 2 * 8  # each job alone holds its 8 GPUs all the time
    assert g.capacity / isolated == 0.5
    # the windows interleave: a's iterations start at 0, 8, ...; b's half a period later
    assert g.window_start("a", 0.0, 0.0) == 0.0
    assert g.window_start("b", 0.0, 0.0) == 4.0


def test_a_job_that_does_not_fit_waits_then_runs():
    placer = SpatiotemporalPlacer(nodes(2), cfg(slots=8, group_nodes=2))
    [d] = placer.submit("big", 16, now=0.0)
    assert d.kind == "profile" and d.gpus == 16
    [w] = placer.submit("next", 8, now=1.0)
    assert w.kind == "wait" and "no group has 8 GPUs of slack" in w.reason
    assert placer.state()["queue"] == ["next"]
    # profiled: its shaped demand (16 then 4) leaves room for the waiting job's flat 8 only if
    # some slot has 8 free in every slot; it does not, so it keeps waiting
    placed = placer.profiled(
        "big", DemandTrace((Phase("rollout", 16, 6.0), Phase("train", 4, 2.0))), 2.0
    )
    assert [x.kind for x in placed] == ["place"]
    assert placer.state()["queue"] == ["next"]
    out = placer.finish("big", 3.0)
    kinds = [x.kind for x in out]
    assert kinds == ["release", "profile"] and out[1].job == "next"
    with pytest.raises(JobDoesNotFit):
        placer.submit("huge", 17, now=4.0)
    with pytest.raises(ReservationConflict):
        placer.submit("next", 8, now=4.0)
    with pytest.raises(JobNotPlaced):
        placer.profiled("ghost", DemandTrace((Phase("train", 1, 1.0),)), 4.0)


def test_two_phase_profiles_then_micro_shifts_into_a_shared_group():
    placer = SpatiotemporalPlacer(nodes(2), cfg(slots=8, group_nodes=2))
    assert placer.submit("a", 8, now=0.0)[0].kind == "profile"
    assert placer.submit("b", 8, now=0.0)[0].kind == "profile"  # same group: 16 GPUs
    groups = {placer.group_of("a").name, placer.group_of("b").name}
    assert len(groups) == 1
    trace = on_off(8, 4.0, 4.0)
    [pa] = placer.profiled("a", trace, now=10.0)
    [pb] = placer.profiled("b", trace, now=10.0)
    g = placer.group_of("a")
    # both fit at any offset (16 GPUs); micro-shifting puts b where a is off (least overlap)
    assert (pb.offset - pa.offset) % 8 == 4
    assert g.load.tolist() == [8] * 8
    # with capacity left, a third (known) job goes into the same group's slack
    assert placer.submit("c", 8, now=11.0, trace=trace)[0].kind == "place"
    assert g.load.max() == 16


def test_jobs_waiting_with_a_kind_just_profiled_take_its_trace():
    """A waiting job of a kind profiled meanwhile is placed from that trace (no profiling of
    its own), and the simulator can run it best effort before then."""
    placer = SpatiotemporalPlacer(nodes(1), cfg(slots=8, group_nodes=1))
    assert placer.submit("first", 8, now=0.0, kind="m")[0].kind == "profile"
    assert placer.submit("second", 8, now=0.0, kind="m")[0].kind == "wait"
    assert placer.submit("other", 8, now=0.0, kind="n")[0].kind == "wait"
    trace = on_off(8, 4.0, 4.0)
    # its kind's trace places the waiting job at once, in the first one's off half; the job
    # of another kind still needs 8 dedicated GPUs in every slot and waits
    out = placer.profiled("first", trace, now=1.0)
    assert [(d.kind, d.job) for d in out] == [("place", "first"), ("place", "second")]
    assert placer.jobs["second"].trace == trace and placer.jobs["other"].trace is None
    assert placer.state()["queue"] == ["other"]
    placer.finish("first", 2.0)
    assert [(d.kind, d.job) for d in placer.finish("second", 3.0)][-1] == ("profile", "other")


def test_spread_balances_and_pack_fills():
    def run(packing: str) -> list[int]:
        placer = SpatiotemporalPlacer(nodes(2), cfg(slots=4, group_nodes=1, packing=packing))
        # two groups of one node each, made by two 8-GPU jobs profiling
        for name in ("x", "y"):
            placer.submit(name, 8, now=0.0)
        placer.profiled("x", on_off(2, 1.0, 3.0), 1.0)
        placer.profiled("y", on_off(2, 1.0, 3.0), 1.0)
        placer.submit("z", 2, now=2.0, trace=on_off(2, 1.0, 3.0))
        placer.submit("w", 2, now=2.0, trace=on_off(2, 1.0, 3.0))
        return sorted(int(g.load.sum()) for g in placer.cluster.groups.values())

    assert run("spread") == [4, 4]  # z and w go to different groups
    assert run("pack") == [8]  # every job into the fullest group that fits; a node freed


def test_backfill_fits_only_where_no_reserved_phase_is_delayed():
    # 8 free GPUs; a reserved phase needs 6 at t=10; a running phase frees 4 at t=5
    releases, needs = [(5.0, 4)], [(10.0, 6)]
    assert backfill_fits(0.0, 8, 2, 100.0, releases, needs)  # 8-2+4-6 = 4 >= 0 throughout
    assert backfill_fits(0.0, 8, 6, 9.0, releases, needs)  # ends before the reserved start
    assert not backfill_fits(0.0, 8, 7, 100.0, releases, needs)  # 8-7+4-6 < 0 at t=10
    assert not backfill_fits(0.0, 8, 9, 1.0, [], [])  # more than is free
    # a release expected before now is overdue (its GPUs are still held): not counted
    assert not backfill_fits(20.0, 2, 2, 10.0, [(15.0, 8)], [(21.0, 1)])
    # needs at the same instant as a release come first (conservative)
    assert not backfill_fits(0.0, 0, 0, 10.0, [(5.0, 2)], [(5.0, 2), (5.0, 1)])


def test_config_is_validated():
    for bad in ({"slots": 0}, {"packing": "tetris"}, {"reserve_quantile": 0}, {"max_padding": 0.5}):
        with pytest.raises(InvalidTrace):
            PlacementConfig(**bad)


# --- live side: traces from requests, the plugin's placement -----------------------------


def test_trace_recorder_cuts_iterations_at_the_next_rollout():
    rec = TraceRecorder()
    t = 0.0
    done = []
    for _ in range(4):
        done.append(rec.add("sample", "w0", t, t + 3.0))
        done.append(rec.add("sample", "w1", t + 0.5, t + 4.0))
        rec.add("forward_backward", "w0", t + 4.0, t + 6.0)
        rec.add("optim_step", "w0", t + 6.0, t + 6.5)
        rec.add("load_weights", "w1", t + 6.5, t + 7.0)
        rec.add("get_weights", "w1", t + 7.0, t + 7.1)  # not part of a trace
        t += 7.0
    assert done == [False, False, True, False, True, False, True, False]
    assert len(rec.iterations) == 3  # the fourth completes when a fifth starts
    assert rec.iterations[0] == (
        Phase("rollout", 2, 4.0),
        Phase("train", 1, 2.5),
        Phase("sync", 1, 0.5),
    )
    trace = rec.trace(3, 0.9)
    assert trace is not None and trace.peak_gpus == 2 and trace.period_s == pytest.approx(7.0)
    assert rec.trace(4, 0.9) is None


def test_a_whole_iteration_request_records_a_rollout_then_its_training():
    """``sample_train`` (a fused colocated step) is one iteration: a rollout of no duration,
    then training over the request on its worker; iterations complete as the next begins."""
    rec = TraceRecorder()
    done = [rec.add("sample_train", "w0", 10.0 * i, 10.0 * i + 4.0) for i in range(3)]
    assert done == [False, True, True]
    assert list(rec.iterations) == [(Phase("rollout", 1, 0.0), Phase("train", 1, 4.0))] * 2
    trace = rec.trace(2, 0.5)
    assert trace is not None and trace.period_s == pytest.approx(4.0)


def test_live_placement_profiles_then_places_and_replays():
    live = LivePlacement(cfg(slots=16, group_nodes=1, profile_iterations=2))
    hosts = {"tcp://a:1": "a", "tcp://a:2": "a", "tcp://b:1": "b", "tcp://b:2": "b"}
    workers = live.candidates("j1", 2, "tiny", hosts, now=0.0)
    assert workers == ("tcp://a:1", "tcp://a:2")  # its group: node a
    assert live.candidates("j2", 2, "tiny", hosts, now=0.0) == ("tcp://b:1", "tcp://b:2")
    assert live.candidates("j3", 2, "tiny", hosts, now=0.0) is None  # waits: best effort
    t = 0.0
    for _ in range(3):
        live.record("j1", "sample", "tcp://a:1", t, t + 2.0)
        live.record("j1", "forward_backward", "tcp://a:2", t + 2.0, t + 4.0)
        t += 4.0
    live.record("j1", "sample", "tcp://a:1", t, t + 2.0)
    st = live.status()
    assert st["state"]["jobs"]["j1"]["state"] == "placed"
    kinds = [d["kind"] for d in st["decisions"]]
    assert kinds[:4] == ["profile", "profile", "wait", "place"]
    # j2 finishing frees node b: the queued j3, of j1's kind, is placed from j1's trace
    live.finish("j2", t)
    st = live.status()
    assert st["state"]["jobs"]["j3"]["state"] == "placed"
    assert [d["kind"] for d in st["decisions"] if d["job"] == "j3"] == ["wait", "place"]
    # the recorded events, replayed through a fresh placer, give the same decisions
    again = replay(nodes_of(hosts), live.config, st["inputs"])
    assert [d.to_dict() for d in again] == st["decisions"]
    assert len(st["traces"]["j1"]) == 3
    # a worker of j1's group leaves: its next deployment may not go there
    gone = {w: h for w, h in hosts.items() if w != "tcp://a:2"}
    assert live.candidates("j1", 2, "tiny", gone, now=t) == ("tcp://a:1",)


def test_gpus_that_join_are_free_for_groups_and_admit_waiting_jobs():
    placer = SpatiotemporalPlacer(nodes(1), cfg(slots=8, group_nodes=1))
    assert placer.submit("a", 8, now=0.0)[0].kind == "profile"
    assert placer.submit("b", 8, now=0.0)[0].kind == "wait"
    # a new node's GPUs register one by one: the node grows while it is free
    assert placer.add_node(NodeView("n1", ("n1/0",)), now=1.0) == []
    [d] = placer.add_node(NodeView("n1", tuple(f"n1/{k}" for k in range(1, 8))), now=1.5)
    assert (d.kind, d.job) == ("profile", "b") and placer.group_of("b").gpus[0] == "n1/0"
    assert placer.cluster.total_gpus == 16
    with pytest.raises(PlacementError):  # a node in a group cannot grow under reservations
        placer.add_node(NodeView("n1", ("n1/8",)), now=2.0)
    with pytest.raises(PlacementError):  # nor can a GPU join twice
        placer.add_node(NodeView("n2", ("n0/0",)), now=2.0)
    again = replay(nodes(1), placer.config, placer.inputs)
    assert [x.to_dict() for x in again] == [x.to_dict() for x in placer.log]


def test_live_placement_adds_workers_of_new_hosts_while_jobs_are_placed():
    live = LivePlacement(cfg(slots=16, group_nodes=1, profile_iterations=2))
    hosts = {"tcp://a:1": "a", "tcp://a:2": "a"}
    assert live.candidates("j1", 2, "tiny", hosts, now=0.0) == ("tcp://a:1", "tcp://a:2")
    assert live.candidates("j2", 2, "tiny", hosts, now=0.0) is None  # waits
    # host b's workers register one at a time; j2 starts once b holds its 2 GPUs
    live.sync_workers({**hosts, "tcp://b:1": "b"}, now=1.0)
    assert live.status()["state"]["jobs"]["j2"]["state"] == "waiting"
    grown = {**hosts, "tcp://b:1": "b", "tcp://b:2": "b"}
    live.sync_workers(grown, now=2.0)
    assert live.status()["state"]["jobs"]["j2"]["state"] == "profiling"
    assert live.candidates("j2", 2, "tiny", grown, now=2.0) == ("tcp://b:1", "tcp://b:2")
    # a worker joining host a (in j1's group) waits until the placer is idle
    live.sync_workers({**grown, "tcp://a:3": "a"}, now=3.0)
    assert live.placer is not None and live.placer.cluster.total_gpus == 4
    st = live.status()
    assert [n["name"] for n in st["nodes"]] == ["a"]  # what it was built from; b is an input
    again = replay(nodes_of(hosts), live.config, st["inputs"])
    assert [d.to_dict() for d in again] == st["decisions"]
