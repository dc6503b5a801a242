"""What every committed bench result records besides its figures: the code it ran, the command, the machine's
load, and the identity of its input files (bench/results/*, read back by bench/tables.py).

Code identity: ``git rev-parse HEAD`` of the checkout plus the paths under ``aerie/`` and ``bench/`` that differ
from it (uncommitted edits would make the commit a lie), or, for a snapshot made with
``git archive COMMIT | tar -x -C DIR`` (how long runs are kept away from edits in a shared checkout), the commit
written beside it as ``DIR/.commit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SNAPSHOT_COMMIT_FILE = ".commit"


def code_identity(repo: Path) -> dict:
    """``{"commit", "dirty", "snapshot"}`` of the code under ``repo`` (see the module docstring)."""
    marker = repo / SNAPSHOT_COMMIT_FILE
    if marker.exists() and not (repo / ".git").exists():
        return {"commit": marker.read_text().strip(), "dirty": [], "snapshot": True}
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "aerie", "bench"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": [], "snapshot": False}
    dirty = sorted(line[3:] for line in status.splitlines() if line.strip())
    return {"commit": commit, "dirty": dirty, "snapshot": False}


def machine_load() -> dict:
    """The 1/5/15-minute load averages and ``uptime``'s line, at the moment of the call."""
    one, five, fifteen = os.getloadavg()
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        line = ""
    return {"loadavg": [round(one, 2), round(five, 2), round(fifteen, 2)], "uptime": line, "t": time.time()}


def machine() -> dict:
    """The machine a figure was measured on (cores, Python, platform)."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def command_line() -> list[str]:
    """The command as run, the script named from the repository root (``bench/x.py``) wherever the checkout is."""
    argv = list(sys.argv)
    if not argv:
        return []
    script = Path(argv[0])
    return [f"{script.parent.name}/{script.name}" if script.suffix == ".py" else argv[0], *argv[1:]]


def file_identity(path: Path) -> dict:
    """Name, size and sha256 of one input file (hidden shards, the target's weights, prompt files)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def write_json_atomic(path: Path, obj: object) -> None:
    """``path`` appears complete or not at all (a killed run never leaves half a result to be skipped as done)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
