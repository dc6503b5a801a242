"""Torch building blocks the kinds share, named as SGLang loads them: the SwiGLU MLP (``gate_proj``, ``up_proj``,
``down_proj``) and the flex attention a CUDA training step compiles."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention

_compiled_flex = None


def flex_attention_for(device: torch.device):
    """flex_attention compiled on CUDA (the fused kernel; torch.compile's default shape policy: a second length
    recompiles it once with dynamic lengths, so varying packed extents do not recompile again); eager elsewhere (CPU:
    forward only in torch 2.13)."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): SGLang's LlamaMLP / Qwen3MLP / DeepseekV2MLP (gate and up fused when it loads)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
