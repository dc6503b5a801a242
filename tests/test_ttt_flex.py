"""The CUDA attention path (aerie.drafter_kinds.eagle3.ttt_flex: flex attention over the step-0 keys, the diagonal
merged by
log-sum-exp) equals the chunked kernel (layers.TTTAttention, the CPU path and the reference), and both equal a
float64 composition - also at score magnitudes where a softmax without its row max overflows (exp(x) is inf in
fp32 once x > 88.7), and in packed rows (several sequences per row, each attending only to itself).

What runs here: flex attention eagerly and forward only (torch 2.13 has no CPU backward for it); the log-sum-exp
merge forward and backward with a plain-torch step-0 kernel that returns the same (output, log-sum-exp) pair;
the chunked kernel forward and backward. bench/gpu_check.py compares flex and chunked forward and backward on
a GPU.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from aerie.drafter_kinds.eagle3 import ttt_flex
from aerie.drafter_kinds.eagle3.layers import TTTCache, TTTLayout, attention_kernel, repeat_kv

pytestmark = pytest.mark.usefixtures("one_torch_thread")
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

# a packed second row: sequences of 10, 20 and 7 rows (the first row holds one sequence)
SEQ_START = torch.tensor([[0] * 37, [0] * 10 + [10] * 20 + [30] * 7])


def step_tensors(B, h, kvh, T, d, dv, steps, magnitude=1.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape, m=1.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * m).to(dtype)  # noqa: E731
    qs = [mk(B, h, T, d, m=magnitude) for _ in range(steps)]
    ks = [mk(B, kvh, T, d, m=magnitude) for _ in range(steps)]
    vs = [mk(B, kvh, T, dv) for _ in range(steps)]
    return qs, ks, vs


def exact(q, keys, values, seq_start):
    """float64 TTT attention of the last step in ``keys``: [B, h, T, dv], straight from the definition."""
    q, keys, values = q.double(), [k.double() for k in keys], [v.double() for v in values]
    B, h, T, d = q.shape
    rep = h // keys[0].shape[1]
    k0, v0 = repeat_kv(keys[0], rep), repeat_kv(values[0], rep)
    scores = q @ k0.transpose(-1, -2) / math.sqrt(d)
    rows, cols = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (cols <= rows)[None].expand(B, T, T)
    if seq_start is not None:
        allowed = allowed & (cols[None] >= seq_start[:, :, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    diag = [(q * repeat_kv(k, rep)).sum(-1, keepdim=True) / math.sqrt(d) for k in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], -1), -1)
    out = probs[..., :T] @ v0
    for j, v in enumerate(values[1:]):
        out = out + probs[..., T + j, None] * repeat_kv(v, rep)
    return out


def dense_step0(q, k0, v0, layout: TTTLayout):
    """The (out0, lse0) pair ttt_flex.step0_attention returns, in plain differentiable torch (the CPU stand-in for
    flex's backward)."""
    B, h, T, d = q.shape
    rep = h // k0.shape[1]
    scores = (q @ repeat_kv(k0, rep).transpose(-1, -2)) / math.sqrt(d)
    rows, cols = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (cols <= rows)[None].expand(B, T, T)
    if layout.seq_start is not None:
        allowed = allowed & (cols[None] >= layout.seq_start[:, :, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf")).float()
    return (torch.softmax(scores, -1).to(q.dtype) @ repeat_kv(v0, rep)), torch.logsumexp(scores, -1)


def run_cache(cache, qs, ks, vs):
    return [cache.attend(q, k, v) for q, k, v in zip(qs, ks, vs)]


CASES = [  # (h, kvh, T, d, dv, steps, magnitude)
    (4, 2, 37, 8, 6, 3, 1.0),
    (3, 3, 37, 12, 12, 4, 1.0),
    (4, 1, 37, 16, 8, 2, 12.0),  # scores with a spread of ~150: exp overflows in fp32 without the row max
]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("h", "kvh", "T", "d", "dv", "steps", "magnitude"), CASES)
def test_flex_forward_equals_chunked_and_exact(h, kvh, T, d, dv, steps, magnitude, packed) -> None:
    seq_start = SEQ_START if packed else None
    qs, ks, vs = step_tensors(2, h, kvh, T, d, dv, steps, magnitude, dtype=torch.float32)
    with torch.no_grad():
        chunked = run_cache(TTTCache(layout=TTTLayout(chunk_rows=8, seq_start=seq_start)), qs, ks, vs)
        flex = run_cache(TTTCache(layout=TTTLayout(kernel="flex", seq_start=seq_start)), qs, ks, vs)
    for s, (c, f) in enumerate(zip(chunked, flex)):
        ref = exact(qs[s], ks[: s + 1], vs[: s + 1], seq_start).float()
        assert torch.isfinite(f).all() and torch.isfinite(c).all()
        torch.testing.assert_close(c, ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(f, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("h", "kvh", "T", "d", "dv", "steps", "magnitude"), CASES)
def test_lse_merge_and_chunked_gradients_equal_exact(h, kvh, T, d, dv, steps, magnitude, packed, monkeypatch):
    """Outputs and the gradients of every step's q, keys and values: the log-sum-exp merge (over a dense step-0
    kernel, as flex gives it) and the chunked kernel against the float64 definition."""
    monkeypatch.setattr(ttt_flex, "step0_attention", dense_step0)
    seq_start = SEQ_START if packed else None
    qs, ks, vs = step_tensors(2, h, kvh, T, d, dv, steps, magnitude, dtype=torch.float32)
    leaves = [t.requires_grad_() for t in qs + ks + vs]
    weights = [torch.randn(2, h, T, dv, generator=torch.Generator().manual_seed(5 + s)) for s in range(steps)]
    ref = [exact(qs[s], ks[: s + 1], vs[: s + 1], seq_start) for s in range(steps)]
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, weights)), leaves)
    for layout in (TTTLayout(chunk_rows=8, seq_start=seq_start), TTTLayout(kernel="flex", seq_start=seq_start)):
        out = run_cache(TTTCache(layout=layout), qs, ks, vs)
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), leaves)
        for o, r in zip(out, ref):
            torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-5, msg=lambda m, k=layout.kernel: f"{k}: {m}")
        for g, r in zip(grads, ref_grads):
            assert torch.isfinite(g).all(), layout.kernel
            atol = 1e-5 * float(r.abs().max())
            torch.testing.assert_close(g, r, rtol=1e-4, atol=atol, msg=lambda m, k=layout.kernel: f"{k}: {m}")


