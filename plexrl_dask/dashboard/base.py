"""Shared parts of the PlexRL pages: the page base class and helpers for Bokeh sources.

:class:`Page` is distributed's :class:`~distributed.dashboard.components.DashboardComponent`
with what every PlexRL page needs: the scheduler, the ``plexrl.dashboard`` settings, a banner
for a scheduler without the plugin, and an ``update()`` that times each update
(:data:`UPDATE_MS`). The helpers send a browser only what changed: :func:`set_data` nothing
when a source's data is equal, :func:`refresh` a patch of the changed columns when the rows
are the same. Columns are typed for cheap updates: long numeric ones redrawn whole as binary
arrays (:func:`floats`), short or streamed ones (:func:`numbers`) and text (:func:`strings`)
inside the message.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from typing import Any

import numpy as np
from bokeh.core.properties import without_property_validation
from bokeh.core.serialization import Serializer
from bokeh.models import (
    CellEditor,
    ColumnDataSource,
    DataTable,
    Div,
    GlyphRenderer,
    Legend,
    LegendItem,
    NumberFormatter,
    StringFormatter,
    TableColumn,
)
from bokeh.palettes import Category20
from distributed.dashboard.components import DashboardComponent

from plexrl_dask.config import DashboardConfig
from plexrl_dask.dashboard.state import PlexRLDashboardPlugin, dashboard_of

logger = logging.getLogger(__name__)

NOT_INSTALLED = (
    "<b>The PlexRL dashboard plugin is not installed on this scheduler.</b> Start the scheduler "
    "with <code>--preload plexrl_dask.plugins</code> or use <code>plexrl_dask.local_cluster()</code>."
)
TIER_COLORS = {"hbm": "#2ca02c", "dram": "#ff7f0e", "nvme": "#1f77b4", "absent": "#dddddd"}
#: Colour of the strip under a request's bar, by op (dark and distinct from job colours).
OP_COLORS = {
    "sample": "#252525",
    "forward": "#737373",
    "forward_backward": "#e7298a",
    "optim_step": "#e6ab02",
    "train_step": "#d95f02",
    "sync_weights": "#1b9e77",
    "load_weights": "#1b9e77",
    "load_adapter": "#1b9e77",
    "publish_weights": "#66a61e",
    "save_state": "#7570b3",
    "load_state": "#7570b3",
    "load": "#a6761d",
    "tool": "#1f78b4",
}
OTHER_OP = "#bdbdbd"
#: Top and bottom border of the Timeline and its idle bars: their lanes line up.
BORDER = 40
# Category20's strong hues first, then its light ones, without the greys (grey is setup).
PALETTE = tuple(
    c for c in (*Category20[20][0::2], *Category20[20][1::2]) if c not in ("#7f7f7f", "#c7c7c7")
)


def side_legend(title: str, renderer: Any, field: str) -> Legend:
    """A compact legend grouping ``renderer``'s rows by ``field`` (in the browser)."""
    return Legend(
        items=[LegendItem(label={"field": field}, renderers=[renderer])],
        title=title,
        label_text_font_size="8pt",
        title_text_font_size="8pt",
        glyph_height=10,
        glyph_width=14,
        label_height=10,
        spacing=1,
        padding=4,
        border_line_alpha=0,
    )


def lean(*figures: Any) -> None:
    """Leave the selected, unselected and muted looks of ``figures``' glyphs to the browser.
    The pages have no selection tools and no muting legends, so those glyphs never show,
    but as models of their own each would be walked by every message the page sends (Bokeh
    lists a document's models per message): ``"auto"`` is BokehJS's default look instead."""
    for fig in figures:
        for renderer in fig.renderers:
            if isinstance(renderer, GlyphRenderer):
                renderer.nonselection_glyph = "auto"
                renderer.muted_glyph = "auto"


def job_color(plugin: PlexRLDashboardPlugin, job: str) -> str:
    """A job's colour, the same on every page and every reload (by the order the dashboard
    first saw the job; the palette cycles after 18 jobs)."""
    return PALETTE[plugin.job_slot(job) % len(PALETTE)]


def fit_table(table: DataTable, rows: int, max_rows: int) -> None:
    """Size a table to its rows (header included), up to ``max_rows`` (then it scrolls)."""
    height = 32 + 25 * max(1, min(rows, max_rows))
    if table.height != height:
        table.height = height


def short(worker: str) -> str:
    """``tcp://10.0.0.1:4321`` -> ``10.0.0.1:4321``."""
    return worker.split("://", 1)[-1]


def same(a: Any, b: Any) -> bool:
    """Equality of column values: arrays, and lists that may hold arrays (ragged columns)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        nan = a.dtype.kind == "f" and b.dtype.kind == "f"  # a missing number is unchanged
        return bool(np.array_equal(a, b, equal_nan=nan))
    if isinstance(a, list) and isinstance(b, list) and a and isinstance(a[0], np.ndarray):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def set_data(source: ColumnDataSource, data: dict[str, Any]) -> bool:
    """Replace ``source``'s data unless it is equal (no message to the browser then)."""
    old = source.data
    if old.keys() == data.keys() and all(same(old[k], v) for k, v in data.items()):
        return False
    source.data = data
    return True


