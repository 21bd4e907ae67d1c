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
up through ``nn.Module`` attributes per layer and per call, and, where the copies are small
(``plexrl.sampling.fused-weights-max-bytes``), concatenates the q/k/v and the gate/up
projections so that each is one matrix product: on small models the count of operations is
the cost. A bound step takes several tokens per row as well (causal within them), which is how
prompts are prefilled without the HF forward.

It agrees with the HF forward up to float rounding (tested: log-probabilities of sampled
tokens equal teacher-forced scoring within 1e-4), and it is used for sampling only; scoring and
training always run the HF forward. Supported: ``Qwen2ForCausalLM`` and ``LlamaForCausalLM``
with the default rotary embedding, SiLU MLPs, no sliding window, unsharded parameters;
:meth:`DecodeStep.for_model` returns None for anything else, and such a model decodes through
its HF forward. ``plexrl.sampling.decode-step: hf`` turns it off; workers must agree on it and
on ``fused-weights-max-bytes`` (like ``max-batch-size``) for replicas to sample
bit-identically.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from dask.utils import parse_bytes

from plexrl_dask import config
from plexrl_dask.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM")
MODES = ("auto", "hf")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The HF RMSNorm's operations, in its order (statistics in float32); the casts are
    # skipped where they are the identity.
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def _fused(*modules: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One projection doing what ``modules`` do side by side (outputs concatenated)."""
    weight = torch.cat([m.weight for m in modules])
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat(
        [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in modules]
    )


Projection = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, gathered by :meth:`DecodeStep.bind`. ``qkv``/``gate_up``
    are the fused projections (None where the copies were too large: then ``q``, ``k``,
    ``v``/``gate``, ``up`` are used)."""

    input_norm: torch.Tensor
    qkv: Projection | None
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    scaling: float
    post_norm: torch.Tensor
    gate_up: Projection | None
    gate: Projection
    up: Projection
    down: Projection


def fused_weights_max_bytes() -> int:
    """``plexrl.sampling.fused-weights-max-bytes`` in bytes; :class:`ConfigError` unless it is a
    byte size >= 0."""
    value = config.get("sampling.fused-weights-max-bytes")
    try:
        parsed = int(parse_bytes(value)) if isinstance(value, str) else value
    except ValueError as e:
        raise ConfigError(f"plexrl.sampling.fused-weights-max-bytes: {e}") from None
    if isinstance(parsed, bool) or not isinstance(parsed, int) or parsed < 0:
        raise ConfigError(
            f"plexrl.sampling.fused-weights-max-bytes must be a byte size >= 0, got {value!r}"
        )
    return parsed


class DecodeStep:
    """See the module docstring. Build with :meth:`for_model`; :meth:`bind` per stream."""

    def __init__(self, model: torch.nn.Module, fuse_max_bytes: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.base = model.model
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.eps = float(cfg.rms_norm_eps)
        self.rotary = self.base.rotary_emb
        self.fuse_max_bytes = fuse_max_bytes

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> DecodeStep | None:
        """A step for ``model`` when ``plexrl.sampling.decode-step`` is ``auto`` and the model
        is of a supported kind (see the module docstring); None otherwise."""
        mode = config.get("sampling.decode-step")
        if mode not in MODES:
            raise ConfigError(f"plexrl.sampling.decode-step must be one of {MODES}, got {mode!r}")
        if mode == "hf":
            return None
        fuse_max_bytes = fused_weights_max_bytes()
        reason = cls._unsupported(model)
        if reason:
            logger.debug("decoding %s through its HF forward: %s", type(model).__name__, reason)
            return None
        return cls(model, fuse_max_bytes)

    @staticmethod
    def _unsupported(model: torch.nn.Module) -> str | None:
        if type(model).__name__ not in SUPPORTED:
            return f"{type(model).__name__} is not one of {SUPPORTED}"
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

    def _fuses(self) -> bool:
        """Whether the fused copies of the q/k/v and gate/up weights fit the budget."""
        total = 0
        for layer in self.base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                total += m.weight.numel() * m.weight.element_size()
        return total <= self.fuse_max_bytes

    def bind(self) -> BoundStep:
        """The step over the weights the model holds now (see the module docstring)."""
        fuse = self._fuses()
        layers = []
        for layer in self.base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=_fused(attn.q_proj, attn.k_proj, attn.v_proj) if fuse else None,
                    q=_weight(attn.q_proj),
                    k=_weight(attn.k_proj),
                    v=_weight(attn.v_proj),
                    o=_weight(attn.o_proj),
                    scaling=float(attn.scaling),
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=_fused(mlp.gate_proj, mlp.up_proj) if fuse else None,
                    gate=_weight(mlp.gate_proj),
                    up=_weight(mlp.up_proj),
                    down=_weight(mlp.down_proj),
                )
            )
        return BoundStep(self, layers)


class BoundStep:
    """A :class:`DecodeStep` over weights gathered by :meth:`DecodeStep.bind`. Call it inside
    ``torch.inference_mode()`` or ``no_grad``."""

    def __init__(self, step: DecodeStep, layers: list[_Layer]) -> None:
        self.step = step
        self.layers = layers
        self.embed = step.base.embed_tokens
        self.norm = step.base.norm.weight
        head = step.model.lm_head
        self.head = (head.weight, head.bias)
        self.inv_freq = step.rotary.inv_freq.to(torch.float32)
        self.attention_scaling = float(step.rotary.attention_scaling)

    def _rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``(rows, 1, tokens, head_dim)``, as the HF rotary
        embedding computes them."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].to(torch.float32) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, None], sin[:, None]

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
        shape = (rows, new, -1)
        x = self.embed(tokens)
        cos, sin = self._rotary(positions, x.dtype)
        attend = self._attend(mask, new)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, s.eps)
            if layer.qkv is not None:
                qkv = F.linear(h, *layer.qkv).view(rows, new, heads + 2 * kv_heads, head_dim)
                qkv = qkv.transpose(1, 2)
                qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)
                q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            else:
                q = F.linear(h, *layer.q).view(rows, new, heads, head_dim).transpose(1, 2)
                k = F.linear(h, *layer.k).view(rows, new, kv_heads, head_dim).transpose(1, 2)
                v = F.linear(h, *layer.v).view(rows, new, kv_heads, head_dim).transpose(1, 2)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if keys is None or values is None:
                k, v = k.contiguous(), v.contiguous()
            else:
                k = torch.cat((keys[i], k), dim=2)
                v = torch.cat((values[i], v), dim=2)
                keys[i] = values[i] = None  # type: ignore[call-overload]  # (freed as we go)
            new_keys.append(k)
            new_values.append(v)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attend, scale=layer.scaling, enable_gqa=True
            )
            x = x + F.linear(out.transpose(1, 2).reshape(shape), *layer.o)
            h = _rms_norm(x, layer.post_norm, s.eps)
            if layer.gate_up is not None:
                gate, up = F.linear(h, *layer.gate_up).chunk(2, dim=-1)
            else:
                gate, up = F.linear(h, *layer.gate), F.linear(h, *layer.up)
            x = x + F.linear(F.silu(gate) * up, *layer.down)
        last = _rms_norm(x[:, -1], self.norm, s.eps)
        return F.linear(last, *self.head).float(), new_keys, new_values
