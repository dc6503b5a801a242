"""Building blocks both drafter kinds share: RMSNorm, neox RoPE, the dense SwiGLU MLP, and the two attention
caches (``DrafterKVCache`` for decoding, ``TTTCache`` for the training-time-test unroll)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aerie.drafter_kinds.eagle3.ttt_flex import (
    flex_ttt_attention,  # torch.nn.attention.flex_attention: CUDA path
)

if TYPE_CHECKING:
    pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 (bf16 squares lose too much), scale in the input dtype - as SGLang's RMSNorm.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, head_dim] for neox-style (rotate-half) RoPE, computed in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
    return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, kvh, S, d] -> [B, kvh * n_rep, S, d] (grouped-query attention)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class DrafterKVCache:
    """Inference-time cache of the drafter's single attention layer: roped keys and values, [B, kvh, S, d]."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (drop rejected drafts)."""
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Append the new keys; new queries see every cached position and, causally, each other."""
        past = len(self)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        n_rep = q.shape[1] // k.shape[1]
        new, total = q.shape[2], self.keys.shape[2]
        # query i (absolute past + i) may read key j iff j <= past + i
        mask = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(new, device=q.device))[:, None]
        return F.scaled_dot_product_attention(
            q, repeat_kv(self.keys, n_rep), repeat_kv(self.values, n_rep), attn_mask=mask
        )


# Query rows per chunk of the TTT attention: a chunk's score block is [B, heads, ATTENTION_CHUNK_ROWS, T + steps],
# so the attention's working set grows linearly with the window (at Kimi's 64 heads: 16 KiB per window row per
# fp32 copy). aerie.drafter_kinds.eagle3.memory reads it.
ATTENTION_CHUNK_ROWS = 64


class TTTAttention(torch.autograd.Function):
    """Softmax attention of the TTT unroll's step s, computed in chunks of query rows and never kept.

    Inputs: q [B, h, T, d]; the step-0 keys/values k0 [B, kvh, T, d], v0 [B, kvh, T, dv]; the diagonal keys/
    values of steps 1..s, each [B, kvh, T, d] / [B, kvh, T, dv] (GQA: query head i reads kv head i // (h/kvh)).
    Query row t attends to step-0 keys 0..t and to row t of each diagonal key (its own chain's earlier drafts);
    with ``seq_start`` [B, T] (packed windows) only to step-0 keys seq_start[t]..t, its own sequence's.

    Why this kernel: the reference (tests/ttt_reference.py) builds [B, h, T, T + s] scores and keeps their fp32
    softmax and a copy for backward: quadratic in T. Here each chunk of C query rows builds its [B, h, C, e + s]
    scores (e = the chunk's last row + 1: keys beyond it are masked anyway), takes the exact softmax over the
    whole row (no online rescaling: the row's keys are all in the block, so the numbers are the reference's),
    and keeps nothing: backward recomputes each chunk's probabilities from the saved inputs (which the cache
    holds anyway) and applies the softmax gradient. Memory is O(T) saved + one chunk's block; the work is the
    reference's minus the masked upper triangle. It runs the same on CPU and CUDA with plain matmuls: the CPU
    trainer's kernel and the reference of the CUDA one (aerie.drafter_kinds.eagle3.ttt_flex: torch 2.13's flex attention
    has no
    CPU backward, and its eager path materialises the full score matrix).

    Dtypes follow the reference: scores and the probability-weighted sums in the inputs' dtype (bf16 under
    autocast), the softmax and its gradient in fp32; the step-0 key/value gradients (one term per chunk) accumulate
    in fp32.
    """

    @staticmethod
    def forward(ctx, chunk_rows: int, seq_start: Tensor | None, q: Tensor, k0: Tensor, v0: Tensor, *diagonal: Tensor):
        s = len(diagonal) // 2
        ks, vs = diagonal[:s], diagonal[s:]
        B, h, T, _ = q.shape
        out = q.new_empty(B, h, T, v0.shape[-1])
        for a, e, lo, probs in _ttt_chunks(q, k0, ks, chunk_rows, seq_start):
            pd = probs.to(q.dtype)  # [B, kvh, g, C, n + s], n = e - lo step-0 keys
            C, n, kvh, g = e - a, e - lo, k0.shape[1], h // k0.shape[1]
            o = (pd[..., :n].reshape(B, kvh, g * C, n) @ v0[:, :, lo:e]).view(B, kvh, g, C, -1)
            for j, vj in enumerate(vs):
                o = o + pd[..., n + j, None] * vj[:, :, None, a:e]
            out[:, :, a:e] = o.view(B, h, C, -1)
        ctx.chunk_rows, ctx.seq_start = chunk_rows, seq_start
        ctx.save_for_backward(q, k0, v0, *diagonal)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k0, v0, *diagonal = ctx.saved_tensors
        s = len(diagonal) // 2
        ks, vs = diagonal[:s], diagonal[s:]
        B, h, T, d = q.shape
        kvh, dt = k0.shape[1], q.dtype
        g = h // kvh
        scale = 1.0 / math.sqrt(d)
        dq = torch.empty_like(q)
        dk0, dv0 = (
            torch.zeros(k0.shape, dtype=torch.float32, device=q.device),
            torch.zeros_like(v0, dtype=torch.float32),
        )
        # a diagonal key/value row gets one contribution (its own query row): written once, in the inputs' dtype
        dks = [torch.empty_like(k) for k in ks]
        dvs = [torch.empty_like(v) for v in vs]
        for a, e, lo, probs in _ttt_chunks(q, k0, ks, ctx.chunk_rows, ctx.seq_start):
            C, n = e - a, e - lo
            pd = probs.to(dt)
            go = grad_out[:, :, a:e].reshape(B, kvh, g, C, -1)  # [B, kvh, g, C, dv]
            go_rows = go.reshape(B, kvh, g * C, -1)
            # gradients of the probability-weighted sums (in the inputs' dtype, as the reference's matmuls)
            dpd = [(go_rows @ v0[:, :, lo:e].transpose(-1, -2)).view(B, kvh, g, C, n)]
            dv0[:, :, lo:e] += (pd[..., :n].reshape(B, kvh, g * C, n).transpose(-1, -2) @ go_rows).float()
            for j, vj in enumerate(vs):
                dpd.append((go * vj[:, :, None, a:e]).sum(-1, keepdim=True))
                dvs[j][:, :, a:e] = (pd[..., n + j, None] * go).sum(2)
            dp = torch.cat(dpd, dim=-1).float()
            ds = (probs * (dp - (probs * dp).sum(-1, keepdim=True))).to(dt) * scale  # softmax backward, then scale
            qc = q[:, :, a:e].reshape(B, kvh, g, C, d)
            dqc = (ds[..., :n].reshape(B, kvh, g * C, n) @ k0[:, :, lo:e]).view(B, kvh, g, C, d)
            dk0[:, :, lo:e] += (
                ds[..., :n].reshape(B, kvh, g * C, n).transpose(-1, -2) @ qc.reshape(B, kvh, g * C, d)
            ).float()
            for j, kj in enumerate(ks):
                dqc = dqc + ds[..., n + j, None] * kj[:, :, None, a:e]
                dks[j][:, :, a:e] = (ds[..., n + j, None] * qc).sum(2)
            dq[:, :, a:e] = dqc.view(B, h, C, d)
        return (None, None, dq, dk0.to(dt), dv0.to(dt), *dks, *dvs)


def _ttt_chunks(
    q: Tensor, k0: Tensor, ks: tuple[Tensor, ...] | list[Tensor], chunk_rows: int, seq_start: Tensor | None = None
):
    """Yield (first row a, end row e, first key lo, fp32 probabilities [B, kvh, g, C, e - lo + s]) per chunk of
    query rows: the softmax over [step-0 keys lo..e-1 (causal, and within the row's own sequence when
    ``seq_start`` [B, T] says where each row's sequence starts in a packed window) | the row's diagonal keys].
    ``lo`` is the earliest sequence start among the chunk's rows (0 without packing): keys before it are masked for
    every row, so they are not computed - a packed window costs the sum of its sequences' squares, not its own."""
    B, h, T, d = q.shape
    kvh = k0.shape[1]
    g = h // kvh
    scale = 1.0 / math.sqrt(d)
    # a row's sequence start never decreases along the window: a chunk's earliest is at its first row (one sync)
    firsts = [0] * T if seq_start is None else seq_start[:, ::chunk_rows].amin(0).tolist()
    for i, a in enumerate(range(0, T, chunk_rows)):
        e = min(T, a + chunk_rows)
        C, lo = e - a, int(firsts[i])
        qc = q[:, :, a:e].reshape(B, kvh, g, C, d)
        keys = k0[:, :, lo:e].transpose(-1, -2)
        scores = (qc.reshape(B, kvh, g * C, d) @ keys).view(B, kvh, g, C, e - lo) * scale
        key_rows = torch.arange(lo, e, device=q.device)
        allowed = key_rows[None, :] <= torch.arange(a, e, device=q.device)[:, None]  # [C, e - lo] causal
        if seq_start is not None:  # and within the row's own sequence: [B, 1, 1, C, e - lo]
            allowed = (allowed & (key_rows[None, None, :] >= seq_start[:, a:e, None]))[:, None, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        diag = [(qc * kj[:, :, None, a:e]).sum(-1, keepdim=True) * scale for kj in ks]  # [B, kvh, g, C, 1]
        yield a, e, lo, torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1)


def attention_kernel(setting: str, device: torch.device) -> str:
    """The TTT attention kernel a run uses: ``flex`` (compiled flex attention with a block mask, merged with the
    diagonal by log-sum-exp: aerie.drafter_kinds.eagle3.ttt_flex) on CUDA, ``chunked`` (TTTAttention: the CPU path and
    the
    reference) elsewhere; ``drafter.attention_kernel`` may force either (flex on the CPU runs eagerly, forward
    only: torch 2.13 has no CPU backward for it)."""
    if setting not in ("auto", "chunked", "flex"):
        raise ValueError(f"attention kernel must be auto, chunked or flex, not {setting!r}")
    if setting != "auto":
        return setting
    return "flex" if device.type == "cuda" else "chunked"


@dataclass
class TTTLayout:
    """How one batch's rows attend in the TTT unroll, built once per batch and shared by its steps: the kernel
    (``chunked`` or ``flex``), the chunked kernel's query rows per chunk, and for packed windows (several
    sequences in one window row) ``seq_start`` [B, T]: the window row where each row's sequence starts (a row
    attends to step-0 keys of its own sequence only). ``block_mask`` is flex's mask, made on first use."""

    kernel: str = "chunked"
    chunk_rows: int = 0  # 0: ATTENTION_CHUNK_ROWS (read when attending)
    seq_start: Tensor | None = None
    block_mask: object = field(default=None, repr=False)


class TTTCache:
    """Keys/values of one training-time-test unroll over whole sequences.

    Step 0 runs over all rows with causal attention. Step k >= 1 at row t is the k-th chained draft after a
    prefix ending at row t, so at inference it sees the step-0 keys of rows <= t plus its *own row's* keys
    from steps 1..k (the earlier drafts in its chain) - never other rows' later-step keys. ``layout`` (TTTLayout)
    says which kernel computes it (``TTTAttention`` in chunks of query rows, or flex attention) and, in packed
    windows, where each row's sequence starts; ``chunk_rows`` alone sets the chunked kernel's chunk.

    The cache holds one [B, kvh, T, d] key and value per step, made contiguous so that a value that is a view
    of a wider projection (MLA's [k_nope | value]) does not keep the rest alive. Construct it from earlier
    steps' tensors (``keys``, ``values``) to run one step on its own (activation checkpointing re-runs a step).
    """

    def __init__(
        self,
        keys: list[Tensor] | None = None,
        values: list[Tensor] | None = None,
        chunk_rows: int | None = None,
        layout: TTTLayout | None = None,
    ):
        self.keys: list[Tensor] = list(keys or [])  # per step [B, kvh, T, d]
        self.values: list[Tensor] = list(values or [])
        self.layout = layout or TTTLayout(chunk_rows=chunk_rows or 0)

    def __len__(self) -> int:
        return len(self.keys)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k.contiguous())
        self.values.append(v.contiguous())
        lay = self.layout
        if lay.kernel == "flex":
            return flex_ttt_attention(q, self.keys[0], self.values[0], self.keys[1:], self.values[1:], lay)
        return TTTAttention.apply(
            lay.chunk_rows or ATTENTION_CHUNK_ROWS,
            lay.seq_start,
            q,
            self.keys[0],
            self.values[0],
            *self.keys[1:],
            *self.values[1:],
        )
