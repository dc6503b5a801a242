"""Documentation that code keeps in step: every drafter setting has its row in config/README.md, the keys every kind
trains with in the drafter table, each kind's own in its kind's table."""

from __future__ import annotations

import dataclasses
import json
import re

from conftest import REPO

from aerie.drafter.config import TrainConfig
from aerie.drafter_kinds import kinds

ROW = re.compile(r"^\| `(\w+)` \| `([^`]*)` \|", flags=re.M)


def _table(text: str) -> dict[str, str]:
    return {k: v.replace("\\|", "|") for k, v in ROW.findall(text)}


def test_every_drafter_setting_is_documented_with_its_default() -> None:
    text = (REPO / "config" / "README.md").read_text()
    section = text[text.index("## `drafter`") : text.index("## `drafters`")]
    parts = re.split(r"^### .*\(`kind: (\w+)`\)$", section, flags=re.M)
    tables = {"": _table(parts[0]), **{parts[i]: _table(parts[i + 1]) for i in range(1, len(parts), 2)}}
    pairs = {"heldout_weights"}  # (dataset, weight) pairs kept sorted, written as a mapping
    wanted = {
        "": {
            f.name: json.dumps(dict(f.default) if f.name in pairs else f.default)
            for f in dataclasses.fields(TrainConfig)
            if f.name != "kind_settings"
        }
    }
    for name, kind in kinds().items():
        fields = dataclasses.fields(kind.settings_class)
        wanted[name] = {
            f.name: json.dumps(list(f.default) if isinstance(f.default, tuple) else f.default) for f in fields
        }
    for name, fields in wanted.items():
        documented = tables.get(name, {})
        assert documented == fields, (
            f"config/README.md's drafter table {name or '(every kind)'} is out of step with its dataclass: missing "
            f"{sorted(fields.keys() - documented.keys())}, stale {sorted(documented.keys() - fields.keys())}, "
            f"other defaults {[k for k in fields.keys() & documented.keys() if fields[k] != documented[k]]}"
        )
