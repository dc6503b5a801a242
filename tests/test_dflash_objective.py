"""The DFlash objective: anchors, the attention mask, labels/weights, the loss and its gradients, acceptance.

The oracle is each block run ALONE: its own sequence's context strictly before its anchor, positions counted from
its sequence's start, and a mask written here from positions only (full layers: every key; sliding layers: keys at
positions p-W+1..p). The batched paths must equal it - the reference kernel in outputs and float64 gradients, the
flex kernel in outputs (CPU flex: forward only) - so a block that sees another block, its own anchor's feature or
later context, or a neighbouring sequence of a packed row fails. The negative tests break the mask in each of those
ways and check the comparison catches it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aerie.drafter_kinds.dflash.model import DFlashDrafter
from aerie.drafter_kinds.dflash.objective import (
    DFlashBatch,
    block_inputs,
    dflash_loss,
    flex_mask,
    reference_mask,
    sample_anchors,
    simulated_acceptance,
)
from aerie.drafter_kinds.dflash.shape import DFlashShape

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

SHAPE = DFlashShape(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=60,
    num_target_layers=8,
    target_layer_ids=(1, 3, 5),
    block_size=4,
    mask_token_id=59,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=5,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
)
B, T, W, BK = 2, 22, 5, 4
SEQ_START = torch.tensor([[0] * 10 + [10] * 12, [0] * 22])  # row 0 packs two sequences (rows 0-9, 10-21)
LOSS_MASK = torch.tensor(
    [
        [0, 0, 0] + [1] * 7 + [0, 0, 0] + [1] * 9,
        [0] * 5 + [1] * 9 + [0] + [1] * 7,  # a gap at row 14: a turn the target did not generate
    ],
    dtype=torch.float64,
)


def world(dtype=torch.float64):
    torch.manual_seed(0)
    m = DFlashDrafter(SHAPE).to(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    batch = DFlashBatch(
        input_ids=torch.randint(0, 59, (B, T), generator=g),
        loss_mask=LOSS_MASK.clone(),
        target_features=torch.randn(B, T, 96, generator=g, dtype=torch.float64).to(dtype),
        seq_start=SEQ_START.clone(),
    )
    embed = (torch.randn(60, 32, generator=g, dtype=torch.float64) * 2).to(dtype)
    head = (torch.randn(60, 32, generator=g, dtype=torch.float64) * 2).to(dtype)
    return m, batch, embed, head


def layout_of(batch, seed=0, num_anchors=6):
    return sample_anchors(batch.loss_mask, batch.seq_start, num_anchors, BK, torch.Generator().manual_seed(seed))


def real_blocks(layout):
    return [(b, j) for b in range(B) for j in range(layout.num_blocks) if layout.keep[b, j]]


def batched_hidden(m, batch, embed, layout, masks=None, kernel="reference"):
    """The batched forward (as dflash_loss runs it): [B, N, Bk, H]."""
    ids, positions = block_inputs(layout, batch.input_ids, SHAPE.mask_token_id)
    build = reference_mask if kernel == "reference" else flex_mask
    masks = masks or {t: build(layout, SHAPE.window_of(t)) for t in set(SHAPE.layer_types)}
    context_positions = torch.arange(T) - batch.seq_start
    embeds = F.embedding(ids, embed)
    hidden = m(
        embeds, positions, masks, context=m.project_context(batch.target_features), context_positions=context_positions
    )
    return hidden.view(B, layout.num_blocks, BK, -1)


def block_alone(m, batch, embed, b, anchor):
    """The oracle: one block with only its own sequence's context before its anchor. [Bk, H]"""
    start = int(batch.seq_start[b, anchor])
    C = anchor - start
    ctx_positions = torch.arange(C)[None]
    positions = torch.arange(C, C + BK)[None]
    ids = torch.tensor([[int(batch.input_ids[b, anchor])] + [SHAPE.mask_token_id] * (BK - 1)])
    every = torch.cat([ctx_positions, positions], 1)[0]
    q = positions[0][:, None]
    masks = {
        "full_attention": torch.ones(1, 1, BK, C + BK, dtype=torch.bool),
        "sliding_attention": ((every[None] <= q) & (every[None] > q - W))[None, None],
    }
    context = m.project_context(batch.target_features[b : b + 1, start:anchor])
    embeds = F.embedding(ids, embed)
    return m(embeds, positions, masks, context=context, context_positions=ctx_positions)[0]


def mismatching(m, batch, embed, layout, masks=None, kernel="reference", tol=1e-9):
    """The real blocks whose batched hidden states differ from the block run alone."""
    with torch.no_grad():
        hidden = batched_hidden(m, batch, embed, layout, masks, kernel)
        return [
            (b, j)
            for b, j in real_blocks(layout)
            if not torch.allclose(
                hidden[b, j], block_alone(m, batch, embed, b, int(layout.anchors[b, j])), rtol=tol, atol=tol
            )
        ]


# ---- anchors -------------------------------------------------------------------------------------------------------