def refresh(source: ColumnDataSource, data: dict[str, Any], key: str) -> None:
    """Show ``data`` in ``source``: when its ``key`` column is unchanged (the same rows),
    patch only the columns that changed (one small message, numbers as binary); else replace
    everything."""
    old = source.data
    if old.keys() != data.keys() or not same(old[key], data[key]):
        source.data = data
        return
    n = len(data[key])
    patches = {k: [(slice(0, n), v)] for k, v in data.items() if not same(old[k], v)}
    if patches:
        source.patch(patches)


def floats(values: Any) -> np.ndarray:
    """A long numeric column as an array (sent as binary; ``None`` becomes NaN)."""
    return np.array([np.nan if v is None else v for v in values], dtype=float)


class Texts(list):
    """A text column: a list of ``str`` that Bokeh sends as it is.

    Bokeh's serialiser encodes a plain list element by element (an encoder call per string:
    milliseconds on the event loop for a few hundred spans), and a NumPy string array costs a
    copy and a comparison of the whole column on every stream; the encoder registered for
    this type below returns the strings in one piece."""


class Numbers(list):
    """A numeric column sent as JSON: a list of numbers (or ``None``).

    For a table's short columns: a binary array costs a buffer of its own (an id and extra
    websocket frames) per column, more than a few dozen numbers in the message itself. For a
    streamed column (the Timeline's spans): Bokeh appends to an array column by copying every
    kept row on each stream, to a list in place (1.0 ms against 0.35 for 256 spans into
    20,000, measured here). Only non-finite numbers need the serialiser's encoding."""


def _encode_numbers(column: Numbers, serializer: Serializer) -> list:
    # A finite sum means every value is a finite number (inf and nan propagate through a
    # sum, None fails it): the common case goes through in C, as a copy, because the message
    # is turned into JSON later and the source's lists may grow in place before that.
    with contextlib.suppress(TypeError):
        if math.isfinite(sum(column)):
            return list(column)
    return [v if v is None or math.isfinite(v) else serializer.encode(v) for v in column]


Serializer.register(Texts, lambda column, _serializer: list(column))
Serializer.register(Numbers, _encode_numbers)


def strings(values: Any) -> Texts:
    """A text column (``None`` becomes ``""``): see :class:`Texts`."""
    return Texts("" if v is None else str(v) for v in values)


def numbers(values: Any) -> Numbers:
    """A short numeric column (``None`` stays missing): see :class:`Numbers`."""
    return Numbers([None if v is None else float(v) for v in values])


def table_columns(spec: list[tuple]) -> list[TableColumn]:
    """Table columns from ``(field, title, number format or None[, width])``; widths are
    relative (the table fills the page): numbers narrow, text wider.

    The columns share one (unused: tables are read-only) editor and one text formatter:
    every model of a page's document costs each message to the browser a little."""
    editor, text = CellEditor(), StringFormatter()
    out = []
    for field, title, fmt, *width in spec:
        kwargs: dict[str, Any] = {"field": field, "title": title, "editor": editor}
        kwargs["width"] = width[0] if width else (100 if fmt is not None else 200)
        kwargs["formatter"] = NumberFormatter(format=fmt) if fmt is not None else text
        out.append(TableColumn(**kwargs))
    return out


#: Recent update durations per page class, for the benchmark and for operators who want to
#: see what the pages cost the scheduler (bounded): wall-clock ms (how long the event loop was
#: held) and the thread's CPU ms (the work itself, without time the thread waited for a core
#: or the GIL).
UPDATE_MS: dict[str, deque[float]] = {}
UPDATE_CPU_MS: dict[str, deque[float]] = {}
#: When each of those updates started (``time.perf_counter()``), to line them up with other
#: events of the process (the benchmark's garbage collections).
UPDATE_STARTED: dict[str, deque[float]] = {}


class Page(DashboardComponent):
    """Shared parts: the scheduler, the config, the not-installed banner, and ``update()``,
    which times the page's ``_update()`` into :data:`UPDATE_MS`."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.cfg = DashboardConfig.from_dask_config()
        self.banner = Div(text="", name="plexrl-banner")
        self._times = UPDATE_MS.setdefault(type(self).__name__, deque(maxlen=10_000))
        self._cpu = UPDATE_CPU_MS.setdefault(type(self).__name__, deque(maxlen=10_000))
        self._started = UPDATE_STARTED.setdefault(type(self).__name__, deque(maxlen=10_000))

    @without_property_validation  # (as distributed's own updates: values are ours)
    def update(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self._update()
        self._cpu.append(1000 * (time.thread_time() - c0))
        self._times.append(1000 * (time.perf_counter() - t0))
        self._started.append(t0)

    def _update(self) -> None:
        raise NotImplementedError

    def attach(self, doc: Any) -> None:
        """Add what the page needs on its document beyond its root (browser-side callbacks)."""

    def plugin(self) -> PlexRLDashboardPlugin | None:
        plugin = dashboard_of(self.scheduler)
        banner = "" if plugin is not None and plugin.plexrl is not None else NOT_INSTALLED
        if self.banner.text != banner:
            self.banner.text = banner
        return plugin if banner == "" else None
