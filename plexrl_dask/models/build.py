"""A :class:`~plexrl_dask.models.spec.ModelSpec` made into a model, its tokenizer and its
sizes: the half of the models package that needs torch and transformers.

Specs travel everywhere (the scheduler keeps them in its deployment records); building happens
on workers and drivers. ``ModelSpec``'s methods reach this module as
``plexrl_dask.models.build``, which imports it on first use, so a process that only handles
specs never loads the model stack.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from plexrl_dask.errors import InvalidModelSpec
from plexrl_dask.models.lora import attach_adapter
from plexrl_dask.models.tokenizer import build_char_tokenizer

if TYPE_CHECKING:
    from plexrl_dask.models.spec import ModelSpec

_HF_IMPORT = threading.Lock()
# Each spec's modules on the meta device, built once per process (build_empty copies them).
_FRAMES: dict[ModelSpec, Any] = {}
_FRAMES_LOCK = threading.Lock()


def hf(name: str) -> Any:
    """``transformers.<name>``, resolved under a lock: transformers resolves its names lazily,
    and threads that first touch it at once (jobs deploying in parallel) can see a name
    missing ("cannot import name 'Qwen2Config'")."""
    with _HF_IMPORT:
        return getattr(importlib.import_module("transformers"), name)


def torch_dtype(spec: ModelSpec) -> torch.dtype:
    """The spec's dtype as torch's."""
    return getattr(torch, spec.dtype)


def hf_config(spec: ModelSpec) -> Any:
    """The ``transformers`` config of the model (read from disk for a checkpoint)."""
    if spec.config is not None:
        return hf("Qwen2Config")(**dict(spec.config))
    spec.check_path()
    with _checkpoint_errors(spec, "its config"):
        return hf("AutoConfig").from_pretrained(spec.path, local_files_only=True)


@contextlib.contextmanager
def _checkpoint_errors(spec: ModelSpec, what: str) -> Iterator[None]:
    """What Hugging Face raises reading a checkpoint (a file missing or malformed, a model
    type it does not know) as :class:`InvalidModelSpec` naming the checkpoint."""
    try:
        yield
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, InvalidModelSpec):
            raise
        raise InvalidModelSpec(f"{spec.path}: cannot read {what}: {e}") from e


def num_parameters(spec: ModelSpec) -> int:
    """Parameter count, computed on the meta device (no memory, no weights read)."""
    with torch.device("meta"):
        model = hf("AutoModelForCausalLM").from_config(hf_config(spec))
    return sum(p.numel() for p in model.parameters())


def adapter_parameters(spec: ModelSpec) -> int:
    """Parameters of the spec's LoRA adapter (0 without one): ``rank × (in + out)`` per
    wrapped linear module, counted on the meta device."""
    if spec.lora is None:
        return 0
    with torch.device("meta"):
        model = hf("AutoModelForCausalLM").from_config(hf_config(spec))
    wrapped = [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in spec.lora.targets
    ]
    if not wrapped:
        raise InvalidModelSpec(
            f"no linear module of {spec.base.name} is named one of {spec.lora.targets}"
        )
    return sum(spec.lora.rank * (m.in_features + m.out_features) for m in wrapped)


def build_tokenizer(spec: ModelSpec) -> Any:
    """The character tokenizer of a tiny model, or a checkpoint's own."""
    if spec.config is not None:
        return build_char_tokenizer()
    spec.check_path()
    with _checkpoint_errors(spec, "its tokenizer"):
        tokenizer = hf("AutoTokenizer").from_pretrained(spec.path, local_files_only=True)
    if len(tokenizer) <= 1:  # (a directory without tokenizer files gives one of one token)
        raise InvalidModelSpec(f"{spec.path}: no tokenizer (tokenizer.json and its config)")
    return tokenizer


def build_model(spec: ModelSpec, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The model on ``device`` in the spec's dtype, deterministically (with ``lora``: the base
    with the adapter's seeded initial weights; only the adapter trains)."""
    if spec.lora is not None:
        return attach_adapter(build_model(spec.base, device), spec.lora)
    auto_model = hf("AutoModelForCausalLM")
    if spec.config is not None:
        # Seed a private generator state so init does not depend on what ran before. The
        # model is built on the CPU: only the CPU generator is seeded (and restored after),
        # so the CUDA generators of the process are left as they were.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(spec.seed)
            model = auto_model.from_config(hf_config(spec), attn_implementation="sdpa")
        model = model.to(dtype=torch_dtype(spec))
    else:
        spec.check_path()
        with _checkpoint_errors(spec, "its weights"):
            model, info = auto_model.from_pretrained(
                spec.path, local_files_only=True, dtype=torch_dtype(spec),
                attn_implementation="sdpa", output_loading_info=True,
            )  # fmt: skip
        missing = sorted(info.get("missing_keys") or ())
        if missing:  # (Hugging Face would initialise them at random, apart on every worker)
            raise InvalidModelSpec(
                f"{spec.path}: the checkpoint has no weights for {missing[:5]}"
                f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}"
            )
    return model.to(device)


def build_empty(spec: ModelSpec, device: str | torch.device) -> torch.nn.Module:
    """The model's modules on ``device`` with uninitialised parameters and buffers (see
    :meth:`ModelSpec.build_empty`)."""
    with _FRAMES_LOCK:
        frame = _FRAMES.get(spec)
        if frame is None:  # (constructing the modules costs ~4x copying a built frame)
            with torch.device("meta"):
                frame = hf("AutoModelForCausalLM").from_config(
                    hf_config(spec), attn_implementation="sdpa"
                )
            _FRAMES[spec] = frame = frame.to(dtype=torch_dtype(spec))
        model = copy.deepcopy(frame)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    return model
