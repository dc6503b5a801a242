"""Stage 5a: the draft vocabulary - the most frequent loss-masked target tokens (aerie.formats.vocab)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aerie.formats.tokens import read_tokens_shard
from aerie.formats.vocab import write_draft_vocab
from aerie.target_model.config import read_text_config


def count_tokens(token_shards: Sequence[Path], vocab_size: int) -> torch.Tensor:
    """Frequency of each target id over generated (loss-masked) positions of all shards: int64 [V]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in token_shards:
        t, _ = read_tokens_shard(path, ["input_ids", "loss_mask"])
        ids = t["input_ids"][t["loss_mask"].bool()].long()
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"{path}: token id {int(ids.max())} >= target vocab size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft_ids_in_target_space sorted ascending, d2t int64 [Vd], t2d bool [V]).

    The top ``draft_vocab_size`` ids by count (ties broken by lower id, so the choice is deterministic);
    capped at the target vocabulary.
    """
    vocab_size = counts.numel()
    n = min(draft_vocab_size, vocab_size)
    # Stable sort on -count keeps ascending ids among equal counts.
    order = torch.sort(-counts, stable=True).indices[:n]
    chosen = torch.sort(order).values
    d2t = chosen - torch.arange(n, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return chosen, d2t, t2d


def build_draft_vocab(
    token_shards: Sequence[Path],
    out_path: Path,
    *,
    target_vocab_size: int,
    draft_vocab_size: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    counts = count_tokens(token_shards, target_vocab_size)
    chosen, d2t, t2d = select_draft_vocab(counts, draft_vocab_size)
    total = int(counts.sum())
    coverage = float(counts[chosen].sum()) / total if total else 0.0
    meta = {
        "draft_vocab_size": int(chosen.numel()),
        "target_vocab_size": target_vocab_size,
        "coverage": round(coverage, 6),
        "distinct_tokens_seen": int((counts > 0).sum()),
        "tokens_counted": total,
    }
    write_draft_vocab(out_path, d2t, t2d, counts, meta)
    log(f"{out_path.name}: {meta}")
    return meta


def build_draft_vocab_for_target(
    token_shards: Sequence[Path],
    out_path: Path,
    *,
    target_path: Path,
    draft_vocab_size: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """build_draft_vocab over the target's vocabulary (its config.json; a wrapper's text_config)."""
    vocab_size = int(read_text_config(target_path)["vocab_size"])
    return build_draft_vocab(
        token_shards, out_path, target_vocab_size=vocab_size, draft_vocab_size=draft_vocab_size, log=log
    )
