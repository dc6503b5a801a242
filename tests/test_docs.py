"""Documentation that code keeps in step: every drafter setting has its row in config/README.md."""

from __future__ import annotations

import dataclasses
import json
import re

from conftest import REPO

from aerie.drafter.config import TrainConfig


def test_every_drafter_setting_is_documented_with_its_default() -> None:
    text = (REPO / "config" / "README.md").read_text()
    section = text[text.index("## `drafter`") : text.index("## `bench`")]
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, flags=re.M))
    fields = {f.name: json.dumps(f.default) for f in dataclasses.fields(TrainConfig)}
    assert documented == fields, (
        f"config/README.md's drafter table is out of step with TrainConfig: missing "
        f"{sorted(fields.keys() - documented.keys())}, stale {sorted(documented.keys() - fields.keys())}, "
        f"other defaults {[k for k in fields.keys() & documented.keys() if fields[k] != documented[k]]}"
    )
