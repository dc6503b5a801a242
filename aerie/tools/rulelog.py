"""Logging for Snakemake rule scripts: every rule's progress and errors land in its ``log:`` file, and every
attempt of a job keeps its own copy.

Snakemake deletes a job's declared log when the job starts again (after a crash, a kill or a failure), so the
log of the attempt that lost work or money would be gone. Each attempt therefore hard-links the declared log to
``<name>.attempt-<N><suffix>`` beside it (``shard-00000.log`` -> ``shard-00000.attempt-2.log``): one file under
two names, so everything written to the declared log during the attempt - by this process, by subprocesses that
append to it (torchrun workers), by tracebacks - is in the attempt's copy, which Snakemake does not own and
never deletes. N counts the attempts that ever started, across Snakemake invocations and ``--retries``.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def attempt_log_path(log_path: str | Path, attempt: int) -> Path:
    """The attempt-numbered copy of a declared log: ``dir/name.attempt-<attempt><suffix>``."""
    path = Path(log_path)
    return path.with_name(f"{path.stem}.attempt-{attempt}{path.suffix}")


def attempt_logs(log_path: str | Path) -> dict[int, Path]:
    """Every attempt's copy of a declared log that exists, by attempt number (ascending)."""
    path = Path(log_path)
    pattern = re.compile(re.escape(path.stem) + r"\.attempt-(\d+)" + re.escape(path.suffix) + "$")
    found = {}
    if path.parent.is_dir():
        for p in path.parent.iterdir():
            m = pattern.match(p.name)
            if m:
                found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def keep_attempt_log(log_path: str | Path) -> tuple[int, Path | None]:
    """Give the declared log (which must exist) an attempt-numbered second name; returns (attempt, copy path).

    When the declared log already is an attempt's copy (the same job opened it twice), that attempt is kept.
    Returns (attempt, None) where the file system has no hard links: the caller then writes the copy itself.
    """
    path = Path(log_path)
    earlier = attempt_logs(path)
    for n, p in earlier.items():
        try:
            if os.path.samefile(p, path):
                return n, p
        except OSError:
            continue
    attempt = max(earlier, default=0) + 1
    while True:
        copy = attempt_log_path(path, attempt)
        try:
            os.link(path, copy)  # atomic: fails when the name exists, so two writers never share a number
            return attempt, copy
        except FileExistsError:
            attempt += 1
        except OSError:
            # No hard links here (some network and FUSE file systems): a separate file, written alongside.
            try:
                open(copy, "x").close()
                return attempt, None
            except FileExistsError:
                attempt += 1


class _Tee:
    """A text stream writing to two files (the fallback where the attempt copy cannot be a hard link)."""

    def __init__(self, first: TextIO, second: TextIO):
        self._files = (first, second)

    def write(self, text: str) -> int:
        for f in self._files:
            f.write(text)
        return len(text)

    def flush(self) -> None:
        for f in self._files:
            f.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._files[0].fileno()


def open_rule_log(log_path: str | Path, echo: bool = True) -> Callable[[str], None]:
    """Send stderr (warnings, tracebacks) to the rule's log file and return a ``log(msg)`` function.

    ``log`` writes timestamped lines to the file and, with ``echo``, to stdout so a person watching
    ``snakemake`` sees the pipeline progress. The log also gets this attempt's numbered copy (module docstring),
    announced in its first line together with the copies of earlier attempts.
    """
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh: TextIO = open(path, "a", buffering=1, encoding="utf-8")
    attempt, linked = keep_attempt_log(path)
    copy = linked or attempt_log_path(path, attempt)
    if linked is None:
        fh = _Tee(fh, open(copy, "a", buffering=1, encoding="utf-8"))  # type: ignore[assignment]
    sys.stderr = fh
    logging.basicConfig(stream=fh, level=logging.WARNING, force=True)
    quiet_third_party_bars()

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        fh.write(line + "\n")
        if echo:
            print(line, flush=True)

    atexit.register(lambda: log(peak_memory_line()))
    earlier = [p.name for n, p in attempt_logs(path).items() if n < attempt]
    log(
        f"attempt {attempt} (pid {os.getpid()} on {socket.gethostname()}); this log is kept as {copy.name}"
        + (f"; earlier attempts: {', '.join(earlier)}" if earlier else "")
    )
    return log


def quiet_third_party_bars() -> None:
    """Keep transformers' and huggingface_hub's own progress bars ("Loading weights: 100%|...") out of the job's log:
    the job's one progress printer says what it does. Whether they are imported yet or not."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub / transformers are imported
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


PEAK_MEMORY = re.compile(r"peak memory: ([\d,]+) MiB resident")


def peak_memory_line() -> str:
    """What the job used at most, for its log's last line: the process's resident high-water mark (VmHWM, exact,
    where Snakemake's ``benchmark:`` max_rss samples every 0.5-30 s and misses short peaks) and, when the job used
    CUDA, each GPU's most allocated by torch. Read by tests/fit_check.py (PEAK_MEMORY) against the fit plan."""
    parts = []
    try:
        with open("/proc/self/status") as fh:
            hwm = next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), None)
        if hwm is not None:
            parts.append(f"{hwm / 1024:,.0f} MiB resident (VmHWM)")
    except OSError:  # not Linux
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            parts.append(f"GPU {i}: {torch.cuda.max_memory_allocated(i) / 2**30:,.2f} GiB allocated by torch")
    return "peak memory: " + ("; ".join(parts) or "not measurable here")


def snakemake_threads(smk: Any) -> int:
    return int(getattr(smk, "threads", 1) or 1)
