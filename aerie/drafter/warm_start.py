"""Warm start (``drafter.init``): training starts from every tensor of a published drafter folder of the run's kind
(its torch side's ``build`` checks and loads it: aerie.drafter_kinds.<kind>.training), and can be pulled back toward
its weights.

- ``StartPull``: L2-SP (Li et al. 2018, "Explicit inductive bias for transfer learning") applied decoupled, as
  AdamW applies weight decay: after each optimizer step ``w -= lr * init_pull * (w - w_start)``. It keeps a small
  domain set from dragging the drafter far from what it learnt on the large one; ``init_pull`` 0 (the default) is
  off. Memory: one fp32 copy of the trainable weights on the training device.

A fine-tuning schedule is TrainConfig's own settings: a lower ``learning_rate``, a short ``warmup_ratio`` and
``lr_schedule`` cosine or constant (config/README.md).
"""

from __future__ import annotations

import torch
from torch import nn


class StartPull:
    """Decoupled L2-SP toward the weights a model has now (its start): ``step(lr)`` after each optimizer step."""

    def __init__(self, model: nn.Module, strength: float):
        self.strength = float(strength)
        self.pairs = [(w, w.detach().clone()) for w in model.parameters() if w.requires_grad]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for w, start in self.pairs:
            w.sub_(w - start, alpha=lr * self.strength)

    def distance(self) -> float:
        """||w - w_start|| over the trainable weights (logged: how far fine-tuning moved the drafter)."""
        with torch.no_grad():
            return float(sum(float((w - s).float().pow(2).sum()) for w, s in self.pairs) ** 0.5)
