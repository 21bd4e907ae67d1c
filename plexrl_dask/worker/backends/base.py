"""The interfaces a backend implements.

A replica holder drives backends only through these methods, so a vLLM engine (rollout) or a
multi-rank FSDP2 group (training) plugs in behind the same holder, runtime and scheduler.

Residency vocabulary (docs/architecture.md, "Residency reports"): a backend is *resident* when its state is in device memory
("hbm" tier) and runnable; ``offload`` moves its state to host memory ("dram" tier) and frees
the device; ``reload`` brings it back. ``sleep``/``wake`` are the rollout-engine names of the same
two transitions (vLLM's ``sleep(level=1)`` / ``wake_up``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from plexrl_dask.errors import OpNotSupported, WeightsMismatch
from plexrl_dask.shared.types import (
    AdamWParams,
    Datum,
    ForwardBackwardResult,
    ForwardResult,
    Loss,
    SampledSequence,
    SamplingParams,
    Streams,
)


def check_weights(
    params: Mapping[str, torch.Tensor], weights: Mapping[str, Any], strict: bool
) -> None:
    """Refuse ``weights`` (by canonical name) that do not fit ``params`` (a model's named
    parameters; meta tensors will do): unknown names, missing ones when ``strict``, a
    non-tensor, a tensor that is not a dense one holding data (sparse, meta), another shape,
    a float/integer mismatch, or floats that are finite as given but not once cast to the
    parameter's dtype (1e39 in float64 for a float32 parameter). :class:`WeightsMismatch`."""
    unknown = sorted(set(weights) - set(params))
    missing = sorted(set(params) - set(weights)) if strict else []
    if unknown or missing:
        raise WeightsMismatch(
            f"set_weights names do not match the model: unknown {unknown[:5]}, "
            f"missing {missing[:5]} (pass strict=False to update a subset)"
        )
    for n, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise WeightsMismatch(f"{n}: a torch.Tensor is needed, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_meta:
            raise WeightsMismatch(f"{n}: a dense tensor holding data is needed, got {t.layout}"
                                  f"{' on meta' if t.is_meta else ''}")  # fmt: skip
        if tuple(t.shape) != tuple(params[n].shape):
            raise WeightsMismatch(
                f"{n}: shape {tuple(t.shape)} does not match the model's {tuple(params[n].shape)}"
            )
        if t.is_floating_point() != params[n].is_floating_point():
            raise WeightsMismatch(f"{n}: dtype {t.dtype} cannot be copied into {params[n].dtype}")
        target = params[n].dtype
        if (
            t.is_floating_point()
            and t.dtype != target
            and torch.finfo(t.dtype).max > torch.finfo(target).max
            and not bool(torch.isfinite(t.to(target)).all())
        ):
            raise WeightsMismatch(f"{n}: values beyond {target}'s range; nothing was written")


class NotATrainer:
    """For rollout-only backends: the training ops raise :class:`OpNotSupported`, saying
    ``trainer_hint`` (where to train instead)."""

    trainer_hint = "this deployment only samples; train a training deployment"

    def _not_a_trainer(self, op: str) -> OpNotSupported:
        return OpNotSupported(f"{op}: {self.trainer_hint}")

    def forward_backward(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("forward_backward")

    def optim_step(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("optim_step")

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("train_step")

    def save_state(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("save_state")


@runtime_checkable
class Backend(Protocol):
    """What every backend offers the holder: weights by canonical name, residency moves.
    A backend may also have ``close()`` (called when the holder drops the replica: an engine
    process, files of its own)."""

    version: int
    #: Whether ``offload`` hands its host state to the holder's ``stash`` (kept in the node's
    #: tiers); False for an engine that keeps its own host copy (vLLM's sleep).
    stashes: bool

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

    def forward(
        self, batch: Sequence[Datum], temperature: float = 1.0, top: int = 0
    ) -> ForwardResult: ...

    def forward_backward(
        self, batch: Sequence[Datum], loss: Loss, logprobs: bool = False
    ) -> dict[str, float] | ForwardBackwardResult:
        """Accumulate gradients of ``loss`` over ``batch``; return its metrics (with
        ``logprobs``, a :class:`ForwardBackwardResult` with the per-token log-probabilities
        too)."""

    def optim_step(self, params: AdamWParams) -> dict[str, float]:
        """Apply the accumulated gradients with AdamW, then clear them."""

    def train_step(
        self, batch: Sequence[Datum], loss: Loss, params: AdamWParams
    ) -> dict[str, dict[str, float]]:
        """:meth:`forward_backward` then :meth:`optim_step`: both results, by op."""

    def save_state(self, path: str) -> dict:
        """Write parameters and optimizer state as a checkpoint loadable at any world size."""

    def load_state(self, path: str) -> int:
        """Restore a checkpoint; returns its version."""
