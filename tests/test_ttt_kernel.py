"""The memory-bounded TTT training path equals the plain composition it replaced (tests/ttt_reference.py).

* ``TTTAttention`` (chunked over query rows, recomputed in backward) vs the naive [T, T + k] attention: outputs and
  the gradients of q and every step's keys and values, GQA and MHA, several window lengths (not multiples of the
  chunk), chunk sizes and step counts;
* ``ttt_forward`` (checkpointed steps, chunked vocabulary loss, per-chunk soft targets) vs the naive unroll and
  loss: the loss, per-step statistics, draft tokens and every parameter's gradient, for both drafter kinds,
  both hidden layouts, padded batches and rows without a usable target.

Tolerances: fp32 (the CPU trainer) 1e-5 relative on the loss, 1e-4 relative on gradients with an absolute
floor of 1e-5 of the gradient tensor's largest entry (1e-6 for the attention alone): reordered sums only.
bf16 autocast (what the GPU trainer runs, here on CPU): 2e-2 relative on the loss, a gradient error under 2 %
of its norm (bf16 keeps 8 significant bits).
"""

from __future__ import annotations

import pytest
import torch
from ttt_reference import NaiveTTTCache, naive_forward

from aerie.drafter.config import TrainConfig
from aerie.drafter_kinds.batch import Batch
from aerie.drafter_kinds.eagle3 import layers, ttt
from aerie.drafter_kinds.eagle3.layers import TTTCache
from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
from aerie.drafter_kinds.eagle3.ttt import TargetHead, ttt_forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, VD, H, A = 96, 40, 32, 3  # target vocab, draft vocab, hidden, aux layers
KINDS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "mla": dict(
        attention="mla", num_attention_heads=4, num_key_value_heads=4, head_dim=12, q_lora_rank=16,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),
}  # fmt: skip


def drafter(kind: str, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=H, intermediate_size=48, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3], **KINDS[kind]
    )
    model = Eagle3Drafter(cfg)
    target_ids = torch.sort(torch.randperm(V)[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    model.set_vocab_maps(target_ids - torch.arange(VD), t2d)
    with torch.no_grad():  # lively enough that every path matters
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model


def batch(layout: str, T: int, steps: int, seed: int = 1) -> tuple[Batch, TargetHead]:
    """Two windows: the first T real rows, the second T - 3 (padding after), random loss masks and targets."""
    g = torch.Generator().manual_seed(seed)
    B, W = 2, T + steps + 2
    row_valid = torch.zeros(B, T, dtype=torch.bool)
    row_valid[0] = True
    row_valid[1, : max(1, T - 3)] = True
    gen = torch.rand(B, W, generator=g) < 0.7
    head_full = torch.randn(V, H, generator=g)
    final = topk_ids = topk_lp = None
    if layout == "full":
        final = torch.randn(B, W, H, generator=g)
    else:
        topk_ids = torch.stack([torch.randperm(V, generator=g)[:8] for _ in range(B * W)]).view(B, W, 8)
        topk_lp = torch.sort(torch.randn(B, W, 8, generator=g), dim=-1, descending=True).values.log_softmax(-1)
    b = Batch(
        aux=torch.randn(B, T, A * H, generator=g),
        position_ids=torch.arange(T).expand(B, T) + torch.tensor([[0], [5]]),
        row_valid=row_valid,
        ids=torch.randint(0, V, (B, W), generator=g),
        have=torch.ones(B, W, dtype=torch.bool),
        gen=gen,
        final=final,
        rows=int(row_valid.sum()),
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
    )
    return b, head_full


def target_head(model: Eagle3Drafter, layout: str, head_full: torch.Tensor) -> TargetHead:
    if layout == "full":
        return TargetHead(full=head_full, draft=head_full[model.t2d], t2d=model.t2d)
    return TargetHead(full=None, draft=None, t2d=model.t2d)


# ---------------------------------------------------------------------------------------------------------
# the attention kernel alone


def random_step_tensors(B: int, h: int, kvh: int, T: int, d: int, dv: int, steps: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(B, h, T, d, generator=g, dtype=torch.float32).to(dtype).requires_grad_() for _ in range(steps)]
    ks = [torch.randn(B, kvh, T, d, generator=g).to(dtype).requires_grad_() for _ in range(steps)]
    vs = [torch.randn(B, kvh, T, dv, generator=g).to(dtype).requires_grad_() for _ in range(steps)]
    return qs, ks, vs


def attend_all(cache, qs, ks, vs) -> list[torch.Tensor]:
    return [cache.attend(q, k, v) for q, k, v in zip(qs, ks, vs)]


@pytest.mark.parametrize(
    ("T", "chunk", "h", "kvh", "steps"),
    [(1, 4, 2, 2, 3), (5, 2, 4, 2, 4), (16, 16, 2, 1, 2), (37, 8, 4, 2, 3), (37, 5, 3, 3, 7), (40, 64, 4, 4, 1)],
)
def test_attention_equals_naive_outputs_and_gradients(T: int, chunk: int, h: int, kvh: int, steps: int) -> None:
    """Every step's output, and the gradients of q and of every step's keys and values, fp32."""
    qs, ks, vs = random_step_tensors(2, h, kvh, T, 8, 6, steps, torch.float32)
    ref = attend_all(NaiveTTTCache(), qs, ks, vs)
    new = attend_all(TTTCache(chunk_rows=chunk), qs, ks, vs)
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(9 + i)) for i, o in enumerate(ref)]
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, weights)), qs + ks + vs)
    new_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(new, weights)), qs + ks + vs)
    for r, n in zip(ref, new):
        torch.testing.assert_close(n, r, rtol=1e-5, atol=1e-6)
    for name, r, n in zip(["q"] * steps + ["k"] * steps + ["v"] * steps, ref_grads, new_grads):
        torch.testing.assert_close(n, r, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"d{name}: {m}")


