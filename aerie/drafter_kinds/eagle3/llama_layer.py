"""Llama attention for the EAGLE-3 drafter's single layer: the layer SGLang 0.5.23 serves as
``LlamaForCausalLMEagle3`` (python/sglang/srt/models/llama_eagle3.py). q/k/v read the 2H-wide EAGLE-3 input
``[input_layernorm(embeds), hidden_norm(hidden)]``; grouped-query attention with neox RoPE; o_proj writes H.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from aerie.drafter_kinds.eagle3.layers import DrafterKVCache, TTTCache, apply_rotary, repeat_kv, rotary_cos_sin

if TYPE_CHECKING:
    from aerie.drafter_kinds.eagle3.model import DrafterConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, kvh, d, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        # q/k/v read [input_layernorm(embeds), hidden_norm(hidden)]: 2H wide (SGLang overrides qkv_proj so).
        self.q_proj = nn.Linear(2 * H, h * d, bias=False)
        self.k_proj = nn.Linear(2 * H, kvh * d, bias=False)
        self.v_proj = nn.Linear(2 * H, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)

    def forward(self, x: Tensor, position_ids: Tensor, cache: DrafterKVCache | TTTCache | None) -> Tensor:
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [B, kvh, T, d]
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(position_ids, c.head_dim, c.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            n_rep = c.num_attention_heads // c.num_key_value_heads
            out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        else:
            out = cache.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
