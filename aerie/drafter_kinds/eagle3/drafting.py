"""In-process drafting with an EAGLE-3 drafter: chain (top-1) drafts for aerie.benchmark.speculative, one draft
step per forward, the drafter's KV cache kept in step with the target's verified positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aerie.drafter_kinds.eagle3.layers import DrafterKVCache
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter


class EagleProposer:
    """Chain (top-1) drafting with an EAGLE-3 drafter.

    Row t of a drafter forward pairs the target feature of position t with the token at t+1 and
    predicts the token at t+2. The drafter's KV cache keeps only positions backed by TRUE target
    features (``self.true_len``); the positions its own drafting appended are cropped on the next
    call and re-run with the target's real features once the target has verified them.
    """

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.aux_layer_ids: list[int] = [int(i) for i in drafter.cfg.aux_layer_ids]
        self._dtype = next(drafter.parameters()).dtype
        self._device = next(drafter.parameters()).device
        self.reset()

    def reset(self) -> None:
        self.cache = DrafterKVCache()
        self.true_len = 0  # drafter-cache positions computed from true target features
        self._pending: list[torch.Tensor] = []  # features not yet run through the drafter

    def _forward(self, hidden: torch.Tensor, ids: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids_t = torch.tensor([list(ids)], dtype=torch.long, device=self._device)
        pos = torch.arange(start, start + len(ids), device=self._device).unsqueeze(0)
        return self.drafter(hidden, ids_t, pos, self.cache)

    def _next_draft(self, logits: torch.Tensor) -> torch.Tensor:
        draft = logits[:, -1].argmax(dim=-1)  # [1] draft-vocab id
        return self.drafter.draft_to_target(draft)

    def propose(self, tokens: Sequence[int], aux: torch.Tensor | None, max_drafts: int) -> list[int]:
        if aux is None:
            raise ValueError("EagleProposer needs the target's aux hidden states")
        self._pending.append(aux)
        if max_drafts <= 0:
            return []  # keep the features: they are replayed on the next call
        feats = torch.cat(self._pending, dim=1).to(device=self._device, dtype=self._dtype)
        self._pending.clear()
        start, m = self.true_len, feats.shape[1]
        if start + m != len(tokens) - 1:
            raise RuntimeError(
                f"drafter out of sync: {start} cached + {m} new features for {len(tokens)} committed tokens"
            )
        # Drop positions that were computed from the drafter's own guesses.
        self.cache.crop(start)
        # Catch up on the newly committed positions with their true features; the last row already
        # predicts the first draft.
        logits, hidden = self._forward(self.drafter.project_aux(feats), tokens[start + 1 :], start)
        self.true_len = start + m

        drafts: list[int] = []
        draft = self._next_draft(logits)
        drafts.append(int(draft))
        for j in range(1, max_drafts):
            # Feed the drafter's own output state back in place of the (unknown) target feature.
            logits, hidden = self._forward(hidden[:, -1:], [int(draft)], self.true_len + j - 1)
            draft = self._next_draft(logits)
            drafts.append(int(draft))
        return drafts
