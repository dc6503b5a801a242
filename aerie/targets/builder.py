"""What a target builder is: the config key that asks for it, its settings, the target folder it will build
(described before it exists, for parse time), and how to build it.

A run names a built target with ``target.<key>: {settings}`` beside ``target.path``; a real target is an existing
folder and has no builder. Everything else in aerie sees a built target only through ``planned_target`` (its
config.json before the folder is here) and the folder itself afterwards: no stage asks which builder made it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PlannedTarget:
    """A target folder as parse time knows it before it is built: its text config (config.json's text part, the
    keys the previews read), its architectures, and how many bytes a parameter takes once built."""

    text_config: dict[str, Any]
    architectures: tuple[str, ...]
    bytes_per_parameter: int
    source: str  # where this description comes from, for the previews ("target.demo")


@dataclass(frozen=True)
class TargetBuilder:
    """A builder of an ordinary target folder (``rules/target.smk`` runs ``build`` as rule ``<key>_target``)."""

    key: str  # config: target.<key>
    settings_class: type  # torch-free dataclass of target.<key>
    describe: Callable[[Any], PlannedTarget]  # settings -> the folder it will build
    build_entry: str  # "module:function", called as function(out_dir, settings, log=log) (imports torch)

    @property
    def rule(self) -> str:
        return f"{self.key}_target"

    def settings(self, values: Mapping[str, Any] | None, **overrides: Any) -> Any:
        """The builder's settings from ``target.<key>`` (YAML lists become the tuples the dataclass declares)."""
        fields = {f.name: f for f in dataclasses.fields(self.settings_class)}
        given = {**(values or {}), **overrides}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise ValueError(f"target.{self.key}: unknown settings {unknown}")
        return self.settings_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})

    def planned(self, values: Mapping[str, Any] | None) -> PlannedTarget:
        return self.describe(self.settings(values))

    def build(self, out_dir: str | Path, values: Mapping[str, Any] | None, log: Callable[[str], None], **overrides):
        module, function = self.build_entry.split(":")
        build = getattr(importlib.import_module(module), function)  # torch: only the building job pays for it
        return build(out_dir, self.settings(values, **overrides), log=log)
