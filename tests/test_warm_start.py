"""Drafter folders of any tool (aerie.drafter_kinds.eagle3.folder), and training that starts from one (drafter.init).

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

from aerie.drafter_kinds.eagle3.folder import (
    DrafterFolderError,
    check_drafter_folder,
    expected_tensor_shapes,
    read_drafter_folder,
    served_aux_layer_ids,
)
from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
from aerie.drafter_kinds.folders import resolve_drafter_folder

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
    # EAGLE 3.1's switches on a folder without them: accepted (training switches them on, fc_norm starting at 1)
    assert sf_check(SPECFORGE, shape={"fc_norm": True, "norm_output": True}).fc_norm is False
    assert read_drafter_folder(SPECFORGE).eagle31_upgrade({"fc_norm": True, "norm_output": True}) == [
        "fc_norm",
        "norm_output",
    ]
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


# ---- training from the folder ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """The fixture's toy target (rebuilt from its config.json), its greedy data as hidden shards, and a draft vocab
    file that is the SpecForge folder's own (what the draft_vocab rule writes under drafter.init)."""
    from tiny_world import greedy_sequences, write_hidden_v1_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from aerie.formats.vocab import write_draft_vocab
    from aerie.vocab.draft_vocab import folder_vocab_maps

    root = tmp_path_factory.mktemp("warm_start")
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig.from_pretrained(SPECFORGE / "target")).eval()
    target.save_pretrained(root / "target")
    seqs = greedy_sequences(target, SF_AUX, num_seqs=24, prompt_len=6, new_tokens=14, id_prefix="toy")
    shards = [root / "shard-00000.safetensors"]
    write_hidden_v1_shard(
        shards[0], seqs, aux_layer_ids=SF_AUX, target_config=target.config, target_dir=root / "target"
    )
    d2t, t2d = folder_vocab_maps(SPECFORGE)
    vocab = root / "vocab.safetensors"
    write_draft_vocab(vocab, d2t, t2d, torch.zeros(160, dtype=torch.int64), {"source": "drafter.init"})
    return {"root": root, "target": root / "target", "shards": shards, "vocab": vocab, "d2t": d2t, "t2d": t2d}


TRAIN = dict(ttt_steps=2, epochs=1, batch_size=8, max_seq_len=32, eval_fraction=0.25, seed=0, threads=1, log_every=1)


def _train(world, out: Path, **overrides) -> dict:
    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter

    cfg = TrainConfig.of(**{**TRAIN, "init": str(SPECFORGE), **overrides})
    return train_drafter(
        world["shards"], world["vocab"], world["target"], out, cfg, log=lambda _: None, layer_ids=SF_AUX
    )


