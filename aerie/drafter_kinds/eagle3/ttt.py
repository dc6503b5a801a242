"""Training-time test (TTT): the unrolled chain of draft steps and its loss against the target.

Step 0 feeds fc(aux features) with tokens shifted by one, exactly like SGLang's draft extend. Step k >= 1
feeds each row's own step k-1 ``hidden_out`` with the token one further on, at position t+k - exactly what
chained draft steps see at inference. Attention follows the same rule (TTTCache): step-k row t sees step-0
keys of rows <= t and its own row's keys from steps 1..k. The loss at every step is the soft cross-entropy
against the target's next-token distribution restricted to the draft vocab (``TargetHead``: from the final
states through lm_head for ``full`` hidden shards, from the stored top-k for ``compact`` ones), weighted
``step_loss_decay**k`` and normalised by the supervised rows.

Memory (training): each step up to lm_head runs under activation checkpointing (``torch.utils.checkpoint``,
non-reentrant): between forward and backward a step keeps only its inputs and outputs - the hidden state it
hands on and the key/value it adds to the cache - and backward re-runs it. The vocabulary loss
(``SoftCrossEntropy``, outside the checkpoint so that re-running a step does not redo it) keeps its input in the
logits' dtype, takes ``LOSS_CHUNK_ROWS`` rows of logits at a time and keeps none (backward recomputes them), and
the soft targets are built per chunk too (``Targets.rows``): no [B, T, Vd] tensor exists. The attention is TTTAttention
(layers.py). So memory grows linearly in the window (aerie.drafter_kinds.eagle3.memory counts it;
bench/drafter_memory.py
measures it), and the numbers are those of the plain composition (tests/ttt_reference.py; tests check
outputs and gradients against it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.eagle3.layers import TTTCache, TTTLayout
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter

# Rows of logits the vocabulary loss builds at a time (per batch: LOSS_CHUNK_ROWS // B rows of each window).
# aerie.drafter_kinds.eagle3.memory reads it.
LOSS_CHUNK_ROWS = 256


def _fp32(device: torch.device):
    """Targets are computed in fp32 even inside the training step's bf16 autocast (as they always were)."""
    if not torch.amp.is_autocast_available(device.type):  # e.g. meta tensors (bench/drafter_memory.py)
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def _compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype autocast gives matmuls here (bf16 on the GPU trainer), else fp32."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


