"""The run's drafters, resolved once: their names, settings (aerie.drafter.config.TrainConfig, their kind's keys
included), warm-start folders, and the target layers each reads - so that one capture serves them all.

A config trains one drafter (section ``drafter``), named ``run``: ``results/drafter/{run}/``. With a ``drafters``
section it trains one per entry, each named ``{run}-{key}``, on the same data: every entry's keys override
``drafter``'s, and a key its kind does not know is refused, naming it (so ``drafter`` then holds what they share).
The hidden states are captured once, at the union of the layers every drafter reads (``capture_layer_ids``).

Torch-free: Snakemake calls it while it parses the workflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.drafter.config import TrainConfig
from aerie.drafter.traffic import heldout_weights
from aerie.drafter_kinds.folders import resolve_drafter_folder
from aerie.drafter_kinds.kind import TargetView
from aerie.plan.config_file import ConfigError


@dataclass(frozen=True)
class PlannedDrafter:
    """One drafter of the run: its name (its folder ``results/drafter/{name}``), where its settings sit in the config,
    its settings (the warm-start folder's values taken where they are left derived, when the folder is here), and
    that folder (None: no warm start, or the folder is not here yet)."""

    name: str
    where: tuple[str, ...]  # the config path of its own section: ("drafter",) or ("drafters", key)
    train: TrainConfig
    values: dict[str, Any]  # its flat section as the config writes it (``drafter`` merged with its entry)
    init_folder: Path | None = None

    @property
    def kind(self) -> str:
        return self.train.kind

    @property
    def section(self) -> dict[str, Any]:
        """The flat section the drafter job trains with: the config's keys, plus those a warm start took from its
        folder (keys the config leaves out keep their defaults in the job: ``threads`` there is the job's)."""
        resolved = self.train.section()
        own = self.train.drafter_kind.setting_names()
        taken = {k: resolved[k] for k in own if k not in self.values and resolved[k] != _default(self.train, k)}
        if self.train.heldout_weights and "heldout_weights" not in self.values:  # from bench.traffic
            taken["heldout_weights"] = dict(self.train.heldout_weights)
        return {**self.values, **taken}


def drafter_sections(config: Mapping[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    """{config path: the merged flat section} of every drafter, in config order."""
    shared = dict(config.get("drafter") or {})
    entries = config.get("drafters") or {}
    if not entries:
        return {("drafter",): shared}
    return {("drafters", key): {**shared, **(entry or {})} for key, entry in entries.items()}


def planned_drafters(config: Mapping[str, Any], base: Path | None = None) -> list[PlannedDrafter]:
    """Every drafter of the run (ConfigError naming the key when a section does not resolve). ``base``: where a
    relative ``init`` folder is looked up (the workflow's directory)."""
    run = str(config.get("run", "run"))
    out = []
    for where, values in drafter_sections(config).items():
        try:
            train = TrainConfig.of(values)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e), where) from None
        folder = None
        if train.init:
            try:
                folder = resolve_drafter_folder(train.init, base=base)
            except FileNotFoundError:
                folder = None  # the dry run says where it looked; a real run refuses to start
        if folder is not None:
            settings = train.drafter_kind.settings_from_folder(train.kind_settings, folder)
            train = TrainConfig(**{**_generic(train), "kind_settings": settings})
        traffic = (config.get("bench") or {}).get("traffic")
        if traffic and not values.get("heldout_weights"):  # the epoch choice weighs the user's traffic mix
            mix = heldout_weights(traffic, training_datasets(config), train.replay_dataset)
            train = train.replace(heldout_weights=mix.weights)
        name = run if where == ("drafter",) else f"{run}-{where[1]}"
        out.append(PlannedDrafter(name, where, train, dict(values), folder))
    return out


def training_datasets(config: Mapping[str, Any]) -> list[str]:
    """The config's datasets: those with training shards have held-out splits (a benchmark-only one has none, and
    the training loop leaves its weight out, saying so)."""
    return list(config.get("datasets") or {})


def _default(train: TrainConfig, key: str) -> Any:
    return getattr(train.drafter_kind.settings({}), key)


def _generic(train: TrainConfig) -> dict[str, Any]:
    section = train.section()
    own = set(train.drafter_kind.setting_names())
    return {k: v for k, v in section.items() if k not in own}


def capture_layer_ids(
    drafters: Sequence[PlannedDrafter], target: TargetView, configured_aux_layer_ids: Sequence[int] | None
) -> list[int]:
    """The target layers the hidden stage captures: every drafter's, in layer order (one capture serves them all).
    ValueError naming the setting when a drafter's layers cannot be served."""
    ids: set[int] = set()
    for d in drafters:
        ids.update(d.train.drafter_kind.capture_layer_ids(d.train.kind_settings, target, configured_aux_layer_ids))
    return sorted(ids)


def drafter_layer_ids(
    drafter: PlannedDrafter, target: TargetView, configured_aux_layer_ids: Sequence[int] | None
) -> list[int]:
    """The layers one drafter reads, in its own order."""
    kind = drafter.train.drafter_kind
    return kind.capture_layer_ids(drafter.train.kind_settings, target, configured_aux_layer_ids)
