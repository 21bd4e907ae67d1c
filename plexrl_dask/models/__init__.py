"""Model specifications: tiny Qwen2-architecture models built locally, or local HF checkpoints."""

from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.models.tokenizer import build_char_tokenizer

__all__ = ["ModelSpec", "build_char_tokenizer"]
