"""The dashboard's data and pages on a scheduler with a synthetic plugin state.

Each page's ``update()`` is called on a real in-process scheduler (``gen_cluster``, no GPU
workers: the PlexRL plugin and the dashboard plugin hold a synthetic state built by the
benchmark's :func:`fill_synthetic`), and the page's data sources are compared with that state;
the JSON routes are fetched over HTTP and compared with the plugin's views at the same instant.
The job accounting is checked against the cost ledger.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import json
import math
import random
import time
import urllib.request

import dask
import pytest
from distributed.utils_test import gen_cluster
from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from plexrl_dask import errors
from plexrl_dask.bench.dashboard import ReferenceWork, scrape_times
from plexrl_dask.bench.synthetic_state import add_request, churn, fill_synthetic
from plexrl_dask.cluster import scheduler_process
from plexrl_dask.dashboard import PAGES, ROUTES_MODULE, metrics
from plexrl_dask.dashboard.browser import fetch_json
from plexrl_dask.dashboard.components import JobsPage, QueuePage, ResidencyPage, TimelinePage, short
from plexrl_dask.dashboard.jobs import JOB_TOPIC, JobLedger, JobStepReport, UnionSeconds
from plexrl_dask.dashboard.routes import add_routes
from plexrl_dask.dashboard.state import (
    PlexRLDashboardPlugin,
    SpanStore,
    dashboard_of,
    decision_reason,
    finite,
)
from plexrl_dask.plugins import PlexRLSchedulerPlugin
from plexrl_dask.rl.ledger import JobWindow, ModeLedger
from plexrl_dask.shared.timeline import TOOL_OP, TOOL_TOPIC, RequestSpan

_PLEXRL = copy.deepcopy(dask.config.get("plexrl"))
_PLEXRL["dashboard"].update({"queue-rows": 7, "decisions-shown": 5, "timeline-batch": 50})
CONFIG = {"plexrl": _PLEXRL}
DASHBOARD = {"dashboard": True, "dashboard_address": "127.0.0.1:0"}


def report(job: str = "job-a", step: int = 0, **overrides) -> JobStepReport:
    fields = dict(
        job=job,
        name="grpo",
        step=step,
        steps=10,
        reward_mean=0.5,
        reward_max=1.0,
        sampled_tokens=100,
        loss=0.1,
        version=step + 1,
        wall_s=1.0,
        time=1000.0 + step,
    )
    return JobStepReport(**{**fields, **overrides})


# --- pure parts ----------------------------------------------------------------------------------


def test_job_reports_round_trip_and_bad_ones_are_typed_errors():
    r = report(loss=None)
    assert JobStepReport.from_event(r.to_event()) == r
    assert JobStepReport.from_event({**r.to_event(), "newer_field": 1}) == r
    for bad in (
        {"step": -1},
        {"job": ""},
        {"reward_mean": math.nan},
        {"steps": 1.5},
        {"loss": "x"},
    ):
        with pytest.raises(errors.InvalidJobReport):
            report(**bad)
    with pytest.raises(errors.InvalidJobReport, match="lacks"):
        JobStepReport.from_event({"job": "a"})
    with pytest.raises(errors.InvalidJobReport):
        JobStepReport.from_event(["not", "a", "dict"])


def random_spans(rng: random.Random, job: str, deployments: list[str], n: int) -> list[RequestSpan]:
    spans, t = [], 0.0
    for _ in range(n):
        t += rng.uniform(-0.5, 1.0)  # overlapping and gapped
        run, setup = rng.uniform(0.01, 1.0), rng.choice((0.0, rng.uniform(0, 0.3)))
        w = f"w{rng.randrange(3)}"
        spans.append(
            RequestSpan(w, rng.choice(deployments), job, "sample", t, t + setup, t + setup + run)
        )
    return spans


@pytest.mark.parametrize("seed", range(5))
def test_job_charges_and_isolated_estimate_equal_the_cost_ledger(seed):
    """Spans arriving in any order give the ledger's isolated lower bound (workers × union of
    the job's spans) and exact busy/setup sums."""
    rng = random.Random(seed)
    spans = random_spans(rng, "a", ["a-policy", "a-rollout"], 300) + random_spans(
        rng, "b", ["b-policy"], 200
    )
    ledger = JobLedger()
    shuffled = spans[:]
    rng.shuffle(shuffled)
    for s in shuffled:
        ledger.span(s)
    ledger.set_layout("a", 3)
    windows = (
        JobWindow("a", ("a-policy", "a-rollout"), "a-rollout", (), (), -math.inf, math.inf, 0),
        JobWindow("b", ("b-policy",), "b-policy", (), (), -math.inf, math.inf, 0),
    )
    mode = ModeLedger("multiplexed", windows, tuple(spans), -math.inf, math.inf, pool=("w0",))
    for job, workers in (("a", 3), ("b", 1)):
        single = ModeLedger(
            "multiplexed", tuple(w for w in windows if w.job == job), tuple(spans), 0, 1, ("w0",)
        )
        assert ledger.isolated_estimate_s(job) == pytest.approx(
            single.isolated_cost_lower_bound(workers)
        )
        mine = [s for s in spans if s.job == job]
        c = ledger.charges[job]
        assert c.requests == len(mine)
        assert c.busy_s == pytest.approx(sum(s.end - s.ready for s in mine))
        assert c.setup_s == pytest.approx(sum(s.ready - s.start for s in mine))
        assert c.charged_s == pytest.approx(sum(s.seconds for s in mine))
    assert mode.isolated_cost_lower_bound(1) == pytest.approx(
        ledger.charges["a"].union.seconds + ledger.charges["b"].union.seconds
    )


