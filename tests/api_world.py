"""A pipeline config whose datasets are regenerated through 'OpenRouter' (the emulator), for the API tests and
bench/api_limits.py: the demo config with jsonl prompt datasets and a target that is only read for its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def api_pipeline_config(
    workdir: Path, base_url: str, target: Path, datasets: dict[str, dict[str, Any]], **responses: Any
) -> Path:
    """Write ``workdir/config.yaml``: per dataset name ``{"n": prompts, **its datasets section}`` (prompts
    ``"<tag> <i>: what is <i> + <i>?"``, the tag ``Question`` for ``chat``, ``<name> question`` otherwise, one more
    held out for the benchmark), ``responses`` through the emulator at ``base_url`` (overridden by ``responses``)."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"] = {"path": str(target), "device": "cpu", "dtype": "float32"}
    config["hidden"]["aux_layer_ids"] = [1, 2, 4]  # of the tiny target's 6 layers (tiny_world.save_tiny_llama_target)
    config["datasets"] = {}
    for name, spec in datasets.items():
        spec = dict(spec)
        n = spec.pop("n")
        src = workdir / f"prompts-{name}.jsonl"
        tag = "Question" if name == "chat" else f"{name} question"
        src.write_text(
            "".join(
                json.dumps({"id": f"p{i}", "prompt": f"{tag} {i}: what is {i} + {i}?"}) + "\n" for i in range(n + 1)
            )
        )
        config["datasets"][name] = {
            "source": {"kind": "jsonl", "path": str(src), "id_field": "id"},
            "bench_prompts": 1,
            **spec,
        }
    config["responses"] = {
        "backend": "openrouter",
        "model": "moonshotai/kimi-k2.5",
        "base_url": base_url,
        "temperature": 1.0,
        "top_p": 0.95,
        "max_new_tokens": 256,
        "concurrency": 100,
        "provider": {"sort": "price", "quantizations": ["int4"]},
        "reasoning": {"enabled": True},
        "backoff_base_s": 0.05,
        "backoff_max_s": 0.5,
        "progress_interval_s": 1,
        "expected_output_tokens": 100,
        **responses,
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