@dataclass
class TargetHead:
    """The target's next-token distribution at every batch position, restricted to the draft vocab.

    Full layout: from the final states through the frozen lm_head (``full`` [V,H] for the greedy token,
    ``draft`` [Vd,H] rows for the soft targets). Compact layout: from the stored top-k lists; no lm_head."""

    full: Tensor | None
    draft: Tensor | None
    t2d: Tensor  # bool [V]
    draft_vocab_size: int = 0  # 0: counted from t2d (once, not per chunk)

    def __post_init__(self) -> None:
        if not self.draft_vocab_size:
            self.draft_vocab_size = int(self.t2d.sum())

    @torch.no_grad()
    def soft_targets(self, final: Tensor) -> Tensor:
        """[B,W,H] -> [B,W,Vd]: target next-token distribution renormalised over the draft vocab."""
        with _fp32(final.device):
            return torch.softmax((final @ self.draft.T).float(), dim=-1)

    @torch.no_grad()
    def greedy(self, final: Tensor, chunk: int = 512) -> Tensor:
        """[B,W,H] -> [B,W] target argmax over the full vocab, in row chunks to bound memory."""
        flat = final.reshape(-1, final.shape[-1])
        with _fp32(final.device):
            out = torch.cat([(flat[i : i + chunk] @ self.full.T).argmax(-1) for i in range(0, len(flat), chunk)])
        return out.view(final.shape[:-1])

    @torch.no_grad()
    def topk_targets(self, ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
        """[B,W,k] top-k lists -> ([B,W,Vd] soft targets, [B,W] has any in-vocab entry): the softmax of the
        entries inside the draft vocab, renormalised among themselves; rows with none get all zeros."""
        draft_index = torch.cumsum(self.t2d, 0) - 1  # target id -> draft id (draft ids ascend with target ids)
        valid = self.t2d[ids]
        has = valid.any(-1)
        lp = logprobs.float().masked_fill(~valid, float("-inf")).masked_fill(~has[..., None], 0.0)
        p = torch.softmax(lp, -1) * valid
        q = torch.zeros(*ids.shape[:-1], self.draft_vocab_size, device=ids.device)
        return q.scatter_add_(-1, (draft_index[ids] * valid).long(), p), has

    @torch.no_grad()
    def targets(self, b: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(q [B,W,Vd] soft targets, greedy [B,W] target token, has_q [B,W] bool) for a batch of either layout.
        Whole-window soft targets: training and evaluation use ``prepare`` (per-chunk rows) instead."""
        if b.topk_ids is not None:
            q, has = self.topk_targets(b.topk_ids, b.topk_logprobs)
            return q, b.topk_ids[..., 0], has  # top-1 of the full vocab = the target's greedy token
        return self.soft_targets(b.final), self.greedy(b.final), torch.ones_like(b.have)

    @torch.no_grad()
    def prepare(self, b: Batch, mask_out_of_vocab: bool = True) -> Targets:
        """The batch's targets without its [B,W,Vd] soft-target tensor: the greedy token and which positions may
        carry loss now, the soft targets of any window positions on demand."""
        if b.topk_ids is not None:
            greedy, has = b.topk_ids[..., 0], self.t2d[b.topk_ids].any(-1)
            rows = lambda p0, p1: self.topk_targets(b.topk_ids[:, p0:p1], b.topk_logprobs[:, p0:p1])[0]  # noqa: E731
        else:
            greedy, has = self.greedy(b.final), torch.ones_like(b.have)
            rows = lambda p0, p1: self.soft_targets(b.final[:, p0:p1])  # noqa: E731
        return Targets(rows=rows, greedy=greedy, ok=target_mask(self, greedy, has, mask_out_of_vocab))


@dataclass
class Targets:
    """One batch's targets: ``rows(p0, p1)`` -> [B, p1-p0, Vd] soft targets of window positions p0..p1-1 (q[p]
    predicts token p+1); ``greedy`` [B,W] the target's token; ``ok`` [B,W] positions that may carry loss."""

    rows: Callable[[int, int], Tensor]
    greedy: Tensor
    ok: Tensor


def ttt_unroll(model: Eagle3Drafter, aux: Tensor, ids: Tensor, position_ids: Tensor, steps: int) -> list[Tensor]:
    """Unrolled chained drafting over every row at once; returns per-step draft logits [B,T,Vd] (whole windows:
    for inspection and tests; training and evaluation use ``ttt_forward``)."""
    T = aux.shape[1]
    cache = TTTCache()
    hidden = model.project_aux(aux)  # [B,T,H] step 0: target features
    logits_per_step = []
    for k in range(steps):
        tokens = ids[:, 1 + k : 1 + k + T]  # token t+1+k at row t
        logits, hidden = model(hidden, tokens, position_ids + k, cache)  # hidden_out feeds step k+1
        logits_per_step.append(logits)
    return logits_per_step


def step_weights(batch: Batch, k: int, target_ok: Tensor | None) -> Tensor:
    """[B,T] float: rows supervised at step k (real row, predicted token generated, and - when given - a usable
    target: in-vocab greedy token with mask_out_of_vocab_targets, an in-vocab top-k entry for compact shards)."""
    T = batch.row_valid.shape[1]
    w = batch.row_valid & batch.gen[:, 2 + k : 2 + k + T]
    own = batch.readable(2 + k)  # packed rows: the predicted token must be of the row's own sequence
    if own is not None:
        w = w & own
    if target_ok is not None:
        w = w & target_ok[:, 1 + k : 1 + k + T]
    return w.float()


def target_mask(head: TargetHead, greedy: Tensor, has_q: Tensor, mask_out_of_vocab: bool) -> Tensor:
    """[B,W] bool: positions whose target distribution may carry loss (``mask_out_of_vocab``: drafter setting
    mask_out_of_vocab_targets - not those whose greedy token is outside the draft vocab)."""
    return has_q & head.t2d[greedy] if mask_out_of_vocab else has_q


class SoftCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``w[row] * -(q[row] . log_softmax(lm_head(x[row])))``, ``LOSS_CHUNK_ROWS`` rows of logits
    at a time; also the rows' argmax (draft tokens) and how many supervised rows it gets right (q's argmax).

    x [B,T,H] (the normed hidden state), weight [Vd,H] (lm_head), q_rows(r0, r1) -> [B, r1-r0, Vd] soft targets of
    rows r0..r1-1, w [B,T] row weights. Logits are made in ``dtype`` (bf16 under autocast, as lm_head would) and
    normalised in fp32; backward recomputes each chunk's logits (d logits = (softmax * sum(q) - q) * w) instead of
    keeping [B,T,Vd] of them, and accumulates lm_head's gradient in fp32. It keeps x in ``dtype``: what the
    logits are made from (a bf16 copy under autocast, x itself in fp32).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, q_rows, w: Tensor, dtype: torch.dtype, chunk_rows: int):
        B, T, _ = x.shape
        ce_sum = torch.zeros((), device=x.device)
        correct = torch.zeros((), device=x.device)
        draft = torch.empty(B, T, dtype=torch.long, device=x.device)
        xd = x.to(dtype)
        with _fp32(x.device):
            wc = weight.to(dtype)
            for r0 in range(0, T, chunk_rows):
                r1 = min(T, r0 + chunk_rows)
                logits = F.linear(xd[:, r0:r1], wc)  # [B, c, Vd]
                q = q_rows(r0, r1)
                ce = -(q * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, c]
                ce_sum += (ce * w[:, r0:r1]).sum()
                draft[:, r0:r1] = logits.argmax(-1)
                correct += ((draft[:, r0:r1] == q.argmax(-1)).float() * w[:, r0:r1]).sum()
        ctx.save_for_backward(xd, weight, w)
        ctx.q_rows, ctx.dtype, ctx.chunk_rows, ctx.x_dtype = q_rows, dtype, chunk_rows, x.dtype
        ctx.mark_non_differentiable(correct, draft)
        return ce_sum, correct, draft

    @staticmethod
    def backward(ctx, grad_ce: Tensor, _grad_correct, _grad_draft):
        xd, weight, w = ctx.saved_tensors
        dtype, (B, T, H) = ctx.dtype, xd.shape
        dx = torch.empty(xd.shape, dtype=ctx.x_dtype, device=xd.device)
        dw = None
        # lm_head's gradient is one matmul per block of grad_block_rows(...) rows (every row of a window up to
        # ~4H / itemsize rows: one per step at Kimi's 32k-row batches is 3), not one fp32 read-add-write of the
        # [Vd, H] sum per loss chunk; the block's logit gradients wait in a buffer about that sum's size.
        block = grad_block_rows(B, T, H, dtype, ctx.chunk_rows)
        with _fp32(xd.device):
            wc = weight.to(dtype)
            buf = torch.empty(B, min(T, block), wc.shape[0], dtype=dtype, device=xd.device)
            for b0 in range(0, T, block):
                b1 = min(T, b0 + block)
                for r0 in range(b0, b1, ctx.chunk_rows):
                    r1 = min(b1, r0 + ctx.chunk_rows)
                    p = torch.softmax(F.linear(xd[:, r0:r1], wc).float(), dim=-1)
                    q = ctx.q_rows(r0, r1)
                    dlogits = ((p * q.sum(-1, keepdim=True) - q) * (w[:, r0:r1] * grad_ce)[..., None]).to(dtype)
                    dx[:, r0:r1] = dlogits @ wc
                    buf[:, r0 - b0 : r1 - b0] = dlogits
                part = _mm_fp32(buf[:, : b1 - b0].flatten(0, 1).T, xd[:, b0:b1].flatten(0, 1))
                dw = part if dw is None else dw.add_(part)
        return dx, dw.to(weight.dtype), None, None, None, None


