"""The device a worker's replicas run on, its default memory budget, torch's threads, its cores,
and the CUDA streams that copies between host and device run on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

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


@contextlib.contextmanager
def copy_stream(device: torch.device, after_default: bool = True) -> Iterator[None]:
    """Run the enclosed copies between host and ``device`` on a CUDA stream of their own,
    and wait for those copies alone when the block ends (on the CPU: nothing to do).

    Offloads and reloads run beside another replica's request (a prefetch runs in its own
    thread; a request makes room by offloading idle replicas). On the default stream their
    copies would queue behind that request's kernels, and a device-wide synchronize would
    wait for all of them; on a stream of their own they go to the copy engines meanwhile.

    ``after_default``: the stream first waits for what is already queued on the default
    stream. An offload needs it: its copies read device tensors that queued kernels (the
    replica's last optimizer step) may still write. A reload does not (``False``): it reads
    pinned host memory, and writes device memory allocated here, on this stream, which the
    caching allocator hands only to this stream's work, and only once the streams that used
    it are done with it. Tensors made here are used on the default stream afterwards:
    :func:`used_by_default_stream` marks them so."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device=device)
    if after_default:
        stream.wait_stream(torch.cuda.default_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def used_by_default_stream(tensors: Iterable[torch.Tensor], device: torch.device) -> None:
    """Mark device ``tensors`` made inside :func:`copy_stream` as used on the default stream
    (the caching allocator then waits for that stream before it reuses their memory)."""
    if device.type != "cuda":
        return
    default = torch.cuda.default_stream(device)
    for t in tensors:
        if t.device.type == "cuda":
            t.record_stream(default)


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes this process holds for ``t`` (its local shard, for a DTensor)."""
    # (a DTensor's shard as it holds it: ``to_local`` goes through an autograd function,
    # ~30 us a tensor, and the holder sums every replica's bytes before every request)
    local = getattr(t, "_local_tensor", None)
    if local is None:
        local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()
