"""aerie.drafter_kinds.dflash.shape: the DFlash drafter's shape as SGLang 0.5.23 reads it, torch-free.

* SGLang's default target layers (recorded from its own build_target_layer_ids) and the Kimi K2.5 drafter's shape;
* validation names the setting; config.json round-trips, and a third-party spelling (top-level keys) reads the same;
* the capture layers per target architecture, SGLang's server flags;
* parameter count (= the built model's), serving KV bytes, training memory / optimizer fit, FLOPs, loss gamma;
* shape.py and folder.py import no torch (parse time reads them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO

from aerie.drafter_kinds.dflash.shape import (
    DFlashShape,
    capture_layer_ids,
    default_loss_gamma,
    default_target_layer_ids,
    optimizer_state_fits,
    parameter_count,
    serving_kv_bytes_per_token,
    sglang_flags,
    train_flops_per_token,
    training_memory,
)

RECORD = json.loads((Path(__file__).parent / "fixtures" / "sglang" / "dflash_weights.json").read_text())
KIMI_TARGET = {
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "intermediate_size": 18432,
    "vocab_size": 163840,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=100,
    num_target_layers=8,
    target_layer_ids=(1, 3, 5),
    block_size=4,
    mask_token_id=99,
)


def kimi() -> DFlashShape:
    return DFlashShape.from_target(KIMI_TARGET, num_layers=6, block_size=8, mask_token_id=163838)


def test_default_target_layers_are_sglangs() -> None:
    for key, ids in RECORD["default_target_layer_ids"].items():
        depth, layers = (int(x) for x in key.split(","))
        assert default_target_layer_ids(depth, layers) == ids, key
    assert default_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]


def test_the_kimi_drafter_is_z_labs_shape() -> None:
    """z-lab/Kimi-K2.5-DFlash: 6 layers, hidden 7168, 64 heads / 8 KV heads x 128, intermediate 18432, target layers
    [1, 12, 24, 35, 47, 58], YaRN as the target's, ~3.48B parameters (its 6.48 GiB of bf16)."""
    s = kimi()
    assert (s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (7168, 64, 8, 128)
    assert (s.intermediate_size, s.vocab_size, s.num_target_layers) == (18432, 163840, 61)
    assert s.target_layer_ids == (1, 12, 24, 35, 47, 58)
    assert s.rope_theta == 50000.0 and s.rope_scaling["factor"] == 64.0 and s.rope_scaling["mscale_all_dim"] == 1.0
    assert s.layer_types == ("full_attention",) * 6 and s.sliding_window is None
    assert parameter_count(s) == 3_479_277_056
    assert abs(parameter_count(s) * 2 / 2**30 - 6.48) < 0.01
    assert serving_kv_bytes_per_token(s) == 2 * 8 * 128 * 6 * 2


def test_a_gqa_target_gives_its_own_heads() -> None:
    target = {
        "hidden_size": 64,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": 500,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    s = DFlashShape.from_target(target, num_layers=3, block_size=16, mask_token_id=7, sliding_window=64)
    assert (s.num_key_value_heads, s.head_dim, s.rope_theta, s.rope_scaling) == (2, 16, 1e6, None)
    assert s.layer_types == ("sliding_attention",) * 3 and s.all_sliding
    assert s.target_layer_ids == tuple(default_target_layer_ids(12, 3))
    with pytest.raises(ValueError, match="rope_scaling type 'llama3'"):
        DFlashShape.from_target(
            {**target, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
            num_layers=3,
            block_size=16,
            mask_token_id=7,
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 1}, "drafter.block_size must be >= 2"),
        ({"num_key_value_heads": 3}, "drafter.num_attention_heads"),
        ({"head_dim": 7}, "drafter.head_dim must be even"),
        ({"mask_token_id": 100}, "drafter.mask_token_id 100 is outside the target vocab"),
        ({"target_layer_ids": (3, 1)}, "strictly ascending"),
        ({"target_layer_ids": (1, 7)}, r"must lie in 0..6 for a target of 8 layers"),
        ({"target_layer_ids": ()}, "drafter.target_layer_ids is empty"),
        ({"layer_types": ("full_attention",)}, "drafter.layer_types has 1 entries for 2 draft layers"),
        ({"layer_types": ("full_attention", "linear_attention")}, "drafter.layer_types"),
        ({"layer_types": ("sliding_attention", "full_attention")}, "drafter.sliding_window must be >= 1"),
        ({"hidden_act": "gelu"}, "drafter.hidden_act"),
        ({"attention_bias": True}, "drafter.attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ],
)
def test_validation_names_the_setting(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        DFlashShape(**{**TINY, **change})


def test_config_json_round_trips_and_carries_sglangs_keys() -> None:
    s = replace(
        DFlashShape(**TINY),
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0},
    )
    cfg = s.to_sglang_config("bfloat16", {"data": "x"})
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 3, 5]}
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 6
    assert cfg["aerie"] == {"format": "aerie.dflash/1", "data": "x"}
    assert DFlashShape.from_sglang_config(json.loads(json.dumps(cfg))) == s
    plain = DFlashShape(**TINY).to_sglang_config("float32", {})
    assert plain["use_sliding_window"] is False and plain["sliding_window"] is None
    assert DFlashShape.from_sglang_config(plain) == DFlashShape(**TINY)


