"""End to end: the PlexRL dashboard pages in a real headless Chromium.

A real process ``local_cluster`` runs two small GRPO jobs (one colocated, one split with a
rollout deployment, on a memory budget that makes the holders offload, so every residency tier
shows up); then a request that holds one worker (until the test opens a gate) keeps four more
queued behind it. Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by selenium)
opens every page from the dashboard's "More…" menu, waits until the page's data — read from the
Bokeh document in the browser — shows the rows the page's JSON route reports at that moment,
checks the console has no errors, and saves a screenshot (into ``$PLEXRL_DASHBOARD_SCREENSHOTS``
when set, else the test's temporary directory).

Skipped only where no Chromium binary exists; ``.ci/run`` installs it.
"""

from __future__ import annotations

import importlib.util
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import dask
import pytest
from distributed import Client, Event

import plexrl_dask as plexrl
from plexrl_dask.dashboard import PAGES
from plexrl_dask.dashboard.browser import Browser, fetch_json, find_chromium
from plexrl_dask.rl import GRPOConfig, GRPOJob, run_jobs
from plexrl_dask.tasks import Problem
from tests.conftest import hold, tiny_spec, unique

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium binary: apt-get install chromium chromium-driver (.ci/run does)",
)

WAIT_S = 90.0
STEPS = 2


@dataclass(frozen=True)
class StartsWithDigit:
    """A task an untrained model sometimes solves (rewards vary within groups, so each step
    trains): the completion must start with a digit."""

    stop: str = "\n"

    def problems(self, start: int, count: int) -> list[Problem]:
        return [
            Problem(prompt=f"{i % 89}=", answer="1\n", index=i) for i in range(start, start + count)
        ]

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion[:1].isdigit() else 0.0


def until(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)


def page_rows(browser: Browser, page: str) -> set | list | None:
    """What the page in the browser shows, keyed like :func:`route_rows`."""
    if page == "timeline":
        d = browser.source("plexrl-timeline-spans", ["lane", "start"])
        lanes = browser.source("plexrl-timeline-idle", ["worker"])  # a row per lane, in order
        if d is None or lanes is None:
            return None
        workers = lanes["worker"]
        if any(lane >= len(workers) for lane in d["lane"]):
            return None  # a span's lane before its row beside the lanes
        return {(workers[int(lane)], st) for lane, st in zip(d["lane"], d["start"], strict=True)}
    if page == "residency":
        d = browser.source("plexrl-residency-cells", ["deployment", "worker", "tier"])
        if d is None:
            return None
        cells = zip(d["deployment"], d["worker"], d["tier"], strict=True)
        return {c for c in cells if c[2] != "absent"}  # an absent cell stays, invisible
    if page == "queue":
        d = browser.source("plexrl-queue-requests", ["request"])
        return None if d is None else d["request"]
    d = browser.source("plexrl-jobs-table", ["job", "step"])
    return None if d is None else set(zip(d["job"], d["step"], strict=True))


def route_rows(base: str, page: str) -> tuple[set | list, dict]:
    data = fetch_json(f"{base}/plexrl/{page}.json")
    if page == "timeline":
        return {(s["worker"], 1000 * s["start"]) for s in data["spans"]}, data
    if page == "residency":
        return {(c["deployment"], c["worker"], c["tier"]) for c in data["cells"]}, data
    if page == "queue":
        return [r["request"] for r in data["queue"]["top"]], data
    return {(j["job"], j["step"]) for j in data["jobs"]}, data


def shows(base: str, browser: Browser, page: str) -> bool:
    """Whether the page shows the route's rows now (the Timeline: all of them, among the
    older ones it keeps)."""
    want, _ = route_rows(base, page)
    got = page_rows(browser, page)
    if got is None:
        return False
    return want <= got if page == "timeline" else want == got


