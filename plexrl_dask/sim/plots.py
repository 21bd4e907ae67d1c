"""Figures of a simulation study: per-policy completion time and cost, a utilisation heatmap
over time, a Gantt chart of one node group, the decode curves the rollouts come from, and the
tool-latency sweep."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from plexrl_dask.sim.simulator import SimOutcome  # noqa: E402

logger = logging.getLogger(__name__)

_PHASE_COLOURS = {"profile": "#999999", "rollout": "#4c72b0", "train": "#dd8452"}


def plot_policies(outcomes: Sequence[SimOutcome], path: str | Path) -> Path:
    """Bars of whole-workload completion time and of user / held GPU-hours per policy."""
    names = [o.policy for o in outcomes]
    s = [o.summary() for o in outcomes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.bar(names, [x["makespan_h"] for x in s], color="#4c72b0")
    a.set_ylabel("whole-workload completion time (h)")
    x = np.arange(len(names))
    b.bar(x - 0.2, [v["user_gpu_hours"] / 1e3 for v in s], 0.4, label="charged to jobs")
    b.bar(x + 0.2, [v["held_gpu_hours"] / 1e3 for v in s], 0.4, label="held (reserved)")
    b.set_xticks(x, names)
    b.set_ylabel("GPU-hours (thousands)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_heatmap(outcome: SimOutcome, path: str | Path, max_rows: int = 256) -> Path:
    """Per-node utilisation (GPUs held by a job's phase or private allocation) over time."""
    h = outcome.heatmap
    if h.shape[0] > max_rows:  # average consecutive nodes so the picture stays readable
        k = int(np.ceil(h.shape[0] / max_rows))
        pad = (-h.shape[0]) % k
        h = np.pad(h, ((0, pad), (0, 0))).reshape(-1, k, h.shape[1]).mean(axis=1)
    fig, ax = plt.subplots(figsize=(11, 4))
    im = ax.imshow(
        h,
        aspect="auto",
        origin="lower",
        vmin=0,
        vmax=1,
        cmap="viridis",
        extent=(0, h.shape[1] * outcome.bin_s / 3600, 0, outcome.heatmap.shape[0]),
        interpolation="nearest",
    )
    ax.set_xlabel("time (h)")
    ax.set_ylabel("node")
    ax.set_title(f"{outcome.policy}: GPU utilisation per node")
    fig.colorbar(im, ax=ax, label="busy share")
    fig.tight_layout()
    return _save(fig, path)


def plot_gantt(outcome: SimOutcome, path: str | Path, hours: float = 3.0) -> Path:
    """The phases of the jobs of one node group (the first one formed) over ``hours``."""
    rows = [g for g in outcome.gantt if g[2] < hours * 3600]
    jobs = sorted({g[0] for g in rows})
    fig, ax = plt.subplots(figsize=(11, 0.4 * max(4, len(jobs)) + 1))
    for y, job in enumerate(jobs):
        for name, kind, t0, t1, gpus in rows:
            if name == job:
                ax.barh(
                    y, (t1 - t0) / 60, left=t0 / 60, height=0.2 + 0.6 * min(1.0, gpus / 64),
                    color=_PHASE_COLOURS.get(kind, "#55a868"), edgecolor="none",
                )  # fmt: skip
    ax.set_yticks(range(len(jobs)), jobs, fontsize=7)
    ax.set_xlabel("time (min); bar height grows with the GPUs a phase holds")
    ax.set_title(f"{outcome.policy}: one node group's jobs")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _PHASE_COLOURS.values()]
    ax.legend(handles, list(_PHASE_COLOURS), fontsize=8, loc="upper right")
    fig.tight_layout()
    return _save(fig, path)


def plot_curves(
    curves: dict[str, tuple[np.ndarray, np.ndarray]],
    measured: tuple[np.ndarray, np.ndarray] | None,
    path: str | Path,
    published: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> Path:
    """Decode tokens/s per GPU by sequences per GPU, one line per model (``curves``: name to
    (batch, tokens/s)), and ``published`` measurements as unjoined markers (name to (batch per
    GPU, tokens/s per GPU); other models and GPUs than the curves'); right: each curve over its
    value at the largest batch, beside the ``measured`` curve of this project's engine
    normalised the same way (the shape check)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, (x, y) in curves.items():
        a.plot(x, y, marker="o", ms=3, label=name)
        b.plot(x, y / y[-1], marker="o", ms=3, label=name)
    lines = a.get_legend_handles_labels()
    for i, (name, (x, y)) in enumerate((published or {}).items()):
        a.scatter(x, y, marker="xs^vDP"[i % 6], s=30, color="k", zorder=3,
                  label=f"published: {name}")  # fmt: skip
    if measured is not None:
        x, y = measured
        b.plot(x, y / y[-1], "k--", marker="s", ms=4, label="measured (device run, 0.5B)")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences per GPU")
    a.set_yscale("log")
    a.set_ylabel("decode tokens/s per GPU (lines: model)")
    b.set_ylabel("tokens/s ÷ tokens/s at the largest batch")
    if published:  # the measurements' legend apart from the curves'
        handles, labels = a.get_legend_handles_labels()
        a.add_artist(a.legend(handles[len(lines[0]):], labels[len(lines[0]):], fontsize=6,
                              loc="upper left"))  # fmt: skip
        a.legend(*lines, fontsize=6, loc="lower right")
    else:
        a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def plot_tool_sweep(points: dict[float, dict[str, float]], path: str | Path) -> Path:
    """The tool-latency sweep: by latency factor, the completion time of Spread+Backfill and
    of the RollMux-style peer ÷ colocated's (left), and the tool waits' share of an agentic
    job's colocated run beside Spread+Backfill's charged GPU-hours ÷ isolated's (right).
    ``points``: factor to its ``tool_latency_x<f>.`` keys, without the prefix."""
    f = sorted(points)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    for key, label in (("completion_time_ratio_vs_colocated", "PlexRL Spread+Backfill"),
                       ("rollmux_completion_time_ratio_vs_colocated", "RollMux-style")):  # fmt: skip
        a.plot(f, [points[x][key] for x in f], marker="o", label=label)
    a.axhline(1.0, color="k", lw=0.8, ls=":")
    a.set_ylabel("completion time ÷ colocated")
    b.plot(f, [points[x]["tool_wait_share"] for x in f], marker="o",
           label="tool waits ÷ colocated run (agentic jobs)")  # fmt: skip
    b.plot(f, [points[x]["user_cost_ratio.spread+backfill"] for x in f], marker="s",
           label="Spread+Backfill GPU-h charged ÷ isolated")  # fmt: skip
    b.set_ylabel("share / ratio")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(f, [f"×{x:g}" for x in f])
        ax.set_xlabel("tool-call latency, × the committed estimate")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", path)
    return path