def test_no_steps_export_equals_the_start_folder_tensor_for_tensor(world, tmp_path) -> None:
    """What the loop does before its first step (start_from_folder), then its export: the SpecForge folder again."""
    from aerie.drafter.config import TrainConfig
    from aerie.drafter_kinds.eagle3.training import export, start_from_folder
    from aerie.formats.vocab import load_draft_vocab

    embed = torch.randn(160, 32)
    model = start_from_folder(
        str(SPECFORGE),
        world["target"],
        load_draft_vocab(world["vocab"]),
        SF_AUX,
        TrainConfig.of(init=str(SPECFORGE)).kind_settings,
        embed,
    )
    export(model, tmp_path / "out", {}, SF_AUX)
    start, exported = load_file(SPECFORGE / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(start)
    for name, t in start.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name


def test_training_starts_from_every_tensor_and_keeps_the_vocab(world, tmp_path) -> None:
    start = load_file(SPECFORGE / "model.safetensors")
    # a learning rate too small to move a bf16 weight: one epoch of real optimizer steps, the start folder exported
    still = _train(world, tmp_path / "still", learning_rate=1e-12, warmup_ratio=0.0)
    assert still["optimizer_steps"] > 0 and still["best_epoch"] in (0, 1)
    exported = load_file(tmp_path / "still" / "model.safetensors")
    for name, t in start.items():
        assert torch.equal(exported[name], t), name
    # trained for real: every float tensor moved from the start, the vocabulary kept
    moved = _train(world, tmp_path / "moved", learning_rate=3e-3, epochs=2)
    trained = load_file(tmp_path / "moved" / "model.safetensors")
    assert torch.equal(trained["d2t"], start["d2t"]) and torch.equal(trained["t2d"], start["t2d"])
    assert not torch.equal(trained["fc.weight"], start["fc.weight"])
    # the start is the folder, not a fresh drafter: its held-out figures before training are the folder's
    scratch = _train(world, tmp_path / "scratch", init="", learning_rate=3e-3)
    assert moved["untrained"]["heldout_loss"] == still["untrained"]["heldout_loss"]
    assert moved["untrained"]["heldout_loss"] != scratch["untrained"]["heldout_loss"]
    assert json.loads((tmp_path / "moved" / "config.json").read_text())["aerie"]["train_config"]["init"] == str(
        SPECFORGE
    )


def test_a_warm_start_never_exports_worse_than_its_start(world, tmp_path, monkeypatch) -> None:
    """The start folder competes for best epoch: scripted held-out acceptance 2.0 (the start), then 1.5 and 1.8 after
    the two epochs - the export is the start folder, tensor for tensor; one that beats it (2.5) is exported."""
    import aerie.drafter_kinds.eagle3.training as side

    def scripted(values):
        it = iter(values)
        return lambda *a, **k: {**side.EMPTY_EVAL, "simulated_acceptance_length": next(it), "heldout_loss": 1.0,
                                "heldout_start_positions": 1}  # fmt: skip

    monkeypatch.setattr(side, "evaluate", scripted([2.0, 1.5, 1.8]))
    kept = _train(world, tmp_path / "kept", learning_rate=3e-3, epochs=2)
    assert kept["best_epoch"] == 0 and kept["simulated_acceptance_length"] == 2.0
    start, exported = load_file(SPECFORGE / "model.safetensors"), load_file(tmp_path / "kept" / "model.safetensors")
    assert all(torch.equal(exported[k], t) for k, t in start.items())
    monkeypatch.setattr(side, "evaluate", scripted([2.0, 1.5, 2.5]))
    beaten = _train(world, tmp_path / "beaten", learning_rate=3e-3, epochs=2)
    assert beaten["best_epoch"] == 2
    assert not torch.equal(load_file(tmp_path / "beaten" / "model.safetensors")["fc.weight"], start["fc.weight"])


def test_a_vocab_file_other_than_the_folders_is_refused(world, tmp_path) -> None:
    from aerie.formats.vocab import write_draft_vocab

    other = tmp_path / "counted.safetensors"
    d2t = torch.zeros(64, dtype=torch.int64)
    t2d = torch.zeros(160, dtype=torch.bool)
    t2d[:64] = True
    write_draft_vocab(other, d2t, t2d, torch.zeros(160, dtype=torch.int64), {})
    with pytest.raises(ValueError, match="not drafter.init's"):
        _train({**world, "vocab": other}, tmp_path / "out")
    with pytest.raises(DrafterFolderError, match=r"drafter.attention is 'mla'"):  # the loop checks the folder too
        _train(world, tmp_path / "out2", attention="mla")


def test_the_vocab_rule_takes_the_folders_maps(world, tmp_path) -> None:
    from aerie.formats.tokens import TOKENS_FORMAT
    from aerie.formats.vocab import load_draft_vocab
    from aerie.tools.artifacts import save_packed
    from aerie.vocab.draft_vocab import draft_vocab_from_folder

    tokens = tmp_path / "tokens.safetensors"
    ids = torch.randint(0, 160, (120,), generator=torch.Generator().manual_seed(3))
    meta = {"format": TOKENS_FORMAT, "sample_ids": ["a", "b"], "generation_prompt_ids": [], "stop_ids": []}
    meta["cut_sequences"] = []
    tensors = {"input_ids": ids.to(torch.int32), "loss_mask": torch.ones(120, dtype=torch.uint8)}
    save_packed(tokens, {**tensors, "seq_offsets": torch.tensor([0, 60, 120])}, meta)
    meta = draft_vocab_from_folder(
        [tokens], tmp_path / "v.safetensors", target_path=world["target"], init=str(SPECFORGE)
    )
    vocab = load_draft_vocab(tmp_path / "v.safetensors")
    assert torch.equal(vocab.d2t, world["d2t"]) and torch.equal(vocab.t2d, world["t2d"])
    assert meta["source"] == "drafter.init" and 0 < meta["coverage"] <= meta["coverage_if_counted"] <= 1


def test_the_pull_and_the_constant_schedule() -> None:
    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import lr_at
    from aerie.drafter.warm_start import StartPull

    model = torch.nn.Linear(4, 4)
    pull = StartPull(model, strength=10.0)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    pull.step(0.05)  # halfway back: w -= lr * strength * (w - start)
    assert torch.allclose(model.weight, start + 0.5)
    assert pull.distance() == pytest.approx(0.5 * 4)
    cfg = TrainConfig.of(learning_rate=1e-3, warmup_ratio=0.1, lr_schedule="constant", init="x")
    assert [lr_at(s, 100, cfg) for s in (50, 99)] == [1e-3, 1e-3] and lr_at(0, 100, cfg) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="drafter.lr_schedule"):
        TrainConfig.of(lr_schedule="linear")
    with pytest.raises(ValueError, match="drafter.init_pull pulls toward .* not set"):
        TrainConfig.of(init_pull=0.1)


