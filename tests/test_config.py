"""Configuration and dry runs: bad input fails before any work, naming the setting or file:line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, shared_path, snakemake


def write_config(workdir: Path, config: dict) -> Path:
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def demo_config() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def jsonl_config(path: str) -> dict:
    config = demo_config()
    config["datasets"] = {"mine": {"source": {"kind": "jsonl", "path": path}, "shard_size": 2, "bench_prompts": 1}}
    return config


def dry_run(workdir: Path, config: dict) -> tuple[int, str]:
    proc = snakemake(workdir, "-n", "--configfile", str(write_config(workdir, config)))
    return proc.returncode, proc.stdout + proc.stderr


def test_demo_dry_run_sees_every_job(workdir: Path) -> None:
    proc = snakemake(workdir, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    config = demo_config()
    # Shard counts come from the config and the prompt sources, before anything runs.
    tasks = config["datasets"]["tasks"]
    tasks_shards = -(-(tasks["source"]["count"] - tasks["bench_prompts"]) // tasks["shard_size"])
    he = config["datasets"]["humaneval"]
    he_shards = -(-(164 - he["bench_prompts"]) // he["shard_size"])
    shards = tasks_shards + he_shards
    assert tasks_shards >= 2 and he_shards >= 2
    assert int(counts["prompts"]) == shards
    assert int(counts["responses"]) == shards
    assert int(counts["tokens"]) == shards
    assert int(counts["hidden"]) == shards
    assert int(counts["bench_prompts"]) == 2
    for rule in ("demo_target", "draft_vocab", "drafter", "bench", "all"):
        assert int(counts[rule]) == 1


def test_unknown_key_is_named(workdir: Path) -> None:
    config = demo_config()
    config["responses"]["temprature"] = 0.5
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "temprature" in out


def test_wrong_type_is_named(workdir: Path) -> None:
    config = demo_config()
    config["responses"]["max_new_tokens"] = "many"
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "max_new_tokens" in out and "many" in out


def test_unknown_drafter_key_is_named(workdir: Path) -> None:
    config = demo_config()
    config["drafter"] = {"learnig_rate": 1e-3}
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "learnig_rate" in out


def test_missing_prompt_file_is_named(workdir: Path) -> None:
    rc, out = dry_run(workdir, jsonl_config("prompts/nowhere.jsonl"))
    assert rc != 0
    assert "prompts/nowhere.jsonl" in out and "not found" in out


def test_malformed_jsonl_line_is_named(workdir: Path) -> None:
    prompts = workdir / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three"\n{"prompt": "four"}\n')
    rc, out = dry_run(workdir, jsonl_config("prompts.jsonl"))
    assert rc != 0
    assert "prompts.jsonl:3" in out and "malformed JSON" in out


def test_missing_field_is_named(workdir: Path) -> None:
    prompts = workdir / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"question": "two"}\n{"prompt": "three"}\n')
    rc, out = dry_run(workdir, jsonl_config("prompts.jsonl"))
    assert rc != 0
    assert "prompts.jsonl:2" in out and "'prompt'" in out


def test_aux_layer_out_of_range_is_named(workdir: Path) -> None:
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    config["hidden"]["aux_layer_ids"] = [1, 29, 61]
    rc, out = dry_run(workdir, config)
    assert rc != 0
    assert "hidden.aux_layer_ids" in out and "61" in out


def test_kimi_example_config_dry_run(workdir: Path) -> None:
    """The Kimi K2.5 example validates and plans every shard from small stand-in prompt files."""
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    assert len(config["datasets"]) == 6
    assert config["hidden"]["aux_layer_ids"] == [1, 29, 57]
    assert config["vocab"]["draft_vocab_size"] == 32000
    mt_bench = shared_path("datasets", "mt_bench_questions.jsonl")
    gsm8k = shared_path("datasets", "gsm8k_test.jsonl")
    for name, ds in config["datasets"].items():
        path = workdir / ds["source"]["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        src = ds["source"]
        if name == "mtbench":
            path.write_bytes(mt_bench.read_bytes())
        elif name == "math":
            path.write_text("".join(gsm8k.read_text().splitlines(keepends=True)[:50]))
        else:
            lines = []
            for i in range(5):
                if "messages_field" in src:
                    rec = {src["messages_field"]: [{"role": "user", "content": f"{name} question {i}"}]}
                else:
                    rec = {src["text_field"]: f"{name} prompt {i}"}
                rec[src.get("id_field", "id")] = f"{name}-{i}"
                lines.append(json.dumps(rec))
            path.write_text("\n".join(lines) + "\n")
    # Stand-in files are tiny: shrink shards so every dataset still has several.
    for ds in config["datasets"].values():
        ds["shard_size"] = 2
    rc, out = dry_run(workdir, config)
    assert rc == 0, out
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    # 4 datasets x 3 shards (5 prompts) + math 25 shards (50 prompts); MT-bench is benchmark-only
    assert int(counts["responses"]) == 4 * 3 + 25
    assert int(counts["bench_prompts"]) == 1
    assert "demo_target" not in counts
