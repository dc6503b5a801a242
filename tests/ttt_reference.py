"""The TTT unroll and loss as aerie trained them before issue 22 (aerie 27746c1): the plain composition, kept
here as the reference the memory-bounded path (aerie.drafter_kinds.eagle3.layers.TTTAttention,
aerie.drafter_kinds.eagle3.ttt.ttt_forward)
must equal, in outputs and gradients. Not used by the product: it builds [B, h, T, T + k] scores per step, keeps
every step's activations and [B, T, Vd] fp32 logits, so it is quadratic in the window (bench/drafter_memory.py
measures it as the "old" rows).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.eagle3.layers import repeat_kv
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter
from aerie.drafter_kinds.eagle3.ttt import TargetHead, step_weights, target_mask


class NaiveTTTCache:
    """Step k row t sees step-0 keys of rows <= t and its own row's keys of steps 1..k: full [T, T] scores."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
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


def naive_unroll(model: Eagle3Drafter, aux: Tensor, ids: Tensor, position_ids: Tensor, steps: int) -> list[Tensor]:
    """Per-step draft logits [B, T, Vd] of the whole window."""
    T = aux.shape[1]
    cache = NaiveTTTCache()
    hidden = model.project_aux(aux)
    logits_per_step = []
    for k in range(steps):
        logits, hidden = model(hidden, ids[:, 1 + k : 1 + k + T], position_ids + k, cache)
        logits_per_step.append(logits)
    return logits_per_step


def naive_loss(logits_per_step: list[Tensor], q: Tensor, batch: Batch, target_ok: Tensor | None, decay: float):
    """Weighted sum over steps of masked soft cross-entropy; also per-step (ce_sum, weight_sum, correct)."""
    T = batch.row_valid.shape[1]
    total = torch.zeros((), device=q.device)
    stats = []
    for k, logits in enumerate(logits_per_step):
        q_k = q[:, 1 + k : 1 + k + T]  # [B,T,Vd]
        w = step_weights(batch, k, target_ok)  # [B,T]
        ce = -(q_k * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B,T]
        ce_sum, w_sum = (ce * w).sum(), w.sum()
        total = total + decay**k * ce_sum / w_sum.clamp_min(1.0)
        correct = ((logits.argmax(-1) == q_k.argmax(-1)).float() * w).sum()
        stats.append((ce_sum.detach(), w_sum, correct))
    return total, stats


def naive_forward(model: Eagle3Drafter, b: Batch, head: TargetHead, cfg, steps: int):
    """(loss, per-step stats, per-step draft ids) exactly as the trainer computed them before issue 22."""
    q, greedy, has_q = head.targets(b)
    logits = naive_unroll(model, b.aux, b.ids, b.position_ids, steps)
    loss, stats = naive_loss(
        logits, q, b, target_mask(head, greedy, has_q, cfg.mask_out_of_vocab_targets), cfg.step_loss_decay
    )
    return loss, stats, [x.argmax(-1) for x in logits]
