"""The table pages: Queue and Jobs (see :mod:`plexrl_dask.dashboard.components`).

Both redraw from the dashboard plugin's views; the Queue patches its tables in place while
their rows stay the same (times and ratios move every update), the Jobs page redraws only when
a span or a step report arrived, and its reward curves only on a report.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from bokeh.layouts import column
from bokeh.models import ColumnDataSource, DataTable, Div
from bokeh.plotting import figure

from plexrl_dask.dashboard.base import (
    Page,
    fit_table,
    job_color,
    lean,
    numbers,
    refresh,
    set_data,
    short,
    strings,
    table_columns,
)
from plexrl_dask.dashboard.state import PlexRLDashboardPlugin

logger = logging.getLogger(__name__)


class QueuePage(Page):
    """The top pending requests (the longest-waiting admitted ones) with their current HRRS
    ratio and setup on their best worker, totals per deployment for the rest, and the most
    recent dispatch decisions with their reasons."""

    REQUEST_FIELDS = (
        "request",
        "job",
        "deployment",
        "op",
        "wait_s",
        "ratio",
        "setup_s",
        "service_s",
        "worker",
        "urgent",
    )
    DECISION_FIELDS = (
        "time",
        "job",
        "deployment",
        "op",
        "workers",
        "wait_s",
        "ratio",
        "setup_s",
        "reason",
    )

    def __init__(self, scheduler: Any, **kwargs: Any) -> None:
        super().__init__(scheduler)
        self._decisions_mark: tuple | None = None  # of the decisions shown
        self.summary = Div(text="", name="plexrl-queue-summary")
        self.source = ColumnDataSource(
            {c: [] for c in self.REQUEST_FIELDS}, name="plexrl-queue-requests"
        )
        self.totals = ColumnDataSource(
            {c: [] for c in ("deployment", "owner", "pending", "shown")}, name="plexrl-queue-totals"
        )
        self.decisions = ColumnDataSource(
            {c: [] for c in self.DECISION_FIELDS}, name="plexrl-queue-decisions"
        )
        self.requests_table = requests = DataTable(
            source=self.source,
            columns=table_columns(
                [
                    ("job", "job", None),
                    ("deployment", "deployment", None),
                    ("op", "op", None),
                    ("wait_s", "wait (s)", "0.00"),
                    ("ratio", "HRRS ratio", "0.00"),
                    ("setup_s", "setup (s)", "0.000"),
                    ("service_s", "service (s)", "0.000"),
                    ("worker", "best worker", None),
                    ("urgent", "urgent", None),
                    ("request", "request", None, 300),
                ]
            ),
            height=330,
            sizing_mode="stretch_width",
            index_position=None,
        )
        self.totals_table = totals = DataTable(
            source=self.totals,
            columns=table_columns(
                [
                    ("deployment", "deployment", None),
                    ("owner", "owner job", None),
                    ("pending", "pending", "0,0"),
                    ("shown", "listed above", "0,0"),
                ]
            ),
            height=150,
            sizing_mode="stretch_width",
            index_position=None,
        )
        self.decisions_table = decisions = DataTable(
            source=self.decisions,
            columns=table_columns(
                [
                    ("time", "time", None),
                    ("job", "job", None),
                    ("deployment", "deployment", None),
                    ("op", "op", None),
                    ("workers", "worker(s)", None),
                    ("wait_s", "waited (s)", "0.00"),
                    ("ratio", "ratio", "0.00"),
                    ("reason", "reason", None, 420),
                ]
            ),
            height=260,
            sizing_mode="stretch_width",
            index_position=None,
        )
        self.root = column(
            self.banner,
            self.summary,
            Div(text="<b>Top pending requests</b> (longest-waiting first)"),
            requests,
            Div(text="<b>Pending per deployment</b>"),
            totals,
            Div(text="<b>Most recent decisions</b>"),
            decisions,
            **kwargs,
        )

    def _update(self) -> None:
        plugin = self.plugin()
        if plugin is None:
            return
        mark = plugin.decisions_mark()
        view = plugin.queue_view(with_decisions=mark != self._decisions_mark)
        q = view["queue"]
        top = q["top"]
        policy = view["policy"]
        summary = (
            f"<b>{q['pending']:,}</b> pending requests (<b>{q['admitted']:,}</b> admitted to the "
            f"dispatcher), <b>{len(q['busy'])}</b> busy workers, <b>{len(q.get('queued', ()))}"
            f"</b> requests queued behind running ones, <b>{len(q.get('held', ()))}</b> free "
            f"workers held for a gang's or a turn's next request · policy: setup weight "
            f"{policy['setup_weight']}, patience {policy['patience_factor']}×(service+setup)+"
            f"{policy['patience_floor_s']}s, choice {policy['choice']}, lookahead "
            f"{'on' if policy.get('lookahead') else 'off'}"
        )
        if self.summary.text != summary:
            self.summary.text = summary
        refresh(
            self.source,
            {
                "request": strings(r["request"] for r in top),
                "job": strings(r["job"] for r in top),
                "deployment": strings(r["deployment"] for r in top),
                "op": strings(r["op"] for r in top),
                "wait_s": numbers(r["wait_s"] for r in top),
                "ratio": numbers(r["ratio"] for r in top),
                "setup_s": numbers(r["setup_s"] for r in top),
                "service_s": numbers(r["service_s"] for r in top),
                "worker": strings(", ".join(short(w) for w in r["worker"]) for r in top),
                "urgent": strings("yes" if r["urgent"] else "" for r in top),
            },
            key="request",
        )
        shown: dict[str, int] = {}
        for r in top:
            shown[r["deployment"]] = shown.get(r["deployment"], 0) + 1
        by = sorted(q["by_deployment"].items(), key=lambda kv: (-kv[1], kv[0]))
        fit_table(self.requests_table, len(top), 20)
        fit_table(self.totals_table, len(by), 10)
        refresh(
            self.totals,
            {
                "deployment": strings(d for d, _ in by),
                "owner": strings(view["owners"].get(d, "") for d, _ in by),
                "pending": numbers(n for _, n in by),
                "shown": numbers(shown.get(d, 0) for d, _ in by),
            },
            key="deployment",
        )
        if mark == self._decisions_mark:
            return
        self._decisions_mark = mark
        ds = view["decisions"]
        fit_table(self.decisions_table, len(ds), 20)
        set_data(
            self.decisions,
            {
                "time": strings(
                    datetime.fromtimestamp(d["time"]).strftime("%H:%M:%S.%f")[:-3] for d in ds
                ),
                "job": strings(d["job"] for d in ds),
                "deployment": strings(d["deployment"] for d in ds),
                "op": strings(d["op"] for d in ds),
                "workers": strings(", ".join(short(w) for w in d["workers"]) for d in ds),
                "wait_s": numbers(d["wait_s"] for d in ds),
                "ratio": numbers(d["ratio"] for d in ds),
                "setup_s": numbers(d["setup_s"] for d in ds),
                "reason": strings(d["reason"] for d in ds),
            },
        )


class JobsPage(Page):
    """Per job: progress, rewards (table and curves), GPU-seconds charged (busy + setup), its
    share of the pool, and the cost it would at least have had isolated."""

    FIELDS = (
        "job", "name", "progress", "step", "reward_mean", "reward_max", "loss", "charged_s",
        "busy_s", "setup_s", "share", "isolated_s", "isolated_workers", "requests",
        "mean_wait_s", "failed", "tool_calls", "tool_s", "color",
    )  # fmt: skip
    TEXT = ("job", "name", "progress", "color")

    def __init__(self, scheduler: Any, **kwargs: Any) -> None:
        super().__init__(scheduler)
        self._version: Any = None
        self._reports_version: Any = None
        self._marks: dict[str, tuple] = {}  # job -> (length, last entry) of its curve as sent
        self._sent: dict[str, int] = {}  # job -> the update that last sent its curve
        self._updates = 0
        self._curves_pending = False  # curves changed that no update has sent yet
        self.source = ColumnDataSource({c: [] for c in self.FIELDS}, name="plexrl-jobs-table")
        self.curves = ColumnDataSource(
            {c: [] for c in ("job", "xs", "ys", "color")}, name="plexrl-jobs-rewards"
        )
        self.summary = Div(text="", name="plexrl-jobs-summary")
        table = DataTable(
            source=self.source,
            columns=table_columns(
                [
                    ("job", "job", None, 260),
                    ("name", "run", None),
                    ("progress", "steps", None),
                    ("reward_mean", "reward (mean)", "0.000"),
                    ("reward_max", "reward (max)", "0.000"),
                    ("charged_s", "GPU-s charged", "0.0"),
                    ("busy_s", "busy s", "0.0"),
                    ("setup_s", "setup s", "0.0"),
                    ("share", "share of pool", "0.0%"),
                    ("isolated_s", "isolated est. GPU-s", "0.0"),
                    ("isolated_workers", "isolated workers", "0"),
                    ("requests", "requests", "0,0"),
                    ("mean_wait_s", "mean queue wait s", "0.000"),
                    ("failed", "failed", "0"),
                    ("tool_calls", "tool calls", "0,0"),
                    ("tool_s", "tool s", "0.0"),
                ]
            ),
            height=220,
            sizing_mode="stretch_width",
            index_position=None,
        )
        fig = figure(
            title="Mean reward per step",
            x_axis_label="step",
            y_axis_label="reward",
            tools="pan,wheel_zoom,box_zoom,reset,save",
            height=320,
            sizing_mode="stretch_width",
        )
        fig.multi_line(
            xs="xs",
            ys="ys",
            line_color="color",
            line_width=2,
            legend_field="job",
            source=self.curves,
        )
        fig.legend.location = "bottom_right"
        fig.xaxis.ticker.min_interval = 1  # steps are whole
        lean(fig)
        self.figure = fig
        self.table = table
        self.root = column(self.banner, self.summary, table, fig, **kwargs)

    def _update(self) -> None:
        plugin = self.plugin()
        if plugin is None:
            return
        ledger = plugin.ledger
        version = (
            ledger.version,
            len(plugin.plexrl.job_counters),
            sum(int(c.get("dispatched", 0)) for c in plugin.plexrl.job_counters.values()),
        )
        redraw_curves = ledger.reports_version != self._reports_version or self._curves_pending
        if version == self._version and not redraw_curves:
            return
        self._updates += 1
        self._version = version
        view = plugin.jobs_view(with_history=False)
        # rows in the order the dashboard first saw the jobs (their colours' order), so a row
        # stays where it is while its numbers move and an update is one small patch
        jobs = sorted(view["jobs"], key=lambda j: plugin.job_slot(j["job"]))
        summary = (
            f"<b>{len(jobs)}</b> jobs · <b>{view['charged_s']:.1f}</b> GPU-seconds charged in "
            "all (busy + setup of their requests); isolated estimate: the workers a job's "
            "deployments hold × the seconds any of its requests ran"
        )
        if self.summary.text != summary:
            self.summary.text = summary
        data: dict[str, Any] = {f: [] for f in self.FIELDS}
        for j in jobs:
            for f in self.FIELDS:
                if f == "progress":
                    data[f].append(f"{j['step']}/{j['steps']}" if j["steps"] else str(j["step"]))
                elif f == "color":
                    data[f].append(job_color(plugin, j["job"]))
                else:
                    data[f].append(j[f])
        refresh(
            self.source,
            {f: strings(v) if f in self.TEXT else numbers(v) for f, v in data.items()},
            key="job",
        )
        fit_table(self.table, len(jobs), 20)
        # (also without a new step: the jobs shown change with other activity)
        self._reports_version = ledger.reports_version
        self._curves_pending = not self._draw_curves(plugin, [j["job"] for j in jobs])

    def _draw_curves(self, plugin: PlexRLDashboardPlugin, jobs: list[str]) -> bool:
        """The reward curves of ``jobs``: only the curves whose history changed are sent (a
        patch), at most ``plexrl.dashboard.curves-per-update`` of them, those longest out of
        date first, unless the jobs shown changed (then all, once). Returns whether every
        curve shown is now current (else the next update sends more)."""
        history = plugin.ledger.history
        marks = {}
        for job in jobs:
            hist = history.get(job)
            if hist:
                marks[job] = (len(hist), hist[-1])
        shown = list(marks)
        changed = [i for i, job in enumerate(shown) if self._marks.get(job) != marks[job]]
        redraw = list(self.curves.data["job"]) != shown
        if not changed and not redraw:
            return True
        if redraw:
            changed = list(range(len(shown)))
            self._marks = marks
        else:
            # bounded work per update: a curve is a few hundred numbers, and every job may
            # have stepped since the last update
            changed.sort(key=lambda i: self._sent.get(shown[i], -1))
            changed = sorted(changed[: self.cfg.curves_per_update])
            self._marks = {job: self._marks[job] for job in shown if job in self._marks}
            for i in changed:
                self._marks[shown[i]] = marks[shown[i]]
        self._sent = {job: self._sent[job] for job in shown if job in self._sent}
        for i in changed:
            self._sent[shown[i]] = self._updates
        pending = any(self._marks.get(job) != marks[job] for job in shown)
        xs, ys = [], []
        for i in changed:  # lists, not arrays: an array is a binary buffer (an id) of its own
            hist = _thin(history[shown[i]])
            xs.append(numbers(h[0] for h in hist))
            ys.append(numbers(h[1] for h in hist))
        if redraw:
            self.curves.data = {
                "job": strings(shown),
                "xs": xs,
                "ys": ys,
                "color": strings(job_color(plugin, job) for job in shown),
            }
        else:
            self.curves.patch(
                {
                    "xs": list(zip(changed, xs, strict=True)),
                    "ys": list(zip(changed, ys, strict=True)),
                }
            )
        return not pending


def _thin(history: Any, points: int = 200) -> list:
    """At most about ``points`` evenly spaced entries of a reward history, the last one kept
    (a curve needs no more pixels than that; the JSON route has every step)."""
    hist = list(history)
    if len(hist) <= points:
        return hist
    stride = -(-len(hist) // points)
    return hist[::-stride][::-1]
