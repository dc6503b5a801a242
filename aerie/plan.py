"""Parse-time checks and the shard plan: everything decided before any job runs.

Snakemake calls these while reading the workflow, so a bad setting or a malformed prompt file fails
``snakemake`` (and ``snakemake -n``) before any work, with a message naming the setting or file:line.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.config_file import ConfigError, ConfigSources, check_against_schema
from aerie.demo_target.config import DemoTargetConfig
from aerie.drafter.config import TrainConfig
from aerie.prompts import DatasetPlan, plan_dataset
from aerie.rehearsal_target.config import ARCHITECTURES as REHEARSAL_ARCHITECTURES
from aerie.rehearsal_target.config import RehearsalTargetConfig
from aerie.target.config import (
    check_servable_aux_layer_ids,
    default_aux_layer_ids,
    read_text_config,
    target_architectures,
)


def validate_config(config: dict[str, Any], sources: ConfigSources) -> None:
    """Check the merged config against config/schema.yaml (every key typed and ranged; errors name the key path and
    the config file and line) and fill in the schema's defaults. Raises ConfigError."""
    check_against_schema(config, _schema(), sources)


def _dataclass_section(section: tuple[str, ...], values: dict[str, Any], cls: type) -> Any:
    """Build a dataclass-backed section (its own checks run in __post_init__) so a value it refuses fails now."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; known keys: {sorted(known)}", section + (unknown[0],))
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), section) from None


def demo_target_config(config: dict[str, Any]) -> DemoTargetConfig:
    return DemoTargetConfig(**config["target"].get("demo") or {})


def train_config(config: dict[str, Any]) -> TrainConfig:
    return TrainConfig(**config.get("drafter") or {})


def check_config(config: dict[str, Any]) -> None:
    """Checks beyond the schema: keys of dataclass-backed sections, backend needs, the benchmark set."""
    target = config["target"]
    if "demo" in target:
        _dataclass_section(("target", "demo"), target["demo"] or {}, DemoTargetConfig)
    if "rehearsal" in target:
        _dataclass_section(("target", "rehearsal"), target["rehearsal"] or {}, RehearsalTargetConfig)
    _dataclass_section(("drafter",), config.get("drafter") or {}, TrainConfig)

    for name in config["datasets"]:
        responses = responses_config(config, name)
        where = ("responses",) if "responses" not in config["datasets"][name] else ("datasets", name, "responses")
        backend = responses["backend"]
        if backend in ("openrouter", "openai") and not responses.get("model") and not responses.get("serve"):
            raise ConfigError(f"required for the '{backend}' backend (the API model name)", where + ("model",))
        if backend != "hf" and not responses.get("base_url") and not responses.get("serve"):
            raise ConfigError(f"required for the '{backend}' backend", where + ("base_url",))
        if responses.get("serve") and backend != "openai":
            raise ConfigError("starts an OpenAI-compatible server, so backend must be 'openai'", where + ("serve",))

    ids = config["hidden"].get("aux_layer_ids")
    layers = target.get("num_hidden_layers") or _local_num_layers(target)
    architectures: Sequence[str] = ()
    if "demo" in target:
        layers = DemoTargetConfig(**target["demo"] or {}).num_hidden_layers
    elif "rehearsal" in target:  # built by the pipeline: its config is known before the folder exists
        layers = RehearsalTargetConfig(**target["rehearsal"] or {}).num_hidden_layers
        architectures = REHEARSAL_ARCHITECTURES
    elif (Path(target["path"]) / "config.json").exists():
        architectures = target_architectures(target["path"])
    if ids or layers:
        try:
            check_servable_aux_layer_ids(
                ids or default_aux_layer_ids(layers),
                layers or max(ids) + 2,
                architectures,
            )
        except ValueError as e:
            hint = "" if ids else f" (SGLang's default for {layers} layers; set hidden.aux_layer_ids)"
            raise ConfigError(f"{e}{hint}", ("hidden", "aux_layer_ids")) from None

    if not any(d.get("bench_prompts", 0) > 0 for d in config["datasets"].values()):
        raise ConfigError("no dataset reserves bench_prompts, so the benchmark would have no prompts", ("datasets",))


def responses_config(config: dict[str, Any], dataset: str) -> dict[str, Any]:
    """The responses settings of one dataset: the global section with the dataset's overrides.

    Overrides are checked against the responses schema (unknown keys and bad values name the dataset).
    """
    from aerie.config_file import schema_errors

    override = config["datasets"][dataset].get("responses") or {}
    merged = {**config["responses"], **override}
    if override:
        errors = schema_errors(merged, _schema()["properties"]["responses"])
        if errors:
            path, message = errors[0]
            # A key the dataset overrides is named where the dataset sets it; a merged-in global key where it is.
            where = ("datasets", dataset, "responses") if path and path[0] in override else ("responses",)
            raise ConfigError(message, where + path)
    return merged


@functools.cache
def _schema() -> dict[str, Any]:
    import yaml

    # libyaml's loader when PyYAML has it (4x faster; every `snakemake -n` pays this), else the Python one.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((Path(__file__).resolve().parent.parent / "config" / "schema.yaml").read_text(), Loader=loader)


def _local_num_layers(target: dict[str, Any]) -> int | None:
    """Decoder layers of a local target folder (reads config.json only), else None."""
    if "demo" in target or "rehearsal" in target or not (Path(target["path"]) / "config.json").exists():
        return None
    return read_text_config(target["path"]).get("num_hidden_layers")


def plan_datasets(config: dict[str, Any]) -> dict[str, DatasetPlan]:
    """Shard plan of every dataset (reads and validates each prompt source once)."""
    plans = {name: plan_dataset(name, ds, config["datasets"]) for name, ds in config["datasets"].items()}
    if not any(p.num_shards for p in plans.values()):
        raise ConfigError("every dataset is benchmark-only, so there is nothing to train on", ("datasets",))
    return plans
