"""aerie.target_model.config: the one reader of a target's config.json (torch-free) and SGLang's aux-layer rules."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, snakemake

from aerie.hidden.settings import CaptureSettings
from aerie.target_model.config import (
    architectures,
    check_servable_aux_layer_ids,
    default_aux_layer_ids,
    is_mla,
    read_text_config,
    resolve_aux_layer_ids,
    target_architectures,
    target_num_hidden_layers,
    text_config,
)

KIMI_LIKE = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "vocab_size": 163840,
    },
    "vision_config": {"hidden_size": 1152},
}


def test_a_wrapped_text_config_is_read_the_same_way_everywhere(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LIKE))
    assert text_config(KIMI_LIKE)["hidden_size"] == 7168 == read_text_config(tmp_path)["hidden_size"]
    assert target_num_hidden_layers(tmp_path) == 61
    assert (
        architectures(KIMI_LIKE)
        == target_architectures(tmp_path)
        == ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"]
    )
    assert is_mla(KIMI_LIKE) and not is_mla({"hidden_size": 64, "num_hidden_layers": 2})
    assert text_config({"hidden_size": 64})["hidden_size"] == 64  # an unwrapped config is its own text config


def test_missing_config_names_the_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_text_config(tmp_path)


def test_one_aux_layer_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="at least two.*skips its fc"):
        check_servable_aux_layer_ids([3], 8)
    with pytest.raises(ValueError, match="at least two"):
        resolve_aux_layer_ids([1], 61, ["KimiK25ForConditionalGeneration"])
    assert resolve_aux_layer_ids(None, 61, ["KimiK25ForConditionalGeneration"]) == [1, 29, 57]


def test_one_aux_layer_fails_the_dry_run(workdir) -> None:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["hidden"]["aux_layer_ids"] = [3]
    (workdir / "c.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(workdir, "-n", "--configfile", str(workdir / "c.yaml"), timeout=300)
    assert proc.returncode != 0
    assert "hidden.aux_layer_ids" in proc.stderr + proc.stdout and "at least two" in proc.stderr + proc.stdout


# ---------------------------------------------------------------------------------------------------------
# DeepSeek/Kimi-family ids: SGLang 0.5.23's DeepseekV2ForCausalLM.set_eagle3_layers_to_capture adds 1 to the
# ids only when the first one is 1 (else it captures the ids' own inputs, one layer early). Every path that
# takes aux ids refuses such ids for these targets before anything is loaded or spent.

DEEPSEEK_FAMILY = [
    ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"],
    ["KimiK25ForConditionalGeneration"],
    ["DeepseekV3ForCausalLM"],
    ["DeepseekV2ForCausalLM"],
    ["DeepseekV32ForCausalLM"],
    ["SomeWrapperForConditionalGeneration", "DeepseekV3ForCausalLM"],  # a wrapper known by its text model only
]
NOT_STARTING_AT_ONE = ([0, 29, 57], [0, 1, 57], [2, 30, 58])


@pytest.mark.parametrize("archs", DEEPSEEK_FAMILY, ids=lambda a: "+".join(a))
@pytest.mark.parametrize("ids", NOT_STARTING_AT_ONE, ids=str)
def test_deepseek_family_ids_not_starting_at_one_are_refused(archs, ids) -> None:
    with pytest.raises(ValueError, match=r"do not start with 1: SGLang's \w+ adds 1"):
        check_servable_aux_layer_ids(ids, 61, archs)
    with pytest.raises(ValueError, match="do not start with 1"):
        resolve_aux_layer_ids(ids, 61, archs)
    assert check_servable_aux_layer_ids([1, 29, 57], 61, archs) == [1, 29, 57]


def test_other_models_take_any_first_id() -> None:
    for ids in NOT_STARTING_AT_ONE:
        assert check_servable_aux_layer_ids(ids, 61, ["LlamaForCausalLM"]) == list(ids)
        assert check_servable_aux_layer_ids(ids, 61, ["Qwen3ForCausalLM"]) == list(ids)


@pytest.mark.parametrize("layers", [8, 32, 61, 80])
def test_default_ids_are_what_sglang_captures_when_a_drafter_names_none(layers) -> None:
    """With no ids SGLang 0.5.23 captures the inputs of layers [2, L//2, L-3] (llama.py, deepseek_v2.py): the
    outputs [1, L//2-1, L-4], which start with 1 and so mean the same layers for the DeepSeek family too."""
    from aerie.target_model.config import captured_output_ids, predicted_capture_inputs

    sglang_default_inputs = [2, layers // 2, layers - 3]
    ids = default_aux_layer_ids(layers)
    assert ids == captured_output_ids(sglang_default_inputs)
    for archs in DEEPSEEK_FAMILY + [["LlamaForCausalLM"]]:
        assert resolve_aux_layer_ids(None, layers, archs) == ids
        assert predicted_capture_inputs(archs, ids) == sglang_default_inputs


def kimi_like_folder(root, layers: int = 8):
    """A Kimi-K2.5-shaped target folder with nothing but its config.json (no weights): whatever refuses the ids
    must do so before it would load anything."""
    root.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(KIMI_LIKE))
    config["text_config"].update(num_hidden_layers=layers, hidden_size=64, vocab_size=300)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_parse_time_refuses_a_local_kimi_target_with_ids_from_zero(tmp_path) -> None:
    from aerie.plan.config_file import ConfigError
    from aerie.plan.resolve import check_config

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"] = {"path": str(kimi_like_folder(tmp_path / "kimi", 61)), "device": "cpu", "dtype": "float32"}
    config["hidden"]["aux_layer_ids"] = [0, 29, 57]
    with pytest.raises(ConfigError, match=r"^hidden\.aux_layer_ids: aux layer ids \[0, 29, 57\] do not start with 1"):
        check_config(config)
    config["hidden"]["aux_layer_ids"] = [1, 29, 57]
    check_config(config)


def test_parse_time_refuses_the_rehearsal_target_with_ids_from_zero() -> None:
    """The rehearsal target is built by the pipeline: parse time knows its architectures before the folder exists."""
    from aerie.plan.config_file import ConfigError
    from aerie.plan.resolve import check_config

    config = yaml.safe_load((REPO / "config" / "kimi-rehearsal.yaml").read_text())
    assert config["target"].get("rehearsal") is not None
    layers = config["target"]["rehearsal"].get("num_hidden_layers", 8)
    config["hidden"]["aux_layer_ids"] = [0, layers // 2 - 1, layers - 4]
    with pytest.raises(ConfigError, match="do not start with 1"):
        check_config(config)


def test_the_capture_job_refuses_kimi_ids_from_zero_before_loading(tmp_path) -> None:
    from aerie.hidden.backends import TargetSession
    from aerie.hidden.run import ShardTask, capture_shards
    from aerie.hidden.shard import capture_shard

    target = kimi_like_folder(tmp_path / "kimi")
    tokens = tmp_path / "tokens.safetensors"  # never read: the ids are refused first
    for call in (
        lambda: TargetSession(str(target), aux_layer_ids=[0, 3, 4], log=lambda _: None),
        lambda: capture_shard(
            tokens, tmp_path / "h.safetensors", str(target), CaptureSettings(aux_layer_ids=[0, 3, 4]), log=print
        ),
        lambda: capture_shards(
            [ShardTask(tokens, tmp_path / "h.safetensors")],
            str(target),
            CaptureSettings(aux_layer_ids=[0, 3, 4]),
            log=print,
        ),
    ):
        with pytest.raises(ValueError, match=r"\[0, 3, 4\] do not start with 1"):
            call()
    assert not (tmp_path / "h.safetensors").exists() and not (tmp_path / "captured").exists()
    session = TargetSession(str(target), aux_layer_ids=None, log=lambda _: None)  # SGLang's default: [1, 3, 4]
    assert session.layer_ids == [1, 3, 4] and session.loads == 0


def test_the_drafter_job_refuses_kimi_ids_from_zero_before_training(tmp_path) -> None:
    from aerie.drafter.cli import run_training_job
    from aerie.drafter.config import TrainConfig

    target = kimi_like_folder(tmp_path / "kimi")
    with pytest.raises(ValueError, match=r"\[0, 3, 4\] do not start with 1"):
        run_training_job(
            [tmp_path / "hidden.safetensors"],  # never read: the ids are refused first
            tmp_path / "vocab.safetensors",
            target,
            tmp_path / "drafter",
            TrainConfig.of(),
            gpus=0,
            configured_aux_layer_ids=[0, 3, 4],
            log=lambda _: None,
            log_path=tmp_path / "drafter.log",
        )
    assert not (tmp_path / "drafter").exists()


def test_parse_time_refuses_the_kimi_config_with_ids_from_zero_before_its_folder_is_here(monkeypatch) -> None:
    """config/kimi-k2.5.yaml as shipped, target folder absent: its target.config_json names the architectures, so
    ids from 0 are refused by the dry run (they were accepted when only num_hidden_layers was known)."""
    from aerie.plan.config_file import ConfigError
    from aerie.plan.resolve import check_config

    monkeypatch.chdir(REPO)
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    assert not (REPO / config["target"]["path"] / "config.json").exists()
    config["hidden"]["aux_layer_ids"] = [0, 29, 57]
    with pytest.raises(ConfigError, match=r"^hidden\.aux_layer_ids: aux layer ids \[0, 29, 57\] do not start with 1"):
        check_config(config)
    config["hidden"]["aux_layer_ids"] = [1, 29, 57]
    check_config(config)


def test_training_by_hand_refuses_kimi_ids_from_zero(tmp_path, capsys) -> None:
    from aerie.drafter.cli import main

    target = kimi_like_folder(tmp_path / "kimi")
    args = ["--hidden", str(tmp_path / "h.safetensors"), "--vocab", str(tmp_path / "v.safetensors")]
    with pytest.raises(SystemExit, match=r"--aux-layer-ids: aux layer ids \[0, 3, 4\] do not start with 1"):
        main([*args, "--target", str(target), "--out", str(tmp_path / "drafter"), "--aux-layer-ids", "[0, 3, 4]"])
    assert not (tmp_path / "drafter").exists()
