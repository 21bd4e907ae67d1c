"""Request-level discrete-event simulation of runtime dispatch, and the workloads it is tested on.

It drives the objects the scheduler plugin runs live (:class:`Dispatcher`,
:class:`SetupCosts`, :class:`Estimates`, :class:`ResidencyMap`), unchanged, with simulated
time: requests arrive, the dispatcher releases them, each runs on its group for its setup (a
load from the tier its model is in on each worker, at that tier's bandwidth; the slowest rank
sets the pace) plus its service time. Workers hold up to ``hbm_models`` models in HBM and
offload the least recently used to DRAM, as the replica holder does, and report residency as
holders do; the estimates learn from completions and loads as the plugin's do (service time
observed from start to completion, setup from each load). With lookahead, a request released
behind a running one starts when that one ends; its model is made resident in the holder model
at its release (the simulated holder has no prefetch of its own).

Deterministic: no randomness inside (workload generators take a seed). Events at one instant
are applied in a fixed order (completions, then arrivals) before one decision.

:class:`SimResult` checks a run against the dispatch rule's promises: the starvation bound of
:mod:`plexrl_dask.policy.dispatch` for every request (in share order), one request per worker at a time, and
release in submission order within each order.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plexrl_dask.policy.dispatch import Dispatcher, DispatchPolicy, Group, Request
from plexrl_dask.policy.estimates import DEFAULT_LOAD_BANDWIDTHS, Estimates, SetupCosts
from plexrl_dask.policy.residency import ResidencyMap, ResidencyReport


@dataclass(frozen=True)
class SimRequest:
    """A request (``request.service_s`` is the estimate dispatch sees) and its true service."""

    request: Request
    duration_s: float


@dataclass(frozen=True)
class ClusterModel:
    """Workers, how many models each holds in HBM, model sizes and true load bandwidths."""

    workers: tuple[str, ...]
    model_bytes: Mapping[str, int] = field(default_factory=dict)
    hbm_models: int = 1
    bandwidths: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_LOAD_BANDWIDTHS))
    resident: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # in HBM at t=0


@dataclass
class Record:
    """What happened to one request."""

    request: Request
    index: int  # arrival order
    patience: float
    start: float = float("nan")
    finish: float = float("nan")
    group: Group = ()
    setup_s: float = 0.0
    urgent: bool = False
    released: float = float("nan")  # = start, unless queued behind another (lookahead)
    tag: float = 0.0  # share tag (dispatch's "Share order")

    @property
    def key(self) -> tuple[float, float, int]:
        """Its place in dispatch's share order ``K``."""
        return (self.tag, self.request.arrival, self.index)

    @property
    def wait(self) -> float:
        return self.start - self.request.arrival

    @property
    def response(self) -> float:
        return self.finish - self.request.arrival


