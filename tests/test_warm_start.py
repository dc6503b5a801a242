"""Drafter folders of any tool (aerie.drafter.folder), and training that starts from one (drafter.init).

The folder "written by another tool" is tests/fixtures/specforge_drafter: saved by SpecForge 0.2.0's own SGLang
exporter (its PROVENANCE.md and make_fixture.py say how), for a toy 8-layer Llama target rebuilt here from its
config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aerie.drafter.folder import (
    DrafterFolderError,
    check_drafter_folder,
    expected_tensor_shapes,
    read_drafter_folder,
    resolve_drafter_folder,
    served_aux_layer_ids,
)
from aerie.drafter.model import DrafterConfig, Eagle3Drafter

REPO = Path(__file__).resolve().parents[1]
SPECFORGE = REPO / "tests" / "fixtures" / "specforge_drafter"
SF_TARGET_LAYERS = 8
SF_AUX = [1, 3, 4]  # SGLang's default for 8 layers: the fixture names no ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py", "*.md", "target"))
    return dst


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    state = load_file(path)
    state = fn(dict(state))
    save_file(state, str(path))


def sf_check(folder: Path, **overrides):
    kw = dict(
        aux_layer_ids=SF_AUX,
        num_hidden_layers=SF_TARGET_LAYERS,
        architectures=["LlamaForCausalLM"],
        target_hidden_size=32,
        target_vocab_size=160,
        draft_vocab_size=64,
        shape={},
    )
    kw.update(overrides)
    return check_drafter_folder(read_drafter_folder(folder), **kw)


# ---- the reader -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        dict(attention="llama"),
        dict(attention="llama", fc_norm=True, num_key_value_heads=1),
        dict(attention="mla"),
        dict(attention="mla", fc_norm=True),
    ],
    ids=["llama", "llama-fc_norm", "mla", "mla-fc_norm"],
)
def test_expected_shapes_are_the_drafters_own(shape) -> None:
    """The torch-free shape table (parse time) equals Eagle3Drafter's state_dict, both kinds."""
    from types import SimpleNamespace

    target = SimpleNamespace(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=160,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    if shape["attention"] == "mla":
        target = SimpleNamespace(
            **vars(target), q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
        )
    cfg = DrafterConfig.from_target(target, 64, [1, 3, 4], **shape)
    real = {k: tuple(v.shape) for k, v in Eagle3Drafter(cfg).state_dict().items() if k != "embed_tokens.weight"}
    assert expected_tensor_shapes(cfg) == real


def test_the_specforge_folder_reads_and_loads_tensor_for_tensor() -> None:
    folder = read_drafter_folder(SPECFORGE)
    assert folder.kind == "llama" and folder.stated_aux_layer_ids is None and not folder.has_embeddings
    assert "another tool" in folder.writer
    cfg = sf_check(SPECFORGE)
    assert cfg.aux_layer_ids == SF_AUX and cfg.draft_vocab_size == 64 and not cfg.norm_output
    drafter = Eagle3Drafter.from_pretrained(SPECFORGE, target=SPECFORGE / "target")
    assert drafter.cfg == cfg and drafter.embeddings_missing
    stored = load_file(SPECFORGE / "model.safetensors")
    state = drafter.state_dict()
    for name, t in stored.items():
        assert torch.equal(state[name].to(t.dtype), t), name
    # a folder naming no aux ids needs the target's depth to know them
    with pytest.raises(ValueError, match="names no eagle_config"):
        Eagle3Drafter.from_pretrained(SPECFORGE)


def test_prefixed_names_absent_t2d_and_shards_are_read(tmp_path) -> None:
    folder = copy_folder(SPECFORGE, tmp_path / "d")
    state = load_file(folder / "model.safetensors")
    t2d = state.pop("t2d")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    first, second = {f"model.{k}": state[k] for k in names[:5]}, {k: state[k] for k in names[5:]}
    save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    index = {n: "model-00001-of-00002.safetensors" for n in first} | {
        n: "model-00002-of-00002.safetensors" for n in second
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    sf_check(folder)
    drafter = Eagle3Drafter.from_pretrained(folder, target=SPECFORGE / "target")
    assert torch.equal(drafter.t2d, t2d.bool())  # rebuilt from d2t
    assert torch.equal(drafter.fc.weight.to(torch.bfloat16), state["fc.weight"])


def test_aerie_exports_round_trip(tmp_path) -> None:
    drafter = Eagle3Drafter.from_pretrained(SPECFORGE, target=SPECFORGE / "target")
    drafter.save_pretrained(tmp_path / "export")
    info = read_drafter_folder(tmp_path / "export")
    assert info.writer.startswith("aerie") and info.stated_aux_layer_ids == SF_AUX
    again = Eagle3Drafter.from_pretrained(tmp_path / "export")
    assert again.cfg == drafter.cfg
    for name, t in drafter.state_dict().items():
        if name != "embed_tokens.weight":  # the target's: never exported
            assert torch.equal(again.state_dict()[name], t), name


# ---- refusals, one per reason, each naming the setting or tensor ------------------------------------------------


def test_refused_kind_and_dimensions(tmp_path) -> None:
    with pytest.raises(DrafterFolderError, match=r"it is a llama drafter .*drafter.attention is 'mla'"):
        sf_check(SPECFORGE, shape={"attention": "mla"})
    with pytest.raises(DrafterFolderError, match=r"num_key_value_heads is 2, drafter.num_key_value_heads is 4"):
        sf_check(SPECFORGE, shape={"num_key_value_heads": 4})
    with pytest.raises(DrafterFolderError, match=r"intermediate_size is 64, drafter.intermediate_size is 128"):
        sf_check(SPECFORGE, shape={"intermediate_size": 128})
    with pytest.raises(DrafterFolderError, match=r"drafter.fc_norm is true"):
        sf_check(SPECFORGE, shape={"fc_norm": True})
    assert sf_check(SPECFORGE, shape={"attention": "llama", "num_key_value_heads": 2, "head_dim": 8}).head_dim == 8


def test_refused_target_and_vocab_sizes(tmp_path) -> None:
    with pytest.raises(DrafterFolderError, match=r"target of hidden size 32 .*the target has 64"):
        sf_check(SPECFORGE, target_hidden_size=64)
    with pytest.raises(DrafterFolderError, match=r"vocab_size 160 != the target's vocab size 200"):
        sf_check(SPECFORGE, target_vocab_size=200)
    with pytest.raises(
        DrafterFolderError, match=r"draft_vocab_size 64 != vocab.draft_vocab_size 32000.*set vocab.draft"
    ):
        sf_check(SPECFORGE, draft_vocab_size=32000)
    folder = copy_folder(SPECFORGE, tmp_path / "d")
    edit_config(folder, target_hidden_size=48)
    with pytest.raises(DrafterFolderError, match=r"target_hidden_size 48 != hidden_size 32"):
        sf_check(folder)


def test_refused_aux_layer_count_and_ids(tmp_path) -> None:
    with pytest.raises(DrafterFolderError, match=r"reads 3 aux layers .*hidden.aux_layer_ids has 2"):
        sf_check(SPECFORGE, aux_layer_ids=[1, 4])
    with pytest.raises(
        DrafterFolderError, match=r"SGLang serves its default layers \[1, 3, 4\].*hidden.aux_layer_ids is \[1, 2, 5\]"
    ):
        sf_check(SPECFORGE, aux_layer_ids=[1, 2, 5])
    folder = copy_folder(SPECFORGE, tmp_path / "d")
    edit_config(folder, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True})
    # A DeepSeek/Kimi target serves [2, 4, 5] (first id not 1: no +1) as the outputs [1, 3, 4] ...
    assert sf_check(folder, architectures=["DeepseekV3ForCausalLM"]).aux_layer_ids == SF_AUX
    # ... a Llama target serves them as written: not the layers the config captures
    with pytest.raises(DrafterFolderError, match=r"states eagle_config ids \[2, 4, 5\].*outputs of layers \[2, 4, 5\]"):
        sf_check(folder, architectures=["LlamaForCausalLM"])
    edit_config(folder, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3], "use_aux_hidden_state": True})
    with pytest.raises(DrafterFolderError, match=r"reads 2 aux layers"):
        sf_check(folder)


