"""A replica's state packed in one buffer, so that an offload or a reload is one copy.

Offloading tensor by tensor costs more than the bytes: on an H200 a training replica's
offload ran at 0.77 of one pinned ``copy_`` of the same bytes and its reload at 0.88
(`benchmarks/RESULTS.md`), the rest going to a copy launch and a host buffer per tensor, and to
handing the device blocks of hundreds of tensors back and asking for them again. Here the
state's tensors are laid out in one buffer at fixed, aligned offsets (:func:`layout`), in a
fixed order; :func:`pack` allocates the destination buffer once and copies into it. When the
source tensors already sit in one buffer in that same layout (what the previous pack left
them in), the whole buffer moves in a **single** copy; otherwise tensor by tensor into the
one buffer. The tensors handed back are views of the buffer: a reloaded replica's parameters,
buffers and optimizer moments are views of one device allocation, so its next offload is
again one copy, and freeing it returns one block.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

ALIGN = 256  # bytes: every tensor starts on a boundary the widest vector loads accept


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in a packed buffer (in ``tensors``' order, each start a
    multiple of :data:`ALIGN`) and the buffer's size."""
    offsets: dict[str, int] = {}
    at = 0
    for name, t in tensors.items():
        offsets[name] = at
        at += -(-_nbytes(t) // ALIGN) * ALIGN
    return offsets, at


def packed_in(flat: torch.Tensor | None, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor of ``tensors`` is the contiguous view of ``flat`` (a uint8
    buffer) that :func:`layout` puts it at, and ``flat`` is exactly that layout's size."""
    if flat is None:
        return False
    offsets, total = layout(tensors)
    if flat.numel() != total:
        return False
    base = flat.data_ptr()
    return all(
        t.is_contiguous() and t.device == flat.device and t.data_ptr() == base + offsets[n]
        for n, t in tensors.items()
    )


def pack(
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    pin_memory: bool = False,
    source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Copy ``tensors`` into one new uint8 buffer on ``device`` (pinned host memory with
    ``pin_memory``), laid out by :func:`layout`; returns the buffer and the copies, by name,
    as views of it. ``source``: a buffer the tensors may already be packed in
    (:func:`packed_in`): then it is copied whole, in one ``copy_``. Copies are
    ``non_blocking``: the caller synchronizes (its stream) before using the result."""
    offsets, total = layout(tensors)
    flat = torch.empty(total, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    views = {
        n: flat[offsets[n] : offsets[n] + _nbytes(t)].view(t.dtype).view(t.shape)
        for n, t in tensors.items()
    }
    if packed_in(source, tensors):
        assert source is not None
        flat.copy_(source, non_blocking=True)
    else:
        for n, t in tensors.items():
            views[n].copy_(t, non_blocking=True)
    return flat, views
