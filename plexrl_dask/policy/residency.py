"""Residency reports: where each deployment's state is, per worker (docs/architecture.md, "Residency reports").

One schema for the worker that sends it (``worker.log_event("plexrl-residency", report)``), the
scheduler plugin that keeps the map, the simulator and the dashboard. The scheduler adds the
``worker`` field (Dask does, for worker events).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

# (the event's topic, and the other names on the wire: plexrl_dask/protocol.py)
from plexrl_dask.protocol import HOLDER_TOPIC, PREFETCH_OP, RESIDENCY_TOPIC, WORKER_TOPIC

__all__ = ["HOLDER_TOPIC", "PREFETCH_OP", "RESIDENCY_TOPIC", "TIERS", "WORKER_TOPIC"]

#: Tiers from fastest to slowest; "absent" means no state on that worker at all.
TIERS = ("hbm", "dram", "nvme", "absent")


@dataclass(frozen=True)
class ResidencyReport:
    """A deployment's state on one worker after its last transition.

    ``load_s`` is the measured duration of that transition (a load for ``hbm``, an offload for
    ``dram``/``nvme``, 0 for ``absent``) and ``source`` the tier it came from (for a load:
    ``dram``, ``nvme`` or ``absent``; ``hbm`` for a regroup of resident state; empty if
    unknown); ``modified`` says the state differs from what the
    deployment's spec builds (trained or overwritten weights), i.e. it would be lost with the
    worker.
    """

    deployment: str
    version: int
    tier: str
    bytes: int
    load_s: float
    worker: str = ""
    uid: str = ""
    modified: bool = False
    lost: bool = False  # "absent" because a failed group request made the state unusable
    source: str = ""

    def __post_init__(self) -> None:
        if self.tier not in TIERS or self.source not in ("", *TIERS):
            raise ValueError(
                f"tier and source must be in {TIERS}, got {self.tier!r}, {self.source!r}"
            )
        # (a load time of inf or NaN would make the deployment's setup estimate, and so its
        # patience, infinite: no bound on its wait any more)
        for name in ("bytes", "load_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def to_event(self) -> dict[str, Any]:
        """The msgpack-able event a worker logs (without ``worker``: Dask adds it)."""
        event = asdict(self)
        event.pop("worker")
        return event

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> ResidencyReport:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in event.items() if k in fields})


class ResidencyMap:
    """The latest report per (deployment, worker), indexed by worker too."""

    def __init__(self) -> None:
        self._reports: dict[tuple[str, str], ResidencyReport] = {}
        self._by_worker: dict[str, dict[str, ResidencyReport]] = {}
        # bytes per tier per worker, kept with every change: setup costs ask for HBM per
        # candidate worker of every request they rank, and the dashboard's node totals and
        # metrics read them per worker, not per report
        self._tier_bytes: dict[str, dict[str, int]] = {}
        # each worker's HBM residents, largest first, made when asked and dropped with any
        # change there: a load that does not fit walks them per candidate worker, and the
        # dispatcher and the Queue page rank hundreds of candidates between two changes
        self._hbm_order: dict[str, tuple[ResidencyReport, ...]] = {}
        # per worker, the number of the last change there (numbers never repeat, a forgotten
        # worker's included): what a cache of costs derived from a worker's residency checks
        self._changes = 0
        self._stamps: dict[str, int] = {}

    def _changed(self, worker: str) -> None:
        self._hbm_order.pop(worker, None)
        self._changes += 1
        self._stamps[worker] = self._changes

    def stamp(self, worker: str) -> int:
        """Changes whenever anything ``worker`` holds changes (0: nothing reported yet)."""
        return self._stamps.get(worker, 0)

    def apply(self, report: ResidencyReport) -> None:
        key = (report.deployment, report.worker)
        held = self._by_worker.setdefault(report.worker, {})
        self._drop(key)
        self._changed(report.worker)
        if report.tier != "absent":
            self._reports[key] = report
            held[report.deployment] = report
            totals = self._tier_bytes.setdefault(report.worker, dict.fromkeys(TIERS[:-1], 0))
            totals[report.tier] += report.bytes

    def _drop(self, key: tuple[str, str]) -> None:
        old = self._reports.pop(key, None)
        if old is None:
            return
        self._by_worker.get(old.worker, {}).pop(old.deployment, None)
        self._changed(old.worker)
        self._tier_bytes[old.worker][old.tier] -= old.bytes

    def forget_worker(self, worker: str) -> None:
        for deployment in self._by_worker.pop(worker, {}):
            self._reports.pop((deployment, worker), None)
        self._tier_bytes.pop(worker, None)
        self._changed(worker)

    def forget_deployment(self, deployment: str) -> None:
        for key in [k for k in self._reports if k[0] == deployment]:
            self._drop(key)

    def hbm_bytes(self, worker: str) -> int:
        """Bytes of the deployments ``worker`` holds in HBM."""
        totals = self._tier_bytes.get(worker)
        return totals["hbm"] if totals is not None else 0

    def hbm_largest_first(self, worker: str) -> tuple[ResidencyReport, ...]:
        """The reports of the deployments ``worker`` holds in HBM, largest first (ties by
        name): the order in which a load that does not fit is charged for what it displaces."""
        order = self._hbm_order.get(worker)
        if order is None:
            held = self._by_worker.get(worker, {}).values()
            order = tuple(
                sorted((r for r in held if r.tier == "hbm"), key=lambda r: (-r.bytes, r.deployment))
            )
            self._hbm_order[worker] = order
        return order

    def tier(self, deployment: str, worker: str) -> str:
        report = self._reports.get((deployment, worker))
        return report.tier if report else "absent"

    def get(self, deployment: str, worker: str) -> ResidencyReport | None:
        return self._reports.get((deployment, worker))

    def reports(self) -> list[ResidencyReport]:
        return sorted(self._reports.values(), key=lambda r: (r.deployment, r.worker))

    def on_worker(self, worker: str) -> list[ResidencyReport]:
        """The reports of every deployment ``worker`` holds."""
        return list(self._by_worker.get(worker, {}).values())

    def count_in(self, worker: str, tier: str) -> int:
        """How many deployments ``worker`` holds in ``tier``."""
        return sum(r.tier == tier for r in self._by_worker.get(worker, {}).values())

    def bytes_by_tier(self, worker: str) -> dict[str, int]:
        """Bytes of the deployments ``worker`` holds, per tier (every tier but "absent")."""
        totals = self._tier_bytes.get(worker)
        return dict(totals) if totals is not None else dict.fromkeys(TIERS[:-1], 0)

    def workers(self) -> list[str]:
        """The workers that have held something since they were last forgotten."""
        return list(self._tier_bytes)
