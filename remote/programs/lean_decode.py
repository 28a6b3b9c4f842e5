"""The CPU engine's decode forward for Qwen3-family models: one new token per row, without transformers' module
machinery.

A decode step of the tiny model spends most of its time outside the arithmetic: transformers' forward goes through
about 40 module calls a layer, builds a 4-D mask, and runs q, k, v (and gate, up) as separate matrix products. This
forward reads the same parameters and does the same arithmetic in few calls: the q, k and v projections as one
product (and gate and up as one), ``rms_norm`` fused, the rotary embedding of transformers' own module, one additive
mask for all layers, and attention on the key/value heads without repeating them (``scaled_dot_product_attention``,
as transformers' sdpa path does for one query). It writes each layer's key and value into the same cache layers
(remote/programs/kv_cache.py, or transformers' own) through their ``update``.

``LeanDecode.build(net)`` gives one only for a model this forward is written for (Qwen3 architecture, full attention
on every layer, no biases, the default rotary embedding, SiLU MLP, plain logits) and only when its logits agree with
transformers' forward on a check input; otherwise None, and the engine keeps transformers' forward. The fused
weights are copies: ``refresh()`` makes them again after the parameters change (a weight update).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from swectl.model.logit_transforms import logit_transforms

CHECK_TOLERANCE = 1e-4  # largest logit difference to transformers' forward accepted on the check input


def _fits(net: Any) -> str:
    """Why ``net`` is not a model this forward is written for, or ""."""
    cfg = net.config
    if type(net).__name__ != "Qwen3ForCausalLM":
        return f"architecture {type(net).__name__}"
    if any(kind != "full_attention" for kind in getattr(cfg, "layer_types", None) or ["full_attention"]):
        return "sliding-window layers"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "hidden_act", "silu") != "silu":
        return "attention bias or an activation other than SiLU"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')}"
    if transforms := logit_transforms(cfg):
        return f"logit transform {', '.join(transforms)}"
    return ""


class LeanDecode:
    """The decode forward of one Qwen3 model (see the module docstring)."""

    def __init__(self, net: Any) -> None:
        self.net = net
        cfg = net.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        self.refresh()

    @classmethod
    def build(cls, net: Any, log: Any = None) -> LeanDecode | None:
        """A LeanDecode for ``net``, or None (with the reason to ``log``) where it does not fit or disagrees."""
        why = _fits(net)
        lean = None
        if not why:
            lean = cls(net)
            gap = lean.check()
            if gap > CHECK_TOLERANCE:
                why, lean = f"its logits differ from transformers' forward by {gap:.3g} on a check input", None
        if why and log is not None:
            log(f"decode: transformers' forward ({why})")
        return lean

    @torch.no_grad()
    def refresh(self) -> None:
        """Fuse the projections again from the current parameters (after a weight update)."""
        self.layers = []
        for layer in self.net.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight,
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                attn.q_norm.weight, attn.k_norm.weight, attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight,
            ))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the token after ``tokens`` (``[rows]``), each at ``positions`` (``[rows]``),
        attending to the cached positions and itself where ``mask`` (``[rows, cached + 1]``) is 1. Appends the new
        keys and values to ``cache``."""
        rows = tokens.shape[0]
        model = self.net.model
        x = model.embed_tokens(tokens)  # [rows, hidden]
        cos, sin = model.rotary_emb(x, positions[:, None])  # [rows, 1, head_dim]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
        additive = torch.zeros(mask.shape, dtype=x.dtype).masked_fill_(mask == 0, torch.finfo(x.dtype).min)
        additive = additive[:, None, None, :]  # [rows, 1, 1, positions]: every kv head and query
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        groups = self.heads // self.kv_heads
        for index, (ln1, qkv_w, q_norm, k_norm, o_w, ln2, gate_up_w, down_w) in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), ln1, self.eps)
            q, k, v = F.linear(h, qkv_w).split([q_size, kv_size, kv_size], dim=-1)
            q = F.rms_norm(q.view(rows, 1, self.heads, self.head_dim), (self.head_dim,), q_norm, self.eps)
            k = F.rms_norm(k.view(rows, 1, self.kv_heads, self.head_dim), (self.head_dim,), k_norm, self.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.layers[index].update(k.transpose(1, 2), v.view(rows, self.kv_heads, 1, self.head_dim))
            query = q.view(rows, self.kv_heads, groups, self.head_dim)  # the query heads of each kv head
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=additive, scale=self.scaling)
            x = x + F.linear(out.reshape(rows, q_size), o_w)
            h = F.rms_norm(x, (x.shape[-1],), ln2, self.eps)
            gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, down_w)
        return self.net.lm_head(model.norm(x))

    @torch.no_grad()
    def check(self) -> float:
        """The largest logit difference to transformers' forward over a few decode steps of two left-padded rows."""
        from transformers import DynamicCache

        vocab = self.net.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2, 12), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        caches = [DynamicCache(config=self.net.config), DynamicCache(config=self.net.config)]
        for cache in caches:
            self.net(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        gap = 0.0
        next_pos = positions[:, -1] + 1
        for _ in range(3):
            token = torch.randint(0, vocab, (2,), generator=generator)
            mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], dim=1)
            theirs = self.net(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                              past_key_values=caches[0], use_cache=True).logits[:, -1, :]
            mine = self.forward(token, mask, next_pos, caches[1])
            gap = max(gap, float((theirs - mine).abs().max()))
            next_pos = next_pos + 1
        return gap


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
