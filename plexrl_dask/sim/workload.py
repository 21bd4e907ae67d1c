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

A job may instead *replay a recorded trace* (``replay:`` in the spec): a JSON file of recorded
iterations, in the format :func:`save_trace` writes (the live runtime's recorder uses it too),
each iteration a list of ``[kind, gpus, seconds]`` phases; iterations are replayed in order and
cycled when the job runs longer than the recording.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from plexrl_dask.errors import InvalidTrace
from plexrl_dask.policy.horizon import Phase

WORKLOADS = Path(__file__).parent / "workloads"

#: Bytes per parameter of a training state (bf16 weights and gradients, fp32 master weights
#: and two Adam moments: 2 + 2 + 4 + 4 + 4).
TRAIN_BYTES_PER_PARAM = 16
#: Bytes per parameter of rollout weights (bf16).
WEIGHT_BYTES_PER_PARAM = 2


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
        if isinstance(d, int | float):
            return cls("fixed", float(d))
        try:
            kind = d["dist"]
            if kind == "lognormal":
                out = cls(kind, float(d["median"]), float(d["sigma"]))
            elif kind == "uniform":
                out = cls(kind, float(d["low"]), float(d["high"]))
            elif kind == "fixed":
                out = cls(kind, float(d["value"]))
            else:
                raise InvalidTrace(f"unknown distribution {kind!r} (lognormal, uniform, fixed)")
        except (KeyError, TypeError) as e:
            raise InvalidTrace(f"bad distribution {d!r}: missing {e}") from e
        if out.a < 0 or out.b < 0 or (kind == "uniform" and out.b < out.a):
            raise InvalidTrace(f"bad distribution parameters {d!r}")
        return out

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "lognormal":
            return self.a * np.exp(self.b * rng.standard_normal(n))
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        return np.full(n, self.a)

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

    @property
    def iterations(self) -> int:
        return len(self.bulk)

    def iteration_phases(self, i: int) -> tuple[Phase, ...]:
        """Iteration ``i`` as a multiplexed (on-policy) run holds GPUs: the weight sync and the
        bulk of rollout on ``r`` GPUs, the tail on ``tail_gpus``, training on ``t``."""
        return (
            Phase("rollout", self.rollout_gpus, self.sync_s + float(self.bulk[i])),
            Phase("tail", self.tail_gpus, float(self.tail[i])),
            Phase("train", self.train_gpus, float(self.train[i])),
        )


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload as committed in YAML: cluster, job mix, iterations, arrivals."""

    name: str
    cluster: ClusterSpec
    models: tuple[ModelClass, ...]
    jobs: int
    iterations: Dist
    offered_load: float  # arrivals: isolated GPU-seconds offered per cluster GPU-second
    arrival: str = "poisson"
    base: Path | None = None  # directory replay paths are relative to

    @classmethod
    def load(cls, path: str | Path) -> WorkloadSpec:
        path = Path(path)
        if not path.exists() and (WORKLOADS / f"{path}.yaml").exists():
            path = WORKLOADS / f"{path}.yaml"
        if not path.exists():
            raise InvalidTrace(
                f"no workload {str(path)!r}; built in: "
                f"{sorted(p.stem for p in WORKLOADS.glob('*.yaml'))}"
            )
        return cls.from_dict(yaml.safe_load(path.read_text()), base=path.parent)

    @classmethod
    def from_dict(cls, d: dict, base: Path | None = None) -> WorkloadSpec:
        try:
            models = tuple(
                ModelClass(
                    name=str(m["name"]),
                    params_b=float(m["params_b"]),
                    weight=float(m["weight"]),
                    rollout_gpus=int(m["rollout_gpus"]),
                    train_gpus=int(m["train_gpus"]),
                    bulk_s=Dist.parse(m.get("rollout_bulk_s", 0.0)),
                    tail_s=Dist.parse(m.get("rollout_tail_s", 0.0)),
                    train_s=Dist.parse(m.get("train_s", 0.0)),
                    tail_gpu_fraction=float(m.get("tail_gpu_fraction", 0.25)),
                    replay=m.get("replay"),
                )
                for m in d["models"]
            )
            spec = cls(
                name=str(d["name"]),
                cluster=ClusterSpec(**d["cluster"]),
                models=models,
                jobs=int(d["jobs"]),
                iterations=Dist.parse(d["iterations"]),
                offered_load=float(d["arrival"]["offered_load"]),
                arrival=str(d["arrival"].get("process", "poisson")),
                base=base,
            )
        except (KeyError, TypeError) as e:
            raise InvalidTrace(f"workload spec lacks or mistypes {e}") from e
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.jobs < 1 or not self.offered_load > 0 or not self.models:
            raise InvalidTrace("a workload needs jobs >= 1, offered_load > 0 and models")
        if self.arrival not in ("poisson", "batch"):
            raise InvalidTrace(f"arrival process {self.arrival!r}: poisson or batch")
        for m in self.models:
            need = m.rollout_gpus + m.train_gpus
            if m.weight <= 0 or m.rollout_gpus < 1 or m.train_gpus < 1:
                raise InvalidTrace(f"model {m.name}: weight, rollout_gpus, train_gpus > 0")
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
        return WorkloadSpec(
            self.name, cluster, models, self.jobs if jobs is None else jobs, self.iterations,
            self.offered_load, self.arrival, self.base,
        ).validated()  # fmt: skip

    def batch(self) -> WorkloadSpec:
        """The same jobs, all submitted at time 0."""
        return WorkloadSpec(
            self.name, self.cluster, self.models, self.jobs, self.iterations,
            self.offered_load, "batch", self.base,
        )  # fmt: skip

    def with_load(self, offered_load: float) -> WorkloadSpec:
        """The same jobs, arriving to offer ``offered_load`` times the cluster's capacity."""
        return WorkloadSpec(
            self.name, self.cluster, self.models, self.jobs, self.iterations,
            offered_load, self.arrival, self.base,
        ).validated()  # fmt: skip

    def validated(self) -> WorkloadSpec:
        """``self``, after :meth:`validate`."""
        self.validate()
        return self


def generate(spec: WorkloadSpec, seed: int = 0) -> list[SimJob]:
    """The jobs of ``spec`` for ``seed``: same seed, same jobs (durations drawn here once).

    Arrivals: a Poisson process (or all at 0 for ``batch``) whose rate offers
    ``offered_load`` times the cluster's GPU-seconds, counting each job at its split-async
    isolated cost (``(r + t)`` GPUs for its isolated duration)."""
    rng = np.random.default_rng(seed)
    weights = np.array([m.weight for m in spec.models])
    kinds = rng.choice(len(spec.models), size=spec.jobs, p=weights / weights.sum())
    counts = np.maximum(1, np.round(spec.iterations.sample(rng, spec.jobs))).astype(int)
    jobs: list[SimJob] = []
    for i, (k, n) in enumerate(zip(kinds, counts, strict=True)):
        m = spec.models[int(k)]
        jrng = np.random.default_rng([seed, i])
        if m.replay:
            bulk, tail, train = _replayed(spec, m, int(n))
        else:
            bulk = m.bulk_s.sample(jrng, int(n))
            tail = m.tail_s.sample(jrng, int(n))
            train = m.train_s.sample(jrng, int(n))
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
            )
        )
    if spec.arrival == "batch":
        return jobs
    from plexrl_dask.sim.isolated import isolated_run  # the split-async cost offered

    offered = sum(isolated_run(j, "split-async", spec.cluster).gpu_seconds for j in jobs)
    rate = spec.offered_load * spec.cluster.gpus / (offered / len(jobs))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(jobs)))
    arrivals -= arrivals[0]
    return [_with_arrival(j, float(a)) for j, a in zip(jobs, arrivals, strict=True)]


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
            tuple(Phase(str(k), int(g), float(s)) for k, g, s in it) for it in data["iterations"]
        ]
    except FileNotFoundError as e:
        raise InvalidTrace(f"no recorded trace at {path}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidTrace(f"{path} is not a recorded trace ({e!r})") from e
    if not its:
        raise InvalidTrace(f"{path} records no iterations")
    return its
