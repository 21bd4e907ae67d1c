"""The device a worker's replicas run on, its default memory budget, torch's threads, its cores."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch

from plexrl_dask.errors import ConfigError

#: The ``"auto"`` budget on the CPU, and the share of a GPU's memory it takes there.
CPU_DEFAULT_BUDGET = 4 * 2**30
CUDA_BUDGET_FRACTION = 0.9


def resolve_device(setting: str) -> str:
    """``"auto"`` → ``"cuda"`` when this process sees a GPU, else ``"cpu"``."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def default_budget(device: str) -> int:
    """The ``"auto"`` memory budget: 90 % of the GPU, or 4 GiB on the CPU."""
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        return int(total * CUDA_BUDGET_FRACTION)
    return CPU_DEFAULT_BUDGET


def fix_threads(n: int) -> None:
    """Run torch's intra-op work on ``n`` threads in this process: results must not depend on
    how a worker's cores are split (docs/architecture.md, "Sampling and determinism").
    Hugging Face tokenizers' own pool (a thread per core, used to encode a batch of prompts)
    is turned off unless ``TOKENIZERS_PARALLELISM`` says otherwise: its threads spin for a
    while after each batch, on the cores the worker's request and event loop need, for
    prompts that take well under a millisecond to encode on one thread."""
    torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def bind_cpus(cpus: Iterable[int]) -> list[int]:
    """Bind every thread of this process to ``cpus``: the threads running now (the event
    loop, Dask's, torch's), and through them the ones they start later, which inherit it.
    Returns the cores this process may use afterwards. ``OSError`` where ``cpus`` are not this
    process's to use (its cgroup or launcher gave it others);
    :class:`~plexrl_dask.errors.ConfigError` off Linux. Binding changes no result: torch's
    thread count is fixed either way."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        raise ConfigError("binding a worker's threads to cores (PLEXRL_WORKER_CPUS) needs Linux")
    before = os.sched_getaffinity(0)
    try:
        _set_every_thread(set(cpus))
    except OSError:
        _set_every_thread(before)  # (all threads or none)
        raise
    return sorted(os.sched_getaffinity(0))


def _set_every_thread(cores: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(int(tid), cores)
