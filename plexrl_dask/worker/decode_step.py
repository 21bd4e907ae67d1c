"""One decode step of a Llama-family model, computed from its own modules' weights.

Decoding feeds one token per row per step. On a small model most of a step's time is the
Hugging Face forward's per-call machinery (wrappers, mask construction, cache bookkeeping,
attribute lookups per layer), not arithmetic: on this project's tiny models a one-row step
cost about 3.9 ms through the HF forward and 2.3 ms as the same operations called directly
(`benchmarks/RESULTS.md`). That fixed cost is what makes a batch's long tail, a few rows
still generating, expensive. :class:`DecodeStep` computes exactly the layers' math:

    x = embed(tokens)
    per layer:  h = rmsnorm(x);  q, k, v = linear(h) (+ bias);  rotary(q, k) at each token's
                position;  k, v appended to the row's cache;  x += o(attention(q, k, v, mask))
                h = rmsnorm(x);  x += down(silu(gate(h)) * up(h))
    logits = lm_head(rmsnorm(x at each row's last token))

:meth:`DecodeStep.bind` reads the modules' weights once, for one stream of a request (a
request never runs beside a weight update of its replica, so every step of the stream sees
the weights the request started with). Binding also gathers what a step would otherwise look
up through ``nn.Module`` attributes per layer and per call. Where the copies are small
(``plexrl.sampling.fused-weights-max-bytes``: every projection's weight, the output head's
included), it lays the weights out for the CPU's cheapest path, because on small models the
count and kind of operations is the cost, not their arithmetic:

- q/k/v and gate/up are concatenated, so that each is one matrix product;
- every projection is a transposed contiguous copy, multiplied as a 2-D ``mm``/``addmm``
  (``F.linear`` on the module's weight took 1.3-3.3x as long at decode shapes here);
- each RMSNorm's weight is folded into the copy of the projection that reads it, and the
  norm's mean of squares is one matrix product that adds ``eps`` (``F.rms_norm``'s reduction
  kernels took 1.7-1.8x as long at these shapes);
- the rotary ``cos``/``sin`` are tables over the stream's positions, looked up per step;
  ``rotate_half`` is a ``roll`` against a sign-folded ``sin`` (the same products);
- on the CPU in float32, a one-token step of 32 rows or more computes attention as two
  batched products around a softmax, with the mask as one additive bias shared by all layers
  (SDPA elsewhere, and for fewer rows, where SDPA is the faster).

Together they cut a step to 0.62-0.88 of its earlier time (about a quarter off) at 1 to 128
rows in-process here (`benchmarks/RESULTS.md`). The layout is kept across requests while the
weights are unchanged (at most ``fused-weights-max-bytes`` per deployment, beside the
weights) and dropped when the model is offloaded. A bound step takes several tokens per row as well (causal within
them), which is how prompts are prefilled without the HF forward.

It agrees with the HF forward up to float rounding (tested: log-probabilities of sampled
tokens equal teacher-forced scoring within 1e-4), and it is used for sampling only; scoring and
training always run the HF forward. Supported: ``Qwen2ForCausalLM`` and ``LlamaForCausalLM``
with the default rotary embedding, SiLU MLPs, no sliding window, unsharded parameters;
:meth:`DecodeStep.for_model` returns None for anything else, and such a model decodes through
its HF forward. A model with PEFT LoRA layers is supported only when asked for
(``adapters=True``, the batch-invariant row decoder): each projection then adds its adapter's
product, and no weight is copied (a copy per adapter would hold the shared base again). ``plexrl.sampling.decode-step: hf`` turns it off; workers must agree on it and
on ``fused-weights-max-bytes`` (like ``max-batch-size``) for replicas to sample
bit-identically.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from plexrl_dask import config
from plexrl_dask.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM")
MODES = ("auto", "hf")
# From this many rows, a one-token step's attention on the CPU is written out (two batched
# products around a softmax, the mask one bias shared by every layer); below it, SDPA. Whole
# steps of the job mix's models, in-process: written out, 0.78-0.97x SDPA's time at 32-128
# rows, 1.0-1.18x at 1-16 (benchmarks/RESULTS.md). The same rule on every worker, so
# replicas still sample alike.
MANUAL_ATTENTION_MIN_ROWS = 32


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The HF RMSNorm's operations, in its order (statistics in float32). In float32,
    # ``F.rms_norm`` computes them in one call (the same bits, where we compared).
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True)
class _Norm:
    """An RMSNorm of a bound step. ``weight`` None: the weight is folded into the copy of the
    projection that reads the norm (``W · diag(weight)``), and the mean of squares is one
    matrix product with a column of ``1 / features`` that adds ``eps`` as it goes: on the CPU,
    0.55-0.6 of ``F.rms_norm``'s time at a decode step's shapes, whose reduction kernels
    cost more than their arithmetic. (Float32 only; the sums' order differs from HF's, within
    float rounding.)"""

    weight: torch.Tensor | None
    eps: float
    mean_column: torch.Tensor | None = None  # (features, 1) of 1 / features
    eps_cell: torch.Tensor | None = None  # (1, 1) holding eps

    @classmethod
    def folded(cls, weight: torch.Tensor, eps: float) -> _Norm:
        features = weight.shape[0]
        column = torch.full((features, 1), 1.0 / features, dtype=weight.dtype, device=weight.device)
        return cls(
            None, eps, column, torch.full((1, 1), eps, dtype=weight.dtype, device=weight.device)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(tokens, features)``."""
        if self.weight is not None:
            return _rms_norm(x, self.weight, self.eps)
        assert self.mean_column is not None and self.eps_cell is not None
        return x * torch.addmm(self.eps_cell, x.square(), self.mean_column).rsqrt_()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, written
    as ``x * cos + cat(x2, x1) * cat(-sin1, sin2)``: the same products, bit for bit (a sign
    moves from one factor to the other), in one ``roll`` instead of two slices, a negation
    and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def attention_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per row: ``q`` ``(rows, heads, 1, head_dim)`` (or ``(rows, heads,
    head_dim)``) against the cache ``k``/``v`` ``(rows, kv_heads, width, head_dim)``, whose
    first two dimensions merge into one (a contiguous cache, or the first rows and columns of
    a larger one); ``bias`` ``(rows * kv_heads, 1, width)`` additive, 0 or -inf. Query head
    ``h`` reads kv head ``h // (heads / kv_heads)``, as HF's ``repeat_kv`` and SDPA's
    ``enable_gqa`` do. Two batched products around a softmax (computed in float32 inside the
    kernel, as HF's eager attention does); returns ``(rows, heads * head_dim)``, ready for the
    output projection."""
    rows, heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    kv, width = k.shape[1], k.shape[2]
    q3 = q.reshape(rows * kv, heads // kv, head_dim)
    scores = torch.baddbmm(
        bias, q3, k.view(rows * kv, width, head_dim).transpose(1, 2), alpha=scale
    )
    out = torch.bmm(scores.softmax(dim=-1), v.view(rows * kv, width, head_dim))
    return out.view(rows, heads * head_dim)


@dataclass(frozen=True)
class _Proj:
    """One linear projection of a bound step. ``transposed``: ``weight`` is a contiguous
    ``(in, out)`` copy, multiplied with ``mm``/``addmm`` (on the CPU, 0.3-0.75 of
    ``F.linear``'s time at a decode step's shapes: it skips the transposed-weight path);
    otherwise it is the module's own ``(out, in)`` weight, through ``F.linear``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    transposed: bool
    # A LoRA adapter's (A, B, scaling) on this projection: ``+ scaling * B(A(x))``, as PEFT
    # computes it (in the adapter's dtype, then cast back)
    delta: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(tokens, in)`` -> ``(tokens, out)``: :meth:`base`, plus :meth:`lora`."""
        out = self.base(x)
        if self.delta is None:
            return out
        return out + self.lora(x).to(out.dtype)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """The base weights' product alone (no adapter)."""
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def lora(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's part, ``scaling * B(A(x))`` in the adapter's dtype (to be cast to
        the base product's and added)."""
        assert self.delta is not None
        a, b, scaling = self.delta
        return F.linear(F.linear(x.to(a.dtype), a), b) * scaling


def _proj(*modules: torch.nn.Module, copy: bool, scale: torch.Tensor | None = None) -> _Proj:
    """One projection doing what ``modules`` do side by side (outputs concatenated); with
    ``copy``, laid out as a transposed copy, its inputs first scaled by ``scale`` (a norm's
    weight folded in: ``W · diag(scale)``). Without ``copy``, a single module as it is."""
    if not copy:
        assert len(modules) == 1 and scale is None, "fusing or folding copies the weights"
        module = modules[0]
        if hasattr(module, "lora_A"):  # (PEFT's LoRA layer: checked by _unsupported)
            name = module.active_adapters[0]
            delta = (
                module.lora_A[name].weight,
                module.lora_B[name].weight,
                float(module.scaling[name]),
            )
            base = module.base_layer
            return _Proj(base.weight, base.bias, transposed=False, delta=delta)
        return _Proj(module.weight, module.bias, transposed=False)
    weight = torch.cat([m.weight for m in modules])
    if scale is not None:
        weight = weight * scale
    weight = weight.t().contiguous()
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                for m in modules
            ]
        )
    return _Proj(weight, bias, transposed=True)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, gathered by :meth:`DecodeStep.bind`. ``qkv``/``gate_up``
    are the fused projections (None where the copies were too large: then ``q``, ``k``,
    ``v``/``gate``, ``up`` are used)."""

    input_norm: _Norm
    qkv: _Proj | None
    q: _Proj | None
    k: _Proj | None
    v: _Proj | None
    o: _Proj
    scaling: float
    post_norm: _Norm
    gate_up: _Proj | None
    gate: _Proj | None
    up: _Proj | None
    down: _Proj


def fused_weights_max_bytes() -> int:
    """``plexrl.sampling.fused-weights-max-bytes`` in bytes; :class:`ConfigError` unless it is a
    byte size >= 0."""
    return config.get_bytes("sampling.fused-weights-max-bytes")


class DecodeStep:
    """See the module docstring. Build with :meth:`for_model`; :meth:`bind` per stream."""

    def __init__(self, model: torch.nn.Module, fuse_max_bytes: int = 0) -> None:
        cfg = model.config
        self.model = model
        # LoRA layers: their base weights and adapters are read as they are, never copied (a
        # copy per adapter would hold its base again)
        self.adapters = any(hasattr(m, "lora_A") for m in model.modules())
        self.base = model.model
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.eps = float(cfg.rms_norm_eps)
        self.rotary = self.base.rotary_emb
        self.fuse_max_bytes = fuse_max_bytes
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
        self._tables = {}
        self._layout: tuple[tuple[int, ...], list[_Layer], _Norm, _Proj] | None = None
        self._layout_bytes: tuple[Any, int] = (None, 0)  # (the layout, its copies' bytes)

    @classmethod
    def for_model(cls, model: torch.nn.Module, adapters: bool = False) -> DecodeStep | None:
        """A step for ``model`` when ``plexrl.sampling.decode-step`` is ``auto`` and the model
        is of a supported kind (see the module docstring); None otherwise. ``adapters``:
        a model with PEFT LoRA layers (one active adapter each, unmerged, no dropout) is
        supported too, its products adding the adapter's; only the batch-invariant row
        decoder asks for that (:mod:`plexrl_dask.worker.row_decode`)."""
        mode = config.get("sampling.decode-step")
        if mode not in MODES:
            raise ConfigError(f"plexrl.sampling.decode-step must be one of {MODES}, got {mode!r}")
        if mode == "hf":
            return None
        fuse_max_bytes = fused_weights_max_bytes()
        reason = cls._unsupported(model, adapters)
        if reason:
            logger.debug("decoding %s through its HF forward: %s", type(model).__name__, reason)
            return None
        return cls(model, fuse_max_bytes)

    @staticmethod
    def _unsupported(model: torch.nn.Module, adapters: bool = False) -> str | None:
        if type(model).__name__ not in SUPPORTED:
            return f"{type(model).__name__} is not one of {SUPPORTED}"
        lora = [m for m in model.modules() if hasattr(m, "lora_A")]
        if lora and not adapters:
            return "it has LoRA adapters"
        for m in lora:
            active = list(getattr(m, "active_adapters", ()))
            if (
                len(active) != 1
                or getattr(m, "merged", False)
                or any(getattr(m, "use_dora", {}).values())
                or not isinstance(m.lora_dropout[active[0]], torch.nn.Identity)
                or type(m.base_layer).__name__ != "Linear"
            ):
                return "a LoRA layer other than one unmerged adapter on a linear layer"
        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"hidden_act {cfg.hidden_act!r}"
        rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
        if (rope.get("rope_type") or rope.get("type") or "default") != "default":
            return f"rope type {rope.get('rope_type') or rope.get('type')!r}"
        if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
        ):
            return "sliding-window attention"
        if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
            return f"attention implementation {cfg._attn_implementation!r}"
        if any(
            type(p).__name__ != "Parameter" or hasattr(p, "device_mesh") for p in model.parameters()
        ):
            return "sharded parameters"
        if getattr(model.model.rotary_emb, "rope_type", "default") != "default":
            return "rotary embedding"
        return None

    def _copies(self) -> bool:
        """Whether the bound step's copies of the weights (every projection transposed, q/k/v
        and gate/up fused, the output head) fit ``fused-weights-max-bytes`` (never with
        adapters)."""
        if self.adapters:
            return False
        modules = [self.model.lm_head]
        for layer in self.base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            modules += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        total = sum(m.weight.numel() * m.weight.element_size() for m in modules)
        return total <= self.fuse_max_bytes

    def rotary_tables(
        self, positions: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` (:func:`_rotate`) for positions ``0 .. positions - 1``,
        ``(positions, head_dim)`` on ``like``'s device and in its dtype, computed as the HF
        rotary embedding computes them (each entry one float32 product of a position and an
        inverse frequency, then cos/sin, the attention scaling, the cast). Kept per device and
        dtype and grown on demand: inverse frequencies are buffers, never trained."""
        key = (like.device, like.dtype)
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < positions:
            count = max(positions, 2 * have[0].shape[0] if have is not None else 0)
            inv_freq = self.rotary.inv_freq.to(device=like.device, dtype=torch.float32)
            at = torch.arange(count, device=like.device, dtype=torch.float32)
            freqs = at[:, None] * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            scaling = float(self.rotary.attention_scaling)
            if scaling != 1.0:
                cos, sin = cos * scaling, sin * scaling
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            have = self._tables[key] = (cos.to(like.dtype), sin.to(like.dtype))
        return have

    def _weights_stamp(self) -> tuple[int, ...]:
        """Where every parameter's data lives and how often it was written in place: equal
        stamps, equal weights. Optimizer steps, ``set_weights`` and state loads write in place
        (each bumps the tensor's version counter); offloading drops the layout
        (:meth:`release`), and data put elsewhere changes its address."""
        params = list(self.model.parameters())
        return tuple(p._version for p in params) + tuple(p.data_ptr() for p in params)

    def nbytes(self) -> int:
        """Device bytes this step keeps beside the model's parameters: its weight layout's
        copies (the fused and transposed projections, the folded norms) and its rotary
        tables. Counted in the replica's bytes (the holder's budget), after every request:
        a layout is walked once."""
        tables = sum(t.untyped_storage().nbytes() for pair in self._tables.values() for t in pair)
        if self._layout is None:
            return tables
        if self._layout_bytes[0] is not self._layout:
            self._layout_bytes = (self._layout, self._copies_bytes(self._layout[1:]))
        return self._layout_bytes[1] + tables

    def _copies_bytes(self, layout: Any) -> int:
        """Bytes of the tensors in ``layout`` (dataclasses, lists, tuples of them) that are
        not the model's parameters, each storage once."""
        seen = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        total = 0

        def count(t: Any) -> None:
            nonlocal total
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
            elif dataclasses.is_dataclass(t) and not isinstance(t, type):
                for f in dataclasses.fields(t):
                    count(getattr(t, f.name))
            elif isinstance(t, (list, tuple)):
                for x in t:
                    count(x)

        count(layout)
        return total

    def release(self) -> None:
        """Drop the weight layout and rotary tables kept for the next :meth:`bind` (the
        backend calls this before it offloads the model: they hold device memory)."""
        self._layout = None
        self._tables.clear()

    def bind(self, positions: int | None = None) -> BoundStep:
        """The step over the weights the model holds now (see the module docstring), for
        tokens at positions below ``positions`` (default: the model's
        ``max_position_embeddings``; a stream passes its longest prompt plus ``max_tokens``).
        The weight layout is kept while the weights are unchanged: laying it out again costs
        a few ms per request on the tiny models, a tenth of a short-answer request."""
        if positions is None:
            positions = int(self.model.config.max_position_embeddings)
        layers, norm, head = self.layout()
        return BoundStep(self, layers, norm, head, positions)

    def layout(self) -> tuple[list[_Layer], _Norm, _Proj]:
        """The layers, final norm and head over the weights the model holds now, laid out as
        the module docstring says; kept while the weights are unchanged (the same objects are
        returned until a weight is written or the model offloaded)."""
        stamp = self._weights_stamp()
        if self._layout is None or self._layout[0] != stamp:
            self._layout = (stamp, *self._lay_out())
        _, layers, norm, head = self._layout
        return layers, norm, head

    def _lay_out(self) -> tuple[list[_Layer], _Norm, _Proj]:
        """The layers, the final norm and the head as :meth:`bind` lays them out."""
        copy = self._copies()
        # Norm weights are folded into the copies of the projections that read them.
        fold = copy and self.model.lm_head.weight.dtype == torch.float32

        def norm(module: torch.nn.Module) -> tuple[_Norm, torch.Tensor | None]:
            if fold:
                return _Norm.folded(module.weight, self.eps), module.weight
            return _Norm(module.weight, self.eps), None

        layers = []
        for layer in self.base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            input_norm, into_qkv = norm(layer.input_layernorm)
            post_norm, into_mlp = norm(layer.post_attention_layernorm)
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            layers.append(
                _Layer(
                    input_norm=input_norm,
                    qkv=_proj(*qkv, copy=True, scale=into_qkv) if copy else None,
                    q=None if copy else _proj(attn.q_proj, copy=False),
                    k=None if copy else _proj(attn.k_proj, copy=False),
                    v=None if copy else _proj(attn.v_proj, copy=False),
                    o=_proj(attn.o_proj, copy=copy),
                    scaling=float(attn.scaling),
                    post_norm=post_norm,
                    gate_up=(
                        _proj(mlp.gate_proj, mlp.up_proj, copy=True, scale=into_mlp)
                        if copy
                        else None
                    ),
                    gate=None if copy else _proj(mlp.gate_proj, copy=False),
                    up=None if copy else _proj(mlp.up_proj, copy=False),
                    down=_proj(mlp.down_proj, copy=copy),
                )
            )
        final_norm, into_head = norm(self.base.norm)
        return layers, final_norm, _proj(self.model.lm_head, copy=copy, scale=into_head)


