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
    per character in ``characters`` (in order). Unknown characters map to ``<unk>``.

    Characters are stored as byte-level symbols (GPT-2's alphabet: a space is ``Ġ``, a newline
    ``Ċ``, printable ASCII itself) and the text is byte-level encoded before it is split into
    characters. A saved copy then loads the same through ``AutoTokenizer``, which for a Qwen2
    checkpoint rebuilds a byte-level tokenizer from the vocabulary: a plain ``" "`` entry would
    not be found there, and whitespace would silently vanish."""
    # Imported here: the vocabulary above is what specs need (the scheduler among them).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from plexrl_dask.models.spec import hf

    if len(set(characters)) != len(characters):
        raise ValueError("tokenizer characters must be unique")
    if any(len(c.encode()) != 1 for c in characters):
        raise ValueError("tokenizer characters are single-byte (ASCII) characters")
    symbols = tuple(_BYTE_SYMBOLS[ord(c)] for c in characters)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + symbols)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Byte-level symbols, then an empty split pattern isolates every one, so "12" is two tokens.
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(pattern="", behavior="isolated"),
        ]
    )
    core.decoder = decoders.ByteLevel()
    return hf("PreTrainedTokenizerFast")(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    out, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTE_SYMBOLS = _byte_symbols()
#: The byte each byte-level symbol stands for.
BYTE_OF_SYMBOL = {symbol: byte for byte, symbol in _BYTE_SYMBOLS.items()}
