"""The PlexRL worker plugin: prepares a GPU worker and asks for its replica holder.

The scheduler plugin registers this plugin cluster-wide, so every worker that joins (including
one restarted by its nanny) gets it. On a worker advertising the GPU resource it fixes torch's
thread count (docs/architecture.md, "Sampling and determinism"), binds its threads to the
cores its launcher chose (``PLEXRL_WORKER_CPUS``: docs/deploying.md, "Local cluster"), sets
the interval of Dask's profiler (``plexrl.worker.profile-interval``), adds the
``plexrl_holder_*`` worker handlers, the handlers that serve this node's stored versions to
other nodes (:mod:`plexrl_dask.state_store.peer`) and the handler of the scheduler's prefetch
hints (passed to the holder), and announces the worker on the ``plexrl-worker`` topic; the
scheduler plugin answers by creating the worker's :class:`ReplicaHolder` actor. Workers
without the GPU resource (tool workers) only have their threads bound, where their launcher
chose cores for them (``plexrl.local-cluster.tool-cpus``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize
from tornado.ioloop import PeriodicCallback

from plexrl_dask import config, protocol
from plexrl_dask import worker as engine
from plexrl_dask.cluster import CPUS_ENV, parse_cpus
from plexrl_dask.config import WorkerConfig
from plexrl_dask.errors import ConfigError, StateStoreError, to_status
from plexrl_dask.protocol import PREFETCH_OP, STORE_MANIFEST, STORE_OBJECTS, WORKER_TOPIC
from plexrl_dask.worker.holder import ReplicaHolder, holder_of

logger = logging.getLogger(__name__)

HOLDER_HANDLERS = (protocol.HOLDER_STATUS, protocol.HOLDER_DROP, protocol.HOLDER_OFFLOAD)
#: Key prefix of the holder actors (one key per worker incarnation).
HOLDER_KEY_PREFIX = "plexrl-replica-holder"


def new_replica_holder() -> Any:
    """A :class:`~plexrl_dask.worker.holder.ReplicaHolder` for the worker this runs on: the
    task the scheduler plugin submits as the worker's holder actor (the actor is what this
    returns). Constructed with no arguments, the holder configures itself from the worker."""
    return ReplicaHolder()


def _bind_cpus() -> list[int] | None:
    """Bind this worker's threads to the cores its launcher chose (``PLEXRL_WORKER_CPUS``,
    :func:`plexrl_dask.cluster.cpus_of_worker`); the cores bound, or None (unbound). A list
    that does not parse or that this process may not use leaves the worker unbound, with a
    warning: it still serves."""
    listed = os.environ.get(CPUS_ENV)
    if not listed:
        return None
    try:
        return engine.device.bind_cpus(parse_cpus(listed))
    except (ConfigError, OSError) as e:
        logger.warning("worker left unbound: %s=%r (%s)", CPUS_ENV, listed, e)
        return None


class PlexRLWorkerPlugin(WorkerPlugin):
    """See the module docstring."""

    name = "plexrl-worker"

    def setup(self, worker: Any) -> None:
        # Tool workers too: an agentic turn's tool call is a request/reply chain like any other.
        config.tune_batched_send(getattr(worker, "batched_stream", None))
        try:
            cfg = WorkerConfig.from_dask_config()
        except ConfigError as e:
            # Announced all the same: the scheduler then tries this worker's holder, which
            # fails with the same error and names it (holder_errors), where a plugin that
            # failed here would leave a worker up with no holder and no reason.
            logger.error("this worker's PlexRL settings are wrong: %s", e)
            worker.log_event(WORKER_TOPIC, {"error": str(e)})
            return
        # (The engine loads here, on the worker; the scheduler imports this class to register
        # it and never loads torch or Zarr.)
        self.cpus = _bind_cpus()  # (a tool worker's too, where its launcher gave it cores)
        if worker.state.total_resources.get(cfg.gpu_resource, 0) < 1:
            return
        engine.device.fix_threads(cfg.torch_threads)
        peer = engine.stores.peer
        profiler = worker.periodic_callbacks.get("profile")
        self._profile_ms = None  # Dask's own interval, restored by teardown
        if profiler is not None and cfg.profile_interval_s is not None:
            # Dask's profiler samples on the event loop, holding the GIL the request thread
            # then waits for (plexrl.worker.profile-interval). Tornado reads the period anew
            # each time it schedules the next call.
            self._profile_ms = profiler.callback_time
            profiler.callback_time = 1000 * cfg.profile_interval_s
        if os.environ.get("MALLOC_TRIM_THRESHOLD_"):
            logger.warning(
                "MALLOC_TRIM_THRESHOLD_ is set in this worker (Dask's default pre-spawn "
                "environment): it makes torch allocations page-fault and ran training 1.2-2x "
                "slower in our measurements. Set distributed.nanny.pre-spawn-environ."
                "MALLOC_TRIM_THRESHOLD_ to null in the workers' Dask config"
            )

        # The holder's lock may be held by a running request: never take it on the event loop.
        async def holder_status() -> dict[str, Any] | None:
            holder = holder_of(worker)
            if holder is None:
                return None
            return await asyncio.get_running_loop().run_in_executor(None, holder.status)

        async def holder_drop(name: str) -> bool:
            holder = holder_of(worker)
            if holder is None:
                return False
            return await asyncio.get_running_loop().run_in_executor(None, holder.drop, name)

        async def holder_offload(name: str) -> bool:
            holder = holder_of(worker)
            if holder is None:
                return False
            return await asyncio.get_running_loop().run_in_executor(None, holder.offload, name)

        # A peer node importing a version from this node's tiers (state_store.peer).
        def node_state() -> Any:
            holder = holder_of(worker)
            if holder is None or holder.node is None:
                raise StateStoreError(f"worker {worker.address} has no node state store")
            return holder.node

        async def store_manifest(model: str, version: int) -> dict[str, Any]:
            def serve() -> dict[str, Any]:
                try:
                    return peer.serve_manifest(node_state(), model, version)
                except StateStoreError as e:
                    return to_status(e)

            return await asyncio.get_running_loop().run_in_executor(None, serve)

        async def store_objects(model: str, version: int, digests: list[str]) -> dict[str, Any]:
            def serve() -> dict[str, Any]:
                try:
                    reply = peer.serve_objects(node_state(), model, version, list(digests))
                except StateStoreError as e:
                    return to_status(e)
                if "objects" in reply:  # as frames of their own, not copied into the message
                    reply["objects"] = {d: to_serialize(b) for d, b in reply["objects"].items()}
                return reply

            return await asyncio.get_running_loop().run_in_executor(None, serve)

        def prefetch(deployment: str | None, uid: str = "") -> None:
            holder = holder_of(worker)
            if holder is not None:
                holder.hint(deployment, uid)

        worker.handlers[protocol.HOLDER_STATUS] = holder_status
        worker.handlers[protocol.HOLDER_DROP] = holder_drop
        worker.handlers[protocol.HOLDER_OFFLOAD] = holder_offload
        worker.handlers[STORE_MANIFEST] = store_manifest
        worker.handlers[STORE_OBJECTS] = store_objects
        # A stream op (one-way, batched with the scheduler's other messages); an op a worker
        # has no handler for would break its stream, so it is never removed (see teardown).
        worker.stream_handlers[PREFETCH_OP] = prefetch

        # The node's manager moves offloaded state between tiers on its own (eviction under
        # DRAM pressure, promotion): re-report tiers so the scheduler's setup costs follow.
        async def refresh_tiers() -> None:
            holder = holder_of(worker)
            if holder is not None:
                await asyncio.get_running_loop().run_in_executor(None, holder.refresh_tiers)

        interval_ms = 1000 * config.get_seconds("state.report-interval")
        self._refresh = PeriodicCallback(refresh_tiers, interval_ms)
        worker.periodic_callbacks["plexrl-tiers"] = self._refresh
        self._refresh.start()
        if worker.nanny is not None:
            # A worker process of its own: what exists now (Dask's worker, torch, the store)
            # lives as long as the process. In the permanent generation, a full garbage
            # collection (the decode loop's allocations set one off every few dozen steps)
            # walks only what requests made since, not these ~400,000 objects (~180 ms each
            # time on a worker running countdown4). Garbage first, so none is kept for good.
            gc.collect()
            gc.freeze()
        worker.log_event(WORKER_TOPIC, {"torch_threads": cfg.torch_threads, "cpus": self.cpus})

    def teardown(self, worker: Any) -> None:
        refresh = worker.periodic_callbacks.pop("plexrl-tiers", None)
        if refresh is not None:
            refresh.stop()
        profiler = worker.periodic_callbacks.get("profile")
        if profiler is not None and getattr(self, "_profile_ms", None) is not None:
            profiler.callback_time = self._profile_ms
        for handler in (*HOLDER_HANDLERS, STORE_MANIFEST, STORE_OBJECTS):
            worker.handlers.pop(handler, None)
        if PREFETCH_OP in worker.stream_handlers:
            worker.stream_handlers[PREFETCH_OP] = lambda **_: None
