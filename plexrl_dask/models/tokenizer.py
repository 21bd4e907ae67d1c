"""A character-level tokenizer built locally with ``tokenizers`` (no hub download).

Procedural verifiable tasks (arithmetic, countdown) are strings of digits, operators and a few
words; a character vocabulary makes every digit its own token, which is what lets a tiny model
learn arithmetic. The result is a ``PreTrainedTokenizerFast``, so it saves and loads exactly like
any Hugging Face tokenizer and the rest of the code never knows it was made here.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Printable ASCII without the vertical whitespace that procedural prompts never contain.
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


def build_char_tokenizer(characters: tuple[str, ...] = CHARACTERS) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer: ids 0-3 are ``<pad> <bos> <eos> <unk>``, then one id
    per character in ``characters`` (in order). Unknown characters map to ``<unk>``."""
    # Imported here: the vocabulary above is what specs need (the scheduler among them).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from plexrl_dask.models.spec import hf

    if len(set(characters)) != len(characters):
        raise ValueError("tokenizer characters must be unique")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(characters))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # An empty split pattern isolates every character, so "12" is two tokens.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return hf("PreTrainedTokenizerFast")(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
