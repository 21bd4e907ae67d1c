"""Models held once per worker for every replica that reads them unchanged.

:class:`SharedBases` builds a frozen model of a spec once per worker and hands it out; the
holder counts its bytes once, and each user's residency report adds an even share of them.
Two kinds of replica use it:

- LoRA adapters, whose base it is (:mod:`plexrl_dask.worker.backends.lora`);
- :class:`SharedWeightsBackend`: a rollout replica whose weights are still its spec's (never
  loaded, synced or set), e.g. several jobs' reference models of one base, or several Tinker
  tenants' samplers of a base model. It samples and scores with the shared model, and a
  request that would change its weights (the holder's ``MUTATING_OPS``) first gives it a
  private copy (:meth:`SharedWeightsBackend.private_copy`, copy on write). Its offload drops
  its reference (nothing to keep: its weights are its spec's); its reload takes it again.

``plexrl.worker.share-frozen-weights`` turns the second kind on (default) or off.
"""

from __future__ import annotations

import copy
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.worker.backends.torch_backend import TorchBackend
from plexrl_dask.worker.decode_step import DecodeStep
from plexrl_dask.worker.static_decode import engine_for


@dataclass
class _Base:
    model: torch.nn.Module
    nbytes: int
    users: set[str] = field(default_factory=set)
    # One decode step for every user: its weight layout (fused, transposed copies) is made
    # once per base, not once per replica, and counts in the base's bytes.
    step: DecodeStep | None = None

    def total_bytes(self) -> int:
        return self.nbytes + (0 if self.step is None else self.step.nbytes())


class SharedBases:
    """The frozen models of one worker's replicas that share them (LoRA adapters' bases, and
    unmodified rollout replicas of one spec), each built once and freed when its last user
    releases it."""

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
                held = self._held[spec] = _Base(model, nbytes, step=DecodeStep.for_model(model))
            held.users.add(user)
            return held.model

    def step_of(self, spec: ModelSpec) -> DecodeStep | None:
        """The decode step every user of ``spec``'s base shares (None where none is held,
        or its architecture has none)."""
        with self._lock:
            held = self._held.get(spec)
            return None if held is None else held.step

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
            n, total = len(held.users), held.total_bytes()
            first = min(held.users) == user
            return total // n + (total % n if first else 0)

    def held(self, spec: ModelSpec) -> bool:
        with self._lock:
            return spec in self._held

    def nbytes(self) -> int:
        """Device bytes of every base held."""
        with self._lock:
            return sum(b.total_bytes() for b in self._held.values())

    def status(self) -> dict[str, dict[str, Any]]:
        """Per base held (by its checkpoint path, or a built model's name), its bytes and
        users."""
        with self._lock:
            return {
                s.path or s.name: {"bytes": b.total_bytes(), "users": sorted(b.users)}
                for s, b in self._held.items()
            }


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each distinct parameter and buffer of ``model`` once (tied weights once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        seen.setdefault(id(t), t)
    return list(seen.values())


class SharedWeightsBackend(TorchBackend):
    """An unmodified rollout replica on its worker's shared copy of its spec's model (see
    the module docstring). ``user`` names it to ``bases``."""

    #: Offload keeps nothing: the weights are the spec's, held by whoever else uses them.
    stashes = False

    def __init__(
        self, spec: ModelSpec, device: str | torch.device, max_batch_size: int,
        bases: SharedBases, user: str,
    ) -> None:  # fmt: skip
        self.bases, self.user = bases, user
        super().__init__(spec, device, max_batch_size)
        self.decode_step = bases.step_of(spec)  # (the base's, shared with its other users)

    def _build_model(self) -> torch.nn.Module:
        return self.bases.acquire(self.spec, self.user)

    def state_bytes(self) -> int:
        """Its own bytes: the decoders' caches (the weights, and the decode step's layout of
        them, are the shared base's)."""
        if self._host is not None:
            return 0
        static = 0 if self.static is None else self.static.nbytes()
        return static + (0 if self.prefix_cache is None else self.prefix_cache.nbytes())

    def shared_bytes(self) -> int:
        """Its share of the shared model while it holds it (see :meth:`SharedBases.share`)."""
        return self.bases.share(self.spec, self.user) if self.resident else 0

    def reload_bytes(self) -> int:
        return 0 if self.bases.held(self.spec) else self.spec.memory_bytes("rollout")

    def offload(self, stash: Any = None, stored: Any = None) -> None:
        """Release the shared model (and the decoders' caches built on it)."""
        if self._host is not None:
            return
        # Its own caches go; the shared decode step's layout stays for the base's other
        # users (it goes with the base, with its last user).
        self.decode_step = None
        self.release_decoders()
        # (the decoders hold the modules: dropped, so the model goes with its last user)
        self.model, self.decode_step, self.static = None, None, None  # type: ignore[assignment]
        self._host = {"bytes": 0}
        self.bases.release(self.spec, self.user)

    def reload(self) -> None:
        if self._host is None:
            return
        self.model = self._build_model()
        self.decode_step = self.bases.step_of(self.spec)
        self.static = engine_for(self)
        self._host = None

    def close(self) -> None:
        if self._host is None:
            self.bases.release(self.spec, self.user)
            self._host = {"bytes": 0}

    def private_copy(self) -> TorchBackend:
        """A plain replica with a copy of the weights of its own (for a request that changes
        them), at this one's version; this one lets go of the shared model."""
        if self._host is not None:
            self.reload()
        model = copy.deepcopy(self.model)
        model.requires_grad_(True)
        own = TorchBackend(
            self.spec, self.device, self.max_batch_size, model=model, tokenizer=self.tokenizer
        )
        own.version = self.version
        self.close()
        return own
