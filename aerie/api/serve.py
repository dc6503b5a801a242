"""Start an OpenAI-compatible server on loopback for the duration of a job (``transformers serve``).

Lets a rule regenerate a dataset through a real HTTP server with the same client as OpenRouter:
pick a free port, start the server in its own process group, wait until ``/health`` answers (failing
early, with the server's log tail, when the process dies), and stop it - SIGTERM, then SIGKILL - on
every exit path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def transformers_serve_command(model_path: str, port: int, host: str = "127.0.0.1",
                               device: str = "cpu", dtype: str = "auto") -> list[str]:
    # `python -m` of the CLI module: the same interpreter (and venv) as this job, no PATH lookup.
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_path),
            "--host", host, "--port", str(port), "--device", device, "--dtype", dtype, "--log-level", "warning"]


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)


@contextlib.contextmanager
def serve_on_loopback(command_for_port, health_path: str, log_path: Path, ready_timeout: float = 300.0,
                      env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``command_for_port(port)`` and yield ``http://127.0.0.1:PORT`` once ``health_path`` answers 200."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_fh:
        proc = subprocess.Popen(command_for_port(port), stdout=log_fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before it was ready; "
                                   f"its log ({log_path}) ends with:\n{_tail(log_path)}")
            try:
                if requests.get(base + health_path, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {ready_timeout:.0f}s; log ({log_path}) ends with:\n"
                                   f"{_tail(log_path)}")
            time.sleep(0.5)
        yield base
    finally:
        stop_process(proc)
