"""The PlexRL worker plugin: creates the replica holder of a GPU worker.

The scheduler plugin registers this plugin cluster-wide, so every worker that joins (including
one restarted by its nanny) gets it. On a worker advertising the GPU resource it fixes torch's
thread count (DESIGN §5), creates a :class:`ReplicaHolder`, puts it in the worker's actor table
(addressable as a Dask actor), adds the ``plexrl_holder_*`` worker handlers, and reports the
holder's capacity to the scheduler. Workers without the GPU resource are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from plexrl_dask import config
from plexrl_dask.config import WorkerConfig
from plexrl_dask.policy.residency import RESIDENCY_TOPIC, WORKER_TOPIC
from plexrl_dask.service.holder import HOLDER_KEY, ReplicaHolder

logger = logging.getLogger(__name__)

_CPU_DEFAULT_BUDGET = 4 * 2**30
_CUDA_BUDGET_FRACTION = 0.9


def resolve_device(setting: str) -> str:
    """``"auto"`` → ``"cuda"`` when this process sees a GPU, else ``"cpu"``."""
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def default_budget(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory * _CUDA_BUDGET_FRACTION)
    return _CPU_DEFAULT_BUDGET


class PlexRLWorkerPlugin(WorkerPlugin):
    """See the module docstring."""

    name = "plexrl-worker"

    def setup(self, worker: Any) -> None:
        cfg = WorkerConfig.from_dask_config()
        if worker.state.total_resources.get(cfg.gpu_resource, 0) < 1:
            return
        import torch

        torch.set_num_threads(cfg.torch_threads)
        if os.environ.get("MALLOC_TRIM_THRESHOLD_"):
            logger.warning(
                "MALLOC_TRIM_THRESHOLD_ is set in this worker (Dask's default pre-spawn "
                "environment): it makes torch allocations page-fault and ran training ~2x "
                "slower in our measurements. Set distributed.nanny.pre-spawn-environ."
                "MALLOC_TRIM_THRESHOLD_ to null in the workers' Dask config"
            )
        device = resolve_device(cfg.device)
        budget = cfg.memory_budget if cfg.memory_budget is not None else default_budget(device)
        holder = ReplicaHolder(
            worker_address=worker.address,
            device=device,
            budget_bytes=budget,
            max_batch_size=int(config.get("sampling.max-batch-size")),
            report=lambda msg: worker.log_event(RESIDENCY_TOPIC, msg),
        )
        worker.state.actors[HOLDER_KEY] = holder

        # The holder's lock may be held by a running request: never take it on the event loop.
        async def holder_status() -> dict[str, Any]:
            return await asyncio.get_running_loop().run_in_executor(None, holder.status)

        async def holder_drop(name: str) -> bool:
            return await asyncio.get_running_loop().run_in_executor(None, holder.drop, name)

        worker.handlers["plexrl_holder_status"] = holder_status
        worker.handlers["plexrl_holder_drop"] = holder_drop
        worker.log_event(WORKER_TOPIC, holder.capacity())
        logger.info("PlexRL holder on %s: %s, budget %.0f MiB", worker.address, device, budget / 2**20)

    def teardown(self, worker: Any) -> None:
        worker.state.actors.pop(HOLDER_KEY, None)
        for handler in ("plexrl_holder_status", "plexrl_holder_drop"):
            worker.handlers.pop(handler, None)
