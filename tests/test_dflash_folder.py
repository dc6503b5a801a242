"""DFlash folders written by another tool (tests/fixtures/dflash_folder: top-level mask/ids, ``model.`` prefixes,
sharded safetensors) load for a warm start; folders that do not fit the target are refused naming the tensor or the
setting; tensors SGLang ignores are warned about, never silently accepted."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3ForCausalLM

from aerie.benchmark.speculative import greedy_generate, speculative_generate
from aerie.drafter_kinds.dflash.drafting import DFlashProposer
from aerie.drafter_kinds.dflash.folder import check_dflash_folder, read_dflash_folder
from aerie.drafter_kinds.dflash.weights import load_dflash
from aerie.drafter_kinds.folders import DrafterFolderError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURE = Path(__file__).parent / "fixtures" / "dflash_folder"
TARGET = json.loads((FIXTURE / "target" / "config.json").read_text())


def copy(tmp_path: Path) -> Path:
    folder = tmp_path / "folder"
    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("target", "*.py", "*.md"))
    return folder


def edit_config(folder: Path, **change) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_tensor(folder: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Replace (or with None, delete) a stored tensor in whichever shard holds it."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = index["weight_map"][name]
    tensors = load_file(str(folder / file))
    if tensor is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def add_tensor(folder: Path, name: str, tensor: torch.Tensor) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = "model-00002-of-00002.safetensors"
    tensors = load_file(str(folder / file))
    tensors[name] = tensor
    save_file(tensors, str(folder / file))
    index["weight_map"][name] = file
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def refused(folder: Path, target=TARGET, valid=None) -> str:
    with pytest.raises(DrafterFolderError) as e:
        check_dflash_folder(folder, target, valid)
    return str(e.value)


def test_the_third_party_folder_loads_and_drafts() -> None:
    shape, tensors = read_dflash_folder(FIXTURE)
    assert shape.target_layer_ids == (1, 3) and shape.mask_token_id == 127 and shape.block_size == 4
    assert tensors["fc.weight"].stored_name == "model.fc.weight" and tensors["fc.weight"].shape == (32, 64)
    assert {t.file for t in tensors.values()} == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    checked = check_dflash_folder(FIXTURE, AutoConfig.for_model(**TARGET), lambda i: i == 127)
    assert checked.warnings == [] and checked.shape == shape
    drafter = load_dflash(FIXTURE, TARGET, dtype=torch.float32)
    stored = {**load_file(str(FIXTURE / "model-00001-of-00002.safetensors"))}
    assert torch.equal(drafter.fc.weight, stored["model.fc.weight"].float())
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(AutoConfig.for_model(**TARGET)).eval()  # the toy target it was made for
    proposer = DFlashProposer(drafter.eval(), target.get_input_embeddings().weight, target.lm_head.weight)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    res = speculative_generate(target, proposer, prompt, 12, num_draft_steps=3)
    assert res.tokens == greedy_generate(target, prompt, 12)


def test_a_wider_hidden_size_is_refused(tmp_path) -> None:
    assert "config.json hidden_size 32 != the target's hidden_size 48" in refused(
        FIXTURE, {**TARGET, "hidden_size": 48}
    )


def test_a_wrong_fc_width_is_refused(tmp_path) -> None:
    folder = copy(tmp_path)
    edit_tensor(folder, "model.fc.weight", torch.zeros(32, 96, dtype=torch.bfloat16))
    message = refused(folder)
    assert "tensor fc.weight has shape [32, 96], expected [32, 64]" in message and "K = 2 target layers" in message


def test_fc_width_follows_the_stated_target_layers(tmp_path) -> None:
    folder = copy(tmp_path)
    edit_config(folder, target_layer_ids=[1, 2, 3])
    assert "tensor fc.weight has shape [32, 64], expected [32, 96]" in refused(folder)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 6], r"target_layer_ids \(top level\) \[1, 6\]: \[6\] not below 5"),
        ([1, 5], r"\[5\] not below 5 for a target of 6 layers .* 5, the last layer, is never captured"),
    ],
)
def test_a_target_layer_too_deep_is_refused(tmp_path, ids, message) -> None:
    folder = copy(tmp_path)
    edit_config(folder, target_layer_ids=ids)
    assert re.search(message, refused(folder))


def test_a_bad_mask_id_is_refused(tmp_path) -> None:
    folder = copy(tmp_path)
    edit_config(folder, mask_token_id=128)
    assert "mask_token_id (top level) 128 is outside the target's vocab 0..127" in refused(folder)
    message = refused(FIXTURE, valid=lambda token: token != 127)  # the caller's tokenizer says 127 is a real token
    assert "mask_token_id (top level) 127 is a real token of the target's tokenizer" in message
    edit_config(folder, mask_token_id=None)
    assert "names no dflash_config.mask_token_id" in refused(folder)


def test_a_missing_tensor_is_refused(tmp_path) -> None:
    folder = copy(tmp_path)
    edit_tensor(folder, "model.layers.1.self_attn.k_norm.weight", None)
    assert "tensor layers.1.self_attn.k_norm.weight is missing (expected shape [8])" in refused(folder)
    with pytest.raises(DrafterFolderError, match="k_norm.weight is missing"):
        load_dflash(folder)


def test_mis_shaped_and_non_float_tensors_are_refused(tmp_path) -> None:
    folder = copy(tmp_path)
    edit_tensor(folder, "model.layers.0.mlp.up_proj.weight", torch.zeros(32, 48, dtype=torch.bfloat16))
    edit_tensor(folder, "model.norm.weight", torch.ones(32, dtype=torch.int64))
    message = refused(folder)
    assert "tensor layers.0.mlp.up_proj.weight has shape [32, 48], expected [48, 32]" in message
    assert "tensor norm.weight is I64: expected a float dtype" in message


def test_tensors_sglang_ignores_are_warned_and_unknown_ones_refused(tmp_path) -> None:
    folder = copy(tmp_path)
    add_tensor(folder, "lm_head.weight", torch.zeros(128, 32, dtype=torch.bfloat16))
    add_tensor(folder, "model.embed_tokens.weight", torch.zeros(128, 32, dtype=torch.bfloat16))
    add_tensor(folder, "d2t", torch.zeros(16, dtype=torch.int64))
    checked = check_dflash_folder(folder, TARGET)
    assert len(checked.warnings) == 3 and all("SGLang ignores it" in w for w in checked.warnings)
    assert any("tensor embed_tokens.weight (stored as model.embed_tokens.weight" in w for w in checked.warnings)
    load_dflash(folder, TARGET)  # loads without them
    add_tensor(folder, "layers.0.self_attn.g_proj.weight", torch.zeros(4, 32, dtype=torch.bfloat16))
    assert "tensor layers.0.self_attn.g_proj.weight" in refused(folder) and "would drop it" in refused(folder)


def test_unsupported_dflash_variants_are_refused_by_name(tmp_path) -> None:
    folder = copy(tmp_path)
    edit_config(folder, dflash_config={"conv_kernel_size": 3, "conv_group_size": 8}, use_gemma_norm=True)
    message = refused(folder)
    assert "dflash_config.conv_kernel_size 3" in message and "use_gemma_norm True" in message
    edit_config(folder, dflash_config=None, use_gemma_norm=None, architectures=["DFlash2DraftModel"])
    assert "architectures ['DFlash2DraftModel']" in refused(folder)
    edit_config(folder, architectures=["DFlashDraftModel"], layer_types=["sliding_attention"] * 2, sliding_window=4)
    assert "without use_sliding_window: true" in refused(folder)


def test_a_trained_mask_embedding_is_refused(tmp_path) -> None:
    folder = copy(tmp_path)
    torch.save({"embedding": torch.zeros(32), "mask_token_id": 127}, folder / "mask_embedding.pt")
    assert "mask_embedding.pt" in refused(folder)


def test_a_depth_mismatch_is_a_warning(tmp_path) -> None:
    checked = check_dflash_folder(FIXTURE, {**TARGET, "num_hidden_layers": 8})
    assert checked.shape.num_target_layers == 8
    assert any("num_target_layers 6 != the target's 8 layers" in w for w in checked.warnings)


def test_a_wrapped_target_config_is_read_through_text_config() -> None:
    checked = check_dflash_folder(
        FIXTURE, {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": TARGET}
    )
    assert checked.shape.hidden_size == 32


def test_the_kind_checks_a_reference_only_against_a_fully_described_target() -> None:
    """A config that names the target's depth alone (parse time, the target not here) leaves the folder to the
    job's check instead of failing on the sizes it lacks; the full description still refuses a misfit."""
    from aerie.drafter_kinds import kind_named
    from aerie.drafter_kinds.kind import TargetView

    kind = kind_named("dflash")
    assert kind.reference_problems(FIXTURE, TargetView({"num_hidden_layers": TARGET["num_hidden_layers"]})) == []
    assert kind.reference_problems(FIXTURE, TargetView(TARGET)) == []
    assert any("hidden_size" in p for p in kind.reference_problems(FIXTURE, TargetView({**TARGET, "hidden_size": 48})))
