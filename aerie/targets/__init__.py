"""Target builders: the demo target and the Kimi K2.5 rehearsal target, each built into an ordinary target folder
by its rule (rules/target.smk); everything downstream loads that folder by path, as it would a real target.

Each builder is one package here exposing ``BUILDER`` (``aerie.targets.builder.TargetBuilder``); ``builders()``
finds them, ``builder_of(target)`` says which one a run's ``target`` section asks for, and ``planned_target`` is
the one place that describes a target whose folder is not here yet.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aerie.target_model.config import read_described_config, read_text_config, target_architectures, text_config
from aerie.targets.builder import PlannedTarget, TargetBuilder


@functools.cache
def builders() -> dict[str, TargetBuilder]:
    """Every builder package of aerie.targets, by config key (each imported for its torch-free ``BUILDER``)."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            builder = getattr(importlib.import_module(f"{__name__}.{info.name}"), "BUILDER", None)
            if builder is not None:
                found[builder.key] = builder
    return found


def builder_of(target: Mapping[str, Any]) -> TargetBuilder | None:
    """The builder the ``target`` section names (``target.<key>``), None for a real target; two are refused."""
    named = [b for key, b in builders().items() if key in target]
    if len(named) > 1:
        keys = ", ".join(f"target.{b.key}" for b in named)
        raise ValueError(f"{keys} each ask the pipeline to build the target; keep one")
    return named[0] if named else None


def planned_target(target: Mapping[str, Any]) -> PlannedTarget | None:
    """The target as parse time can know it: its folder's config.json when it is there, else the builder's
    description of the folder it will build, else ``target.config_json`` (a real target not on this machine);
    None when nothing describes it."""
    folder = Path(target["path"])
    if (folder / "config.json").is_file():
        return PlannedTarget(read_text_config(folder), tuple(target_architectures(folder)), 0, f"{folder}/config.json")
    builder = builder_of(target)
    if builder is not None:
        return builder.planned(target[builder.key])
    if target.get("config_json"):
        described = read_described_config(target["config_json"])
        architectures = tuple(described.get("architectures") or ())
        return PlannedTarget(text_config(described), architectures, 0, "target.config_json")
    return None
