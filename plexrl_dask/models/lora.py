"""LoRA adapters as modules: PEFT's LoRA layers injected into a model of the base's
architecture (what ``ModelSpec.build_model`` builds for a spec with ``lora``, and what each
LoRA replica of :mod:`plexrl_dask.worker.backends.lora` builds over its worker's shared base)."""

from __future__ import annotations

import copy
import itertools
import warnings

import torch

from plexrl_dask.models.spec import LoraSpec


def attach_adapter(base: torch.nn.Module, lora: LoraSpec) -> torch.nn.Module:
    """A module tree of ``base``'s architecture that shares every parameter and buffer
    tensor of ``base`` (frozen) and has ``lora``'s adapter injected (float32, seeded init,
    no dropout); only the adapter's parameters require gradients."""
    from peft import LoraConfig, inject_adapter_in_model

    shared = itertools.chain(base.parameters(), base.buffers())
    tree = copy.deepcopy(base, memo={id(t): t for t in shared})
    for p in tree.parameters():
        p.requires_grad_(False)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.targets),
        lora_dropout=0.0,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(lora.seed)  # (the adapter's init, whatever ran before)
        # An adapter on a tied unembedding adapts the output projection only (the input
        # embedding stays the base's), as intended; PEFT warns about merging such adapters.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        inject_adapter_in_model(config, tree)
    for name, p in tree.named_parameters():
        if ".lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
    return tree
