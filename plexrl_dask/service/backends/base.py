"""The interfaces a backend implements.

A replica holder drives backends only through these methods, so a vLLM engine (rollout) or a
multi-rank FSDP2 group (training) plugs in behind the same holder, runtime and scheduler.

Residency vocabulary (DESIGN §3): a backend is *resident* when its state is in device memory
("hbm" tier) and runnable; ``offload`` moves its state to host memory ("dram" tier) and frees
the device; ``reload`` brings it back. ``sleep``/``wake`` are the rollout-engine names of the same
two transitions (vLLM's ``sleep(level=1)`` / ``wake_up``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from plexrl_dask.service.types import (
    AdamWParams,
    Datum,
    ForwardResult,
    Loss,
    SampledSequence,
    SamplingParams,
    Streams,
)


@runtime_checkable
class Backend(Protocol):
    """What every backend offers the holder: weights by canonical name, residency moves."""

    version: int

    def state_bytes(self) -> int:
        """Device bytes the replica occupies while resident (weights, grads, optimizer)."""

    @property
    def resident(self) -> bool: ...

    def offload(
        self, stash: Callable[[dict[str, Any]], Any] | None = None, stored: Any = None
    ) -> None:
        """Move all state to host memory and free the device memory it used. ``stash``
        takes the host state and returns what the backend keeps instead (a handle on a copy
        in the node's tiers, with ``load()``); it runs before the device memory is freed.
        ``stored``: such a handle on a copy of exactly the current state, kept instead of
        copying the state to the host at all."""

    def reload(self) -> None:
        """Bring offloaded state back to the device, bit-identical."""

    def get_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Host copies of the parameters, keyed by canonical (unsharded HF) names."""

    def set_weights(
        self, weights: Mapping[str, torch.Tensor], version: int | None = None, strict: bool = True
    ) -> None:
        """Overwrite parameters by canonical name; ``strict`` requires every name."""


@runtime_checkable
class RolloutBackend(Backend, Protocol):
    """A generation engine."""

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        streams: Streams | None = None,
    ) -> list[list[SampledSequence]]:
        """``params.n`` completions of each prompt; randomness keyed by ``prompt_ids``; rows
        decoded in ``streams`` (a request split at stream boundaries samples exactly like one
        that is not)."""

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@runtime_checkable
class TrainBackend(Backend, Protocol):
    """A trainable model."""

    def forward(self, batch: Sequence[Datum], temperature: float = 1.0) -> ForwardResult: ...

    def forward_backward(self, batch: Sequence[Datum], loss: Loss) -> dict[str, float]:
        """Accumulate gradients of ``loss`` over ``batch``; return its metrics."""

    def optim_step(self, params: AdamWParams) -> dict[str, float]:
        """Apply the accumulated gradients with AdamW, then clear them."""

    def save_state(self, path: str) -> dict:
        """Write parameters and optimizer state as a checkpoint loadable at any world size."""

    def load_state(self, path: str) -> int:
        """Restore a checkpoint; returns its version."""