def test_served_ids_follow_sglangs_rules() -> None:
    kimi = ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"]
    assert served_aux_layer_ids([2, 30, 58], 61, kimi) == [1, 29, 57]  # the published K2.5 MLA drafter's ids
    assert served_aux_layer_ids([1, 29, 57], 61, kimi) == [1, 29, 57]  # "+1 when the first id is 1"
    assert served_aux_layer_ids(None, 61, kimi) == [1, 29, 57]  # SGLang's default
    assert served_aux_layer_ids([2, 30, 58], 61, ["LlamaForCausalLM"]) == [2, 30, 58]
    assert served_aux_layer_ids([0, 30, 58], 61, kimi) == [-1, 29, 57]  # the embeddings: never what training uses


def test_refused_tensors_missing_extra_misshaped(tmp_path) -> None:
    cases = {
        "missing": (
            lambda s: {k: v for k, v in s.items() if k != "midlayer.mlp.up_proj.weight"},
            r"tensor midlayer.mlp.up_proj.weight is missing \(expected shape \[64, 32\]\)",
        ),
        "extra": (lambda s: {**s, "fc.bias": torch.zeros(32)}, r"tensor fc.bias is not part of the drafter"),
        "misshaped": (
            lambda s: {**s, "lm_head.weight": torch.zeros(65, 32)},
            r"tensor lm_head.weight has shape \[65, 32\], expected \[64, 32\]",
        ),
        "no d2t": (lambda s: {k: v for k, v in s.items() if k != "d2t"}, r"tensor d2t is missing"),
        "bad embed": (
            lambda s: {**s, "embed_tokens.weight": torch.zeros(10, 32)},
            r"tensor embed_tokens.weight has shape",
        ),
    }
    for name, (fn, message) in cases.items():
        folder = copy_folder(SPECFORGE, tmp_path / name.replace(" ", "_"))
        edit_tensors(folder, fn)
        with pytest.raises(DrafterFolderError, match=message):
            sf_check(folder)
        with pytest.raises(DrafterFolderError, match=message):  # the loader refuses the same way
            Eagle3Drafter.from_pretrained(folder, target=SPECFORGE / "target")
    folder = copy_folder(SPECFORGE, tmp_path / "with-embed")  # embeddings may be present
    edit_tensors(folder, lambda s: {**s, "embed_tokens.weight": torch.zeros(160, 32, dtype=torch.bfloat16)})
    sf_check(folder)