def test_union_seconds_folds_the_past_without_losing_length():
    u = UnionSeconds(horizon_s=5.0)
    for i in range(1000):  # 1 s intervals every 2 s, in order: half covered
        u.add(2.0 * i, 2.0 * i + 1.0)
    assert u.seconds == pytest.approx(1000.0)
    assert len(u._starts) <= 4  # folded: bounded memory
    u.add(0.0, 10.0)  # a very late interval reaching into the folded past counts nothing twice
    assert u.seconds == pytest.approx(1000.0)


def test_the_benchmarks_reference_work_is_fixed_and_counted_by_window():
    ref = ReferenceWork(target_ms=0.5)
    assert ref.iterations >= 1_000
    n = ref.iterations
    for _ in range(3):
        ref.run_once()
    assert ref.iterations == n  # fixed once: the same work every run
    assert all(wall > 0 and cpu >= 0 for _, wall, cpu in ref.runs)
    (a, _, _), (b, _, _), (c, _, _) = ref.runs
    assert ref.within([(b, c)]) == [ref.runs[1]]  # a window holds the runs started in it
    assert ref.within([(a, b), (c, c + 1)]) == [ref.runs[0], ref.runs[2]]
    assert ref.within([]) == []


def test_number_columns_encode_as_bokeh_expects_and_as_copies():
    """Finite numbers go out as a plain list (a copy: the message becomes JSON later, and a
    streamed source's lists grow in place); missing stays null; non-finite numbers get
    Bokeh's own encoding, whatever else the column holds."""
    from bokeh.core.serialization import Serializer

    from plexrl_dask.dashboard.base import Numbers, numbers

    column = numbers([1, 2.5, None])
    out = Serializer().encode(column)
    assert out == [1.0, 2.5, None]
    finite = Numbers([1.0, 2.0])
    out = Serializer().encode(finite)
    assert out == [1.0, 2.0] and out is not finite
    for bad in ([float("inf"), 1.0], [float("nan")], [1e308, 1e308, float("-inf")]):
        want = Serializer().encode(list(bad))  # how Bokeh encodes a plain list of them
        assert Serializer().encode(Numbers(bad)) == want


def test_span_store_windows_and_sequence_numbers():
    store = SpanStore(kept=4, window_s=10.0)
    spans = [
        RequestSpan("w", "d", "j", "op", t, t + 0.5, t + 1.0)
        for t in (0.0, 2.0, 4.0, 6.0, 8.0, 9.5)
    ]
    for s in spans:
        store.add(s)
    seq, got = store.since(0, 100)  # only the kept ones are still there
    assert got == spans[-4:] and seq == 6
    assert store.since(seq, 100) == (6, [])
    assert store.since(3, 2) == (5, spans[3:5])
    # window [5, 15]: the span at 4..5 ended at its start and is out; 6..7, 8..9, 9.5..10.5 in
    busy, setup = store.lanes(15.0)["w"]
    assert (busy, setup) == pytest.approx((1.5, 1.5))
    busy, setup = store.lanes(16.25)["w"]  # window [6.25, 16.25]: the 6..7 span is cut
    assert (busy, setup) == pytest.approx((1.5, 1.25))
    assert [s.start for s in store.recent(7.5, 10)] == [8.0, 9.5]


def test_a_tool_workers_overlapping_calls_count_once_in_its_busy_seconds():
    """A tool worker runs calls at once: its lane's busy seconds are their union (8 calls
    over the whole window are one window busy, not eight)."""
    store = SpanStore(kept=100, window_s=10.0)
    for i in range(8):
        store.add(RequestSpan("t", "tool:py", "j", TOOL_OP, 0.0, 0.0, 10.0 + i * 0.1))
    store.add(RequestSpan("t", "tool:py", "j", TOOL_OP, 12.0, 12.0, 13.0))
    assert store.lane("t", 10.0) == pytest.approx((10.0, 0.0))
    assert store.lane("t", 15.0) == pytest.approx((10.7 - 5.0 + 1.0, 0.0))


