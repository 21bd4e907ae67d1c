"""One rank of a training deployment sharded with FSDP2 over a worker process group.

Every rank builds the model from its spec (the seeded init is identical everywhere), then
``fully_shard`` splits each decoder layer and the root over the group's 1-D mesh: each rank keeps
a dim-0 shard of every parameter, gradient and AdamW moment. Each request runs on all ranks at
once (the scheduler plugin releases the gang atomically), each on its own contiguous part of the
batch. Every rank normalises its loss by the whole batch's weight and scales it by the world
size before ``backward``, which FSDP's mean reduction divides out again (exactly, for a power of
two; gloo has no pre-multiplied sum to set the divide factor to 1): a step equals one process
training on the combined batch.

Validation and the non-finite-loss check are agreed across ranks (one all-reduce), so a bad
input fails on every rank instead of leaving the others waiting in a collective.

``get_weights`` gathers whole tensors (returned by rank 0 only); ``save_state`` writes each
rank's shards through DCP, restorable on any world size.

Sampling on the training group (verl's "hybrid engine"; a colocated job over k workers): each
rank decodes its contiguous share of the request's sampling streams on a whole copy of the
weights gathered from the shards, then frees it; the tokens equal a rollout replica's with the
same weights and seeds. The copy counts against the worker's budget; where it does not fit
beside the training state, the rank's gradients and AdamW moments wait on the host meanwhile.

Offload moves a rank's local shards to host memory and frees its module; the next request
rebuilds the module on its group (the same one, or a new one if the workers ran another group
in between) and copies the shards back, bit for bit.

Building: every rank builds the whole model in host memory (the seeded init, or a checkpoint
read), never on the device. ``fully_shard`` moves each unit's parameters and buffers to the
mesh's device as it shards that unit (FSDP2's ``_move_states_to_device``), so a GPU holds
the shards made so far and at most one unit unsharded, not the whole model: a deployment
too large for one GPU can still be built across several. (Limit: the host holds the whole
model once per rank while it is built, and a rebuild runs the init again before the shards
are copied in.)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from plexrl_dask.errors import ConfigError, DeploymentDoesNotFit, EmptyBatch
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.shared.types import SampledSequence, SamplingParams, Streams
from plexrl_dask.worker.backends.torch_backend import TorchBackend
from plexrl_dask.worker.device import copy_stream
from plexrl_dask.worker.groups import ProcessGroupManager
from plexrl_dask.worker.optimizer import new_adamw, norm_parameter_names
from plexrl_dask.worker.replica_checkpoint import local_shard

logger = logging.getLogger(__name__)


def check_device(device: torch.device, current: Callable[[], int]) -> None:
    """Raise :class:`ConfigError` for a CUDA device other than the thread's current one
    (``current()``): FSDP2 puts the shards on the current device whatever the module's
    device, so the shards and the inputs would end up on different GPUs. One worker per GPU
    (``CUDA_VISIBLE_DEVICES``; ``local_cluster`` does this) keeps every rank on "cuda"."""
    if device.type == "cuda" and device.index is not None and device.index != current():
        raise ConfigError(
            f"a sharded deployment runs on the current CUDA device ({current()}), not on "
            f"{device}: give each worker one GPU through CUDA_VISIBLE_DEVICES and use 'cuda'"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself where it is not split)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` (this rank's shard) as a DTensor laid out like parameter ``p``."""
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _rows(n: int, world: int) -> list[int]:
    """Rows of a dimension of ``n`` each rank holds under FSDP2's ``torch.chunk`` convention
    (ranks past the last chunk hold none)."""
    step = -(-n // world) if n else 0
    return [max(0, min(step, n - r * step)) for r in range(world)]


#: The most bytes of whole values one all-gather of :func:`gather_into` brings in (a larger
#: tensor alone): what the gather adds to the copy's memory at its peak.
GATHER_BUCKET_BYTES = 64 * 2**20


def gather_into(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """Copy the whole value of each of ``sources`` (this replica's parameters, in the same
    order on every rank) into the matching ``targets``. Parameters sharded on dim 0 of a 1-D
    mesh travel in buckets of up to :data:`GATHER_BUCKET_BYTES`, one all-gather per bucket
    (per mesh and dtype) rather than one collective per tensor: on a small model, dozens of
    collectives cost more than their bytes (a 2-rank sample's fixed cost was 86 ms with one per
    tensor, 39 ms bucketed, on the mix's countdown4 over gloo). Any other
    parameter is gathered on its own."""
    buckets: list[tuple[Any, torch.dtype, list[int]]] = []
    filling: dict[tuple[Any, torch.dtype], tuple[list[int], list[int]]] = {}
    for i, p in enumerate(sources):
        if not isinstance(p, DTensor):
            targets[i].copy_(p.detach())
            continue
        if len(p.placements) != 1 or p.placements[0] != Shard(0):
            targets[i].copy_(p.full_tensor().detach())
            continue
        key = (p.device_mesh, p.dtype)
        nbytes = p.numel() * p.element_size()
        members, size = filling.get(key, ([], [GATHER_BUCKET_BYTES]))
        if not members or size[0] + nbytes > GATHER_BUCKET_BYTES:
            members, size = [], [0]
            filling[key] = (members, size)
            buckets.append((p.device_mesh, p.dtype, members))
        members.append(i)
        size[0] += nbytes
    for mesh, dtype, members in buckets:
        _gather_bucket(mesh, dtype, [sources[i] for i in members], [targets[i] for i in members])


# torch 2.13 names the one-tensor all-gather all_gather_single (all_gather_into_tensor, the
# name before, warns that it is deprecated); the same collective either way.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_bucket(
    mesh: Any, dtype: torch.dtype, sources: list[torch.Tensor], targets: list[torch.Tensor]
) -> None:
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = [_rows(p.shape[0], world) for p in sources]
    per_row = [math.prod(p.shape[1:]) for p in sources]
    sizes = [sum(r[k] * n for r, n in zip(rows, per_row, strict=True)) for k in range(world)]
    local = [p.to_local().detach().reshape(-1) for p in sources]
    assert sum(t.numel() for t in local) == sizes[rank], "FSDP2's chunking changed"
    width = max(sizes)
    mine = torch.zeros(width, dtype=dtype, device=local[0].device)
    torch.cat(local, out=mine[: sizes[rank]])
    every = torch.empty(world * width, dtype=dtype, device=mine.device)
    _all_gather(every, mine, group=mesh.get_group())
    at = [k * width for k in range(world)]
    for p, target, r, n in zip(sources, targets, rows, per_row, strict=True):
        start = 0
        for k in range(world):
            if r[k]:
                part = every[at[k] : at[k] + r[k] * n].view(r[k], *p.shape[1:])
                target.narrow(0, start, r[k]).copy_(part)
            at[k] += r[k] * n
            start += r[k]


class FSDPBackend(TorchBackend):
    """Rank ``groups.current.rank`` of an FSDP2-sharded replica (see the module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        device: str | torch.device,
        groups: ProcessGroupManager,
        max_batch_size: int = 64,
    ):
        check_device(torch.device(device), torch.cuda.current_device)
        super().__init__(spec, device, max_batch_size)
        # A sharded rank samples through a gathered copy (see sample), never with its own
        # module: a decode step would only keep it, and every shard and gradient, alive
        # after an offload.
        self.decode_step = None
        self.static = None
        self._parked: dict[str, dict[str, torch.Tensor]] | None = None
        self._copy_bytes = 0  # the gathered copy's, while a sample runs
        assert groups.current is not None and groups.mesh is not None
        self.groups = groups
        self.mesh = groups.mesh
        self.epoch_key = groups.current.key
        self.rank = groups.current.rank
        self.world_size = groups.current.world_size
        self._shard()

    def _shard(self) -> None:
        """Split the model over the group: FSDP2 over each decoder layer and the root."""
        block_types = set(getattr(self.model, "_no_split_modules", None) or ())
        for module in self.model.modules():
            if type(module).__name__ in block_types:
                fully_shard(module, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)

    # --- collective hooks ------------------------------------------------------------------

    def _build_model(self) -> torch.nn.Module:
        # On the host: fully_shard below moves each unit to the device as it shards it (see
        # the module docstring). The same values as built on the device: the init runs on
        # the CPU either way.
        return self.spec.build_model("cpu")

    def _agree(self, ok: bool) -> bool:
        return self.groups.all_ok(ok)

    def _gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def _distributed(self) -> bool:
        return True

    def _world(self) -> int:
        return self.world_size

    def _rank(self) -> int:
        return self.rank

    def get_weights(self, names: Any = None) -> dict[str, torch.Tensor]:
        """Whole tensors on rank 0 (every rank takes part in the all-gathers); other ranks
        return nothing, so only one copy travels."""
        weights = super().get_weights(names)
        return weights if self.rank == 0 else {}

    def _backward(self, loss: torch.Tensor) -> None:
        (loss * self.world_size).backward()

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        return p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()

    def _assign(self, p: torch.Tensor, value: torch.Tensor) -> None:
        if not isinstance(p, DTensor):
            p.copy_(value)
            return
        # Every rank has the whole value: take the local shard without any communication.
        p.to_local().copy_(local_shard(p, value))

    def _reshard(self) -> None:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def forward(self, batch: Any, temperature: float = 1.0, top: int = 0) -> Any:
        try:
            return super().forward(batch, temperature, top)
        finally:
            # FSDP2 leaves the root unsharded after a forward (expecting a backward): put the
            # parameters back into their sharded form, which the optimizer state refers to.
            self._reshard()

    def forward_backward(self, batch: Any, loss: Any, logprobs: bool = False) -> Any:
        try:
            return super().forward_backward(batch, loss, logprobs)
        except Exception:
            # Failed after the forward (agreed bad loss, non-finite loss): without a backward
            # the root stays unsharded, and the next set_weights/optim_step would act on the
            # temporary unsharded tensors.
            self._reshard()
            raise

    # --- sampling on the training group (the hybrid engine) ----------------------------

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        streams: Streams | None = None,
    ) -> list[list[SampledSequence]]:
        """This rank's share of a request sampled on the training group: ``prompts`` are the
        rank's contiguous part (possibly none; every rank takes part in the gather either way).

        Checked and agreed on every rank before any collective: the prompts, and room in the
        worker's budget for a whole copy of the weights. Where the copy does not fit beside
        the training state, this rank's gradients and AdamW moments are parked on the host
        for the rollout and brought back bit for bit after it; where it does not fit even
        then, :class:`DeploymentDoesNotFit` on every rank, every rank's state as it was.
        Then the whole weights are gathered, tensor by tensor, into a plain copy, the copy
        samples exactly as a rollout replica holding the same weights would (the same
        decoding code, the same streams), and it is freed."""
        given, prompts = prompts, [list(p) for p in prompts]

        def check() -> bool:
            if prompts:
                self._check_tokens(prompts, extra=params.max_tokens, what="prompt")
            if len(prompt_ids) != len(prompts):
                raise EmptyBatch(f"{len(prompt_ids)} prompt ids for {len(prompts)} prompts")
            return self._room_for_copy()

        try:
            self._checked(check)
            copy = self._gathered()
            self._copy_bytes = copy.state_bytes()
            copy.version = self.version
            if copy.prefix_cache is not None:
                # this rank's cache across copies (in its bytes; emptied when the weights
                # change), so a colocated multi-turn job's next turn finds its prompt
                copy.prefix_cache = self.prefix_cache
            # (the prompts as given: a TurnPrompt's turns decide how the copy prefills it)
            return copy.sample(given, params, prompt_ids, streams) if prompts else []
        finally:
            copy = None
            self._copy_bytes = 0
            self._unpark()

    def gathered_bytes(self) -> int:
        """Device bytes of a whole copy of the weights (what :meth:`sample` gathers)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + sum(
            b.numel() * b.element_size() for b in self.model.buffers()
        )

    def _room_for_copy(self) -> bool:
        """Make room for the copy in the worker's budget (parking this rank's gradients and
        moments if that is what it takes); True if it parked them. Raises
        :class:`DeploymentDoesNotFit`, with nothing parked, where it cannot."""
        need = self.gathered_bytes()
        if self.room is None or self.room(need):
            return False
        self._park()
        if self.room(need):
            return True
        self._unpark()
        raise DeploymentDoesNotFit(
            f"rank {self.rank} of a {self.world_size}-rank deployment has no room for a "
            f"{need / 2**20:.1f} MiB copy of the weights to sample with, even with its "
            "gradients and optimizer state moved to the host: give the workers a larger "
            "memory budget, or sample from a rollout deployment"
        )

    def _park(self) -> None:
        """Move this rank's gradient and optimizer-state shards to the host (the copy's room)."""
        self._reshard()
        parked: dict[str, dict[str, torch.Tensor]] = {}
        with copy_stream(self.device):
            for n, p in self.model.named_parameters():
                mine: dict[str, torch.Tensor] = {}
                if p.grad is not None:
                    mine["grad"] = self._to_host(p.grad.to_local())
                    p.grad = None
                state = {} if self.optimizer is None else self.optimizer.state.get(p, {})
                for k, v in list(state.items()):
                    if isinstance(v, DTensor):
                        mine[f"optim/{k}"] = self._to_host(v.to_local())
                        del state[k]
                if mine:
                    parked[n] = mine
        self._parked = parked

    def _unpark(self) -> None:
        """Bring back what :meth:`_park` moved (bit for bit); nothing if nothing is parked."""
        parked, self._parked = self._parked, None
        if parked is None:
            return
        params = dict(self.model.named_parameters())
        with copy_stream(self.device, after_default=False):
            for n, mine in parked.items():
                p = params[n]
                for key, local in mine.items():
                    value = _like(p, local.to(self.device, non_blocking=True))
                    if key == "grad":
                        p.grad = value
                    else:
                        self.optimizer.state[p][key.split("/", 1)[1]] = value  # type: ignore[union-attr]

    def _gathered(self) -> TorchBackend:
        """A plain (unsharded) replica on this rank's device holding the whole weights,
        gathered bucket by bucket (:func:`gather_into`: at most one bucket's whole values exist
        twice)."""
        self._reshard()
        model = self.spec.build_empty(self.device)
        with torch.no_grad():
            own = dict(model.named_parameters())
            mine = list(self.model.named_parameters())  # (the same order on every rank)
            gather_into([p for _, p in mine], [own[n] for n, _ in mine])
            own_buffers = dict(model.named_buffers())
            for n, b in self.model.named_buffers():
                own_buffers[n].copy_(b)
            # Plain tensor attributes (rotary tables' originals) were left on the meta device.
            sources = dict(self.model.named_modules())
            for name, module in model.named_modules():
                for attr, value in vars(module).items():
                    if isinstance(value, torch.Tensor) and value.is_meta:
                        setattr(module, attr, getattr(sources[name], attr).clone())
        model.eval()
        return TorchBackend(
            self.spec, self.device, self.max_batch_size, model=model, tokenizer=self.tokenizer
        )

    # --- offload, and a new group ---------------------------------------------------------

    def _export(self) -> dict[str, Any]:
        """This rank's local shards (parameters, gradients, optimizer state) and counters, on
        the host (pinned buffers on CUDA; on the CPU the tensors are handed over uncopied)."""
        self._reshard()  # a forward leaves the root unsharded; the optimizer refers to shards
        with copy_stream(self.device):  # beside another request: see copy_stream
            params = dict(self.model.named_parameters())
            optim: dict[str, dict[str, torch.Tensor]] = {}
            if self.optimizer is not None:
                for n, p in params.items():
                    optim[n] = {
                        k: self._to_host(_local(v))
                        for k, v in self.optimizer.state.get(p, {}).items()
                        if isinstance(v, torch.Tensor)
                    }
            state = {
                "params": {n: self._to_host(_local(p).detach()) for n, p in params.items()},
                "grads": {
                    n: self._to_host(_local(p.grad))
                    for n, p in params.items()
                    if p.grad is not None
                },
                "optim": optim,
                "hyper": None
                if self.optimizer is None
                else [
                    {k: v for k, v in g.items() if k != "params"}
                    for g in self.optimizer.param_groups
                ],
                "version": self.version,
                "pending_backward": self.pending_backward,
                "bytes": self.state_bytes(),
            }
        return state

    def offload(self, stash: Any = None, stored: Any = None) -> None:
        """Move this rank's shards to host memory (or into ``stash``, or keep ``stored``
        instead, as in :meth:`TorchBackend.offload`) and free the module. The process group
        is left alone; the next request rebuilds the module on whatever group it then needs."""
        if self._host is not None:
            return
        self.forget_prefixes()
        if stored is not None:
            self._host = stored
        else:
            state = self._export()
            self._host = state if stash is None else stash(state)
        self.model, self.optimizer = None, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        raise RuntimeError("a sharded rank reloads through rebuilt(groups), on its group")

    def state_bytes(self) -> int:
        if self._host is not None:
            return int(self._host["bytes"])
        return super().state_bytes() + self._copy_bytes

    def rebuilt(self, groups: ProcessGroupManager) -> FSDPBackend:  # (or the subclass's)
        """This rank's state (resident or offloaded) on the group ``groups`` now holds (same
        rank and world size). FSDP2 binds parameters to a mesh, so the module is built anew and
        the local shards of parameters, gradients and optimizer state are copied in bit for
        bit."""
        state = self._host_state() if self._host is not None else self._export()
        new = type(self)(self.spec, self.device, groups, self.max_batch_size)
        new.room = self.room
        new.version, new.pending_backward = state["version"], state["pending_backward"]
        params = dict(new.model.named_parameters())

        with torch.no_grad():
            for n, p in params.items():
                _local(p).copy_(state["params"][n])
                if n in state["grads"]:
                    p.grad = _like(p, state["grads"][n].to(self.device, non_blocking=True))
        if state["hyper"] is not None:
            new.optimizer = new_adamw(params.items(), norm_parameter_names(new.model))
            for group, old in zip(new.optimizer.param_groups, state["hyper"], strict=True):
                group.update(old)
            for n, st in state["optim"].items():
                p = params[n]
                new.optimizer.state[p] = {
                    k: (_like(p, v.to(self.device, non_blocking=True)) if v.dim() > 0 else v)
                    for k, v in st.items()
                }
        logger.info("rank %d rebuilt on group %s", new.rank, new.epoch_key)
        return new
