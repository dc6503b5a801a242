"""Logging for Snakemake rule scripts: every rule's progress and errors land in its ``log:`` file."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def open_rule_log(log_path: str | Path, echo: bool = True) -> Callable[[str], None]:
    """Send stderr (warnings, tracebacks) to the rule's log file and return a ``log(msg)`` function.

    ``log`` writes timestamped lines to the file and, with ``echo``, to stdout so a person watching
    ``snakemake`` sees the pipeline progress.
    """
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a", buffering=1, encoding="utf-8")
    sys.stderr = fh
    logging.basicConfig(stream=fh, level=logging.WARNING, force=True)

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        fh.write(line + "\n")
        if echo:
            print(line, flush=True)

    return log


def snakemake_threads(smk: Any) -> int:
    return int(getattr(smk, "threads", 1) or 1)