# --- pages on a scheduler ------------------------------------------------------------------------


async def installed(c, s) -> tuple[PlexRLSchedulerPlugin, PlexRLDashboardPlugin]:
    await c.register_plugin(PlexRLSchedulerPlugin())
    await c.register_plugin(PlexRLDashboardPlugin())
    return s.plugins["plexrl"], dashboard_of(s)


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_queue_page_shows_the_top_requests_and_totals_of_a_long_queue(c, s):
    plexrl, dash = await installed(c, s)
    syn = fill_synthetic(s, requests=10_000, workers=64, spans_per_worker=2, steps=3)
    page = QueuePage(s)
    page.update()
    data = page.source.data
    top = list(plexrl.dispatcher.pending())[:7]  # queue-rows: the longest-waiting admitted ones
    assert data["request"] == [r.request for r in top] == syn.requests[:7]
    assert data["deployment"] == [r.deployment for r in top]
    assert data["job"] == [r.job for r in top]
    assert all(r > 0 for r in data["ratio"]) and all(w > 0 for w in data["wait_s"])
    totals = page.totals.data
    assert sum(totals["pending"]) == 10_000 == len(plexrl.requests)
    assert sum(totals["shown"]) == 7
    assert totals["owner"] == [plexrl.deployments[d].owner for d in totals["deployment"]]
    assert "10,000</b> pending" in page.summary.text
    held = len(plexrl.queue_view(1)["held"])  # (none: no gang or turn holds by default)
    assert f"<b>{held}</b> free workers held" in page.summary.text
    decisions = page.decisions.data
    newest = list(plexrl.decisions)[::-1][:5]
    assert decisions["deployment"] == [d["deployment"] for d in newest]
    assert all(decisions["reason"]) and len(decisions["reason"]) == 5
    # A released request leaves the page on the next update.
    first = syn.requests.pop(0)
    plexrl.dispatcher.remove(first)
    page.update()
    assert first not in page.source.data["request"]
    assert len(page.source.data["request"]) == 7
    # The decisions are rebuilt only when one is recorded, or the policy (their reasons) moves.
    shown = page.decisions.data
    page.update()
    assert page.decisions.data is shown
    plexrl.decisions.append({**newest[0], "request": "a-new-one", "deployment": "newest"})
    page.update()
    assert page.decisions.data["deployment"][0] == "newest"
    reasons = list(page.decisions.data["reason"])
    plexrl.policy = dataclasses.replace(plexrl.policy, setup_weight=0.0, patience_factor=0.0)
    page.update()
    assert list(page.decisions.data["reason"]) != reasons


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_residency_page_shows_every_report_and_bytes_per_node(c, s):
    plexrl, dash = await installed(c, s)
    fill_synthetic(s, requests=10, workers=24, spans_per_worker=1, steps=1)
    page = ResidencyPage(s)
    page.update()
    reports = plexrl.residency.reports()
    data = page.source.data
    assert list(zip(data["deployment"], data["worker"], data["tier"], strict=True)) == [
        (r.deployment, r.worker, r.tier) for r in reports
    ]
    assert list(data["bytes"]) == [r.bytes for r in reports]
    nodes = page.nodes.data
    for n, node in enumerate(nodes["node"]):
        mine = [r for r in reports if plexrl.worker_capacity[r.worker]["node"] == node]
        for tier in ("hbm", "dram", "nvme"):
            assert nodes[f"{tier}_bytes"][n] == sum(r.bytes for r in mine if r.tier == tier)
    assert set(page.heat.y_range.factors) == {r.deployment for r in reports}
    # No change: no work (the sources are left alone).
    before = page.source.data
    page.update()
    assert page.source.data is before
    # Reports arrive: only their cells change (an absent one stays, invisible), and the node
    # totals follow.
    r, moved = reports[0], reports[1]
    plexrl.residency.apply(type(r)(r.deployment, r.version, "absent", 0, 0.0, r.worker, r.uid))
    dash.mark_residency(r.deployment, r.worker)
    new_tier = "nvme" if moved.tier != "nvme" else "dram"
    plexrl.residency.apply(
        type(moved)(moved.deployment, 2, new_tier, moved.bytes, 0.5, moved.worker, moved.uid)
    )
    dash.mark_residency(moved.deployment, moved.worker)
    page.update()
    data = page.source.data
    i = list(zip(data["deployment"], data["worker"], strict=True)).index((r.deployment, r.worker))
    assert data["tier"][i] == "absent" and data["bytes"][i] == 0
    j = list(zip(data["deployment"], data["worker"], strict=True)).index(
        (moved.deployment, moved.worker)
    )
    assert (data["tier"][j], data["version"][j]) == (new_tier, 2)
    shown = {
        (d, w, t)
        for d, w, t in zip(data["deployment"], data["worker"], data["tier"], strict=True)
        if t != "absent"
    }
    assert shown == {
        (c["deployment"], c["worker"], c["tier"]) for c in dash.residency_view()["cells"]
    }
    nodes = page.nodes.data
    for n, node in enumerate(nodes["node"]):
        for tier in ("hbm", "dram", "nvme"):
            want = sum(
                x.bytes
                for x in plexrl.residency.reports()
                if x.tier == tier and plexrl.worker_capacity[x.worker]["node"] == node
            )
            assert nodes[f"{tier}_bytes"][n] == want


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_timeline_page_streams_new_spans_in_bounded_batches(c, s):
    plexrl, dash = await installed(c, s)
    syn = fill_synthetic(s, requests=10, workers=8, spans_per_worker=20, steps=1)
    page = TimelinePage(s)
    page.update()  # a new page starts with the newest timeline-batch (50) spans
    kept = dash.spans.since(0, 10**6)[1]
    assert len(page.source.data["start"]) == 50
    assert list(page.source.data["start"]) == [1000 * sp.start for sp in kept[-50:]]
    churn(s, syn, random.Random(0), dt=20.0)  # 160 new spans: four updates to catch up
    new = dash.spans.next_seq - len(kept)
    sizes = []
    for _ in range(5):
        n0 = len(page.source.data["start"])
        page.update()
        sizes.append(len(page.source.data["start"]) - n0)
    assert max(sizes) <= 50 and sum(sizes) == new
    # a span's worker is its lane's (the idle source has a row per lane, in lane order)
    lane_worker = list(page.idle.data["worker"])
    streamed = {
        (lane_worker[int(lane)], st)
        for lane, st in zip(page.source.data["lane"], page.source.data["start"], strict=True)
    }
    assert {(sp.worker, 1000 * sp.start) for sp in dash.spans.since(0, 10**6)[1][-new:]} <= streamed
    # Running requests and every worker's lane, labelled with its idle fraction.
    running = page.running.data
    assert sorted(running["worker"]) == sorted(v[3] for v in plexrl.started.values())
    lanes = page._lanes  # a lane per worker, with its idle fraction beside it
    assert set(lanes) >= set(syn.workers)
    assert lane_worker == sorted(lanes, key=lanes.get)
    labels = page.figure.yaxis[0].major_label_overrides
    assert all(labels[lanes[w]] == short(w) for w in syn.workers)
    page.update()  # refreshes the idle fractions of up to 32 lanes: all 8 here
    rows = dash.worker_lanes(time.time())[0]
    idle = dict(zip(page.idle.data["worker"], page.idle.data["idle"], strict=True))
    for w in rows:
        assert idle[w["worker"]] == pytest.approx(w["idle_fraction"], abs=0.01)
    assert list(page.colors.factors) == sorted(set(page.source.data["job"]), key=dash.job_slot)
    # Only spans that waited for a setup get a (hatched) setup bar.
    waited = [s for s in dash.spans.since(0, 10**6)[1] if s.ready > s.start]
    setups = {
        st for st, w in zip(page.source.data["start"], page.source.data["waited"], strict=True) if w
    }
    assert setups and setups <= {1000 * s.start for s in waited}


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_tool_calls_reported_by_a_driver_are_lanes_of_the_timeline_not_charges(c, s):
    _, dash = await installed(c, s)
    now = time.time()
    spans = [
        {"worker": "tcp://10.0.0.9:4000", "tool": "calc", "start": now - 2.0, "end": now - 1.5},
        {"worker": "tcp://10.0.0.9:4000", "tool": "py", "start": now - 1.0, "end": now - 0.2},
    ]
    await c.log_event(TOOL_TOPIC, {"job": "job-t", "spans": spans})
    for bad in (
        {"job": "job-t"},
        {"job": "job-t", "spans": [{"worker": "w", "tool": "x", "start": 2.0, "end": 1.0}]},
    ):
        await c.log_event(TOOL_TOPIC, bad)  # fmt: skip
    deadline = time.monotonic() + 10
    while dash.counters["bad_tool_reports"] < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert dash.counters["tool_spans"] == 2 and dash.counters["bad_tool_reports"] == 2
    page = TimelinePage(s)
    page.update()
    data = page.source.data
    assert list(data["op"]) == ["tool", "tool"] and list(data["job"]) == ["job-t", "job-t"]
    assert list(data["deployment"]) == ["tool:calc", "tool:py"]
    assert "tcp://10.0.0.9:4000" in page._lanes
    assert "job-t" not in dash.ledger.charges  # tool workers are not the pool
    # ...and the Jobs page counts each job's calls and their seconds (not charged)
    [row] = [r for r in dash.jobs_view()["jobs"] if r["job"] == "job-t"]
    assert row["tool_calls"] == 2 and row["tool_s"] == pytest.approx(1.3)
    assert row["charged_s"] == 0.0
    jobs = JobsPage(s)
    jobs.update()
    [i] = [k for k, j in enumerate(jobs.source.data["job"]) if j == "job-t"]
    assert jobs.source.data["tool_calls"][i] == 2


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_jobs_page_shows_steps_rewards_and_charges(c, s):
    plexrl, dash = await installed(c, s)
    s.log_event(JOB_TOPIC, report("job-a", 0, reward_mean=0.25).to_event())
    s.log_event(JOB_TOPIC, report("job-a", 1, reward_mean=0.75).to_event())
    s.log_event(JOB_TOPIC, {"job": "broken"})  # ignored (counted), never raised in the hook
    dash.add_spans(
        [
            RequestSpan("w1", "a-policy", "job-a", "sample", 10.0, 11.0, 13.0),
            RequestSpan("w1", "b-policy", "job-b", "sample", 13.0, 13.0, 14.0),
        ]
    )
    page = JobsPage(s)
    page.update()
    data = page.source.data
    assert data["job"] == ["job-a", "job-b"] or data["job"] == ["job-b", "job-a"]
    a = data["job"].index("job-a")
    assert data["progress"][a] == "2/10" and data["reward_mean"][a] == 0.75
    assert data["charged_s"][a] == pytest.approx(3.0) and data["setup_s"][a] == pytest.approx(1.0)
    assert data["share"][a] == pytest.approx(0.75)
    assert data["isolated_s"][a] == pytest.approx(3.0)
    curves = page.curves.data
    assert curves["job"] == ["job-a"]
    assert list(curves["xs"][0]) == [0, 1] and list(curves["ys"][0]) == [0.25, 0.75]
    assert dash.counters["bad_job_reports"] == 1
    # A new step redraws the curve (ragged columns of arrays compare safely).
    s.log_event(JOB_TOPIC, report("job-a", 2, reward_mean=0.5).to_event())
    page.update()
    assert list(page.curves.data["ys"][0]) == [0.25, 0.75, 0.5]
    assert page.source.data["progress"][page.source.data["job"].index("job-a")] == "3/10"
    # Rows keep their places while activity moves (job-b is now the most recent), and a
    # second job's curve joins; a step of one job then changes only its own curve.
    rows = list(page.source.data["job"])
    dash.add_spans([RequestSpan("w1", "b-policy", "job-b", "sample", 20.0, 20.0, 22.0)])
    s.log_event(JOB_TOPIC, report("job-b", 0, reward_mean=0.1).to_event())
    page.update()
    assert list(page.source.data["job"]) == rows
    assert page.source.data["charged_s"][rows.index("job-b")] == pytest.approx(3.0)
    assert list(page.curves.data["job"]) == [j for j in rows if j in ("job-a", "job-b")]
    b_curve = page.curves.data["ys"][list(page.curves.data["job"]).index("job-b")]
    s.log_event(JOB_TOPIC, report("job-a", 3, reward_mean=0.9).to_event())
    page.update()
    curves = page.curves.data
    assert curves["ys"][list(curves["job"]).index("job-b")] is b_curve
    assert list(curves["ys"][list(curves["job"]).index("job-a")]) == [0.25, 0.75, 0.5, 0.9]


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_jobs_page_drops_the_curve_of_a_job_no_longer_shown(c, s):
    """A job pushed off the page by another job's requests (no new step anywhere) takes its
    curve with it."""
    _, dash = await installed(c, s)
    s.log_event(JOB_TOPIC, report("job-a", 0, reward_mean=0.5).to_event())
    dash.cfg = dataclasses.replace(dash.cfg, jobs_shown=1)
    page = JobsPage(s)
    page.update()
    assert list(page.curves.data["job"]) == ["job-a"]
    dash.add_spans([RequestSpan("w1", "b-policy", "job-b", "sample", 30.0, 30.0, 31.0)])
    page.update()
    assert page.source.data["job"] == ["job-b"]
    assert list(page.curves.data["job"]) == []


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_jobs_page_sends_a_bounded_number_of_curves_per_update(c, s):
    """Every job steps at once: an update sends at most ``curves-per-update`` curves, those
    longest out of date first, and the next updates send the rest without new steps."""
    _, dash = await installed(c, s)
    jobs = [f"job-{k}" for k in range(5)]
    for job in jobs:
        s.log_event(JOB_TOPIC, report(job, 0, reward_mean=0.1).to_event())
    with dask.config.set({"plexrl.dashboard.curves-per-update": 2}):
        page = JobsPage(s)
    assert page.cfg.curves_per_update == 2
    page.update()  # the jobs shown are new: every curve, once
    shown = list(page.curves.data["job"])
    assert sorted(shown) == jobs

    def ys(job: str) -> list[float]:
        return list(page.curves.data["ys"][shown.index(job)])

    for job in jobs:
        s.log_event(JOB_TOPIC, report(job, 1, reward_mean=0.2).to_event())
    current = []
    for _ in range(3):
        before = {job: ys(job) for job in jobs}
        page.update()
        sent = [job for job in jobs if ys(job) != before[job]]
        assert 1 <= len(sent) <= 2 and not set(sent) & set(current)
        current += sent
    assert sorted(current) == jobs and all(ys(job) == [0.1, 0.2] for job in jobs)
    # nothing is left to send: an update without news sends nothing
    before = {job: ys(job) for job in jobs}
    page.update()
    assert {job: ys(job) for job in jobs} == before
    # the curves sent last wait longest next time
    for job in jobs:
        s.log_event(JOB_TOPIC, report(job, 2, reward_mean=0.3).to_event())
    page.update()
    first = [job for job in jobs if ys(job)[-1] == 0.3]
    assert len(first) == 2 and not set(first) & set(current[-1:])


