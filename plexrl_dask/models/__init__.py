"""Model specifications: tiny Qwen2-architecture models built locally, or local HF checkpoints.

:mod:`~plexrl_dask.models.spec` (the record every process handles) and
:mod:`~plexrl_dask.models.tokenizer` import no model stack; ``build`` (torch, transformers) is
imported on first use, as ``plexrl_dask.models.build``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.models.tokenizer import build_char_tokenizer

if TYPE_CHECKING:
    from plexrl_dask.models import build


def __getattr__(name: str) -> Any:
    if name == "build":
        return importlib.import_module(f"{__name__}.build")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ModelSpec", "build", "build_char_tokenizer"]
