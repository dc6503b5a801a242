"""Training data: windows over hidden-shard sequences, the held-out split, batch order, and batch loading into the
``aerie.drafter_kinds.batch.Batch`` every kind's objective reads.

A window of a sequence is ``rows`` rows that carry loss plus the kind's look-ahead (``DrafterKind.lookahead``: the
tokens - and targets - its last rows' objective reads past them: EAGLE-3's later TTT steps). A batch holds the
columns of the kind's layers among the shard's captured ones (one capture serves every kind of a run), and the
target's next-token distribution only when the kind reads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from aerie.drafter.config import TrainConfig
from aerie.drafter_kinds.batch import Batch
from aerie.formats.hidden import HiddenShard, dequantize_aux


@dataclass
class Window:
    """Rows [start, end) of one sequence; tokens/targets are read up to look_end (for the unrolled steps)."""

    shard: int
    start: int
    end: int
    look_end: int
    pos0: int  # position id of row `start` within its sequence


def make_windows(shard_idx: int, shard: HiddenShard, seq: int, max_len: int, lookahead: int) -> list[Window]:
    s, e = int(shard.seq_offsets[seq]), int(shard.seq_offsets[seq + 1])
    out = []
    for a in range(s, e, max_len):
        b = min(a + max_len, e)
        look_end = min(b + lookahead, e)
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


def plan_windows(shards: list[HiddenShard], held: set[tuple[int, int]], max_len: int, lookahead: int) -> WindowPlan:
    """Windows of every sequence (``make_windows``), training or held out by ``held`` (shard, sequence) pairs.

    stats: sequences, the longest, how many were longer than ``max_len`` (cut into several windows), windows kept
    and their rows, and windows left out because they hold no supervised prediction (a prompt-only stretch).
    """
    train, heldout = [], []
    longest = windowed = skipped = 0
    for si, sh in enumerate(shards):
        for seq in range(sh.num_seqs):
            n = int(sh.seq_offsets[seq + 1]) - int(sh.seq_offsets[seq])
            kept = make_windows(si, sh, seq, max_len, lookahead)
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


def pack_rows(windows: list[Window], capacity: int | None) -> list[list[int]]:
    """Indices of ``windows`` per batch row. ``capacity`` None: one window per row (padded batches). Else each
    window goes into the first row it fits (packed batches: several sequences per row, up to ``capacity`` rows):
    a window of n rows needs n free rows and then reserves its look-ahead (look_end - end rows, the tokens its
    last rows' later TTT steps read; 0 for a sequence's last window) before the next one starts."""
    if capacity is None:
        return [[i] for i in range(len(windows))]
    rows: list[list[int]] = []
    fill: list[int] = []
    for i, w in enumerate(windows):
        n = w.end - w.start
        r = next((r for r, f in enumerate(fill) if f + n <= capacity), None)
        if r is None:
            rows.append([])
            fill.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        fill[r] += w.look_end - w.start
    return rows


def row_extent(windows: list[Window], row: list[int]) -> int:
    """Window rows a packed row's sequences occupy: up to the last one's last real row."""
    return sum(windows[i].look_end - windows[i].start for i in row[:-1]) + windows[row[-1]].end - windows[row[-1]].start


def padded_tokens(group: list[Window], capacity: int | None = None) -> int:
    """Rows a batch of these windows occupies (what memory grows with): batch rows x the longest row, with one
    window per row (``capacity`` None) or packed into rows of ``capacity`` (``pack_rows``)."""
    rows = pack_rows(group, capacity)
    return len(rows) * max(row_extent(group, r) for r in rows)


def real_tokens(group: list[Window]) -> int:
    return sum(w.end - w.start for w in group)


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
    windows whose padded size stays within max_batch_tokens when it is set. Padded batches (``packing: false``):
    one window per row, size windows x the longest. Packed batches (``packing``, the default): windows share rows
    of max_seq_len (``pack_rows``), at most max_batch_tokens // max_seq_len rows; when the next window does not fit,
    the next ``PACK_LOOKAHEAD`` windows of the order are tried before the batch closes, so little of a row is left
    empty. A window never exceeds the budget alone: TrainConfig refuses max_batch_tokens below max_seq_len."""
    order = torch.randperm(len(windows), generator=generator).tolist() if generator is not None else range(len(windows))
    if cfg.packing:
        return _packed_batches([windows[i] for i in order], cfg)
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


# Windows of the shuffled order a packed batch looks ahead for one that fills its last free rows.
PACK_LOOKAHEAD = 64


