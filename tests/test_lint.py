"""The workflow is `snakemake --lint` clean and snakefmt-formatted, the Python code ruff-clean and ruff-formatted
(all also run in CI through this test)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, snakemake

SNAKEFILES = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]


def check(findings: dict[str, list[str]], what: str) -> None:
    assert not findings, f"{what}:\n" + "\n".join(f"{f}: {m}" for f, ms in findings.items() for m in ms)


def test_snakemake_lint_is_clean(workdir: Path) -> None:
    proc = snakemake(workdir, "--lint", timeout=300)
    out = proc.stdout + proc.stderr
    findings: dict[str, list[str]] = {}
    for block in re.split(r"^(?=Lints for )", out, flags=re.M)[1:]:
        head = block.splitlines()[0]
        path = re.search(r"(/\S+?\.smk|/\S*Snakefile)", head).group(1)
        rel = str(Path(path).resolve().relative_to(REPO))
        who = re.match(r"Lints for (rule \w+|snakefile)", head).group(1)
        findings.setdefault(rel, []).extend(f"{who}: {m}" for m in re.findall(r"^\s+\* (.*)$", block, flags=re.M))
    if not findings:
        assert proc.returncode == 0, out
        assert "Congratulations, your workflow is in a good condition!" in out, out
    check(findings, "snakemake --lint")


def test_snakefmt_check_is_clean() -> None:
    snakefmt = shutil.which("snakefmt", path=str(Path(sys.executable).parent)) or shutil.which("snakefmt")
    if snakefmt is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("snakefmt is missing, and CI must run every test")
        pytest.skip('snakefmt not installed (pip install -e ".[test]")')
    findings = {}
    for path in SNAKEFILES:
        proc = subprocess.run([snakefmt, "--check", str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)
        if proc.returncode != 0:
            findings[str(path.relative_to(REPO))] = [
                f"not snakefmt-formatted (snakefmt --diff {path.relative_to(REPO)})"
            ]
    check(findings, "snakefmt --check")


def _ruff() -> str:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("ruff is missing, and CI must run every test")
        pytest.skip('ruff not installed (pip install -e ".[test]")')
    return ruff


def test_python_code_passes_ruff_check() -> None:
    """The rules in pyproject.toml [tool.ruff.lint]: pyflakes, pycodestyle at 120 columns, isort, bugbear, pyupgrade."""
    proc = subprocess.run(
        [_ruff(), "check", "--output-format", "concise", "."], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, f"ruff check (fix with: ruff check --fix .):\n{proc.stdout[-4000:]}{proc.stderr}"


def test_python_code_is_ruff_formatted() -> None:
    proc = subprocess.run([_ruff(), "format", "--check", "."], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, f"not ruff-formatted (fix with: ruff format .):\n{proc.stdout[-4000:]}{proc.stderr}"
