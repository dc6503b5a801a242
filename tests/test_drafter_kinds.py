"""bench/drafter_kinds.py: its study config is the rehearsal's and passes the schema, a finished kind x seed is never
recomputed nor mixed with another recipe, and its RESULTS table (bench/tables.py) is the paired comparison of the
committed per-seed results."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import drafter_kinds  # noqa: E402
import paired_stats  # noqa: E402


def result(kind: str, seed: int, simulated: float, measured: float, ngram: float = 1.6) -> dict:
    method = {"acceptance_per_position": [0.5], "tokens_per_s": 10.0, "speedup": 1.0, "lossless": True}
    return {
        "format": drafter_kinds.FORMAT,
        "kind": kind,
        "seed": seed,
        "recipe": {**drafter_kinds.RECIPE, "threads": 1},
        "bench_settings": drafter_kinds.BENCH,
        "data": {
            "fingerprint": {"hidden_shards": [["a", 1, "ab"]]},
            "sequences": 10,
            "tokens": 1000,
            "generated_tokens": 400,
            "heldout_sequences": 1,
            "bench_prompts": 4,
        },
        "drafter": {
            "architecture": "Eagle3DeepseekV2ForCausalLM" if kind == "mla" else "LlamaForCausalLMEagle3",
            "params": {"trainable": 100, "attention": 10},
            "serving_kv_bytes_per_token_bf16": 160,
        },
        "train": {"tokens_per_s": 500.0, "peak_rss_mib": 600.0, "peak_rss_growth_mib": 300.0},
        "simulated": {"acceptance_length": simulated, "acceptance_per_position": [simulated - 1.0, 0.0, 0.0]},
        "bench": {
            "lossless": True,
            "methods": {
                "eagle3": {**method, "acceptance_length": measured},
                "untrained": {**method, "acceptance_length": 1.0},
                "ngram": {**method, "acceptance_length": ngram},
            },
        },
        "code": "abc1234",
        "machine": {
            "loadavg": {"before": [1.0, 1.0, 1.0], "after_bench": [2.0, 2.0, 2.0]},
            "cpu_count": 2,
            "date": f"2026-01-0{seed + 1} 00:00:00",
        },
    }


def write(out: Path, r: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    drafter_kinds.result_path(out, r["kind"], r["seed"]).write_text(json.dumps(r))


def test_the_study_data_is_the_rehearsals_target_and_sampling_and_passes_the_schema(tmp_path) -> None:
    from aerie.plan.config_file import ConfigSources
    from aerie.plan.resolve import check_config, validate_config

    rehearsal = yaml.safe_load((REPO / "config" / "kimi-rehearsal.yaml").read_text())
    config = drafter_kinds.study_config(prompts=40, bench_prompts=8)
    assert config["target"] == rehearsal["target"]  # the same build settings: the same target
    for key in ("temperature", "top_p", "max_new_tokens"):
        assert config["responses"][key] == rehearsal["responses"][key]
    for key in ("aux_layer_ids", "layout", "backend"):
        assert config["hidden"][key] == rehearsal["hidden"][key]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    checked = copy.deepcopy(config)
    validate_config(checked, ConfigSources.read([path]))
    check_config(checked)


def test_a_finished_kind_and_seed_is_never_recomputed_nor_mixed_with_another_recipe(tmp_path, monkeypatch) -> None:
    out = tmp_path / "out"
    for kind in drafter_kinds.KINDS:
        write(out, result(kind, 0, 3.0, 2.8))

    def no_training(*args, **kwargs):
        raise AssertionError(f"recomputed a finished result: {args}")

    monkeypatch.setattr(drafter_kinds.subprocess, "run", no_training)
    args = argparse.Namespace(seeds=[0], kinds=list(drafter_kinds.KINDS), out=out, work=tmp_path, threads=1)
    drafter_kinds.run_all(args)  # both finished: nothing runs

    other = result("mla", 0, 3.0, 2.8)
    other["recipe"]["epochs"] += 1
    write(out, other)
    with pytest.raises(SystemExit, match="recipe"):
        drafter_kinds.run_all(args)


def test_the_table_is_the_paired_comparison_of_the_per_seed_results(tmp_path) -> None:
    out = tmp_path / "out"
    mla, llama = [3.00, 2.95, 3.05], [3.10, 3.02, 3.12]
    for seed, (m, ll) in enumerate(zip(mla, llama)):
        write(out, result("mla", seed, m, m - 0.3))
        write(out, result("llama", seed, ll, ll - 0.3))
    write(out, result("mla", 3, 9.9, 9.9))  # a seed only one kind finished is left out of every figure
    text = drafter_kinds.kinds_table(out)
    assert "Mean ± stdev over seeds 0, 1, 2:" in text
    assert "| `mla` (Eagle3DeepseekV2ForCausalLM) | 3.000 ± 0.050 |" in text
    gap = paired_stats.paired_test(mla, llama)
    assert f"| mla - llama | simulated acceptance | {gap['mean_diff']:+.3f} [{gap['ci95'][0]:+.3f}" in text
    row = next(line for line in text.splitlines() if line.startswith("| mla - llama | simulated acceptance |"))
    assert ("beyond the spread" in row) == (gap["p"] < 0.05)
    assert "| prompt lookup (`ngram`) |" in text and "1.600" in text
