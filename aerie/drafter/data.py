"""Training data: windows over hidden-shard sequences, the held-out split, batch order, and batch loading.

Index conventions for one sequence window starting at row ``a`` (all arrays are relative to ``a``):
``ids[p]`` token at p; ``q[p]`` target distribution after p (it predicts token p+1); ``gen[p]`` 1 when token p
was generated (loss mask). Step k, row t: input token ``ids[t+1+k]``, target ``q[t+1+k]``, supervised when
``gen[t+2+k]`` (the predicted token is a generated one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from aerie.drafter.config import TrainConfig
from aerie.formats.hidden import HiddenShard


@dataclass
class Window:
    """Rows [start, end) of one sequence; tokens/targets are read up to look_end (for the unrolled steps)."""

    shard: int
    start: int
    end: int
    look_end: int
    pos0: int  # position id of row `start` within its sequence


def make_windows(shard_idx: int, shard: HiddenShard, seq: int, max_len: int, ttt_steps: int) -> list[Window]:
    s, e = int(shard.seq_offsets[seq]), int(shard.seq_offsets[seq + 1])
    out = []
    for a in range(s, e, max_len):
        b = min(a + max_len, e)
        look_end = min(b + ttt_steps + 1, e)
        # keep windows with at least one supervised prediction (a generated token at a+2 .. look_end-1)
        if a + 2 < look_end and bool(shard.loss_mask[a + 2 : look_end].any()):
            out.append(Window(shard_idx, a, b, look_end, a - s))
    return out


@dataclass
class WindowPlan:
    """Every sequence cut into windows of at most ``max_seq_len`` rows, split into training and held-out windows,
    with the counts a run reports (eval.json ``windows``, the train log's ``data`` event): nothing is dropped
    without being counted."""

    train: list[Window]
    heldout: list[Window]
    stats: dict


def plan_windows(shards: list[HiddenShard], held: set[tuple[int, int]], max_len: int, ttt_steps: int) -> WindowPlan:
    """Windows of every sequence (``make_windows``), training or held out by ``held`` (shard, sequence) pairs.

    stats: sequences, the longest, how many were longer than ``max_len`` (cut into several windows), windows kept
    and their rows, and windows left out because they hold no supervised prediction (a prompt-only stretch).
    """
    train, heldout = [], []
    longest = windowed = skipped = 0
    for si, sh in enumerate(shards):
        for seq in range(sh.num_seqs):
            n = int(sh.seq_offsets[seq + 1]) - int(sh.seq_offsets[seq])
            kept = make_windows(si, sh, seq, max_len, ttt_steps)
            (heldout if (si, seq) in held else train).extend(kept)
            longest = max(longest, n)
            windowed += n > max_len
            skipped += -(-n // max_len) - len(kept)
    windows = train + heldout
    stats = {
        "max_seq_len": max_len,
        "sequences": sum(sh.num_seqs for sh in shards),
        "longest_sequence": longest,
        "sequences_cut_into_windows": windowed,
        "windows": len(windows),
        "train_windows": len(train),
        "heldout_windows": len(heldout),
        "window_rows": sum(w.end - w.start for w in windows),
        "windows_without_supervision_skipped": skipped,
    }
    return WindowPlan(train, heldout, stats)


def padded_tokens(group: list[Window]) -> int:
    """Rows a batch of these windows occupies: windows x the longest (what memory grows with)."""
    return len(group) * max(w.end - w.start for w in group)


def split_heldout(shards: list[HiddenShard], fraction: float, seed: int) -> set[tuple[int, int]]:
    """Held-out (shard, seq) pairs: a deterministic hash of each sample id, so adding shards keeps the split."""
    if fraction <= 0:
        return set()
    keyed = []
    for si, shard in enumerate(shards):
        for q in range(shard.num_seqs):
            digest = hashlib.sha256(f"{seed}:{shard.sample_ids[q]}".encode()).hexdigest()
            keyed.append((int(digest[:12], 16) / 16**12, si, q))
    held = {(si, q) for u, si, q in keyed if u < fraction}
    if not held and len(keyed) >= 2:  # tiny runs: hold out at least one sequence
        u, si, q = min(keyed)
        held = {(si, q)}
    if len(held) == len(keyed):
        raise ValueError(f"eval_fraction {fraction} holds out every sequence: nothing left to train on")
    return held


def batches(windows: list[Window], cfg: TrainConfig, generator: torch.Generator | None) -> list[list[Window]]:
    """Shuffle (when a generator is given) and group windows, in that order, into batches of at most batch_size
    windows whose padded size (windows x the longest) stays within max_batch_tokens when it is set. A window
    never exceeds the budget alone: TrainConfig refuses max_batch_tokens below max_seq_len."""
    order = torch.randperm(len(windows), generator=generator).tolist() if generator is not None else range(len(windows))
    out, cur, cur_len = [], [], 0
    for i in order:
        w = windows[i]
        n = w.end - w.start
        longest = max(cur_len, n)
        over_tokens = cfg.max_batch_tokens and longest * (len(cur) + 1) > cfg.max_batch_tokens
        if cur and (len(cur) >= cfg.batch_size or over_tokens):
            out.append(cur)
            cur, longest = [], n
        cur.append(w)
        cur_len = longest
    if cur:
        out.append(cur)
    return out


def derived_seed(seed: int, *parts) -> int:
    """A seed for one purpose (e.g. ("epoch", 3)) derived from the run's seed."""
    return int(hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).hexdigest()[:15], 16)


