"""The draft's rotary embedding, computed as SGLang 0.5.23 computes it for a DFlash draft's rope settings.

DFlashAttention (models/dflash.py) calls ``get_rope(head_dim, rotary_dim=head_dim, base=rope_theta,
rope_scaling=<rope_parameters or rope_scaling>, is_neox_style=True)`` (layers/rotary_embedding/factory.py):

* plain (no scaling, or ``rope_type: default``): ``RotaryEmbedding`` - inverse frequencies
  ``1 / theta^(2i/d)`` in fp32, cos/sin of ``position * inv_freq`` in fp32, amplitude 1;
* ``yarn``: ``YaRNScalingRotaryEmbedding`` (layers/rotary_embedding/yarn.py). Frequencies: the dimensions turning
  more than ``beta_fast`` times over ``original_max_position_embeddings`` keep ``1 / theta^(2i/d)``, those turning
  fewer than ``beta_slow`` times are divided by ``factor``, linear in between (correction range floored/ceiled when
  ``truncate``, the default; a zero-width ramp widened by 0.001). Amplitude (the factor on cos and sin, so the
  scores scale by its square): ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`` when
  BOTH keys are set, else ``0.1 ln(factor) + 1``; times ``attn_factor`` (default 1). With z-lab's Kimi-K2.5-DFlash
  settings (factor 64, mscale 1.0, mscale_all_dim 1.0) that is exactly 1.0; an engine that applies the plain
  YaRN rule instead gets 1 + 0.1 ln 64 = 1.4159.

Neox style: the halves (x[i], x[i + d/2]) turn by frequency i. The rotation runs in fp32 (float64 inputs:
float64) and the result is cast back to the input's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """SGLang's yarn_get_mscale: 1 without scaling, else 0.1 * mscale * ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_amplitude(scaling: Mapping[str, Any] | None) -> float:
    """The factor SGLang puts on cos and sin for these rope settings (1 for plain RoPE)."""
    if not scaling:
        return 1.0
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale is not None and mscale_all_dim is not None:
        amplitude = yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all_dim))
    else:
        amplitude = yarn_get_mscale(factor)  # SGLang's yarn_get_mscale_simple
    return amplitude * float(scaling.get("attn_factor", 1.0))


def _yarn_correction_range(scaling: Mapping[str, Any], dim: int, theta: float) -> tuple[float, float]:
    """The dimension range over which YaRN ramps from extrapolation to interpolation (yarn_find_correction_range)."""
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(float(scaling.get("beta_fast", 32)))
    high = correction_dim(float(scaling.get("beta_slow", 1)))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rotary_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> Tensor:
    """Inverse frequencies [head_dim / 2], fp32, as SGLang's _compute_inv_freq computes them."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if not scaling:
        return 1.0 / pos_freqs
    factor = float(scaling["factor"])
    low, high = _yarn_correction_range(scaling, head_dim, theta)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * float(scaling.get("extrapolation_factor", 1.0))  # 1: the original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


class DFlashRotary:
    """cos/sin tables for positions, shared by every layer of a drafter. A plain object, not a module: its fp32
    frequencies must not follow the drafter into bf16."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None):
        self.inv_freq = rotary_inv_freq(head_dim, theta, scaling)  # [d/2] fp32, CPU
        self.amplitude = rotary_amplitude(scaling)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, d/2] in fp32 (amplitude included)."""
        freqs = positions.float()[:, None, :, None] * self.inv_freq.to(positions.device)
        return freqs.cos() * self.amplitude, freqs.sin() * self.amplitude


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox rotation of x [B, heads, T, d] by cos/sin [B, 1, T, d/2]; fp32 math (float64 stays float64), x's dtype
    out."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
