"""One decode step of a Llama-family model, computed from its own modules' weights.

Decoding feeds one token per row per step. On a small model most of a step's time is the
Hugging Face forward's per-call machinery (wrappers, mask construction, cache bookkeeping,
attribute lookups per layer), not arithmetic: on this project's tiny models a one-row step
cost about 3.9 ms through the HF forward and 2.3 ms as the same operations called directly
(`benchmarks/RESULTS.md`). That fixed cost is what makes a batch's long tail, a few rows
still generating, expensive. :class:`DecodeStep` computes exactly the layers' math, reading
the weights of the model's modules at every call (so weight updates, reloads and
``set_weights`` are seen at once):

    x = embed(token)
    per layer:  h = rmsnorm(x);  q, k, v = linear(h) (+ bias);  rotary(q, k) at each row's
                position;  k, v appended to the row's cache;  x += o(attention(q, k, v, mask))
                h = rmsnorm(x);  x += down(silu(gate(h)) * up(h))
    logits = lm_head(rmsnorm(x))

It agrees with the HF forward up to float rounding (tested: log-probabilities of sampled
tokens equal teacher-forced scoring within 1e-4), and it is used for sampling only; scoring and
training always run the HF forward. Supported: ``Qwen2ForCausalLM`` and ``LlamaForCausalLM``
with the default rotary embedding, SiLU MLPs, no sliding window, unsharded parameters;
:meth:`DecodeStep.for_model` returns None for anything else, and such a model decodes through
its HF forward. ``plexrl.sampling.decode-step: hf`` turns it off; workers must agree on it
(like ``max-batch-size``) for replicas to sample bit-identically.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from plexrl_dask import config
from plexrl_dask.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM")
MODES = ("auto", "hf")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The HF RMSNorm's operations, in its order (statistics in float32).
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DecodeStep:
    """See the module docstring. Build with :meth:`for_model`."""

    def __init__(self, model: torch.nn.Module) -> None:
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

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> DecodeStep | None:
        """A step for ``model`` when ``plexrl.sampling.decode-step`` is ``auto`` and the model
        is of a supported kind (see the module docstring); None otherwise."""
        mode = config.get("sampling.decode-step")
        if mode not in MODES:
            raise ConfigError(f"plexrl.sampling.decode-step must be one of {MODES}, got {mode!r}")
        if mode == "hf":
            return None
        reason = cls._unsupported(model)
        if reason:
            logger.debug("decoding %s through its HF forward: %s", type(model).__name__, reason)
            return None
        return cls(model)

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

    @torch.no_grad()
    def __call__(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Feed ``tokens`` ``(rows,)`` at ``positions`` ``(rows, 1)``; ``keys``/``values``: per
        layer ``(rows, kv_heads, width, head_dim)`` of the tokens before, ``mask``
        ``(rows, width + 1)``: 1 where a row attends (the new token included). Returns the
        next-token logits ``(rows, vocab)`` in float32 and the grown caches. ``keys`` and
        ``values`` are consumed: each layer's old tensors are released once grown, so the
        cache is held once, not twice, during the step."""
        rows = tokens.shape[0]
        x = self.base.embed_tokens(tokens[:, None])
        freqs = positions[..., None].to(torch.float32) * self.rotary.inv_freq.to(
            x.device, torch.float32
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rotary.attention_scaling
        cos = (emb.cos() * scale).to(x.dtype)[:, None]  # (rows, 1, 1, head_dim)
        sin = (emb.sin() * scale).to(x.dtype)[:, None]
        attend = mask.to(torch.bool)[:, None, None, :]
        new_keys, new_values = [], []
        for i, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm.weight, self.eps)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias)
            q = _rotate(q.view(rows, 1, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = _rotate(k.view(rows, 1, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(rows, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            k = torch.cat((keys[i], k), dim=2)
            v = torch.cat((values[i], v), dim=2)
            keys[i] = values[i] = None  # type: ignore[call-overload]  # (freed as we go)
            new_keys.append(k)
            new_values.append(v)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attend, scale=attn.scaling, enable_gqa=True
            )
            x = x + F.linear(
                out.transpose(1, 2).reshape(rows, 1, -1), attn.o_proj.weight, attn.o_proj.bias
            )
            mlp = layer.mlp
            h = _rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
            x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        x = _rms_norm(x, self.base.norm.weight, self.eps)
        head = self.model.lm_head
        return F.linear(x[:, -1], head.weight, head.bias).float(), new_keys, new_values
