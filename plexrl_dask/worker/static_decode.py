"""Static-shape decoding: a slotted KV cache, batch buckets, and steps captured as CUDA graphs.

On a GPU, a decode step of a model that fits one device is launch-bound, not bandwidth-bound:
the dynamic decoder (:mod:`plexrl_dask.worker.decode`) grows its cache by concatenation and
launches a few hundred small kernels from Python per step, so a step costs about the same at 1
and at 128 rows (1.2-2.5 ms on an H200, `benchmarks/RESULTS.md`). This engine gives every
tensor a step touches a fixed address and shape, so that a whole step, **the token choice
included**, can be recorded once as a CUDA graph and replayed with one launch:

- **Slots.** A replica holds a cache of ``max_batch_size`` slots × ``length`` columns per
  layer (``(slots, kv_heads, length, head_dim)``), allocated once and kept while it fits the
  requests (``length``: the stream's longest prompt plus ``max_tokens``, rounded up to a power
  of two), counted in the replica's memory (``TorchBackend.state_bytes``) and dropped when the
  replica is offloaded. A row's token at position ``p`` lives in column ``p`` of its slot; a
  step writes each row's new key and value at its own position and attends to columns
  ``0 .. p`` (a mask built from the positions, in the graph).
- **Buckets.** A step runs on the first ``B`` slots (``B`` a power of two, or
  ``max_batch_size``) and the first ``L`` columns (``L`` a power of two from 64, or
  ``length``): one graph per ``(B, L, kind of choice)``, captured the first time it is needed
  and kept while the weights and the cache keep their addresses.
- **The token choice in the step.** A step reads each slot's logits (left there by the
  previous step or the prefill), draws its uniform from the row's key and completion position
  on the device (:func:`~plexrl_dask.worker.sampling.uniforms_on_device`, the same bits as
  the host's), chooses the token (:func:`~plexrl_dask.worker.sampling.choose_tokens_on_device`),
  feeds it, and leaves the next logits. The host reads only the chosen tokens and their
  log-probabilities back, once per step, to see which rows ended.
- **Continuous batching by slot refill.** Rows are admitted into free slots under the dynamic
  decoder's rule (once ``refill_min_rows`` slots are free, or the batch is empty, or every
  waiting row fits), each admission one prefill of the admitted rows' distinct prompts
  (right-padded, causal, written into their slots). Once nothing waits and the live rows fit
  a smaller bucket, they are moved to the lowest slots. The schedule is a function of the
  stream alone, so a stream decodes the same on any replica of the same kind.

Without capture (the CPU; ``plexrl.sampling.cuda-graphs: false``) the same step runs op by op.
It computes what the dynamic decoder computes, to float rounding: the tests compare
log-probabilities with teacher-forced scoring and report where tokens agree
(``bench.device``'s ``captured_token_agreement`` on a GPU). Supported: the models
:class:`~plexrl_dask.worker.decode_step.DecodeStep` supports.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from plexrl_dask import config
from plexrl_dask.errors import ConfigError
from plexrl_dask.shared.types import SampledSequence, SamplingParams
from plexrl_dask.worker.decode_step import DecodeStep, _Layer, _Norm, _Proj, attention_one
from plexrl_dask.worker.sampling import (
    choose_tokens_on_device,
    keys_tensor,
    row_keys,
    uniforms_on_device,
)

if TYPE_CHECKING:
    from plexrl_dask.worker.backends.torch_backend import TorchBackend

logger = logging.getLogger(__name__)

MIN_COLUMNS = 64  # the smallest column bucket and cache length
ENGINES = ("auto", "static", "dynamic")


def _norm(norm: _Norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; an RMSNorm that keeps its weight runs as one ``F.rms_norm`` (one fused
    kernel on CUDA where HF's bf16 order of operations takes seven; it multiplies by the
    weight before rounding to bf16 instead of after: float rounding)."""
    if norm.weight is None:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def _rotate_fused(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`_rotate` with the second product and the sum in one ``addcmul``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def _add_projected(residual: torch.Tensor, proj: _Proj, x: torch.Tensor) -> torch.Tensor:
    """``residual + proj(x)``, as one matrix product that adds ``residual`` where the
    projection has no bias."""
    if proj.bias is not None:
        return residual + proj(x)
    weight = proj.weight if proj.transposed else proj.weight.t()
    return torch.addmm(residual, x, weight)


def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    """``x`` after the layer's second half: its norm, SiLU MLP and residual."""
    h = _norm(layer.post_norm, x)
    if layer.gate_up is not None:
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
    else:
        assert layer.gate is not None and layer.up is not None
        gate, up = layer.gate(h), layer.up(h)
    return _add_projected(x, layer.down, F.silu(gate) * up)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return 1 << max(int(n) - 1, floor - 1, 0).bit_length()


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes steps run at: powers of two below ``max_batch_size``, and it."""
    sizes = {1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size}
    return tuple(sorted(sizes | {max_batch_size}))


@dataclass
class _Cache:
    """The slotted cache and every buffer a step reads or writes, at fixed addresses."""

    keys: list[torch.Tensor]  # per layer (slots, kv_heads, length, head_dim)
    values: list[torch.Tensor]
    logits: torch.Tensor  # (slots, vocab) float32: each slot's next-token logits
    positions: torch.Tensor  # (slots,) position of the token a step feeds
    completion: torch.Tensor  # (slots,) index in its completion of the token a step chooses
    row_keys: torch.Tensor  # (slots,) int64: the row's sampling key
    # (slots, 2) float64: the token each slot's step chose and its log-probability (a
    # token id and a float32 are exact in float64: one read-back a step, not two)
    chosen: torch.Tensor
    temperature: torch.Tensor  # () float32
    top_p: torch.Tensor  # () float64
    top_k: torch.Tensor  # () int64, 0: no limit
    columns: torch.Tensor  # (length,) 0 .. length - 1

    @property
    def length(self) -> int:
        return int(self.columns.shape[0])

    @property
    def slots(self) -> int:
        return int(self.positions.shape[0])

    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, self.logits]
        return sum(t.numel() * t.element_size() for t in tensors)


class StaticEngine:
    """One replica's static decoding (see the module docstring): its cache, its captured
    steps. ``capture``: record steps as CUDA graphs (CUDA only); ``cache_max_bytes``: the
    most the cache may take (a stream that needs more decodes through the dynamic decoder).
    A stream decodes at most the backend's ``max_batch_size`` rows at a time, read as it
    starts; the cache has at least that many slots (it grows, never shrinks, while kept)."""

    def __init__(
        self,
        model: torch.nn.Module,
        step: DecodeStep,
        device: torch.device,
        capture: bool,
        cache_max_bytes: int,
    ) -> None:
        self.model = model
        self.step = step
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.cache_max_bytes = int(cache_max_bytes)
        cfg = model.config
        self.layers = int(cfg.num_hidden_layers)
        self.vocab = int(cfg.vocab_size)
        self._cache: _Cache | None = None
        self._graphs: dict[tuple[int, int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool: object = None
        self._addresses: tuple[int, ...] = ()
        self.captures = 0  # graphs recorded (for tests and benchmarks)
        self.capture_error: str | None = None  # why capturing stopped, if it failed

    # --- memory ------------------------------------------------------------------------------

    def cache_bytes(self, slots: int, length: int) -> int:
        """Device bytes of a cache of ``slots`` × ``length`` columns (keys, values and the
        slots' logits)."""
        s = self.step
        dtype = self.model.get_input_embeddings().weight.dtype
        per_layer = 2 * slots * s.kv_heads * length * s.head_dim * dtype.itemsize
        return self.layers * per_layer + slots * self.vocab * 4

    def nbytes(self) -> int:
        """Device bytes held now (0 when nothing is allocated)."""
        return 0 if self._cache is None else self._cache.nbytes()

    def fits(self, slots: int, longest_prompt: int, max_tokens: int) -> bool:
        """Whether a stream of these lengths, ``slots`` rows at a time, can decode here within
        ``cache_max_bytes``."""
        needed = self._length_for(longest_prompt + max_tokens)
        return self.cache_bytes(slots, needed) <= self.cache_max_bytes

    def extra_bytes(self, slots: int, longest_prompt: int, max_tokens: int) -> int:
        """Device bytes a stream of these lengths would add to what the cache holds now (0
        when the cache it has will do): what to make room for before :meth:`decode`."""
        needed = self._length_for(longest_prompt + max_tokens)
        c = self._cache
        if c is not None and c.length >= needed and c.slots >= slots:
            return 0
        if c is not None:
            slots, needed = max(slots, c.slots), max(needed, c.length)
        return self.cache_bytes(slots, self._length_for(needed)) - self.nbytes()

    def release(self) -> None:
        """Drop the cache and the captured steps (before the replica is offloaded)."""
        self._graphs.clear()
        self._pool = None
        self._cache = None

    def _length_for(self, needed: int) -> int:
        limit = int(self.model.config.max_position_embeddings)
        return min(_pow2_at_least(needed, MIN_COLUMNS), max(limit, needed))

    def _ensure_cache(self, slots: int, needed: int) -> _Cache:
        c = self._cache
        if c is not None and c.length >= needed and c.slots >= slots:
            return c
        self.release()  # a larger cache: the old one and every graph over it go
        if c is not None:
            slots = max(slots, c.slots)
            needed = max(needed, c.length)
        length = self._length_for(needed)
        s, dev = self.step, self.device
        dtype = self.model.get_input_embeddings().weight.dtype
        shape = (slots, s.kv_heads, length, s.head_dim)

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        # Zeros, not garbage: slots no row holds still run inside a bucket, and must not
        # produce NaN or out-of-range tokens there.
        self._cache = _Cache(
            keys=[torch.zeros(shape, dtype=dtype, device=dev) for _ in range(self.layers)],
            values=[torch.zeros(shape, dtype=dtype, device=dev) for _ in range(self.layers)],
            logits=zeros(slots, self.vocab, dtype=torch.float32),
            positions=zeros(slots),
            completion=zeros(slots),
            row_keys=zeros(slots),
            chosen=zeros(slots, 2, dtype=torch.float64),
            temperature=torch.ones((), dtype=torch.float32, device=dev),
            top_p=torch.ones((), dtype=torch.float64, device=dev),
            top_k=torch.zeros((), dtype=torch.int64, device=dev),
            columns=torch.arange(length, device=dev),
        )
        return self._cache

    # --- the model's math ---------------------------------------------------------------------

    def _tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step.rotary_tables(length, self.model.get_input_embeddings().weight)

    def _forward_one(self, tokens: torch.Tensor, batch: int, columns: int) -> torch.Tensor:
        """Feed ``tokens`` (one per slot of the first ``batch``) at the slots' positions,
        attending to their first ``columns`` columns; returns the next logits in float32."""
        c, s = self._cache, self.step
        assert c is not None
        layers, norm, head = self.step.layout()
        heads, kv, hd = s.heads, s.kv_heads, s.head_dim
        pos = c.positions[:batch]
        cos_t, sin_t = self._tables(c.length)
        cos, sin = F.embedding(pos, cos_t)[:, None], F.embedding(pos, sin_t)[:, None]
        x = self.model.get_input_embeddings()(tokens)
        # 0 where a slot's row has a token (columns up to its position), -inf after; one
        # bias for every layer, one row per (slot, kv head).
        open_ = c.columns[:columns][None, :] <= pos[:, None]
        bias = torch.zeros((batch, columns), dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(~open_, float("-inf"))
        bias = bias[:, None, None, :].expand(batch, kv, 1, columns).reshape(batch * kv, 1, columns)
        slots = torch.arange(batch, device=x.device)
        for i, layer in enumerate(layers):
            h = _norm(layer.input_norm, x)
            if layer.qkv is not None:
                qkv = layer.qkv(h).view(batch, heads + 2 * kv, hd)
                qk = _rotate_fused(qkv[:, : heads + kv], cos, sin)
                q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]
            else:
                assert layer.q is not None and layer.k is not None and layer.v is not None
                q = _rotate_fused(layer.q(h).view(batch, heads, hd), cos, sin)
                k = _rotate_fused(layer.k(h).view(batch, kv, hd), cos, sin)
                v = layer.v(h).view(batch, kv, hd)
            keys, values = c.keys[i], c.values[i]
            keys[slots, :, pos] = k
            values[slots, :, pos] = v
            out = attention_one(
                q, keys[:batch, :, :columns], values[:batch, :, :columns], bias, layer.scaling
            )
            x = _add_projected(x, layer.o, out)
            x = _mlp(layer, x)
        return head(_norm(norm, x)).float()

    def _step(self, batch: int, columns: int, greedy: bool, nucleus: bool) -> None:
        """One decode step of the first ``batch`` slots (what a graph records): choose each
        slot's token from its logits, feed it, keep the next logits, advance."""
        c = self._cache
        assert c is not None
        u = uniforms_on_device(c.row_keys[:batch], c.completion[:batch])
        tokens, logprobs = choose_tokens_on_device(
            c.logits[:batch],
            c.temperature,
            c.top_p,
            u,
            greedy=greedy,
            nucleus=nucleus,
            top_k=c.top_k,
        )
        c.chosen[:batch, 0].copy_(tokens)
        c.chosen[:batch, 1].copy_(logprobs)
        c.logits[:batch].copy_(self._forward_one(tokens, batch, columns))
        c.completion[:batch].add_(1)
        # Slots whose rows ended run on until refilled; their position stays in the cache.
        c.positions[:batch].add_(1).clamp_(max=c.length - 1)

    def _prefill(self, prompts: list[list[int]], slots: list[int], of_slot: list[int]) -> None:
        """Run the distinct ``prompts`` (right-padded, causal) and write each one's keys,
        values and last logits into the slots continuing it (``of_slot[i]``: the prompt of
        ``slots[i]``)."""
        c, s = self._cache, self.step
        assert c is not None
        layers, norm, head = self.step.layout()
        heads, kv, hd = s.heads, s.kv_heads, s.head_dim
        dev = self.device
        count, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((count, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        cos_t, sin_t = self._tables(c.length)
        cos, sin = cos_t[:width][None, None], sin_t[:width][None, None]
        to = torch.tensor(slots, device=dev)
        rows = torch.tensor(of_slot, device=dev)
        x = self.model.get_input_embeddings()(ids).view(count * width, -1)
        for i, layer in enumerate(layers):
            h = _norm(layer.input_norm, x)
            if layer.qkv is not None:
                qkv = layer.qkv(h).view(count, width, heads + 2 * kv, hd).transpose(1, 2)
                qk = _rotate_fused(qkv[:, : heads + kv], cos, sin)
                q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]
            else:
                assert layer.q is not None and layer.k is not None and layer.v is not None
                q = _rotate_fused(
                    layer.q(h).view(count, width, heads, hd).transpose(1, 2), cos, sin
                )
                k = _rotate_fused(layer.k(h).view(count, width, kv, hd).transpose(1, 2), cos, sin)
                v = layer.v(h).view(count, width, kv, hd).transpose(1, 2)
            # Columns past a prompt's end hold its padding's keys: masked (a row attends up
            # to its position only) and overwritten as the row grows.
            c.keys[i][:, :, :width].index_copy_(0, to, k.index_select(0, rows))
            c.values[i][:, :, :width].index_copy_(0, to, v.index_select(0, rows))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=layer.scaling, enable_gqa=True
            )
            x = _add_projected(x, layer.o, out.transpose(1, 2).reshape(count * width, heads * hd))
            x = _mlp(layer, x)
        last = x.view(count, width, -1)[torch.arange(count, device=dev), lengths - 1]
        logits = head(_norm(norm, last)).float()
        c.logits.index_copy_(0, to, logits.index_select(0, rows))
        c.positions.index_copy_(0, to, lengths.index_select(0, rows))
        c.completion.index_fill_(0, to, 0)

    # --- graphs -------------------------------------------------------------------------------

    def _weights_addresses(self) -> tuple[int, ...]:
        """Where every tensor a step reads lives: a graph replays reads of these addresses."""
        layers, norm, head = self.step.layout()
        out: list[int] = []
        for obj in (*layers, norm, head):
            for value in vars(obj).values():
                if isinstance(value, torch.Tensor):
                    out.append(value.data_ptr())
                elif hasattr(value, "__dict__"):
                    out += [
                        v.data_ptr() for v in vars(value).values() if isinstance(v, torch.Tensor)
                    ]
        out.append(self.model.get_input_embeddings().weight.data_ptr())
        assert self._cache is not None
        out += [t.data_ptr() for t in self._tables(self._cache.length)]
        return tuple(out)

    def _run_step(self, batch: int, columns: int, greedy: bool, nucleus: bool) -> None:
        if not self.capture:
            self._step(batch, columns, greedy, nucleus)
            return
        key = (batch, columns, greedy, nucleus)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._record(key)
            except Exception as e:  # noqa: BLE001 (a replica that cannot capture still decodes)
                # Op by op from now on: slower, the same math. Recorded for benchmarks and
                # the logs; the step itself runs below, so the stream goes on.
                logger.warning("capturing a decode step failed; decoding op by op: %r", e)
                self.capture, self.capture_error = False, f"{type(e).__name__}: {e}"
                self._graphs.clear()
                self._step(batch, columns, greedy, nucleus)
                return
        graph.replay()

    def _record(self, key: tuple[int, int, bool, bool]) -> torch.cuda.CUDAGraph:
        """Capture the step ``key`` (torch's recipe: warm up on a side stream, then record).
        The warm-up runs the step once for real; it writes the same keys and values the
        recorded step will, and its other outputs are overwritten by the replay that follows,
        so the state is as if the step had run once. The buffers it advanced are put back."""
        c = self._cache
        assert c is not None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        saved = (c.positions.clone(), c.completion.clone(), c.logits[: key[0]].clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(*key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        c.positions.copy_(saved[0])
        c.completion.copy_(saved[1])
        c.logits[: key[0]].copy_(saved[2])
        graph = torch.cuda.CUDAGraph()
        # (thread-local: a prefetch's copies in another thread may run during the capture)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step(*key)
        self._graphs[key] = graph
        self.captures += 1
        return graph

    # --- a stream -----------------------------------------------------------------------------

    def decode(
        self,
        backend: TorchBackend,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        refill_min_rows: int,
    ) -> list[SampledSequence]:
        """Decode one stream of ``rows`` (``(prompt index, sample index)`` pairs), at most
        ``max_batch_size`` at a time with slot refill; their completions in row order."""
        longest = max(len(prompts[i]) for i, _ in rows)
        c = self._ensure_cache(backend.max_batch_size, longest + params.max_tokens)
        addresses = self._weights_addresses()
        if addresses != self._addresses:
            self._graphs.clear()  # weights moved (a reload, a new layout): record again
            self._addresses = addresses
        greedy, nucleus = params.temperature == 0.0, params.truncated
        c.temperature.fill_(params.temperature if not greedy else 1.0)
        c.top_p.fill_(params.top_p)
        c.top_k.fill_(params.top_k)
        stream = _Stream(self, backend, prompts, rows, params, prompt_ids, refill_min_rows)
        return stream.run(greedy, nucleus)


class _Stream:
    """The host side of one stream: which row each slot holds, what each row has produced."""

    def __init__(
        self,
        engine: StaticEngine,
        backend: TorchBackend,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        refill_min_rows: int,
    ) -> None:
        self.engine = engine
        self.backend = backend
        self.prompts = prompts
        self.rows = rows
        self.params = params
        self.refill_min_rows = max(1, int(refill_min_rows))
        self.keys = row_keys(
            params.seed,
            np.array([prompt_ids[i] for i, _ in rows], dtype=np.int64),
            np.array([j for _, j in rows], dtype=np.int64),
        )
        n = len(rows)
        self.tokens = np.zeros((n, params.max_tokens), dtype=np.int64)
        self.logprobs = np.zeros((n, params.max_tokens), dtype=np.float32)
        self.count = np.zeros(n, dtype=np.int64)
        self.stopped = np.zeros(n, dtype=bool)
        self.prompt_len = np.array([len(prompts[i]) for i, _ in rows], dtype=np.int64)
        self.limit = int(backend.max_batch_size)  # rows decoded at a time
        self.buckets = batch_buckets(self.limit)
        self.slot_row = np.full(self.limit, -1, dtype=np.int64)  # -1: free
        self.admitted = 0  # rows [0, admitted) have had a slot
        self.steps = 0

    def _admit(self) -> None:
        """Prefill waiting rows into free slots when the admission rule says so."""
        remaining = len(self.rows) - self.admitted
        free = np.flatnonzero(self.slot_row < 0)
        live = self.limit - len(free)
        if remaining == 0 or len(free) == 0:
            return
        if live and len(free) < min(self.refill_min_rows, remaining):
            return
        take = min(len(free), remaining)
        slots = free[:take].tolist()
        picked = list(range(self.admitted, self.admitted + take))
        self.admitted += take
        distinct: dict[int, int] = {}
        of_slot = [distinct.setdefault(self.rows[r][0], len(distinct)) for r in picked]
        c = self.engine._cache
        assert c is not None
        to = torch.tensor(slots, device=self.engine.device)
        c.row_keys.index_copy_(0, to, keys_tensor(self.keys[picked], self.engine.device))
        self.engine._prefill([self.prompts[i] for i in distinct], slots, of_slot)
        self.slot_row[slots] = picked

    def _compact(self) -> None:
        """Once nothing waits: move the live rows to the lowest slots if they then fit a
        smaller bucket (a copy of their cache columns, once per shrink)."""
        if self.admitted < len(self.rows):
            return
        held = np.flatnonzero(self.slot_row >= 0)
        if len(held) == 0 or self._bucket(int(held[-1]) + 1) <= self._bucket(len(held)):
            return
        dst = np.arange(len(held))
        moved = held != dst
        src_t = torch.tensor(held[moved], device=self.engine.device)
        dst_t = torch.tensor(dst[moved], device=self.engine.device)
        c = self.engine._cache
        assert c is not None
        for t in (*c.keys, *c.values, c.logits, c.positions, c.completion, c.row_keys):
            t.index_copy_(0, dst_t, t.index_select(0, src_t))
        rows = self.slot_row[held]
        self.slot_row[:] = -1
        self.slot_row[: len(held)] = rows

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, greedy: bool, nucleus: bool) -> list[SampledSequence]:
        engine, params, backend = self.engine, self.params, self.backend
        c = engine._cache
        assert c is not None
        stops = params.stop
        longest_stop = max((len(s) for s in stops), default=0)
        may_stop = backend.tokens_ending(s[-1] for s in stops if s) if stops else frozenset()
        stop_mask: np.ndarray | None = None
        if may_stop is not None and stops:
            stop_mask = np.zeros(backend.vocab_size, dtype=bool)
            stop_mask[list(may_stop)] = True
        stop_ids = np.array(sorted(params.stop_ids(backend.eos_token_ids)), dtype=np.int64)
        while True:
            self._admit()
            held = np.flatnonzero(self.slot_row >= 0)
            if len(held) == 0:
                break
            batch = self._bucket(int(held[-1]) + 1)
            rows = self.slot_row[held]
            needed = int((self.prompt_len[rows] + self.count[rows]).max()) + 1
            columns = min(c.length, _pow2_at_least(needed, MIN_COLUMNS))
            engine._run_step(batch, columns, greedy, nucleus)
            self.steps += 1
            out = c.chosen[:batch].cpu().numpy()[held]
            chosen = out[:, 0].astype(np.int64)
            at = self.count[rows]
            self.tokens[rows, at] = chosen
            self.logprobs[rows, at] = out[:, 1]
            self.count[rows] = at + 1
            hit = np.isin(chosen, stop_ids)
            if longest_stop:
                maybe = ~hit if stop_mask is None else ~hit & stop_mask[chosen]
                for k in np.flatnonzero(maybe):
                    r = int(rows[k])
                    seq = self.tokens[r, : self.count[r]].tolist()
                    hit[k] = backend.stopped_by_string(seq, stops, longest_stop)
            self.stopped[rows[hit]] = True
            done = hit | (self.count[rows] >= params.max_tokens)
            self.slot_row[held[done]] = -1
            self._compact()
        return [self._sequence(r) for r in range(len(self.rows))]

    def _sequence(self, r: int) -> SampledSequence:
        n = int(self.count[r])
        tokens = self.tokens[r, :n].tolist()
        return SampledSequence(
            tokens=tuple(tokens),
            logprobs=tuple(self.logprobs[r, :n].tolist()),
            text=self.backend.text(tokens),
            finish_reason="stop" if self.stopped[r] else "length",
        )


def cache_max_bytes(device: torch.device) -> int:
    """``plexrl.sampling.static-cache-max-bytes`` in bytes (``auto``: a quarter of the
    holder's default budget on CUDA, 1 GiB on the CPU); :class:`ConfigError` unless a byte
    size >= 0."""
    if config.get("sampling.static-cache-max-bytes") == "auto":
        if device.type == "cuda":
            return int(0.25 * 0.9 * torch.cuda.get_device_properties(device).total_memory)
        return 2**30
    return config.get_bytes("sampling.static-cache-max-bytes")


def engine_for(backend: TorchBackend) -> StaticEngine | None:
    """The static engine for ``backend``'s model under ``plexrl.sampling.engine`` (``auto``:
    on CUDA; ``static``: everywhere; ``dynamic``: never) and ``plexrl.sampling.cuda-graphs``,
    or None where the model has no :class:`DecodeStep` (then it decodes dynamically)."""
    mode = config.get("sampling.engine")
    if mode not in ENGINES:
        raise ConfigError(f"plexrl.sampling.engine must be one of {ENGINES}, got {mode!r}")
    capture = config.get("sampling.cuda-graphs")
    if not isinstance(capture, bool):
        raise ConfigError(f"plexrl.sampling.cuda-graphs must be true or false, got {capture!r}")
    limit = cache_max_bytes(backend.device)  # (checked whichever engine runs)
    if backend.decode_step is None or mode == "dynamic":
        return None
    if mode == "auto" and backend.device.type != "cuda":
        return None
    return StaticEngine(backend.model, backend.decode_step, backend.device, capture, limit)
