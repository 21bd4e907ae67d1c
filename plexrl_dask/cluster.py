"""Starting PlexRL on a cluster: a local one, or an existing one.

``local_cluster()`` is the embedded default (DESIGN §5): a process ``LocalCluster`` on
127.0.0.1 whose workers advertise the GPU resource and whose scheduler preloads the PlexRL
plugins, exactly as a shared cluster would with ``dask scheduler --preload plexrl_dask.plugins``.
``install(client)`` adds the plugins to a running cluster instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dask.config
from dask.utils import parse_bytes
from distributed import Client, LocalCluster

from plexrl_dask import config

logger = logging.getLogger(__name__)

PRELOAD = "plexrl_dask.plugins"
TRIM_ENV = "MALLOC_TRIM_THRESHOLD_"
TRIM_ENV_KEY = f"distributed.nanny.pre-spawn-environ.{TRIM_ENV}"


def local_cluster(
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | int | None = None,
    processes: bool = True,
    dashboard_address: str | None = ":0",
    **kwargs: Any,
) -> LocalCluster:
    """A ``LocalCluster`` of PlexRL workers (each advertising one unit of the GPU resource).

    Defaults come from ``plexrl.local-cluster.*``. It binds to 127.0.0.1 on free ports; the
    dashboard too (``cluster.dashboard_link``).
    """
    gpu = str(config.get("worker.gpu-resource"))
    resources = {gpu: 1, **kwargs.pop("resources", {})}
    scheduler_kwargs = dict(kwargs.pop("scheduler_kwargs", {}))
    scheduler_kwargs["preload"] = [*scheduler_kwargs.get("preload", []), PRELOAD]
    limit = memory_limit if memory_limit is not None else config.get("local-cluster.memory-limit")
    if n_workers is None:
        n_workers = int(config.get("local-cluster.n-workers"))
    if threads_per_worker is None:
        threads_per_worker = int(config.get("local-cluster.threads-per-worker"))
    # Dask sets MALLOC_TRIM_THRESHOLD_ in worker processes; an explicit threshold turns off
    # glibc's adaptive mmap threshold, so every large tensor allocation is a fresh mmap and page
    # faults: torch training ran 1.2-2x slower in such a worker (benchmarks/RESULTS.md). Nannies
    # read this when they are created, so it also holds for their restarts.
    _drop_leaked_trim_threshold()
    with dask.config.set({TRIM_ENV_KEY: None}):
        return LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=processes,
            memory_limit=parse_bytes(limit) if isinstance(limit, str) else limit,
            resources=resources,
            host="127.0.0.1",
            dashboard_address=dashboard_address,
            scheduler_kwargs=scheduler_kwargs,
            **kwargs,
        )


def _drop_leaked_trim_threshold() -> None:
    """Dask's nannies write their pre-spawn environment into *this* process's ``os.environ``
    before spawning, so after any other LocalCluster in this process every later worker
    inherits ``MALLOC_TRIM_THRESHOLD_`` whatever its own config says. Remove it when it holds
    exactly Dask's default (the leak), not a value someone chose."""
    leaked = dask.config.get(TRIM_ENV_KEY, default=None)
    if leaked is not None and os.environ.get(TRIM_ENV) == str(leaked):
        del os.environ[TRIM_ENV]
        logger.info("removed %s=%s left in this process by another Dask nanny", TRIM_ENV, leaked)


def install(client: Client) -> None:
    """Install the PlexRL plugins on the cluster of ``client`` (idempotent).

    Workers need ``plexrl_dask`` importable and must advertise the GPU resource
    (``dask worker ... --resources GPU=1``) to get a replica holder.
    """
    from plexrl_dask.plugins import PlexRLSchedulerPlugin

    client.register_plugin(PlexRLSchedulerPlugin())
