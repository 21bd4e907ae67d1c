"""``ModelSpec``: what model a deployment runs, independent of where it runs.

A spec is a small frozen dataclass that travels to workers and is turned into a model there, so
every replica of one spec starts bit-identical: ``ModelSpec.tiny(...)`` builds a Qwen2-architecture
model with a seeded random init and a locally built tokenizer; ``ModelSpec(path=...)`` loads a
local Hugging Face checkpoint (model + tokenizer) with the same code path. Nothing is fetched from
a hub: loads pass ``local_files_only=True``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from plexrl_dask import models
from plexrl_dask.errors import InvalidModelSpec
from plexrl_dask.models.tokenizer import CHARACTERS, SPECIAL_TOKENS

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Bytes per parameter of each dtype. torch and transformers are plexrl_dask.models.build's,
# loaded where a model is first built or sized: the scheduler handles specs and never needs
# them (a preloaded scheduler that imported them held 400,573 tracked objects against 138,365
# without, measured, and every full garbage collection of its event loop walks them).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# Adam keeps two fp32 moments per parameter, and training holds a gradient per parameter.
_ADAM_STATE_BYTES_PER_PARAM = 8
#: The linear layers a LoRA adapter wraps by default: every projection of a Qwen2/Llama block
#: (what Tinker adapts: attention and MLP).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter (PEFT's ``LoraConfig``) trained on a frozen base model: ``rank`` and
    ``alpha`` (the update is scaled by ``alpha / rank``), the names of the linear modules it
    wraps, and the seed of its random init (A uniform, B zero: the adapter starts as the base).
    Adapter parameters are kept in float32 whatever the base's dtype."""

    rank: int
    alpha: float = 32.0
    targets: tuple[str, ...] = LORA_TARGETS
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidModelSpec(f"a LoRA rank is an integer >= 1, got {self.rank!r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
            math.isfinite(alpha) and alpha > 0
        ):
            raise InvalidModelSpec(f"a LoRA alpha is a finite number > 0, got {alpha!r}")
        if (
            not isinstance(self.targets, (list, tuple))
            or not self.targets
            or not all(isinstance(t, str) and t for t in self.targets)
        ):
            raise InvalidModelSpec(f"LoRA targets are a list of module names, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidModelSpec(f"a LoRA seed is an integer, got {self.seed!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "seed": self.seed}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraSpec:
        return cls(int(d["rank"]), float(d["alpha"]), tuple(d["targets"]), int(d["seed"]))


@dataclass(frozen=True)
class ModelSpec:
    """A model to deploy.

    Exactly one of ``path`` (a local HF checkpoint directory) or ``config`` (keyword arguments of
    ``transformers.Qwen2Config``, filled in by :meth:`tiny`) is set. ``seed`` fixes the random
    init of a config-built model; ``dtype`` is the parameter dtype on the device. With
    ``lora``, the model is that adapter on this (frozen) base: its replicas on one worker
    share the base's weights (:meth:`with_lora`, :attr:`base`).
    """

    path: str | None = None
    config: tuple[tuple[str, Any], ...] | None = None
    seed: int = 0
    dtype: str = "float32"
    label: str = field(default="", compare=False)
    lora: LoraSpec | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.config is None):
            raise InvalidModelSpec("give exactly one of ModelSpec(path=...) or ModelSpec.tiny(...)")
        if self.dtype not in _DTYPE_BYTES:
            raise InvalidModelSpec(f"dtype {self.dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        # The path is checked where it is read (client at deploy, worker at load), not here:
        # the scheduler handles specs of paths that exist only on the workers' filesystem.

    # --- constructors ------------------------------------------------------------------

    @classmethod
    def tiny(
        cls,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int | None = None,
        max_positions: int = 256,
        seed: int = 0,
        dtype: str = "float32",
    ) -> ModelSpec:
        """A small Qwen2-architecture model with random init and the character tokenizer."""

        sizes = (hidden_size, num_layers, num_heads, num_kv_heads, max_positions)
        sizes += () if intermediate_size is None else (intermediate_size,)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*sizes, seed)):
            raise InvalidModelSpec(f"tiny model sizes and seed must be integers, got {sizes}")
        if min(sizes) < 1:
            raise InvalidModelSpec("tiny model sizes must all be positive")
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise InvalidModelSpec(
                f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) and "
                f"num_heads by num_kv_heads ({num_kv_heads})"
            )
        cfg = {
            "vocab_size": len(SPECIAL_TOKENS) + len(CHARACTERS),
            "hidden_size": hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "intermediate_size": intermediate_size or 4 * hidden_size,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "attention_dropout": 0.0,
        }
        label = f"tiny-h{hidden_size}-l{num_layers}-s{seed}"
        return cls(config=tuple(sorted(cfg.items())), seed=seed, dtype=dtype, label=label)

    def with_lora(
        self,
        rank: int,
        alpha: float = 32.0,
        targets: tuple[str, ...] = LORA_TARGETS,
        seed: int = 0,
    ) -> ModelSpec:
        """A LoRA adapter of ``rank`` on this model as its frozen base."""
        if self.lora is not None:
            raise InvalidModelSpec(f"{self.name} is already a LoRA adapter")
        return replace(self, lora=LoraSpec(rank, float(alpha), tuple(targets), seed))

    @property
    def base(self) -> ModelSpec:
        """The frozen base model (this spec itself when it has no adapter)."""
        return self if self.lora is None else replace(self, lora=None)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able form (for scheduler handlers and events)."""
        return {
            "path": self.path,
            "config": None if self.config is None else [list(kv) for kv in self.config],
            "seed": self.seed,
            "dtype": self.dtype,
            "label": self.label,
            "lora": None if self.lora is None else self.lora.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        config = d.get("config")
        lora = d.get("lora")
        return cls(
            path=d.get("path"),
            config=None if config is None else tuple((k, v) for k, v in config),
            seed=int(d.get("seed", 0)),
            dtype=d.get("dtype", "float32"),
            label=d.get("label", ""),
            lora=None if lora is None else LoraSpec.from_dict(lora),
        )

    # --- what it is ----------------------------------------------------------------------

    @property
    def name(self) -> str:
        """A readable name for logs and the dashboard."""
        name = self.label or (
            os.path.basename(os.path.normpath(self.path)) if self.path else "model"
        )
        return name if self.lora is None else f"{name}+lora-r{self.lora.rank}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return models.build.torch_dtype(self)

    def hf_config(self) -> Any:
        """The ``transformers`` config of the model (read from disk for a checkpoint)."""
        return models.build.hf_config(self)

    def check_path(self) -> None:
        """:class:`InvalidModelSpec` unless ``path`` is a checkpoint directory here."""
        if not os.path.isfile(os.path.join(str(self.path), "config.json")):
            raise InvalidModelSpec(
                f"{self.path!r} is not a Hugging Face checkpoint directory on this machine "
                "(no config.json there)"
            )

    def num_parameters(self) -> int:
        """Parameter count, computed on the meta device (no memory, no weights read)."""
        return models.build.num_parameters(self)

    def adapter_parameters(self) -> int:
        """Parameters of the LoRA adapter (0 without one): ``rank × (in + out)`` per wrapped
        linear module, counted on the meta device."""
        return 0 if self.lora is None else models.build.adapter_parameters(self)

    def adapter_bytes(self, role: str) -> int:
        """Device bytes of the adapter's own state: float32 weights, and for training their
        gradients and AdamW moments."""
        n = self.adapter_parameters()
        return n * (4 + 4 + _ADAM_STATE_BYTES_PER_PARAM if role == "train" else 4)

    def memory_bytes(self, role: str) -> int:
        """Device bytes one replica needs: weights for rollout; weights, gradients and AdamW
        moments for training. A LoRA adapter needs its base's weights (shared with every
        other adapter on that base on the same worker) and its own state. (KV-cache memory
        of sampling is bounded by the sampling batch size and checked when sampling, not
        here.)"""
        if self.lora is not None:
            return self.base.memory_bytes("rollout") + self.adapter_bytes(role)
        n = self.num_parameters()
        weight_bytes = n * _DTYPE_BYTES[self.dtype]
        if role == "train":
            return 2 * weight_bytes + n * _ADAM_STATE_BYTES_PER_PARAM
        return weight_bytes

    # --- building (plexrl_dask.models.build) ---------------------------------------------

    def build_tokenizer(self) -> Any:
        """The model's tokenizer (the character tokenizer of a tiny model)."""
        return models.build.build_tokenizer(self)

    def build_model(self, device: str | torch.device = "cpu") -> torch.nn.Module:
        """Build the model on ``device`` in ``self.dtype``, deterministically (with ``lora``:
        the base with the adapter's seeded initial weights; only the adapter trains)."""
        return models.build.build_model(self, device)

    def build_empty(self, device: str | torch.device) -> torch.nn.Module:
        """The model's modules on ``device`` with uninitialised parameters and buffers (no
        init runs, no weights are read): a frame for values copied in from elsewhere.
        Tensors a module keeps as plain attributes (not parameters or buffers) stay on the
        meta device; the caller copies those too."""
        return models.build.build_empty(self, device)

    def save_pretrained(self, directory: str) -> ModelSpec:
        """Write this model and tokenizer as a Hugging Face checkpoint in ``directory`` and
        return the ``ModelSpec(path=directory)`` that loads it."""
        os.makedirs(directory, exist_ok=True)
        self.build_model("cpu").save_pretrained(directory)
        self.build_tokenizer().save_pretrained(directory)
        with open(os.path.join(directory, "plexrl_spec.json"), "w") as f:
            json.dump({"source": self.name, "seed": self.seed, "dtype": self.dtype}, f)
        return ModelSpec(path=directory, dtype=self.dtype)
