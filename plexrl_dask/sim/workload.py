"""The simulator's input: a cluster, a set of RL jobs, and every iteration's phase durations.

A workload is specified in YAML (``plexrl_dask/sim/workloads/*.yaml``; the format is the one
of :class:`WorkloadSpec`) and generated from it, deterministically for a seed, into
:class:`SimJob` objects whose per-iteration durations are drawn once, so every policy run on a
workload sees exactly the same jobs, arrivals and durations.

Per iteration ``i`` a job has: ``bulk[i]`` seconds of rollout on its ``r`` rollout GPUs,
``tail[i]`` seconds in which only ``tail_gpus`` replicas still generate (the long tail of
response lengths), ``train[i]`` seconds of training on its ``t`` GPUs; plus a fixed weight-sync
time (model bytes over the sync bandwidth) and a setup time when its training state must be
loaded into HBM (training-state bytes per GPU over the host-to-device bandwidth).

A model class may instead *describe its rollout* (``shape:``, ``rollout:`` and ``train_mfu:``,
with the workload's ``hardware:`` and ``lengths:``): its durations then come from the decode
model of :mod:`plexrl_dask.sim.decode`, per layout. Such a job's colocated deployment decodes
over its training data-parallel group (``train_gpus``), at the batch each GPU then holds; its
split and pooled deployments use ``rollout_gpus`` (``auto``: the size of the cheapest
split-async deployment of a median step). A class with ``tools:`` makes multi-turn rollouts: each
response is ``turns`` model turns with a tool call between two, its latency drawn from
``latency_s``; the step's critical path (its longest response) waits ``turns - 1`` of them.
During that wait a colocated or split job holds its GPUs idle; a pooled job holds none.

A job may instead *replay a recorded trace* (``replay:`` in the spec): a JSON file of recorded
iterations, in the format :func:`save_trace` writes (the live runtime's recorder uses it too),
each iteration a list of ``[kind, gpus, seconds]`` phases; iterations are replayed in order and
cycled when the job runs longer than the recording.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from plexrl_dask.errors import InvalidTrace
from plexrl_dask.policy.horizon import Phase
from plexrl_dask.sim.decode import DecodeModel, Hardware, LengthModel, ModelShape, train_seconds

WORKLOADS = Path(__file__).parent / "workloads"

#: Bytes per parameter of a training state (bf16 weights and gradients, fp32 master weights
#: and two Adam moments: 2 + 2 + 4 + 4 + 4).
TRAIN_BYTES_PER_PARAM = 16
#: Bytes per parameter of rollout weights (bf16).
WEIGHT_BYTES_PER_PARAM = 2


def number(value: object, what: str) -> float:
    """``value`` as a finite float; :class:`InvalidTrace` otherwise (a spec's YAML)."""
    if isinstance(value, bool):
        raise InvalidTrace(f"{what} is a number, got {value!r}")
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise InvalidTrace(f"{what} is a number, got {value!r}") from None
    if not math.isfinite(out):
        raise InvalidTrace(f"{what} must be finite, got {value!r}")
    return out


def integer(value: object, what: str) -> int:
    """``value`` as an int (a float only if whole); :class:`InvalidTrace` otherwise."""
    out = number(value, what)
    if not out.is_integer():
        raise InvalidTrace(f"{what} is a whole number, got {value!r}")
    return int(out)


@dataclass(frozen=True)
class ClusterSpec:
    """Hardware of the simulated cluster."""

    gpus: int
    gpus_per_node: int = 8
    hbm_park_gb: float = 40.0  # HBM per GPU that may hold parked training states
    h2d_gbps: float = 25.0  # host (pinned DRAM) to GPU, per GPU
    sync_gbps: float = 50.0  # weight sync (trainer to rollout replicas), per job
    # Host DRAM per GPU that holds offloaded training states (None: unbounded, every state
    # fits); states beyond it go to NVMe, least recently used first.
    dram_gb_per_gpu: float | None = None
    nvme_gbps: float = 12.0  # NVMe read bandwidth per node (shared by its GPUs)

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            object.__setattr__(self, name, integer(getattr(self, name), f"cluster.{name}"))
        for name in ("hbm_park_gb", "h2d_gbps", "sync_gbps", "nvme_gbps"):
            object.__setattr__(self, name, number(getattr(self, name), f"cluster.{name}"))
        if self.dram_gb_per_gpu is not None:
            dram = number(self.dram_gb_per_gpu, "cluster.dram_gb_per_gpu")
            object.__setattr__(self, "dram_gb_per_gpu", dram)
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % self.gpus_per_node:
            raise InvalidTrace(
                f"gpus ({self.gpus}) must be a positive multiple of gpus_per_node "
                f"({self.gpus_per_node})"
            )
        if min(self.hbm_park_gb, self.h2d_gbps, self.sync_gbps, self.nvme_gbps) <= 0:
            raise InvalidTrace("hbm_park_gb, h2d_gbps, sync_gbps and nvme_gbps must be > 0")
        if self.dram_gb_per_gpu is not None and self.dram_gb_per_gpu < 0:
            raise InvalidTrace(f"dram_gb_per_gpu must be >= 0, got {self.dram_gb_per_gpu}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


@dataclass(frozen=True)
class Dist:
    """A duration distribution: lognormal (``median``, ``sigma``) or uniform (``low``,
    ``high``); ``fixed`` for a constant."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, d: dict | float | int) -> Dist:
        if isinstance(d, int | float) and not isinstance(d, bool):
            return cls("fixed", number(d, "a duration")).checked(d)
        try:
            kind = d["dist"]
            if kind == "lognormal":
                out = cls(kind, number(d["median"], "median"), number(d["sigma"], "sigma"))
            elif kind == "uniform":
                out = cls(kind, number(d["low"], "low"), number(d["high"], "high"))
            elif kind == "fixed":
                out = cls(kind, number(d["value"], "value"))
            else:
                raise InvalidTrace(f"unknown distribution {kind!r} (lognormal, uniform, fixed)")
        except (KeyError, TypeError) as e:
            raise InvalidTrace(f"bad distribution {d!r}: missing {e}") from e
        return out.checked(d)

    def checked(self, given: object) -> Dist:
        """``self`` if its parameters are >= 0 (a uniform's low <= high)."""
        if self.a < 0 or self.b < 0 or (self.kind == "uniform" and self.b < self.a):
            raise InvalidTrace(f"bad distribution parameters {given!r}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "lognormal":
            return self.a * np.exp(self.b * rng.standard_normal(n))
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        return np.full(n, self.a)

    def scaled(self, factor: float) -> Dist:
        """The same distribution with every value times ``factor`` (a lognormal's median, a
        uniform's bounds, a constant): each sample drawn from the same generator state is the
        original sample times ``factor``."""
        if not factor > 0:
            raise InvalidTrace(f"a distribution's scale factor must be > 0, got {factor}")
        b = self.b if self.kind == "lognormal" else self.b * factor
        return Dist(self.kind, self.a * factor, b)

    def mean(self) -> float:
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a


@dataclass(frozen=True)
class ModelClass:
    """One kind of job of the mix: its model, GPUs and duration distributions."""

    name: str
    params_b: float
    weight: float
    rollout_gpus: int
    train_gpus: int
    bulk_s: Dist
    tail_s: Dist
    train_s: Dist
    tail_gpu_fraction: float = 0.25
    replay: str | None = None  # path of a recorded trace, relative to the spec file
    rollout: RolloutSpec | None = None  # described rollout (decode model) instead of bulk_s
    tools: ToolSpec | None = None  # multi-turn rollouts with tool calls


@dataclass(frozen=True)
class RolloutSpec:
    """A rollout described for the decode model: the model's shape, the rollout's
    tensor-parallel degree, responses per step, training MFU, and (optionally) the lengths of
    this class when they differ from the workload's."""

    shape: ModelShape
    tp: int
    responses: int
    train_mfu: float
    lengths: LengthModel | None = None

    @classmethod
    def parse(cls, m: dict, params_b: float) -> RolloutSpec:
        r = m["rollout"]
        lengths = LengthModel(**r["lengths"]) if "lengths" in r else None
        spec = cls(ModelShape.from_dict(m["shape"], params_b), integer(r["tp"], "rollout.tp"),
                   integer(r["responses"], "rollout.responses"),
                   number(m["train_mfu"], "train_mfu"), lengths)  # fmt: skip
        if spec.tp < 1 or spec.responses < 1 or not 0 < spec.train_mfu <= 1:
            raise InvalidTrace(f"rollout {r!r}: tp >= 1, responses >= 1, train_mfu in (0, 1]")
        return spec


@dataclass(frozen=True)
class ToolSpec:
    """Multi-turn rollouts: ``turns`` model turns per response, a tool call between two."""

    turns: int
    latency_s: Dist

    @classmethod
    def parse(cls, d: dict) -> ToolSpec:
        spec = cls(integer(d["turns"], "tools.turns"), Dist.parse(d["latency_s"]))
        if spec.turns < 1:
            raise InvalidTrace(f"tools: turns must be >= 1, got {spec.turns}")
        return spec


@dataclass(frozen=True)
class SimJob:
    """One job of a generated workload, with all of its iterations' durations."""

    name: str
    model: str
    arrival_s: float
    rollout_gpus: int
    train_gpus: int
    tail_gpus: int
    bulk: np.ndarray = field(repr=False)
    tail: np.ndarray = field(repr=False)
    train: np.ndarray = field(repr=False)
    sync_s: float = 0.0
    train_bytes_per_gpu: float = 0.0
    # colocated: GPUs (0: max(r, t)) and rollout seconds there (None: bulk * r / g + tail)
    coloc_gpus: int = 0
    coloc_rollout: np.ndarray | None = field(default=None, repr=False)
    stall: np.ndarray | None = field(default=None, repr=False)  # tool waits, critical path

    @property
    def iterations(self) -> int:
        return len(self.bulk)

    @property
    def colocated_gpus(self) -> int:
        return self.coloc_gpus or max(self.rollout_gpus, self.train_gpus)

    def stall_s(self, i: int) -> float:
        return 0.0 if self.stall is None else float(self.stall[i])

    def rollout_s(self, i: int) -> float:
        """The rollout phase of iteration ``i`` (:meth:`iteration_phases`): sync + bulk."""
        return self.sync_s + float(self.bulk[i])

    def train_s(self, i: int) -> float:
        """The train phase of iteration ``i`` (:meth:`iteration_phases`)."""
        return float(self.train[i])

    def iteration_phases(self, i: int) -> tuple[Phase, ...]:
        """Iteration ``i`` as a multiplexed (on-policy) run holds GPUs: the weight sync and the
        bulk of rollout on ``r`` GPUs, the tail on ``tail_gpus``, the tool waits of its
        critical path on none (a ``gap``, agentic jobs only), training on ``t``."""
        gap = () if self.stall is None else (Phase("gap", 0, float(self.stall[i])),)
        return (
            Phase("rollout", self.rollout_gpus, self.rollout_s(i)),
            Phase("tail", self.tail_gpus, float(self.tail[i])),
            *gap,
            Phase("train", self.train_gpus, self.train_s(i)),
        )


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload as committed in YAML: cluster, job mix, iterations, arrivals.

    ``offered_load``: arrivals offer that many GPU-seconds per cluster GPU-second, each job
    counted at its ``arrival_basis`` cost: ``split-async`` (its split-async isolated cost, the
    default) or ``cheapest-isolated`` (its cheapest isolated mode: the most any isolated
    baseline sustains is ``offered_load = 1``, perfectly packed)."""

    name: str
    cluster: ClusterSpec
    models: tuple[ModelClass, ...]
    jobs: int
    iterations: Dist
    offered_load: float
    arrival: str = "poisson"
    base: Path | None = None  # directory replay paths are relative to
    arrival_basis: str = "split-async"
    hardware: Hardware | None = None  # for described rollouts
    lengths: LengthModel | None = None  # response lengths of described rollouts

    @classmethod
    def load(cls, path: str | Path) -> WorkloadSpec:
        path = Path(path)
        if not path.exists() and (WORKLOADS / f"{path}.yaml").exists():
            path = WORKLOADS / f"{path}.yaml"
        if not path.exists():
            raise InvalidTrace(
                f"no workload {str(path)!r}; built in: "
                f"{sorted(p.stem for p in WORKLOADS.glob('*.yaml') if p.stem != 'decode-measurements')}"
            )
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise InvalidTrace(f"cannot read the workload {str(path)!r}: {e}") from e
        return cls.from_dict(raw, base=path.parent)

    @classmethod
    def from_dict(cls, d: dict, base: Path | None = None) -> WorkloadSpec:
        try:
            hardware = Hardware.from_dict(d["hardware"]) if "hardware" in d else None
            lengths = LengthModel(**d["lengths"]) if "lengths" in d else None
            cluster = ClusterSpec(**d["cluster"])
            models = tuple(_model_class(m, hardware, lengths, cluster) for m in d["models"])
            spec = cls(
                name=str(d["name"]),
                cluster=cluster,
                models=models,
                jobs=integer(d["jobs"], "jobs"),
                iterations=Dist.parse(d["iterations"]),
                offered_load=number(d["arrival"]["offered_load"], "arrival.offered_load"),
                arrival=str(d["arrival"].get("process", "poisson")),
                base=base,
                arrival_basis=str(d["arrival"].get("basis", "split-async")),
                hardware=hardware,
                lengths=lengths,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            if isinstance(e, InvalidTrace):
                raise
            raise InvalidTrace(f"workload spec lacks or mistypes {e}") from e
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.jobs < 1 or not self.offered_load > 0 or not self.models:
            raise InvalidTrace("a workload needs jobs >= 1, offered_load > 0 and models")
        if self.arrival not in ("poisson", "batch"):
            raise InvalidTrace(f"arrival process {self.arrival!r}: poisson or batch")
        if self.arrival_basis not in ("split-async", "cheapest-isolated"):
            raise InvalidTrace(
                f"arrival basis {self.arrival_basis!r}: split-async or cheapest-isolated"
            )
        for m in self.models:
            need = m.rollout_gpus + m.train_gpus
            if m.weight <= 0 or m.rollout_gpus < 1 or m.train_gpus < 1 or m.params_b <= 0:
                raise InvalidTrace(
                    f"model {m.name}: weight, params_b, rollout_gpus, train_gpus > 0"
                )
            if need > self.cluster.gpus:
                raise InvalidTrace(
                    f"model {m.name} needs {need} GPUs, more than the cluster's {self.cluster.gpus}"
                )
            if not 0 < m.tail_gpu_fraction <= 1:
                raise InvalidTrace(f"model {m.name}: tail_gpu_fraction in (0, 1]")

    def scaled(self, gpus: int, jobs: int | None = None) -> WorkloadSpec:
        """The same mix on ``gpus`` GPUs (job classes that no longer fit are dropped)."""
        if gpus < 1:
            raise InvalidTrace(f"a cluster needs gpus >= 1, got {gpus}")
        cluster = ClusterSpec(**{**self.cluster.__dict__, "gpus": gpus})
        models = tuple(m for m in self.models if m.rollout_gpus + m.train_gpus <= gpus)
        if not models:
            raise InvalidTrace(
                f"no job class of workload {self.name!r} fits {gpus} GPUs (the smallest needs "
                f"{min(m.rollout_gpus + m.train_gpus for m in self.models)})"
            )
        return replace(
            self, cluster=cluster, models=models, jobs=self.jobs if jobs is None else jobs
        ).validated()

    def batch(self) -> WorkloadSpec:
        """The same jobs, all submitted at time 0."""
        return replace(self, arrival="batch")

    def with_load(self, offered_load: float) -> WorkloadSpec:
        """The same jobs, arriving to offer ``offered_load`` times the cluster's capacity."""
        return replace(self, offered_load=offered_load).validated()

    def with_tool_latency(self, factor: float) -> WorkloadSpec:
        """The same workload with every tool call's latency ``factor`` times the committed
        one (:meth:`Dist.scaled`): the generated jobs are the same draws, their tool waits
        times ``factor``; arrivals still offer ``offered_load`` at the jobs' new costs."""
        models = tuple(
            m if m.tools is None
            else replace(m, tools=replace(m.tools, latency_s=m.tools.latency_s.scaled(factor)))
            for m in self.models
        )  # fmt: skip
        return replace(self, models=models).validated()

    def validated(self) -> WorkloadSpec:
        """``self``, after :meth:`validate`."""
        self.validate()
        return self


def _model_class(
    m: dict, hardware: Hardware | None, lengths: LengthModel | None, cluster: ClusterSpec
) -> ModelClass:
    """One ``models:`` entry; a described rollout's ``rollout_gpus: auto`` is resolved here."""
    params_b = number(m["params_b"], f"model {m.get('name')}: params_b")
    rollout = RolloutSpec.parse(m, params_b) if "rollout" in m else None
    rollout_gpus = m["rollout_gpus"]
    if rollout is not None:
        if hardware is None or (lengths is None and rollout.lengths is None):
            raise InvalidTrace(f"model {m['name']}: a described rollout needs hardware: and "
                               "lengths: in the workload")  # fmt: skip
        if rollout_gpus == "auto":
            rollout_gpus = _split_gpus(rollout, hardware, rollout.lengths or lengths,
                                       integer(m["train_gpus"], "train_gpus"), params_b,
                                       cluster)  # fmt: skip
        if integer(m["train_gpus"], "train_gpus") % rollout.tp or (
            integer(rollout_gpus, "rollout_gpus") % rollout.tp
        ):
            raise InvalidTrace(f"model {m['name']}: rollout_gpus and train_gpus must be "
                               f"multiples of the rollout's tp ({rollout.tp})")  # fmt: skip
    elif rollout_gpus == "auto":
        raise InvalidTrace(f"model {m['name']}: rollout_gpus: auto needs a described rollout")
    return ModelClass(
        name=str(m["name"]),
        params_b=params_b,
        weight=number(m["weight"], f"model {m['name']}: weight"),
        rollout_gpus=integer(rollout_gpus, f"model {m['name']}: rollout_gpus"),
        train_gpus=integer(m["train_gpus"], f"model {m['name']}: train_gpus"),
        bulk_s=Dist.parse(m.get("rollout_bulk_s", 0.0)),
        tail_s=Dist.parse(m.get("rollout_tail_s", 0.0)),
        train_s=Dist.parse(m.get("train_s", 0.0)),
        tail_gpu_fraction=number(m.get("tail_gpu_fraction", 0.25), "tail_gpu_fraction"),
        replay=m.get("replay"),
        rollout=rollout,
        tools=ToolSpec.parse(m["tools"]) if "tools" in m else None,
    )


def _split_gpus(r: RolloutSpec, hw: Hardware, lengths: LengthModel, train_gpus: int,
                params_b: float, cluster: ClusterSpec) -> int:  # fmt: skip
    """``rollout_gpus: auto``: the cheapest split-async rollout size of a median step."""
    model = DecodeModel(hw, r.shape, lengths, r.tp)
    tokens = r.responses * (lengths.prompt_tokens + lengths.mean(np.ones(1)))
    train = float(train_seconds(r.shape, hw, train_gpus, tokens, r.train_mfu)[0])
    sync = params_b * 1e9 * WEIGHT_BYTES_PER_PARAM / (cluster.sync_gbps * 1e9)
    return model.split_gpus(r.responses, train, sync, train_gpus, cluster.gpus - train_gpus)


def generate(spec: WorkloadSpec, seed: int = 0) -> list[SimJob]:
    """The jobs of ``spec`` for ``seed``: same seed, same jobs (durations drawn here once).

    Arrivals: a Poisson process (or all at 0 for ``batch``) whose rate offers
    ``offered_load`` times the cluster's GPU-seconds, each job counted at its
    ``arrival_basis`` cost (:class:`WorkloadSpec`). The jobs' durations do not depend on the
    load: they are drawn once per (spec, seed) and reused (a capacity search generates the
    same jobs at many loads)."""
    jobs, order_rng_state = _drawn(replace(spec, offered_load=1.0, arrival="batch"), seed)
    if spec.arrival == "batch":
        return list(jobs)
    from plexrl_dask.sim.isolated import isolated_run  # the cost offered

    mode = "split-async" if spec.arrival_basis == "split-async" else "best"
    offered = sum(isolated_run(j, mode, spec.cluster).gpu_seconds for j in jobs)
    rate = spec.offered_load * spec.cluster.gpus / (offered / len(jobs))
    rng = np.random.default_rng(seed)
    rng.bit_generator.state = order_rng_state
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(jobs)))
    arrivals -= arrivals[0]
    return [_with_arrival(j, float(a)) for j, a in zip(jobs, arrivals, strict=True)]


@lru_cache(maxsize=16)
def _drawn(spec: WorkloadSpec, seed: int) -> tuple[tuple[SimJob, ...], dict]:
    """The jobs of ``spec`` at time 0, and the state of the seed's generator after drawing
    them (arrivals are drawn from there, as they always were)."""
    rng = np.random.default_rng(seed)
    weights = np.array([m.weight for m in spec.models])
    kinds = rng.choice(len(spec.models), size=spec.jobs, p=weights / weights.sum())
    counts = np.maximum(1, np.round(spec.iterations.sample(rng, spec.jobs))).astype(int)
    jobs: list[SimJob] = []
    for i, (k, n) in enumerate(zip(kinds, counts, strict=True)):
        m = spec.models[int(k)]
        jrng = np.random.default_rng([seed, i])
        extra: dict = {}
        if m.replay:
            bulk, tail, train = _replayed(spec, m, int(n))
        elif m.rollout is not None:
            bulk, tail, train, extra = _described(spec, m, int(n), jrng)
        else:
            bulk = m.bulk_s.sample(jrng, int(n))
            tail = m.tail_s.sample(jrng, int(n))
            train = m.train_s.sample(jrng, int(n))
        if m.tools is not None and m.tools.turns > 1:
            calls = m.tools.latency_s.sample(jrng, int(n) * (m.tools.turns - 1))
            extra["stall"] = calls.reshape(int(n), m.tools.turns - 1).sum(1)
        params = m.params_b * 1e9
        jobs.append(
            SimJob(
                name=f"job{i:04d}-{m.name}",
                model=m.name,
                arrival_s=0.0,
                rollout_gpus=m.rollout_gpus,
                train_gpus=m.train_gpus,
                tail_gpus=max(1, math.ceil(m.rollout_gpus * m.tail_gpu_fraction)),
                bulk=bulk,
                tail=tail,
                train=train,
                sync_s=params * WEIGHT_BYTES_PER_PARAM / (spec.cluster.sync_gbps * 1e9),
                train_bytes_per_gpu=params * TRAIN_BYTES_PER_PARAM / m.train_gpus,
                **extra,
            )
        )
    return tuple(jobs), rng.bit_generator.state


def _described(
    spec: WorkloadSpec, m: ModelClass, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Durations of a described rollout (:mod:`plexrl_dask.sim.decode`): bulk and tail of the
    pooled layout on ``rollout_gpus``, training on ``train_gpus``, and the colocated rollout
    on the training group."""
    r = m.rollout
    assert r is not None and spec.hardware is not None
    lengths = r.lengths or spec.lengths
    assert lengths is not None
    model = DecodeModel(spec.hardware, r.shape, lengths, r.tp)
    scale = np.exp(lengths.iteration_sigma * rng.standard_normal(n))
    longest = lengths.longest(scale, rng.uniform(size=n), r.responses)
    pooled = model.rollout(m.rollout_gpus, r.responses, scale, longest, m.tail_gpu_fraction)
    coloc = model.rollout(m.train_gpus, r.responses, scale, longest, m.tail_gpu_fraction)
    tokens = r.responses * lengths.prompt_tokens + pooled.tokens
    train = train_seconds(r.shape, spec.hardware, m.train_gpus, tokens, r.train_mfu)
    extra = {"coloc_gpus": m.train_gpus, "coloc_rollout": coloc.total_s}
    return pooled.bulk_s, pooled.tail_s, train, extra


def _with_arrival(job: SimJob, arrival: float) -> SimJob:
    return SimJob(**{**job.__dict__, "arrival_s": arrival})


def _replayed(spec: WorkloadSpec, m: ModelClass, n: int) -> tuple[np.ndarray, ...]:
    assert m.replay is not None
    path = Path(m.replay) if spec.base is None else spec.base / m.replay
    its = load_trace(path)
    idx = np.arange(n) % len(its)
    out = []
    for kind in ("rollout", "tail", "train"):
        col = [sum(p.duration_s for p in it if p.kind == kind) for it in its]
        out.append(np.array(col)[idx])
    return tuple(out)


def save_trace(path: str | Path, iterations: Sequence[Sequence[Phase]], meta: dict) -> None:
    """Write recorded iterations in the replay format (JSON: ``meta`` and ``iterations``)."""
    data = {
        "meta": meta,
        "iterations": [[[p.kind, p.gpus, p.duration_s] for p in it] for it in iterations],
    }
    Path(path).write_text(json.dumps(data, indent=1))


def load_trace(path: str | Path) -> list[tuple[Phase, ...]]:
    """Recorded iterations from a file :func:`save_trace` wrote."""
    try:
        data = json.loads(Path(path).read_text())
        its = [
            tuple(
                Phase(str(k), integer(g, "a phase's gpus"), number(s, "a phase's seconds"))
                for k, g, s in it
            )
            for it in data["iterations"]
        ]
    except FileNotFoundError as e:
        raise InvalidTrace(f"no recorded trace at {path}") from e
    except InvalidTrace as e:
        raise InvalidTrace(f"{path} is not a recorded trace ({e})") from e
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError, OSError) as e:
        raise InvalidTrace(f"{path} is not a recorded trace ({e!r})") from e
    if not its or not all(its):
        raise InvalidTrace(f"{path} records no iterations, or an iteration of no phase")
    return its
