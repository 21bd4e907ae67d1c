"""Jobs on the dashboard: the per-step report a job's driver sends, and what each job is charged.

**Reporting path (one schema, here).** A job's driver reports every finished step with
:func:`report_step`, which logs a :class:`JobStepReport` as a Dask event on the ``plexrl-job``
topic (``client.log_event``). The scheduler keeps it in its event log (Dask's own *Events*
page lists it) and hands it to every scheduler plugin; the dashboard plugin
(:mod:`plexrl_dask.dashboard.state`) keeps the latest report and the reward history of each
job. :class:`~plexrl_dask.rl.grpo.GRPOJob` reports after each step; any other driver can do the
same. A report is observational: if it cannot be delivered the job goes on (with a warning).

**Identity.** ``job`` is the accounting identity, :attr:`Runtime.job
<plexrl_dask.driver.runtime.Runtime.job>`: every request a job submits carries it in its
annotation (the scheduler's queue and per-job counters), and the deployments it deploys are
owned by it (so the request spans its replica holders log carry it too). ``name`` is the run's
own name (``GRPOJob.name``), shown alongside; two runs sharing one ``Runtime`` share one row.

**Charges.** :class:`JobLedger` turns request spans (:mod:`plexrl_dask.shared.timeline`) into
per-job charges, incrementally (each span is looked at once):

- *GPU-seconds charged* = Σ over the job's spans of ``end - start``: the seconds its requests
  ran (*busy*, ``end - ready``) plus the setup they waited for (*setup*, ``ready - start``: the
  load of the job's own replica, and the offload of whatever it displaced), i.e. busy plus
  attributable setup;
- *share of the pool* = the job's charge ÷ every job's charge (of the worker-seconds the pool
  spent on requests, how much went to this job);
- *isolated cost estimate* = what the job would at least have cost alone (the ledger's
  :meth:`~plexrl_dask.rl.ledger.ModeLedger.isolated_cost_lower_bound`): the workers its
  deployments hold (Σ world size × replicas) × the seconds in which any of its requests ran
  (the union of its spans).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any

from plexrl_dask.errors import InvalidJobReport
from plexrl_dask.protocol import JOB_TOPIC  # (the event's topic: plexrl_dask/protocol.py)
from plexrl_dask.shared.timeline import RequestSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobStepReport:
    """One finished step of a job (see the module docstring for ``job`` and ``name``).

    ``steps`` is the number of steps the run plans (0: unknown); ``loss`` is ``None`` for a
    step that trained on nothing (every group's rewards were equal); ``time`` is the wall-clock
    instant of the report.
    """

    job: str
    name: str
    step: int
    steps: int
    reward_mean: float
    reward_max: float
    sampled_tokens: int
    loss: float | None
    version: int
    wall_s: float
    time: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("job", "name"):
                ok = isinstance(value, str) and (bool(value) or f.name == "name")
            elif f.name in ("step", "steps", "sampled_tokens", "version"):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            elif f.name == "loss" and value is None:
                ok = True
            else:
                ok = (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and math.isfinite(value)
                )
            if not ok:
                raise InvalidJobReport(
                    f"job report field {f.name!r} is invalid: {value!r} (job names are "
                    "non-empty strings, counts non-negative integers, numbers finite)"
                )

    def to_event(self) -> dict[str, Any]:
        """The msgpack-able message logged on :data:`JOB_TOPIC`."""
        return asdict(self)

    @classmethod
    def from_event(cls, msg: Any) -> JobStepReport:
        """Parse a logged message; unknown keys are ignored (newer drivers), missing ones raise
        :class:`~plexrl_dask.errors.InvalidJobReport`."""
        if not isinstance(msg, dict):
            raise InvalidJobReport(f"a job report is a dict, got {type(msg).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in msg]
        if missing:
            raise InvalidJobReport(f"job report lacks {missing}: {sorted(msg)[:20]}")
        return cls(**{n: msg[n] for n in names})


def report_step(client: Any, report: JobStepReport, timeout: float = 10.0) -> bool:
    """Send ``report`` to the scheduler (``client``: a synchronous ``distributed.Client``),
    waiting at most ``timeout`` seconds. Returns whether it was delivered; a failure is logged,
    not raised: the dashboard must never stop a job."""
    try:
        client.sync(
            client.scheduler.log_event,
            topic=JOB_TOPIC,
            msg=report.to_event(),
            callback_timeout=timeout,
        )
        return True
    except Exception as e:  # noqa: BLE001 (any comm failure: the job goes on)
        logger.warning("could not report step %d of job %s: %s", report.step, report.job, e)
        return False


class UnionSeconds:
    """The length of the union of intervals added in any order, in bounded memory.

    Disjoint intervals are kept sorted; those ending more than ``horizon_s`` before the latest
    end seen are folded into a total (``frozen_s``) and forgotten. An interval arriving later
    than that and reaching into the folded past is clipped at the fold, so nothing is counted
    twice; spans arrive within a poll interval of their end, far inside the horizon.
    """

    def __init__(self, horizon_s: float = 600.0) -> None:
        self.horizon_s = float(horizon_s)
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._open_s = 0.0
        self.frozen_s = 0.0
        self.frozen_until = float("-inf")
        self._latest = float("-inf")

    def add(self, start: float, end: float) -> None:
        start = max(start, self.frozen_until)
        if end <= start:
            return
        i = bisect.bisect_left(self._ends, start)  # first interval ending at or after start
        j = bisect.bisect_right(self._starts, end)  # intervals [i, j) touch [start, end]
        if i < j:
            start = min(start, self._starts[i])
            end = max(end, self._ends[j - 1])
            self._open_s -= sum(
                b - a for a, b in zip(self._starts[i:j], self._ends[i:j], strict=True)
            )
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]
        self._open_s += end - start
        self._latest = max(self._latest, end)
        while self._ends and self._ends[0] < self._latest - self.horizon_s:
            a, b = self._starts.pop(0), self._ends.pop(0)
            self._open_s -= b - a
            self.frozen_s += b - a
            self.frozen_until = b

    @property
    def seconds(self) -> float:
        return self.frozen_s + self._open_s


@dataclass
class JobCharge:
    """One job's accumulated charges (see the module docstring)."""

    requests: int = 0
    busy_s: float = 0.0
    setup_s: float = 0.0
    first_start: float = float("inf")
    last_end: float = float("-inf")
    union: UnionSeconds | None = None

    @property
    def charged_s(self) -> float:
        return self.busy_s + self.setup_s


class JobLedger:
    """Per-job reports and charges, bounded: at most ``jobs_kept`` jobs (the least recently
    active are forgotten first) and ``steps_kept`` steps of reward history each."""

    def __init__(self, steps_kept: int = 1000, jobs_kept: int = 500) -> None:
        self.steps_kept = int(steps_kept)
        self.jobs_kept = int(jobs_kept)
        self.reports: dict[str, JobStepReport] = {}
        self.history: dict[str, deque[tuple[int, float, float]]] = {}
        self.charges: dict[str, JobCharge] = {}
        self.deployments: dict[str, set[str]] = {}  # job -> deployments its spans ran
        self.layout_workers: dict[str, int] = {}  # job -> workers its deployments hold
        # job -> (tool calls, their seconds): what its episodes waited on tools (tool
        # workers are not the pool: shown, never charged)
        self.tools: dict[str, tuple[int, float]] = {}
        self._active: dict[str, float] = {}  # job -> last activity (wall clock), LRU order
        self.version = 0  # bumped on every change: pages redraw only then
        self.reports_version = 0  # bumped on every step report (reward curves redraw then)

    def report(self, r: JobStepReport) -> None:
        self.reports[r.job] = r
        hist = self.history.setdefault(r.job, deque(maxlen=self.steps_kept))
        if hist and hist[-1][0] >= r.step:  # a new run under the same job: start over
            hist.clear()
        hist.append((r.step, r.reward_mean, r.reward_max))
        self.reports_version += 1
        self._touch(r.job, r.time)

    def span(self, s: RequestSpan) -> None:
        c = self.charges.get(s.job)
        if c is None:
            c = self.charges[s.job] = JobCharge(union=UnionSeconds())
        c.requests += 1
        c.busy_s += max(0.0, s.end - s.ready)
        c.setup_s += max(0.0, s.ready - s.start)
        c.first_start = min(c.first_start, s.start)
        c.last_end = max(c.last_end, s.end)
        assert c.union is not None
        c.union.add(s.start, s.end)
        self.deployments.setdefault(s.job, set()).add(s.deployment)
        self._touch(s.job, s.end)

    def tool(self, s: RequestSpan) -> None:
        """A tool call of ``s.job`` ran (a span of a tool report)."""
        calls, seconds = self.tools.get(s.job, (0, 0.0))
        self.tools[s.job] = (calls + 1, seconds + max(0.0, s.end - s.start))
        self._touch(s.job, s.end)

    def set_layout(self, job: str, workers: int) -> None:
        """The workers ``job``'s deployments hold now (kept after they are undeployed)."""
        if workers > 0 and self.layout_workers.get(job) != workers:
            self.layout_workers[job] = workers
            self.version += 1

    def isolated_estimate_s(self, job: str) -> float:
        c = self.charges.get(job)
        if c is None or c.union is None:
            return 0.0
        return max(1, self.layout_workers.get(job, 1)) * c.union.seconds

    def jobs(self, limit: int) -> list[str]:
        """Up to ``limit`` jobs, most recently active first."""
        out = []
        for job in reversed(self._active):
            out.append(job)
            if len(out) >= limit:
                break
        return out

    def _touch(self, job: str, when: float) -> None:
        self._active.pop(job, None)
        self._active[job] = when
        self.version += 1
        while len(self._active) > self.jobs_kept:
            old = next(iter(self._active))
            for table in (
                self._active,
                self.reports,
                self.history,
                self.charges,
                self.deployments,
                self.layout_workers,
                self.tools,
            ):
                table.pop(old, None)
