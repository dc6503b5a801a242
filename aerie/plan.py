"""Parse-time checks and the shard plan: everything decided before any job runs.

Snakemake calls these while reading the workflow, so a bad setting or a malformed prompt file fails
``snakemake`` (and ``snakemake -n``) before any work, with a message naming the setting or file:line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from aerie.capture import check_aux_layer_ids, default_aux_layer_ids
from aerie.prompts import DatasetPlan, plan_dataset


class ConfigError(ValueError):
    """A configuration value that the JSON schema cannot express is wrong; the message names it."""


def _check_dataclass_keys(section: str, values: dict[str, Any], cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; known keys: {sorted(known)}")


def demo_target_config(config: dict[str, Any]):
    from aerie.demo_target.pretrain import DemoTargetConfig

    return DemoTargetConfig(**config["target"].get("demo") or {})


def train_config(config: dict[str, Any]):
    from aerie.drafter.train import TrainConfig

    return TrainConfig(**config.get("drafter") or {})


def check_config(config: dict[str, Any]) -> None:
    """Checks beyond the schema: keys of dataclass-backed sections, backend needs, the benchmark set."""
    from aerie.demo_target.pretrain import DemoTargetConfig
    from aerie.drafter.train import TrainConfig

    target = config["target"]
    if "demo" in target:
        _check_dataclass_keys("target.demo", target["demo"] or {}, DemoTargetConfig)
    _check_dataclass_keys("drafter", config.get("drafter") or {}, TrainConfig)

    responses = config["responses"]
    if responses["backend"] != "hf" and not responses.get("model"):
        raise ConfigError(f"responses.model: required for the '{responses['backend']}' backend (the API model name)")

    ids = config["hidden"].get("aux_layer_ids")
    layers = target.get("num_hidden_layers") or _local_num_layers(target)
    if "demo" in target:
        layers = DemoTargetConfig(**target["demo"] or {}).num_hidden_layers
    if ids or layers:
        try:
            check_aux_layer_ids(ids or default_aux_layer_ids(layers), layers or max(ids) + 1)
        except ValueError as e:
            hint = "" if ids else f" (SGLang's default for {layers} layers; set hidden.aux_layer_ids)"
            raise ConfigError(f"hidden.aux_layer_ids: {e}{hint}") from None

    if not any(d.get("bench_prompts", 0) > 0 for d in config["datasets"].values()):
        raise ConfigError("datasets: no dataset reserves bench_prompts, so the benchmark would have no prompts")


def _local_num_layers(target: dict[str, Any]) -> int | None:
    """Decoder layers of a local target folder (reads config.json only), else None."""
    cfg_path = Path(target["path"]) / "config.json"
    if "demo" in target or not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)  # Kimi K2.5 wraps the language model config
    return cfg.get("num_hidden_layers")


def plan_datasets(config: dict[str, Any]) -> dict[str, DatasetPlan]:
    """Shard plan of every dataset (reads and validates each prompt source once)."""
    plans = {name: plan_dataset(name, ds) for name, ds in config["datasets"].items()}
    if not any(p.num_shards for p in plans.values()):
        raise ConfigError("datasets: every dataset is benchmark-only, so there is nothing to train on")
    return plans
