"""One rank of a tensor-parallel rollout replica: a model split over a worker process group.

``deploy(name, spec, role="rollout", replicas=R, tensor_parallel=t)`` runs R replicas of t
workers each; the scheduler releases every request to all t ranks of one replica at once (the
gang rules of training groups: all ranks or none). Each rank builds the model from its spec and
splits it with torch's tensor-parallel plan over the group's 1-D mesh, Megatron's layout: in
every decoder layer q, k, v and the MLP's gate and up projections are split by output
(``ColwiseParallel``: each rank holds whole heads and a slice of the MLP's width), o and down by
input (``RowwiseParallel``, whose outputs are summed over the ranks); embeddings, norms and the
output head stay whole on every rank. Attention runs on each rank's own heads with the same
code as one worker, since transformers sizes heads from the projections' outputs.

Every rank decodes the whole request: the sums leave the same hidden states on every rank, so
each computes the same logits and, with the per-row seeded sampling, the same tokens; rank 0's
result is returned (``whole_on_every_rank``). Log-probabilities equal one worker's to float
rounding (partial sums are added in another order), so a token may differ where rounding flips
a choice; ``bench.weight_sync`` measures the agreement.

Weights arrive as each rank's slices (``load_weights`` from the state store reads only the
regions its placements hold; ``set_weights`` cuts them from whole tensors). Offload keeps the
local shards on the host and a request rebuilds the split model on its group, as for training
groups (:mod:`plexrl_dask.worker.backends.fsdp`, whose machinery this shares). Training ops are
refused: a rollout replica only samples and scores. On the CPU (gloo) this is about
correctness, not speed: the sums cost more than the split saves at these sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from plexrl_dask.errors import ConfigError
from plexrl_dask.worker.backends.base import NotATrainer
from plexrl_dask.worker.backends.fsdp import FSDPBackend
from plexrl_dask.worker.backends.torch_backend import TorchBackend

#: The plan of one Qwen2/Llama decoder layer (module path under the layer -> style).
LAYER_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM of the Qwen2/Llama family."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(
            f"tensor parallelism knows the Qwen2/Llama layout (model.layers), not {type(model).__name__}"
        )
    return list(layers)


class TPBackend(NotATrainer, FSDPBackend):
    """Rank ``groups.current.rank`` of a tensor-parallel rollout replica (see the module
    docstring)."""

    #: Every rank computes a request's whole result; rank 0 returns it.
    whole_on_every_rank = True

    def _shard(self) -> None:
        for layer in decoder_layers(self.model):
            plan = {
                path: ColwiseParallel() if style == "colwise" else RowwiseParallel()
                for path, style in LAYER_PLAN.items()
            }
            parallelize_module(layer, self.mesh, plan)
        self.model.to(self.device)  # what the plan left whole (embeddings, norms, head)

    def _build_model(self) -> torch.nn.Module:
        return TorchBackend._build_model(self)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        # Every rank decodes the whole request through the HF forward (the split model's
        # collectives run inside it), no gathered copy.
        return TorchBackend.sample(self, *args, **kwargs)

    trainer_hint = (
        "a tensor-parallel rollout replica samples and scores; train a training deployment "
        "and sync_weights into it"
    )