def test_attention_bf16_within_bf16_tolerance() -> None:
    qs, ks, vs = random_step_tensors(1, 4, 2, 29, 16, 16, 3, torch.bfloat16)
    ref = attend_all(NaiveTTTCache(), qs, ks, vs)
    new = attend_all(TTTCache(chunk_rows=6), qs, ks, vs)
    assert all(o.dtype == torch.bfloat16 for o in new)
    ref_grads = torch.autograd.grad(sum(o.float().square().sum() for o in ref), qs + ks + vs)
    new_grads = torch.autograd.grad(sum(o.float().square().sum() for o in new), qs + ks + vs)
    for r, n in zip(ref + list(ref_grads), new + list(new_grads)):
        assert (n.float() - r.float()).norm() <= 0.02 * r.float().norm() + 1e-3


def test_attention_saves_no_score_matrix() -> None:
    """What TTTAttention keeps for backward is its inputs: nothing of size T x T."""
    qs, ks, vs = random_step_tensors(1, 2, 2, 64, 4, 4, 3, torch.float32)
    cache = TTTCache(chunk_rows=8)
    out = attend_all(cache, qs, ks, vs)[-1]
    saved = out.grad_fn.saved_tensors
    assert out.grad_fn.name().startswith("TTTAttention")
    assert all(t.numel() <= 2 * 64 * 4 for t in saved), [tuple(t.shape) for t in saved]


# ---------------------------------------------------------------------------------------------------------
# the whole training forward: unroll, loss, statistics, gradients