def test_anchors_follow_the_rules() -> None:
    _, batch, _, _ = world()
    lay = layout_of(batch, num_anchors=3)
    per_sequence = {}
    for b, j in real_blocks(lay):
        t = int(lay.anchors[b, j])
        start = int(SEQ_START[b, t])
        assert LOSS_MASK[b, t] and LOSS_MASK[b, t + 1] and SEQ_START[b, t + 1] == start  # inside one sequence
        assert int(lay.starts[b, j]) == start
        per_sequence.setdefault((b, start), []).append(t)
    assert sorted(per_sequence) == [(0, 0), (0, 10), (1, 0)]
    assert all(len(ts) == 3 for ts in per_sequence.values())
    for b in range(B):  # sorted per row
        row = lay.anchors[b][lay.keep[b]].tolist()
        assert row == sorted(row)
    assert 13 not in lay.anchors[1][lay.keep[1]].tolist()  # row 14 is unsupervised: 13 is no anchor
    everything = layout_of(batch, num_anchors=100)  # all valid anchors: counted exactly
    assert everything.keep.sum(1).tolist() == [6 + 8, 8 + 6]
    assert torch.equal(layout_of(batch, seed=5).anchors, layout_of(batch, seed=5).anchors)
    assert any(not torch.equal(layout_of(batch, seed=s).anchors, layout_of(batch, seed=0).anchors) for s in (1, 2, 3))
    with pytest.raises(ValueError, match="no anchor"):
        sample_anchors(torch.zeros(1, 8), None, 4, BK, torch.Generator())


def test_block_inputs_restart_positions_per_sequence() -> None:
    _, batch, _, _ = world()
    lay = layout_of(batch)
    ids, positions = block_inputs(lay, batch.input_ids, 59)
    ids, positions = ids.view(B, -1, BK), positions.view(B, -1, BK)
    for b, j in real_blocks(lay):
        t = int(lay.anchors[b, j])
        assert ids[b, j].tolist() == [int(batch.input_ids[b, t]), 59, 59, 59]
        assert positions[b, j].tolist() == [t - int(SEQ_START[b, t]) + k for k in range(BK)]
    dead = ~lay.keep
    assert (ids[dead] == 59).all()


# ---- the mask --------------------------------------------------------------------------------------------------------


def test_the_reference_path_equals_each_block_alone() -> None:
    m, batch, embed, _ = world()
    lay = layout_of(batch)
    assert len(real_blocks(lay)) >= 10 and mismatching(m, batch, embed, lay) == []


def test_the_flex_path_equals_the_reference_and_each_block_alone() -> None:
    m, batch, embed, _ = world(torch.float32)
    lay = layout_of(batch)
    with torch.no_grad():
        ref = batched_hidden(m, batch, embed, lay)
        flex = batched_hidden(m, batch, embed, lay, kernel="flex")
    torch.testing.assert_close(flex[lay.keep], ref[lay.keep], rtol=1e-5, atol=1e-5)
    assert mismatching(m, batch, embed, lay, kernel="flex", tol=1e-4) == []


def _broken(lay, how: str):
    """The reference masks with one rule broken, and the block it must show up in."""
    masks = {t: reference_mask(lay, SHAPE.window_of(t)).clone() for t in set(SHAPE.layer_types)}
    blocks = real_blocks(lay)
    q = lambda j: slice(j * BK, (j + 1) * BK)  # noqa: E731 - a block's query rows
    kv = lambda j: slice(T + j * BK, T + (j + 1) * BK)  # noqa: E731 - a block's key columns
    if how == "sees another block":
        b, j = blocks[1]
        for mk in masks.values():
            mk[b, 0, q(j), kv(j - 1)] = True
    elif how == "sees its own anchor's feature":
        b, j = next((b, j) for b, j in blocks if lay.anchors[b, j] - lay.starts[b, j] >= 2)
        for mk in masks.values():
            mk[b, 0, q(j), int(lay.anchors[b, j])] = True
    elif how == "sees later context":
        b, j = blocks[0]
        for mk in masks.values():
            mk[b, 0, q(j), int(lay.anchors[b, j]) + 2] = True
    elif how == "crosses a packed sequence boundary":
        b, j = next((0, j) for bb, j in blocks if bb == 0 and lay.starts[0, j] == 10)
        masks["full_attention"][b, 0, q(j), 5:10] = True
    elif how == "slides bidirectionally":
        b, j = blocks[0]
        masks["sliding_attention"][b, 0, q(j), kv(j)] = True
    elif how == "attends causally in a full layer":
        b, j = blocks[0]
        masks["full_attention"][b, 0, q(j), kv(j)] = torch.tril(torch.ones(BK, BK, dtype=torch.bool))
    elif how == "ignores the window":
        b, j = next((b, j) for b, j in blocks if lay.anchors[b, j] - lay.starts[b, j] >= W + 1)
        masks["sliding_attention"][b, 0, q(j), int(lay.starts[b, j]) : int(lay.anchors[b, j])] = True
    return masks, (b, j)


