"""Stage 5a: the draft vocabulary - the most frequent loss-masked target tokens (aerie.formats.vocab)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aerie.drafter_kinds.eagle3.folder import read_drafter_folder
from aerie.drafter_kinds.folders import resolve_drafter_folder
from aerie.formats.tokens import read_tokens_shard
from aerie.formats.vocab import FOLLOWED_SOURCE, NEW_ROW_RULE, write_draft_vocab
from aerie.target_model.config import read_text_config
from aerie.vocab.settings import VocabSettings


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


def folder_vocab_maps(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) of a drafter folder (aerie.drafter_kinds.eagle3.folder: any tool's), t2d rebuilt
    from d2t
    when the folder has none (SGLang never reads it), identity maps for a full-vocabulary head without d2t."""
    info = read_drafter_folder(folder)
    maps = {}
    for name in ("d2t", "t2d"):
        t = info.tensors.get(name)
        if t is not None:
            with safe_open(str(Path(folder) / t.file), framework="pt") as f:
                maps[name] = f.get_tensor(t.stored_name)
    d2t = maps.get("d2t", torch.zeros(info.draft_vocab_size, dtype=torch.int64)).long()
    t2d = maps.get("t2d")
    if t2d is None:
        t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t] = True
    return d2t, t2d.bool()


def follow_data(folder_ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The folder's target ids (``folder_ids`` [Vd]) after following the data's ``counts`` [V]: the ids the data
    uses are kept; the ids it never uses are replaced, as far as there are ids the folder lacks that the data uses,
    by those ids, the most frequent first (ties: the lower id); the unused ids given up first are the highest.
    Returns (the new target ids ascending [Vd], what changed: kept / replaced / the ids added and dropped)."""
    folder_ids = folder_ids.long()
    used = counts[folder_ids] > 0
    unused = torch.sort(folder_ids[~used], descending=True).values
    in_folder = torch.zeros(counts.numel(), dtype=torch.bool)
    in_folder[folder_ids] = True
    missing = torch.nonzero((counts > 0) & ~in_folder).flatten()
    missing = missing[torch.sort(-counts[missing], stable=True).indices]
    n = min(len(unused), len(missing))
    added, dropped = missing[:n], unused[:n]
    keep = torch.ones(counts.numel(), dtype=torch.bool)
    keep[dropped] = False
    new_ids = torch.sort(torch.cat([folder_ids[keep[folder_ids]], added])).values
    return new_ids, {
        "kept": int(len(folder_ids) - n),
        "replaced": n,
        "unused_in_folder": int((~used).sum()),
        "missing_from_folder": int(len(missing)),
        "added_ids": added.tolist(),
        "dropped_ids": dropped.tolist(),
    }


def draft_vocab_from_folder(
    token_shards: Sequence[Path],
    out_path: Path,
    *,
    target_path: Path,
    init: str,
    settings: VocabSettings | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """drafter.init's draft vocabulary (its d2t/t2d: the warm start keeps every tensor, lm_head's rows included),
    with the data's token counts and the folder vocab's coverage of them; or, when ``settings`` follow the data
    (vocab.warm_start ``follow``, or ``auto`` below ``follow_below``), the folder's ids with the unused ones
    replaced (``follow_data``): training then starts with the folder's lm_head rows for the kept ids and the
    target's lm_head rows for the new ones (aerie.drafter_kinds.eagle3.training.start_from_folder)."""
    settings = settings or VocabSettings()
    folder = resolve_drafter_folder(init, base=Path.cwd())
    d2t, t2d = folder_vocab_maps(folder)
    vocab_size = int(read_text_config(target_path)["vocab_size"])
    if t2d.numel() != vocab_size:
        raise ValueError(
            f"drafter.init {folder}: its t2d covers {t2d.numel()} ids, the target's vocab has {vocab_size}"
        )
    counts = count_tokens(token_shards, vocab_size)
    chosen = torch.arange(len(d2t)) + d2t
    total = int(counts.sum())

    def coverage_of(ids: torch.Tensor) -> float:
        return round(float(counts[ids].sum()) / total if total else 0.0, 6)

    coverage = coverage_of(chosen)
    best = select_draft_vocab(counts, len(d2t))[0]
    meta = {
        "draft_vocab_size": int(len(d2t)),
        "target_vocab_size": vocab_size,
        "coverage": coverage,
        # what counting would have reached with as many ids: the cost of keeping the folder's vocabulary
        "coverage_if_counted": coverage_of(best),
        "distinct_tokens_seen": int((counts > 0).sum()),
        "tokens_counted": total,
        "source": "drafter.init",
        "init": str(init),
        "init_folder": str(folder),
        "warm_start": settings.warm_start,
    }
    if settings.follows(coverage):
        new_ids, change = follow_data(chosen, counts)
        d2t = new_ids - torch.arange(len(new_ids))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[new_ids] = True
        meta.update(
            source=FOLLOWED_SOURCE,
            coverage_before=coverage,
            coverage=coverage_of(new_ids),
            kept=change["kept"],
            replaced=change["replaced"],
            unused_in_folder=change["unused_in_folder"],
            missing_from_folder=change["missing_from_folder"],
            new_row_rule=NEW_ROW_RULE,
        )
        write_draft_vocab(out_path, d2t, t2d, counts, meta)
        log(
            f"{out_path.name}: drafter.init {folder}'s draft vocabulary followed the data (vocab.warm_start: "
            f"{settings.warm_start}): kept {change['kept']} ids, replaced {change['replaced']} it never uses by the "
            f"most frequent it lacks; coverage {coverage:.4f} -> {meta['coverage']:.4f} (counting: "
            f"{meta['coverage_if_counted']:.4f}); new lm_head rows: {NEW_ROW_RULE}"
        )
        return meta
    write_draft_vocab(out_path, d2t, t2d, counts, meta)
    log(f"{out_path.name}: taken from drafter.init {folder} (d2t/t2d), not counted: {meta}")
    return meta
