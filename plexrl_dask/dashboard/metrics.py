"""PlexRL's numbers on the scheduler's Prometheus endpoint (``/metrics``), beside Dask's own.

Operators of a shared cluster scrape Prometheus. Dask's scheduler already serves
``/metrics`` (when ``prometheus_client`` is installed) from the process's default registry;
:func:`register` adds one collector to that registry, and the scheduler's own route then
serves PlexRL's metrics too: no second server, no new port, no patch to Dask. They are named
like Dask's (``distributed.dashboard.prometheus.namespace``, ``dask`` by default, then the
subsystem ``plexrl``):

Per job (label ``job``; the ``plexrl.dashboard.jobs-shown`` most recently active jobs, as
on the Jobs page, so the number of series stays bounded on a long-lived cluster):

- ``dask_plexrl_job_charged_seconds_total``, ``..._busy_seconds_total``,
  ``..._setup_seconds_total``: worker-seconds charged to the job (busy + attributable setup;
  the ledger of the Jobs page and of ``bench.multiplex``);
- ``dask_plexrl_job_requests_total{state="dispatched"|"completed"|"failed"}`` and
  ``dask_plexrl_job_wait_seconds_total``: the scheduler plugin's per-job counters;
- ``dask_plexrl_job_step``, ``dask_plexrl_job_reward_mean``, ``dask_plexrl_job_loss``
  (its last step report; absent before the first), ``dask_plexrl_job_share`` (of all the
  worker-seconds charged), ``dask_plexrl_job_isolated_estimate_seconds`` (what it would
  have cost on its own workers).

The pool:

- ``dask_plexrl_queue_requests{state="pending"|"admitted"}``,
  ``dask_plexrl_queue_oldest_wait_seconds`` (0 when nothing is admitted),
  ``dask_plexrl_deployment_pending_requests{deployment}``;
- ``dask_plexrl_deployments``; ``dask_plexrl_worker_busy`` (1 while a request runs there)
  and ``dask_plexrl_worker_idle_fraction`` over the Timeline window, per PlexRL worker;
- ``dask_plexrl_node_tier_bytes{node, tier}``: bytes of replicas held per tier per node, as
  the workers report them (the Residency page's node table).

A scrape does what a dashboard update does: bounded work (jobs shown, workers, deployments,
nodes), never proportional to the queue, on the scheduler's event loop (Dask's handler runs
there). It reads the dashboard plugin's views and starts no polling. One collector per
process serves the newest started dashboard plugin (a process may run several schedulers one
after another, as tests do) while it is installed; otherwise it yields nothing.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import dask.config

if TYPE_CHECKING:
    from plexrl_dask.dashboard.state import PlexRLDashboardPlugin

logger = logging.getLogger(__name__)

SUBSYSTEM = "plexrl"

_collector: PlexRLCollector | None = None


class PlexRLCollector:
    """A ``prometheus_client`` collector of the dashboard plugin it points at (see the module
    docstring); ``collect`` yields metric families."""

    def __init__(self) -> None:
        self._plugin: weakref.ref[PlexRLDashboardPlugin] | None = None

    def point_at(self, plugin: PlexRLDashboardPlugin | None) -> None:
        self._plugin = None if plugin is None else weakref.ref(plugin)

    @property
    def plugin(self) -> PlexRLDashboardPlugin | None:
        return None if self._plugin is None else self._plugin()

    def name(self, metric: str) -> str:
        namespace = dask.config.get("distributed.dashboard.prometheus.namespace", default="dask")
        return "_".join(p for p in (namespace, SUBSYSTEM, metric) if p)

    def describe(self) -> list[Any]:
        # No families up front: registering must not run a collection (the registry calls
        # ``collect`` for collectors without ``describe``), and names are checked per scrape.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from plexrl_dask.dashboard.state import dashboard_of

        plugin = self.plugin
        if plugin is None or plugin.scheduler is None or plugin.plexrl is None:
            return
        if dashboard_of(plugin.scheduler) is not plugin:
            return  # removed from its scheduler (Dask's remove_plugin does not close it)
        try:
            jobs = plugin.jobs_view(with_history=False)["jobs"]
            queue = plugin.queue_view(limit=1, with_decisions=False)["queue"]
            workers, running = plugin.worker_lanes(time.time())
            nodes = plugin.node_bytes()
            deployments = len(plugin.plexrl.deployments)
        except Exception:  # a scrape must not fail the scheduler's /metrics for Dask's own
            logger.exception("PlexRL metrics: collecting failed")
            return

        def counter(metric: str, doc: str, labels: list[str]) -> Any:
            return CounterMetricFamily(self.name(metric), doc, labels=labels)

        def gauge(metric: str, doc: str, labels: list[str] | None = None) -> Any:
            return GaugeMetricFamily(self.name(metric), doc, labels=labels)

        charged = counter(
            "job_charged_seconds", "Worker-seconds charged to the job (busy + setup)", ["job"]
        )
        busy = counter("job_busy_seconds", "Worker-seconds the job's requests ran", ["job"])
        setup = counter(
            "job_setup_seconds", "Worker-seconds of loads and offloads charged to the job", ["job"]
        )
        requests = counter("job_requests", "The job's requests, by state", ["job", "state"])
        wait = counter("job_wait_seconds", "Seconds the job's requests waited to start", ["job"])
        step = gauge("job_step", "GRPO steps the job has reported done", ["job"])
        reward = gauge("job_reward_mean", "Mean reward of the job's last step", ["job"])
        loss = gauge("job_loss", "Loss of the job's last step", ["job"])
        share = gauge("job_share", "The job's share of all charged worker-seconds", ["job"])
        isolated = gauge(
            "job_isolated_estimate_seconds",
            "Worker-seconds the job would have cost on its own workers",
            ["job"],
        )
        for row in jobs:
            job = [str(row["job"])]
            charged.add_metric(job, row["charged_s"])
            busy.add_metric(job, row["busy_s"])
            setup.add_metric(job, row["setup_s"])
            requests.add_metric([*job, "dispatched"], row["dispatched"])
            requests.add_metric([*job, "failed"], row["failed"])
            counts = plugin.plexrl.job_counters.get(row["job"], {})
            requests.add_metric([*job, "completed"], counts.get("completed", 0))
            wait.add_metric(job, counts.get("wait_s", 0.0))
            share.add_metric(job, row["share"])
            isolated.add_metric(job, row["isolated_s"])
            step.add_metric(job, row["step"])
            for family, key in ((reward, "reward_mean"), (loss, "loss")):
                if row[key] is not None:
                    family.add_metric(job, row[key])
        yield from (charged, busy, setup, requests, wait, step, reward, loss, share, isolated)

        queued = gauge("queue_requests", "Requests waiting in the PlexRL queue", ["state"])
        queued.add_metric(["pending"], queue["pending"])
        queued.add_metric(["admitted"], queue["admitted"])
        oldest = gauge(
            "queue_oldest_wait_seconds", "How long the oldest admitted request has waited"
        )
        oldest.add_metric([], queue["top"][0]["wait_s"] if queue["top"] else 0.0)
        per_deployment = gauge(
            "deployment_pending_requests", "Pending requests per deployment", ["deployment"]
        )
        for name, n in queue["by_deployment"].items():
            per_deployment.add_metric([name], n)
        held = gauge("deployments", "Deployments registered on the scheduler")
        held.add_metric([], deployments)
        yield from (queued, oldest, per_deployment, held)

        live = {r["worker"] for r in running}
        worker_busy = gauge("worker_busy", "1 while a request runs on the worker", ["worker"])
        idle = gauge(
            "worker_idle_fraction",
            "Fraction of the Timeline window the worker ran nothing",
            ["worker"],
        )
        for w in workers:
            worker_busy.add_metric([w["worker"]], 1.0 if w["worker"] in live else 0.0)
            idle.add_metric([w["worker"]], w["idle_fraction"])
        tiers = gauge(
            "node_tier_bytes", "Bytes of replicas held per tier on each node", ["node", "tier"]
        )
        for entry in nodes:
            for key, value in entry.items():
                if key.endswith("_bytes"):
                    tiers.add_metric([entry["node"], key.removesuffix("_bytes")], value)
        yield from (worker_busy, idle, tiers)


def collector() -> PlexRLCollector | None:
    """This process's collector (None until a dashboard plugin registered one)."""
    return _collector


def register(plugin: PlexRLDashboardPlugin) -> bool:
    """Serve ``plugin``'s metrics on this process's Prometheus registry (the one Dask's
    ``/metrics`` route serves); returns False, doing nothing, without ``prometheus_client``.
    Idempotent: one collector per process, pointed at the newest plugin."""
    global _collector
    try:
        from prometheus_client import REGISTRY
    except ModuleNotFoundError:
        return False
    if _collector is None:
        _collector = PlexRLCollector()
        REGISTRY.register(_collector)
    _collector.point_at(plugin)
    return True


def unregister(plugin: PlexRLDashboardPlugin) -> None:
    """Stop serving ``plugin``'s metrics (if the collector still points at it)."""
    if _collector is not None and _collector.plugin is plugin:
        _collector.point_at(None)
