"""The DFlash drafter: parameter names are those SGLang 0.5.23's ``DFlashDraftModel.load_weights`` consumes, so
``state_dict()`` is the export (tests/fixtures/sglang/dflash_weights.json records the mapping).

    ctx     = hidden_norm(fc(target features))         # [B, C, K*H] -> [B, C, H]: the context, one row per token
    x       = the block's embeddings                    # [B, Q, H]: [last verified token, MASK x (B-1)] per block
    per layer (Qwen3, pre-norm):
      q       = rope(q_norm(q_proj(input_layernorm(x))))            per head
      keys    = [rope(k_norm(k_proj(ctx))) | rope(k_norm(k_proj(input_layernorm(x))))]
      values  = [v_proj(ctx)               | v_proj(input_layernorm(x))]
      x       = x + o_proj(attention(q, keys, values, mask))
      x       = x + down_proj(silu(gate_proj(n)) * up_proj(n)),     n = post_attention_layernorm(x)
    hidden  = norm(x)                                   # -> the target's lm_head (the caller's)

The context is NOT passed through a layer's input_layernorm: SGLang materialises it with ``kv_proj_only`` on the
projected features (``prepare_context_hidden_for_kv`` returns them unchanged), then ``k_norm`` and rope at the
context token's position, into every draft layer's KV cache. Which keys a query sees is the mask's business
(objective.py builds them for training, drafting.py for serving-like drafting): either a dense boolean tensor
[B, 1, Q, C + Q] (the reference path: SDPA) or a flex-attention ``BlockMask`` (the CUDA path), one per layer type.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from aerie.drafter_kinds.blocks import SwiGLU, flex_attention_for
from aerie.drafter_kinds.dflash.rotary import DFlashRotary, apply_rotary
from aerie.drafter_kinds.dflash.shape import DFlashShape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise and scale in fp32 (float64 stays float64), return the input's dtype (SGLang's forward_native).
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(x.dtype)


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | BlockMask) -> Tensor:
    """q [B, h, Q, d], keys/values [B, kvh, S, d] -> [B, h, Q, d] under a dense boolean mask [B, 1, Q, S]
    (True: may attend) or a flex BlockMask; softmax scale 1/sqrt(d) (SGLang's head_dim**-0.5)."""
    h, kvh = q.shape[1], keys.shape[1]
    if isinstance(mask, BlockMask):
        return flex_attention_for(q.device)(q, keys, values, block_mask=mask, enable_gqa=h != kvh)
    if h != kvh:  # grouped-query attention: query head i reads KV head i // (h / kvh)
        keys, values = keys.repeat_interleave(h // kvh, dim=1), values.repeat_interleave(h // kvh, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class DFlashAttention(nn.Module):
    def __init__(self, shape: DFlashShape):
        super().__init__()
        H, h, kvh, d = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, kvh * d, bias=False)
        self.v_proj = nn.Linear(H, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)  # per head
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def keys_values(self, x: Tensor, positions: Tensor, rotary: DFlashRotary) -> tuple[Tensor, Tensor]:
        """Roped, normed keys and values [B, kvh, T, d] of rows x [B, T, H] at positions [B, T]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary.cos_sin(positions)
        return apply_rotary(k, cos, sin), v

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        rotary: DFlashRotary,
        context_kv: tuple[Tensor, Tensor],
        mask: Tensor | BlockMask,
    ) -> Tensor:
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)  # [B, h, Q, d]
        cos, sin = rotary.cos_sin(positions)
        q = apply_rotary(q, cos, sin)
        k, v = self.keys_values(x, positions, rotary)
        keys = torch.cat([context_kv[0].to(k.dtype), k], dim=2)  # [B, kvh, C + Q, d]: context first
        values = torch.cat([context_kv[1].to(v.dtype), v], dim=2)
        out = attend(q, keys, values, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, shape: DFlashShape, layer_type: str):
        super().__init__()
        self.layer_type = layer_type  # "full_attention" or "sliding_attention": picks the layer's mask
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = DFlashAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        rotary: DFlashRotary,
        mask: Tensor | BlockMask,
        context_kv: tuple[Tensor, Tensor] | None = None,
        context: Tensor | None = None,
        context_positions: Tensor | None = None,
    ) -> Tensor:
        """x [B, Q, H] -> [B, Q, H]. The context's keys/values: given (``context_kv``, a drafting cache) or made
        here from the projected context [B, C, H] at ``context_positions`` [B, C] (training)."""
        if context_kv is None:
            context_kv = self.self_attn.keys_values(context, context_positions, rotary)
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, context_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashContextCache:
    """Drafting-time context keys/values per draft layer, [B, kvh, C, d], for the committed positions 0..C-1."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def __len__(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def append(self, drafter: DFlashDrafter, target_features: Tensor, positions: Tensor) -> None:
        """Write the context of new committed positions: target features [B, m, K*H] at positions [B, m]."""
        context = drafter.project_context(target_features)
        for i, layer in enumerate(drafter.layers):
            k, v = layer.self_attn.keys_values(context, positions, drafter.rotary)
            if i < len(self.keys):
                self.keys[i] = torch.cat([self.keys[i], k], dim=2)
                self.values[i] = torch.cat([self.values[i], v], dim=2)
            else:
                self.keys.append(k)
                self.values.append(v)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


class DFlashDrafter(nn.Module):
    """The DFlash drafter of ``shape``; one API for training (objective.py), drafting (drafting.py) and export."""

    def __init__(self, shape: DFlashShape):
        super().__init__()
        self.shape = shape
        H = shape.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(shape, t) for t in shape.layer_types)
        self.norm = RMSNorm(H, shape.rms_norm_eps)
        self.fc = nn.Linear(shape.num_context_features * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, shape.rms_norm_eps)
        self.rotary = DFlashRotary(shape.head_dim, shape.rope_theta, shape.rope_scaling)

    def project_context(self, target_features: Tensor) -> Tensor:
        """[..., K*H] concatenated target layer outputs (in target_layer_ids order) -> [..., H]."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: Tensor,
        block_positions: Tensor,
        masks: Mapping[str, Tensor | BlockMask],
        *,
        context: Tensor | None = None,
        context_positions: Tensor | None = None,
        cache: DFlashContextCache | None = None,
        checkpoint_layers: bool = False,
    ) -> Tensor:
        """block_embeds [B, Q, H] (the target's embeddings of the block tokens), block_positions [B, Q], masks by
        layer type over [context | block] keys -> the final-normed hidden states [B, Q, H].

        The context: ``context`` [B, C, H] (``project_context``'s output) at ``context_positions`` [B, C], or a
        drafting ``cache``. ``checkpoint_layers`` recomputes each layer in backward instead of keeping its
        activations."""
        x = block_embeds
        for i, layer in enumerate(self.layers):
            context_kv = (cache.keys[i], cache.values[i]) if cache is not None else None
            args = (x, block_positions, self.rotary, masks[layer.layer_type], context_kv, context, context_positions)
            x = checkpoint(layer, *args, use_reentrant=False) if checkpoint_layers else layer(*args)
        return self.norm(x)
