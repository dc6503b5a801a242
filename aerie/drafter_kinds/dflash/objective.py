"""The DFlash training objective on one batch, and acceptance simulated from its predictions.

A batch is B rows of T tokens: ``input_ids``, ``loss_mask`` (1 on the target's generated tokens),
``target_features`` (the K target layers' outputs per token, concatenated in layer order) and, for packed rows,
``seq_start`` (the row position where each token's sequence starts: nothing crosses a sequence boundary).

1. Anchors: positions t with loss_mask[t] and loss_mask[t+1] inside one sequence; up to ``num_anchors`` per
   sequence, drawn without replacement by the seeded generator, sorted.
2. Each anchor t makes a block ``[token[t], MASK x (B-1)]`` (embedded with the target's embeddings) at positions
   t..t+B-1 of its sequence (positions restart at every sequence start: RoPE sees what serving sees).
3. Attention over keys ``[context rows 0..T-1 | every block's tokens]``: a block's queries see the context of
   their own sequence strictly before their anchor (serving has no target feature for the anchor token yet) and
   their own block - bidirectionally in full-attention layers, causally in sliding ones, where a query at position
   p also sees no key before p - W + 1 - and never another block.
4. Slot k (1..B-1) predicts token[t+k], weight loss_mask[t+k] x (t+k in the same sequence) x exp(-(k-1)/gamma);
   cross-entropy through the frozen target lm_head over the full vocabulary, a chunk of blocks at a time (each
   chunk's logits are recomputed in backward, never kept), normalised by the summed weights.

The reference path builds the mask as a dense boolean tensor (SDPA; CPU, tests); the flex path as a
``BlockMask`` (CUDA; on the CPU flex attention runs eagerly, forward only, in torch 2.13).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.utils.checkpoint import checkpoint

from aerie.drafter_kinds.dflash.model import DFlashDrafter
from aerie.drafter_kinds.dflash.shape import default_loss_gamma

KERNELS = ("reference", "flex")


@dataclass
class DFlashBatch:
    input_ids: Tensor  # [B, T] int
    loss_mask: Tensor  # [B, T] 0/1
    target_features: Tensor  # [B, T, K*H]
    seq_start: Tensor | None = None  # [B, T] int: row position of each token's sequence start (None: one per row)

    def starts(self) -> Tensor:
        if self.seq_start is not None:
            return self.seq_start.long()
        return torch.zeros_like(self.input_ids, dtype=torch.long)


@dataclass
class BlockLayout:
    """Where a batch's blocks sit: per row N blocks (rows with fewer anchors are padded with dead blocks)."""

    anchors: Tensor  # [B, N] row position of each block's anchor (0 for a dead block)
    keep: Tensor  # [B, N] bool: a real block
    starts: Tensor  # [B, N] row position where the anchor's sequence starts
    block_size: int
    context_len: int  # T

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]


def sample_anchors(
    loss_mask: Tensor, seq_start: Tensor | None, num_anchors: int, block_size: int, generator: torch.Generator
) -> BlockLayout:
    """Up to ``num_anchors`` anchors per sequence (see the module docstring), sampled on the CPU by ``generator``."""
    B, T = loss_mask.shape
    supervised = loss_mask.detach().cpu() > 0
    starts = seq_start.detach().cpu().long() if seq_start is not None else torch.zeros(B, T, dtype=torch.long)
    valid = supervised[:, :-1] & supervised[:, 1:] & (starts[:, :-1] == starts[:, 1:])  # [B, T-1]
    rows: list[Tensor] = []
    for b in range(B):
        candidates = valid[b].nonzero().flatten()
        picked = []
        for start in starts[b, candidates].unique().tolist():  # one draw per sequence of the row
            mine = candidates[starts[b, candidates] == start]
            picked.append(mine[torch.randperm(len(mine), generator=generator)[:num_anchors]])
        rows.append(torch.cat(picked).sort().values if picked else torch.zeros(0, dtype=torch.long))
    N = max(len(r) for r in rows)
    if N == 0:
        raise ValueError("no anchor in the batch: DFlash needs two consecutive supervised tokens in a sequence")
    anchors = torch.zeros(B, N, dtype=torch.long)
    keep = torch.zeros(B, N, dtype=torch.bool)
    for b, r in enumerate(rows):
        anchors[b, : len(r)], keep[b, : len(r)] = r, True
    device = loss_mask.device
    anchor_starts = torch.where(keep, starts.gather(1, anchors), 0)
    return BlockLayout(anchors.to(device), keep.to(device), anchor_starts.to(device), block_size, T)


