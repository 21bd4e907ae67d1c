"""Benchmark of the scheduler plugin and its policy core: overhead, decision latency, HRRS.

Every comparison is within one run (this machine is shared and noisy):

- ``plain_task_throughput_ratio``: tasks/s of plain Dask tasks on a process LocalCluster with
  the PlexRL plugins ÷ on an identical one without, rounds interleaved (target >= 0.9);
- ``decision_latency_p50_us`` / ``_p99_us``: :meth:`Dispatcher.decide` after each completion,
  with 10,000 queued requests over 256 workers (512 deployments: single workers, 2- and 4-rank
  gangs, data-parallel rollouts over 4-8 replicas; half of them in HBM) in steady state
  (target p99 <= 1000);
- a mixed live workload on a 2-worker process LocalCluster (three jobs: a 2-rank FSDP trainer
  with long forward_backward + optim_step, two rollout jobs sampling short and long from
  2-replica deployments of two models; budgets fit the trainer's shard and one rollout model
  per worker), open-loop arrivals at about 70 % load computed from service times measured in
  the same run (near saturation the queue's growth, and with it every response time, swings
  from run to run); each round draws its own arrival realisation (3 in a full run, 1 quick)
  and replays it identically under each policy from the same residency, rounds interleaved,
  responses pooled over the rounds:
  ``hrrs_vs_fifo_mean_response_ratio`` and ``_p99_`` against residency-aware FIFO and
  ``model_loads_ratio`` against residency-blind FIFO (all < 1 is the point); every policy
  runs with dispatch lookahead (the default), and ``lookahead_mean_response_ratio`` /
  ``_p99_`` compare HRRS with it against HRRS without it (``sim_lookahead_…``: the same in
  simulation);
  ``hrrs_vs_fifo_p99_response_ratio_per_round`` gives each realisation's ratio and
  ``live_{p99,mean}_response_s_by_action`` which actions make each policy's tail;
  ``sim_live_mix_*`` are the same schedules in the queueing simulator
  (:func:`simulated_live_mix`), with this run's service and load times: the dispatch rule
  alone, without Dask's round trips, prefetches or this machine's noise.
- ``max_wait_over_bound``: the largest observed wait ÷ the proven bound of
  :mod:`plexrl_dask.policy.dispatch`, over simulated random and adversarial workloads (gang
  against a stream of singles, long against a stream of shorts, one job flooding the queue),
  under HRRS and both FIFOs (target <= 1). The simulated workloads also give ``sim_*`` ratios.
- ``scheduler_footprint``: a real ``dask scheduler`` process with ``--preload
  plexrl_dask.plugins`` beside one without, started alike, each with a client connected and
  Dask's status page and (with the preload) every PlexRL page built once: seconds until it
  serves, resident memory, objects the garbage collector tracks, the length of a full
  collection (which stops the scheduler's event loop for its whole length), and whether the
  model stack (torch, transformers, Zarr) was imported. ``scheduler_full_gc_ratio_vs_plain``
  and ``scheduler_rss_ratio_vs_plain`` are the preloaded scheduler's ÷ the plain one's.

Run: ``python -m plexrl_dask.bench.scheduler --json OUT`` (~15 min; ``--quick``: ~5 min;
``--only SECTION``, repeatable: footprint, plain, decisions, simulated, live).
"""

from __future__ import annotations

import heapq
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import dask
import numpy as np
from distributed import Client, LocalCluster
from rich.progress import track

import plexrl_dask as plexrl
from plexrl_dask.bench.common import interleaved, median, parser, report
from plexrl_dask.cluster import MODEL_STACK, TRIM_ENV_KEY, scheduler_process
from plexrl_dask.policy.dispatch import Dispatcher, DispatchPolicy, Request
from plexrl_dask.policy.estimates import Estimates, SetupCosts
from plexrl_dask.policy.residency import ResidencyMap, ResidencyReport
from plexrl_dask.sim.queueing import ADVERSARIAL, random_workload, simulate