def test_parse_time_refuses_a_folder_that_does_not_fit_and_previews_one_that_does(tmp_path, monkeypatch) -> None:
    """check_config (what the Snakefile runs in every parse) on the demo config with drafter.init set."""
    import yaml

    from aerie.plan.config_file import ConfigError
    from aerie.plan.drafters import planned_drafters
    from aerie.plan.resolve import check_config
    from aerie.preview.drafters import init_preview_text

    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["drafter"]["init"] = str(SPECFORGE)  # hidden 32: not the demo target's 256
    with pytest.raises(ConfigError, match=r"target of hidden size 32 .*the target has 256") as e:
        check_config(config)
    assert e.value.path[:2] == ("drafter", "init")
    # a folder that fits the toy target: preview wording of the dry run
    config = {
        "run": "ws",
        "target": {"path": str(SPECFORGE / "target")},
        "hidden": {"aux_layer_ids": SF_AUX},
        "vocab": {"draft_vocab_size": 64},
        "drafter": {"init": str(SPECFORGE)},
    }
    text = init_preview_text(planned_drafters(config)[0])
    assert "training starts from every one of its tensors" in text and "taken from its d2t/t2d (64 ids)" in text
    config["drafter"]["init"] = "someone/absent-drafter"
    assert "is NOT here - a real run refuses to start" in init_preview_text(planned_drafters(config)[0])


# ---- bench/warm_start.py: its table and its refusal to mix settings -------------------------------------------


def _seed_result(ws, seed: int, warm: float, scratch: float, published: float = 2.0) -> dict:
    method = {"tokens_per_s": 10.0, "speedup": 1.0, "lossless": True}
    accs = {"published": published, "scratch": scratch, "warm": warm, "ngram": 1.3}
    train = {"wall_seconds": 1.0, "optimizer_steps": 8, "best_epoch": 2, "heldout_simulated_acceptance": 2.0,
             "untrained_simulated_acceptance": 1.0, "tokens_per_s": 100.0}  # fmt: skip
    sets = {
        s: {"prompts": 4, "baseline_tokens_per_s": 10.0, "methods": {m: {**method, "acceptance_length": a + d}
            for m, a in accs.items()}} for s, d in (("general", 0.5), ("domain", 0.0))
    }  # fmt: skip
    meta = {"coverage": 0.99}
    return {
        "format": ws.FORMAT,
        "seed": seed,
        "study": "covered",
        "general_families": ["arith", "lists", "code"],
        "recipes": {"published": ws.PUBLISH, **ws.ARMS},
        "bench_settings": ws.BENCH,
        "draft_vocab_size": ws.DRAFT_VOCAB,
        "data": {
            "general": {"sequences": 10, "generated_tokens": 500},
            "domain": {"sequences": 3, "generated_tokens": 90},
            "vocab": {"scratch": meta, "warm": meta},
        },  # fmt: skip
        "train": {"scratch": train, "warm": train},
        "sets": sets,
        "code": "abc1234",
        "machine": {"loadavg": {"before": [1.0] * 3, "after_bench": [2.0] * 3}, "cpu_count": 2},
    }


