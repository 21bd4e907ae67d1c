"""The Bokeh components of the PlexRL pages, in distributed's own pattern.

Each page is a :class:`~distributed.dashboard.components.DashboardComponent`: Bokeh
``ColumnDataSource`` s, a ``root`` model, and ``update()``, which a periodic callback of the
page's document calls every ``plexrl.dashboard.update-interval`` on the scheduler's event loop.
An update reads the dashboard plugin's views (:mod:`plexrl_dask.dashboard.state`) — the same
rows the JSON routes return — and does bounded work: the Timeline streams only spans it has not
sent yet (at most ``timeline-batch``), Residency and Jobs redraw only when their data changed,
the Queue shows ``queue-rows`` requests however long the queue is. Sources carry names
(``plexrl-<page>-<what>``) so scripts and the browser tests can find them in the document.

Here: the Timeline and Residency pages and :func:`page_doc`; the Queue and Jobs pages are in
:mod:`plexrl_dask.dashboard.tables`, the shared parts in :mod:`plexrl_dask.dashboard.base`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from bokeh.layouts import column, row
from bokeh.models import (
    CategoricalColorMapper,
    CDSView,
    ColumnDataSource,
    CustomJS,
    CustomJSHover,
    DataTable,
    DatetimeTicker,
    DatetimeTickFormatter,
    Div,
    FactorRange,
    FixedTicker,
    GroupFilter,
    HoverTool,
    NumeralTickFormatter,
    Range1d,
)
from bokeh.plotting import figure
from bokeh.transform import dodge
from dask.utils import format_bytes
from distributed.dashboard.components import add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME
from distributed.utils import log_errors

from plexrl_dask.dashboard.base import (
    BORDER,
    OP_COLORS,
    OTHER_OP,
    TIER_COLORS,
    Numbers,
    Page,
    Texts,
    floats,
    job_color,
    lean,
    numbers,
    set_data,
    short,
    side_legend,
    strings,
    table_columns,
)
from plexrl_dask.dashboard.state import PlexRLDashboardPlugin
from plexrl_dask.dashboard.tables import JobsPage, QueuePage
from plexrl_dask.policy.residency import TIERS

logger = logging.getLogger(__name__)


#: The Timeline's scrolling, in the browser (``xr``: the x range; ``made_ms``: the scheduler's
#: clock when the page was made, which the spans' times are on).
_SCROLL_JS = """
const offset = made_ms - Date.now();
setInterval(() => {
  const now = Date.now() + offset;
  xr.setv({start: now - (xr.end - xr.start), end: now});
}, INTERVAL_MS);
"""
#: A span's tooltip values, in the browser (``spans``: the span source; ``idle``: the idle
#: source, one row per lane in lane order): WHAT is ``setup`` or ``ran`` (seconds, from the
#: span's start, ready and end in ms) or ``worker`` (the lane's).
_SPAN_HOVER = """
const i = special_vars.index;
const d = spans.data;
if ("WHAT" === "worker") {
  return String(idle.data.worker[d.lane[i]] ?? "");
}
const s = "WHAT" === "setup" ? d.ready[i] - d.start[i] : d.end[i] - d.ready[i];
return (s / 1000).toFixed(3);
"""


class TimelinePage(Page):
    """Per worker, a live Gantt of requests: the running part coloured by job with a strip
    coloured by op, the setup part (load/offload before it ran) grey and hatched, what runs
    now dashed, idle time as gaps; beside it, each worker's idle fraction over the window.

    Workers are lanes ``0, 1, ...`` in order of first appearance (a lane never moves, so
    streamed spans stay valid). Colours are mapped in the browser from the job
    and op columns; a stream carries only what is new."""

    def __init__(self, scheduler: Any, **kwargs: Any) -> None:
        super().__init__(scheduler)
        self._seq: int | None = None
        self._lanes: dict[str, int] = {}
        self._jobs: list[str] = []  # seen, not yet in the colour mapping
        self._known: set[str] = set()
        self._idle_next = 0  # the lane whose idle fraction is refreshed next
        self._workers_seen = (-1, -1)
        # What the tooltip derives (setup and run seconds, the worker of a lane) is computed
        # in the browser (_SPAN_HOVER): every streamed column costs each update its encoding.
        texts = ("job", "deployment", "op", "waited")
        values = ("lane", "start", "ready", "end")
        self.source = ColumnDataSource(
            {**{c: strings(()) for c in texts}, **{c: numbers(()) for c in values}},
            name="plexrl-timeline-spans",
        )
        self.running = ColumnDataSource(
            {c: [] for c in ("worker", "lane", "job", "deployment", "op", "start", "until")},
            name="plexrl-timeline-running",
        )
        self.idle = ColumnDataSource(
            {"worker": strings(()), "lane": numbers(()), "idle": numbers(())},
            name="plexrl-timeline-idle",
        )
        self.colors = CategoricalColorMapper(factors=[], palette=[])
        ops = CategoricalColorMapper(
            factors=list(OP_COLORS), palette=list(OP_COLORS.values()), nan_color=OTHER_OP
        )
        now_ms = 1000 * time.time()
        # Scrolled by the browser itself (attach()): not a message from the scheduler every
        # second, and, not syncable, not one back from every browser either.
        self.x_range = Range1d(
            now_ms - 1000 * self.cfg.timeline_window_s,
            now_ms,
            syncable=False,
            name="plexrl-timeline-x",
        )
        self.y_range = Range1d(-0.5, 0.5)
        fig = figure(
            title="PlexRL timeline: requests per worker (colour: job; bottom strip: op; grey "
            "hatched: setup, i.e. load/offload; dashed: running; gaps: idle)",
            x_axis_type="datetime",
            x_range=self.x_range,
            y_range=self.y_range,
            tools="xpan,xwheel_zoom,box_zoom,reset,save",
            height=340,
            min_border_bottom=BORDER,
            min_border_top=BORDER,
            **kwargs,
        )
        fig.yaxis.ticker = FixedTicker(ticks=[])
        fig.ygrid.visible = False
        fig.xaxis.formatter = DatetimeTickFormatter(
            seconds="%H:%M:%S", minsec="%H:%M:%S", minutes="%H:%M", hourmin="%H:%M", context=None
        )
        # Bokeh's own date-time ticks up to half a day (the spans kept cover minutes), without
        # its day, month and year tickers: fewer models for every message to walk
        fig.xaxis.ticker = DatetimeTicker(tickers=DatetimeTicker().tickers[:3])
        color = {"field": "job", "transform": self.colors}
        run = fig.hbar(
            y="lane",
            left="ready",
            right="end",
            height=0.7,
            fill_color=color,
            line_color=color,
            source=self.source,
        )
        # The op as a strip along the bottom of the bar, coloured by op (per-bar hatch
        # patterns would say it too, but browsers draw thousands of them far too slowly).
        strip = fig.hbar(
            y=dodge("lane", -0.29, range=self.y_range),
            left="ready",
            right="end",
            height=0.12,
            fill_color={"field": "op", "transform": ops},
            line_color=None,
            source=self.source,
        )
        fig.add_layout(
            side_legend("op (strip)", strip, "op"),
            "right",
        )
        fig.hbar(  # only the spans that waited for a setup: hatched bars are costly to draw
            y="lane",
            left="start",
            right="ready",
            height=0.7,
            fill_color="#d9d9d9",
            line_color=color,
            hatch_pattern="/",
            hatch_color="#555555",
            source=self.source,
            view=CDSView(filter=GroupFilter(column_name="waited", group="yes")),
        )
        live = fig.hbar(
            y="lane",
            left="start",
            right="until",
            height=0.7,
            fill_color=color,
            fill_alpha=0.35,
            line_color="black",
            line_dash="dashed",
            source=self.running,
        )
        fig.add_tools(
            HoverTool(
                renderers=[run],
                tooltips=[
                    ("job", "@job"),
                    ("deployment", "@deployment"),
                    ("op", "@op"),
                    ("setup", "@ready{setup} s"),
                    ("ran", "@end{ran} s"),
                    ("worker", "@lane{worker}"),
                ],
                formatters={
                    field: CustomJSHover(
                        args={"spans": self.source, "idle": self.idle},
                        code=_SPAN_HOVER.replace("WHAT", what),
                        name=f"plexrl-timeline-hover-{what}",
                    )
                    for field, what in (("@ready", "setup"), ("@end", "ran"), ("@lane", "worker"))
                },
            ),
            HoverTool(
                renderers=[live],
                tooltips=[
                    ("running", "@op of @deployment"),
                    ("job", "@job"),
                    ("worker", "@worker"),
                ],
            ),
        )
        fig.add_layout(
            side_legend("job", run, "job"),
            "right",
        )
        self.figure = fig
        idle = figure(
            title="idle",
            x_range=Range1d(0, 1),
            y_range=self.y_range,
            width=110,
            height=fig.height,
            tools="",
            toolbar_location=None,
            min_border_bottom=BORDER,
            min_border_top=BORDER,
            tooltips=[("worker", "@worker"), ("idle", "@idle{0%}")],
        )
        idle.hbar(y="lane", left=0, right="idle", height=0.7, color="#bbbbbb", source=self.idle)
        idle.xaxis.formatter = NumeralTickFormatter(format="0%")
        idle.xaxis.ticker = FixedTicker(ticks=[0, 0.5, 1])
        idle.yaxis.visible = False
        idle.ygrid.visible = False
        self.idle_figure = idle
        lean(fig, idle)
        self.root = column(self.banner, row(fig, idle, **kwargs), **kwargs)

    def attach(self, doc: Any) -> None:
        """Scroll in the browser: once the document is ready, every update interval the x range
        ends at the scheduler's now (the browser's clock, corrected by its offset from the
        scheduler's when the page was made) and keeps its width (a zoom holds)."""
        doc.js_on_event(
            "document_ready",
            CustomJS(
                args={"xr": self.x_range, "made_ms": self.x_range.end},
                code=_SCROLL_JS.replace("INTERVAL_MS", str(int(1000 * self.cfg.update_interval_s))),
            ),
        )

    def _lane(self, worker: str) -> int:
        lane = self._lanes.get(worker)
        if lane is None:
            lane = self._lanes[worker] = len(self._lanes)
        return lane

    def _refresh_idle(
        self, plugin: PlexRLDashboardPlugin, now: float, running: list[dict[str, Any]]
    ) -> None:
        """The idle fractions beside the lanes (one row per lane, in lane order): a new
        lane's at once, the others in turn, ``idle-lanes-per-update`` of them per update (an
        update stays bounded however many workers there are; fractions over the window move
        slowly)."""
        seen = (len(self.scheduler.workers), len(plugin.spans.workers))
        if seen != self._workers_seen:  # PlexRL workers, and workers with spans not sent yet
            self._workers_seen = seen
            for w in sorted({*plugin.gpu_workers(), *plugin.spans.workers} - self._lanes.keys()):
                self._lane(w)
        live = {r["worker"]: r["start"] for r in running}
        workers = list(self._lanes)
        shown = len(self.idle.data["worker"])
        if shown < len(workers):
            new = workers[shown:]
            self.idle.stream(
                {
                    "worker": strings(new),
                    "lane": numbers(range(shown, len(workers))),
                    "idle": numbers(plugin.idle_fraction(w, now, live.get(w)) for w in new),
                }
            )
        k = min(self.cfg.idle_lanes_per_update, shown)
        if k == 0:
            return
        # the next k lanes in turn, as at most two runs of consecutive lanes (it wraps): a
        # slice patch of a list of numbers encodes in one piece, where a patch per index
        # encodes an (index, value) pair per lane
        first = self._idle_next
        runs = [(first, min(first + k, shown))]
        if first + k > shown:
            runs.append((0, first + k - shown))
        old = self.idle.data["idle"]
        patches = []
        for a, b in runs:
            values = [
                plugin.idle_fraction(workers[i], now, live.get(workers[i])) for i in range(a, b)
            ]
            # the tooltip shows whole per cent: smaller moves are not worth a message
            if any(abs(v - o) >= 0.005 for v, o in zip(values, old[a:b], strict=True)):
                patches.append((slice(a, b), Numbers(values)))
        self._idle_next = (first + k) % shown
        if patches:
            self.idle.patch({"idle": patches})

    def _job(self, job: str) -> None:
        if job not in self._known:
            self._known.add(job)
            self._jobs.append(job)

    def _update(self) -> None:
        plugin = self.plugin()
        if plugin is None:
            return
        now = time.time()
        store = plugin.spans
        lanes = len(self._lanes)
        if self._seq is None:  # a new page starts with the newest batch
            self._seq = max(0, store.next_seq - self.cfg.timeline_batch)
        self._seq, spans = store.since(self._seq, self.cfg.timeline_batch)
        running = plugin.running()
        # a list per column (measured: faster than one pass making a tuple per span, and
        # tuples are objects the garbage collector tracks, lists of str and float are not)
        worker = [sp.worker for sp in spans]
        deployment = [sp.deployment for sp in spans]
        job = [sp.job for sp in spans]
        op = [sp.op for sp in spans]
        start = [sp.start for sp in spans]
        ready = [sp.ready for sp in spans]
        end = [sp.end for sp in spans]
        for name in dict.fromkeys(itertools.chain(job, (r["job"] for r in running))):
            self._job(name)
        if self._jobs:  # new jobs: extend the colour mapping before data that needs it
            factors = [*self.colors.factors, *self._jobs]
            self._jobs = []
            self.colors.update(factors=factors, palette=[job_color(plugin, job) for job in factors])
        if spans:
            lanes_of = self._lanes
            lane = [float(lanes_of[w] if w in lanes_of else self._lane(w)) for w in worker]
            start, ready, end = np.array(start), np.array(ready), np.array(end)
            # Numbers, not arrays: Bokeh appends to an array column by copying all the kept
            # rows (20,000) on every stream, to a list in place
            self.source.stream(
                {
                    "job": Texts(job),
                    "deployment": Texts(deployment),
                    "op": Texts(op),
                    "waited": Texts(np.where(ready > start, "yes", "").tolist()),
                    "lane": Numbers(lane),
                    "start": Numbers((1000 * start).tolist()),
                    "ready": Numbers((1000 * ready).tolist()),
                    "end": Numbers((1000 * end).tolist()),
                },
                rollover=self.cfg.spans_kept,
            )
        set_data(
            self.running,
            {
                "worker": strings(r["worker"] for r in running),
                "lane": numbers(self._lane(r["worker"]) for r in running),
                "job": strings(r["job"] for r in running),
                "deployment": strings(r["deployment"] for r in running),
                "op": strings(r["op"] for r in running),
                "start": numbers(1000 * r["start"] for r in running),
                # drawn to the plot's right edge (now), so the source changes only when what
                # runs does
                "until": numbers(1000 * (r["start"] + 86400) for r in running),
            },
        )
        self._refresh_idle(plugin, now, running)
        if len(self._lanes) != lanes:  # new workers: their lanes and labels
            n = len(self._lanes)
            self.y_range.update(start=-0.5, end=n - 0.5)
            self.figure.yaxis.ticker.ticks = list(range(0, n, -(-n // 40)))  # <= 40 labels
            self.figure.yaxis.major_label_overrides = {
                lane: short(w) for w, lane in self._lanes.items()
            }
            height = min(1400, 220 + 30 * max(4, n))
            self.figure.height = self.idle_figure.height = height


class ResidencyPage(Page):
    """Deployment × worker: the tier each deployment's state is in on each worker (absent:
    blank), the bytes per tier per node as the workers report them, and each node
    StateManager's stored bytes and dedup savings."""

    #: The cells' text columns (the others are numbers).
    TEXT = ("text", "deployment", "worker", "label", "tier", "color", "size", "node")

    def __init__(self, scheduler: Any, **kwargs: Any) -> None:
        super().__init__(scheduler)
        self._structure: Any = None
        self._seq = -1
        self._nodes_version = -1
        self._labels = True
        self._rows: dict[tuple[str, str], int] = {}
        self._totals: dict[str, dict[str, int]] = {}
        self._truncated = 0
        cell_cols = (*self.TEXT, "bytes", "version", "load_s")
        self.source = ColumnDataSource({c: [] for c in cell_cols}, name="plexrl-residency-cells")
        self.nodes = ColumnDataSource(
            {c: [] for c in ("node", "hbm_bytes", "dram_bytes", "nvme_bytes")},
            name="plexrl-residency-nodes",
        )
        self.stores = ColumnDataSource(
            {c: [] for c in ("node", "tier", "used", "logical", "saved", "capacity", "versions")},
            name="plexrl-residency-stores",
        )
        heat = figure(
            title="Residency: where each deployment's state is (deployment × worker)",
            x_range=FactorRange(factors=[]),
            y_range=FactorRange(factors=[]),
            tools="hover,save",
            tooltips=[
                ("deployment", "@deployment"),
                ("worker", "@worker"),
                ("tier", "@tier"),
                ("bytes", "@size"),
                ("version", "@version{0}"),
                ("last transition", "@load_s{0.000} s"),
            ],
            height=360,
            sizing_mode="stretch_width",
        )
        heat.rect(
            x="label",
            y="deployment",
            width=0.92,
            height=0.92,
            fill_color="color",
            line_color=None,
            legend_field="tier",
            source=self.source,
        )
        heat.text(
            x="label",
            y="deployment",
            text="text",
            text_align="center",
            text_baseline="middle",
            text_font_size="8pt",
            text_color="white",
            source=self.source,
        )
        heat.xaxis.major_label_orientation = 0.8
        heat.legend.location = "top_right"
        heat.legend.orientation = "horizontal"
        self.heat = heat
        tiers = ["hbm_bytes", "dram_bytes", "nvme_bytes"]
        bars = figure(
            title="Bytes per tier per node (as the workers report them)",
            x_range=FactorRange(factors=[]),
            tools="hover,save",
            tooltips=[("node", "@node"), ("tier", "$name"), ("bytes", "@$name{0.0 b}")],
            height=260,
            sizing_mode="stretch_width",
        )
        bars.vbar_stack(
            tiers,
            x="node",
            width=0.6,
            color=[TIER_COLORS[t.split("_")[0]] for t in tiers],
            legend_label=["HBM", "DRAM", "NVMe"],
            source=self.nodes,
        )
        bars.yaxis.formatter = NumeralTickFormatter(format="0.0 b")
        bars.legend.location = "top_left"
        bars.legend.orientation = "horizontal"
        self.bars = bars
        lean(heat, bars)
        table = DataTable(
            source=self.stores,
            columns=table_columns(
                [
                    ("node", "node", None),
                    ("tier", "tier", None),
                    ("used", "stored", "0.0 b"),
                    ("logical", "logical (all versions)", "0.0 b"),
                    ("saved", "dedup saved", "0.0 b"),
                    ("capacity", "capacity", "0.0 b"),
                    ("versions", "versions", "0"),
                ]
            ),
            height=140,
            sizing_mode="stretch_width",
            index_position=None,
        )
        title = Div(
            text="<b>Node state stores (DRAM and NVMe tiers): stored bytes and dedup savings</b>"
        )
        self.note = Div(text="", name="plexrl-residency-note")
        self.root = column(self.banner, self.note, heat, bars, title, table, **kwargs)

    def _update(self) -> None:
        plugin = self.plugin()
        if plugin is None:
            return
        plugin.watch_residency()
        seq = plugin.residency_seq
        structure = plugin.residency_structure()
        changes = plugin.residency_changes(self._seq) if seq != self._seq else []
        if structure != self._structure or changes is None:  # workers or deployments changed
            self._structure = structure
            self._redraw(plugin)
        elif changes:  # only the cells reported since the last update
            self._apply(plugin, changes)
        self._seq = seq
        if plugin.nodes_version != self._nodes_version:
            self._nodes_version = plugin.nodes_version
            self._draw_stores(plugin.nodes)

    def _row(self, c: dict[str, Any]) -> dict[str, Any]:
        tier = c["tier"]
        return {
            # labels inside the cells only while they are big enough to read
            "text": f"{tier.upper()} {format_bytes(c['bytes'])}"
            if self._labels and tier != "absent"
            else "",
            "deployment": c["deployment"],
            "worker": c["worker"],
            "label": short(c["worker"]),
            "tier": tier,
            "color": TIER_COLORS[tier] if tier != "absent" else "rgba(0,0,0,0)",
            "bytes": c["bytes"],
            "size": format_bytes(c["bytes"]),
            "version": c["version"],
            "load_s": c["load_s"],
            "node": c["node"],
        }

    def _redraw(self, plugin: PlexRLDashboardPlugin) -> None:
        view = plugin.residency_view()
        cells = view["cells"]
        self._truncated = view["truncated"]
        self._note()
        self._labels = len(cells) <= 64
        self._rows = {(c["deployment"], c["worker"]): i for i, c in enumerate(cells)}
        data: dict[str, Any] = {col: [] for col in self.source.data}
        for c in cells:
            for k, v in self._row(c).items():
                data[k].append(v)
        for k in data:
            data[k] = strings(data[k]) if k in self.TEXT else floats(data[k])
        set_data(self.source, data)
        workers = [short(w) for w in view["workers"]]
        deployments = list(view["deployments"])
        for c in cells:  # held by a worker or deployment no longer listed (in flight)
            if short(c["worker"]) not in workers:
                workers.append(short(c["worker"]))
            if c["deployment"] not in deployments:
                deployments.append(c["deployment"])
        if list(self.heat.x_range.factors) != workers:
            self.heat.x_range.factors = workers
            self.heat.xaxis.major_label_text_font_size = "8pt" if len(workers) <= 32 else "0pt"
        if list(self.heat.y_range.factors) != deployments:
            self.heat.y_range.factors = deployments
            self.heat.height = min(1200, 160 + 26 * max(3, len(deployments)))
        self._totals = {n["node"]: {t: n[f"{t}_bytes"] for t in TIERS[:3]} for n in view["nodes"]}
        self._draw_nodes()

    def _factor(self, c: dict[str, Any]) -> None:
        """Make sure a cell's worker and deployment have an axis factor."""
        if short(c["worker"]) not in self.heat.x_range.factors:
            self.heat.x_range.factors = [*self.heat.x_range.factors, short(c["worker"])]
        if c["deployment"] not in self.heat.y_range.factors:
            self.heat.y_range.factors = [*self.heat.y_range.factors, c["deployment"]]

    def _apply(self, plugin: PlexRLDashboardPlugin, keys: list[tuple[str, str]]) -> None:
        """Patch the changed cells (a cell that became absent stays, invisible), append new
        ones, and move their bytes between the node totals."""
        data = self.source.data
        patches: dict[str, list[tuple[int, Any]]] = {}
        new: dict[str, list] = {col: [] for col in data}
        for deployment, worker in keys:
            c = plugin.residency_cell(deployment, worker)
            i = self._rows.get((deployment, worker))
            if i is not None:
                old_tier, old_bytes = data["tier"][i], data["bytes"][i]
                row = self._row(c)
                changed = [(k, v) for k, v in row.items() if data[k][i] != v]
                if not changed:
                    continue
                self._add(data["node"][i], old_tier, -old_bytes)
                for k, v in changed:
                    patches.setdefault(k, []).append((i, v))
            elif c["tier"] != "absent" and len(self._rows) >= self.cfg.residency_cells:
                self._truncated += 1
                continue
            elif c["tier"] != "absent":
                self._rows[(deployment, worker)] = len(self._rows)
                for k, v in self._row(c).items():
                    new[k].append(v)
                self._factor(c)
            else:
                continue
            self._add(c["node"], c["tier"], c["bytes"])
        if patches:
            self.source.patch(patches)
        if new["deployment"]:
            self.source.stream(new)
        self._note()
        self._draw_nodes()

    def _note(self) -> None:
        text = (
            f"<small>{self._truncated:,} more cells not drawn: at most "
            f"{self.cfg.residency_cells:,} (plexrl.dashboard.residency-cells)</small>"
            if self._truncated
            else ""
        )
        if self.note.text != text:
            self.note.text = text

    def _add(self, node: str, tier: str, nbytes: int) -> None:
        if tier != "absent":
            totals = self._totals.setdefault(node, dict.fromkeys(TIERS[:3], 0))
            totals[tier] += nbytes

    def _draw_nodes(self) -> None:
        names = sorted(self._totals)
        if list(self.bars.x_range.factors) != names:
            self.bars.x_range.factors = names
        set_data(
            self.nodes,
            {
                "node": names,
                "hbm_bytes": [self._totals[n]["hbm"] for n in names],
                "dram_bytes": [self._totals[n]["dram"] for n in names],
                "nvme_bytes": [self._totals[n]["nvme"] for n in names],
            },
        )

    def _draw_stores(self, stores: dict[str, Any]) -> None:
        rows: dict[str, list] = {c: [] for c in self.stores.data}
        for node in sorted(stores):
            for tier, t in sorted(stores[node]["tiers"].items()):
                rows["node"].append(node)
                rows["tier"].append(tier)
                rows["used"].append(t.get("used") or 0)
                rows["logical"].append(t.get("logical_bytes") or 0)
                rows["saved"].append(t.get("dedup_saved_bytes") or 0)
                rows["capacity"].append(t.get("capacity"))
                rows["versions"].append(t.get("versions") or 0)
        set_data(self.stores, rows)


PAGE_CLASSES: dict[str, type[Page]] = {
    "TimelinePage": TimelinePage,
    "ResidencyPage": ResidencyPage,
    "QueuePage": QueuePage,
    "JobsPage": JobsPage,
}


def page_doc(cls_name: str, title: str) -> Callable[[Any, dict, Any], None]:
    """The Bokeh document function of a page (what ``applications`` maps a URL to): the
    component, its first update, and its periodic updates."""

    def doc_fn(scheduler: Any, extra: dict, doc: Any) -> None:
        with log_errors():
            page = PAGE_CLASSES[cls_name](scheduler, sizing_mode="stretch_width")
            page.update()
            page.attach(doc)
            interval_ms = int(1000 * page.cfg.update_interval_s)
            add_periodic_callback(doc, page, interval_ms)
            doc.add_root(page.root)
            doc.title = title
            doc.theme = BOKEH_THEME

    doc_fn.__name__ = f"{cls_name.lower()}_doc"
    return doc_fn
