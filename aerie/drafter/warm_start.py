"""Warm start (``drafter.init``): training starts from every tensor of a published drafter folder, keeps its draft
vocabulary, and can be pulled back toward its weights.

- ``start_from_folder``: the folder (aerie.drafter.folder: any tool's SGLang layout, local or in the Hub cache)
  checked against this run - the target's hidden and vocab sizes, the aux layers SGLang would serve it vs the
  layers the hidden shards were captured at, the draft vocab file (which the draft_vocab rule took from the folder),
  the shape settings - then loaded with the target's embeddings. Nothing is re-initialised: fc, the layer, the
  norms, lm_head, d2t and t2d are the folder's, so an export before any optimizer step is the folder again (in
  SGLang's bf16).
- ``StartPull``: L2-SP (Li et al. 2018, "Explicit inductive bias for transfer learning") applied decoupled, as
  AdamW applies weight decay: after each optimizer step ``w -= lr * init_pull * (w - w_start)``. It keeps a small
  domain set from dragging the drafter far from what it learnt on the large one; ``init_pull`` 0 (the default) is
  off. Memory: one fp32 copy of the trainable weights on the training device.

A fine-tuning schedule is TrainConfig's own settings: a lower ``learning_rate``, a short ``warmup_ratio`` and
``lr_schedule`` cosine or constant (config/README.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from aerie.drafter.config import TrainConfig
from aerie.drafter.folder import check_drafter_folder, read_drafter_folder, resolve_drafter_folder
from aerie.drafter.model import Eagle3Drafter
from aerie.formats.vocab import DraftVocab
from aerie.target_model.config import read_text_config, target_architectures


def start_from_folder(
    init: str,
    target_path: Path,
    vocab: DraftVocab,
    aux_layer_ids: Sequence[int],
    cfg: TrainConfig,
    embed: Tensor,
) -> Eagle3Drafter:
    """The drafter of folder ``init`` for this run (fp32, the target's embeddings ``embed`` [V, H] loaded), refused
    by name unless it fits (aerie.drafter.folder.check_drafter_folder) and ``vocab`` is its own d2t/t2d."""
    path = resolve_drafter_folder(init, base=Path.cwd())
    info = read_drafter_folder(path)
    text = read_text_config(target_path)
    check_drafter_folder(
        info,
        aux_layer_ids=list(aux_layer_ids),
        num_hidden_layers=int(text["num_hidden_layers"]),
        architectures=target_architectures(target_path),
        target_hidden_size=int(text["hidden_size"]),
        target_vocab_size=int(text["vocab_size"]),
        draft_vocab_size=len(vocab.d2t),
        shape=cfg.drafter_shape(),
    )
    model = Eagle3Drafter.from_folder(info, list(aux_layer_ids), embed_tokens=embed)
    if not (torch.equal(model.d2t, vocab.d2t.long()) and torch.equal(model.t2d, vocab.t2d.bool())):
        raise ValueError(
            f"the draft vocab file is not drafter.init's ({path}) d2t/t2d: warm start keeps the folder's draft "
            "vocabulary (the draft_vocab rule takes it from the folder); rerun the draft_vocab rule"
        )
    return model


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
