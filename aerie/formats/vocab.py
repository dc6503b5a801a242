"""``aerie.draft-vocab/1``: the draft vocabulary, stored the way SGLang's EAGLE-3 drafter reads it.

``d2t[draft_id] = target_id - draft_id`` (int64 [Vd], draft ids ascend with target ids), ``t2d`` a boolean
mask over the target vocabulary, and ``token_counts`` (int64 [V]) the generated-token counts it was chosen by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aerie.tools.artifacts import load_packed, save_packed

VOCAB_FORMAT = "aerie.draft-vocab/1"
# ``meta["source"]`` of a warm start's vocabulary that followed the data (vocab.warm_start): drafter.init's ids with
# the ones the data never uses replaced; training remaps the folder's lm_head rows to it (new rows: NEW_ROW_RULE).
FOLLOWED_SOURCE = "drafter.init, following the data"
NEW_ROW_RULE = "the target's lm_head row of the token (the folder's own row for every kept id)"


@dataclass
class DraftVocab:
    d2t: Tensor  # int64 [Vd]
    t2d: Tensor  # bool [V]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def target_ids(self) -> Tensor:  # [Vd] target id of each draft id (ascending)
        return torch.arange(len(self.d2t)) + self.d2t


def write_draft_vocab(path: str | Path, d2t: Tensor, t2d: Tensor, token_counts: Tensor, meta: dict[str, Any]) -> None:
    """Publish a draft vocabulary atomically (``meta`` without ``format``: it is set here)."""
    save_packed(path, {"d2t": d2t, "t2d": t2d, "token_counts": token_counts}, {"format": VOCAB_FORMAT, **meta})


def load_draft_vocab(path: str | Path) -> DraftVocab:
    """d2t (int64), t2d (bool) and the metadata of a draft-vocab file."""
    t, meta = load_packed(path, VOCAB_FORMAT, ["d2t", "t2d"])
    return DraftVocab(d2t=t["d2t"].long(), t2d=t["t2d"].bool(), meta=meta)
