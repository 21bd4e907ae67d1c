"""Benchmark of the spatiotemporal placement, by trace-driven simulation (issue 7, docs/measurements.md, "bench.simulate").

Every policy runs on the same generated workload (``plexrl_dask/sim/workloads/paper2048.yaml``,
committed before any comparison) in the same run:

- ``completion_time_ratio.<policy>``: whole-workload completion time (first arrival to last
  completion) ÷ the isolated baseline's (paper: Spread+Backfill 0.56; target <= 0.50);
- ``user_cost_ratio.<policy>``: GPU-hours charged to the jobs ÷ isolated, and
  ``held_cost_ratio.<policy>``: GPU-hours reserved (private allocations or node groups) ÷
  isolated;
- ``completion_time_floor_ratio``: the lowest ``completion_time_ratio`` any policy could
  reach on these jobs: the last ``arrival + ideal time`` (each job's fastest isolated time on
  an empty cluster) ÷ the isolated completion time. Near 1, the workload is arrival-bound and
  the completion time cannot tell policies apart (then the batch variant and the capacity
  multiplier do);
- ``batch.completion_time_ratio.<policy>``: the same jobs all submitted at once (how fast a
  backlog drains), Spread+Backfill and isolated (and ``batch.completion_time_floor_ratio``:
  there the floor is the longest job, and the work bound is ``user_cost_ratio``);
- ``capacity_multiplier``: the highest arrival rate Spread+Backfill sustains with the mean job
  slowdown (completion time ÷ the job's fastest isolated time on an empty cluster) at most
  ``--slowdown-target`` (2.0), found by bisection over Poisson streams of ``--capacity-jobs``
  jobs of the same mix on ``--capacity-gpus`` GPUs (512: a bisection is ~20 simulations),
  ÷ the same for isolated (paper 1.8x; target >= 2.0);
- ``gpu_double_bookings`` (0) over every run, and ``sim_wall_s`` / ``events_per_s`` of the
  Spread+Backfill run (target <= 60 s for >= 500 jobs over >= a simulated week at 2048 GPUs).

Run: ``python -m plexrl_dask.bench.simulate --gpus 2048 --json OUT`` (~10 minutes on one core);
``--quick``: 256 GPUs, 100 jobs, capacity on 128 GPUs (~2 minutes).
"""

from __future__ import annotations

import logging
import time

from plexrl_dask.bench.common import parser, report
from plexrl_dask.config import placement_config
from plexrl_dask.sim.simulator import POLICIES
from plexrl_dask.sim.study import capacity, compare, write_plots
from plexrl_dask.sim.workload import WorkloadSpec

logger = logging.getLogger(__name__)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2048)
    p.add_argument("--jobs", type=int, default=None, help="default: the workload's (500)")
    p.add_argument("--workload", default="paper2048", help="built-in name or YAML path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offered-load", type=float, default=None, help="override the workload's")
    p.add_argument("--slowdown-target", type=float, default=2.0)
    p.add_argument(
        "--capacity-gpus", type=int, default=512, help="cluster of the capacity bisection"
    )
    p.add_argument(
        "--capacity-jobs", type=int, default=400, help="jobs per run of the capacity bisection"
    )
    p.add_argument("--no-batch", action="store_true", help="skip the all-at-once variant")
    p.add_argument("--png", default="benchmarks/simulate", help="prefix of the figures")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.gpus, args.jobs = 256, args.jobs or 100
        args.capacity_gpus, args.capacity_jobs = 128, 120
    spec = WorkloadSpec.load(args.workload).scaled(args.gpus, args.jobs)
    if args.offered_load is not None:
        spec = spec.with_load(args.offered_load)
    placement = placement_config()
    outcomes = compare(spec, POLICIES, args.seed, placement)
    iso = outcomes["isolated"].summary()
    results: dict = {}
    for name, o in outcomes.items():
        s = o.summary()
        results[f"completion_time_ratio.{name}"] = s["makespan_h"] / iso["makespan_h"]
        results[f"user_cost_ratio.{name}"] = s["user_gpu_hours"] / iso["user_gpu_hours"]
        results[f"held_cost_ratio.{name}"] = s["held_gpu_hours"] / iso["held_gpu_hours"]
        results[f"mean_slowdown.{name}"] = s["mean_slowdown"]
        results[f"utilisation.{name}"] = s["utilisation"]
    if not args.no_batch:
        # the same jobs all submitted at once: how fast each policy drains a backlog
        batch = compare(spec.batch(), ("isolated", "spread+backfill"), args.seed, placement)
        iso_b = batch["isolated"].summary()
        for name, o in batch.items():
            s = o.summary()
            results[f"batch.completion_time_ratio.{name}"] = s["makespan_h"] / iso_b["makespan_h"]
            results[f"batch.utilisation.{name}"] = s["utilisation"]
        results["batch.gpu_double_bookings"] = sum(o.double_bookings for o in batch.values())
        results["batch.completion_time_floor_ratio"] = (
            iso_b["floor_makespan_h"] / iso_b["makespan_h"]
        )
    sb = outcomes["spread+backfill"].summary()
    results["completion_time_ratio"] = results["completion_time_ratio.spread+backfill"]
    results["completion_time_floor_ratio"] = iso["floor_makespan_h"] / iso["makespan_h"]
    results["isolated_makespan_h"] = iso["makespan_h"]
    results["gpu_double_bookings"] = sum(o.double_bookings for o in outcomes.values())
    results["sim_wall_s"] = sb["sim_wall_s"]
    results["events_per_s"] = sb["events_per_s"]
    results["events"] = sb["events"]
    t0 = time.perf_counter()
    cap_spec = spec.scaled(args.capacity_gpus, args.capacity_jobs)
    cap = {
        name: capacity(cap_spec, name, args.slowdown_target, args.seed, placement)
        for name in ("isolated", "spread+backfill")
    }
    results["capacity_load.isolated"] = cap["isolated"]
    results["capacity_load.spread+backfill"] = cap["spread+backfill"]
    results["capacity_multiplier"] = cap["spread+backfill"] / cap["isolated"]
    results["capacity_search_s"] = time.perf_counter() - t0
    figures = [str(p) for p in write_plots(outcomes, args.png)] if args.png else []
    report(
        "simulate",
        results,
        targets={
            "completion_time_ratio": "<= 0.50 (paper 0.56)",
            "capacity_multiplier": ">= 2.0 (paper 1.8)",
            "gpu_double_bookings": "0",
            "sim_wall_s": "<= 60 at 2048 GPUs, >= 500 jobs",
        },
        config={
            "workload": spec.name,
            "gpus": spec.cluster.gpus,
            "jobs": spec.jobs,
            "offered_load": spec.offered_load,
            "seed": args.seed,
            "slowdown_target": args.slowdown_target,
            "capacity_gpus": args.capacity_gpus,
            "capacity_jobs": args.capacity_jobs,
            "placement": placement.__dict__,
            "simulated_week": iso["makespan_h"] >= 168,
            "figures": figures,
            "summaries": {n: o.summary() for n, o in outcomes.items()},
        },
        out=args.json,
    )


if __name__ == "__main__":
    main()
