"""Benchmark of the spatiotemporal placement, by trace-driven simulation at 2048 GPUs (issues 7
and 40; docs/measurements.md, "bench.simulate").

Three committed workloads, every baseline in one study, one run:

- ``paper2048-backlog`` (keys without a prefix): paper2048's job mix with rollouts from the
  decode model (:mod:`plexrl_dask.sim.decode`: colocated jobs decode over their training group),
  arriving at 1.3 x the most any isolated baseline sustains;
- ``paper2048`` (keys under ``paper2048.``): the committed workload of issue 7, unchanged;
- ``paper2048-agentic`` (keys under ``agentic.``, unless ``--no-agentic``): the backlog mix
  with 30 % of jobs making multi-turn rollouts with tool calls.

Per workload:

- ``completion_time_ratio``: whole-workload completion time (first arrival to last completion)
  of Spread+Backfill ÷ the isolated baseline in each job's cheapest mode (FIFO + EASY);
  ``_vs_colocated`` / ``_vs_split_async``: ÷ every job colocated (on its training group, for
  described rollouts) / split-async; ``completion_time_ratio.<policy>`` for every policy;
  ``rollmux_completion_time_ratio_vs_colocated``: the RollMux-style peer ÷ colocated;
- ``user_cost_ratio.<policy>`` (GPU-hours charged) and ``held_cost_ratio.<policy>`` (GPU-hours
  reserved) ÷ the cheapest isolated mode; ``completion_time_floor_ratio``: the lowest ratio
  any policy could reach (last arrival + ideal time ÷ isolated);
- ``capacity_load.<policy>``: the highest offered load each policy sustains with mean job
  slowdown ≤ ``--slowdown-target``, bisected on the full cluster (``--gpus``) over Poisson
  streams of ``--capacity-jobs`` jobs of the same mix; ``capacity_multiplier``:
  Spread+Backfill's ÷ the cheapest isolated mode's, ``_vs_colocated`` ÷ colocated's;
  ``rollmux_capacity_multiplier_vs_colocated``;
- ``gpu_double_bookings`` (0) over every run; ``sim_wall_s`` of the whole benchmark as run.

Besides, ``curve.*``: the decode curve's shape (tokens/s per GPU at batch b ÷ at 256) of the
workload's 7B class beside this project's measurement on its own engine
(``benchmarks/device/device.json``, captured decode at 1, 8, 64, 256 rows), when present; and
``decode_model_vs_measured``: the decode model with the backlog workload's ``hardware:`` at each
published measurement of ``sim/workloads/decode-measurements.yaml``
(:mod:`plexrl_dask.sim.measured`: predicted and measured tokens/s per sequence and per GPU,
predicted ÷ measured, the source), with ``decode_model_vs_measured_median`` / ``_min`` /
``_max`` of the ratios.

With ``--extended`` (or each of its flags; beyond the plain command's 120 s budget):

- ``--agentic-capacity``: the capacity bisection on ``paper2048-agentic`` too (``agentic.``);
- ``--sustained``: per workload, ``sustained_load.<policy>``, the saturation throughput
  (:func:`plexrl_dask.sim.study.sustained`: ``--sustained-jobs`` jobs all submitted at once
  on the full cluster, the work of the iterations completed between the 1/5 and 3/5 job
  completions per GPU-second, in offered-load units), its window, the jobs still queued at
  its end, and ``sustained_capacity_multiplier`` (``_vs_colocated``, RollMux-style's);
- ``--tool-sweep``: ``agentic.tool_latency_x<f>.*``, the agentic workload with its tool-call
  latencies times each ``--tool-factors`` factor (completion-time ratios, charged costs, the
  tool waits' share).

Run: ``python -m plexrl_dask.bench.simulate --gpus 2048 --json OUT`` (about 2 minutes on
one core: the capacity bisections at 2048 GPUs dominate; ``sim_wall_s_default`` is that part
of an extended run); ``--quick``: 256 GPUs, 100 jobs.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from plexrl_dask.bench.common import parser, report
from plexrl_dask.config import placement_config
from plexrl_dask.policy.spatiotemporal import PlacementConfig
from plexrl_dask.sim.decode import DecodeModel
from plexrl_dask.sim.measured import compare_measured, ratio_summary
from plexrl_dask.sim.study import capacity, compare, sustained, tool_wait_share, write_plots
from plexrl_dask.sim.workload import WorkloadSpec, generate

logger = logging.getLogger(__name__)

MAIN = ("isolated", "colocated", "split", "split-async", "rollmux", "spread+backfill",
        "pack+backfill")  # fmt: skip
SHORT = ("isolated", "colocated", "split-async", "rollmux", "spread+backfill")
CAPACITY = ("isolated", "colocated", "rollmux", "spread+backfill")
DEVICE_JSON = Path("benchmarks/device/device.json")


def study(spec: WorkloadSpec, policies: tuple[str, ...], capacity_policies: tuple[str, ...],
          args, placement: PlacementConfig, png: str | None) -> tuple[dict, dict]:  # fmt: skip
    """One workload's study: every policy on the same jobs, then capacity by bisection."""
    outcomes = compare(spec, policies, args.seed, placement, progress=False)
    s = {name: o.summary() for name, o in outcomes.items()}
    iso = s["isolated"]
    out: dict = {}
    for name, x in s.items():
        out[f"completion_time_ratio.{name}"] = x["makespan_h"] / iso["makespan_h"]
        out[f"user_cost_ratio.{name}"] = x["user_gpu_hours"] / iso["user_gpu_hours"]
        out[f"held_cost_ratio.{name}"] = x["held_gpu_hours"] / iso["held_gpu_hours"]
        out[f"mean_slowdown.{name}"] = x["mean_slowdown"]
        out[f"utilisation.{name}"] = x["utilisation"]
    sb = s["spread+backfill"]["makespan_h"]
    out["completion_time_ratio"] = sb / iso["makespan_h"]
    out["completion_time_ratio_vs_colocated"] = sb / s["colocated"]["makespan_h"]
    out["completion_time_ratio_vs_split_async"] = sb / s["split-async"]["makespan_h"]
    out["rollmux_completion_time_ratio_vs_colocated"] = (
        s["rollmux"]["makespan_h"] / s["colocated"]["makespan_h"]
    )
    out["completion_time_floor_ratio"] = iso["floor_makespan_h"] / iso["makespan_h"]
    out["isolated_makespan_h"] = iso["makespan_h"]
    out["gpu_double_bookings"] = sum(o.double_bookings for o in outcomes.values())
    out |= capacity_keys(spec, capacity_policies, args, placement)
    if png:
        out["figures"] = [str(p) for p in write_plots(outcomes, png)]
    return out, s