def run_both(model, b, head, cfg, steps, *, checkpointing=True, autocast_bf16=False):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else torch.autocast("cpu", enabled=False)
    params = [p for p in model.parameters() if p.requires_grad]
    with ctx:
        ref_loss, ref_stats, ref_drafts = naive_forward(model, b, head, cfg, steps)
    ref_grads = torch.autograd.grad(ref_loss, params)
    with ctx:
        loss, stats, drafts = ttt_forward(
            model, b, head.prepare(b, cfg.mask_out_of_vocab_targets), steps, cfg.step_loss_decay, checkpointing
        )
    grads = torch.autograd.grad(loss, params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return (ref_loss, ref_stats, ref_drafts, ref_grads), (loss, stats, drafts, grads), names


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize(("layout", "T", "steps", "attn_chunk", "loss_chunk"), [
    ("compact", 13, 3, 4, 10),  # 13 rows: neither chunk divides it
    ("full", 9, 7, 2, 6),
    ("compact", 1, 2, 1, 1),
    ("full", 24, 1, 24, 4096),
    ("compact", 37, 2, 8, 6),  # 3 loss rows a chunk, 16 a gradient block (H = 32, fp32, 2 windows): 3 blocks
])  # fmt: skip
def test_training_forward_equals_naive(kind, layout, T, steps, attn_chunk, loss_chunk, monkeypatch) -> None:
    monkeypatch.setattr(layers, "ATTENTION_CHUNK_ROWS", attn_chunk)
    monkeypatch.setattr(ttt, "LOSS_CHUNK_ROWS", loss_chunk)
    model = drafter(kind)
    b, head_full = batch(layout, T, steps)
    head = target_head(model, layout, head_full)
    cfg = TrainConfig.of(ttt_steps=steps)
    for checkpointing in (True, False):
        (rl, rs, rd, rg), (nl, ns, nd, ng), names = run_both(model, b, head, cfg, steps, checkpointing=checkpointing)
        torch.testing.assert_close(nl, rl, rtol=1e-5, atol=1e-6)
        for (rc, rw, rr), (nc, nw, nr) in zip(rs, ns):
            torch.testing.assert_close(nc, rc, rtol=1e-5, atol=1e-5)
            assert float(nw) == float(rw) and float(nr) == float(rr)
        for r, n in zip(rd, nd):
            assert torch.equal(r, n)
        for name, r, n in zip(names, rg, ng):
            atol = 1e-5 * float(r.abs().max())
            torch.testing.assert_close(n, r, rtol=1e-4, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_training_forward_bf16_autocast_within_tolerance(kind, monkeypatch) -> None:
    """The GPU trainer's dtype flow (bf16 autocast), run on the CPU: loss and gradients within bf16 tolerance."""
    monkeypatch.setattr(layers, "ATTENTION_CHUNK_ROWS", 5)
    monkeypatch.setattr(ttt, "LOSS_CHUNK_ROWS", 14)
    model = drafter(kind)
    b, head_full = batch("compact", 17, 3)
    head = target_head(model, "compact", head_full)
    (rl, _, _, rg), (nl, _, _, ng), names = run_both(model, b, head, TrainConfig.of(ttt_steps=3), 3, autocast_bf16=True)
    torch.testing.assert_close(nl, rl, rtol=2e-2, atol=1e-3)
    for name, r, n in zip(names, rg, ng):
        assert (n - r).norm() <= 0.02 * r.norm() + 1e-4, name


def test_lm_head_gradient_is_one_matmul_per_block_not_per_chunk(monkeypatch) -> None:
    """The loss's backward sums lm_head's gradient once per block of ~4H / itemsize rows (issue 29 item 4), not
    once per chunk of logits: 13 rows in chunks of 2 are 7 chunks but one block per TTT step."""
    monkeypatch.setattr(ttt, "LOSS_CHUNK_ROWS", 4)  # 2 rows per window per chunk
    calls = []
    real = ttt._mm_fp32
    monkeypatch.setattr(ttt, "_mm_fp32", lambda a, b: calls.append(a.shape) or real(a, b))
    model = drafter("llama")
    b, head_full = batch("full", 13, 3)
    cfg = TrainConfig.of(ttt_steps=3)
    loss, _, _ = ttt_forward(
        model,
        b,
        target_head(model, "full", head_full).prepare(b, cfg.mask_out_of_vocab_targets),
        3,
        cfg.step_loss_decay,
    )
    loss.backward()
    assert len(calls) == 3 and all(shape == (VD, 2 * 13) for shape in calls), calls  # one per step, all rows


def test_padding_rows_and_unusable_targets_carry_no_gradient(monkeypatch) -> None:
    """Rows that are padding or whose target is unusable change nothing: the loss ignores their logits."""
    monkeypatch.setattr(layers, "ATTENTION_CHUNK_ROWS", 3)
    model = drafter("llama")
    b, head_full = batch("full", 10, 2)
    head = target_head(model, "full", head_full)
    cfg = TrainConfig.of(ttt_steps=2)
    targets = head.prepare(b, cfg.mask_out_of_vocab_targets)
    loss, stats, _ = ttt_forward(model, b, targets, 2, cfg.step_loss_decay)
    # padding rows of window 1 (rows 7..9): new features there change neither the loss nor the stats
    b.aux[1, 7:] += 10.0
    loss2, stats2, _ = ttt_forward(model, b, targets, 2, cfg.step_loss_decay)
    torch.testing.assert_close(loss2, loss)
    assert [float(s[0]) for s in stats2] == pytest.approx([float(s[0]) for s in stats])