@dataclass
class SimResult:
    records: list[Record]
    loads: int
    lookahead: bool = False

    def responses(self) -> list[float]:
        return [r.response for r in self.records]

    def bounds(self) -> list[float]:
        """The bound on each request's wait (the module docstring of
        :mod:`plexrl_dask.policy.dispatch`): ``P_max + n * B``; with lookahead, where a
        released request may wait behind one more, ``P_max + (2 n + 1) * B``. ``n`` counts
        the requests ahead in share order that arrived before (once) and after (twice)."""
        recs = sorted(self.records, key=lambda r: r.index)
        out = [0.0] * len(recs)
        for i, r in enumerate(recs):
            a, s, key = r.request.arrival, r.start, r.key
            before = [q for q in recs[: i + 1] if q.key <= key]
            p_max = max(q.patience for q in before)
            t0 = a + p_max
            n = sum(1 for q in before if q.released > t0)
            n += 2 * sum(1 for q in recs[i + 1 :] if q.key < key and q.released > t0)
            blocking = max(
                (q.finish - q.start for q in recs if q.start < s and q.finish > a), default=0.0
            )
            out[r.index] = p_max + ((2 * n + 1) if self.lookahead else n) * blocking
        return out

    def max_wait_over_bound(self) -> float:
        worst = 0.0
        for r, bound in zip(
            sorted(self.records, key=lambda r: r.index), self.bounds(), strict=True
        ):
            if r.wait > 1e-9:
                worst = max(worst, r.wait / bound if bound > 0 else float("inf"))
        return worst

    def overlaps(self) -> list[tuple[str, str, str]]:
        """(worker, request, request) for every two requests that overlapped on a worker."""
        by_worker: dict[str, list[Record]] = {}
        for r in self.records:
            for w in r.group:
                by_worker.setdefault(w, []).append(r)
        bad = []
        for w, recs in by_worker.items():
            recs.sort(key=lambda r: r.start)
            for a, b in itertools.pairwise(recs):
                if b.start < a.finish - 1e-9:
                    bad.append((w, a.request.request, b.request.request))
        return bad

    def order_violations(self) -> list[tuple[str, str]]:
        """Pairs of one order that were released out of arrival order (on one worker, what is
        released first also starts first)."""
        by_order: dict[str, list[Record]] = {}
        for r in sorted(self.records, key=lambda r: r.index):
            by_order.setdefault(r.request.order_key, []).append(r)
        return [
            (a.request.request, b.request.request)
            for recs in by_order.values()
            for a, b in itertools.pairwise(recs)
            if b.released < a.released
        ]


