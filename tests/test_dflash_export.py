"""aerie's DFlash export against SGLang 0.5.23's own loader, without SGLang.

tests/fixtures/sglang/dflash_weights.json was recorded by executing SGLang's DFlashDraftModel constructor and
load_weights from the wheel (record_dflash_weights.py beside it) on aerie exports at Kimi K2.5's dims and at a tiny
size, and on the third-party folder fixture. Here today's code must produce what was recorded: the same tensors (so
SGLang fills every one of its parameters exactly once, fc at the width it checks, nothing dropped), a config.json
carrying every attribute SGLang read with the values it parsed, and the attention types/windows it built.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from aerie.drafter_kinds.dflash.folder import canonical_name, read_dflash_folder
from aerie.drafter_kinds.dflash.model import DFlashDrafter
from aerie.drafter_kinds.dflash.shape import DFlashShape
from aerie.drafter_kinds.dflash.weights import export_dflash, load_dflash

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECORD = json.loads((Path(__file__).parent / "fixtures" / "sglang" / "dflash_weights.json").read_text())
FIXTURE = Path(__file__).parent / "fixtures" / "dflash_folder"


def shape_of(kind: str) -> DFlashShape:
    return DFlashShape(**RECORD["kinds"][kind]["aerie_shape"])


def sglang_param(name: str) -> str:
    """The SGLang parameter a checkpoint tensor goes to (its stacked q/k/v and gate/up)."""
    return re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name))


def load_problems(rec: dict, exported: dict[str, tuple[list[int], str]]) -> list[str]:
    """What would go wrong loading ``exported`` (name -> (shape, dtype)) with the recorded SGLang mapping: empty
    when every SGLang parameter is filled exactly once, every tensor is of the recorded shape, none is dropped."""
    problems = []
    filled: dict[str, list[tuple[int, int]]] = {name: [] for name in rec["params"]}
    for name, (shape, _) in exported.items():
        entry = rec["checkpoint"].get(name)
        if entry is None:
            problems.append(f"{name}: never shown to SGLang's load_weights")
            continue
        if shape != entry["shape"]:
            problems.append(f"{name}: shape {shape}, SGLang took {entry['shape']}")
        if entry.get("dropped"):
            problems.append(f"{name}: dropped by SGLang")
        for fill in entry.get("fills", []):
            filled[fill["param"]].append(tuple(fill["rows"]))
    for param, shape in rec["params"].items():
        rows = sorted(filled[param])
        if [r for a, b in rows for r in range(a, b)] != list(range(shape[0])):
            problems.append(f"{param}: rows {rows} do not fill its {shape[0]} rows exactly once")
    missing = set(rec["checkpoint"]) - set(exported)
    problems += [f"{name}: recorded but not exported" for name in sorted(missing)]
    return problems


def test_the_kimi_export_fills_every_sglang_parameter() -> None:
    """At Kimi K2.5's dims: names and shapes from the drafter built on the meta device (what the export holds)."""
    shape = shape_of("kimi")
    assert shape.hidden_size == 7168 and shape.target_layer_ids == (1, 12, 24, 35, 47, 58)
    with torch.device("meta"):
        model = DFlashDrafter(shape)
    exported = {n: (list(t.shape), "bfloat16") for n, t in model.state_dict().items()}
    rec = RECORD["kinds"]["kimi"]
    assert load_problems(rec, exported) == []
    assert len(rec["params"]) == 6 * 8 + 3  # per layer: 2 norms, qkv, o, q_norm, k_norm, gate_up, down
    assert rec["params"]["fc.weight"] == [7168, 6 * 7168] and rec["num_context_features"] == 6
    assert rec["params"]["layers.0.self_attn.qkv_proj.weight"] == [(64 + 2 * 8) * 128, 7168]
    fills = rec["checkpoint"]["layers.3.self_attn.k_proj.weight"]["fills"]
    assert fills == [{"param": "layers.3.self_attn.qkv_proj.weight", "rows": [64 * 128, 72 * 128]}]


