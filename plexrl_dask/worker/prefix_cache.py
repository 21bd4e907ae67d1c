"""A replica's prefix cache: the keys and values of multi-turn conversations it prefilled.

An agentic episode samples each model turn as its own request, whose prompt is the
conversation so far: the last request's prompt, the tokens it sampled and the tool's output.
Prefilling that whole prompt again every turn recomputes what the replica computed a turn ago.
A prompt that says where its turns end (:class:`~plexrl_dask.shared.types.TurnPrompt`) is
prefilled **turn by turn, one conversation at a time** (a forward per turn over that turn's new
tokens, on top of the keys and values of the turns before), and the replica keeps the keys
and values of the whole prompt it prefilled, keyed by the replica's weights, the prompt's
tokens and where its turns end (the forwards that computed them). The next turn's prompt
starts with that one, turns and all, so only its new turns are prefilled.

Why one conversation and one turn per forward: it makes the cache invisible in the results.
Keys and values computed in a batch depend, in their last bits, on the batch's other rows and
its padding; computed alone, turn by turn, they are a pure function of the conversation's
tokens and the weights. A hit hands over exactly the tensors that a miss computes again (the
same forwards in the same order), so a conversation samples the same bits whether its prefix
was cached, evicted, or prefilled on another replica: multiplexing, eviction and placement
change no result (DESIGN §5). The price is that a cold prompt's turns are not batched with
other conversations' prompts. Identical prompts (the samples of one problem at their first
turn) are prefilled once and hit after.

The cache is bounded (``plexrl.sampling.prefix-cache-bytes``), evicts the least recently used
prompt first, counts in the replica's bytes (so in the holder's budget: a holder short of room
shrinks its replicas' prefix caches before it offloads any replica), is emptied when the
replica is offloaded, and is emptied when its weights change (any request that mutates them:
the holder's ``MUTATING_OPS``). It holds tensors that are never written in place: a hit's
tensors go into the stream's batch, whose steps make new ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from plexrl_dask import config
from plexrl_dask.worker.device import default_budget


@dataclass(frozen=True)
class Prefix:
    """A prefilled prompt: per layer its keys and values ``(1, kv_heads, tokens, head_dim)``
    and the logits of its next token ``(vocab,)`` (float32)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    logits: torch.Tensor

    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, self.logits)
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """Prefilled prompts by token sequence, at most ``max_bytes`` of them (see the module
    docstring). Counters: ``lookups`` (prompts looked up), ``hits`` (found at some turn
    boundary), ``tokens`` (their tokens) and ``hit_tokens`` (those not prefilled again)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        # (tokens, turn ends): the same tokens prefilled in other turns are other forwards
        self._entries: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], Prefix] = (
            OrderedDict()
        )
        self._bytes = 0
        self._version: int | None = None
        self.lookups = self.hits = self.tokens = self.hit_tokens = 0

    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every prompt (the weights changed, or the replica left the device)."""
        self._entries.clear()
        self._bytes = 0

    def _at(self, version: int) -> None:
        if version != self._version:  # (the weights changed without the holder saying so)
            self.clear()
            self._version = version

    def lookup(
        self, version: int, tokens: Sequence[int], turns: Sequence[int]
    ) -> tuple[int, Prefix | None]:
        """The longest turn boundary ``b`` of ``turns`` whose prompt ``tokens[:b]``, with the
        turns before it ending where ``turns`` say, is cached at weights ``version``, with its
        prefix (``(0, None)`` if none is); counted."""
        self._at(version)
        self.lookups += 1
        self.tokens += len(tokens)
        ends = sorted(turns)
        for k in range(len(ends) - 1, -1, -1):
            key = (tuple(tokens[: ends[k]]), tuple(ends[: k + 1]))
            end = ends[k]
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self.hit_tokens += end
                return end, found
        return 0, None

    def put(
        self, version: int, tokens: Sequence[int], turns: Sequence[int], prefix: Prefix
    ) -> None:
        """Keep ``prefix`` as the prompt ``tokens`` prefilled turn by turn to the ends
        ``turns`` (the last one ``len(tokens)``) at weights ``version``, evicting the least
        recently used ones past ``max_bytes`` (a prefix larger than that is not kept)."""
        self._at(version)
        size = prefix.nbytes()
        if size > self.max_bytes:
            return
        key = (tuple(tokens), tuple(sorted(b for b in turns if b <= len(tokens))))
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes()
        while self._entries and self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes()
        self._entries[key] = prefix
        self._bytes += size

    def shrink(self, max_bytes: int) -> int:
        """Evict the least recently used prompts until at most ``max_bytes`` are kept (the
        holder, short of memory: :class:`~plexrl_dask.worker.holder.ReplicaHolder`); returns
        the bytes freed."""
        freed = 0
        while self._entries and self._bytes > max(0, max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes()
            freed += evicted.nbytes()
        return freed

    def stats(self) -> dict[str, int]:
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "tokens": self.tokens,
            "hit_tokens": self.hit_tokens,
            "entries": len(self._entries),
            "bytes": self._bytes,
        }


def prefix_cache_bytes(device: torch.device) -> int:
    """``plexrl.sampling.prefix-cache-bytes`` in bytes (``auto``: a sixteenth of the worker's
    memory budget, ``plexrl.worker.memory-budget`` or the device's default: 256 MiB of a
    CPU's 4 GiB; 0 turns the cache off)."""
    if config.get("sampling.prefix-cache-bytes") == "auto":
        budget = config.WorkerConfig.from_dask_config().memory_budget
        return (budget if budget is not None else default_budget(str(device))) // 16
    return config.get_bytes("sampling.prefix-cache-bytes")
