"""A character-level tokenizer built locally with ``tokenizers`` (no hub download).

Procedural verifiable tasks (arithmetic, countdown) are strings of digits, operators and a few
words; a character vocabulary makes every digit its own token, which is what lets a tiny model
learn arithmetic. The result is a ``PreTrainedTokenizerFast``, so it saves and loads exactly like
any Hugging Face tokenizer and the rest of the code never knows it was made here.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from plexrl_dask import config
from plexrl_dask.errors import ConfigError, InvalidSamplingParams, NoChatTemplate
from plexrl_dask.shared.types import Chat, TurnPrompt

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

    from plexrl_dask.models.build import hf

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


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str | Chat | Sequence[int]],
    special_tokens: bool | None = None,
) -> list[Sequence[int]]:
    """Prompts as token ids: strings encoded with ``tokenizer`` as Hugging Face does, with its
    special tokens (``special_tokens``, default ``plexrl.sampling.special-tokens``: true);
    chats rendered with its chat template and the generation prompt, as
    ``apply_chat_template`` tokenizes them (the template places its own special tokens);
    token-id sequences passed through as ints (a :class:`TurnPrompt` as itself)."""
    if special_tokens is None:
        special_tokens = special_tokens_default()
    texts = [p for p in prompts if isinstance(p, str)]
    # One tokenizer call for all of them: a call costs ~35 us of its own per string, as
    # much as encoding a short prompt (a GRPO step's 16 prompts: ~0.5 ms of its request).
    encoded = iter(
        tokenizer(texts, add_special_tokens=special_tokens)["input_ids"] if texts else []
    )
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(list(next(encoded)))
        elif isinstance(p, Chat):
            out.append(_chat_ids(tokenizer, p))
        elif isinstance(p, TurnPrompt):
            out.append(p)  # (its turns go with it: the replica's prefix cache reads them)
        else:
            out.append([int(t) for t in p])
    return out


def _chat_ids(tokenizer: Any, chat: Chat) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(
            "this model's tokenizer has no chat template: give the prompt as text or token ids"
        )
    try:
        ids = tokenizer.apply_chat_template(
            chat.as_dicts(), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as e:  # (the checkpoint's template, Jinja: whatever it raises)
        raise InvalidSamplingParams(
            f"this model's chat template failed on the chat: {type(e).__name__}: {e}"
        ) from e
    return [int(t) for t in ids]


def special_tokens_default() -> bool:
    """``plexrl.sampling.special-tokens``: whether string prompts get the tokenizer's special
    tokens (its post-processor's BOS), as Hugging Face adds them."""

    value = config.get("sampling.special-tokens")
    if not isinstance(value, bool):
        raise ConfigError(f"plexrl.sampling.special-tokens must be true or false, got {value!r}")
    return value


def token_pieces(tokenizer: Any) -> list[str] | None:
    """Each token id's text, when the tokenizer decodes by plain concatenation (a ``Fuse``
    decoder, or a ``ByteLevel`` one whose every token is whole UTF-8 on its own, and no
    clean-up of spaces, like the character tokenizer of tiny models): then
    ``decode(ids, skip_special_tokens=True) == "".join(pieces[i] for i in ids)``. ``None``
    for any other tokenizer, which is then decoded."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = type(getattr(backend, "decoder", None)).__name__
    if backend is None or decoder not in ("Fuse", "ByteLevel"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    special = set(tokenizer.all_special_ids)
    pieces = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        if i in special:
            continue
        if decoder == "Fuse":
            pieces[i] = token
            continue
        try:  # (a token of part of a character decodes only beside the rest of it)
            pieces[i] = bytes(BYTE_OF_SYMBOL[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            return None
    return pieces


def end_of_sequence_ids(tokenizer: Any, model: Any) -> tuple[int, ...]:
    """The tokens that end a completion, as Hugging Face's ``generate`` ends it: the
    tokenizer's end-of-sequence token and those of the model's generation config (one id or
    a list; instruct checkpoints list their end-of-turn token there). Sorted, no repeats."""
    config = getattr(model, "generation_config", None)
    found: list[Any] = [tokenizer.eos_token_id]
    listed = getattr(config, "eos_token_id", None)
    found += list(listed) if isinstance(listed, (list, tuple)) else [listed]
    return tuple(sorted({int(i) for i in found if isinstance(i, int) and not isinstance(i, bool)}))