def test_the_warm_start_table_is_the_paired_comparison_per_set(tmp_path) -> None:
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import warm_start as ws

    for seed, (warm, scratch) in enumerate([(2.6, 2.1), (2.5, 2.2), (2.7, 2.0)]):
        (tmp_path / f"seed-{seed}.json").write_text(json.dumps(_seed_result(ws, seed, warm, scratch)))
    text = ws.warm_start_table(tmp_path)
    assert "| `warm` | 3.100 ± 0.100 | 2.600 ± 0.100 |" in text  # general, domain
    assert "| warm - scratch | domain | +0.500 [" in text and "| warm - published | domain | +0.600 [" in text
    assert "every decode lossless: True" in text
    # a seed file of another recipe is refused, never mixed in
    other = _seed_result(ws, 9, 2.0, 2.0)
    other["recipes"]["warm"] = {**other["recipes"]["warm"], "learning_rate": 1.0}
    (tmp_path / "seed-9.json").write_text(json.dumps(other))
    (tmp_path / "publisher").mkdir()
    (tmp_path / "publisher" / "study.yaml").write_text(json.dumps({"target": {"path": "t"}}))
    with pytest.raises(SystemExit, match="other settings"):
        ws.run_all(argparse_ns(work=tmp_path, study="covered", seeds=[9], out=tmp_path, threads=1, arms=None))


def test_the_levers_table_compares_each_lever_with_the_plain_warm_start(tmp_path) -> None:
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import warm_start as ws

    arms = ["warm", "warm-pull", "warm-short"]
    for seed, (warm, pull) in enumerate([(2.6, 2.9), (2.5, 2.7), (2.7, 2.8)]):
        r = _seed_result(ws, seed, warm, 2.0)
        r["recipes"] = ws.recipes(arms)
        r["train"] = {a: r["train"]["warm"] for a in arms}
        for st in r["sets"].values():
            base = st["methods"].pop("scratch")
            st["methods"]["warm-pull"] = {
                **base,
                "acceptance_length": pull + (st["methods"]["warm"]["acceptance_length"] - warm),
            }
            st["methods"]["warm-short"] = dict(st["methods"]["warm"])
        (tmp_path / f"seed-{seed}.json").write_text(json.dumps(r))
    text = ws.warm_start_table(tmp_path)
    assert "| `warm-pull` | 3.300 ± 0.100 | 2.800 ± 0.100 |" in text and "`scratch`" not in text
    assert "| warm-pull - warm | domain | +0.200 [" in text and "| warm-pull - published | domain | +0.800 [" in text
    assert "warm-pull ttt_steps 3" in text and "init_pull 30.0" in text
    # a run of other arms into the same folder is refused
    (tmp_path / "publisher").mkdir()
    (tmp_path / "publisher" / "study.yaml").write_text(json.dumps({"target": {"path": "t"}}))
    with pytest.raises(SystemExit, match="other settings"):
        ws.run_all(argparse_ns(work=tmp_path, study="covered", seeds=[0], out=tmp_path, threads=1, arms=["warm"]))


def argparse_ns(**kw):
    import argparse

    return argparse.Namespace(**kw)


def test_an_mla_folder_in_deepseek_spelling_loads_with_the_served_layers(tmp_path) -> None:
    """A published Kimi-style MLA drafter: ids [2, 4, 5] (no +1 on DeepSeek/Kimi targets) are the outputs [1, 3, 4],
    which is what the in-process benchmark then captures (cfg.aux_layer_ids)."""
    from types import SimpleNamespace

    tc = SimpleNamespace(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=160, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_theta=50000.0, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(tc, 64, [1, 3, 4]))
    drafter.save_pretrained(tmp_path / "mla")
    edit_config(tmp_path / "mla", aerie=None, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})
    target = tmp_path / "target"
    target.mkdir()
    text = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "hidden_size": 32, "vocab_size": 160}
    (target / "config.json").write_text(
        json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text})
    )
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "mla", target=target)
    assert loaded.cfg == drafter.cfg and loaded.cfg.aux_layer_ids == [1, 3, 4]
    with pytest.raises(DrafterFolderError, match=r"outputs of layers \[2, 4, 5\]"):
        check_drafter_folder(read_drafter_folder(tmp_path / "mla"), aux_layer_ids=[1, 3, 4], num_hidden_layers=8)


# ---- issue 37: the folder's messages, EAGLE 3.1 from a folder, a vocabulary that follows the data ------------