def capacity_keys(spec: WorkloadSpec, policies: tuple[str, ...], args,
                  placement: PlacementConfig) -> dict:  # fmt: skip
    """Each policy's capacity (the highest offered load with mean slowdown within the
    target, bisected on ``--capacity-jobs`` streams on the full cluster) and the ratios."""
    cap_spec = spec.scaled(spec.cluster.gpus, args.capacity_jobs)
    cap = {
        name: capacity(
            cap_spec,
            name,
            args.slowdown_target,
            args.seed,
            placement,
            *args.capacity_bracket,
            steps=args.capacity_steps,
        )  # fmt: skip
        for name in policies
    }
    out = {f"capacity_load.{name}": load for name, load in cap.items()}
    out["capacity_multiplier"] = cap["spread+backfill"] / cap["isolated"]
    out["capacity_multiplier_vs_colocated"] = cap["spread+backfill"] / cap["colocated"]
    if "rollmux" in cap:
        out["rollmux_capacity_multiplier_vs_colocated"] = cap["rollmux"] / cap["colocated"]
    return out


def sustained_keys(spec: WorkloadSpec, policies: tuple[str, ...], args,
                   placement: PlacementConfig) -> dict:  # fmt: skip
    """Each policy's saturation throughput (:func:`~plexrl_dask.sim.study.sustained`:
    ``--sustained-jobs`` jobs submitted at once on the full cluster), its window and the
    jobs still queued at its end, and the ratios."""
    out: dict = {}
    load: dict[str, float] = {}
    bookings = 0
    for name in policies:
        got, outcome = sustained(spec, name, args.sustained_jobs, args.seed, placement)
        load[name] = out[f"sustained_load.{name}"] = got.load
        out[f"sustained_window_h.{name}"] = [got.t0_s / 3600, got.t1_s / 3600]
        out[f"sustained_queue_at_end.{name}"] = got.queued_at_end
        bookings += outcome.double_bookings
    out["sustained_capacity_multiplier"] = load["spread+backfill"] / load["isolated"]
    out["sustained_capacity_multiplier_vs_colocated"] = load["spread+backfill"] / load["colocated"]
    if "rollmux" in load:
        out["rollmux_sustained_capacity_multiplier_vs_colocated"] = (
            load["rollmux"] / load["colocated"]
        )
    out["sustained_gpu_double_bookings"] = bookings
    return out