logger = logging.getLogger(__name__)

# Every policy with dispatch lookahead (the default), and HRRS once more without it: the
# lookahead's own effect, in the same run.
POLICIES = {
    "hrrs": DispatchPolicy(lookahead=True),
    "fifo": DispatchPolicy.fifo(lookahead=True),
    "fifo_blind": DispatchPolicy.fifo("blind", lookahead=True),
    "hrrs_no_lookahead": DispatchPolicy(lookahead=False),
}
LIVE_POLICIES = {
    "hrrs": {"ordering": "hrrs", "choice": "residency", "lookahead": True},
    "fifo": {"ordering": "fifo", "choice": "residency", "lookahead": True},
    "fifo_blind": {"ordering": "fifo", "choice": "blind", "lookahead": True},
    "hrrs_no_lookahead": {"ordering": "hrrs", "choice": "residency", "lookahead": False},
}


# --- plain task overhead ------------------------------------------------------------------------


def _noop(x: int) -> int:
    return x + 1


def plain_task_throughput(quick: bool) -> dict[str, float]:
    """The same cluster twice (workers with the GPU resource, the same environment), with and
    without the PlexRL plugins."""
    n, reps = (2000, 4) if quick else (4000, 6)
    kwargs = {"n_workers": 2, "threads_per_worker": 1, "dashboard_address": ":0"}
    with dask.config.set({TRIM_ENV_KEY: None}):
        plain = LocalCluster(host="127.0.0.1", processes=True, resources={"GPU": 1}, **kwargs)
    with (
        plain,
        plexrl.local_cluster(**kwargs) as with_plugin,
        Client(plain, set_as_default=False) as a,
        Client(with_plugin, set_as_default=False) as b,
    ):

        def run(client: Client) -> None:
            client.gather(client.map(_noop, range(n), pure=False))

        run(a), run(b)  # warm
        times = interleaved({"without": lambda: run(a), "with": lambda: run(b)}, reps)
    return {
        "plain_tasks_per_s_without_plugin": n / median(times["without"]),
        "plain_tasks_per_s_with_plugin": n / median(times["with"]),
        "plain_task_throughput_ratio": median(times["without"]) / median(times["with"]),
    }


# --- the scheduler process ----------------------------------------------------------------------


def _scheduler_probe() -> dict[str, Any]:
    """Run on a scheduler: what it imported, its tracked objects, a full collection's length
    (the median of three) and its resident memory."""
    import gc

    import psutil

    pauses = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - t0)
    return {
        "heavy_modules": [m for m in MODEL_STACK if m in sys.modules],
        "objects": len(gc.get_objects()),
        "full_gc_ms": 1000 * statistics.median(pauses),
        "rss_mb": psutil.Process().memory_info().rss / 2**20,
    }


def _scheduler_process(preload: bool, timeout: float = 120.0) -> dict[str, Any]:
    """Start ``dask scheduler`` (with the PlexRL preload or without), connect a client, build
    Dask's status page and (with the preload) every PlexRL page once (a page's GET creates its
    Bokeh document on the scheduler), probe it, stop it."""
    from plexrl_dask.dashboard import PAGES

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with scheduler_process(tmp, preload=preload, timeout=timeout) as info:
            start_s = time.perf_counter() - t0
            with Client(info["address"], timeout=timeout, set_as_default=False) as client:
                base = client.dashboard_link.rsplit("/", 1)[0]
                for path in ("/status", *(PAGES if preload else ())):
                    with urllib.request.urlopen(base + path, timeout=timeout) as page:
                        page.read()
                return {"start_s": start_s, **client.run_on_scheduler(_scheduler_probe)}


