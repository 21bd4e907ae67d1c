"""A replica's AdamW: which parameters it decays, and each step's hyperparameters.

Every backend builds its optimizer here (first step, a restored checkpoint, a module rebuilt on
another process group, an adapter reloaded), so the parameter groups are the same wherever the
state goes: the trainable parameters in two groups, those ``AdamWParams.no_decay =
"biases-and-norms"`` leaves undecayed and the rest. Hyperparameters are set on every group at
every ``optim_step`` from its :class:`~plexrl_dask.shared.types.AdamWParams`, so a request's
parameters always win over what a rebuilt optimizer restored. Two groups compute what one
would, element for element: AdamW's update is per element.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from plexrl_dask.shared.types import AdamWParams

#: The names ``no_decay="biases-and-norms"`` exempts, matched on the lower-cased parameter
#: name: Hugging Face ``Trainer.get_decay_parameter_names``'s patterns. It also exempts the
#: parameters of normalisation modules by type (:func:`norm_parameter_names`): GPT-2's
#: ``ln_1``, ``ln_2``, ``ln_f`` match no pattern.
NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
#: The param-group key that marks the exempt group.
EXEMPT = "plexrl_no_decay"


def norm_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """The names of the parameters of ``model``'s normalisation modules: ``nn.LayerNorm`` and
    any module whose class name ends in ``Norm`` (Hugging Face's ``*RMSNorm``), as Hugging
    Face's ``Trainer`` finds them (by type, not by name)."""
    return frozenset(
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("Norm")
        for name, _ in module.named_parameters(recurse=False)
    )


def new_adamw(
    named: Iterable[tuple[str, torch.nn.Parameter]], norms: frozenset[str] = frozenset()
) -> torch.optim.AdamW:
    """An AdamW over the trainable ones of ``named`` parameters, in the two groups above
    (an empty group left out); ``norms``: :func:`norm_parameter_names` of their model."""
    decayed: list[torch.nn.Parameter] = []
    exempt: list[torch.nn.Parameter] = []
    for name, p in named:
        if p.requires_grad:
            no_decay = name in norms or NO_DECAY_NAMES.search(name.lower())
            (exempt if no_decay else decayed).append(p)
    groups = [{"params": ps, EXEMPT: flag} for ps, flag in ((decayed, False), (exempt, True)) if ps]
    return torch.optim.AdamW(groups, weight_decay=0.0)


def set_hyperparameters(optimizer: torch.optim.AdamW, params: AdamWParams) -> None:
    """Every group of ``optimizer`` at ``params`` (no decay on the exempt group where
    ``params.no_decay`` says so)."""
    for group in optimizer.param_groups:
        exempt = group.get(EXEMPT, False) and params.no_decay == "biases-and-norms"
        group.update(
            lr=params.lr,
            betas=(params.beta1, params.beta2),
            eps=params.eps,
            weight_decay=0.0 if exempt else params.weight_decay,
        )