def tool_sweep_keys(spec: WorkloadSpec, factors: list[float], args, placement: PlacementConfig,
                    known: dict[float, dict]) -> dict:  # fmt: skip
    """The agentic workload with its tool-call latencies times each factor
    (:meth:`~plexrl_dask.sim.workload.WorkloadSpec.with_tool_latency`), every policy of
    ``SHORT`` on it: the completion-time ratios, charged costs and the tool waits' share, under
    ``tool_latency_x<f>.``. ``known``: policy summaries already run at a factor (the agentic
    study at 1), by factor."""
    out: dict = {}
    for f in factors:
        scaled = spec.with_tool_latency(f)
        if f in known:
            s, bookings = known[f], 0
        else:
            outcomes = compare(scaled, SHORT, args.seed, placement, progress=False)
            s = {name: o.summary() for name, o in outcomes.items()}
            bookings = sum(o.double_bookings for o in outcomes.values())
        iso, col = s["isolated"], s["colocated"]["makespan_h"]
        sb = s["spread+backfill"]["makespan_h"]
        point = {
            "completion_time_ratio_vs_colocated": sb / col,
            "rollmux_completion_time_ratio_vs_colocated": s["rollmux"]["makespan_h"] / col,
            "completion_time_ratio_vs_split_async": sb / s["split-async"]["makespan_h"],
            "completion_time_floor_ratio": iso["floor_makespan_h"] / iso["makespan_h"],
            "tool_wait_share": tool_wait_share(generate(scaled, args.seed), scaled.cluster),
            "gpu_double_bookings": bookings,
        }
        point |= {f"user_cost_ratio.{n}": x["user_gpu_hours"] / iso["user_gpu_hours"]
                  for n, x in s.items()}  # fmt: skip
        out |= {f"tool_latency_x{f:g}.{k}": v for k, v in point.items()}
    return out


def curve_figure(spec: WorkloadSpec, path: str) -> str:
    """Every described class's decode curve (and the measured one) as a figure, with the
    published measurements (tokens/s per GPU at their batch per GPU)."""
    from plexrl_dask.sim.plots import plot_curves

    curves = {}
    for m in spec.models:
        if m.rollout is None or spec.hardware is None:
            continue
        lengths = m.rollout.lengths or spec.lengths
        assert lengths is not None
        model = DecodeModel(spec.hardware, m.rollout.shape, lengths, m.rollout.tp)
        top = float(model.max_batch(np.ones(1))[0]) / m.rollout.tp
        b = np.unique(np.append(2.0 ** np.arange(0, np.log2(top)), top))
        ctx = float(lengths.residual_context(np.ones(1))[0])
        curves[f"{m.name} (tp {m.rollout.tp})"] = (b, model.tokens_per_s_per_gpu(b, ctx))
    measured = None
    if DEVICE_JSON.exists():
        r = json.loads(DEVICE_JSON.read_text()).get("results", {})
        b = np.array([1, 8, 64, 256])
        keys = [f"decode_0.5b_captured_tokens_per_s_b{k}" for k in b]
        if all(k in r for k in keys):
            measured = (b.astype(float), np.array([r[k] for k in keys]))
    published: dict[str, tuple[list[float], list[float]]] = {}
    if spec.hardware is not None:
        for row in compare_measured(spec.hardware):
            xs, ys = published.setdefault(f"{row['model']}, {row['gpu']} x{row['tp']}", ([], []))
            xs.append(row["batch"] / row["tp"])
            ys.append(row["measured_tok_s_per_gpu"])
    points = {k: (np.array(x), np.array(y)) for k, (x, y) in published.items()}
    return str(plot_curves(curves, measured, path, points))


def measured_check(spec: WorkloadSpec) -> dict:
    """The decode model with ``spec``'s hardware at every published measurement (per point,
    and the ratios' median, min and max)."""
    if spec.hardware is None:
        return {}
    rows = compare_measured(spec.hardware)
    summary = ratio_summary(rows)
    out: dict = {"decode_model_vs_measured": {row["name"]: row for row in rows}}
    out |= {f"decode_model_vs_measured_{k}": v for k, v in summary.items()}
    return out


