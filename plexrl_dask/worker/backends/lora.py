"""LoRA adapters on a base model held once per worker.

A LoRA deployment (``ModelSpec.with_lora``) trains only its adapter: PEFT's LoRA layers
(``peft.inject_adapter_in_model``) around the linear modules its spec names, on a frozen base.
Every LoRA replica on one worker whose base is the same spec uses the same base tensors:
:class:`~plexrl_dask.worker.backends.shared.SharedBases` builds a base once and hands out its parameters; each replica has a module
tree of its own (a copy of the base's modules that shares the base's parameter and buffer
tensors, with its adapter injected), so requests of different adapters never switch adapters
in a shared module and a replica's state is just its adapter, its gradients and its AdamW
moments. The holder counts a base's bytes once, besides its adapters' (``state_bytes``).

Offload moves the adapter state to host memory (to the node's store, like any replica's) and
drops the replica's module tree, so the base is freed when no resident adapter uses it;
reload builds the tree again on the (possibly rebuilt) base and restores the adapter and its
optimizer bit for bit. Decoding goes through the Hugging Face forward with the adapter
applied (the stream decoder's weight-level step and the static engine read base weights
only); batch-invariant requests (``Streams.invariant``: the Tinker front door's merged calls)
decode through :mod:`plexrl_dask.worker.row_decode` on a step that adds the adapter to each
product (``TorchBackend.row_step``). One adapter per request: an adapter bank
(:mod:`plexrl_dask.worker.backends.adapters`) decodes the rows of many adapters in one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plexrl_dask.errors import InvalidModelSpec, OpNotSupported
from plexrl_dask.models.lora import attach_adapter
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.worker.backends.shared import SharedBases
from plexrl_dask.worker.backends.torch_backend import TorchBackend
from plexrl_dask.worker.device import copy_stream
from plexrl_dask.worker.optimizer import new_adamw


class _AdapterView:
    """What the checkpoint functions read of a model, restricted to the adapter's
    parameters (checkpoints and published weights of a LoRA replica hold only its adapter)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def named_parameters(self) -> Any:
        return ((n, p) for n, p in self._model.named_parameters() if p.requires_grad)


class LoraBackend(TorchBackend):
    """A LoRA adapter's replica on a shared base (see the module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        device: str | torch.device,
        max_batch_size: int = 64,
        bases: SharedBases | None = None,
        user: str = "",
        tokenizer: Any = None,
    ) -> None:
        """``bases``: the worker's shared bases (default: a private one); ``user`` names
        this replica to them; ``tokenizer``: the base's, already built (default: built)."""
        if spec.lora is None:
            raise InvalidModelSpec(f"{spec.name} has no LoRA adapter: use the torch backend")
        self.bases = SharedBases(device) if bases is None else bases
        self.user = user or f"lora-{id(self):x}"
        super().__init__(spec, device, max_batch_size, tokenizer=tokenizer)

    def _build_model(self) -> torch.nn.Module:
        base = self.bases.acquire(self.spec.base, self.user)
        return attach_adapter(base, self.spec.lora)  # type: ignore[arg-type]

    def _weights(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def _checkpointed(self) -> Any:
        return _AdapterView(self.model)

    def _dcp_refused(self) -> OpNotSupported:
        return OpNotSupported(
            f"{self.spec.name}: a LoRA adapter is checkpointed to the state store "
            "(save_state to a store checkpoint), not to a DCP directory"
        )

    # --- residency -------------------------------------------------------------------------

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's parameters, gradients and optimizer state (the base is not this
        replica's: :class:`SharedBases` counts it once)."""
        weights = self._weights()
        out: dict[str, torch.Tensor] = {}
        for n, p in weights.items():
            out[f"param/{n}"] = p.data
            if p.grad is not None:
                out[f"grad/{n}"] = p.grad
        if self.optimizer is not None:
            for n, p in weights.items():
                for k, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"optim/{n}/{k}"] = v
        return out

    def shared_bytes(self) -> int:
        """This adapter's share of its base while it holds it (what its residency reports
        add, so the scheduler's view of the worker counts the base once, over its users)."""
        return self.bases.share(self.spec.base, self.user) if self.resident else 0

    def reload_bytes(self) -> int:
        """Device bytes a reload takes: the adapter's state, and its base unless held."""
        base = 0 if self.bases.held(self.spec.base) else self.spec.base.memory_bytes("rollout")
        return self.state_bytes() + base

    def offload(
        self, stash: Callable[[dict[str, Any]], Any] | None = None, stored: Any = None
    ) -> None:
        """Move the adapter's state to host memory (or keep ``stored``, a copy of exactly
        it), drop this replica's module tree and release the base."""
        if self._host is not None:
            return
        if stored is not None:
            kept = stored
        else:
            weights = self._weights()
            opt = self.optimizer
            with copy_stream(self.device):
                host: dict[str, Any] = {
                    "params": {n: self._to_host(p.data) for n, p in weights.items()},
                    "grads": {
                        n: self._to_host(p.grad) for n, p in weights.items() if p.grad is not None
                    },
                    "buffers": {},
                    "optim": {
                        n: {k: self._to_host(v) for k, v in opt.state[p].items()}
                        for n, p in weights.items()
                        if opt is not None and opt.state.get(p)
                    },
                    "optim_groups": None
                    if opt is None
                    else [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                    "bytes": self.state_bytes(),
                }
            kept = host if stash is None else stash(host)
        self.model = None  # type: ignore[assignment]
        self._adapter_step = None  # (it holds the module tree, and through it the base)
        self.optimizer = None
        self._host = kept
        self.bases.release(self.spec.base, self.user)

    def reload(self) -> None:
        """Build the module tree on the base again and restore the adapter's state."""
        if self._host is None:
            return
        host = self._host_state()
        self.model = self._build_model()
        weights = self._weights()
        with torch.no_grad(), copy_stream(self.device, after_default=False):
            for n, p in weights.items():
                p.data = host["params"][n].to(self.device, non_blocking=True)
                g = host["grads"].get(n)
                p.grad = None if g is None else g.to(self.device, non_blocking=True)
        groups = host.get("optim_groups")
        if groups is not None:
            self.optimizer = new_adamw(weights.items())
            for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
                group.update(saved)
            for n, st in host["optim"].items():
                self.optimizer.state[weights[n]] = {
                    k: v.to(self.device) if v.dim() else v.clone() for k, v in st.items()
                }
        self._host = None

    def close(self) -> None:
        """Release the base (the holder dropped this replica)."""
        self.bases.release(self.spec.base, self.user)
