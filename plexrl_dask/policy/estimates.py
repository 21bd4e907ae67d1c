"""Estimates the dispatch rule needs: service time per (deployment, op) and setup (load) time.

Both are learned from what the cluster reports, as exponentially weighted moving averages that
start from documented priors:

- service: the wall time from release to completion of each request (the plugin observes it);
  prior ``plexrl.scheduler.service-prior`` (1 s: a tiny model's step on a CPU worker);
- setup: the measured ``load_s`` of each transition into HBM a holder reports (build, reload or
  group rebuild); until one is seen, the deployment's bytes over
  ``plexrl.scheduler.load-bandwidth-prior`` (2 GB/s: host-to-device copies and CPU builds of
  tiny models are of that order; the state-store issue measures the real tiers).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Estimates:
    """EWMA estimates with priors (see the module docstring)."""

    service_prior_s: float = 1.0
    load_bandwidth: float = 2e9
    weight: float = 0.3  # of each new observation
    _service: dict[tuple[str, str], float] = field(default_factory=dict)
    _load: dict[str, float] = field(default_factory=dict)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new

    def observe_service(self, deployment: str, op: str, seconds: float) -> None:
        key = (deployment, op)
        self._service[key] = self._blend(self._service.get(key), max(seconds, 1e-6))

    def observe_load(self, deployment: str, seconds: float) -> None:
        if seconds > 0:
            self._load[deployment] = self._blend(self._load.get(deployment), seconds)

    def service(self, deployment: str, op: str) -> float:
        return self._service.get((deployment, op), self.service_prior_s)

    def setup(self, deployment: str, nbytes: int) -> float:
        """Time to make ``deployment`` resident on a worker where it is not."""
        learned = self._load.get(deployment)
        return learned if learned is not None else nbytes / self.load_bandwidth

    def forget(self, deployment: str) -> None:
        self._load.pop(deployment, None)
        for key in [k for k in self._service if k[0] == deployment]:
            del self._service[key]
