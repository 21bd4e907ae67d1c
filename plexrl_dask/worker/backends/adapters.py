"""An adapter bank: one base model and many LoRA adapters on it, sampled in one decode.

A LoRA replica (:mod:`plexrl_dask.worker.backends.lora`) is one adapter, and a request is one
replica's: concurrent samples of eight tenants' adapters on one base are eight requests, each
decoding its few rows alone. A bank (``deploy(name, base_spec, role="rollout",
backend="adapters")``) holds its base once per worker (the worker's
:class:`~plexrl_dask.worker.backends.shared.SharedBases`, the very tensors its LoRA replicas
there use) and any number of adapters, each a *snapshot*: loaded from a stored version of a
LoRA deployment (``Deployment.load_adapter(key, spec, saved)``, what ``save_state`` returned)
and never changed after. A sample request names an adapter per prompt (or none: the base
alone). The adapters' rows decode together with the batch-invariant row decoder
(:mod:`plexrl_dask.worker.row_decode`): each product computes the base's part for all of them
at once and each adapter's part for that adapter's rows, so a row's tokens are the bits it
samples alone, on its own LoRA replica, whichever adapters its companions use. The base's
prompts decode apart, on the replica's own step (its weight copies included: the faster
layout), as in a request of the base alone, and so sample what a plain replica of the base
samples.

State and residency: the bank's own bytes are its adapters' parameters (the base is counted
once, shared). Offload writes the adapters to the node's store like any replica's state and
drops their module trees; reload builds them again on the base. A bank whose worker is lost
comes back empty: its adapters are not part of a spec, so a request naming one it no longer
holds fails with :class:`~plexrl_dask.errors.AdapterNotFound`, and its owner loads the adapter
again from the stored version (``plexrl serve`` does). A bank does not train and takes no
weights: those requests are :class:`~plexrl_dask.errors.OpNotSupported`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from plexrl_dask.errors import AdapterNotFound, InvalidModelSpec, OpNotSupported
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.shared.types import (
    ForwardResult,
    SampledSequence,
    SamplingParams,
    Streams,
)
from plexrl_dask.worker.backends.base import NotATrainer
from plexrl_dask.worker.backends.lora import LoraBackend
from plexrl_dask.worker.backends.shared import SharedBases, SharedWeightsBackend
from plexrl_dask.worker.decode_step import DecodeStep
from plexrl_dask.worker.device import copy_stream
from plexrl_dask.worker.row_decode import RowDecoder


class AdapterBank(NotATrainer, SharedWeightsBackend):
    """A base and its loaded adapters (see the module docstring); ``user`` names the bank
    to ``bases``."""

    #: Offload writes the adapters to the node's store.
    stashes = True

    def __init__(
        self, spec: ModelSpec, device: str | torch.device, max_batch_size: int = 64,
        bases: SharedBases | None = None, user: str = "",
    ) -> None:  # fmt: skip
        if spec.lora is not None:
            raise InvalidModelSpec(
                f"an adapter bank is deployed with its base model's spec, not {spec.name}"
            )
        self.adapters: dict[str, LoraBackend] = {}
        self._specs: dict[str, ModelSpec] = {}  # (kept while offloaded)
        self._base_step: DecodeStep | None = None
        bases = SharedBases(device) if bases is None else bases
        super().__init__(spec, device, max_batch_size, bases, user or f"bank-{id(self):x}")

    # --- adapters ---------------------------------------------------------------------------

    def load_adapter(self, key: str, spec: ModelSpec, source: Any) -> int:
        """Load adapter ``key`` (``spec``: the LoRA deployment's, on this bank's base) from
        ``source`` (a stored version of its state: its parameters only are read); replaces a
        loaded adapter of that key. Returns the adapter's version. Nothing changes if the
        load fails (an adapter of another base or shape is
        :class:`~plexrl_dask.errors.InvalidModelSpec` / ``WeightsMismatch``)."""
        if spec.lora is None or spec.base != self.spec:
            raise InvalidModelSpec(
                f"adapter {key!r}: {spec.name} is not a LoRA adapter on {self.spec.name}"
            )
        adapter = self._adapter(key, spec)
        try:
            version = adapter.load_state(source, optimizer=False)
        except BaseException:
            adapter.close()
            raise
        old = self.adapters.pop(key, None)
        if old is not None:
            old.close()
        self._specs.pop(key, None)  # (both tables in one order: the offload's names follow it)
        self.adapters[key], self._specs[key] = adapter, spec
        return version

    def drop_adapter(self, key: str) -> bool:
        """Unload adapter ``key``; whether it was loaded."""
        self._specs.pop(key, None)
        adapter = self.adapters.pop(key, None)
        if adapter is None:
            return False
        adapter.close()
        return True

    def _adapter(self, key: str, spec: ModelSpec) -> LoraBackend:
        return LoraBackend(
            spec, self.device, self.max_batch_size, bases=self.bases,
            user=f"{self.user}|{key}", tokenizer=self.tokenizer,
        )  # fmt: skip

    def _named(self, keys: Sequence[str | None]) -> list[LoraBackend | None]:
        missing = sorted({k for k in keys if k is not None and k not in self.adapters})
        if missing:
            raise AdapterNotFound(
                f"this bank of {self.spec.name} holds no adapter {missing[0]!r} (held: "
                f"{len(self.adapters)}); load it with load_adapter"
            )
        return [None if k is None else self.adapters[k] for k in keys]

    # --- requests ---------------------------------------------------------------------------

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        streams: Streams | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[list[SampledSequence]]:
        """As :meth:`TorchBackend.sample`; ``adapters``: per prompt, the key of the adapter
        its rows decode with (None: the base). Prompts of adapters always decode with the
        batch-invariant row decoder."""
        if adapters is None or all(a is None for a in adapters):
            return super().sample(prompts, params, prompt_ids, streams)
        if len(adapters) != len(prompts):
            raise AdapterNotFound(f"{len(adapters)} adapter keys for {len(prompts)} prompts")
        named = self._named(adapters)
        prompts = [list(p) for p in prompts]
        self._check_sample(prompts, params, prompt_ids)
        if any(a is None for a in adapters):
            # The base's prompts decode as they do in a request of the base alone (on the
            # replica's own step, its weight copies included), the adapters' on the step
            # without copies: each prompt the same bits whatever it is merged with.
            return self._base_and_adapters(prompts, params, prompt_ids, streams, adapters)
        lora = [a for a in named if a is not None]
        assert len(lora) == len(named)  # (every prompt has an adapter here)
        base = self._base_row_step()
        steps = [a.row_step() for a in lora]
        if base is None or any(s is None for s in steps):
            raise OpNotSupported(
                f"{self.spec.name}: adapters decode only where the weight-level decode step "
                "runs (plexrl.sampling.decode-step: auto, a Qwen2 or Llama model)"
            )
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        self.model.eval()
        with torch.inference_mode():
            try:
                decoder = RowDecoder(self, base, prompts, rows, params, prompt_ids, steps)
            except OpNotSupported:  # (no row-invariant products on this device)
                return self._one_at_a_time(prompts, params, prompt_ids, streams, lora)
            done = decoder.run()
        return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _base_and_adapters(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        streams: Streams | None,
        adapters: Sequence[str | None],
    ) -> list[list[SampledSequence]]:
        """A request of base prompts and adapters' prompts: the two parts decoded apart."""
        base = [i for i, a in enumerate(adapters) if a is None]
        mine = [i for i, a in enumerate(adapters) if a is not None]
        out: list[list[SampledSequence]] = [[] for _ in prompts]
        parts = (
            (base, super().sample([prompts[i] for i in base], params,
                                  [prompt_ids[i] for i in base], streams)),
            (mine, self.sample([prompts[i] for i in mine], params,
                               [prompt_ids[i] for i in mine], streams,
                               [adapters[i] for i in mine])),
        )  # fmt: skip
        for indices, groups in parts:
            for i, group in zip(indices, groups, strict=True):
                out[i] = group
        return out

    def _one_at_a_time(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        streams: Streams | None,
        lora: list[LoraBackend],
    ) -> list[list[SampledSequence]]:
        """Where rows cannot be decoded batch-invariantly: each prompt on its adapter's
        replica as a stream of its own, which is what it samples alone there."""
        refill = (streams or Streams.from_config()).refill_min_rows
        own = Streams(params.n, refill, invariant=False)
        return [
            adapter.sample([p], params, [pid], own)[0]
            for p, pid, adapter in zip(prompts, prompt_ids, lora, strict=True)
        ]

    def forward(
        self,
        batch: Sequence[Any],
        temperature: float = 1.0,
        adapter: str | None = None,
        top: int = 0,
    ) -> ForwardResult:
        """Log-probabilities under the base, or under adapter ``adapter`` (and ``top``: see
        :meth:`TorchBackend.forward`)."""
        if adapter is None:
            return super().forward(batch, temperature, top)
        (lora,) = self._named([adapter])
        assert lora is not None
        return lora.forward(batch, temperature, top)

    def _base_row_step(self) -> DecodeStep | None:
        """The base's step with no copies of its weights (adapters add to its products)."""
        step = self._base_step
        if step is None or step.model is not self.model:
            step = None
            if DecodeStep.for_model(self.model) is not None:
                step = DecodeStep(self.model, fuse_max_bytes=0)
            self._base_step = step
        return step

    #: No copy of the base of its own: requests that would change weights are refused.
    private_copy = None

    trainer_hint = (
        "an adapter bank samples and scores its adapters; it neither trains nor takes weights "
        "(train a LoRA deployment and load its saved state into the bank with load_adapter)"
    )

    def set_weights(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("set_weights")

    def load_weights(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("load_weights")

    def load_state(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("load_state")

    # --- residency --------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Its adapters' parameters (and the decoders' caches)."""
        if self._host is not None:
            return int(self._host["bytes"])
        return super().state_bytes() + sum(a.state_bytes() for a in self.adapters.values())

    def shared_bytes(self) -> int:
        """Its share of the base, and its adapters' (each holds the base as a user of its
        own), so that the shares the holder reports still sum to the base."""
        return super().shared_bytes() + sum(a.shared_bytes() for a in self.adapters.values())

    def reload_bytes(self) -> int:
        """Device bytes a reload takes: the adapters, and the base unless another holds it."""
        return self.state_bytes() + super().reload_bytes()

    def offload(
        self, stash: Callable[[dict[str, Any]], Any] | None = None, stored: Any = None
    ) -> None:
        """Write the adapters to host memory (``stash`` them, or keep ``stored``, a copy of
        exactly them), drop their module trees and release the base."""
        if self._host is not None:
            return
        kept = stored
        if kept is None:
            with copy_stream(self.device):
                params = {
                    f"a{i}.{n}": self._to_host(p.data)
                    for i, key in enumerate(self._specs)  # (reload names them in this order)
                    for n, p in self.adapters[key]._weights().items()
                }
            host = {"params": params, "grads": {}, "buffers": {}, "optim": {},
                    "optim_groups": None, "bytes": self.state_bytes()}  # fmt: skip
            kept = host if stash is None else stash(host)
        for a in self.adapters.values():
            a.close()
        self.adapters = {}
        self._base_step = None
        super().offload()
        self._host = kept

    def reload(self) -> None:
        """Build the base (if no other user holds it) and every adapter on it again."""
        if self._host is None:
            return
        host = self._host_state()
        self._host = {"bytes": 0}  # (SharedWeightsBackend.reload's marker of an offload)
        super().reload()
        with torch.no_grad(), copy_stream(self.device, after_default=False):
            for i, (key, spec) in enumerate(self._specs.items()):
                adapter = self._adapter(key, spec)
                for n, p in adapter._weights().items():
                    p.data = host["params"][f"a{i}.{n}"].to(self.device, non_blocking=True)
                self.adapters[key] = adapter

    def close(self) -> None:
        for a in self.adapters.values():
            a.close()
        self.adapters = {}
        super().close()

    def status(self) -> Mapping[str, Any]:
        """The adapters held (keys and bytes)."""
        return {k: a.state_bytes() for k, a in self.adapters.items()}
