"""The DFlash drafter's math and names.

* its state_dict is exactly folder.expected_tensor_shapes (the names SGLang's load_weights reads: test_dflash_export);
* without context and with a causal mask it is transformers' Qwen3Model (plain RoPE and YaRN) on the same weights;
* with context, every layer equals a float64 composition written out here from the served contract: the context is
  hidden_norm(fc(features)), projected by each layer's k/v (no input_layernorm), k_norm'd and roped at its own
  positions, and read before the block's keys;
* the drafting cache equals the training path; activation checkpointing changes no gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3Model

from aerie.drafter_kinds.dflash.folder import expected_tensor_shapes
from aerie.drafter_kinds.dflash.model import DFlashContextCache, DFlashDrafter
from aerie.drafter_kinds.dflash.rotary import rotary_amplitude, rotary_inv_freq
from aerie.drafter_kinds.dflash.shape import DFlashShape

pytestmark = pytest.mark.usefixtures("one_torch_thread")

YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}


def tiny(**change) -> DFlashShape:
    fields = dict(
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=80,
        vocab_size=100,
        num_target_layers=8,
        target_layer_ids=(1, 3, 5),
        block_size=4,
        mask_token_id=99,
        rope_theta=10000.0,
        max_position_embeddings=512,
    )
    return DFlashShape(**{**fields, **change})


def drafter(shape: DFlashShape, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    m = DFlashDrafter(shape).double()
    with torch.no_grad():  # norms away from 1, so a missing or misplaced norm shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def test_state_dict_is_the_expected_tensors() -> None:
    shape = tiny()
    state = DFlashDrafter(shape).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_tensor_shapes(shape)


@pytest.mark.parametrize("scaling", [None, YARN])
def test_without_context_it_is_transformers_qwen3(scaling) -> None:
    shape = tiny(rope_scaling=scaling)
    m = drafter(shape)
    rope = {"rope_type": "default", "rope_theta": 10000.0} if scaling is None else {**scaling, "rope_theta": 10000.0}
    cfg = Qwen3Config(
        vocab_size=100,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=rope,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    ref = Qwen3Model(cfg).double().eval()
    result = ref.load_state_dict(m.state_dict(), strict=False)
    assert result.missing_keys == ["embed_tokens.weight"]
    assert sorted(result.unexpected_keys) == ["fc.weight", "hidden_norm.weight"]
    x = torch.randn(2, 9, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9)[None].repeat(2, 1) + torch.tensor([[0], [37]])
    causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None, None]
    empty = DFlashContextCache()
    empty.keys = empty.values = [torch.zeros(2, 2, 0, 16, dtype=torch.float64)] * 2
    with torch.no_grad():
        ours = m(x, positions, {"full_attention": causal}, cache=empty)
        theirs = ref(inputs_embeds=x, position_ids=positions).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, shape):
    """x [B, heads, T, d] rotated (neox) at positions [B, T], float64."""
    inv = rotary_inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling).double()
    angle = positions.double()[:, None, :, None] * inv
    amp = rotary_amplitude(shape.rope_scaling)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1) * amp


def layer_by_hand(layer, shape, x, positions, ctx, ctx_positions, mask):
    """One decoder layer, written out: the served contract in float64."""
    a, eps = layer.self_attn, shape.rms_norm_eps
    B, Q, _ = x.shape
    C = ctx.shape[1]
    h, kvh, d = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    n = _rms(x, layer.input_layernorm.weight, eps)
    q = _rms((n @ a.q_proj.weight.T).view(B, Q, h, d), a.q_norm.weight, eps).transpose(1, 2)
    k_blk = _rms((n @ a.k_proj.weight.T).view(B, Q, kvh, d), a.k_norm.weight, eps).transpose(1, 2)
    v_blk = (n @ a.v_proj.weight.T).view(B, Q, kvh, d).transpose(1, 2)
    k_ctx = _rms((ctx @ a.k_proj.weight.T).view(B, C, kvh, d), a.k_norm.weight, eps).transpose(1, 2)
    v_ctx = (ctx @ a.v_proj.weight.T).view(B, C, kvh, d).transpose(1, 2)
    q = _rope(q, positions, shape)
    keys = torch.cat([_rope(k_ctx, ctx_positions, shape), _rope(k_blk, positions, shape)], 2)
    values = torch.cat([v_ctx, v_blk], 2)
    keys, values = keys.repeat_interleave(h // kvh, 1), values.repeat_interleave(h // kvh, 1)
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(d)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    x = x + (probs @ values).transpose(1, 2).reshape(B, Q, h * d) @ a.o_proj.weight.T
    n = _rms(x, layer.post_attention_layernorm.weight, eps)
    mlp = layer.mlp
    gate, up = n @ mlp.gate_proj.weight.T, n @ mlp.up_proj.weight.T
    return x + (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T


@pytest.mark.parametrize("scaling", [None, YARN])
def test_with_context_each_layer_is_the_served_contract(scaling) -> None:
    shape = tiny(rope_scaling=scaling, layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    m = drafter(shape)
    g = torch.Generator().manual_seed(2)
    B, C, Q = 2, 7, 4
    features = torch.randn(B, C, 3 * 48, dtype=torch.float64, generator=g)
    x = torch.randn(B, Q, 48, dtype=torch.float64, generator=g)
    ctx_positions = torch.arange(C)[None].repeat(B, 1) + torch.tensor([[0], [100]])
    positions = torch.arange(C, C + Q)[None].repeat(B, 1) + torch.tensor([[0], [100]])
    masks = {  # random masks: the math must hold whatever the pattern (every row keeps its own key)
        t: (torch.rand(B, 1, Q, C + Q, generator=g) < 0.6) | torch.cat([torch.zeros(Q, C), torch.eye(Q)], 1).bool()
        for t in ("sliding_attention", "full_attention")
    }
    with torch.no_grad():
        ours = m(x, positions, masks, context=m.project_context(features), context_positions=ctx_positions)
        ctx = _rms(features @ m.fc.weight.T, m.hidden_norm.weight, shape.rms_norm_eps)
        ref = x
        for layer in m.layers:
            ref = layer_by_hand(layer, shape, ref, positions, ctx, ctx_positions, masks[layer.layer_type])
        ref = _rms(ref, m.norm.weight, shape.rms_norm_eps)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)  # the cos/sin tables are fp32, as SGLang's


def test_the_drafting_cache_equals_the_training_path_and_crops() -> None:
    shape = tiny()
    m = drafter(shape)
    g = torch.Generator().manual_seed(3)
    features = torch.randn(1, 9, 3 * 48, dtype=torch.float64, generator=g)
    x = torch.randn(1, 4, 48, dtype=torch.float64, generator=g)
    mask = {"full_attention": torch.ones(1, 1, 4, 9 + 4, dtype=torch.bool)}
    with torch.no_grad():
        cache = DFlashContextCache()
        cache.append(m, features[:, :5], torch.arange(5)[None])
        cache.append(m, features[:, 5:], torch.arange(5, 9)[None])
        assert len(cache) == 9
        positions = torch.arange(9, 13)[None]
        cached = m(x, positions, mask, cache=cache)
        direct = m(x, positions, mask, context=m.project_context(features), context_positions=torch.arange(9)[None])
        torch.testing.assert_close(cached, direct, rtol=1e-12, atol=1e-12)
        cache.crop(5)
        assert len(cache) == 5 and all(k.shape[2] == 5 for k in cache.keys + cache.values)


def test_checkpointed_layers_give_the_same_gradients() -> None:
    shape = tiny()
    m = drafter(shape)
    g = torch.Generator().manual_seed(4)
    features = torch.randn(2, 6, 3 * 48, dtype=torch.float64, generator=g)
    x = torch.randn(2, 4, 48, dtype=torch.float64, generator=g)
    mask = {"full_attention": torch.ones(2, 1, 4, 10, dtype=torch.bool)}
    grads = []
    for checkpointed in (False, True):
        m.zero_grad()
        out = m(
            x,
            torch.arange(6, 10)[None].repeat(2, 1),
            mask,
            context=m.project_context(features),
            context_positions=torch.arange(6)[None].repeat(2, 1),
            checkpoint_layers=checkpointed,
        )
        out.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_bf16_runs_and_rotary_stays_fp32() -> None:
    shape = tiny(rope_scaling=YARN)
    m = DFlashDrafter(shape).to(torch.bfloat16)
    assert m.rotary.inv_freq.dtype == torch.float32
    out = m(
        torch.randn(1, 4, 48, dtype=torch.bfloat16),
        torch.arange(3, 7)[None],
        {"full_attention": torch.ones(1, 1, 4, 7, dtype=torch.bool)},
        context=m.project_context(torch.randn(1, 3, 144)),
        context_positions=torch.arange(3)[None],
    )
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
