"""Multi-latent attention (DeepSeek-V2/V3, Kimi K2.x) for the EAGLE-3 drafter's single layer.

The layer SGLang 0.5.23 serves as ``Eagle3DeepseekV2ForCausalLM`` (python/sglang/srt/models/kimi_k25_eagle3.py):
its ``Eagle3MLADecoderLayer`` builds ``DeepseekV2AttentionMLA`` (models/deepseek_v2.py) and then widens the
fused q/kv down-projection to read the EAGLE-3 input ``[input_layernorm(embeds), hidden_norm(hidden)]`` (2H).
Everything else is the target's attention. Shapes, for h heads, n = qk_nope_head_dim, r = qk_rope_head_dim,
v = v_head_dim, Lq = q_lora_rank, Lkv = kv_lora_rank:

    x       [B, T, 2H]
    q       = q_b_proj(q_a_layernorm(q_a_proj(x)))          # 2H -> Lq -> h*(n+r); per head [nope | rope]
    latent  = kv_a_proj_with_mqa(x)                         # 2H -> Lkv + r: [compressed kv | shared rope key]
    kv      = kv_b_proj(kv_a_layernorm(latent[:Lkv]))       # Lkv -> h*(n+v); per head [k_nope | value]
    k       = [k_nope | rope(latent[Lkv:])]                 # the rope key is one head, shared by all heads
    out     = o_proj(softmax(q k^T * scale) value)          # h*v -> H

SGLang stores checkpoint ``q_a_proj`` and ``kv_a_proj_with_mqa`` fused (rows concatenated, q first) as
``fused_qkv_a_proj_with_mqa`` and, after loading, splits ``kv_b_proj`` per head into ``w_kc`` (the n key rows)
and ``w_vc`` (the v value rows) so decode can attend in the latent space ("absorbed"): its KV cache holds
only ``Lkv + r`` values per token (576 for Kimi), the reason for choosing MLA. Here the keys and values are
expanded per head and go through the same caches as the Llama kind (``DrafterKVCache``, ``TTTCache``);
the math is the same, the memory is not what SGLang uses.

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (``rope_interleave``, SGLang's
``is_neox_style=False``) with YaRN frequencies (``DeepseekScalingRotaryEmbedding``): cos/sin are scaled by
mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax scale by mscale(factor,
mscale_all_dim)^2 (``compute_mla_mscale_scaling``); Kimi K2.x uses factor 64, theta 50000.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aerie.drafter_kinds.eagle3.layers import DrafterKVCache, RMSNorm, TTTCache

if TYPE_CHECKING:
    from aerie.drafter_kinds.eagle3.model import DrafterConfig


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude correction (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: dict | None) -> tuple[Tensor, float]:
    """(inverse frequencies [dim/2] in fp32, cos/sin magnitude) of plain RoPE or DeepSeek YaRN.

    YaRN keeps the fast-rotating dimensions (more than ``beta_fast`` turns over the original context) as they
    are, divides the slow ones (fewer than ``beta_slow`` turns) by ``factor`` and ramps linearly in between.
    """
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not scaling:
        return 1.0 / pos_freqs, 1.0
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    magnitude = yarn_mscale(factor, float(scaling.get("mscale", 1))) / yarn_mscale(
        factor, float(scaling.get("mscale_all_dim", 0))
    )
    return inv_freq, magnitude


def mla_softmax_scale(cfg: DrafterConfig) -> float:
    """1/sqrt(n + r), times mscale(factor, mscale_all_dim)^2 under YaRN (SGLang's compute_mla_mscale_scaling)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling
    if s:
        m = yarn_mscale(float(s["factor"]), float(s.get("mscale_all_dim", 0)))
        scale *= m * m
    return scale


def apply_rope(x: Tensor, position_ids: Tensor, inv_freq: Tensor, magnitude: float, interleave: bool) -> Tensor:
    """Rotate x [B, heads, T, r] at position_ids [B, T]; fp32 math, result in x's dtype."""
    freqs = position_ids.float()[:, None, :, None] * inv_freq.to(x.device)  # [B, 1, T, r/2]
    cos, sin = freqs.cos() * magnitude, freqs.sin() * magnitude
    xf = x.float()
    if interleave:  # pairs (x[2i], x[2i+1]) turn by frequency i, in place
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:  # neox: halves (x[i], x[i + r/2]) turn by frequency i
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class MLAAttention(nn.Module):
    """DeepSeek multi-latent attention over the 2H-wide EAGLE-3 input; parameter names are the checkpoint
    names SGLang's Eagle3DeepseekV2ForCausalLM.load_weights reads (under ``midlayer.self_attn.``)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H, h = cfg.hidden_size, cfg.num_attention_heads
        n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_a_proj = nn.Linear(2 * H, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (n + r), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, cfg.kv_lora_rank + r, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (n + v), bias=False)
        self.o_proj = nn.Linear(h * v, H, bias=False)
        # The caches scale scores by 1/sqrt(n + r); folding YaRN's extra factor into q keeps them kind-agnostic.
        self.q_multiplier = mla_softmax_scale(cfg) * math.sqrt(n + r)

    def forward(self, x: Tensor, position_ids: Tensor, cache: DrafterKVCache | TTTCache | None) -> Tensor:
        B, T, _ = x.shape
        c = self.cfg
        h, n, r, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, h, n + r).transpose(1, 2)  # [B,h,T,n+r]
        q_nope, q_rope = q.split([n, r], dim=-1)
        latent = self.kv_a_proj_with_mqa(x)  # [B, T, Lkv + r]
        compressed, k_rope = latent.split([c.kv_lora_rank, r], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(B, T, h, n + v).transpose(1, 2)  # [B,h,T,n+v]
        k_nope, value = kv.split([n, v], dim=-1)

        inv_freq, magnitude = yarn_inv_freq(r, c.rope_theta, c.rope_scaling)
        q_rope = apply_rope(q_rope, position_ids, inv_freq, magnitude, c.rope_interleave)
        k_rope = apply_rope(k_rope[:, None], position_ids, inv_freq, magnitude, c.rope_interleave)  # [B,1,T,r]
        q = torch.cat([q_nope, q_rope], dim=-1) * self.q_multiplier
        k = torch.cat([k_nope, k_rope.expand(B, h, T, r)], dim=-1)  # [B, h, T, n+r]
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, value, is_causal=True)
        else:
            out = cache.attend(q, k, value)  # [B, h, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, h * v))