class BoundStep:
    """A :class:`DecodeStep` over weights gathered by :meth:`DecodeStep.bind`. Call it inside
    ``torch.inference_mode()`` or ``no_grad``."""

    def __init__(
        self, step: DecodeStep, layers: list[_Layer], norm: _Norm, head: _Proj, positions: int
    ) -> None:
        self.step = step
        self.layers = layers
        self.norm = norm
        self.head = head
        self.embed = step.base.embed_tokens
        self.cos, self.sin_signed = step.rotary_tables(positions, self.embed.weight)
        # On the CPU in float32, one-token steps of MANUAL_ATTENTION_MIN_ROWS rows or more
        # write attention out; elsewhere SDPA's fused kernels are kept.
        weight = self.embed.weight
        self.manual_attention = weight.device.type == "cpu" and weight.dtype == torch.float32

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and the signed ``sin`` (:func:`_rotate`) at ``positions``, shaped
        ``(rows, 1, tokens, head_dim)``: rows of the tables built at :meth:`DecodeStep.bind`."""
        cos = F.embedding(positions, self.cos)
        return cos[:, None], F.embedding(positions, self.sin_signed)[:, None]

    @staticmethod
    def _attend(mask: torch.Tensor, new: int) -> torch.Tensor:
        """Which keys each new token attends to: ``(rows, 1, new, width + new)``."""
        attend = mask.to(torch.bool)[:, None, None, :]
        if new == 1:
            return attend
        width = mask.shape[1] - new
        cols = torch.arange(width + new, device=mask.device)
        at = width + torch.arange(new, device=mask.device)[:, None]
        # Causal among the new tokens. A padding token attends to itself only: a query with
        # nothing to attend to would come out NaN, and its key and value would carry the NaN
        # into every later product with the cache (masked weights are zero, NaN times zero
        # is not).
        return (attend & (cols <= at)) | (cols == at)

    def _decode_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The mask of a one-token step as an additive bias, ``(rows * kv_heads, 1, width)``:
        0 where a row has a token, -inf elsewhere (the new token is always a token, so no
        row's softmax is all -inf)."""
        rows, width = mask.shape
        bias = torch.zeros((rows, width), dtype=dtype, device=mask.device)
        bias.masked_fill_(mask == 0, float("-inf"))
        kv = self.step.kv_heads
        return bias[:, None, None, :].expand(rows, kv, 1, width).reshape(rows * kv, 1, width)

    def __call__(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor] | None,
        values: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Feed ``tokens``, ``(rows,)`` or ``(rows, new)``, at ``positions`` (``(rows, 1)`` or
        ``(rows, new)``); ``keys``/``values``: per layer ``(rows, kv_heads, width, head_dim)``
        of the tokens before (None: no tokens before, a prefill); ``mask``
        ``(rows, width + new)``: 1 where a row has a token (the new ones included; a prompt's
        left padding is 0). Returns the logits of each row's last token ``(rows, vocab)`` in
        float32 and the grown caches. ``keys`` and ``values`` are consumed: each layer's old
        tensors are released once grown, so the cache is held once, not twice, during the
        step."""
        s = self.step
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        rows, new = tokens.shape
        heads, kv_heads, head_dim = s.heads, s.kv_heads, s.head_dim
        # Every projection runs on (rows * new, features): two-dimensional products.
        x = self.embed(tokens).view(rows * new, -1)
        cos, sin = self._rotary(positions)
        one = (
            new == 1
            and keys is not None
            and self.manual_attention
            and rows >= MANUAL_ATTENTION_MIN_ROWS
        )
        attend = self._decode_bias(mask, x.dtype) if one else self._attend(mask, new)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            if layer.qkv is not None:
                qkv = layer.qkv(h).view(rows, new, heads + 2 * kv_heads, head_dim)
                qkv = qkv.transpose(1, 2)
                qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)
                q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            else:
                assert layer.q is not None and layer.k is not None and layer.v is not None
                q = layer.q(h).view(rows, new, heads, head_dim).transpose(1, 2)
                k = layer.k(h).view(rows, new, kv_heads, head_dim).transpose(1, 2)
                v = layer.v(h).view(rows, new, kv_heads, head_dim).transpose(1, 2)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if keys is None or values is None:
                k, v = k.contiguous(), v.contiguous()
            else:
                k = torch.cat((keys[i], k), dim=2)
                v = torch.cat((values[i], v), dim=2)
                keys[i] = values[i] = None  # type: ignore[call-overload]  # (freed as we go)
            new_keys.append(k)
            new_values.append(v)
            if one:
                out = attention_one(q, k, v, attend, layer.scaling)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attend, scale=layer.scaling, enable_gqa=True
                )
                out = out.transpose(1, 2).reshape(rows * new, heads * head_dim)
            x = x + layer.o(out)
            h = layer.post_norm(x)
            if layer.gate_up is not None:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
            else:
                assert layer.gate is not None and layer.up is not None
                gate, up = layer.gate(h), layer.up(h)
            x = x + layer.down(F.silu(gate) * up)
        last = self.norm(x.view(rows, new, -1)[:, -1])
        return self.head(last).float(), new_keys, new_values
