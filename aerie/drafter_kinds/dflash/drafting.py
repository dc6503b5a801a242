"""In-process block drafting for aerie's benchmark: ``DFlashProposer`` implements the ``Proposer`` protocol of
aerie.benchmark.speculative, drafting as SGLang 0.5.23's DFLASH worker does (speculative/dflash_worker_v2.py).

Each call: the target features of the newly committed positions go into every draft layer's context keys/values
(SGLang's ``_append_target_hidden_to_draft_kv``: ``project_target_hidden``, then each layer's k/v projection,
k_norm and rope at those positions); then one forward over ``[last committed token, MASK x (B-1)]`` at positions
n..n+B-1 (n = committed tokens with features), which reads every context key (full-attention layers: the block
bidirectionally; sliding ones: causally, within the window) and proposes slots 1..B-1 by argmax through the
target's lm_head. The block's own keys never enter the cache, so nothing the drafter guessed survives into the next
call: the cache always holds exactly the committed positions, as SGLang's draft KV after it rewrites the accepted
slots with the target's features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from aerie.drafter_kinds.dflash.model import DFlashContextCache, DFlashDrafter


def drafting_mask(context_len: int, block_size: int, window: int | None, device: torch.device) -> Tensor:
    """[1, 1, Bk, C + Bk] for a block anchored right after C context positions: every context key (within the
    window for sliding layers) and the block, bidirectional (window None) or causal within the window."""
    q = torch.arange(block_size, device=device)[:, None]  # query offsets; its position is C + q
    context = torch.ones(block_size, context_len, dtype=torch.bool, device=device)
    block = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if window is not None:
        context_pos = torch.arange(context_len, device=device)[None, :]
        context = context_pos > context_len + q - window
        kv = torch.arange(block_size, device=device)[None, :]
        block = (kv <= q) & (q - kv < window)
    return torch.cat([context, block], dim=1)[None, None]


class DFlashProposer:
    """Block drafting with a DFlash drafter; ``embed_weight`` and ``lm_head_weight`` [V, H] are the target's."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: Tensor, lm_head_weight: Tensor):
        self.drafter = drafter
        self.shape = drafter.shape
        # aerie's capture convention = SGLang's target_layer_ids on every target it serves DFLASH on (shape.py)
        self.aux_layer_ids: list[int] = list(self.shape.target_layer_ids)
        self._device = drafter.fc.weight.device
        self._dtype = drafter.fc.weight.dtype
        self._embed = embed_weight.detach().to(self._device)
        self._head = lm_head_weight.detach().to(self._device)
        self.reset()

    def reset(self) -> None:
        self.cache = DFlashContextCache()
        self._pending: list[Tensor] = []  # features shown but not yet written (a call with max_drafts 0)

    @torch.no_grad()
    def propose(self, tokens: Sequence[int], aux: Tensor | None, max_drafts: int) -> list[int]:
        if aux is None:
            raise ValueError("DFlashProposer needs the target's features (aux_layer_ids)")
        self._pending.append(aux)
        if max_drafts <= 0:
            return []
        features = torch.cat(self._pending, dim=1).to(device=self._device, dtype=self._dtype)
        self._pending.clear()
        start, m = len(self.cache), features.shape[1]
        if start + m != len(tokens) - 1:
            raise RuntimeError(f"drafter out of sync: {start} cached + {m} new features for {len(tokens)} tokens")
        self.cache.append(self.drafter, features, torch.arange(start, start + m, device=self._device)[None])

        anchor, Bk = len(tokens) - 1, self.shape.block_size
        ids = torch.full((1, Bk), self.shape.mask_token_id, dtype=torch.long, device=self._device)
        ids[0, 0] = int(tokens[-1])
        positions = torch.arange(anchor, anchor + Bk, device=self._device)[None]
        masks = {
            t: drafting_mask(anchor, Bk, self.shape.window_of(t), self._device) for t in set(self.shape.layer_types)
        }
        embeds = F.embedding(ids, self._embed).to(self._dtype)
        hidden = self.drafter(embeds, positions, masks, cache=self.cache)  # [1, Bk, H]
        logits = hidden[0, 1:] @ self._head.T.to(hidden.dtype)  # slots 1..Bk-1: the drafts
        return logits.argmax(dim=-1)[: min(max_drafts, Bk - 1)].tolist()
