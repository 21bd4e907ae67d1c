"""Continuous batching: one sampling stream decoded with its batch kept full.

A rollout request's completions end at different lengths (the long tail). Decoding a fixed
batch until its longest row ends leaves the batch emptier at every step, while each step's cost
on a small model is mostly fixed. A **stream** is a contiguous run of a request's rows (prompt ×
sample, in that order) decoded at most ``max_batch_size`` at a time: when rows end, their slots
are refilled from the stream's waiting rows, so the batch stays full until the stream runs out.

How it works, and why:

- Waiting rows are **prefilled ahead**, ``max_batch_size`` at a time (one forward over their
  left-padded prompts), and parked with their KV cache, attention mask, next position and
  next-token logits. Admitting them is a splice of tensors, not a forward: a refill costs no
  model call of its own.
- Rows are admitted once ``refill_min_rows`` slots are free (or the batch is empty, or every
  waiting row fits), in row order. Fewer, larger splices cost less than one per finished row.
- Every row's content stays right-aligned in the cache (left padding; one column appended per
  step), so joining two sets of rows pads the narrower on the left, and columns that no row
  attends to any more are cut from the left whenever rows are dropped.
- Token choice is a pure function of (seed, prompt id, sample index, **the row's own token
  position**) (:mod:`plexrl_dask.worker.sampling`), so a row samples from the same uniforms
  whenever it is admitted. The logits themselves depend, in the last bits, on which rows share a
  batch (CPU and GPU matmuls are not batch-invariant). The admission schedule is a pure function
  of the stream's rows and outcomes, so a stream decodes bit-identically on any worker; the
  runtime splits a request over replicas only at stream boundaries
  (:func:`~plexrl_dask.driver.deployment.split_prompts`), so any replica count gives the same bits.
- A multi-turn prompt (:class:`~plexrl_dask.shared.types.TurnPrompt`) on a replica with a
  prefix cache is prefilled alone, turn by turn from the longest prefix the cache holds, and
  then joins the waiting rows like any prefilled row (:mod:`plexrl_dask.worker.prefix_cache`
  says why alone: so that a hit is bit-identical to a miss).
- Cache layers other than plain growing ones (sliding windows, static caches) cannot be spliced:
  such a model decodes each batch of the stream to its end before admitting the next (what the
  backend did before streams existed).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from plexrl_dask.shared.types import SampledSequence, SamplingParams
from plexrl_dask.worker.prefix_cache import Prefix
from plexrl_dask.worker.sampling import choose_tokens, row_keys, uniforms_at

if TYPE_CHECKING:
    from plexrl_dask.worker.backends.torch_backend import TorchBackend

logger = logging.getLogger(__name__)


@dataclass
class Rows:
    """Rows of a stream with their decoding state, all on the model's device.

    ``index``: the rows' positions in the stream; ``keys``/``values``: per layer,
    ``(rows, kv_heads, width, head_dim)``, left-padded; ``mask``: ``(rows, width)``, 1 where a
    row has a token; ``next_pos``: ``(rows, 1)`` position id of each row's next token;
    ``logits``: ``(rows, vocab)`` for each row's next token.
    """

    index: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    next_pos: torch.Tensor
    logits: torch.Tensor

    def __len__(self) -> int:
        return len(self.index)

    def select(self, picks: Sequence[int], trim: bool = True) -> Rows:
        """The rows at ``picks`` (positions in this set), in that order; with ``trim``, the
        columns no picked row attends to are cut from the left."""
        sel = torch.tensor(list(picks), dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, sel)
        cut = 0
        if trim:
            live = torch.nonzero(mask.any(dim=0))
            cut = int(live[0, 0]) if len(live) else 0
        return Rows(
            [self.index[p] for p in picks],
            [k.index_select(0, sel)[:, :, cut:] for k in self.keys],
            [v.index_select(0, sel)[:, :, cut:] for v in self.values],
            mask[:, cut:],
            self.next_pos.index_select(0, sel),
            self.logits.index_select(0, sel),
        )

    def split(self, count: int) -> tuple[Rows, Rows | None]:
        """The first ``count`` rows and the rest (None when none are left)."""
        if count >= len(self):
            return self, None
        return self.select(range(count)), self.select(range(count, len(self)))

    @staticmethod
    def join(a: Rows, b: Rows) -> Rows:
        """``a``'s rows then ``b``'s, the narrower set padded on the left."""
        width = max(a.mask.shape[1], b.mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        return Rows(
            a.index + b.index,
            [torch.cat([pad(x, 2), pad(y, 2)]) for x, y in zip(a.keys, b.keys, strict=True)],
            [torch.cat([pad(x, 2), pad(y, 2)]) for x, y in zip(a.values, b.values, strict=True)],
            torch.cat([pad(a.mask, 1), pad(b.mask, 1)]),
            torch.cat([a.next_pos, b.next_pos]),
            torch.cat([a.logits, b.logits]),
        )


def _layers(cache: object) -> list[object]:
    return list(getattr(cache, "layers", []))


def _spliceable(cache: object) -> bool:
    """Whether ``cache`` is a plain, on-device ``DynamicCache`` whose every layer is a plain
    growing one holding tensors: then its rows can be selected and joined as tensors. Caches
    with state outside their layers' keys and values (sliding windows, offloading, caches of
    other kinds) cannot."""

    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return False
    layers = _layers(cache)
    return bool(layers) and all(
        type(layer) is DynamicLayer
        and getattr(layer, "is_initialized", True)
        and isinstance(getattr(layer, "keys", None), torch.Tensor)
        for layer in layers
    )


class StopRule:
    """When a completion stops: at a stop token id (end of sequence unless ignored) or once its
    text holds a stop string."""

    def __init__(self, backend: TorchBackend, params: SamplingParams) -> None:
        self.backend = backend
        self.strings = params.stop
        self.longest = max((len(s) for s in self.strings), default=0)
        # A stop string that appears in a row's text for the first time ends in its newest
        # token: the full check runs only after tokens whose text holds a stop's last character.
        self.may_stop = backend.tokens_ending(s[-1] for s in self.strings if s)
        self.ids = params.stop_ids(backend.eos_token_ids)

    def stopped(self, seq: list[int], token: int) -> bool:
        """Whether ``seq``, whose newest token is ``token``, is complete."""
        return token in self.ids or bool(
            self.longest
            and (self.may_stop is None or token in self.may_stop)
            and self.backend.stopped_by_string(seq, self.strings, self.longest)
        )


class Completions:
    """What a decoder produces for a request's ``rows`` (``(prompt index, sample index)``):
    each row's tokens, log-probabilities and finish reason, with the keys of its randomness."""

    def __init__(
        self,
        backend: TorchBackend,
        rows: list[tuple[int, int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
    ) -> None:
        self.backend = backend
        self.params = params
        self.stops = StopRule(backend, params)
        self.keys = row_keys(
            params.seed,
            np.array([prompt_ids[i] for i, _ in rows], dtype=np.int64),
            np.array([j for _, j in rows], dtype=np.int64),
        )
        self.tokens: list[list[int]] = [[] for _ in rows]
        self.logprobs: list[list[float]] = [[] for _ in rows]
        self.reasons = ["length"] * len(rows)

    def choose(self, index: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
        """Choose the next token of rows ``index`` from their ``logits`` (a row each, in that
        order) and record it; the tokens (on the logits' device), and whether each row goes
        on."""
        position = np.array([len(self.tokens[r]) for r in index], dtype=np.int64)
        u = uniforms_at(self.keys[index], position)
        params = self.params
        chosen, chosen_lp = choose_tokens(
            logits, params.temperature, params.top_p, u, params.top_k
        )
        goes_on = []
        for r, token, lp in zip(index, chosen.tolist(), chosen_lp.tolist(), strict=True):
            seq = self.tokens[r]
            seq.append(token)
            self.logprobs[r].append(lp)
            if self.stops.stopped(seq, token):
                self.reasons[r] = "stop"
            goes_on.append(self.reasons[r] != "stop" and len(seq) < params.max_tokens)
        return chosen, goes_on

    def sequences(self) -> list[SampledSequence]:
        """Every row's completion, in row order."""
        text = self.backend.text
        return [
            SampledSequence(
                tokens=tuple(seq),
                logprobs=tuple(self.logprobs[r]),
                text=text(seq),
                finish_reason=self.reasons[r],
            )
            for r, seq in enumerate(self.tokens)
        ]


class StreamDecoder:
    """Decodes one stream of ``rows`` (``(prompt index, sample index)`` pairs) of one request
    on ``backend``'s model (see the module docstring). Use :meth:`run` once."""

    def __init__(
        self,
        backend: TorchBackend,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        refill_min_rows: int,
        turns: Sequence[tuple[int, ...] | None] | None = None,
    ):
        """``turns``: per prompt, where its turns end (a :class:`TurnPrompt`'s), or None; a
        prompt with turns is prefilled through ``backend.prefix_cache``, turn by turn."""
        self.backend = backend
        self.turns = turns
        self.model = backend.model
        self.device = backend.device
        self.prompts = prompts
        self.rows = rows
        self.params = params
        self.batch_size = backend.max_batch_size
        self.refill_min_rows = max(1, int(refill_min_rows))
        self.out = Completions(backend, rows, params, prompt_ids)
        self.prefilled = 0  # rows [0, prefilled) have been prefilled
        self.cache: object = None  # the batch's cache object, its tensors swapped in per step
        self.spliceable = True
        self.forwards = 0
        self.logits_kw = {"logits_to_keep": 1} if "logits_to_keep" in backend.forward_params else {}
        # The decode step over the weights as this stream starts; None: through the HF forward.
        self.step = None
        if backend.decode_step is not None:
            longest = max(len(prompts[i]) for i, _ in rows)
            self.step = backend.decode_step.bind(longest + params.max_tokens)

    # --- model calls ------------------------------------------------------------------------

    def _prefill(self, count: int) -> Rows:
        """Prefill the next ``count`` rows of the stream. The samples of one prompt share its
        prefill: each distinct prompt goes through the model once, and its cache and logits
        are copied to every row that continues it."""
        start = self.prefilled
        picked = list(range(start, start + count))
        self.prefilled += count
        distinct: dict[int, int] = {}  # prompt index -> its row in the prefill
        of_row = [distinct.setdefault(self.rows[r][0], len(distinct)) for r in picked]
        order = list(distinct)
        turned = [i for i in order if self.turns is not None and self.turns[i] is not None]
        if not turned:
            prompts = self._prefill_batch(order)
        else:  # each turn prompt on its own (prefix cache), the others in one batch
            plain = [i for i in order if i not in set(turned)]
            parts = [self._prefill_turns(i) for i in turned]
            if plain:
                parts.append(self._prefill_batch(plain))
            joined = functools.reduce(Rows.join, parts)
            at = {i: k for k, i in enumerate(turned + plain)}
            prompts = joined.select([at[i] for i in order], trim=False)
            prompts.index = list(range(len(order)))
        if len(distinct) == count:  # one sample per prompt: nothing to copy
            prompts.index = picked
            return prompts
        rows = prompts.select(of_row, trim=False)
        rows.index = picked
        if not self.spliceable:
            self.cache.reorder_cache(  # type: ignore[attr-defined]
                torch.tensor(of_row, dtype=torch.long, device=self.device)
            )
        return rows

    def _prefill_batch(self, indices: list[int]) -> Rows:
        """The prompts ``indices`` (prompt indices) in one forward, left-padded."""
        width = max(len(self.prompts[i]) for i in indices)
        ids = torch.full((len(indices), width), self.backend.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        for k, i in enumerate(indices):
            p = self.prompts[i]
            ids[k, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[k, width - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        self.forwards += 1
        if self.step is not None:
            logits, keys, values = self.step(ids, mask, positions, None, None)
            return Rows(
                list(range(len(indices))), keys, values, mask, positions[:, -1:] + 1, logits
            )
        return self._prefill_hf(ids, mask, positions)

    def _prefill_turns(self, i: int) -> Rows:
        """Prompt ``i`` alone, turn by turn from the longest of its prefixes the replica's
        prefix cache holds (:mod:`plexrl_dask.worker.prefix_cache`), which then holds it."""
        assert self.step is not None and self.turns is not None and self.turns[i] is not None
        cache, version = self.backend.prefix_cache, self.backend.version
        tokens, turns = self.prompts[i], self.turns[i]
        start, hit = cache.lookup(version, tokens, turns)
        cached = start
        keys = None if hit is None else list(hit.keys)
        values = None if hit is None else list(hit.values)
        logits = None if hit is None else hit.logits[None]
        for end in (b for b in turns if b > start):
            ids = torch.tensor([tokens[start:end]], dtype=torch.long, device=self.device)
            mask = torch.ones((1, end), dtype=torch.long, device=self.device)
            positions = torch.arange(start, end, device=self.device)[None]
            logits, keys, values = self.step(ids, mask, positions, keys, values)
            self.forwards += 1
            start = end
        assert keys is not None and values is not None and logits is not None
        if start > cached:  # (computed here: keep it)
            cache.put(version, tokens, turns, Prefix(tuple(keys), tuple(values), logits[0]))
        n = len(tokens)
        mask = torch.ones((1, n), dtype=torch.long, device=self.device)
        next_pos = torch.full((1, 1), n, dtype=torch.long, device=self.device)
        return Rows([0], list(keys), list(values), mask, next_pos, logits)

    def _prefill_hf(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> Rows:
        """The prompts ``ids`` through the HF forward, their cache kept as the batch's cache
        object when it cannot be spliced."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self.logits_kw,
        )
        cache = output_cache(out)
        if self.cache is None:
            self.spliceable = _spliceable(cache)
        if self.cache is None or not self.spliceable:
            # Not spliceable: rows are only prefilled into an empty batch, whose cache this is.
            self.cache = cache
        layers = _layers(cache) if self.spliceable else []
        return Rows(
            list(range(ids.shape[0])),
            [layer.keys for layer in layers],  # type: ignore[attr-defined]
            [layer.values for layer in layers],  # type: ignore[attr-defined]
            mask,
            positions[:, -1:] + 1,
            out.logits[:, -1].float(),
        )

    def _step(self, batch: Rows, chosen: torch.Tensor, advance: torch.Tensor | None) -> Rows:
        """Feed each row its chosen token; the rows with their grown cache and new logits.
        ``advance``: ``(rows, 1)``, 1 for rows still generating and 0 for finished ones (whose
        position then stays put, inside the range every row's prompt and ``max_tokens`` were
        checked against); None when every row is generating."""
        mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        next_pos = batch.next_pos + (1 if advance is None else advance)
        if self.spliceable and self.step is not None:
            logits, keys, values = self.step(chosen, mask, batch.next_pos, batch.keys, batch.values)
            self.forwards += 1
            return Rows(batch.index, keys, values, mask, next_pos, logits)
        if self.spliceable:
            for layer, k, v in zip(_layers(self.cache), batch.keys, batch.values, strict=True):
                layer.keys, layer.values = k, v  # type: ignore[attr-defined]
            # The cache holds them now: without these references, each layer's old tensor is
            # freed as soon as the forward has grown it (one cache in memory, not two).
            batch.keys, batch.values = [], []
        out = self.model(
            input_ids=chosen[:, None],
            attention_mask=mask,
            position_ids=batch.next_pos,
            use_cache=True,
            **{self.backend.cache_kw: self.cache},
        )
        self.forwards += 1
        self.cache = output_cache(out)
        layers = _layers(self.cache) if self.spliceable else []
        return Rows(
            batch.index,
            [layer.keys for layer in layers],  # type: ignore[attr-defined]
            [layer.values for layer in layers],  # type: ignore[attr-defined]
            mask,
            next_pos,
            out.logits[:, -1].float(),
        )

    # --- the stream -------------------------------------------------------------------------

    def _admit(
        self, batch: Rows | None, live: list[int], waiting: Rows | None
    ) -> tuple[Rows | None, list[int], Rows | None]:
        """Refill ``batch`` (``live``: the positions of its unfinished rows) from the waiting
        rows when the admission rule says so; returns the batch, its live positions and the
        rows still waiting."""
        remaining = (len(self.rows) - self.prefilled) + (0 if waiting is None else len(waiting))
        free = self.batch_size - len(live)
        if remaining == 0 or free == 0:
            return batch, live, waiting
        if live and (not self.spliceable or free < min(self.refill_min_rows, remaining)):
            return batch, live, waiting
        take = min(free, remaining)
        # Prefill ahead in whole batches (one forward for up to max_batch_size rows): at most
        # that many rows' prompt caches wait beside the batch.
        while waiting is None or len(waiting) < take:
            more = self._prefill(min(self.batch_size, len(self.rows) - self.prefilled))
            waiting = more if waiting is None else Rows.join(waiting, more)
        admitted, waiting = waiting.split(take)
        assert self.spliceable or waiting is None, "an unspliceable cache is never split"
        if batch is not None and live:
            admitted = Rows.join(self._compact(batch, live), admitted)
        return admitted, list(range(len(admitted))), waiting

    def _compact(self, batch: Rows, live: list[int]) -> Rows:
        """``batch`` without its finished rows (``live``: the positions of the others)."""
        if len(live) == len(batch):
            return batch
        if not self.spliceable:
            self.cache.reorder_cache(  # type: ignore[attr-defined]
                torch.tensor(live, dtype=torch.long, device=self.device)
            )
        return batch.select(live, trim=self.spliceable)

    def run(self) -> list[SampledSequence]:
        """Decode every row of the stream; their completions in row order.

        While rows wait to be admitted, a finished row stays in the batch (fed padding, its
        position frozen, its output ignored) until ``refill_min_rows`` rows have finished:
        dropping rows copies the whole cache, and a few idle rows cost less than that. Once
        nothing waits, finished rows are dropped at once."""
        batch: Rows | None = None
        live: list[int] = []  # positions in the batch of the rows still generating
        waiting: Rows | None = None
        while True:
            batch, live, waiting = self._admit(batch, live, waiting)
            if batch is None:
                break
            every = len(live) == len(batch)
            index = [batch.index[p] for p in live]
            if every:
                logits = batch.logits
            else:
                live_t = torch.tensor(live, dtype=torch.long, device=batch.logits.device)
                logits = batch.logits.index_select(0, live_t)
            chosen, goes_on = self.out.choose(index, logits)
            still = [live[k] for k, on in enumerate(goes_on) if on]
            if not still:
                batch, live = None, []
                continue
            if every:
                feed = chosen
            else:
                feed = torch.full(
                    (len(batch),),
                    self.backend.pad_token_id,
                    dtype=chosen.dtype,
                    device=chosen.device,
                )
                feed.index_copy_(0, live_t.to(chosen.device), chosen)
            live = still
            nothing_waits = waiting is None and self.prefilled == len(self.rows)
            dead = len(batch) - len(live)
            if dead and (nothing_waits or dead >= self.refill_min_rows):
                batch = self._compact(batch, live)
                feed = feed[torch.tensor(live, dtype=torch.long, device=feed.device)]
                live = list(range(len(batch)))
            advance = None
            if len(live) < len(batch):
                advance = torch.zeros((len(batch), 1), dtype=batch.next_pos.dtype)
                advance[live] = 1
                advance = advance.to(batch.next_pos.device)
            batch = self._step(batch, feed, advance)
        logger.debug("stream of %d rows: %d model calls", len(self.rows), self.forwards)
        return self.out.sequences()


def output_cache(out: object) -> object:
    """The KV cache a model call returned (``cache`` in recent transformers,
    ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values  # type: ignore[attr-defined]
