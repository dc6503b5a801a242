"""DFlashProposer with aerie's speculative_generate on a tiny random transformers target: lossless (the output is
greedy decoding's), acceptance counted like SGLang's, the drafting mask is the training mask of one block, and a
drafter trained with the objective on the target's own greedy continuations gets acceptance well above 1."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.benchmark.speculative import Proposer, greedy_generate, speculative_generate
from aerie.drafter_kinds.dflash.drafting import DFlashProposer, drafting_mask
from aerie.drafter_kinds.dflash.model import DFlashDrafter
from aerie.drafter_kinds.dflash.objective import BlockLayout, DFlashBatch, dflash_loss, reference_mask
from aerie.drafter_kinds.dflash.shape import DFlashShape, capture_layer_ids
from aerie.target_model.capture import AuxHiddenCapture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, MASK, NEW = 300, 299, 30


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def shape_of(target, **change) -> DFlashShape:
    return DFlashShape.from_target(target.config, num_layers=2, block_size=4, mask_token_id=MASK, **change)


def proposer(target, drafter) -> DFlashProposer:
    return DFlashProposer(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, MASK, (1, n), generator=g) for n in (1, 7, 19)]


def check_accounting(res, k) -> None:
    assert sum(res.committed_per_step) == len(res.tokens) - 1
    assert all(0 <= a <= d <= k for a, d in zip(res.accepted_per_step, res.drafted_per_step))
    assert all(c == a + 1 or c <= a for a, c in zip(res.accepted_per_step, res.committed_per_step))
    assert res.acceptance_length == pytest.approx(sum(res.committed_per_step) / res.verify_steps)


@pytest.mark.parametrize("sliding", [None, 3])
def test_lossless_with_an_untrained_drafter(target, prompts, sliding) -> None:
    shape = shape_of(target, sliding_window=sliding)
    assert capture_layer_ids(shape, "LlamaForCausalLM") == [1, 3]
    torch.manual_seed(1)
    p = proposer(target, DFlashDrafter(shape).eval())
    assert isinstance(p, Proposer) and p.aux_layer_ids == [1, 3]
    for prompt in prompts:
        for k in (1, 3):  # fewer drafts than the block's B-1, and all of them
            res = speculative_generate(target, p, prompt, NEW, num_draft_steps=k)
            assert res.tokens == greedy_generate(target, prompt, NEW)
            check_accounting(res, k)


def test_the_drafting_mask_is_one_training_block() -> None:
    """A block anchored after C context positions sees, at drafting, what the training mask lets it see."""
    C, Bk = 9, 4
    layout = BlockLayout(
        anchors=torch.tensor([[C]]),
        keep=torch.tensor([[True]]),
        starts=torch.tensor([[0]]),
        block_size=Bk,
        context_len=C + 3,
    )
    for window in (None, 3, 6, 20):
        train = reference_mask(layout, window)[0, 0]  # [Bk, (C + 3) + Bk]
        draft = drafting_mask(C, Bk, window, torch.device("cpu"))[0, 0]  # [Bk, C + Bk]
        assert not train[:, C : C + 3].any()  # context at and after the anchor: never
        assert torch.equal(torch.cat([train[:, :C], train[:, C + 3 :]], 1), draft), window


def test_features_are_consumed_and_checked(target, prompts) -> None:
    p = proposer(target, DFlashDrafter(shape_of(target)).eval())
    tokens = prompts[1][0].tolist() + [5]
    with AuxHiddenCapture(target, p.aux_layer_ids) as cap, torch.no_grad():
        target(input_ids=prompts[1])
        aux = cap.aux_hidden_states()
    assert p.propose(tokens, aux, 0) == []  # shown, kept for the next call
    drafts = p.propose(tokens, aux[:, :0], 3)
    assert len(drafts) == 3 and len(p.cache) == len(tokens) - 1
    with pytest.raises(RuntimeError, match="out of sync"):
        p.propose(tokens + [6, 7], aux[:, :1], 3)
    with pytest.raises(ValueError, match="features"):
        p.propose(tokens, None, 3)


def test_a_trained_drafter_gets_accepted(target) -> None:
    """Trained with the objective on the target's greedy continuations of 8 prompts, the drafter proposes the
    continuation of one of them: the output stays greedy's and most drafts are accepted."""
    shape = shape_of(target)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, MASK, (1, 6), generator=g) for _ in range(8)]
    ids = torch.stack([torch.cat([p[0], torch.tensor(greedy_generate(target, p, NEW))]) for p in prompts])
    with AuxHiddenCapture(target, shape.target_layer_ids) as cap, torch.no_grad():
        target(input_ids=ids)
        features = cap.aux_hidden_states()
    loss_mask = torch.zeros(ids.shape)
    loss_mask[:, 6:] = 1
    batch = DFlashBatch(ids, loss_mask, features)
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    anchors = torch.Generator().manual_seed(0)
    for _ in range(100):
        out = dflash_loss(drafter, batch, embed_weight=embed, lm_head_weight=head, num_anchors=16, generator=anchors)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.acceptance().length > 3.0
    drafter.eval()
    untrained = DFlashDrafter(shape).eval()
    for prompt in prompts[:2]:
        res = speculative_generate(target, proposer(target, drafter), prompt, NEW, num_draft_steps=3)
        assert res.tokens == greedy_generate(target, prompt, NEW)
        check_accounting(res, 3)
        assert res.acceptance_length > 2.5
        before = speculative_generate(target, proposer(target, untrained), prompt, NEW, num_draft_steps=3)
        assert before.acceptance_length < 1.5