def block_inputs(layout: BlockLayout, input_ids: Tensor, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """(block token ids [B, N*Bk]: each block's anchor token then MASK ids, dead blocks all MASK; their positions
    [B, N*Bk] within the anchor's sequence)."""
    B, N, Bk = *layout.anchors.shape, layout.block_size
    ids = torch.full((B, N, Bk), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = torch.where(layout.keep, input_ids.gather(1, layout.anchors), mask_token_id)
    offsets = torch.arange(Bk, device=input_ids.device)
    positions = (layout.anchors - layout.starts)[:, :, None] + offsets
    return ids.view(B, N * Bk), positions.view(B, N * Bk)


def reference_mask(layout: BlockLayout, window: int | None) -> Tensor:
    """Dense boolean mask [B, 1, N*Bk, T + N*Bk] (True: the query may read the key), ``window`` None for full
    attention layers, W for sliding ones."""
    B, N, Bk, T = *layout.anchors.shape, layout.block_size, layout.context_len
    device = layout.anchors.device
    offset = torch.arange(Bk, device=device)
    anchor = layout.anchors[:, :, None, None]  # [B, N, 1, 1]
    start = layout.starts[:, :, None, None]
    query_row = anchor + offset[None, None, :, None]  # [B, N, Bk, 1]: the query's row position
    kv_row = torch.arange(T, device=device)
    context = ((kv_row >= start) & (kv_row < anchor)).expand(B, N, Bk, T)
    same_block = torch.eye(N, dtype=torch.bool, device=device)[None, :, None, :, None]  # [1, N, 1, N, 1]
    kv_offset = offset[None, None, None, None, :]
    q_offset = offset[None, None, :, None, None]
    block = same_block.expand(B, N, Bk, N, Bk)
    if window is not None:
        context = context & (kv_row > query_row - window)
        block = block & (kv_offset <= q_offset) & (q_offset - kv_offset < window)
    block = block.reshape(B, N, Bk, N * Bk)
    return torch.cat([context, block], dim=-1).view(B, 1, N * Bk, T + N * Bk)


def flex_mask(layout: BlockLayout, window: int | None) -> BlockMask:
    """The same mask as ``reference_mask``, as a flex-attention BlockMask (compiled on CUDA)."""
    B, N, Bk, T = *layout.anchors.shape, layout.block_size, layout.context_len
    anchors, starts = layout.anchors, layout.starts

    def mask_mod(b, h, q_idx, kv_idx):
        blk, q_off = q_idx // Bk, q_idx % Bk
        anchor, start = anchors[b, blk], starts[b, blk]
        context = (kv_idx < T) & (kv_idx >= start) & (kv_idx < anchor)
        kv_blk, kv_off = (kv_idx - T) // Bk, (kv_idx - T) % Bk
        block = (kv_idx >= T) & (kv_blk == blk)
        if window is not None:
            context = context & (kv_idx > anchor + q_off - window)
            block = block & (kv_off <= q_off) & (q_off - kv_off < window)
        return context | block

    device = anchors.device
    return create_block_mask(mask_mod, B, None, N * Bk, T + N * Bk, device=device, _compile=device.type == "cuda")


def block_labels(layout: BlockLayout, batch: DFlashBatch, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """(labels [B, N, Bk-1]: token[t+k] of slot k = 1..Bk-1; valid [B, N, Bk-1]: a real block, t+k inside the row
    and the anchor's sequence, loss_mask[t+k]; weights [B, N, Bk-1]: valid x exp(-(k-1)/gamma))."""
    B, N, Bk, T = *layout.anchors.shape, layout.block_size, layout.context_len
    k = torch.arange(1, Bk, device=layout.anchors.device)
    rows = layout.anchors[:, :, None] + k  # [B, N, Bk-1]
    inside = rows < T
    safe = rows.clamp(max=T - 1).view(B, -1)
    labels = batch.input_ids.gather(1, safe).view(B, N, Bk - 1)
    same_sequence = batch.starts().gather(1, safe).view(B, N, Bk - 1) == layout.starts[:, :, None]
    supervised = batch.loss_mask.gather(1, safe).view(B, N, Bk - 1) > 0
    valid = layout.keep[:, :, None] & inside & same_sequence & supervised
    decay = torch.exp(-(k - 1).double() / gamma)
    return labels, valid, valid.double() * decay


@dataclass
class DFlashLoss:
    """The objective's value on a batch and what the loop logs. Slot k of the per-slot tensors is draft k + 1."""

    loss: Tensor  # scalar, differentiable
    slot_loss_sum: Tensor  # [Bk-1] cross-entropy summed over valid positions (no decay)
    slot_correct: Tensor  # [Bk-1] argmax == label, over valid positions
    slot_count: Tensor  # [Bk-1] valid positions
    slot_weight: Tensor  # [Bk-1] summed loss weights (with decay)
    block_correct: Tensor  # [blocks, Bk-1] bool, real blocks only
    block_valid: Tensor  # [blocks, Bk-1] bool

    def slot_loss(self) -> list[float]:
        return (self.slot_loss_sum / self.slot_count.clamp(min=1)).tolist()

    def slot_accuracy(self) -> list[float]:
        return (self.slot_correct / self.slot_count.clamp(min=1)).tolist()

    def acceptance(self) -> Acceptance:
        return simulated_acceptance(self.block_correct, self.block_valid)


def _chunk_loss(hidden: Tensor, head: Tensor, labels: Tensor, valid: Tensor, weights: Tensor) -> tuple[Tensor, ...]:
    """One chunk of blocks: hidden [c, Bk-1, H] -> (weighted CE sum, per-slot CE sums, per-slot correct,
    correct [c, Bk-1]). Logits in fp32 (float64 stays float64)."""
    logits = hidden @ head.T.to(hidden.dtype)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [c, Bk-1, V]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        slot_ce = (ce.detach() * valid).sum(0)
    return (ce * weights).sum(), slot_ce, correct.sum(0).float(), correct


def dflash_loss(
    drafter: DFlashDrafter,
    batch: DFlashBatch,
    *,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    num_anchors: int,
    generator: torch.Generator,
    gamma: float | None = None,
    kernel: str = "reference",
    loss_chunk_blocks: int = 64,
    checkpoint_layers: bool = False,
) -> DFlashLoss:
    """The objective (module docstring) of ``drafter`` on ``batch``. ``embed_weight`` [V, H] and ``lm_head_weight``
    [V, H] are the target's, frozen; ``gamma`` None: ``default_loss_gamma(block_size)``; ``kernel``: "reference"
    (dense mask) or "flex"."""
    if kernel not in KERNELS:
        raise ValueError(f"DFlash attention kernel must be one of {list(KERNELS)}, not {kernel!r}")
    shape = drafter.shape
    Bk = shape.block_size
    layout = sample_anchors(batch.loss_mask, batch.seq_start, num_anchors, Bk, generator)
    ids, positions = block_inputs(layout, batch.input_ids, shape.mask_token_id)
    build = reference_mask if kernel == "reference" else flex_mask
    masks = {t: build(layout, shape.window_of(t)) for t in set(shape.layer_types)}
    context = drafter.project_context(batch.target_features)
    starts = batch.starts()
    context_positions = torch.arange(layout.context_len, device=starts.device) - starts
    embeds = F.embedding(ids, embed_weight.detach()).to(context.dtype)
    hidden = drafter(
        embeds,
        positions,
        masks,
        context=context,
        context_positions=context_positions,
        checkpoint_layers=checkpoint_layers,
    )
    B, N = layout.anchors.shape
    drafts = hidden.view(B, N, Bk, -1)[:, :, 1:][layout.keep]  # [blocks, Bk-1, H]: real blocks' draft slots
    labels, valid, weights = (t[layout.keep] for t in block_labels(layout, batch, loss_gamma(gamma, Bk)))
    loss_dtype = torch.promote_types(drafts.dtype, torch.float32)
    weights = weights.to(loss_dtype)
    head = lm_head_weight.detach()
    total = drafts.new_zeros((), dtype=loss_dtype)
    slot_ce, slot_correct, correct = [], [], []
    for a in range(0, drafts.shape[0], loss_chunk_blocks):
        part = slice(a, a + loss_chunk_blocks)
        out = checkpoint(_chunk_loss, drafts[part], head, labels[part], valid[part], weights[part], use_reentrant=False)
        total = total + out[0]
        slot_ce.append(out[1])
        slot_correct.append(out[2])
        correct.append(out[3])
    weight_sum = weights.sum()
    return DFlashLoss(
        loss=total / weight_sum.clamp(min=torch.finfo(loss_dtype).tiny),
        slot_loss_sum=torch.stack(slot_ce).sum(0),
        slot_correct=torch.stack(slot_correct).sum(0),
        slot_count=valid.sum(0).float(),
        slot_weight=weights.sum(0),
        block_correct=torch.cat(correct),
        block_valid=valid,
    )


@dataclass(frozen=True)
class Acceptance:
    length: float | None  # mean tokens committed per verify step, bonus included (None: no block)
    per_position: list[float]  # [k]: fraction of blocks whose draft k+1 is accepted
    blocks: int


def simulated_acceptance(correct: Tensor, valid: Tensor | None = None) -> Acceptance:
    """Acceptance counted like SGLang's ``spec_accept_length``: each block is one verify step that commits its
    leading correct drafts plus the target's own next token. ``correct`` [blocks, Bk-1]; ``valid`` marks slots
    with a label - a chain stops at the first wrong or unlabelled slot (past the sequence's end, or a token the
    target did not generate: a served target would not have produced it either)."""
    ok = correct.bool() & (valid.bool() if valid is not None else True)
    blocks = ok.shape[0]
    if blocks == 0:
        return Acceptance(None, [0.0] * ok.shape[1], 0)
    leading = ok.long().cumprod(dim=1)  # [blocks, Bk-1]: 1 while every draft so far was accepted
    per_position = (leading.sum(0).double() / blocks).tolist()
    return Acceptance(float(leading.sum(1).double().mean()) + 1.0, per_position, blocks)


def loss_gamma(gamma: float | None, block_size: int) -> float:
    """The decay gamma a run uses (``gamma`` or the block size's default); checked positive and finite."""
    value = float(gamma) if gamma is not None else default_loss_gamma(block_size)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"drafter.loss_gamma must be a positive number, got {gamma}")
    return value