def test_large_scores_in_fp32_stay_finite_and_exact() -> None:
    """fp32 (the CPU trainer) at a score spread of ~300: both kernels finite and equal to float64."""
    qs, ks, vs = step_tensors(1, 2, 2, 24, 8, 8, 3, magnitude=17.0, dtype=torch.float32, seed=3)
    leaves = [t.requires_grad_() for t in qs + ks + vs]
    out = run_cache(TTTCache(chunk_rows=5), qs, ks, vs)
    for s, o in enumerate(out):
        torch.testing.assert_close(o.double(), exact(qs[s], ks[: s + 1], vs[: s + 1], None), rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(sum(o.sum() for o in out), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        flex = run_cache(TTTCache(layout=TTTLayout(kernel="flex")), *[[t.detach() for t in ts] for ts in (qs, ks, vs)])
    for o, f in zip(out, flex):
        torch.testing.assert_close(f, o, rtol=1e-4, atol=1e-4)


def test_packed_rows_equal_each_sequence_alone() -> None:
    """A packed row's sequences attend only to themselves: each equals the same sequence in a row of its own."""
    qs, ks, vs = step_tensors(2, 4, 2, 37, 8, 6, 3, dtype=torch.float32)
    with torch.no_grad():
        for kernel in ("chunked", "flex"):
            packed = run_cache(TTTCache(layout=TTTLayout(kernel=kernel, chunk_rows=8, seq_start=SEQ_START)), qs, ks, vs)
            for a, e in [(0, 10), (10, 30), (30, 37)]:
                alone = run_cache(
                    TTTCache(layout=TTTLayout(kernel=kernel, chunk_rows=8)),
                    *[[t[1:, :, a:e] for t in ts] for ts in (qs, ks, vs)],
                )
                for p, s in zip(packed, alone):
                    torch.testing.assert_close(p[1:, :, a:e], s, rtol=1e-5, atol=1e-6)


def test_kernel_choice() -> None:
    assert attention_kernel("auto", torch.device("cpu")) == "chunked"
    assert attention_kernel("auto", torch.device("cuda", 0)) == "flex"
    assert attention_kernel("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="attention kernel"):
        attention_kernel("flash", torch.device("cpu"))