@gen_cluster(
    client=True,
    nthreads=[],
    config={
        "plexrl": {**_PLEXRL, "dashboard": {**_PLEXRL["dashboard"], "idle-lanes-per-update": 3}}
    },
    scheduler_kwargs=DASHBOARD,
)
async def test_timeline_refreshes_idle_fractions_a_few_lanes_per_update(c, s):
    plexrl, dash = await installed(c, s)
    syn = fill_synthetic(s, requests=10, workers=8, spans_per_worker=20, steps=1)
    page = TimelinePage(s)
    page.update()  # every lane appears at once, with its idle fraction
    assert list(page.idle.data["worker"]) == list(page._lanes)
    assert set(page._lanes) >= set(syn.workers)
    churn(s, syn, random.Random(1), dt=120.0)  # busy workers: their fractions drop
    want = {w["worker"]: w["idle_fraction"] for w in dash.worker_lanes(time.time())[0]}
    stale = dict(zip(page.idle.data["worker"], page.idle.data["idle"], strict=True))
    changed = {w for w in want if abs(want[w] - stale[w]) > 0.01}
    assert len(changed) > 3
    page.update()  # at most 3 lanes refreshed per update
    now = dict(zip(page.idle.data["worker"], page.idle.data["idle"], strict=True))
    assert sum(now[w] != stale[w] for w in want) <= 3
    for _ in range(2):  # 8 lanes: all refreshed after three updates
        page.update()
    now = dict(zip(page.idle.data["worker"], page.idle.data["idle"], strict=True))
    for w, idle in want.items():
        assert now[w] == pytest.approx(idle, abs=0.01)


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_pages_without_the_plugin_say_so(c, s):
    for cls in (TimelinePage, ResidencyPage, QueuePage, JobsPage):
        page = cls(s)
        page.update()
        assert "not installed" in page.banner.text


