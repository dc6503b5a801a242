"""The TTT attention on CUDA: compiled flex attention over the step-0 keys with a block mask, and the diagonal
keys (each row's own chain of earlier drafts) merged in by log-sum-exp.

Step s at row t attends to step-0 keys 0..t (within its own sequence in a packed window) and to row t of the
diagonal keys of steps 1..s. Split the softmax there: flex attention computes ``out0`` (softmax over the step-0
keys) and its log-sum-exp ``lse0`` per row, without ever materialising scores (a fused kernel that skips the
masked blocks: a packed window costs its sequences' squares, not its own); the s diagonal scores are one dot
product per row. The exact softmax over all 1 + s parts is then ``softmax([lse0, diag_1..diag_s])`` weighting
``[out0, v_1..v_s]`` (``lse_merge``) - the same numbers as TTTAttention (layers.py, the chunked CPU kernel and the
reference), up to reordered sums. Gradients flow through both of flex's outputs (torch 2.13 differentiates its
log-sum-exp on CUDA). What backward keeps per step is flex's own (q, k0, v0, out0, lse0) plus [B, h, T, 1 + s]
merge weights.

The block mask is built once per batch (``TTTLayout.block_mask``) and reused by every step and by the
checkpointed re-runs. On the CPU flex attention runs eagerly and forward only (tests check it against the
chunked kernel there; bench/gpu_check.py checks forward and backward on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

from aerie.drafter_kinds.blocks import flex_attention_for

if TYPE_CHECKING:  # layers.TTTCache calls in here: no import back at run time
    from aerie.drafter_kinds.eagle3.layers import TTTLayout


def ttt_block_mask(layout: TTTLayout, B: int, T: int, device: torch.device):
    """Causal over the window's rows; with ``seq_start`` [B, T] also within each row's own sequence."""
    seq_start = layout.seq_start
    if seq_start is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        return create_block_mask(mask_mod, None, None, T, T, device=device, _compile=device.type == "cuda")

    def packed_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= seq_start[b, q_idx])

    return create_block_mask(packed_mask_mod, B, None, T, T, device=device, _compile=device.type == "cuda")


def step0_attention(q: Tensor, k0: Tensor, v0: Tensor, layout: TTTLayout) -> tuple[Tensor, Tensor]:
    """(out0 [B, h, T, dv], lse0 [B, h, T] fp32, natural log): softmax attention over the step-0 keys."""
    B, h, T, _ = q.shape
    if layout.block_mask is None:
        layout.block_mask = ttt_block_mask(layout, B, T, q.device)
    out0, aux = flex_attention_for(q.device)(
        q, k0, v0, block_mask=layout.block_mask, enable_gqa=h != k0.shape[1], return_aux=AuxRequest(lse=True)
    )
    return out0, aux.lse


def lse_merge(q: Tensor, out0: Tensor, lse0: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor]) -> Tensor:
    """[B, h, T, dv]: the softmax over [step-0 keys | each row's diagonal keys] from the step-0 attention's output
    and log-sum-exp. Scores and weighted sums in the inputs' dtype, the softmax in fp32 (as TTTAttention)."""
    if not ks:
        return out0
    B, h, T, d = q.shape
    kvh = ks[0].shape[1]
    g = h // kvh
    qg = q.view(B, kvh, g, T, d)
    scale = d**-0.5
    diag = [((qg * k[:, :, None]).sum(-1) * scale).float() for k in ks]  # [B, kvh, g, T] each
    # softmax's own max subtraction keeps large scores finite (lse0 is already a log)
    w = torch.softmax(torch.stack([lse0.view(B, kvh, g, T).float(), *diag], dim=-1), dim=-1).to(q.dtype)
    out = w[..., 0, None] * out0.view(B, kvh, g, T, -1)
    for j, v in enumerate(vs):
        out = out + w[..., 1 + j, None] * v[:, :, None]
    return out.view(B, h, T, -1)


def flex_ttt_attention(
    q: Tensor, k0: Tensor, v0: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor], layout: TTTLayout
) -> Tensor:
    """TTTAttention's result (same arguments, without the chunking) by flex attention plus ``lse_merge``."""
    out0, lse0 = step0_attention(q, k0, v0, layout)
    return lse_merge(q, out0, lse0, ks, vs)
