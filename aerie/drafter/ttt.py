"""Training-time test (TTT): the unrolled chain of draft steps and its loss against the target.

Step 0 feeds fc(aux features) with tokens shifted by one, exactly like SGLang's draft extend. Step k >= 1
feeds each row's own step k-1 ``hidden_out`` with the token one further on, at position t+k - exactly what
chained draft steps see at inference. Attention follows the same rule (TTTCache): step-k row t sees step-0
keys of rows <= t and its own row's keys from steps 1..k. The loss at every step is the soft cross-entropy
against the target's next-token distribution restricted to the draft vocab (``TargetHead``: from the final
states through lm_head for ``full`` hidden shards, from the stored top-k for ``compact`` ones), weighted
``step_loss_decay**k`` and normalised by the supervised rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aerie.drafter.config import TrainConfig
from aerie.drafter.data import Batch
from aerie.drafter.layers import TTTCache
from aerie.drafter.model import Eagle3Drafter


@dataclass
class TargetHead:
    """The target's next-token distribution at every batch position, restricted to the draft vocab.

    Full layout: from the final states through the frozen lm_head (``full`` [V,H] for the greedy token,
    ``draft`` [Vd,H] rows for the soft targets). Compact layout: from the stored top-k lists; no lm_head."""

    full: Tensor | None
    draft: Tensor | None
    t2d: Tensor  # bool [V]

    @torch.no_grad()
    def soft_targets(self, final: Tensor) -> Tensor:
        """[B,W,H] -> [B,W,Vd]: target next-token distribution renormalised over the draft vocab."""
        return torch.softmax((final @ self.draft.T).float(), dim=-1)

    @torch.no_grad()
    def greedy(self, final: Tensor, chunk: int = 512) -> Tensor:
        """[B,W,H] -> [B,W] target argmax over the full vocab, in row chunks to bound memory."""
        flat = final.reshape(-1, final.shape[-1])
        out = torch.cat([(flat[i : i + chunk] @ self.full.T).argmax(-1) for i in range(0, len(flat), chunk)])
        return out.view(final.shape[:-1])

    @torch.no_grad()
    def topk_targets(self, ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
        """[B,W,k] top-k lists -> ([B,W,Vd] soft targets, [B,W] has any in-vocab entry): the softmax of the
        entries inside the draft vocab, renormalised among themselves; rows with none get all zeros."""
        draft_index = torch.cumsum(self.t2d, 0) - 1  # target id -> draft id (draft ids ascend with target ids)
        valid = self.t2d[ids]
        has = valid.any(-1)
        lp = logprobs.float().masked_fill(~valid, float("-inf")).masked_fill(~has[..., None], 0.0)
        p = torch.softmax(lp, -1) * valid
        q = torch.zeros(*ids.shape[:-1], int(self.t2d.sum()), device=ids.device)
        return q.scatter_add_(-1, (draft_index[ids] * valid).long(), p), has

    @torch.no_grad()
    def targets(self, b: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(q [B,W,Vd] soft targets, greedy [B,W] target token, has_q [B,W] bool) for a batch of either layout."""
        if b.topk_ids is not None:
            q, has = self.topk_targets(b.topk_ids, b.topk_logprobs)
            return q, b.topk_ids[..., 0], has  # top-1 of the full vocab = the target's greedy token
        return self.soft_targets(b.final), self.greedy(b.final), torch.ones_like(b.have)


def ttt_unroll(model: Eagle3Drafter, aux: Tensor, ids: Tensor, position_ids: Tensor, steps: int) -> list[Tensor]:
    """Unrolled chained drafting over every row at once; returns per-step draft logits [B,T,Vd]."""
    T = aux.shape[1]
    cache = TTTCache()
    hidden = model.project_aux(aux)  # [B,T,H] step 0: target features
    logits_per_step = []
    for k in range(steps):
        tokens = ids[:, 1 + k : 1 + k + T]  # token t+1+k at row t
        logits, hidden = model(hidden, tokens, position_ids + k, cache)  # hidden_out feeds step k+1
        logits_per_step.append(logits)
    return logits_per_step


def step_weights(batch: Batch, k: int, target_ok: Tensor | None) -> Tensor:
    """[B,T] float: rows supervised at step k (real row, predicted token generated, and - when given - a usable
    target: in-vocab greedy token with mask_out_of_vocab_targets, an in-vocab top-k entry for compact shards)."""
    T = batch.row_valid.shape[1]
    w = batch.row_valid & batch.gen[:, 2 + k : 2 + k + T]
    if target_ok is not None:
        w = w & target_ok[:, 1 + k : 1 + k + T]
    return w.float()


def target_mask(head: TargetHead, greedy: Tensor, has_q: Tensor, cfg: TrainConfig) -> Tensor:
    """[B,W] bool: positions whose target distribution may carry loss."""
    return has_q & head.t2d[greedy] if cfg.mask_out_of_vocab_targets else has_q


def ttt_loss(logits_per_step: list[Tensor], q: Tensor, batch: Batch, target_ok: Tensor | None, decay: float):
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


class TTTUnroll(nn.Module):
    """ttt_unroll as a module: what DDP wraps (it averages the gradients of what runs inside its forward)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int):
        super().__init__()
        self.drafter, self.steps = drafter, steps

    def forward(self, aux: Tensor, ids: Tensor, position_ids: Tensor) -> list[Tensor]:
        return ttt_unroll(self.drafter, aux, ids, position_ids, self.steps)


def autocast(device: torch.device):
    # bf16 autocast on GPU; exact fp32 on CPU (deterministic, and CPU bf16 is slow).
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
