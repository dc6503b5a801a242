"""Parse-time checks and the shard plan: everything decided before any job runs.

Snakemake calls these while reading the workflow, so a bad setting or a malformed prompt file fails
``snakemake`` (and ``snakemake -n``) before any work, with a message naming the setting or file:line.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from aerie.demo_target.config import DemoTargetConfig
from aerie.drafter.config import TrainConfig
from aerie.prompts import DatasetPlan, plan_dataset
from aerie.target.config import (
    check_servable_aux_layer_ids, default_aux_layer_ids, read_text_config, target_architectures,
)


class ConfigError(ValueError):
    """A configuration value that the JSON schema cannot express is wrong; the message names it."""


def _check_dataclass_keys(section: str, values: dict[str, Any], cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; known keys: {sorted(known)}")


def demo_target_config(config: dict[str, Any]) -> DemoTargetConfig:
    return DemoTargetConfig(**config["target"].get("demo") or {})


def train_config(config: dict[str, Any]) -> TrainConfig:
    return TrainConfig(**config.get("drafter") or {})


def check_config(config: dict[str, Any]) -> None:
    """Checks beyond the schema: keys of dataclass-backed sections, backend needs, the benchmark set."""
    target = config["target"]
    if "demo" in target:
        _check_dataclass_keys("target.demo", target["demo"] or {}, DemoTargetConfig)
    _check_dataclass_keys("drafter", config.get("drafter") or {}, TrainConfig)

    for name in config["datasets"]:
        responses = responses_config(config, name)
        where = "responses" if "responses" not in config["datasets"][name] else f"datasets.{name}.responses"
        backend = responses["backend"]
        if backend in ("openrouter", "openai") and not responses.get("model") and not responses.get("serve"):
            raise ConfigError(f"{where}.model: required for the '{backend}' backend (the API model name)")
        if backend != "hf" and not responses.get("base_url") and not responses.get("serve"):
            raise ConfigError(f"{where}.base_url: required for the '{backend}' backend")
        if responses.get("serve") and backend != "openai":
            raise ConfigError(f"{where}.serve: starts an OpenAI-compatible server, so backend must be 'openai'")

    ids = config["hidden"].get("aux_layer_ids")
    layers = target.get("num_hidden_layers") or _local_num_layers(target)
    if "demo" in target:
        layers = DemoTargetConfig(**target["demo"] or {}).num_hidden_layers
    if ids or layers:
        try:
            local = "demo" not in target and (Path(target["path"]) / "config.json").exists()
            check_servable_aux_layer_ids(ids or default_aux_layer_ids(layers), layers or max(ids) + 2,
                                         target_architectures(target["path"]) if local else ())
        except ValueError as e:
            hint = "" if ids else f" (SGLang's default for {layers} layers; set hidden.aux_layer_ids)"
            raise ConfigError(f"hidden.aux_layer_ids: {e}{hint}") from None

    if not any(d.get("bench_prompts", 0) > 0 for d in config["datasets"].values()):
        raise ConfigError("datasets: no dataset reserves bench_prompts, so the benchmark would have no prompts")


def responses_config(config: dict[str, Any], dataset: str) -> dict[str, Any]:
    """The responses settings of one dataset: the global section with the dataset's overrides.

    Overrides are checked against the responses schema (unknown keys and bad values name the dataset).
    """
    import jsonschema

    override = config["datasets"][dataset].get("responses") or {}
    merged = {**config["responses"], **override}
    if override:
        schema = _schema()["properties"]["responses"]
        try:
            jsonschema.validate(merged, schema)
        except jsonschema.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path)
            raise ConfigError(f"datasets.{dataset}.responses{'.' + path if path else ''}: {e.message}") from None
    return merged


@functools.cache
def _schema() -> dict[str, Any]:
    import yaml

    return yaml.safe_load((Path(__file__).resolve().parent.parent / "config" / "schema.yaml").read_text())


def _local_num_layers(target: dict[str, Any]) -> int | None:
    """Decoder layers of a local target folder (reads config.json only), else None."""
    if "demo" in target or not (Path(target["path"]) / "config.json").exists():
        return None
    return read_text_config(target["path"]).get("num_hidden_layers")


def plan_datasets(config: dict[str, Any]) -> dict[str, DatasetPlan]:
    """Shard plan of every dataset (reads and validates each prompt source once)."""
    plans = {name: plan_dataset(name, ds) for name, ds in config["datasets"].items()}
    if not any(p.num_shards for p in plans.values()):
        raise ConfigError("datasets: every dataset is benchmark-only, so there is nothing to train on")
    return plans