# --- JSON routes ---------------------------------------------------------------------------------


async def get_json(s, path: str):
    port = s.http_server.port
    resp = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}{path}", request_timeout=30)
    assert resp.headers["Content-Type"] == "application/json"
    return json.loads(resp.body)


def same(view: dict) -> dict:
    """``view`` as the routes encode it."""
    return json.loads(json.dumps(finite(view)))


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_json_routes_return_exactly_the_plugin_state(c, s):
    plexrl, dash = await installed(c, s)
    fill_synthetic(s, requests=500, workers=32, spans_per_worker=5, steps=4)
    data = await get_json(s, "/plexrl/queue.json")
    assert data == same(dash.queue_view(now=data["queue"]["now"]))
    assert [r["request"] for r in data["queue"]["top"]] == [
        r.request for r in list(plexrl.dispatcher.pending())[:7]
    ]
    data = await get_json(s, "/plexrl/queue.json?limit=300")
    assert len(data["queue"]["top"]) == 300 and data["queue"]["pending"] == 500
    data = await get_json(s, "/plexrl/timeline.json")
    assert data == same(dash.timeline_view(now=data["now"]))
    assert len(data["spans"]) == 50  # timeline-batch
    data = await get_json(s, "/plexrl/timeline.json?limit=1000")
    window = dash.cfg.timeline_window_s
    kept = dash.spans.since(0, 10**6)[1]
    assert data["spans"] == same([sp.to_dict() for sp in kept if sp.end > data["now"] - window])
    assert await get_json(s, "/plexrl/residency.json") == same(dash.residency_view())
    data = await get_json(s, "/plexrl/jobs.json")
    assert data == same(dash.jobs_view())
    assert {j["job"] for j in data["jobs"]} == {f"job-{k}" for k in range(8)}
    for bad in (
        "/plexrl/queue.json?limit=0",
        "/plexrl/queue.json?limit=ten",
        "/plexrl/jobs.json?limit=3",
    ):
        with pytest.raises(HTTPClientError) as e:
            await get_json(s, bad)
        assert e.value.code == 400
        assert json.loads(e.value.response.body)["error"] == "InvalidDashboardQuery"