def test_refused_configs_aerie_cannot_represent(tmp_path) -> None:
    cases = {
        "speculators": ({"speculators_model_type": "eagle3"}, "speculators"),
        "rope": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope scaling 'llama3'"),
        "bias": ({"attention_bias": True}, "attention_bias: true"),
        "layers": ({"num_hidden_layers": 2}, "num_hidden_layers 2"),
        "arch": ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 drafter SGLang serves"),
        "no-aux": ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state: false"),
    }
    for name, (changes, message) in cases.items():
        folder = copy_folder(SPECFORGE, tmp_path / name)
        edit_config(folder, **changes)
        with pytest.raises(DrafterFolderError, match=message):
            read_drafter_folder(folder)


# ---- finding a folder -------------------------------------------------------------------------------------------


def test_hub_ids_resolve_in_the_cache_only(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        resolve_drafter_folder("lightseekorg/kimi-k2.5-eagle3", base=tmp_path)
    msg = str(e.value)
    assert str(cache / "models--lightseekorg--kimi-k2.5-eagle3") in msg and "huggingface-cli download" in msg
    repo = cache / "models--lightseekorg--kimi-k2.5-eagle3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    copy_folder(SPECFORGE, repo / "snapshots" / "abc123")
    assert resolve_drafter_folder("lightseekorg/kimi-k2.5-eagle3", base=tmp_path) == repo / "snapshots" / "abc123"
    copy_folder(SPECFORGE, tmp_path / "published")  # a local folder, relative to the workflow's directory
    assert resolve_drafter_folder("published", base=tmp_path) == tmp_path / "published"
    with pytest.raises(FileNotFoundError, match="give the folder"):
        resolve_drafter_folder("no/such/folder/here", base=tmp_path)