def test_folder_messages_name_what_is_actually_there(tmp_path) -> None:
    """The dry run says when the folder's own embeddings are dropped; a speculators folder is refused naming its
    real differences (no "biased fc" without an fc.bias); 4 aux ids against a 3-wide fc name both figures."""
    with_embed = copy_folder(SPECFORGE, tmp_path / "embed")
    edit_tensors(with_embed, lambda s: {**s, "embed_tokens.weight": torch.zeros(160, 32, dtype=torch.bfloat16)})
    assert (
        "its own embed_tokens [160, 32] are dropped: SGLang swaps in the target's"
        in read_drafter_folder(with_embed).describe()
    )
    assert "no embed_tokens: the target's are used" in read_drafter_folder(SPECFORGE).describe()
    from aerie.drafter.config import TrainConfig
    from aerie.drafter_kinds.eagle3 import KIND

    preview = KIND.init_preview(with_embed, TrainConfig.of(fc_norm=True, norm_output=True).kind_settings)
    assert "are dropped: SGLang swaps in the target's" in preview[0]
    assert (
        preview[-1]
        == "EAGLE 3.1: fc_norm, norm_output switched on, which the folder lacks; its 3 fc_norm weights start at 1"
    )

    spec = copy_folder(SPECFORGE, tmp_path / "speculators")
    edit_config(spec, speculators_model_type="eagle3", architectures=None, transformer_layer_config={"x": 1})
    edit_tensors(spec, lambda s: {k.replace("midlayer.", "layers.0."): v for k, v in s.items()})
    with pytest.raises(DrafterFolderError) as e:
        read_drafter_folder(spec)
    text = "\n".join(e.value.problems)
    assert "speculators_model_type 'eagle3'" in text and "transformer_layer_config" in text
    assert "named layers.N.* (e.g. layers.0." in text and "bias" not in text
    edit_tensors(spec, lambda s: {**s, "fc.bias": torch.zeros(32, dtype=torch.bfloat16)})
    with pytest.raises(DrafterFolderError, match=r"it has fc.bias \[32\]: SGLang's fc has no bias"):
        read_drafter_folder(spec)

    four = copy_folder(SPECFORGE, tmp_path / "four")
    edit_config(four, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]})
    with pytest.raises(DrafterFolderError) as e:
        sf_check(four)
    text = "\n".join(e.value.problems)
    assert "4 eagle_config ids [1, 2, 3, 4]; fc.weight [32, 96] = 3 x hidden 32" in text
    assert "names 4 aux layer ids [1, 2, 3, 4], but fc.weight [32, 96] reads 3" in text


def test_eagle31_switches_from_an_eagle3_folder_start_at_one_and_export_sglangs_keys(world, tmp_path) -> None:
    from aerie.drafter.config import TrainConfig
    from aerie.drafter_kinds.eagle3.training import export, start_from_folder
    from aerie.formats.vocab import load_draft_vocab

    settings = TrainConfig.of(init=str(SPECFORGE), fc_norm=True, norm_output=True).kind_settings
    vocab = load_draft_vocab(world["vocab"])
    model = start_from_folder(str(SPECFORGE), world["target"], vocab, SF_AUX, settings, torch.randn(160, 32))
    assert model.cfg.fc_norm and model.cfg.norm_output
    assert all(torch.equal(n.weight, torch.ones(32)) for n in model.fc_norm)
    export(model, tmp_path / "out", {}, SF_AUX)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(stored)
    start = load_file(SPECFORGE / "model.safetensors")
    assert all(torch.equal(stored[k], t) for k, t in start.items())  # every other tensor is the folder's
    again = Eagle3Drafter.from_pretrained(tmp_path / "out", target=world["target"])
    assert again.cfg.fc_norm and again.cfg.norm_output
    trained = _train(world, tmp_path / "trained", fc_norm=True, norm_output=True, learning_rate=3e-3)
    assert trained["optimizer_steps"] > 0
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["fc_norm"] is True


def _tokens_shard(path: Path, ids: torch.Tensor) -> Path:
    from aerie.formats.tokens import TOKENS_FORMAT
    from aerie.tools.artifacts import save_packed

    n = len(ids)
    meta = {"format": TOKENS_FORMAT, "sample_ids": ["a"], "generation_prompt_ids": [], "stop_ids": []}
    meta["cut_sequences"] = []
    tensors = {"input_ids": ids.to(torch.int32), "loss_mask": torch.ones(n, dtype=torch.uint8)}
    save_packed(path, {**tensors, "seq_offsets": torch.tensor([0, n])}, meta)
    return path