class _Holder:
    """A worker's models: LRU in HBM up to a count, the rest it held in DRAM."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.hbm: OrderedDict[str, None] = OrderedDict()
        self.dram: set[str] = set()

    def tier(self, model: str) -> str:
        return "hbm" if model in self.hbm else "dram" if model in self.dram else "absent"

    def use(self, model: str) -> tuple[str, list[str]]:
        """Make ``model`` resident; returns the tier it came from and what was offloaded."""
        source = self.tier(model)
        self.dram.discard(model)
        self.hbm[model] = None
        self.hbm.move_to_end(model)
        evicted = []
        while len(self.hbm) > self.capacity:
            victim, _ = self.hbm.popitem(last=False)
            self.dram.add(victim)
            evicted.append(victim)
        return source, evicted


def simulate(
    workload: Sequence[SimRequest],
    cluster: ClusterModel,
    policy: DispatchPolicy,
    learn: bool = True,
) -> SimResult:
    """Run ``workload`` (any order; sorted by arrival) on ``cluster`` under ``policy``."""
    residency = ResidencyMap()
    estimates = Estimates(load_bandwidths=dict(DEFAULT_LOAD_BANDWIDTHS))
    bytes_of = dict(cluster.model_bytes)
    dispatcher = Dispatcher(
        policy, SetupCosts(residency, estimates, lambda m: bytes_of.get(m, 0)), cluster.workers
    )
    holders = {w: _Holder(cluster.hbm_models) for w in cluster.workers}

    def report(model: str, worker: str, tier: str, load_s: float = 0.0, source: str = "") -> None:
        residency.apply(
            ResidencyReport(
                model, 0, tier, bytes_of.get(model, 0), load_s, worker=worker, source=source
            )
        )

    for model, workers in cluster.resident.items():
        for w in workers:
            holders[w].use(model)
            report(model, w, "hbm")

    ordered = sorted(workload, key=lambda x: x.request.arrival)
    records: dict[str, Record] = {}
    true_duration = {x.request.request: x.duration_s for x in ordered}
    seq = itertools.count()
    events: list[
        tuple[float, int, int, object]
    ] = []  # (time, 0 completion | 1 arrival | 2 wake-up, seq, payload)
    wakeups: set[float] = set()
    for x in ordered:
        heapq.heappush(events, (x.request.arrival, 1, next(seq), x.request))
    loads = 0
    free_at: dict[str, float] = {}  # worker -> end of the last request released there
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, _, payload = heapq.heappop(events)
            if kind == 0:
                rec = payload
                assert isinstance(rec, Record)
                for w in rec.group:
                    dispatcher.release_worker(w, rec.request.request, rec.finish)
                if learn:
                    estimates.observe_service(
                        rec.request.deployment, rec.request.op, rec.finish - rec.start
                    )
            elif kind == 1:
                req = payload
                assert isinstance(req, Request)
                patience = dispatcher.add(req)
                records[req.request] = Record(req, len(records), patience)
            else:
                wakeups.discard(now)  # a gang's hold ends: decide again (the plugin's timer)
        for d in dispatcher.decide(now):
            rec = records[d.request.request]
            rec.request = d.request  # arrival as dispatch saw it
            model = d.request.deployment
            setup = 0.0
            for w in d.group:
                source, evicted = holders[w].use(model)
                load_s = (
                    bytes_of.get(model, 0) / cluster.bandwidths[source] if source != "hbm" else 0.0
                )
                setup = max(setup, load_s)
                for victim in evicted:
                    report(victim, w, "dram")
                report(model, w, "hbm", load_s, source)
                if source != "hbm":
                    loads += 1
                    if learn:
                        estimates.observe_load(model, source, load_s, bytes_of.get(model, 0))
            start = now
            if d.behind is not None:
                start = max([now] + [free_at.get(w, now) for w in d.group])
            rec.released, rec.start, rec.group = now, start, d.group
            rec.setup_s, rec.urgent, rec.tag = setup, d.urgent, d.tag
            rec.finish = start + setup + true_duration[d.request.request]
            for w in d.group:
                free_at[w] = rec.finish
            heapq.heappush(events, (rec.finish, 0, next(seq), rec))
        wake = dispatcher.next_wakeup(now)
        if wake is not None and wake > now and wake not in wakeups:
            wakeups.add(wake)
            heapq.heappush(events, (wake, 2, next(seq), None))
    if len(dispatcher):
        raise RuntimeError(f"{len(dispatcher)} requests never started (no live group?)")
    return SimResult(list(records.values()), loads, policy.lookahead)


# --- workloads -------------------------------------------------------------------------------


def sim_request(
    name: str,
    groups: Sequence[Group],
    t: float,
    service: float,
    model: str,
    *,
    op: str = "step",
    order: str = "",
    job: str = "",
    estimate: float | None = None,
) -> SimRequest:
    """A request of ``model`` arriving at ``t`` that runs on one of ``groups`` for
    ``service`` seconds (dispatch sees ``estimate``, default the truth); ``order`` names its
    ordering chain (default: its own)."""
    req = Request(
        request=name,
        groups=tuple(tuple(g) for g in groups),
        arrival=t,
        service_s=estimate if estimate is not None else service,
        order=order or f"{model}#{name}",
        deployment=model,
        op=op,
        job=job,
    )
    return SimRequest(req, service)


def random_workload(
    seed: int, n_workers: int = 6, n_requests: int = 150
) -> tuple[ClusterModel, list[SimRequest]]:
    """Jobs with training gangs, aimed writes and data-parallel reads over replicas, Poisson
    arrivals at about full load, log-normal true service times, estimates off by up to 2x."""
    rng = random.Random(seed)
    workers = tuple(f"w{i}" for i in range(n_workers))
    models: dict[str, tuple[Group, ...]] = {}
    for m in range(rng.randint(2, 6)):
        ranks = rng.choice([1, 1, 2]) if n_workers > 1 else 1
        replicas = 1 if ranks > 1 else rng.randint(1, min(3, n_workers))
        chosen = rng.sample(workers, ranks * replicas)
        models[f"m{m}"] = tuple(tuple(chosen[i * ranks : (i + 1) * ranks]) for i in range(replicas))
    sizes = {m: rng.randint(1, 8) * 500_000_000 for m in models}
    mean_service = {op: rng.uniform(0.2, 5.0) for op in ("sample", "train", "sync")}
    rate = n_workers / (sum(mean_service.values()) / 3) / 1.5
    out, t = [], 0.0
    for i in range(n_requests):
        t += rng.expovariate(rate)
        model = rng.choice(sorted(models))
        groups = models[model]
        op = rng.choice(["sample", "train", "sync"])
        service = rng.lognormvariate(0, 0.8) * mean_service[op]
        if op == "sample" and len(groups) > 1:
            chosen, order = groups, f"{model}#any"  # data-parallel read
        else:
            k = rng.randrange(len(groups))
            chosen, order = (groups[k],), f"{model}#{k}"
        out.append(
            sim_request(
                f"r{i}",
                chosen,
                t,
                service,
                model,
                op=op,
                order=order,
                job=f"j{i % 3}",
                estimate=service * rng.uniform(0.5, 2.0),
            )
        )
    cluster = ClusterModel(workers, sizes, hbm_models=rng.choice([1, 2]))
    return cluster, out


def gang_vs_singles(n_singles: int = 300) -> tuple[ClusterModel, list[SimRequest]]:
    """A 2-rank gang on (w0, w1) against a continuous stream of singles on each of its workers
    (different models, always resident): without reservations the two workers are never free
    at once."""
    workers = ("w0", "w1")
    out = [sim_request("gang", [("w0", "w1")], 1.0, 2.0, "trainer")]
    for i in range(n_singles):
        for w, offset in (("w0", 0.0), ("w1", 0.25)):
            out.append(sim_request(f"s{w}-{i}", [(w,)], 0.5 + offset + 0.5 * i, 0.45, f"roll-{w}"))
    return ClusterModel(workers, hbm_models=3), out


def long_vs_short_stream(n_short: int = 400) -> tuple[ClusterModel, list[SimRequest]]:
    """One long request against a continuous stream of short ones on the same worker: HRRS lets
    the short ones overtake, until the long one's patience runs out."""
    out = [sim_request("warmup", [("w0",)], 0.0, 1.0, "short")]
    out.append(sim_request("long", [("w0",)], 0.5, 20.0, "long", estimate=5.0))
    for i in range(n_short):
        out.append(sim_request(f"short{i}", [("w0",)], 0.6 + 0.25 * i, 0.2, "short"))
    return ClusterModel(("w0",), hbm_models=2), out