def scheduler_footprint(quick: bool) -> dict[str, Any]:
    """The preloaded scheduler process against a plain one (see the module docstring); each
    figure is the median over the starts, the two kinds alternating."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(2 if quick else 3):
        for preload in (False, True):
            runs[preload].append(_scheduler_process(preload))
    out: dict[str, Any] = {}
    for preload, name in ((False, "plain"), (True, "preloaded")):
        for key in ("start_s", "rss_mb", "objects", "full_gc_ms"):
            out[f"scheduler_{name}_{key}"] = median([r[key] for r in runs[preload]])
        out[f"scheduler_{name}_heavy_modules"] = sorted(
            {m for r in runs[preload] for m in r["heavy_modules"]}
        )
    out["scheduler_full_gc_ratio_vs_plain"] = (
        out["scheduler_preloaded_full_gc_ms"] / out["scheduler_plain_full_gc_ms"]
    )
    out["scheduler_rss_ratio_vs_plain"] = (
        out["scheduler_preloaded_rss_mb"] / out["scheduler_plain_rss_mb"]
    )
    return out


# --- decision latency --------------------------------------------------------------------------


def decision_latency(
    quick: bool, n_queued: int = 10_000, n_workers: int = 256, seed: int = 0
) -> dict[str, float]:
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(n_workers)]
    deployments: list[tuple[str, tuple[tuple[str, ...], ...], bool]] = []
    residency = ResidencyMap()
    for i in range(512):
        kind = rng.random()
        if kind < 0.4:
            groups = ((rng.choice(workers),),)
        elif kind < 0.6:
            groups = (tuple(rng.sample(workers, rng.choice([2, 4]))),)
        else:
            groups = tuple((w,) for w in rng.sample(workers, rng.randint(4, 8)))
        name = f"d{i}"
        deployments.append((name, groups, len(groups) > 1))
        for g in groups:
            for w in g:
                tier = "hbm" if rng.random() < 0.5 else "dram"
                residency.apply(ResidencyReport(name, 0, tier, 2 * 10**9, 0.0, worker=w))
    costs = SetupCosts(residency, Estimates(), lambda _: 2 * 10**9)
    dispatcher = Dispatcher(DispatchPolicy(), costs, workers)
    ids = iter(range(10**9))

    def request(now: float) -> Request:
        name, groups, dp = rng.choice(deployments)
        k = rng.randrange(len(groups))
        return Request(
            request=f"r{next(ids)}",
            groups=groups if dp else (groups[k],),
            arrival=now,
            service_s=rng.lognormvariate(0.0, 1.0),
            order=f"{name}#any" if dp else f"{name}#{k}",
            deployment=name,
        )

    for i in range(n_queued):
        dispatcher.add(request(-100.0 + 100.0 * i / n_queued))
    running: list[tuple[float, int, tuple[str, ...]]] = []
    tie = iter(range(10**9))
    now = 0.0
    for d in dispatcher.decide(now):
        heapq.heappush(running, (now + d.request.service_s, next(tie), d.group))
    samples, released = [], []
    for _ in track(range(1000 if quick else 5000), description="decisions"):
        if not running:
            break
        now, _, group = heapq.heappop(running)
        for w in group:
            dispatcher.release_worker(w)
        while len(dispatcher) < n_queued:
            dispatcher.add(request(now))
        t0 = time.perf_counter()
        decisions = dispatcher.decide(now)
        samples.append(time.perf_counter() - t0)
        released.append(len(decisions))
        for d in decisions:
            heapq.heappush(
                running, (now + d.request.service_s * rng.uniform(0.5, 2.0), next(tie), d.group)
            )
    us = np.array(samples) * 1e6
    return {
        "decision_latency_p50_us": float(np.percentile(us, 50)),
        "decision_latency_p99_us": float(np.percentile(us, 99)),
        "decision_latency_max_us": float(us.max()),
        "decisions_measured": len(samples),
        "releases_per_decision_mean": float(np.mean(released)),
    }


# --- simulated workloads: the bound, and ratios at scale ---------------------------------------


def simulated(quick: bool) -> dict[str, float]:
    seeds = range(10 if quick else 40)
    worst = 0.0
    mean_resp: dict[str, list[float]] = {p: [] for p in POLICIES}
    loads: dict[str, int] = dict.fromkeys(POLICIES, 0)
    for seed in track(seeds, description="simulated workloads"):
        cluster, workload = random_workload(seed, n_workers=8, n_requests=300)
        for name, policy in POLICIES.items():
            result = simulate(workload, cluster, policy)
            worst = max(worst, result.max_wait_over_bound())
            mean_resp[name].append(statistics.fmean(result.responses()))
            loads[name] += result.loads
    for factory in ADVERSARIAL.values():
        cluster, workload = factory()
        for policy in POLICIES.values():
            worst = max(worst, simulate(workload, cluster, policy).max_wait_over_bound())
    return {
        "max_wait_over_bound": worst,
        "sim_hrrs_vs_fifo_mean_response_ratio": statistics.fmean(mean_resp["hrrs"])
        / statistics.fmean(mean_resp["fifo"]),
        "sim_model_loads_ratio": loads["hrrs"] / max(1, loads["fifo_blind"]),
        "sim_fifo_vs_blind_model_loads_ratio": loads["fifo"] / max(1, loads["fifo_blind"]),
        "sim_lookahead_mean_response_ratio": statistics.fmean(mean_resp["hrrs"])
        / statistics.fmean(mean_resp["hrrs_no_lookahead"]),
    }


# --- the live mixed workload ---------------------------------------------------------------------


def live_schedule(
    service: dict[str, float], duration_s: float, load: float = 0.7, seed: int = 0
) -> list[tuple[float, str]]:
    """Open-loop arrivals of the live mix's actions (``service``: each action's measured
    seconds): each action a Poisson stream, rates set so that the expected busy worker-time
    is ``load`` of both workers (the trainer's gang takes both)."""
    rng = random.Random(seed)
    weight = {"train": 2.0, "sample_a": 1.0, "sample_b": 1.0, "sample_b_long": 1.0}
    share = {"train": 0.35, "sample_a": 0.25, "sample_b": 0.25, "sample_b_long": 0.15}
    events = []
    for name, frac in share.items():
        rate = load * 2 * frac / (service[name] * weight[name])
        t = rng.expovariate(rate)
        while t < duration_s:
            events.append((t, name))
            t += rng.expovariate(rate)
    return sorted(events)


class _LiveWorkload:
    """Three jobs on one 2-worker cluster; see the module docstring."""

    def __init__(self, client: Client, quick: bool) -> None:
        self.client = client
        self.duration_s = 25.0 if quick else 45.0
        spec_a = plexrl.ModelSpec.tiny(
            hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=256, seed=1
        )
        spec_b = plexrl.ModelSpec.tiny(
            hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=256, seed=2
        )
        self.jobs = {j: plexrl.Runtime(client, job=j) for j in ("trainer", "rl-a", "rl-b")}
        self.trainer = self.jobs["trainer"].deploy("bench-trainer", spec_a, world_size=2)
        self.roll_a = self.jobs["rl-a"].deploy("bench-roll-a", spec_a, role="rollout", replicas=2)
        self.roll_b = self.jobs["rl-b"].deploy("bench-roll-b", spec_b, role="rollout", replicas=2)
        tok = self.trainer.tokenize
        self.batch = [
            plexrl.Datum(tokens=tok("".join(str((i * j) % 10) for j in range(120))))
            for i in range(16)
        ]
        self.prompts = [f"{i}+{i * 3}=" for i in range(4)]
        self.workers = sorted(set(self.roll_a.info.workers) | set(self.trainer.info.workers))
        self.actions = {
            "train": self._train,
            "sample_a": lambda: self.roll_a.sample(self.prompts[:2], self._params(8)),
            "sample_b": lambda: self.roll_b.sample(self.prompts[:2], self._params(8)),
            "sample_b_long": lambda: self.roll_b.sample(self.prompts, self._params(48)),
        }

    @staticmethod
    def _params(tokens: int) -> plexrl.SamplingParams:
        return plexrl.SamplingParams(n=2, temperature=1.0, max_tokens=tokens, seed=0)

    def _train(self) -> list[Any]:
        return [
            self.trainer.forward_backward(self.batch),
            self.trainer.optim_step(plexrl.AdamWParams(lr=1e-4)),
        ]

    def reset_residency(self) -> None:
        """The same residency before every policy: b, then a, then the trainer loaded last."""
        for dep in (self.roll_b, self.roll_a, self.trainer):
            plexrl.result(dep.load(), timeout=300)

    def service_times(self) -> dict[str, float]:
        """Median wall time of each action run alone (3 runs after a warm one)."""
        out = {}
        for name, action in self.actions.items():
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                plexrl.result(action(), timeout=300)
                times.append(time.perf_counter() - t0)
            out[name] = median(times[1:])
        return out

    def schedule(self, service: dict[str, float], seed: int = 0) -> list[tuple[float, str]]:
        """This workload's arrivals (:func:`live_schedule`) over its duration."""
        return live_schedule(service, self.duration_s, seed=seed)

    @staticmethod
    def load_time_s(seconds: dict[str, float], counts: dict[str, int]) -> float:
        """The mean measured load over every policy's runs (the simulator's load time)."""
        n = sum(counts.values())
        return sum(seconds.values()) / n if n else 0.0  # no load: the simulator needs none

    def loads(self) -> tuple[int, float]:
        """Loads into HBM so far (builds, reloads, prefetches) and their measured seconds."""
        count, seconds = 0, 0.0
        for w in self.workers:
            status = self.jobs["trainer"].holder(w).status().result(timeout=60)
            c = status["counters"]
            count += c["loads"] + c["reloads"] + c["prefetches"]
            seconds += status["load_seconds"]
        return count, seconds

    def run(self, schedule: list[tuple[float, str]]) -> tuple[list[float | None], int, float]:
        """Replay ``schedule``; returns the response times (in schedule order; None for one
        whose completion was not seen), and the model loads it caused with their measured
        seconds."""
        self.reset_residency()
        loads0, seconds0 = self.loads()
        done: dict[int, float] = {}
        submitted: dict[int, float] = {}
        lock = threading.Lock()
        futures = []
        start = time.perf_counter()
        for i, (t, name) in enumerate(schedule):
            delay = start + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            out = self.actions[name]()
            fut = out[-1] if isinstance(out, list) else out
            submitted[i] = time.perf_counter()

            def finished(_: Any, i: int = i) -> None:
                with lock:
                    done[i] = time.perf_counter()

            fut.add_done_callback(finished)
            futures.append(out)
        plexrl.result(
            [f for out in futures for f in (out if isinstance(out, list) else [out])], timeout=600
        )
        deadline = time.monotonic() + 10
        while len(done) < len(schedule) and time.monotonic() < deadline:
            time.sleep(0.01)
        loads, seconds = self.loads()
        if len(done) < len(schedule):
            logger.warning("%d completions were not seen in time", len(schedule) - len(done))
        # in schedule order, None where a completion was not seen
        responses = [done[i] - submitted[i] if i in done else None for i in range(len(schedule))]
        return responses, loads - loads0, seconds - seconds0


def live_mixed(quick: bool) -> dict[str, Any]:
    spec = plexrl.ModelSpec.tiny(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=256
    )
    weights = spec.memory_bytes("rollout")
    # The trainer's shard (train bytes / 2) and one rollout model fit; two rollout models do not.
    budget = spec.memory_bytes("train") // 2 + int(1.5 * weights)
    with (
        dask.config.set({"plexrl.worker.memory-budget": budget}),
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        work = _LiveWorkload(client, quick)
        admin = work.jobs["trainer"]
        service = work.service_times()
        # One arrival realisation per round, each replayed under every policy: the p99 of one
        # realisation turns on its bursts (a few trainer actions arriving together), so the
        # comparison pools several.
        schedules = [work.schedule(service, seed=r) for r in range(1 if quick else 3)]
        responses: dict[str, list[float]] = {p: [] for p in LIVE_POLICIES}
        # by action (which requests make each policy's tail) and by round (how much rounds
        # disagree): the p99 of ~1,000 responses is their tenth-longest
        by_action: dict[str, dict[str, list[float]]] = {p: {} for p in LIVE_POLICIES}
        rounds: dict[str, list[list[float]]] = {p: [] for p in LIVE_POLICIES}
        loads: dict[str, int] = dict.fromkeys(LIVE_POLICIES, 0)
        load_s: dict[str, float] = dict.fromkeys(LIVE_POLICIES, 0.0)
        for schedule in schedules:
            for name, knobs in track(LIVE_POLICIES.items(), description="live policies"):
                admin.set_policy(**knobs)
                got, n_loads, seconds = work.run(schedule)
                seen = [r for r in got if r is not None]
                responses[name] += seen
                rounds[name].append(seen)
                for (_, action), r in zip(schedule, got, strict=True):
                    if r is not None:
                        by_action[name].setdefault(action, []).append(r)
                loads[name] += n_loads
                load_s[name] += seconds
        admin.set_policy(**LIVE_POLICIES["hrrs"])

    def p99(xs: list[float]) -> float:
        return float(np.percentile(xs, 99))

    out: dict[str, Any] = {
        "hrrs_vs_fifo_mean_response_ratio": statistics.fmean(responses["hrrs"])
        / statistics.fmean(responses["fifo"]),
        "hrrs_vs_fifo_p99_response_ratio": p99(responses["hrrs"]) / p99(responses["fifo"]),
        "model_loads_ratio": loads["hrrs"] / max(1, loads["fifo_blind"]),
        "lookahead_mean_response_ratio": statistics.fmean(responses["hrrs"])
        / statistics.fmean(responses["hrrs_no_lookahead"]),
        "lookahead_p99_response_ratio": p99(responses["hrrs"])
        / p99(responses["hrrs_no_lookahead"]),
        "live_requests_per_policy_run": statistics.fmean(len(x) for x in schedules),
    }
    for name in LIVE_POLICIES:
        out[f"live_{name}_mean_response_s"] = statistics.fmean(responses[name])
        out[f"live_{name}_p99_response_s"] = p99(responses[name])
        out[f"live_{name}_model_loads"] = loads[name]
        out[f"live_{name}_load_seconds"] = load_s[name]
    out["live_service_s"] = {k: round(v, 4) for k, v in service.items()}
    out["live_p99_response_s_by_action"] = {
        name: {a: round(p99(xs), 4) for a, xs in sorted(actions.items())}
        for name, actions in by_action.items()
    }
    out["live_mean_response_s_by_action"] = {
        name: {a: round(statistics.fmean(xs), 4) for a, xs in sorted(actions.items())}
        for name, actions in by_action.items()
    }
    out["hrrs_vs_fifo_p99_response_ratio_per_round"] = [
        round(p99(h) / p99(f), 3) for h, f in zip(rounds["hrrs"], rounds["fifo"], strict=True)
    ]
    out.update(simulated_live_mix(schedules, service, work.load_time_s(load_s, loads)))
    return out


SIM_WORKERS = ("w0", "w1")


def simulated_live_mix(
    schedules: list[list[tuple[float, str]]], service: dict[str, float], load_s: float
) -> dict[str, Any]:
    """The live schedules in the queueing simulator, with the service and load times measured
    in the same run: what the dispatch rule alone does with this workload, without Dask's
    round trips, the holders' prefetches or this machine's noise (responses pooled over the
    schedules, as live). Each worker holds the trainer's shard and one rollout model."""
    from plexrl_dask.sim.queueing import ClusterModel, simulate

    nbytes = 100_000_000  # any size: the bandwidth below makes a load take ``load_s``
    cluster = ClusterModel(
        SIM_WORKERS,
        dict.fromkeys(("trainer", "roll-a", "roll-b"), nbytes),
        hbm_models=2,
        bandwidths=dict.fromkeys(("dram", "nvme", "absent"), nbytes / max(load_s, 1e-3)),
        resident={"trainer": SIM_WORKERS, "roll-a": ("w0",), "roll-b": ("w1",)},
    )
    out: dict[str, Any] = {}
    means, p99s = {}, {}
    for name in ("hrrs", "fifo"):
        resp, loads = [], 0
        for schedule in schedules:
            res = simulate(_sim_live_requests(schedule, service), cluster, POLICIES[name])
            finish = {r.request.request: r.finish for r in res.records}
            for i, (t, action) in enumerate(schedule):
                last = f"{i}-optim_step" if action == "train" else f"{i}-sample"
                resp.append(finish[last] - t)
            loads += res.loads
        means[name], p99s[name] = statistics.fmean(resp), float(np.percentile(resp, 99))
        out[f"sim_live_mix_{name}_model_loads"] = loads
    out["sim_live_mix_hrrs_vs_fifo_mean_response_ratio"] = means["hrrs"] / means["fifo"]
    out["sim_live_mix_hrrs_vs_fifo_p99_response_ratio"] = p99s["hrrs"] / p99s["fifo"]
    out["sim_live_mix_load_s"] = load_s
    return out


def _sim_live_requests(schedule: list[tuple[float, str]], service: dict[str, float]) -> list[Any]:
    """A schedule's actions as simulated requests: the trainer's action is its two gang
    requests (forward_backward, then optim_step: its response ends with the second), a
    sample goes to either replica of its model."""
    from plexrl_dask.sim.queueing import sim_request

    # forward_backward took most of the measured train action (optim_step ~ a fifth)
    split = {"forward_backward": 0.8, "optim_step": 0.2}
    requests = []
    for i, (t, action) in enumerate(schedule):
        if action == "train":
            for k, (op, share) in enumerate(split.items()):
                requests.append(
                    sim_request(f"{i}-{op}", [SIM_WORKERS], t + k * 1e-6, share * service[action],
                                "trainer", op=op, order="trainer#0", job="trainer")
                )  # fmt: skip
        else:
            model = "roll-a" if action == "sample_a" else "roll-b"
            requests.append(
                sim_request(f"{i}-sample", [(w,) for w in SIM_WORKERS], t, service[action],
                            model, op="sample", order=f"{model}#any", job=model)
            )  # fmt: skip
    return requests


SECTIONS = {
    "footprint": scheduler_footprint,
    "plain": plain_task_throughput,
    "decisions": decision_latency,
    "simulated": simulated,
    "live": live_mixed,
}

TARGETS = {
    "plain_task_throughput_ratio": ">= 0.9",
    "decision_latency_p99_us": "<= 1000",
    "hrrs_vs_fifo_mean_response_ratio": "< 1",
    "hrrs_vs_fifo_p99_response_ratio": "< 1",
    "model_loads_ratio": "< 1",
    "max_wait_over_bound": "<= 1",
}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        help="run only this section (repeatable; default: all)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, Any] = {}
    for name, section in SECTIONS.items():
        if not args.only or name in args.only:
            results.update(section(args.quick))
    report(
        "scheduler",
        results,
        TARGETS,
        {"quick": args.quick, "policies": {k: str(v) for k, v in POLICIES.items()}},
        args.json,
    )


if __name__ == "__main__":
    main()
