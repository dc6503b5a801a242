"""The training batch every kind's objective reads: windows of hidden-shard sequences, one per row or packed several
to a row (aerie.drafter.data builds it from the shards).

Index conventions for a window starting at row ``a`` (relative to ``a``): ``ids[p]`` the token at p; ``gen[p]`` 1 when
token p was generated (the loss mask); ``aux`` row t: the target's features of position t at the kind's layers
(concatenated in layer order); the target's next-token distribution after p (``final`` or ``topk_*``) only when the
kind reads it. ``W`` = rows + the kind's look-ahead + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Batch:
    aux: Tensor  # [B, T, A*H]
    position_ids: Tensor  # [B, T]
    row_valid: Tensor  # [B, T] bool: real rows (not padding)
    ids: Tensor  # [B, W] token ids, W = T + ttt_steps + 2
    have: Tensor  # [B, W] bool: a token and target feature exist at p
    gen: Tensor  # [B, W] bool: token p was generated
    final: Tensor | None  # full layout: [B, W, H] target final hidden (after its norm)
    rows: int  # number of real rows
    topk_ids: Tensor | None = None  # compact layout: [B, W, k] target's top-k next-token ids
    topk_logprobs: Tensor | None = None  # compact layout: [B, W, k] their log-probabilities
    # packed rows (several sequences per batch row); None when every row holds one window from row 0
    seq_start: Tensor | None = None  # [B, T] long: the batch row where row t's sequence starts
    row_limit: Tensor | None = None  # [B, T] long: positions row t may read lie before this (its own sequence's)

    def readable(self, offset: int) -> Tensor | None:
        """[B, T] bool: whether position t + offset still belongs to row t's own sequence (None: always, the
        padding is zeros there). Step k's weight reads gen at t+2+k, evaluation's chain have at t+2+k."""
        if self.row_limit is None:
            return None
        T = self.row_limit.shape[1]
        return torch.arange(offset, offset + T, device=self.row_limit.device)[None] < self.row_limit