def test_follow_data_keeps_used_ids_and_replaces_unused_by_the_most_frequent_missing() -> None:
    from aerie.vocab.draft_vocab import follow_data

    counts = torch.zeros(12, dtype=torch.int64)
    counts[[1, 3]] = 5  # used folder ids
    counts[[8, 9, 10]] = torch.tensor([2, 7, 7])  # missing from the folder: 9 and 10 most frequent (tie: lower id)
    new, change = follow_data(torch.tensor([1, 3, 4, 5]), counts)
    assert new.tolist() == [1, 3, 9, 10] and change["replaced"] == 2 and change["kept"] == 2
    assert change["dropped_ids"] == [5, 4]  # the highest unused ids go first
    few = torch.zeros(12, dtype=torch.int64)
    few[[1, 11]] = 1  # one missing id for three unused: one replaced, two unused kept
    new, change = follow_data(torch.tensor([1, 3, 4, 5]), few)
    assert new.tolist() == [1, 3, 4, 11] and change["replaced"] == 1


def test_a_followed_vocab_trains_from_the_folder_with_remapped_rows(world, tmp_path) -> None:
    from aerie.drafter.config import TrainConfig
    from aerie.drafter_kinds.eagle3.training import start_from_folder
    from aerie.formats.vocab import load_draft_vocab
    from aerie.target_model.heads import read_target_heads
    from aerie.vocab.draft_vocab import draft_vocab_from_folder
    from aerie.vocab.settings import VocabSettings

    folder_ids = (torch.arange(64) + world["d2t"]).tolist()
    outside = [i for i in range(160) if i not in set(folder_ids)][:5]
    ids = torch.tensor((folder_ids[:20] + outside) * 4)  # 5 ids the folder lacks, 44 of its ids never used
    tokens = _tokens_shard(tmp_path / "tokens.safetensors", ids)

    def follow_below(limit: float, out: str) -> dict:
        settings = VocabSettings(warm_start="auto", follow_below=limit)
        return draft_vocab_from_folder(
            [tokens], tmp_path / out, target_path=world["target"], init=str(SPECFORGE), settings=settings
        )

    keep = follow_below(0.7, "k.safetensors")
    assert keep["source"] == "drafter.init" and keep["coverage"] == pytest.approx(0.8)  # 0.8 >= 0.7: kept
    meta = follow_below(0.9, "f.safetensors")
    assert meta["coverage_before"] == pytest.approx(0.8) and meta["coverage"] == 1.0 and meta["replaced"] == 5
    assert "target's lm_head row" in meta["new_row_rule"]
    vocab = load_draft_vocab(tmp_path / "f.safetensors")
    assert set(outside) <= set(vocab.target_ids.tolist())
    settings = TrainConfig.of(init=str(SPECFORGE)).kind_settings
    model = start_from_folder(str(SPECFORGE), world["target"], vocab, SF_AUX, settings, torch.randn(160, 32))
    folder_rows = load_file(SPECFORGE / "model.safetensors")["lm_head.weight"].float()
    target_rows = read_target_heads(world["target"], ["lm_head"]).lm_head.float()
    for row, tid in enumerate(vocab.target_ids.tolist()):
        want = target_rows[tid] if tid in outside else folder_rows[folder_ids.index(tid)]
        assert torch.equal(model.lm_head.weight[row].float(), want), tid
    assert torch.equal(model.d2t, vocab.d2t)
    moved = _train({**world, "vocab": tmp_path / "f.safetensors"}, tmp_path / "out", learning_rate=3e-3)
    assert moved["optimizer_steps"] > 0
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["d2t"], vocab.d2t)


def test_vocab_settings_are_checked_by_name() -> None:
    from aerie.vocab.settings import VocabSettings

    assert VocabSettings.of({"warm_start": "auto", "follow_below": 0.95}).follows(0.9)
    assert not VocabSettings.of({"warm_start": "auto", "follow_below": 0.95}).follows(0.96)
    assert VocabSettings(warm_start="follow").follows(1.0) and not VocabSettings().follows(0.1)
    with pytest.raises(ValueError, match=r"vocab.warm_start must be one of keep, follow, auto.*booleans"):
        VocabSettings.of({"warm_start": True})
    with pytest.raises(ValueError, match="vocab.follow_below is a coverage"):
        VocabSettings.of({"follow_below": 1.5})
    with pytest.raises(ValueError, match="vocab.nope is not a setting"):
        VocabSettings.of({"nope": 1})


