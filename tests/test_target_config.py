"""aerie.target.config: the one reader of a target's config.json (torch-free) and SGLang's aux-layer rules."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, snakemake

from aerie.target.config import (
    architectures,
    check_servable_aux_layer_ids,
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