def curve_check(spec: WorkloadSpec) -> dict:
    """The smallest described class's decode curve (tokens/s per GPU at b ÷ at b = 256) beside
    the project's own measured curve (the device run's captured decode), same batch sizes."""
    m = next((m for m in spec.models if m.rollout is not None), None)
    if m is None or spec.hardware is None:
        return {}
    assert m.rollout is not None
    lengths = m.rollout.lengths or spec.lengths
    assert lengths is not None
    model = DecodeModel(spec.hardware, m.rollout.shape, lengths, m.rollout.tp)
    b = np.array([1, 8, 64, 256])
    ctx = float(lengths.residual_context(np.ones(1))[0])
    sourced = model.tokens_per_s_per_gpu(b / m.rollout.tp, ctx)
    out = {
        f"curve.{m.name}_tokens_per_s_per_gpu_b{k}": float(v)
        for k, v in zip(b, sourced, strict=True)
    }
    out |= {
        f"curve.{m.name}_shape_b{k}": float(v / sourced[-1])
        for k, v in zip(b, sourced, strict=True)
    }
    if DEVICE_JSON.exists():
        r = json.loads(DEVICE_JSON.read_text()).get("results", {})
        keys = {k: f"decode_0.5b_captured_tokens_per_s_b{k}" for k in b}
        if all(v in r for v in keys.values()):
            top = r[keys[256]]
            out |= {f"curve.measured_shape_b{k}": r[v] / top for k, v in keys.items()}
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2048)
    p.add_argument("--jobs", type=int, default=None, help="default: the workloads' (500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slowdown-target", type=float, default=2.0)
    p.add_argument("--capacity-jobs", type=int, default=300,
                   help="jobs per run of the capacity bisection (on --gpus GPUs; enough to "
                   "fill the cluster: with 100 at 2048 GPUs no queue ever forms)")  # fmt: skip
    p.add_argument("--capacity-steps", type=int, default=5, help="simulations per bisection")
    p.add_argument("--capacity-bracket", type=float, nargs=2, default=(0.5, 4.0),
                   metavar=("LO", "HI"), help="offered loads the bisection searches")  # fmt: skip
    p.add_argument("--no-agentic", action="store_true", help="skip paper2048-agentic")
    p.add_argument("--png", default="benchmarks/simulate", help="prefix of the figures")
    x = p.add_argument_group("extended (beyond the plain command's 120 s)")
    x.add_argument("--extended", action="store_true", help="all three parts below")
    x.add_argument("--agentic-capacity", action="store_true",
                   help="the capacity bisection on paper2048-agentic too")  # fmt: skip
    x.add_argument("--sustained", action="store_true",
                   help="saturation throughput: jobs all submitted at once, completed work "
                   "per GPU-second between the 1/5 and 3/5 completions")  # fmt: skip
    x.add_argument("--sustained-jobs", type=int, default=1000, help="jobs of a sustained run")
    x.add_argument(
        "--tool-sweep",
        action="store_true",
        help="paper2048-agentic with its tool latencies times each factor",
    )
    x.add_argument("--tool-factors", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4])
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.extended:
        args.agentic_capacity = args.sustained = args.tool_sweep = True
    if args.quick:
        args.gpus, args.jobs, args.capacity_jobs = 256, args.jobs or 100, 60
        args.sustained_jobs = min(args.sustained_jobs, 100)
    t0, c0 = time.perf_counter(), time.process_time()
    placement = placement_config()
    results: dict = {}
    config: dict = {"summaries": {}}
    extended = _Clock()  # the extended parts
    plan = [("", "paper2048-backlog", MAIN, CAPACITY, args.png),
            ("paper2048.", "paper2048", SHORT, ("isolated", "colocated", "spread+backfill"),
             None)]  # fmt: skip
    if not args.no_agentic:
        plan.append(("agentic.", "paper2048-agentic", SHORT, CAPACITY, None))
    for prefix, name, policies, cap_policies, png in plan:
        spec = WorkloadSpec.load(name).scaled(args.gpus, args.jobs)
        if prefix != "agentic.":
            out, summaries = study(spec, policies, cap_policies, args, placement, png)
        else:  # completion; capacity (and the tool sweep) when asked for
            out, summaries = _completion_only(spec, policies, args, placement)
            with extended:
                if args.agentic_capacity:
                    out |= capacity_keys(spec, cap_policies, args, placement)
                if args.tool_sweep:
                    known = {1.0: summaries}
                    out |= tool_sweep_keys(spec, args.tool_factors, args, placement, known)
        if args.sustained:
            with extended:
                out |= sustained_keys(spec, cap_policies, args, placement)
        results |= {f"{prefix}{k}": v for k, v in out.items() if k != "figures"}
        config["summaries"][name] = summaries
        config.setdefault("figures", []).extend(out.get("figures", []))
        config[f"{name}.offered_load"] = spec.offered_load
        config[f"{name}.arrival_basis"] = spec.arrival_basis
        config[f"{name}.rollout_gpus"] = {m.name: m.rollout_gpus for m in spec.models}
    results["gpu_double_bookings"] = sum(
        v for k, v in results.items() if k.endswith("gpu_double_bookings")
    )
    backlog = WorkloadSpec.load("paper2048-backlog")
    results |= curve_check(backlog)
    results |= measured_check(backlog)
    if args.png:
        config["figures"].append(curve_figure(backlog, f"{args.png}-decode-curves.png"))
    if args.png and args.tool_sweep and not args.no_agentic:
        from plexrl_dask.sim.plots import plot_tool_sweep

        at = {f: f"agentic.tool_latency_x{f:g}." for f in args.tool_factors}
        points = {f: {k.removeprefix(p): v for k, v in results.items() if k.startswith(p)}
                  for f, p in at.items()}  # fmt: skip
        config["figures"].append(str(plot_tool_sweep(points, f"{args.png}-tool-sweep.png")))
    results["sim_wall_s"] = time.perf_counter() - t0
    results["extended_wall_s"] = extended.wall_s
    results["sim_wall_s_default"] = results["sim_wall_s"] - extended.wall_s
    # CPU seconds beside the wall times: on a shared machine the wall time also counts others
    results["sim_cpu_s"] = time.process_time() - c0
    results["sim_cpu_s_default"] = results["sim_cpu_s"] - extended.cpu_s
    report(
        "simulate",
        results,
        targets={
            "completion_time_ratio_vs_colocated": "<= 0.56 (paper), below RollMux-style",
            "capacity_multiplier_vs_colocated": ">= 1.8 (paper), above RollMux-style",
            "gpu_double_bookings": "0",
            "sim_wall_s_default": "<= 120 on one core",
        },
        config={
            "gpus": args.gpus,
            "jobs": args.jobs,
            "seed": args.seed,
            "slowdown_target": args.slowdown_target,
            "capacity_jobs": args.capacity_jobs,
            "capacity_steps": args.capacity_steps,
            "capacity_bracket": list(args.capacity_bracket),
            "agentic_capacity": args.agentic_capacity,
            "sustained": args.sustained,
            "sustained_jobs": args.sustained_jobs,
            "tool_sweep": args.tool_sweep,
            "tool_factors": args.tool_factors,
            "placement": placement.__dict__,
            **config,
        },
        out=args.json,
    )