def test_a_third_party_config_reads_as_sglang_reads_it() -> None:
    """Top-level mask/ids/block (SGLang's fallback), no layer_types (Qwen3Config's rule), no num_target_layers (the
    target's depth), no ids at all (SGLang's default for the target's depth)."""
    cfg = DFlashShape(**TINY).to_sglang_config("bfloat16", {})
    nested = cfg.pop("dflash_config")
    for key in ("aerie", "layer_types", "num_target_layers"):
        cfg.pop(key)
    top = {**cfg, **nested}
    assert DFlashShape.from_sglang_config(top, num_target_layers=8) == DFlashShape(**TINY)
    without_ids = {k: v for k, v in top.items() if k != "target_layer_ids"}
    assert DFlashShape.from_sglang_config(without_ids, num_target_layers=8).target_layer_ids == (1, 5)
    sliding = {**top, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    assert DFlashShape.from_sglang_config(sliding, num_target_layers=8).layer_types == (
        "full_attention",
        "sliding_attention",
    )
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashShape.from_sglang_config({k: v for k, v in top.items() if k != "mask_token_id"}, num_target_layers=8)
    with pytest.raises(ValueError, match="num_target_layers"):
        DFlashShape.from_sglang_config(top)


def test_capture_layers_are_the_target_layer_ids_on_sglangs_targets() -> None:
    s = kimi()
    for arch in ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert capture_layer_ids(s, arch) == [1, 12, 24, 35, 47, 58]
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        capture_layer_ids(s, "Qwen2ForCausalLM")


def test_sglang_flags() -> None:
    s = kimi()
    assert sglang_flags("/d", s) == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        "/d",
        "--speculative-num-draft-tokens",
        "8",
    ]
    assert sglang_flags("/d", s, num_draft_tokens=4)[-1] == "4"
    with pytest.raises(ValueError, match="num_draft_tokens 9"):
        sglang_flags("/d", s, num_draft_tokens=9)
    with pytest.raises(ValueError, match="full_attention layers"):
        sglang_flags("/d", s, draft_window_size=2048)
    sliding = replace(s, layer_types=("sliding_attention",) * 6, sliding_window=2048)
    assert sglang_flags("/d", sliding)[-2:] == ["--speculative-draft-window-size", "2048"]
    assert sglang_flags("/d", sliding, draft_window_size=4096)[-1] == "4096"
    with pytest.raises(ValueError, match="draft_window_size 1024"):
        sglang_flags("/d", sliding, draft_window_size=1024)
    flags = " ".join(sglang_flags("/d", sliding))
    assert "--speculative-dflash-draft-window-size" not in flags


def test_sglang_flag_names_exist_in_0523() -> None:
    """Each flag is ``--`` + a field of SGLang 0.5.23's speculative arguments (arg_groups/fields/spec.py, recorded
    from the wheel with its CLI rule ``"--" + name.replace("_", "-")``); z-lab's card flag is not among them."""
    fields = set(RECORD["sglang_spec_fields"])
    sliding = replace(kimi(), layer_types=("sliding_attention",) * 6, sliding_window=2048)
    used = {f[2:].replace("-", "_") for f in sglang_flags("/d", sliding) if f.startswith("--")}
    assert used == {
        "speculative_algorithm",
        "speculative_draft_model_path",
        "speculative_num_draft_tokens",
        "speculative_draft_window_size",
    }
    assert used <= fields
    assert "speculative_dflash_block_size" in fields  # an alias of num_draft_tokens for DFLASH, not used here
    assert "speculative_dflash_draft_window_size" not in fields


def test_parameter_count_is_the_models() -> None:
    from aerie.drafter_kinds.dflash.model import DFlashDrafter

    s = DFlashShape(**TINY)
    assert parameter_count(s) == sum(p.numel() for p in DFlashDrafter(s).parameters())


def test_training_memory_and_optimizer_fit() -> None:
    s = kimi()
    mem = training_memory(s, batch_tokens=4096, num_anchors=512)
    P = parameter_count(s)
    assert (mem.weights, mem.gradients, mem.optimizer) == (4 * P, 4 * P, 8 * P)
    assert 55.6e9 < mem.optimizer_state < 55.7e9
    assert mem.frozen_target == 2 * 163840 * 7168 * 2
    assert mem.total == mem.optimizer_state + mem.frozen_target + mem.batch + mem.activations + mem.logits
    checkpointed = training_memory(s, batch_tokens=4096, num_anchors=512, checkpoint_layers=True)
    assert checkpointed.activations < mem.activations / 3
    bigger = training_memory(s, batch_tokens=8192, num_anchors=1024)
    assert bigger.activations > 1.9 * mem.activations and "GB" in mem.describe()
    assert optimizer_state_fits(s, 80 * 10**9)[0] and not optimizer_state_fits(s, 48 * 10**9)[0]
    fits, text = optimizer_state_fits(s, 80 * 10**9)
    assert "3.48B parameters" in text and "55.7 GB" in text


def test_train_flops_per_token() -> None:
    s = kimi()
    f = train_flops_per_token(s, 512, 4096)
    # the MLP of the block tokens alone: 3 (fwd+bwd) x 2 x 3 x H x I per block token per layer, 1 block token/token
    mlp = 3 * 2 * 3 * 7168 * 18432 * 6
    assert mlp < f < 3 * mlp
    assert train_flops_per_token(s, 256, 4096) < f  # fewer blocks, less work per token
    assert train_flops_per_token(s, 0, 4096) > 0  # fc and the context keys still run


def test_default_loss_gamma() -> None:
    assert [default_loss_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert default_loss_gamma(12) == pytest.approx(5 + 2 / 3)
    assert default_loss_gamma(4) == 2.0 and default_loss_gamma(2) == 1.0 and default_loss_gamma(32) > 7


def test_shape_and_folder_import_no_torch() -> None:
    code = (
        "import sys, aerie.drafter_kinds.dflash.shape, aerie.drafter_kinds.dflash.folder\n"
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
