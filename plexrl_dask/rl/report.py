"""What a multiplexed run looked like: the end-of-run table and the PNG (reward curves and a
per-worker timeline coloured by job and op)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from rich.table import Table

from plexrl_dask.rl.grpo import StepRecord
from plexrl_dask.rl.ledger import ModeLedger
from plexrl_dask.shared.timeline import by_worker

#: How ops are drawn on the timeline: rollout solid, training hatched, weight moves dotted.
OP_STYLE = {
    "sample": ("", 1.0),
    "forward": ("..", 0.85),
    "forward_backward": ("//", 0.85),
    "optim_step": ("xx", 0.85),
    "train_step": ("\\\\", 0.85),
    "publish_weights": ("oo", 0.6),
    "load_weights": ("oo", 0.6),
    "load_state": ("--", 0.5),
}


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def reward_start_end(records: Sequence[StepRecord], k: int = 5) -> tuple[float, float]:
    """Mean sampled reward over the first and the last ``k`` steps (fewer when short)."""
    k = max(1, min(k, len(records) // 2 or 1))
    return mean([r.reward_mean for r in records[:k]]), mean([r.reward_mean for r in records[-k:]])


def summary_table(
    records: Mapping[str, Sequence[StepRecord]],
    ledger: ModeLedger,
    isolated_estimates: Mapping[str, float] | None = None,
    title: str = "multiplexed run",
) -> Table:
    """Per job: reward start → end, steps, wall time; then the pool's utilisation and cost
    and its ratio to each of ``isolated_estimates`` (worker-seconds by baseline name)."""
    table = Table(title=title)
    for col in ("job", "reward (first → last 5 steps)", "steps", "wall s", "tokens"):
        table.add_column(col, justify="left" if col == "job" else "right")
    for window in ledger.jobs:
        recs = records[window.job]
        start, end = reward_start_end(recs)
        wall = sum(r.wall_s for r in recs)
        table.add_row(
            window.job,
            f"{start:.3f} → {end:.3f}",
            str(len(recs)),
            f"{wall:.1f}",
            str(window.useful_tokens),
        )
    cost = ledger.reserved_worker_seconds()
    util = 1.0 - ledger.idle_fraction()
    pool = f"pool of {len(ledger.pool)}" if ledger.pool else "isolated"
    line = f"{pool}: makespan {ledger.makespan():.1f}s, utilisation {util:.0%}, cost {cost:.1f} worker-s"
    for name, estimate in (isolated_estimates or {}).items():
        if estimate > 0:
            line += f"; {cost / estimate:.2f} × {name} ({estimate:.1f})"
    table.caption = line
    return table


#: Steps in the moving average of the reward plot.
SMOOTHING = 5


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(
    records: Mapping[str, Sequence[StepRecord]],
    ledger: ModeLedger,
    path: str | os.PathLike[str],
    title: str = "",
) -> None:
    """Write a PNG: each job's sampled reward per step (faint) and its moving average over
    :data:`SMOOTHING` steps, and every worker's requests over time, coloured by job, hatched
    by op."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on workers or CI
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    jobs = [w.job for w in ledger.jobs]
    colours = {job: plt.get_cmap("tab10")(i % 10) for i, job in enumerate(jobs)}
    fig, (ax_r, ax_t) = plt.subplots(
        2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [1, 1.2]}, constrained_layout=True
    )
    for job in jobs:
        recs = records[job]
        steps, rewards = [r.step for r in recs], [r.reward_mean for r in recs]
        # raw points faint, their moving average bold: the trend a step's noise hides
        ax_r.plot(steps, rewards, color=colours[job], alpha=0.3, linewidth=0.8)
        ax_r.plot(steps, moving_average(rewards, SMOOTHING), label=job, color=colours[job])
    ax_r.set_xlabel("GRPO step")
    ax_r.set_ylabel("mean sampled reward")
    ax_r.legend(loc="upper left", fontsize="small")
    ax_r.set_title(
        f"{title or f'{ledger.mode}: reward per step'} (faint: each step; line: mean of "
        f"the last {SMOOTHING})"
    )

    owner = {d: w.job for w in ledger.jobs for d in w.deployments}
    lanes = by_worker(s for s in ledger.spans if s.deployment in owner)
    for y, (_worker, spans) in enumerate(sorted(lanes.items())):
        for s in spans:
            hatch, alpha = OP_STYLE.get(s.op, ("", 0.5))
            ax_t.barh(
                y,
                s.end - s.start,
                left=s.start - ledger.t0,
                height=0.8,
                color=colours[owner[s.deployment]],
                alpha=alpha,
                hatch=hatch,
                edgecolor="black",
                linewidth=0.2,
            )
    ax_t.set_yticks(range(len(lanes)), [w.rsplit("/", 1)[-1] for w in sorted(lanes)])
    ax_t.set_xlabel("seconds since the run started")
    ax_t.set_title("requests per worker (colour: job; hatch: op)")
    ops = sorted({s.op for ss in lanes.values() for s in ss})
    handles = [
        Patch(facecolor="white", edgecolor="black", hatch=OP_STYLE.get(op, ("", 0))[0], label=op)
        for op in ops
    ]
    # Below the lanes: inside, the legend would hide the requests it explains.
    ax_t.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        fontsize="x-small",
        ncol=max(1, min(6, len(ops))),
        frameon=False,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
