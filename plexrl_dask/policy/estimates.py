"""Estimates the dispatch rule needs: service time per (deployment, op) and setup time per tier.

Both are learned from what the cluster reports, as exponentially weighted moving averages that
start from documented priors (``plexrl.scheduler.*``):

- **service**: the wall time from release to completion of each request (the plugin observes
  it), per (deployment, op). For a (deployment, op) not yet observed, the first of: its
  deployment's bytes times the seconds per byte learned for that op over every deployment (an
  op's time grows with the model it runs); the deployment's other ops (their running mean:
  one job's steps are of one size); its bytes at the seconds per byte of every op; the prior
  ``service-prior`` (1 s: a tiny model's step on a CPU worker). A flat prior made a new job's
  first request of each op look long beside the learned times of the jobs already running:
  short requests overtook it by response ratio for about a second each
  (``benchmarks/RESULTS.md``, bench.agentic).
- **setup**: making a deployment resident in HBM on a worker costs a load from the tier it is
  in there. Each residency report of a transition into HBM carries its measured ``load_s`` and
  the tier it came from (``source``): ``dram`` (a reload of offloaded state), ``nvme`` (a read
  from the node's disk tier) or ``absent`` (a cold build or a read of a canonical version).
  The learned value is per (deployment, tier); for a deployment not yet observed in a tier, the
  bytes over that tier's learned bandwidth (all deployments' loads from it); before any load
  from a tier is seen, the bytes over its prior bandwidth ``load-bandwidth-priors``. These are
  order-of-magnitude guesses, not measurements (no GPU was available to measure them; learning
  replaces them after the first loads): DRAM 10 GB/s, below PCIe 4/5's nominal host-to-device
  rates; NVMe 2 GB/s, one local SSD; absent 0.5 GB/s, building a model and initialising or
  reading its weights. A deployment in HBM costs nothing. A weights-only engine's loads (a
  vLLM replica's start and wake, whose budget holds a KV cache that a wake allocates rather
  than copies) are learned as its own times only, never as a tier's bandwidth; before its
  first load from a tier, its estimate is its whole budget over that tier's bandwidth (an
  overestimate of a wake: the weights are what is copied).

:class:`SetupCosts` puts them together with the residency map into the :class:`Costs` the
dispatcher asks (:mod:`plexrl_dask.policy.dispatch`); the live plugin and the simulators use it
alike (:class:`NoCosts`: everything resident everywhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from plexrl_dask.policy.residency import TIERS, ResidencyMap

#: Tiers a load can come from (a load is a transition into HBM).
LOAD_SOURCES = TIERS[1:]

#: Prior load bandwidths (bytes/s) per source tier; see the module docstring.
DEFAULT_LOAD_BANDWIDTHS: Mapping[str, float] = {"dram": 10e9, "nvme": 2e9, "absent": 0.5e9}


@dataclass
class Estimates:
    """EWMA estimates with priors (see the module docstring)."""

    service_prior_s: float = 1.0
    load_bandwidths: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_LOAD_BANDWIDTHS)
    )
    weight: float = 0.3  # of each new observation
    _service: dict[tuple[str, str], float] = field(default_factory=dict)
    _load: dict[tuple[str, str], float] = field(default_factory=dict)
    _bandwidth: dict[str, float] = field(default_factory=dict)
    _rate: dict[str, float] = field(default_factory=dict)  # op ('' for any) -> s per byte
    _of_deployment: dict[str, float] = field(default_factory=dict)  # any of its ops
    #: Bumped by every change to a setup estimate (what cached setup costs check).
    setup_stamp: int = 0

    def __post_init__(self) -> None:
        missing = set(LOAD_SOURCES) - set(self.load_bandwidths)
        if missing or not all(0 < v < float("inf") for v in self.load_bandwidths.values()):
            raise ValueError(
                f"load bandwidth priors must be > 0 for {LOAD_SOURCES}: {dict(self.load_bandwidths)}"
            )
        if not 0 < self.service_prior_s < float("inf") or not 0 < self.weight <= 1:
            raise ValueError(f"need service_prior_s > 0 and 0 < weight <= 1: {self}")

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new

    def observe_service(self, deployment: str, op: str, seconds: float, nbytes: int = 0) -> None:
        """A request of ``op`` on ``deployment`` (``nbytes`` per worker; 0: unknown) took
        ``seconds`` from release to completion (a non-finite one is no observation)."""
        if not math.isfinite(seconds):
            return
        seconds = max(seconds, 1e-6)
        key = (deployment, op)
        self._service[key] = self._blend(self._service.get(key), seconds)
        self._of_deployment[deployment] = self._blend(self._of_deployment.get(deployment), seconds)
        if nbytes > 0:
            for k in (op, ""):
                self._rate[k] = self._blend(self._rate.get(k), seconds / nbytes)

    def observe_load(self, deployment: str, source: str, seconds: float, nbytes: int = 0) -> None:
        """A measured load of ``deployment`` (``nbytes``) from tier ``source`` into HBM."""
        if source not in LOAD_SOURCES or not 0 < seconds < math.inf:
            return  # a regroup of resident state, or an unknown origin: not a tier's load
        key = (deployment, source)
        self.setup_stamp += 1
        self._load[key] = self._blend(self._load.get(key), seconds)
        if nbytes > 0:
            self._bandwidth[source] = self._blend(self._bandwidth.get(source), nbytes / seconds)

    def service(self, deployment: str, op: str, nbytes: int = 0) -> float:
        """Expected seconds of a request of ``op`` on ``deployment`` (``nbytes`` per worker,
        for the estimate of a pair not yet observed; see the module docstring)."""
        learned = self._service.get((deployment, op))
        if learned is not None:
            return learned
        if nbytes > 0 and op in self._rate:
            return nbytes * self._rate[op]
        if deployment in self._of_deployment:
            return self._of_deployment[deployment]
        if nbytes > 0 and "" in self._rate:
            return nbytes * self._rate[""]
        return self.service_prior_s

    def setup(self, deployment: str, tier: str, nbytes: int) -> float:
        """Time to make ``deployment`` (``nbytes``) resident in HBM from ``tier``."""
        if tier == "hbm":
            return 0.0
        learned = self._load.get((deployment, tier))
        if learned is not None:
            return learned
        bandwidth = self._bandwidth.get(tier) or self.load_bandwidths[tier]
        return nbytes / bandwidth

    def forget(self, deployment: str) -> None:
        self.setup_stamp += 1
        self._of_deployment.pop(deployment, None)
        for table in (self._load, self._service):
            for key in [k for k in table if k[0] == deployment]:
                del table[key]


class Costs(Protocol):
    """What dispatch needs to know about residency."""

    def setup_s(self, deployment: str, group: tuple[str, ...]) -> float:
        """Estimated time to make ``deployment`` resident on every worker of ``group``."""
        ...

    def crowding(self, worker: str) -> int:
        """How many deployments ``worker`` holds in HBM (for spreading)."""
        ...


class NoCosts:
    """Everything resident everywhere (no setup)."""

    def setup_s(self, deployment: str, group: tuple[str, ...]) -> float:
        return 0.0

    def crowding(self, worker: str) -> int:
        return 0


class SetupCosts:
    """Setup cost of a deployment on a group of workers, from residency and estimates.

    ``bytes_of(deployment)`` gives a deployment's bytes per worker (0 if unknown). A group's
    setup is its slowest worker's (the ranks load in parallel and start together). With
    ``budget_of(worker)`` (HBM bytes; 0 if unknown), a load that does not fit beside what the
    worker holds in HBM also costs what it displaces: the estimated reload of the residents it
    would push out (largest first, a stand-in for the holder's LRU order, which the scheduler
    does not see), because those come back later at that price.

    Costs are cached per (deployment, worker) and recomputed when the worker's residency
    (:meth:`ResidencyMap.stamp`), the setup estimates (``Estimates.setup_stamp``), the
    deployment's bytes or the worker's budget change.
    """

    #: Cached (deployment, worker) costs kept at most (then the cache starts over).
    CACHE_ENTRIES = 1 << 18

    def __init__(
        self,
        residency: ResidencyMap,
        estimates: Estimates,
        bytes_of: Callable[[str], int],
        budget_of: Callable[[str], int] | None = None,
    ) -> None:
        self.residency = residency
        self.estimates = estimates
        self.bytes_of = bytes_of
        self.budget_of = budget_of
        self._cache: dict[tuple[str, str], tuple[tuple[int, int, int, int], float]] = {}

    def setup_s(self, deployment: str, group: tuple[str, ...]) -> float:
        nbytes = 0
        worst = 0.0
        for w in group:
            tier = self.residency.tier(deployment, w)
            if tier != "hbm":
                nbytes = nbytes or self.bytes_of(deployment)
                worst = max(worst, self._worker_setup(deployment, tier, nbytes, w))
        return worst

    def _worker_setup(self, deployment: str, tier: str, nbytes: int, worker: str) -> float:
        # The dispatcher and the Queue page ask for the same (deployment, worker) pairs many
        # times between two changes; the cost is a function of exactly what the key and the
        # stamp hold (the worker's residency, the setup estimates, the bytes and the budget).
        budget = self.budget_of(worker) if self.budget_of is not None else 0
        stamp = (self.residency.stamp(worker), self.estimates.setup_stamp, nbytes, budget)
        key = (deployment, worker)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        cost = self.estimates.setup(deployment, tier, nbytes) + self._displacement(
            deployment, nbytes, worker, budget
        )
        if len(self._cache) >= self.CACHE_ENTRIES:  # bounded: entries of gone deployments
            self._cache.clear()
        self._cache[key] = (stamp, cost)
        return cost

    def _displacement(self, deployment: str, nbytes: int, worker: str, budget: int) -> float:
        if budget <= 0:
            return 0.0
        own = self.residency.get(deployment, worker)
        held = self.residency.hbm_bytes(worker) - (own.bytes if own and own.tier == "hbm" else 0)
        need = nbytes - (budget - held)
        if need <= 0:  # it fits beside what is there (the common case: no list, no sort)
            return 0.0
        cost = 0.0
        for r in self.residency.hbm_largest_first(worker):
            if need <= 0:
                break
            if r.deployment != deployment:
                cost += self.estimates.setup(r.deployment, "dram", r.bytes)
                need -= r.bytes
        return cost

    def crowding(self, worker: str) -> int:
        return self.residency.count_in(worker, "hbm")
