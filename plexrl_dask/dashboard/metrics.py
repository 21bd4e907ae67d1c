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
- ``dask_plexrl_job_requests_dispatched_total``,
  ``dask_plexrl_job_requests_ended_total{outcome="completed"|"failed"}`` and
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
process serves, on each scheduler's loop, the newest dashboard plugin installed on that
scheduler (a process may run several schedulers, as tests do); anywhere else, say a
``prometheus_client.start_http_server`` thread in a driver that runs a ``local_cluster``,
it yields nothing, since the plugins' state belongs to their loop. A collection that fails
yields nothing and is logged; Dask's own metrics are still served.
"""

from __future__ import annotations

import asyncio
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
    """A ``prometheus_client`` collector of the dashboard plugins started in this process
    (see the module docstring); ``collect`` yields metric families."""

    def __init__(self) -> None:
        self._plugins: list[weakref.ref[PlexRLDashboardPlugin]] = []

    def add(self, plugin: PlexRLDashboardPlugin) -> None:
        self.discard(plugin)
        self._plugins.append(weakref.ref(plugin))

    def discard(self, plugin: PlexRLDashboardPlugin) -> None:
        self._plugins = [r for r in self._plugins if r() is not None and r() is not plugin]

    def plugin(self) -> PlexRLDashboardPlugin | None:
        """The plugin to report: the newest one still installed on a scheduler whose event
        loop is the running one (Dask's ``/metrics`` handler runs there). None off every
        scheduler's loop: collecting reads (and caches into) state that only the loop may
        touch, so a registry collected from another thread (``start_http_server`` in the
        same process, say) gets nothing of PlexRL's rather than a race."""

        from plexrl_dask.dashboard.state import dashboard_of

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        for ref in reversed(self._plugins):
            plugin = ref()
            scheduler = None if plugin is None else plugin.scheduler
            if (
                scheduler is not None
                and scheduler.loop.asyncio_loop is loop
                # removed from its scheduler (Dask's remove_plugin does not close it)
                and dashboard_of(scheduler) is plugin
                and plugin.plexrl is not None
            ):
                return plugin
        return None

    def name(self, metric: str) -> str:
        namespace = dask.config.get("distributed.dashboard.prometheus.namespace", default="dask")
        return "_".join(p for p in (namespace, SUBSYSTEM, metric) if p)

    def describe(self) -> list[Any]:
        # No families up front: the registry would otherwise collect once at registration,
        # off any scheduler's loop, and the families' labels depend on the state anyway.
        return []

    def collect(self) -> Iterator[Any]:
        plugin = self.plugin()
        if plugin is None:
            return
        try:
            # All or nothing: a failure half-way must not leave a half-written scrape that
            # breaks Dask's own metrics on the same route.
            families = self._families(plugin)
        except Exception:  # noqa: BLE001 (logged; the route still serves Dask's metrics)
            logger.exception("PlexRL metrics: collecting failed")
            return
        yield from families

    def _families(self, plugin: PlexRLDashboardPlugin) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        jobs = plugin.jobs_view(with_history=False)["jobs"]
        queue = plugin.queue_view(limit=1, with_decisions=False)["queue"]
        workers, running = plugin.worker_lanes(time.time())
        nodes = plugin.node_bytes()
        counters = plugin.plexrl.job_counters

        def counter(metric: str, doc: str, labels: list[str]) -> Any:
            return CounterMetricFamily(self.name(metric), doc, labels=labels)

        def gauge(metric: str, doc: str, labels: list[str] | None = None) -> Any:
            return GaugeMetricFamily(self.name(metric), doc, labels=labels)

        job = ["job"]
        charged = counter("job_charged_seconds", "Worker-seconds charged (busy + setup)", job)
        busy = counter("job_busy_seconds", "Worker-seconds the job's requests ran", job)
        setup = counter("job_setup_seconds", "Worker-seconds of loads charged to the job", job)
        dispatched = counter("job_requests_dispatched", "The job's requests released", job)
        ended = counter(
            "job_requests_ended", "The job's requests that ended, by outcome", [*job, "outcome"]
        )
        wait = counter("job_wait_seconds", "Seconds the job's requests waited to start", job)
        step = gauge("job_step", "GRPO steps the job has reported done", job)
        reward = gauge("job_reward_mean", "Mean reward of the job's last step", job)
        loss = gauge("job_loss", "Loss of the job's last step", job)
        share = gauge("job_share", "The job's share of all charged worker-seconds", job)
        isolated = gauge(
            "job_isolated_estimate_seconds",
            "Worker-seconds the job would have cost on its own workers",
            job,
        )
        for row in jobs:
            name = [str(row["job"])]
            counts = counters.get(row["job"], {})
            charged.add_metric(name, row["charged_s"])
            busy.add_metric(name, row["busy_s"])
            setup.add_metric(name, row["setup_s"])
            dispatched.add_metric(name, row["dispatched"])
            ended.add_metric([*name, "completed"], counts.get("completed", 0))
            ended.add_metric([*name, "failed"], row["failed"])
            wait.add_metric(name, counts.get("wait_s", 0.0))
            share.add_metric(name, row["share"])
            isolated.add_metric(name, row["isolated_s"])
            step.add_metric(name, row["step"])
            for family, key in ((reward, "reward_mean"), (loss, "loss")):
                if row[key] is not None:
                    family.add_metric(name, row[key])

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
        for deployment, n in queue["by_deployment"].items():
            per_deployment.add_metric([deployment], n)
        held = gauge("deployments", "Deployments registered on the scheduler")
        held.add_metric([], len(plugin.plexrl.deployments))

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
        return [
            *(charged, busy, setup, dispatched, ended, wait, step, reward, loss, share, isolated),
            *(queued, oldest, per_deployment, held, worker_busy, idle, tiers),
        ]


def collector() -> PlexRLCollector | None:
    """This process's collector (None until a dashboard plugin registered one)."""
    return _collector


def register(plugin: PlexRLDashboardPlugin) -> bool:
    """Serve ``plugin``'s metrics on this process's Prometheus registry (the one Dask's
    ``/metrics`` route serves); returns False, doing nothing, without ``prometheus_client``.
    One collector per process, whatever the number of schedulers in it."""
    global _collector
    try:
        from prometheus_client import REGISTRY
    except ModuleNotFoundError:
        return False
    if _collector is None:
        _collector = PlexRLCollector()
        REGISTRY.register(_collector)
    _collector.add(plugin)
    return True


def unregister(plugin: PlexRLDashboardPlugin) -> None:
    """Stop serving ``plugin``'s metrics."""
    if _collector is not None:
        _collector.discard(plugin)