async def get_metrics(s) -> dict[tuple[str, tuple], float]:
    """The scheduler's Prometheus ``/metrics`` (Dask's route), parsed: (sample name, sorted
    labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    port = s.http_server.port
    resp = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/metrics", request_timeout=30)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(resp.body.decode())
        for sample in family.samples
    }


@gen_cluster(client=True, nthreads=[], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_prometheus_metrics_are_the_dashboard_views_beside_dasks_own(c, s):
    pytest.importorskip("prometheus_client")
    plexrl, dash = await installed(c, s)
    fill_synthetic(s, requests=500, workers=32, spans_per_worker=5, steps=4)
    m = await get_metrics(s)
    assert ("dask_scheduler_clients", ()) in m  # Dask's own metrics are still served
    jobs = dash.jobs_view(with_history=False)["jobs"]
    assert len(jobs) == 8
    for row in jobs:
        job = (("job", row["job"]),)
        assert m[("dask_plexrl_job_charged_seconds_total", job)] == pytest.approx(row["charged_s"])
        assert m[("dask_plexrl_job_busy_seconds_total", job)] == pytest.approx(row["busy_s"])
        assert m[("dask_plexrl_job_setup_seconds_total", job)] == pytest.approx(row["setup_s"])
        assert m[("dask_plexrl_job_share", job)] == pytest.approx(row["share"])
        assert m[("dask_plexrl_job_step", job)] == row["step"] == 4
        assert m[("dask_plexrl_job_reward_mean", job)] == pytest.approx(row["reward_mean"])
        counts = plexrl.job_counters.get(row["job"], {})
        assert m[("dask_plexrl_job_requests_dispatched_total", job)] == counts.get("dispatched", 0)
        for outcome in ("completed", "failed"):
            key = ("dask_plexrl_job_requests_ended_total", (*job, ("outcome", outcome)))
            assert m[key] == counts.get(outcome, 0)
    queue = dash.queue_view(limit=1, with_decisions=False)["queue"]
    assert m[("dask_plexrl_queue_requests", (("state", "pending"),))] == 500
    assert m[("dask_plexrl_queue_requests", (("state", "admitted"),))] == queue["admitted"]
    # (read after the scrape: the oldest request has waited a little longer)
    assert 0 < m[("dask_plexrl_queue_oldest_wait_seconds", ())] <= queue["top"][0]["wait_s"]
    for name, n in queue["by_deployment"].items():
        assert m[("dask_plexrl_deployment_pending_requests", (("deployment", name),))] == n
    assert m[("dask_plexrl_deployments", ())] == len(plexrl.deployments) == 32
    nodes = dash.node_bytes()
    assert len(nodes) == 4  # 32 workers, 8 per node
    for entry in nodes:
        for tier in ("hbm", "dram", "nvme"):
            key = ("dask_plexrl_node_tier_bytes", (("node", entry["node"]), ("tier", tier)))
            assert m[key] == entry[f"{tier}_bytes"]
    lanes, _ = dash.worker_lanes(time.time())
    assert {k[1][0][1] for k in m if k[0] == "dask_plexrl_worker_idle_fraction"} == {
        w["worker"] for w in lanes
    }
    timed = scrape_times(5)  # the benchmark's measurement of a scrape
    assert (
        timed["metrics_samples"] > 8 * 10 and 0 < timed["metrics_ms_p50"] <= timed["metrics_ms_max"]
    )
    # Off the scheduler's loop (a driver's own exporter thread, say) nothing of PlexRL's is
    # collected: the plugins' state belongs to the loop.
    assert await asyncio.to_thread(lambda: list(metrics.collector().collect())) == []
    # A collection that fails yields nothing and leaves Dask's metrics on the route.
    real, dash.node_bytes = dash.node_bytes, lambda: 1 / 0
    failed = await get_metrics(s)
    assert ("dask_scheduler_clients", ()) in failed
    assert not [k for k in failed if k[0].startswith("dask_plexrl_")]
    dash.node_bytes = real
    # A scrape starts no node polling (the Residency page does), and the metrics follow the
    # plugin: gone with it, back with the next one.
    assert dash._residency_watched == float("-inf")
    await c.unregister_scheduler_plugin("plexrl-dashboard")
    assert not [k for k in await get_metrics(s) if k[0].startswith("dask_plexrl_")]
    await c.register_plugin(PlexRLDashboardPlugin())
    assert ("dask_plexrl_deployments", ()) in await get_metrics(s)


@gen_cluster(
    client=True,
    nthreads=[],
    config={
        **CONFIG,
        "distributed.scheduler.http.routes": ["distributed.http.health", ROUTES_MODULE],
    },
    scheduler_kwargs=DASHBOARD,
)
async def test_routes_from_the_config_answer_404_without_the_plugin(c, s):
    with pytest.raises(HTTPClientError) as e:
        await get_json(s, "/plexrl/jobs.json")
    assert e.value.code == 404
    assert "not installed" in json.loads(e.value.response.body)["message"]
    # Installing the plugin later does not add the routes twice; they answer at once.
    await c.register_plugin(PlexRLSchedulerPlugin())
    await c.register_plugin(PlexRLDashboardPlugin())
    assert (await get_json(s, "/plexrl/jobs.json"))["installed"] is True
    assert add_routes(s) is False  # already served (from the config)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_queue_view_ratio_and_best_worker_on_live_workers(c, s, a):
    """With a live worker the queue view gives each request its HRRS ratio and the group the
    dispatcher would rank best."""
    plexrl, dash = await installed(c, s)
    fill_synthetic(s, requests=0, workers=4, spans_per_worker=0, steps=0, decisions=0)
    plexrl.dispatcher.add_worker(a.address)
    name = next(iter(plexrl.deployments))
    info = plexrl.deployments[name]
    plexrl.deployments[name] = info.with_(workers=(a.address,))
    add_request(plexrl, "r1", name, "forward", info.owner, 0.0)
    view = dash.queue_view(now=100.0)
    (row,) = view["queue"]["top"]
    ratio, setup = plexrl.dispatcher.ratio(next(iter(plexrl.dispatcher.pending())), 100.0)
    assert row["worker"] == [a.address] and row["wait_s"] == 100.0
    assert row["ratio"] == pytest.approx(ratio) and row["setup_s"] == pytest.approx(setup)


def test_a_preloaded_dask_scheduler_serves_the_pages_and_routes(tmp_path):
    """The shared-cluster path: ``dask scheduler --preload plexrl_dask.plugins`` lists the
    pages in its menu data and answers the JSON routes."""
    with scheduler_process(tmp_path) as info:
        base = f"http://127.0.0.1:{info['services']['dashboard']}"
        plots = fetch_json(f"{base}/individual-plots.json")
        assert set(PAGES) <= set(plots.values())
        jobs = fetch_json(f"{base}/plexrl/jobs.json")
        assert jobs["installed"] is True and jobs["jobs"] == []
        queue = fetch_json(f"{base}/plexrl/queue.json")
        assert queue["queue"]["pending"] == 0
        if importlib.util.find_spec("prometheus_client") is not None:
            with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
                metrics = resp.read().decode()
            assert "dask_plexrl_deployments 0.0" in metrics.splitlines()
            assert 'dask_plexrl_queue_requests{state="pending"} 0.0' in metrics.splitlines()


def test_decision_reasons_say_why_and_where_a_request_was_released():
    hrrs = {"setup_weight": 2.0, "patience_factor": 8.0}
    fifo = {"setup_weight": 0.0, "patience_factor": 0.0}
    assert (
        decision_reason({"ratio": 1.5, "setup_s": 0.0}, hrrs)
        == "highest ratio 1.50 on a free worker, resident (no setup)"
    )
    assert decision_reason({"ratio": 1.5, "setup_s": 0.25, "behind": "r1"}, hrrs) == (
        "highest ratio 1.50 on a busy worker, after a 0.25s load, "
        "queued behind the request running there"
    )
    assert decision_reason({"urgent": True, "wait_s": 12.0, "behind": "r1"}, hrrs) == (
        "urgent: waited 12.0s, past its patience; resident (no setup), "
        "queued behind the request running there"
    )
    assert decision_reason({"behind": None}, fifo) == "fifo: oldest request, resident (no setup)"