def _dataset_shards(world, root: Path) -> list[Path]:
    """The world's shard under two dataset names, as the pipeline lays them out (results/DATASET/hidden/)."""
    out = []
    for name in ("domain", "general"):
        path = root / "results" / name / "hidden" / "shard-00000.safetensors"
        path.parent.mkdir(parents=True)
        shutil.copy(world["shards"][0], path)
        out.append(path)
    return out


def test_replay_and_the_traffic_weighted_choice(world, tmp_path) -> None:
    """replay_share mixes that share of every epoch from the replay dataset (new windows each epoch); share 0 keeps
    it held out only; heldout_weights choose the epoch on the weighted per-dataset figure, with its half-width."""
    from aerie.drafter.config import TrainConfig
    from aerie.drafter.loop import train_drafter
    from aerie.drafter.traffic import floor_message, heldout_halfwidth

    shards = _dataset_shards(world, tmp_path)

    def train(out: str, **over) -> dict:
        cfg = TrainConfig.of(**{**TRAIN, "init": str(SPECFORGE), "learning_rate": 3e-3, "epochs": 2, **over})
        return train_drafter(shards, world["vocab"], world["target"], tmp_path / out, cfg, log=lambda _: None)

    plain = train("plain")
    replay = train("replay", replay_dataset="general", replay_share=0.5)
    held = train("held", replay_dataset="general", replay_share=0.0)
    own = replay["windows"]["replay"]["own_windows_per_epoch"]
    assert replay["windows"]["replay"]["windows_per_epoch"] == own  # share 0.5: one replay window per own one
    assert held["windows"]["replay"]["windows_per_epoch"] == 0
    # without replay every dataset trains whole; share 0.5 draws as many general windows as domain ones (here all)
    assert plain["optimizer_steps"] == replay["optimizer_steps"] > held["optimizer_steps"]
    weighted = train("weighted", heldout_weights={"domain": 0.7, "general": 0.3})
    start = weighted["untrained"]
    assert set(weighted["epochs"][0]["by_dataset"]) == {"domain", "general"}
    assert weighted["selection"]["heldout_weights"] == {"domain": 0.7, "general": 0.3}
    halfwidth = weighted["selection"]["halfwidth_95"]
    assert halfwidth == pytest.approx(heldout_halfwidth(start["by_dataset"], start["weights"])) and halfwidth > 0
    starts = start["heldout_start_positions"]
    assert weighted["selection"]["floor_warning"] == floor_message(halfwidth, starts)
    # the same spread over a tenth of the starts is too wide to tell drafters 0.05 apart, and says so
    assert "raise drafter.eval_fraction" in floor_message(max(halfwidth, 0.1), starts // 10)
    parts = weighted["epochs"][0]["by_dataset"]
    assert weighted["epochs"][0]["simulated_acceptance_length"] == pytest.approx(
        0.7 * parts["domain"]["simulated_acceptance_length"] + 0.3 * parts["general"]["simulated_acceptance_length"]
    )
    assert start["simulated_acceptance_length"] is not None
    said = []  # an optional replay source that planned no shard: a warning, and no replay
    cfg = TrainConfig.of(**{**TRAIN, "init": str(SPECFORGE), "replay_dataset": "kimi_mtp", "replay_share": 0.2})
    absent = train_drafter(shards, world["vocab"], world["target"], tmp_path / "absent", cfg, log=said.append)
    assert "replay" not in absent["windows"] or absent["windows"]["replay"]["pool_windows"] == 0
    assert any("drafter.replay_dataset 'kimi_mtp' has no hidden shard" in line for line in said)
    with pytest.raises(ValueError, match=r"drafter.replay_share must be in \[0, 1\)"):
        TrainConfig.of(replay_dataset="general", replay_share=1.0)
    with pytest.raises(ValueError, match="drafter.heldout_weights.domain: a weight is a number >= 0"):
        TrainConfig.of(heldout_weights={"domain": -1})


def _recipe_seed(ws, seed: int, accs: dict, study: str = "shifted") -> dict:
    """A format-2 seed file: accs = method -> (general, domain)."""
    arms = [m for m in accs if m not in ("published", "ngram")]
    method = {"tokens_per_s": 10.0, "speedup": 1.0, "lossless": True}
    sets = {
        s: {"prompts": 16, "baseline_tokens_per_s": 10.0,
            "methods": {m: {**method, "acceptance_length": a[i]} for m, a in accs.items()}}
        for i, s in enumerate(("general", "domain"))
    }  # fmt: skip
    train = {"wall_seconds": 1.0, "optimizer_steps": 8, "best_epoch": 6, "heldout_simulated_acceptance": 2.0,
             "untrained_simulated_acceptance": 1.0, "tokens_per_s": 100.0,
             "selection": {"halfwidth_95": 0.2}}  # fmt: skip
    vocab = {"coverage": 0.9, "coverage_before": 0.95, "replaced": 10}
    about = {"sequences": 10, "generated_tokens": 500}
    return {
        "format": ws.FORMAT2, "seed": seed, "study": study, "general_families": ws.STUDIES[study],
        "recipes": ws.recipes(arms, levers=True), "traffic": ws.TRAFFIC, "bench_settings": ws.BENCH,
        "draft_vocab_size": ws.DRAFT_VOCAB,
        "data": {"general": about, "domain": about, "replay": about, "publisher_seed": seed % 3,
                 "vocab": {"scratch": vocab, "warm": vocab, "follow": vocab}},
        "train": {a: {**train, **({"replay": {"windows_per_epoch": 40, "pool_windows": 86,
                                              "own_windows_per_epoch": 40, "share": 0.5}} if a == "recipe" else {})}
                  for a in arms},
        "sets": sets, "code": "abc1234",
        "machine": {"loadavg": {"before": [1.0] * 3, "after_bench": [2.0] * 3}, "cpu_count": 2},
    }  # fmt: skip


def test_the_recipe_table_checks_the_issues_goals_honestly(tmp_path) -> None:
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import warm_start as ws

    for seed in range(5):
        jitter = 0.01 * seed
        accs = {
            "published": (3.0, 1.1),
            "scratch": (1.1, 2.6 + jitter),
            "warm": (2.1, 2.2),
            "recipe": (2.9 - jitter, 2.7),  # above scratch on the domain, below published on the general set
            "ngram": (1.3, 1.2),
        }
        (tmp_path / f"seed-{seed}.json").write_text(json.dumps(_recipe_seed(ws, seed, accs)))
    text = ws.warm_start_table(tmp_path)
    mix = 0.3 * 2.88 + 0.7 * 2.7  # the traffic mix of the recipe's mean
    assert f"| `recipe` | 2.880 ± 0.016 | 2.700 ± 0.000 | {mix:.3f} ± " in text
    assert "| recipe >= scratch on the domain set |" in text and "| recipe >= published on the general set |" in text
    goal_rows = [line for line in text.splitlines() if line.startswith("| recipe >= ")]
    assert goal_rows[0].endswith("**holds** |") and goal_rows[1].endswith("**does not hold** |")
    assert "0 of 5 above" in goal_rows[1] and "sign-flip p 0.062" in goal_rows[1]
    assert "publisher seed of each (the published drafter it starts from and is paired with): 0/1/2/0/1" in text
    assert "vocab follows the data, replay_share 0.5, traffic {" in text and "10/10/10/10/10 ids replaced" in text


def test_a_later_run_of_more_arms_is_merged_only_when_it_measured_the_same(tmp_path) -> None:
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import warm_start as ws

    base, extra = tmp_path / "base", tmp_path / "extra"
    base.mkdir(), extra.mkdir()
    first = {"published": (3.0, 1.1), "recipe": (2.9, 2.7), "ngram": (1.3, 1.2)}
    (base / "seed-0.json").write_text(json.dumps(_recipe_seed(ws, 0, first)))
    later = {"published": (3.0, 1.1), "recipe-eagle31": (2.95, 2.75), "ngram": (1.3, 1.2)}
    (extra / "seed-0.json").write_text(json.dumps(_recipe_seed(ws, 0, later)))
    ws.merge_arms(extra, base)
    merged = json.loads((base / "seed-0.json").read_text())
    assert list(merged["recipes"]) == ["published", "recipe", "recipe-eagle31"]
    assert merged["sets"]["domain"]["methods"]["recipe-eagle31"]["acceptance_length"] == 2.75
    assert "| recipe-eagle31 - recipe | domain | +0.050 (one seed: no test) |" in ws.warm_start_table(base)
    other = {**later, "published": (3.1, 1.1)}  # another measurement of the published drafter: refused
    (extra / "seed-0.json").write_text(json.dumps(_recipe_seed(ws, 0, other)))
    with pytest.raises(SystemExit, match="published measured 3.1 on general"):
        ws.merge_arms(extra, base)
