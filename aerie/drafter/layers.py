"""Building blocks both drafter kinds share: RMSNorm, neox RoPE, the dense SwiGLU MLP, and the two attention
caches (``DrafterKVCache`` for decoding, ``TTTCache`` for the training-time-test unroll)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from aerie.drafter.model import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 (bf16 squares lose too much), scale in the input dtype - as SGLang's RMSNorm.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, head_dim] for neox-style (rotate-half) RoPE, computed in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
    return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, kvh, S, d] -> [B, kvh * n_rep, S, d] (grouped-query attention)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class DrafterKVCache:
    """Inference-time cache of the drafter's single attention layer: roped keys and values, [B, kvh, S, d]."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (drop rejected drafts)."""
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Append the new keys; new queries see every cached position and, causally, each other."""
        past = len(self)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        n_rep = q.shape[1] // k.shape[1]
        new, total = q.shape[2], self.keys.shape[2]
        # query i (absolute past + i) may read key j iff j <= past + i
        mask = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(new, device=q.device))[:, None]
        return F.scaled_dot_product_attention(
            q, repeat_kv(self.keys, n_rep), repeat_kv(self.values, n_rep), attn_mask=mask
        )


class TTTCache:
    """Keys/values of one training-time-test unroll over whole sequences.

    Step 0 runs over all rows with causal attention. Step k >= 1 at row t is the k-th chained draft after a
    prefix ending at row t, so at inference it sees the step-0 keys of rows <= t plus its *own row's* keys
    from steps 1..k (the earlier drafts in its chain) - never other rows' later-step keys. Scores against
    those diagonal keys are one dot product per row, concatenated to the causal block before the softmax.
    """

    def __init__(self) -> None:
        self.keys: list[Tensor] = []  # per step [B, kvh, T, d]
        self.values: list[Tensor] = []

    def __len__(self) -> int:
        return len(self.keys)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.values.append(v)
        n_rep = q.shape[1] // k.shape[1]
        T = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        k0, v0 = repeat_kv(self.keys[0], n_rep), repeat_kv(self.values[0], n_rep)
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag_v = [repeat_kv(vj, n_rep) for vj in self.values[1:]]
        diag_s = [(q * repeat_kv(kj, n_rep)).sum(-1, keepdim=True) * scale for kj in self.keys[1:]]  # [B,h,T,1]
        probs = torch.softmax(torch.cat([scores, *diag_s], dim=-1).float(), dim=-1).to(q.dtype)  # [B,h,T,T+k]
        out = probs[..., :T] @ v0
        for j, vj in enumerate(diag_v):
            out = out + probs[..., T + j : T + j + 1] * vj
        return out


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
