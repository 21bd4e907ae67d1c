"""The device a worker's replicas run on, its default memory budget, torch's threads."""

from __future__ import annotations

import os

import torch

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