def _packed_batches(order: list[Window], cfg: TrainConfig) -> list[list[Window]]:
    """Packed batches in the given order (``batches``): rows of max_seq_len, at most max_batch_tokens //
    max_seq_len of them (batch_size when no budget), at most batch_size windows."""
    capacity = cfg.max_seq_len
    max_rows = max(1, cfg.largest_batch_tokens // capacity)
    pending = list(order)
    out = []
    while pending:
        fill: list[int] = []  # per row: window rows used (with look-ahead)
        cur: list[Window] = []
        j = 0
        while j < len(pending) and j < PACK_LOOKAHEAD and len(cur) < cfg.batch_size:
            w = pending[j]
            n = w.end - w.start
            r = next((r for r, f in enumerate(fill) if f + n <= capacity), None)
            if r is None and len(fill) < max_rows:
                fill.append(0)
                r = len(fill) - 1
            if r is None:
                if not cur:  # cannot happen (a window fits an empty row); guards the loop
                    raise AssertionError("a window longer than a row")
                j += 1  # does not fit: look further ahead in the order
                continue
            fill[r] += w.look_end - w.start
            cur.append(pending.pop(j))
        out.append(cur)
    return out


def balance_ranks(
    groups: list[list[Window]], world: int, cost, generator: torch.Generator | None
) -> list[list[Window]]:
    """A batch order in which every run of ``world`` consecutive batches (one optimizer step of all ranks under
    ``shard_for_rank``) has batches of similar ``cost(batch)``: batches sorted by cost, cut into steps of
    ``world``, the steps shuffled (by ``generator``). DDP waits for the slowest rank at every step, so this bounds
    the slowest rank over the mean by the cost spread within a step. One process: the order as it is."""
    if world <= 1 or len(groups) <= world:
        return list(groups)
    ranked = sorted(groups, key=cost, reverse=True)
    steps = [ranked[i : i + world] for i in range(0, len(ranked), world)]
    last = steps.pop() if len(steps[-1]) < world else None  # a short last step stays last (shard_for_rank pads it)
    perm = torch.randperm(len(steps), generator=generator).tolist() if generator is not None else range(len(steps))
    return [g for i in perm for g in steps[i]] + (last or [])


def batch_cost(group: list[Window], capacity: int | None, attention_rows: float) -> float:
    """Relative compute of a batch: every computed row (padding included) costs 1, and the attention adds
    n^2 / (2 * attention_rows) per block of n rows attending causally to each other - a whole padded row
    (chunked kernel, padded batches), each packed sequence on its own (packed batches: both kernels skip keys
    before a row's sequence). ``attention_rows``: the window length at which the attention costs as much as
    the rest of a row (``attention_cost_rows``)."""
    rows = pack_rows(group, capacity)
    T = max(row_extent(group, r) for r in rows)
    linear = len(rows) * T
    if capacity is None:
        quadratic = len(rows) * T * T
    else:
        quadratic = sum((group[i].end - group[i].start) ** 2 for r in rows for i in r)
    return linear + quadratic / (2 * attention_rows)


def derived_seed(seed: int, *parts) -> int:
    """A seed for one purpose (e.g. ("epoch", 3)) derived from the run's seed."""
    return int(hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).hexdigest()[:15], 16)


def epoch_batches(windows: list[Window], cfg: TrainConfig, epoch: int) -> list[list[Window]]:
    """The batch order of one epoch: a shuffle seeded by (seed, epoch), so a resumed run rebuilds it exactly."""
    return batches(windows, cfg, torch.Generator().manual_seed(derived_seed(cfg.seed, "epoch", epoch)))


def load_batch(
    windows: list[Window],
    shards: list[HiddenShard],
    lookahead: int,
    device: torch.device,
    dtype: torch.dtype,
    capacity: int | None = None,
    *,
    layers: Sequence[int] | None = None,
    targets: bool = True,
) -> Batch:
    """The batch's tensors on ``device``: one window per batch row, or packed into rows of ``capacity``
    (``pack_rows``: a sequence's rows, then its look-ahead, then the next sequence). ``layers``: which of the
    shards' captured layers (indices into their aux_layer_ids) the batch holds, in that order (None: all);
    ``targets``: whether it holds the target's next-token distribution (top-k or final states). The rows are read
    in their stored dtypes (compact aux: float8 and per-layer scales) into host buffers, pinned when ``device`` is a
    GPU, copied without blocking and dequantised on ``device``: the host moves a quarter of fp32's bytes."""
    device = torch.device(device)
    pin = device.type == "cuda"
    return host_batch(windows, shards, lookahead, capacity, pin=pin, layers=layers, targets=targets).to_device(
        device, dtype
    )


@dataclass
class HostBatch:
    """A batch as read from the shards, in the stored dtypes, on the host (``host_batch``)."""

    aux: Tensor  # [B, T, A*H] stored dtype (float8 for compact shards)
    aux_scales: Tensor | None  # [B, T, A] fp32 (compact)
    tensors: dict[str, Tensor | None]  # everything else, in Batch's field names
    packed: bool

    def to_device(self, device: torch.device, dtype: torch.dtype) -> Batch:
        to = lambda t: t.to(device, non_blocking=True) if t is not None else None  # noqa: E731
        B, T, _ = self.aux.shape
        if self.aux_scales is not None:  # dequantised where the batch will live
            aux = dequantize_aux(to(self.aux).view(B * T, -1), to(self.aux_scales).view(B * T, -1), dtype)
            aux = aux.view(B, T, -1)
        else:
            aux = to(self.aux).to(dtype)
        t = {k: to(v) for k, v in self.tensors.items()}
        if t["final"] is not None:
            t["final"] = t["final"].to(dtype)
        if not self.packed:
            t["seq_start"] = t["row_limit"] = None
        return Batch(aux=aux, rows=int(self.tensors["row_valid"].sum()), **t)

    def nbytes(self) -> int:
        parts = [self.aux, self.aux_scales, *self.tensors.values()]
        return sum(x.numel() * x.element_size() for x in parts if x is not None)


