"""Held-out evaluation: TTT loss, simulated chain acceptance length and per-position acceptance."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter
from aerie.drafter_kinds.eagle3.settings import Eagle3Settings
from aerie.drafter_kinds.eagle3.ttt import TargetHead, autocast, ttt_forward
from aerie.drafter_kinds.kind import EMPTY_EVAL


@torch.no_grad()
def evaluate(
    model: Eagle3Drafter,
    batches: Iterable[Batch],
    head: TargetHead,
    settings: Eagle3Settings,
    kernel: str,
    device: torch.device,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> dict:
    """Held-out TTT loss plus simulated chain acceptance with greedy verification.

    For every held-out start row t whose first drafted token is a generated one, draft step k is accepted
    when its argmax (mapped to a target id) equals the target's greedy token at t+1+k and all earlier steps
    were accepted; acceptance length = 1 (bonus token) + accepted steps. Later steps are fed the recorded
    tokens, which equal the accepted drafts when the data was generated greedily (exact simulation then).
    Under torchrun each rank evaluates its share of the held-out batches and ``all_reduce`` sums the counts.
    """
    model.eval()
    K = settings.ttt_steps
    ce = torch.zeros(K, dtype=torch.float64)
    wsum = torch.zeros(K, dtype=torch.float64)
    correct = torch.zeros(K, dtype=torch.float64)
    accepted_at = torch.zeros(K, dtype=torch.float64)  # starts whose chain reached step k accepted
    starts = 0
    for b in batches:
        T = b.row_valid.shape[1]
        targets = head.prepare(b, settings.mask_out_of_vocab_targets)
        greedy = targets.greedy  # [B,W]: the token the target verifies against
        with autocast(device):
            _, stats, drafts = ttt_forward(model, b, targets, K, settings.step_loss_decay, kernel=kernel)
        for k, (c, w, r) in enumerate(stats):
            ce[k] += float(c)
            wsum[k] += float(w)
            correct[k] += float(r)
        start = b.row_valid & b.gen[:, 2 : 2 + T]  # [B,T]
        if b.readable(2) is not None:  # packed rows: the first drafted token is of the row's own sequence
            start = start & b.readable(2)
        chain = start.clone()
        for k, draft_ids in enumerate(drafts):
            draft = model.draft_to_target(draft_ids)  # [B,T] target ids
            ok = (draft == greedy[:, 1 + k : 1 + k + T]) & b.have[:, 2 + k : 2 + k + T]
            if b.readable(2 + k) is not None:
                ok = ok & b.readable(2 + k)
            chain = chain & ok
            accepted_at[k] += float(chain.sum())
        starts += int(start.sum())
    model.train()
    if all_reduce is not None:
        totals = all_reduce(torch.cat([ce, wsum, correct, accepted_at, torch.tensor([starts], dtype=torch.float64)]))
        ce, wsum, correct, accepted_at = totals[: 4 * K].view(4, K)
        starts = int(totals[-1])
    if starts == 0:
        return dict(EMPTY_EVAL)
    loss_k = (ce / wsum.clamp_min(1)).tolist()
    per_pos = (accepted_at / starts).tolist()
    return {
        "simulated_acceptance_length": 1.0 + sum(per_pos),
        "acceptance_per_position": per_pos,
        # what a chain of n draft steps would give: 1 + sum of the first n per-position rates
        "simulated_acceptance_length_by_steps": [1.0 + sum(per_pos[:n]) for n in range(1, K + 1)],
        "heldout_loss": sum(settings.step_loss_decay**k * loss for k, loss in enumerate(loss_k)),
        "heldout_loss_per_step": loss_k,
        "heldout_accuracy_per_step": (correct / wsum.clamp_min(1)).tolist(),
        "heldout_start_positions": starts,
    }