def epoch_batches(windows: list[Window], cfg: TrainConfig, epoch: int) -> list[list[Window]]:
    """The batch order of one epoch: a shuffle seeded by (seed, epoch), so a resumed run rebuilds it exactly."""
    return batches(windows, cfg, torch.Generator().manual_seed(derived_seed(cfg.seed, "epoch", epoch)))


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


def load_batch(
    windows: list[Window], shards: list[HiddenShard], ttt_steps: int, device: torch.device, dtype: torch.dtype
) -> Batch:
    B = len(windows)
    T = max(w.end - w.start for w in windows)
    W = T + ttt_steps + 2
    first = shards[windows[0].shard]
    A_H, H, k = len(first.aux_layer_ids) * first.hidden_size, first.hidden_size, first.topk
    compact = first.layout == "compact"
    aux = torch.zeros(B, T, A_H, dtype=dtype)
    final = None if compact else torch.zeros(B, W, H, dtype=dtype)
    topk_ids = torch.zeros(B, W, k, dtype=torch.long) if compact else None
    topk_lp = torch.zeros(B, W, k, dtype=torch.float32) if compact else None
    ids = torch.zeros(B, W, dtype=torch.long)
    have = torch.zeros(B, W, dtype=torch.bool)
    gen = torch.zeros(B, W, dtype=torch.bool)
    row_valid = torch.zeros(B, T, dtype=torch.bool)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    for i, w in enumerate(windows):
        sh = shards[w.shard]
        n, m = w.end - w.start, w.look_end - w.start
        aux[i, :n] = sh.aux_rows(w.start, w.end, dtype)
        if compact:
            topk_ids[i, :m] = sh.rows("target_topk_ids", w.start, w.look_end).long()
            topk_lp[i, :m] = sh.rows("target_topk_logprobs", w.start, w.look_end).float()
        else:
            final[i, :m] = sh.rows("final_hidden_states", w.start, w.look_end).to(dtype)
        ids[i, :m] = sh.input_ids[w.start : w.look_end]
        gen[i, :m] = sh.loss_mask[w.start : w.look_end]
        have[i, :m] = True
        row_valid[i, :n] = True
        position_ids[i] = w.pos0 + torch.arange(T)
    to = lambda t: t.to(device, non_blocking=True) if t is not None else None  # noqa: E731
    return Batch(
        to(aux),
        to(position_ids),
        to(row_valid),
        to(ids),
        to(have),
        to(gen),
        to(final),
        int(row_valid.sum()),
        to(topk_ids),
        to(topk_lp),
    )
