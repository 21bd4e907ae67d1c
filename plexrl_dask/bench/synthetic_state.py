"""A large synthetic state for the PlexRL scheduler plugin and its dashboard, and its churn.

:func:`fill_synthetic` gives a real scheduler's plugins the state of a production-size
cluster (deployments placed on fake workers, their residency, thousands of queued requests,
the Timeline's spans, job step reports, recent decisions) without any worker or job behind
it; :func:`churn` keeps that state changing as a busy cluster's would. The fake worker
addresses never connect, and nothing here triggers a dispatch pass. Used by
``bench.dashboard`` and the dashboard tests.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

from plexrl_dask.dashboard.jobs import JOB_TOPIC, JobStepReport
from plexrl_dask.dashboard.state import dashboard_of
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.policy.dispatch import Request
from plexrl_dask.policy.residency import RESIDENCY_TOPIC, ResidencyReport
from plexrl_dask.shared.records import DeploymentInfo
from plexrl_dask.shared.timeline import RequestSpan

OPS = ("sample", "forward_backward", "optim_step", "forward")
TIERS = ("hbm", "dram", "nvme")


@dataclass
class Synthetic:
    """What :func:`fill_synthetic` put into the plugins (fake worker addresses never connect)."""

    workers: list[str]
    deployments: list[str]
    jobs: list[str]
    requests: list[str] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)


def fake_worker(i: int, per_node: int = 8) -> str:
    return f"tcp://10.0.{i // per_node}.1:{40000 + i % per_node}"


def add_request(plexrl: Any, name: str, deployment: str, op: str, job: str, arrival: float) -> None:
    """Queue a synthetic request the way the plugin's routing and admission would: in its
    pending queue (per deployment) and in the dispatcher. (It has no tasks, so a dispatch
    pass would release it onto its fake group: nothing here triggers one.)"""
    from plexrl_dask.plugins.requests import PendingRequest

    info = plexrl.deployments[deployment]
    groups = tuple((w,) for w in info.workers)
    pending = plexrl.requests.add(
        PendingRequest(name, 1, deployment, op, None, job, groups=groups, admitted=True)
    )
    plexrl.dispatcher.add(
        Request(
            request=name,
            groups=groups,
            arrival=arrival,
            service_s=plexrl.service_estimate(deployment, op),
            order=pending.order,
            deployment=deployment,
            op=op,
            job=job,
        )
    )


def remove_request(plexrl: Any, name: str) -> None:
    plexrl.requests.forget(plexrl.requests.get(name))
    plexrl.dispatcher.remove(name)


def span(
    worker: str, deployment: str, job: str, op: str, end: float, rng: random.Random
) -> RequestSpan:
    run = rng.uniform(0.05, 0.8)
    setup = rng.choice((0.0, 0.0, 0.0, rng.uniform(0.05, 0.5)))
    return RequestSpan(worker, deployment, job, op, end - run - setup, end - run, end)


def fill_synthetic(
    scheduler: Any,
    *,
    requests: int = 10_000,
    workers: int = 256,
    deployments: int = 32,
    jobs: int = 8,
    replicas: int = 8,
    spans_per_worker: int = 20,
    steps: int = 100,
    decisions: int = 200,
    seed: int = 0,
) -> Synthetic:
    """Give the PlexRL and dashboard plugins of ``scheduler`` a large, consistent state:
    ``deployments`` (owned round-robin by ``jobs`` jobs; every other one a rollout with
    ``replicas`` replicas) placed on ``workers`` fake workers, which the dispatcher knows and
    which report residency (each worker holds its deployments in HBM, DRAM or NVMe);
    ``requests`` queued requests; ``spans_per_worker`` spans each in the Timeline window;
    ``steps`` step reports per job; ``decisions`` recent decisions."""
    from plexrl_dask.plugins.accounting import Started

    rng = random.Random(seed)
    plexrl = scheduler.plugins["plexrl"]
    dash = dashboard_of(scheduler)
    assert dash is not None, "the dashboard plugin is not installed"
    addrs = [fake_worker(i) for i in range(workers)]
    for i, w in enumerate(addrs):
        plexrl.worker_capacity[w] = {
            "worker": w,
            "budget_bytes": 8 << 30,
            "device": "cpu",
            "node": f"node-{i // 8}",
        }
        plexrl.dispatcher.add_worker(w)
    job_names = [f"job-{j}" for j in range(jobs)]
    spec = ModelSpec.tiny(hidden_size=32, num_layers=1)
    names = []
    for d in range(deployments):
        rollout = d % 2 == 1
        k = replicas if rollout else 1
        placed = tuple(addrs[(d * 7 + r * 31) % workers] for r in range(k))
        name = f"{'rollout' if rollout else 'policy'}-{d}"
        plexrl.deployments[name] = DeploymentInfo(
            name=name,
            uid=f"uid-{d}",
            spec=spec,
            role="rollout" if rollout else "train",
            backend="torch",
            owner=job_names[d % jobs],
            memory_bytes=rng.randint(1, 16) << 28,
            workers=placed,
            replicas=k,
        )
        names.append(name)
    for w in addrs:  # every worker holds up to four deployments, one of them in HBM
        for n, d in enumerate(rng.sample(names, 4)):
            info = plexrl.deployments[d]
            tier = "hbm" if n == 0 else rng.choice(TIERS[1:])
            plexrl.residency.apply(
                ResidencyReport(d, 1, tier, info.memory_bytes, rng.uniform(0.1, 3.0), w, info.uid)
            )
        dash.log_event(RESIDENCY_TOPIC, {})
    syn = Synthetic(addrs, names, job_names)
    now_m, now_w = time.monotonic(), time.time()
    for i in range(requests):
        d = rng.choice(names)
        name = f"synthetic-{next(syn.seq)}"
        add_request(
            plexrl,
            name,
            d,
            rng.choice(OPS),
            plexrl.deployments[d].owner,
            now_m - (requests - i) * 1e-3,
        )
        syn.requests.append(name)
    window = dash.cfg.timeline_window_s
    for w in addrs:
        ends = sorted(now_w - rng.uniform(0, window) for _ in range(spans_per_worker))
        for end in ends:
            d = rng.choice(names)
            dash.add_spans([span(w, d, plexrl.deployments[d].owner, rng.choice(OPS), end, rng)])
    for j in job_names:
        for s in range(steps):
            _report(dash, j, s, steps, rng)
    for _ in range(decisions):
        d = rng.choice(names)
        plexrl.decisions.append(
            {
                "time": now_w - rng.uniform(0, 10),
                "request": f"done-{next(syn.seq)}",
                "deployment": d,
                "op": rng.choice(OPS),
                "job": plexrl.deployments[d].owner,
                "workers": [rng.choice(addrs)],
                "wait_s": rng.uniform(0, 5),
                "ratio": rng.uniform(0.5, 4),
                "service_s": rng.uniform(0.1, 1),
                "setup_s": rng.choice((0.0, rng.uniform(0.1, 2))),
                "urgent": rng.random() < 0.1,
            }
        )
    for w in addrs[::2]:  # half the workers run something now
        d = rng.choice(names)
        plexrl.started[f"running-{w}"] = Started(
            now_m - rng.uniform(0, 2),
            d,
            rng.choice(OPS),
            w,
            plexrl.deployments[d].owner,
        )
    return syn


def _report(dash: Any, job: str, step: int, steps: int, rng: random.Random) -> None:
    report = JobStepReport(
        job=job,
        name=f"grpo-{job}",
        step=step,
        steps=steps,
        reward_mean=min(1.0, 0.2 + step / max(1, steps) * 0.6 + rng.uniform(-0.05, 0.05)),
        reward_max=1.0,
        sampled_tokens=rng.randint(500, 2000),
        loss=rng.uniform(-0.1, 0.1),
        version=step + 1,
        wall_s=rng.uniform(1, 3),
        time=time.time(),
    )
    dash.log_event(JOB_TOPIC, report.to_event())


def churn(scheduler: Any, syn: Synthetic, rng: random.Random, dt: float) -> None:
    """``dt`` seconds of a busy cluster: a span per worker-second, a residency move and a
    replaced request (the queue keeps its length) per 2 worker-seconds, a step per job every
    couple of seconds."""
    plexrl = scheduler.plugins["plexrl"]
    dash = dashboard_of(scheduler)
    n = len(syn.workers)
    now = time.time()
    count = max(1, int(n * dt))
    for k in range(count):  # ends increasing: each worker's spans arrive in order
        w, d = rng.choice(syn.workers), rng.choice(syn.deployments)
        end = now - dt + (k + 1) * dt / count
        dash.add_spans([span(w, d, plexrl.deployments[d].owner, rng.choice(OPS), end, rng)])
    for _ in range(max(1, int(n * dt / 2))):
        w, d = rng.choice(syn.workers), rng.choice(syn.deployments)
        info = plexrl.deployments[d]
        plexrl.residency.apply(
            ResidencyReport(
                d, 1, rng.choice(TIERS), info.memory_bytes, rng.uniform(0.1, 3), w, info.uid
            )
        )
        dash.log_event(RESIDENCY_TOPIC, {})
        old = syn.requests.pop(0)
        remove_request(plexrl, old)
        name = f"synthetic-{next(syn.seq)}"
        add_request(plexrl, name, d, rng.choice(OPS), info.owner, time.monotonic())
        syn.requests.append(name)
    if rng.random() < dt / 2:
        for j in syn.jobs:
            last = dash.ledger.reports[j]
            _report(dash, j, last.step + 1, last.steps, rng)
