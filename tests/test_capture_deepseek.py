"""Layer convention on Kimi K2.5's architecture (DeepseekV3: MLA attention, MoE, dense first layers)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from aerie.target_model.capture import AuxHiddenCapture
from aerie.target_model.config import default_aux_layer_ids


@pytest.fixture(scope="module")
def deepseek() -> DeepseekV3ForCausalLM:
    """A tiny DeepseekV3 with Kimi's structure: a dense first layer, then MoE layers with a shared expert."""
    cfg = DeepseekV3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(cfg).eval()


def test_aux_ids_are_decoder_layer_outputs_as_sglang_captures_them(deepseek) -> None:
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    layer_ids = default_aux_layer_ids(8)  # [1, 3, 4]: what SGLang captures for a drafter naming no ids
    with torch.no_grad():
        ref = deepseek(ids, output_hidden_states=True).hidden_states  # [0] = embeddings, [i + 1] = layer i
        with AuxHiddenCapture(deepseek, layer_ids) as cap:
            deepseek(ids)
            aux = cap.aux_hidden_states()
    assert aux.shape == (2, 19, 3 * 64)
    expected = torch.cat([ref[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(aux, expected, atol=0, rtol=0)
    # An off-by-one in either direction is a different tensor: the convention is not a matter of taste.
    for shift in (-1, 1):
        wrong = torch.cat([ref[i + 1 + shift] for i in layer_ids], dim=-1)
        assert (aux - wrong).abs().max() > 1e-3


def test_only_the_hooked_layers_are_kept_and_hooks_are_removed(deepseek) -> None:
    ids = torch.randint(0, 300, (1, 7))
    layers = deepseek.model.layers
    before = [len(layer._forward_hooks) for layer in layers]  # transformers may keep hooks of its own
    with torch.no_grad(), AuxHiddenCapture(deepseek, [0, 7]) as cap:
        during = [len(layer._forward_hooks) for layer in layers]
        deepseek(ids)
        assert sorted(cap._captured) == [0, 7]
    assert [d - b for d, b in zip(during, before)] == [1, 0, 0, 0, 0, 0, 0, 1]
    assert [len(layer._forward_hooks) for layer in layers] == before
