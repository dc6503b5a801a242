"""A stand-in ``conda`` for dry runs with conda deployment on (no conda can be installed on the test machines).

With ``--software-deployment-method conda`` (profiles/gpu-host, profiles/slurm), even ``snakemake -n`` asks conda
three things before it plans the environments, and nothing else (Snakemake 9.27.1,
snakemake/deployment/conda.py: ``Conda.__init__`` runs ``conda info --json`` and reads ``conda_prefix`` and
``platform``; ``Conda._check`` runs ``type conda``, ``conda --version`` (>= MIN_CONDA_VER, 24.7.1) and
``conda config --get channel_priority --json`` (reads ``get.channel_priority``)). The stand-in answers exactly those
in conda's JSON shapes and fails loudly on any other command, so a test that would create an environment fails
instead of passing silently. Only dry runs use it.
"""

from __future__ import annotations

import os
from pathlib import Path

CONDA_VERSION = "25.1.1"
# The command-line form of what profiles/gpu-host and profiles/slurm set: the Kimi config's SGLang rules need it.
CONDA_DEPLOYMENT = ("--software-deployment-method", "conda")

_SCRIPT = """#!/bin/sh
# Stand-in conda for dry runs (tests/conda_stand_in.py): answers only what snakemake -n asks.
case "$1 $2" in
  "info --json") echo '{{"conda_prefix": "{prefix}", "platform": "linux-64", "conda_version": "{version}"}}';;
  "--version "*) echo "conda {version}";;
  "config --get") echo '{{"get": {{"channel_priority": "strict"}}, "rc_path": "{prefix}/.condarc", '\
'"success": true, "warnings": []}}';;
  *) echo "stand-in conda (tests/conda_stand_in.py) cannot run: conda $*" >&2; exit 2;;
esac
"""


def conda_on_path(tmp_path: Path) -> dict[str, str]:
    """The environment for a subprocess that finds the stand-in ``conda`` first on PATH."""
    bindir = tmp_path / "conda-stand-in" / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    prefix = tmp_path / "conda-stand-in"
    script = bindir / "conda"
    script.write_text(_SCRIPT.format(prefix=prefix, version=CONDA_VERSION))
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