def grad_block_rows(B: int, T: int, hidden: int, dtype: torch.dtype, chunk_rows: int) -> int:
    """Rows of each window per lm_head-gradient matmul in SoftCrossEntropy's backward: the block's [B, rows, Vd]
    logit gradients take about as many bytes as the fp32 [Vd, H] gradient (4 * H / itemsize rows in all), at least
    one loss chunk. aerie.drafter_kinds.eagle3.memory counts the buffer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return min(T, max(chunk_rows, (4 * hidden // itemsize) // max(1, B)))


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b summed and returned in fp32 (bf16 inputs on CUDA: cuBLAS writes fp32 directly)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _draft_step(model: Eagle3Drafter, hidden, tokens, positions, keys, values, layout: TTTLayout):
    """One TTT step up to lm_head: (normed, next hidden, this step's key, value). A pure function of its arguments
    (a fresh cache over the earlier steps' keys), so checkpointing can re-run it. The loss stays outside: its
    forward would be re-run for nothing (SoftCrossEntropy keeps only its input and recomputes logits anyway)."""
    cache = TTTCache(keys, values, layout=layout)
    normed, hidden = model.step(hidden, tokens, positions, cache)
    return normed, hidden, cache.keys[-1], cache.values[-1]


def ttt_forward(
    model: Eagle3Drafter,
    b: Batch,
    targets: Targets,
    steps: int,
    decay: float,
    checkpointing: bool = True,
    kernel: str = "chunked",
) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor]], list[Tensor]]:
    """The TTT unroll and its loss: (weighted loss, per-step (ce_sum, weight_sum, correct), per-step draft ids
    [B,T] in the draft vocab). With ``checkpointing`` (and gradients on) every step is re-run in backward.
    ``kernel``: the attention kernel (layers.attention_kernel); packed rows attend within their sequences."""
    T = b.row_valid.shape[1]
    B = b.row_valid.shape[0]
    device = b.aux.device
    dtype = _compute_dtype(device)
    chunk_rows = max(1, LOSS_CHUNK_ROWS // B)

    def run(fn, *args):
        if checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    layout = TTTLayout(kernel=kernel, seq_start=b.seq_start)  # one per batch: flex's block mask is built once
    hidden = run(model.project_aux, b.aux)  # [B,T,H] step 0: target features
    keys: list[Tensor] = []
    values: list[Tensor] = []
    total = torch.zeros((), device=device)
    stats, drafts = [], []
    for k in range(steps):
        w = step_weights(b, k, targets.ok)  # [B,T]

        def q_rows(r0: int, r1: int, k: int = k) -> Tensor:  # row t at step k is scored against q[t+1+k]
            return targets.rows(r0 + 1 + k, r1 + 1 + k)

        tokens = b.ids[:, 1 + k : 1 + k + T]  # token t+1+k at row t, at position t+k
        normed, hidden, key, value = run(
            _draft_step, model, hidden, tokens, b.position_ids + k, tuple(keys), tuple(values), layout
        )
        ce_sum, correct, draft = SoftCrossEntropy.apply(normed, model.lm_head.weight, q_rows, w, dtype, chunk_rows)
        keys.append(key)
        values.append(value)
        w_sum = w.sum()
        total = total + decay**k * ce_sum / w_sum.clamp_min(1.0)
        stats.append((ce_sum.detach(), w_sum, correct))
        drafts.append(draft)
    return total, stats, drafts


class TTTUnroll(nn.Module):
    """ttt_forward as a module: what DDP wraps (it averages the gradients of what runs inside its forward)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, kernel: str = "chunked"):
        super().__init__()
        self.drafter, self.steps, self.decay, self.kernel = drafter, steps, decay, kernel

    def forward(self, b: Batch, targets: Targets):
        return ttt_forward(self.drafter, b, targets, self.steps, self.decay, kernel=self.kernel)


def autocast(device: torch.device):
    # bf16 autocast on GPU; exact fp32 on CPU (deterministic, and CPU bf16 is slow).
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