def _layer_rows(shard: HiddenShard, name: str, start: int, end: int, layers: Sequence[int] | None) -> Tensor:
    """Rows start..end of a per-layer tensor (aux [n, A*H], scales [n, A]) with only ``layers`` (indices), in order."""
    rows = shard.rows(name, start, end)
    if layers is None:
        return rows
    A = len(shard.aux_layer_ids)
    return rows.view(rows.shape[0], A, -1)[:, list(layers)].reshape(rows.shape[0], -1)


def host_batch(
    windows: list[Window],
    shards: list[HiddenShard],
    lookahead: int,
    capacity: int | None,
    pin: bool = False,
    *,
    layers: Sequence[int] | None = None,
    targets: bool = True,
) -> HostBatch:
    """Read a batch's rows from the shards into host buffers (``load_batch``'s first half; a loader thread runs
    it while the previous step computes: ``prefetched``)."""
    layout = pack_rows(windows, capacity)
    B = len(layout)
    T = max(row_extent(windows, r) for r in layout)
    W = T + lookahead + 1
    first = shards[windows[0].shard]
    A = len(first.aux_layer_ids) if layers is None else len(layers)
    H, k = first.hidden_size, first.topk
    compact = first.layout == "compact"
    topk = compact and targets
    final = not compact and targets
    zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, pin_memory=pin)  # noqa: E731
    aux_dtype = first.rows("aux_hidden_states", 0, 0).dtype
    aux = zeros(B, T, A * H, dtype=aux_dtype)
    scales = zeros(B, T, A, dtype=torch.float32) if compact else None
    final_dtype = first.rows("final_hidden_states", 0, 0).dtype if final else None
    t = {
        "position_ids": zeros(B, T, dtype=torch.long),
        "row_valid": zeros(B, T, dtype=torch.bool),
        "ids": zeros(B, W, dtype=torch.long),
        "have": zeros(B, W, dtype=torch.bool),
        "gen": zeros(B, W, dtype=torch.bool),
        "final": zeros(B, W, H, dtype=final_dtype) if final else None,
        "topk_ids": zeros(B, W, k, dtype=torch.long) if topk else None,
        "topk_logprobs": zeros(B, W, k, dtype=torch.float32) if topk else None,
        "seq_start": zeros(B, T, dtype=torch.long),
        "row_limit": zeros(B, T, dtype=torch.long),
    }
    for i, row in enumerate(layout):
        o = 0
        for j, wi in enumerate(row):
            w = windows[wi]
            sh = shards[w.shard]
            n, m = w.end - w.start, w.look_end - w.start
            aux[i, o : o + n] = _layer_rows(sh, "aux_hidden_states", w.start, w.end, layers)
            if compact:
                scales[i, o : o + n] = _layer_rows(sh, "aux_scales", w.start, w.end, layers)
            if topk:
                t["topk_ids"][i, o : o + m] = sh.rows("target_topk_ids", w.start, w.look_end).long()
                t["topk_logprobs"][i, o : o + m] = sh.rows("target_topk_logprobs", w.start, w.look_end).float()
            if final:
                t["final"][i, o : o + m] = sh.rows("final_hidden_states", w.start, w.look_end)
            t["ids"][i, o : o + m] = sh.input_ids[w.start : w.look_end]
            t["gen"][i, o : o + m] = sh.loss_mask[w.start : w.look_end]
            t["have"][i, o : o + m] = True
            t["row_valid"][i, o : o + n] = True
            # the sequence's rows, its look-ahead and (last in the row) the padding: its positions, its start
            span = (o + m if j + 1 < len(row) else T) - o
            t["position_ids"][i, o : o + span] = w.pos0 + torch.arange(span)
            t["seq_start"][i, o : o + span] = o
            t["row_limit"][i, o : o + span] = o + m
            o += m
    return HostBatch(aux, scales, t, packed=any(len(r) > 1 for r in layout))


def prefetched(groups: list[list[Window]], load) -> Iterator[Batch]:
    """``load(group)`` for each group in order, the next one running on a background thread while the caller
    works on the current one (one batch ahead: the host holds two batches at a time)."""
    if not groups:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aerie-batch-loader") as pool:
        pending = pool.submit(load, groups[0])
        for i in range(len(groups)):
            batch = pending.result()
            if i + 1 < len(groups):
                pending = pool.submit(load, groups[i + 1])
            yield batch
