"""Batch-invariant decoding: each row's tokens as if it were decoded alone.

:mod:`plexrl_dask.worker.decode` batches a request's rows with left padding, so a row's
logits depend, in their last bits, on the rows it shares a batch with: the request is
deterministic, but two requests merged into one decode would not sample what each samples
alone. This decoder makes every row's bits its own, so requests can be merged (the Tinker
front door coalesces a sampler's concurrent calls, :mod:`plexrl_dask.serve.coalesce`) and a
row samples the same tokens whatever ``max-batch-size``, stream length or companions:

- **No padding.** Rows are kept in *cohorts* of equal cache length (the samples of prompts of
  one length, admitted together; every live row grows by one token a step). Attention runs
  per cohort on its own cache, unpadded: SDPA's result for one sequence does not depend on
  how many sequences of that shape share the call (measured on this CPU build for 1-128).
  Prompts are prefilled grouped by length, causal, without a mask.
- **Products on row-invariant shapes.** A row of a matrix product can depend on how many rows
  the call has: on this CPU build's MKL, a one-row ``mm`` takes a matrix-vector path and
  differs in the last bits from the same row among 2-128 rows, which all agree (at the
  widths of 896 and more, 200+ rows differ again). Every product of a step (the projections
  and the head) runs on between 2 and ``cap`` rows: one row is paired with a copy of itself,
  more than ``cap`` are cut into pieces. A norm whose weight is folded into the next
  projection computes its mean of squares as a one-column product in the stream decoder,
  which is not row-invariant here: this decoder reduces per row instead. :func:`invariance`
  probes this on the model's own shapes, device and dtype once per kind (every row of 2 to
  ``cap`` rows against that row alone); where it does not hold, every product runs on
  exactly ``cap`` rows (padded with zeros), which it probes too; where neither holds the
  request is refused (:class:`~plexrl_dask.errors.OpNotSupported`).
- Everything else a step computes (embedding, norms, rotary, SiLU, the token choice) works row
  by row.

Rows are admitted while fewer than ``max_batch_size`` are live, prompts prefilled as they are
admitted (a prompt whose samples are split over two admissions is prefilled twice, to the
same bits). Finished rows are dropped from their cohort when a quarter of it has finished
(a copy of its cache) and fed padding until then. Supported where :class:`DecodeStep` is
(the weight-level step), LoRA adapters included (each product adds its adapter's, read from
the modules: no copy of the shared base); turn prompts (prefix cache), the HF forward and
the static CUDA engine decode through their own paths, not this one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from plexrl_dask.errors import OpNotSupported
from plexrl_dask.shared.types import SampledSequence, SamplingParams
from plexrl_dask.worker.decode import Completions
from plexrl_dask.worker.decode_step import BoundStep, DecodeStep, _Norm, _Proj, _rotate

if TYPE_CHECKING:
    from plexrl_dask.worker.backends.torch_backend import TorchBackend

logger = logging.getLogger(__name__)

#: The most rows one product takes (the probe checks 2..CAP agree).
CAP = 128
#: Row counts the probe compares (with the row at the first and the last position).
_PROBE_ROWS = (2, 3, 17, 64, CAP)

# (device type, dtype, threads, the products' shapes) -> (cap, exact): what the probe found
_PROBED: dict[tuple, tuple[int, bool]] = {}


@dataclass(frozen=True)
class ProductRows:
    """How a step's products take rows: between 2 and ``cap`` per call, or (``exact``) exactly
    ``cap`` per call, padded with zeros."""

    cap: int
    exact: bool

    def apply(self, f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``f`` over the rows of ``x`` ``(rows, features)``, on row-invariant shapes."""
        m = x.shape[0]
        if self.exact:
            pad = (-m) % self.cap
            if pad:
                x = torch.cat((x, x.new_zeros((pad, x.shape[1]))))
            parts = [f(x[i : i + self.cap]) for i in range(0, x.shape[0], self.cap)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            return out[:m] if pad else out
        if m == 1:  # (paired with itself: a one-row product takes another path)
            return f(torch.cat((x, x)))[:1]
        if m <= self.cap:
            return f(x)
        # pieces of cap rows; a last piece of one row is paired like any one row
        return torch.cat([self.apply(f, x[i : i + self.cap]) for i in range(0, m, self.cap)])


def _products(bound: BoundStep) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """Every row-wise computation a step of ``bound`` runs, with its input width: each
    projection's base product and, where it has an adapter, the adapter's part (computed
    apart: rows of other adapters share the base product, :func:`forward_rows`)."""
    out: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    hidden = bound.embed.weight.shape[1]

    def add(proj: _Proj, width: int) -> None:
        out.append((proj.base, width))
        if proj.delta is not None:
            out.append((proj.lora, width))

    for layer in bound.layers:
        for proj in (layer.qkv, layer.q, layer.k, layer.v, layer.gate_up, layer.gate, layer.up):
            if proj is not None:
                add(proj, hidden)
        add(layer.o, bound.step.heads * bound.step.head_dim)
        add(layer.down, _in_width(layer.down))
    for norm in {id(n): n for n in _norms(bound)}.values():
        out.append((functools.partial(_norm, norm), hidden))
    add(bound.head, hidden)
    return out


def _norms(bound: BoundStep) -> list[_Norm]:
    return [n for layer in bound.layers for n in (layer.input_norm, layer.post_norm)] + [bound.norm]


def _norm(norm: _Norm, x: torch.Tensor) -> torch.Tensor:
    """``norm`` of ``x`` row by row. A folded norm (its weight in the next product's copy)
    computes its mean of squares as a one-column product, which is not row-invariant on the
    CPU: here it is a reduction per row."""
    if norm.weight is None:
        return F.rms_norm(x, (x.shape[-1],), None, norm.eps)
    return norm(x)


def _shape(f: object) -> tuple[int, ...]:
    proj = getattr(f, "__self__", None)  # (a projection's bound method: base or lora)
    if isinstance(proj, _Proj):
        if f.__name__ == "lora":  # type: ignore[attr-defined]
            assert proj.delta is not None
            return (-1, *proj.delta[0].shape, *proj.delta[1].shape)
        return tuple(proj.weight.shape)
    weight = getattr(f, "weight", None)
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()


def _in_width(proj: object) -> int:
    weight = proj.weight  # type: ignore[attr-defined]
    return weight.shape[0] if proj.transposed else weight.shape[1]  # type: ignore[attr-defined]


def _agree(
    tiling: ProductRows, f: Callable[[torch.Tensor], torch.Tensor], width: int, like: torch.Tensor
) -> bool:
    """Whether every row of ``f`` over ``rows`` is what that row alone gives, for each probed
    row count and position, on random inputs."""
    gen = torch.Generator(device="cpu").manual_seed(width)
    for m in _PROBE_ROWS:
        x = torch.randn((m, width), generator=gen).to(like.device, like.dtype)
        together = tiling.apply(f, x)
        for at in range(m):
            if not torch.equal(together[at], tiling.apply(f, x[at : at + 1])[0]):
                return False
    return True


def invariance(*bounds: BoundStep) -> ProductRows:
    """How the products of ``bounds`` (a request's steps: the base's and its adapters') must
    take rows for each row's result to be its own (see the module docstring), probed on
    their shapes, device and dtype once per kind. :class:`OpNotSupported` where no way was
    found."""
    weight = bounds[0].embed.weight
    # one product per shape: what the probe finds is a property of the kernels at a shape
    # (the cache's key says so too), and adapters' steps repeat the base's products
    kinds = {(width, _shape(f)): (f, width) for b in bounds for f, width in _products(b)}
    products = list(kinds.values())
    key = (weight.device.type, weight.dtype, torch.get_num_threads(), tuple(sorted(kinds)))
    found = _PROBED.get(key)
    if found is None:
        with torch.inference_mode():
            for tiling in (ProductRows(CAP, exact=False), ProductRows(16, exact=True)):
                if all(_agree(tiling, f, width, weight) for f, width in products):
                    found = (tiling.cap, tiling.exact)
                    break
            else:
                found = (0, False)
        _PROBED[key] = found
        logger.debug("row-invariant products on %s/%s: %s", weight.device, weight.dtype, found)
    if found[0] == 0:
        raise OpNotSupported(
            f"batch-invariant decoding: matrix products on {weight.device.type} "
            f"({weight.dtype}) are not row-invariant at any shape tried"
        )
    return ProductRows(*found)


#: A request's adapters in one model call: each the bound step whose projections carry that
#: adapter's parts, with the rows (of the call) that add them (None: every row).
Adapters = Sequence[tuple[BoundStep, Sequence[int] | None]]


def _pick(bound: BoundStep, name: str, layer: int | None) -> _Proj:
    proj = getattr(bound, name) if layer is None else getattr(bound.layers[layer], name)
    assert proj is not None
    return proj


class _Products:
    """A model call's projections on row-invariant shapes: the base product of every row,
    plus each adapter's part for its rows (each part on the rows of its adapter alone, so a
    row's bits do not depend on which adapters its companions use)."""

    def __init__(
        self, bound: BoundStep, tiling: ProductRows, adapters: Adapters, count: int, new: int
    ) -> None:
        self.bound, self.tiling = bound, tiling
        if not adapters and bound.step.adapters:
            adapters = ((bound, None),)  # (a LoRA replica's own step: its adapter, every row)
        self.tokens: list[tuple[BoundStep, torch.Tensor | None]] = []
        self.rows: list[tuple[BoundStep, torch.Tensor | None]] = []
        device = bound.embed.weight.device
        for step, rows in adapters:
            if rows is None or len(rows) == count:
                self.tokens.append((step, None))
                self.rows.append((step, None))
                continue
            at = torch.tensor(rows, dtype=torch.long, device=device)
            self.rows.append((step, at))
            spread = at[:, None] * new + torch.arange(new, device=device)
            self.tokens.append((step, spread.reshape(-1)))

    def __call__(
        self, name: str, layer: int | None, x: torch.Tensor, per_row: bool = False
    ) -> torch.Tensor:
        """Projection ``name`` of layer ``layer`` (None: the step's ``head``) over ``x``:
        every token of the call, or (``per_row``) one per row."""
        proj = _pick(self.bound, name, layer)
        out = self.tiling.apply(proj.base, x)
        for step, at in self.rows if per_row else self.tokens:
            part = _pick(step, name, layer)
            if part.delta is None:
                continue
            if at is None:
                out = out + self.tiling.apply(part.lora, x).to(out.dtype)
            else:
                mine = self.tiling.apply(part.lora, x.index_select(0, at)).to(out.dtype)
                out = out.index_put((at,), out.index_select(0, at) + mine)
        return out


def _check_base(step: DecodeStep, adapter: DecodeStep) -> None:
    """An adapter's step must read the very base weights ``step`` reads (a bank's adapters are
    on its base: :mod:`plexrl_dask.worker.backends.adapters`), and neither lays out copies."""
    if step._copies():
        raise OpNotSupported("adapters decode on a step without weight copies")
    ours = [p.data_ptr() for p in step.model.parameters()]
    theirs = [p.data_ptr() for n, p in adapter.model.named_parameters() if "lora_" not in n]
    if ours != theirs:
        raise OpNotSupported("an adapter on another copy of the base cannot decode with it")


@dataclass
class _Cohort:
    """Rows of equal cache length: ``index`` the rows (stream order), their caches per layer
    ``(rows, kv_heads, width, head_dim)``, the next token's position and the next logits."""

    index: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    position: int
    logits: torch.Tensor
    done: int = 0  # rows of index that finished (still fed until the cohort is compacted)

    def select(self, keep: list[int]) -> _Cohort:
        at = torch.tensor(keep, dtype=torch.long, device=self.logits.device)
        return _Cohort(
            [self.index[k] for k in keep],
            [k.index_select(0, at) for k in self.keys],
            [v.index_select(0, at) for v in self.values],
            self.position,
            self.logits.index_select(0, at),
        )


def forward_rows(
    bound: BoundStep,
    tiling: ProductRows,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    parts: Sequence[tuple[int, list[torch.Tensor] | None, list[torch.Tensor] | None]],
    adapters: Adapters = (),
) -> tuple[torch.Tensor, list[tuple[list[torch.Tensor], list[torch.Tensor]]]]:
    """Feed ``tokens`` ``(rows, new)`` at ``positions`` (same shape). ``parts``: consecutive
    groups of rows, each ``(count, keys, values)`` with its cache per layer (None: no tokens
    before; then ``new`` tokens are causal among themselves), all of one width within a
    part. ``bound`` gives the base weights; ``adapters`` the LoRA adapters rows add
    (:data:`Adapters`; none: the base alone). Returns each row's last-token logits (float32)
    and each part's grown cache."""
    s = bound.step
    count, new = tokens.shape
    heads, kv_heads, head_dim = s.heads, s.kv_heads, s.head_dim
    product = _Products(bound, tiling, adapters, count, new)
    x = bound.embed(tokens).view(count * new, -1)
    cos, sin = bound._rotary(positions)
    grown: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in parts]
    for i, layer in enumerate(bound.layers):
        h = tiling.apply(functools.partial(_norm, layer.input_norm), x)
        if layer.qkv is not None:
            qkv = product("qkv", i, h)
            qkv = qkv.view(count, new, heads + 2 * kv_heads, head_dim).transpose(1, 2)
            qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        else:
            q = product("q", i, h)
            k = product("k", i, h)
            v = product("v", i, h)
            q = q.view(count, new, heads, head_dim).transpose(1, 2)
            k = k.view(count, new, kv_heads, head_dim).transpose(1, 2)
            v = v.view(count, new, kv_heads, head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs, at = [], 0
        for p, (n, keys, values) in enumerate(parts):
            kp, vp = k[at : at + n], v[at : at + n]
            if keys is not None and values is not None:
                kp = torch.cat((keys[i], kp), dim=2)
                vp = torch.cat((values[i], vp), dim=2)
                keys[i] = values[i] = None  # type: ignore[call-overload]  # (freed as we go)
            else:
                kp, vp = kp.contiguous(), vp.contiguous()
            grown[p][0].append(kp)
            grown[p][1].append(vp)
            out = F.scaled_dot_product_attention(
                q[at : at + n],
                kp,
                vp,
                is_causal=keys is None and new > 1,
                scale=layer.scaling,
                enable_gqa=True,
            )
            outs.append(out.transpose(1, 2).reshape(n * new, heads * head_dim))
            at += n
        x = x + product("o", i, outs[0] if len(outs) == 1 else torch.cat(outs))
        h = tiling.apply(functools.partial(_norm, layer.post_norm), x)
        if layer.gate_up is not None:
            gate, up = product("gate_up", i, h).chunk(2, dim=-1)
        else:
            gate = product("gate", i, h)
            up = product("up", i, h)
        x = x + product("down", i, F.silu(gate) * up)
    last = tiling.apply(functools.partial(_norm, bound.norm), x.view(count, new, -1)[:, -1])
    return product("head", None, last, per_row=True).float(), grown


class RowDecoder:
    """Decodes ``rows`` (``(prompt index, sample index)`` pairs) of one request so that each
    row's completion is what it would be alone (see the module docstring). Use :meth:`run`
    once."""

    def __init__(
        self,
        backend: TorchBackend,
        step: DecodeStep,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        adapters: Sequence[DecodeStep | None] | None = None,
    ) -> None:
        """``step``: the replica's decode step (``backend.row_step()``). ``adapters``: per
        prompt, the step of the LoRA adapter its rows decode with, on ``step``'s base weights
        (None: the base alone); default: ``step`` as it is, its adapters included."""
        self.backend = backend
        self.prompts = prompts
        self.rows = rows
        self.params = params
        self.device = backend.device
        self.batch_size = backend.max_batch_size
        width = max(len(prompts[i]) for i, _ in rows) + params.max_tokens
        self.bound = step.bind(width)
        self.adapter_of: list[int] | None = None  # per prompt: an index into self.adapters
        self.adapters: list[BoundStep] = []
        if adapters is not None:
            bound: dict[int, int] = {}
            self.adapter_of = []
            for a in adapters:
                if a is not None and id(a) not in bound:
                    _check_base(step, a)
                    bound[id(a)] = len(self.adapters)
                    self.adapters.append(a.bind(width))
                self.adapter_of.append(-1 if a is None else bound[id(a)])
        self.tiling = invariance(self.bound, *self.adapters)
        self.out = Completions(backend, rows, params, prompt_ids)
        self.admitted = 0
        self.forwards = 0

    def _adapters(self, prompts: Sequence[int]) -> Adapters:
        """The adapters of a model call whose rows are of ``prompts`` (indices), in order."""
        if self.adapter_of is None:
            return ()
        rows: list[list[int]] = [[] for _ in self.adapters]
        for r, i in enumerate(prompts):
            if self.adapter_of[i] >= 0:
                rows[self.adapter_of[i]].append(r)
        return [(b, mine) for b, mine in zip(self.adapters, rows, strict=True) if mine]

    def _prefill(self, picked: list[int]) -> list[_Cohort]:
        """Cohorts of the rows ``picked``: their distinct prompts prefilled, grouped by length."""
        by_length: dict[int, list[int]] = {}  # length -> distinct prompt indices
        for r in picked:
            i = self.rows[r][0]
            group = by_length.setdefault(len(self.prompts[i]), [])
            if i not in group:
                group.append(i)
        cohorts = []
        for length, indices in by_length.items():
            ids = torch.tensor([self.prompts[i] for i in indices], dtype=torch.long)
            positions = torch.arange(length).expand(len(indices), length)
            logits, ((keys, values),) = forward_rows(
                self.bound,
                self.tiling,
                ids.to(self.device),
                positions.to(self.device),
                [(len(indices), None, None)],
                self._adapters(indices),
            )
            self.forwards += 1
            mine = [r for r in picked if len(self.prompts[self.rows[r][0]]) == length]
            at = torch.tensor(
                [indices.index(self.rows[r][0]) for r in mine], dtype=torch.long, device=self.device
            )
            cohorts.append(
                _Cohort(
                    mine,
                    [k.index_select(0, at) for k in keys],
                    [v.index_select(0, at) for v in values],
                    length,
                    logits.index_select(0, at),
                )
            )
        return cohorts

    def run(self) -> list[SampledSequence]:
        """Decode every row; their completions in row order."""
        cohorts: list[_Cohort] = []
        live: dict[int, bool] = {}  # row -> still generating
        pad = self.backend.pad_token_id
        while True:
            free = self.batch_size - sum(len(c.index) - c.done for c in cohorts)
            if free > 0 and self.admitted < len(self.rows):
                picked = list(range(self.admitted, min(len(self.rows), self.admitted + free)))
                self.admitted += len(picked)
                cohorts += self._prefill(picked)
                live.update((r, True) for r in picked)
            if not cohorts:
                break
            # choose every live row's next token
            index = [r for c in cohorts for r in c.index if live[r]]
            logits = torch.cat(
                [c.logits[[k for k, r in enumerate(c.index) if live[r]]] for c in cohorts]
            )
            chosen, goes_on = self.out.choose(index, logits)
            fed = dict(zip(index, chosen.tolist(), strict=True))
            live.update(zip(index, goes_on, strict=True))
            cohorts = self._compacted(cohorts, live)
            if not cohorts:
                continue
            feed = torch.tensor(
                [fed[r] if live[r] else pad for c in cohorts for r in c.index], dtype=torch.long
            ).to(self.device)
            positions = torch.tensor(
                [c.position for c in cohorts for _ in c.index], dtype=torch.long
            ).to(self.device)
            logits, grown = forward_rows(
                self.bound,
                self.tiling,
                feed[:, None],
                positions[:, None],
                [(len(c.index), c.keys, c.values) for c in cohorts],
                self._adapters([self.rows[r][0] for c in cohorts for r in c.index]),
            )
            self.forwards += 1
            at = 0
            for c, (keys, values) in zip(cohorts, grown, strict=True):
                c.keys, c.values = keys, values
                c.logits = logits[at : at + len(c.index)]
                c.position += 1
                at += len(c.index)
        logger.debug("%d rows batch-invariantly: %d model calls", len(self.rows), self.forwards)
        return self.out.sequences()

    @staticmethod
    def _compacted(cohorts: list[_Cohort], live: dict[int, bool]) -> list[_Cohort]:
        """The cohorts without finished rows where a quarter or more of one finished (a
        finished row is fed padding until then: dropping rows copies the cohort's cache)."""
        out = []
        for c in cohorts:
            keep = [k for k, r in enumerate(c.index) if live[r]]
            c.done = len(c.index) - len(keep)
            if not keep:
                continue
            if c.done and 4 * c.done >= len(c.index):
                c = c.select(keep)
            out.append(c)
        return out
