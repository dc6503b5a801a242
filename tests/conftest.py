"""Shared test helpers: paths, the ../shared folder rule, and running snakemake as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path under ../shared; skip when it is absent, except under CI where it must be there."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        if os.environ.get("CI") == "true":
            raise AssertionError(f"{path} is missing, and CI must run every test")
        pytest.skip(f"{path} not present (a user's clone has no ../shared)")
    return path


def snakemake(
    workdir: Path, *args: str, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run this checkout's workflow in ``workdir`` with the current interpreter's snakemake."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core box a second thread that waits for a busy
    core makes every small matmul many times slower. Modules opt in with ``pytestmark``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def private_key_ledgers(tmp_path_factory):
    """Every responses job keeps a ledger per API key outside its results folder (aerie.responses.api.key_ledger); the
    tests'
    jobs and the snakemake runs they start (which inherit the environment) keep theirs in a folder of the session,
    never in the user's ~/.local/state."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AERIE_STATE_DIR", str(tmp_path_factory.mktemp("aerie-state")))
        yield