def flood(n_flood: int = 400, seed: int = 0) -> tuple[ClusterModel, list[SimRequest]]:
    """Job A floods the queue with requests over four models at t=0; job B submits one small
    request every 5 s; models need loads (one model per worker's HBM)."""
    rng = random.Random(seed)
    workers = ("w0", "w1", "w2", "w3")
    sizes = {f"a{i}": 2_000_000_000 for i in range(4)} | {"b": 1_000_000_000}
    out = []
    for i in range(n_flood):
        model = f"a{i % 4}"
        out.append(
            sim_request(
                f"a{i}",
                [(w,) for w in workers],
                0.0,
                rng.uniform(0.5, 3.0),
                model,
                order=f"{model}#any",
                job="A",
            )
        )
    for i in range(40):
        out.append(
            sim_request(
                f"b{i}", [(w,) for w in workers], 2.5 + 5.0 * i, 0.3, "b", order="b#any", job="B"
            )
        )
    return ClusterModel(workers, sizes, hbm_models=1), out


def burst(
    n_burst: int = 500, n_victim: int = 5, service_s: float = 0.008
) -> tuple[ClusterModel, list[SimRequest]]:
    """Job A submits a burst of ``n_burst`` training steps on its model at t=0; job B submits
    ``n_victim`` of its own on another model right after; one worker holds both in HBM (the
    fault suite's flood case, see dispatch's "Share order")."""
    out = [
        sim_request(f"a{i}", [("w0",)], 0.0, service_s, "a", order="a#0", job="A")
        for i in range(n_burst)
    ]
    out += [
        sim_request(f"b{i}", [("w0",)], 0.01, service_s, "b", order="b#0", job="B")
        for i in range(n_victim)
    ]
    return ClusterModel(("w0",), hbm_models=2, resident={"a": ("w0",), "b": ("w0",)}), out


ADVERSARIAL = {
    "gang_vs_singles": gang_vs_singles,
    "long_vs_short_stream": long_vs_short_stream,
    "flood": flood,
    "burst": burst,
}