class _Clock:
    """Wall and CPU seconds spent inside its ``with`` blocks, summed."""

    def __init__(self) -> None:
        self.wall_s = self.cpu_s = 0.0

    def __enter__(self) -> None:
        self._t, self._c = time.perf_counter(), time.process_time()

    def __exit__(self, *exc: object) -> None:
        self.wall_s += time.perf_counter() - self._t
        self.cpu_s += time.process_time() - self._c


def _completion_only(spec: WorkloadSpec, policies: tuple[str, ...], args,
                     placement: PlacementConfig) -> tuple[dict, dict]:  # fmt: skip
    outcomes = compare(spec, policies, args.seed, placement, progress=False)
    s = {name: o.summary() for name, o in outcomes.items()}
    col, sb = s["colocated"]["makespan_h"], s["spread+backfill"]["makespan_h"]
    out = {f"completion_time_ratio.{n}": x["makespan_h"] / s["isolated"]["makespan_h"]
           for n, x in s.items()}  # fmt: skip
    out |= {f"user_cost_ratio.{n}": x["user_gpu_hours"] / s["isolated"]["user_gpu_hours"]
            for n, x in s.items()}  # fmt: skip
    out["completion_time_ratio_vs_colocated"] = sb / col
    out["rollmux_completion_time_ratio_vs_colocated"] = s["rollmux"]["makespan_h"] / col
    out["gpu_double_bookings"] = sum(o.double_bookings for o in outcomes.values())
    return out, s


if __name__ == "__main__":
    main()