def test_the_tiny_export_file_fills_every_sglang_parameter(tmp_path) -> None:
    shape = shape_of("tiny")
    torch.manual_seed(0)
    model = DFlashDrafter(shape)
    export_dflash(model, shape, tmp_path, {"run": "test"})
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        exported = {n: (list(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}
        assert f.metadata() == {"format": "aerie.dflash/1"}
    assert {d for _, d in exported.values()} == {"BF16"}
    assert load_problems(RECORD["kinds"]["tiny"], exported) == []
    assert sorted(exported) == sorted(RECORD["kinds"]["tiny"]["checkpoint"])


@pytest.mark.parametrize("kind", ["kimi", "tiny"])
def test_config_json_carries_what_sglang_read(kind, tmp_path) -> None:
    rec = RECORD["kinds"][kind]
    shape = shape_of(kind)
    config = shape.to_sglang_config("bfloat16", {"run": "x"})
    recorded = dict(rec["config_json"])
    assert {k: v for k, v in config.items() if k != "aerie"} == recorded  # re-record when this changes
    for attribute in rec["config_attributes_read"]:
        assert attribute in config, attribute  # every attribute SGLang read is written, not defaulted
    draft = rec["draft_config"]
    assert draft["target_layer_ids"] == list(shape.target_layer_ids) and draft["mask_token_id"] == shape.mask_token_id
    assert (draft["block_size"], draft["num_target_layers"], draft["num_hidden_layers"]) == (
        shape.block_size,
        shape.num_target_layers,
        shape.num_hidden_layers,
    )
    assert draft["mask_token"] == "<|MASK|>"  # SGLang's default string: it checks the tokenizer has no other id
    assert rec["block_size"] == shape.block_size
    for layer, layer_type in zip(rec["layers"], shape.layer_types):
        if layer_type == "full_attention":  # bidirectional over [context | block]
            assert layer == {**layer, "attn_type": "ENCODER_ONLY", "sliding_window_size": -1}
        else:  # causal, window_left = W - 1 (HF's window counts the query itself)
            assert layer == {**layer, "attn_type": "DECODER", "sliding_window_size": shape.sliding_window - 1}
        assert layer["scaling"] == pytest.approx(shape.head_dim**-0.5)
    (tmp_path / "config.json").write_text(json.dumps(config))
    parsed = AutoConfig.from_pretrained(tmp_path)  # what SGLang builds from it
    assert type(parsed).__name__ == "Qwen3Config"
    assert list(parsed.layer_types) == list(shape.layer_types) and parsed.sliding_window == shape.sliding_window
    assert DFlashShape.from_sglang_config(rec["config_json"]) == shape


def test_sglangs_rotary_is_built_from_the_exported_rope() -> None:
    kimi = RECORD["kinds"]["kimi"]["rotary"]
    assert kimi["class"] == "YaRNScalingRotaryEmbedding" and kimi["get_rope"]["base"] == 50000.0
    scaling = kimi["get_rope"]["rope_scaling"]
    assert (scaling["factor"], scaling["original_max_position_embeddings"]) == (64.0, 4096)
    assert (scaling["mscale"], scaling["mscale_all_dim"]) == (1.0, 1.0)
    assert kimi["rotary_dim"] == 128 and kimi["is_neox_style"]


def test_sglang_refuses_a_wrong_fc_width_as_recorded() -> None:
    assert "DFLASH fc.weight shape mismatch" in RECORD["kinds"]["tiny"]["fc_width_refusal"]


def test_sglang_resolves_the_third_party_names_as_aerie_reads_them() -> None:
    """The folder fixture stores ``model.``-prefixed names; SGLang's load_weights put each into the parameter aerie's
    canonical name maps to (q/k/v and gate/up stacked in that order)."""
    rec = RECORD["kinds"]["folder_fixture"]
    shape, tensors = read_dflash_folder(FIXTURE)
    assert sorted(rec["checkpoint"]) == sorted(t.stored_name for t in tensors.values())
    for stored, entry in rec["checkpoint"].items():
        assert not entry.get("dropped"), stored
        assert [f["param"] for f in entry["fills"]] == [sglang_param(canonical_name(stored))]
    stored_shapes = {t.stored_name: (list(t.shape), t.dtype) for t in tensors.values()}
    assert load_problems(rec, stored_shapes) == []  # every SGLang parameter filled exactly once
    assert rec["draft_config"]["mask_token_id"] == shape.mask_token_id
    assert rec["draft_config"]["target_layer_ids"] == list(shape.target_layer_ids)


def test_export_round_trips(tmp_path) -> None:
    shape = shape_of("tiny")
    torch.manual_seed(0)
    model = DFlashDrafter(shape)
    export_dflash(model, shape, tmp_path, {"run": "x"}, dtype=torch.float32)
    back = load_dflash(tmp_path)
    assert back.shape == shape
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["aerie"] == {"format": "aerie.dflash/1", "run": "x"} and config["torch_dtype"] == "float32"
    with pytest.raises(ValueError, match="built for"):
        export_dflash(model, DFlashShape(**{**shape.as_dict(), "block_size": 8}), tmp_path / "b", {})