@pytest.mark.parametrize(
    "how",
    [
        "sees another block",
        "sees its own anchor's feature",
        "sees later context",
        "crosses a packed sequence boundary",
        "slides bidirectionally",
        "attends causally in a full layer",
        "ignores the window",
    ],
)
def test_a_wrong_mask_gives_different_numbers(how) -> None:
    m, batch, embed, _ = world()
    lay = layout_of(batch, num_anchors=100)
    masks, block = _broken(lay, how)
    assert block in mismatching(m, batch, embed, lay, masks)


# ---- the loss ----------------------------------------------------------------------------------------------------


def oracle_loss(m, batch, embed, lay, head, gamma):
    """Sum over blocks (each alone) of the weighted cross-entropies, over the summed weights; labels and weights
    written out from the rows. Also the argmax hits per block."""
    num, den, hits = 0.0, 0.0, []
    for b, j in real_blocks(lay):
        t = int(lay.anchors[b, j])
        end = int((SEQ_START[b] == SEQ_START[b, t]).nonzero().max()) + 1  # the sequence's last row + 1
        logits = block_alone(m, batch, embed, b, t)[1:] @ head.T  # slots 1..Bk-1
        row_hits = []
        for k in range(1, BK):
            valid = t + k < end and bool(LOSS_MASK[b, t + k])
            if not valid:
                row_hits.append(False)
                continue
            label = int(batch.input_ids[b, t + k])
            w = math.exp(-(k - 1) / gamma)
            num = num + w * F.cross_entropy(logits[k - 1][None], torch.tensor([label]))
            den += w
            row_hits.append(int(logits[k - 1].argmax()) == label)
        hits.append(row_hits)
    return num / den, torch.tensor(hits)


@pytest.mark.parametrize(("gamma", "chunk", "checkpointed"), [(None, 64, False), (3.0, 1, True)])
def test_loss_and_gradients_equal_the_per_block_float64_recomputation(gamma, chunk, checkpointed) -> None:
    m, batch, embed, head = world()
    batch.target_features.requires_grad_()
    out = dflash_loss(
        m,
        batch,
        embed_weight=embed,
        lm_head_weight=head,
        num_anchors=6,
        generator=torch.Generator().manual_seed(0),
        gamma=gamma,
        loss_chunk_blocks=chunk,
        checkpoint_layers=checkpointed,
    )
    leaves = [*m.parameters(), batch.target_features]
    grads = torch.autograd.grad(out.loss, leaves)
    ref, hits = oracle_loss(m, batch, embed, layout_of(batch), head, gamma or 2.0)  # block 4: the default gamma is 2
    ref_grads = torch.autograd.grad(ref, leaves)
    torch.testing.assert_close(out.loss, ref.to(out.loss.dtype), rtol=1e-9, atol=1e-9)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-9)
    assert torch.equal(out.block_correct, hits)
    valid = out.block_valid
    assert out.slot_count.tolist() == valid.sum(0).double().tolist()
    assert 0 < out.slot_count[0] and out.slot_count[-1] < out.slot_count[0]  # late slots run out of sequence
    assert len(out.slot_loss()) == BK - 1 and all(x > 0 for x in out.slot_loss())


def test_flex_loss_equals_the_reference_loss() -> None:
    m, batch, embed, head = world(torch.float32)
    losses = []
    for kernel in ("reference", "flex"):
        with torch.no_grad():
            out = dflash_loss(
                m,
                batch,
                embed_weight=embed,
                lm_head_weight=head,
                num_anchors=6,
                generator=torch.Generator().manual_seed(0),
                kernel=kernel,
            )
        losses.append(out.loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kernel"):
        dflash_loss(
            m, batch, embed_weight=embed, lm_head_weight=head, num_anchors=2, generator=torch.Generator(), kernel="x"
        )


# ---- acceptance --------------------------------------------------------------------------------------------------


def test_simulated_acceptance_counts_like_sglang() -> None:
    correct = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    acc = simulated_acceptance(correct)
    assert acc.blocks == 4
    assert acc.length == pytest.approx((2 + 0 + 3 + 1) / 4 + 1)  # leading correct drafts + the target's token
    assert acc.per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    assert simulated_acceptance(correct, valid).length == pytest.approx((2 + 0 + 1 + 1) / 4 + 1)
    assert simulated_acceptance(torch.zeros(0, 3, dtype=torch.bool)).length is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex attention and its backward need CUDA")
def test_on_cuda_flex_gradients_equal_the_reference() -> None:
    """The training path on a GPU: compiled flex attention (forward and backward) against the dense reference."""
    m, batch, embed, head = world(torch.float32)
    m, embed, head = m.cuda(), embed.cuda(), head.cuda()
    batch = DFlashBatch(*(t.cuda() for t in (batch.input_ids, batch.loss_mask, batch.target_features, batch.seq_start)))
    results = []
    for kernel in ("reference", "flex"):
        out = dflash_loss(
            m,
            batch,
            embed_weight=embed,
            lm_head_weight=head,
            num_anchors=6,
            generator=torch.Generator().manual_seed(0),
            kernel=kernel,
        )
        results.append((out.loss, torch.autograd.grad(out.loss, list(m.parameters()))))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-4)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
