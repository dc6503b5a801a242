"""Packaging a user relies on: the per-rule conda env installs what pyproject says, and there is a licence."""

from __future__ import annotations

import re
import tomllib

import yaml
from conftest import REPO


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_conda_env_matches_the_package_dependencies() -> None:
    """envs/aerie.yaml (snakemake --sdm conda) pins exactly pyproject's runtime dependencies."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((REPO / "envs" / "aerie.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    want = {_name(r): r.replace(" ", "") for r in project["dependencies"]}
    have = {_name(r): r.replace(" ", "") for r in pip}
    only_project, only_env = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    differ = [(want[k], have[k]) for k in want.keys() & have.keys() if want[k] != have[k]]
    assert have == want, (
        f"envs/aerie.yaml differs from pyproject.toml: only in pyproject {only_project}, "
        f"only in the env {only_env}, different {differ}"
    )
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert project["requires-python"].lstrip(">=") in python


def test_the_licence_file_is_the_one_pyproject_names() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache" in str(project["license"]) and "Apache License" in text and "Version 2.0" in text
