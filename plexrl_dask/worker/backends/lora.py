"""LoRA adapters on a base model held once per worker.

A LoRA deployment (``ModelSpec.with_lora``) trains only its adapter: PEFT's LoRA layers
(``peft.inject_adapter_in_model``) around the linear modules its spec names, on a frozen base.
Every LoRA replica on one worker whose base is the same spec uses the same base tensors:
:class:`SharedBases` builds a base once and hands out its parameters; each replica has a module
tree of its own (a copy of the base's modules that shares the base's parameter and buffer
tensors, with its adapter injected), so requests of different adapters never switch adapters
in a shared module and a replica's state is just its adapter, its gradients and its AdamW
moments. The holder counts a base's bytes once, besides its adapters' (``state_bytes``).

Offload moves the adapter state to host memory (to the node's store, like any replica's) and
drops the replica's module tree, so the base is freed when no resident adapter uses it;
reload builds the tree again on the (possibly rebuilt) base and restores the adapter and its
optimizer bit for bit. Decoding goes through the Hugging Face forward with the adapter
applied (the weight-level decode step and the static engine read base weights only, so
:mod:`plexrl_dask.worker.decode_step` refuses models with adapters). One adapter per request:
requests of several adapters are not batched into one decode here.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from plexrl_dask.errors import InvalidModelSpec, OpNotSupported
from plexrl_dask.models.lora import attach_adapter
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.worker.backends.torch_backend import TorchBackend, copy_stream


@dataclass
class _Base:
    model: torch.nn.Module
    nbytes: int
    users: set[str] = field(default_factory=set)


class SharedBases:
    """The frozen base models of one worker's LoRA replicas, each built once and freed when
    its last user releases it."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._held: dict[ModelSpec, _Base] = {}
        self._lock = threading.Lock()

    def acquire(self, spec: ModelSpec, user: str) -> torch.nn.Module:
        """``spec``'s model (built on first use), with ``user`` counted as holding it."""
        with self._lock:
            held = self._held.get(spec)
            if held is None:
                model = spec.build_model(self.device)
                model.requires_grad_(False)
                model.eval()
                nbytes = sum(t.numel() * t.element_size() for t in _tensors(model))
                held = self._held[spec] = _Base(model, nbytes)
            held.users.add(user)
            return held.model

    def release(self, spec: ModelSpec, user: str) -> None:
        """``user`` no longer holds ``spec``; the base is freed with its last user."""
        with self._lock:
            held = self._held.get(spec)
            if held is None:
                return
            held.users.discard(user)
            if not held.users:
                del self._held[spec]

    def share(self, spec: ModelSpec, user: str) -> int:
        """``user``'s share of ``spec``'s base bytes: its bytes split evenly over its users,
        the remainder to the first by name, so the shares sum to the base exactly (0 when
        ``user`` does not hold it)."""
        with self._lock:
            held = self._held.get(spec)
            if held is None or user not in held.users:
                return 0
            n = len(held.users)
            first = min(held.users) == user
            return held.nbytes // n + (held.nbytes % n if first else 0)

    def held(self, spec: ModelSpec) -> bool:
        with self._lock:
            return spec in self._held

    def nbytes(self) -> int:
        """Device bytes of every base held."""
        with self._lock:
            return sum(b.nbytes for b in self._held.values())

    def status(self) -> dict[str, dict[str, Any]]:
        """Per base held (by its checkpoint path, or a built model's name), its bytes and
        users."""
        with self._lock:
            return {
                s.path or s.name: {"bytes": b.nbytes, "users": sorted(b.users)}
                for s, b in self._held.items()
            }


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each distinct parameter and buffer of ``model`` once (tied weights once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        seen.setdefault(id(t), t)
    return list(seen.values())


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
    ) -> None:
        """``bases``: the worker's shared bases (default: a private one); ``user`` names
        this replica to them."""
        if spec.lora is None:
            raise InvalidModelSpec(f"{spec.name} has no LoRA adapter: use the torch backend")
        self.bases = SharedBases(device) if bases is None else bases
        self.user = user or f"lora-{id(self):x}"
        super().__init__(spec, device, max_batch_size)

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
            self.optimizer = torch.optim.AdamW(list(weights.values()))
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