def test_every_page_shows_what_its_route_reports_in_chromium(tmp_path):
    shots = Path(os.environ.get("PLEXRL_DASHBOARD_SCREENSHOTS") or tmp_path)
    with (
        dask.config.set({"plexrl.dashboard.timeline-window": "40s"}),
        plexrl.local_cluster(n_workers=2, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        base = cluster.dashboard_link.rsplit("/", 1)[0]
        assert base.startswith("http://127.0.0.1:")
        # The pages are in individual-plots.json (JupyterLab) and the "More..." menu.
        plots = fetch_json(f"{base}/individual-plots.json")
        assert set(PAGES) <= set(plots.values())
        with urllib.request.urlopen(f"{base}/status", timeout=30) as resp:
            menu = resp.read().decode()
        assert all(url.lstrip("/") in menu for url in PAGES)

        # Two small real jobs at once on the pool.
        jobs = []
        for k, split in ((0, False), (1, True)):
            runtime = plexrl.Runtime(client, job=unique(f"dash-job{k}"))
            spec = tiny_spec(seed=30 + k)
            policy = runtime.deploy(unique(f"dash-policy{k}"), spec)
            rollout = (
                runtime.deploy(unique(f"dash-rollout{k}"), spec, role="rollout") if split else None
            )
            config = GRPOConfig(
                steps=STEPS, prompts_per_step=4, group_size=4, max_tokens=6, lr=1e-2, seed=k
            )
            jobs.append(
                GRPOJob(f"grpo{k}", runtime, StartsWithDigit(), policy, config, rollout=rollout)
            )
        run_jobs(jobs, timeout=600)
        names = {j.runtime.job for j in jobs}

        def jobs_done() -> bool:
            rows = {j["job"]: j for j in fetch_json(f"{base}/plexrl/jobs.json")["jobs"]}
            return all(
                n in rows and rows[n]["step"] == STEPS and rows[n]["requests"] > 0 for n in names
            )

        until(jobs_done, "both jobs' steps and spans on the dashboard")
        # Prometheus scrapes the same numbers from the scheduler's own /metrics (where
        # prometheus_client is installed: the test extra has it).
        if importlib.util.find_spec("prometheus_client") is not None:
            from prometheus_client.parser import text_string_to_metric_families

            with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
                samples = {
                    (s.name, s.labels.get("job")): s.value
                    for f in text_string_to_metric_families(resp.read().decode())
                    for s in f.samples
                }
            for name in names:
                assert samples[("dask_plexrl_job_step", name)] == STEPS
                assert samples[("dask_plexrl_job_charged_seconds_total", name)] > 0
        # The split job's rollout offloaded to the node's DRAM tier (its owner asks).
        rollout = jobs[1].rollout
        assert rollout.offload() == {rollout.info.workers[0]: True}

        # A frozen queue: a request holds the first job's worker, four more wait behind it
        # (with lookahead, the first of them queued on the worker, the others pending).
        first = jobs[0]
        gate = Event(unique("dash-gate"), client=client)
        with dask.annotate(plexrl=first.policy.annotation(op="hold")):
            blocker = client.submit(hold, first.policy.name, gate.name, 300.0, pure=False)
        datum = plexrl.Datum.from_prompt_completion(
            first.policy.tokenize("12="), first.policy.tokenize("3\n")
        )
        queued = [first.policy.forward([datum]) for _ in range(4)]
        until(
            lambda: (
                (q := fetch_json(f"{base}/plexrl/queue.json")["queue"])["admitted"]
                + len(q["queued"])
                == 4
            ),
            "four requests queued behind the held worker",
        )
        try:
            with Browser(width=1400, height=1000, timeout=WAIT_S) as browser:
                for url in PAGES:
                    page = url.rsplit("-", 1)[-1]
                    browser.open(base + url)
                    browser.wait_for(
                        lambda page=page: shows(base, browser, page), f"the {page} rows"
                    )
                    want, data = route_rows(base, page)
                    assert want, f"the {page} route reports no rows: {data}"
                    time.sleep(1.0)  # let the canvas draw what arrived
                    browser.screenshot(shots / f"{page}.png")
                    errors = browser.console_errors()
                    assert not errors, f"console errors on {url}: {errors}"
                    if page == "jobs":
                        assert {j for j, _ in want} == names
                    if page == "timeline":
                        assert {s["job"] for s in data["spans"]} >= names
                        assert {r["op"] for r in data["running"]} == {"hold"}
                        # the tooltip's worker, setup and run seconds, derived in the browser
                        shown = browser.source("plexrl-timeline-spans", ["start"])["start"]
                        by_start = {1000 * s["start"]: s for s in data["spans"]}
                        i = next(i for i, st in enumerate(shown) if st in by_start)
                        span = by_start[shown[i]]
                        worker = browser.hover_value("plexrl-timeline-hover-worker", i)
                        assert worker == span["worker"]
                        setup = browser.hover_value("plexrl-timeline-hover-setup", i)
                        ran = browser.hover_value("plexrl-timeline-hover-ran", i)
                        assert float(setup) == pytest.approx(
                            span["ready"] - span["start"], abs=2e-3
                        )
                        assert float(ran) == pytest.approx(span["end"] - span["ready"], abs=2e-3)
                        # the browser scrolls the time axis itself, to the scheduler's now
                        end = browser.model_property("plexrl-timeline-x", "end")
                        browser.wait_for(
                            lambda end=end: (
                                browser.model_property("plexrl-timeline-x", "end") > end + 500
                            ),
                            "the time axis scrolling",
                        )
                        assert (
                            abs(
                                browser.model_property("plexrl-timeline-x", "end")
                                - 1000 * time.time()
                            )
                            < 5000
                        )
                    if page == "residency":
                        assert {"hbm", "dram"} <= {t for _, _, t in want}
        finally:
            gate.set()
        assert blocker.result(timeout=WAIT_S) == first.policy.name
        assert all(len(f.result(timeout=WAIT_S).logprobs) == 1 for f in queued)
        for page in ("timeline", "residency", "queue", "jobs"):
            assert (shots / f"{page}.png").read_bytes()[:4] == b"\x89PNG"
