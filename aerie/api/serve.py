"""Start an OpenAI-compatible server on loopback for the duration of a job (``transformers serve``).

Lets a rule regenerate a dataset through a real HTTP server with the same client as OpenRouter:
pick a free port, start the server in its own process group, wait until ``/health`` answers (failing
early, with the server's log tail, when the process dies), and stop it - SIGTERM, then SIGKILL - on
every exit path.

Targets with custom code (Kimi K2.5, the rehearsal target: ``auto_map`` in config.json, loaded with
``trust_remote_code``) are served through ``python -m aerie.api.serve serve MODEL_DIR ...``: transformers
5's ``serve`` ignores ``auto_map`` when it picks the model class (see ``expose_remote_architecture``), so this
launcher makes the folder's own classes the ones it finds, then runs the unchanged ``transformers serve``.
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


def transformers_serve_command(
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> list[str]:
    """``transformers serve`` for one model folder; custom-code folders go through this module's launcher."""
    args = [
        "serve",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
        "--log-level",
        "warning",
    ]
    if trust_remote_code:
        return [sys.executable, "-m", "aerie.api.serve", *args, "--trust-remote-code"]
    # `python -m` of the CLI module: the same interpreter (and venv) as this job, no PATH lookup.
    return [sys.executable, "-m", "transformers.cli.transformers", *args]


def expose_remote_architecture(model_path: str | Path) -> str | None:
    """Make ``transformers serve`` load a custom-code folder with the folder's own classes.

    ``serve`` picks ``AutoModelForMultimodalLM`` when the ``model_type`` is one transformers knows as
    multimodal (``kimi_k25`` is: transformers ships its own Kimi K2.5 classes), else ``transformers.<architectures
    [0]>``; neither consults ``auto_map``. So the folder's config class is registered with that auto class and its
    ``AutoModelForCausalLM`` class is set as ``transformers.<name>``. Returns the name, or None when the folder
    has no custom causal-LM class.
    """
    import json

    import transformers
    from transformers import AutoConfig, AutoModelForMultimodalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config_json = json.loads((Path(model_path) / "config.json").read_text())
    reference = (config_json.get("auto_map") or {}).get("AutoModelForCausalLM")
    names = config_json.get("architectures") or []
    if not reference or not names:
        return None
    cls = get_class_from_dynamic_module(reference, str(model_path))
    if cls.__name__ != names[0]:
        raise ValueError(
            f"{model_path}/config.json: auto_map AutoModelForCausalLM is {cls.__name__}, "
            f"but architectures[0] is {names[0]}"
        )
    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=True)
    AutoModelForMultimodalLM.register(type(config), cls, exist_ok=True)
    setattr(transformers, names[0], cls)
    return names[0]


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
def serve_on_loopback(
    command_for_port, health_path: str, log_path: Path, ready_timeout: float = 300.0, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Run ``command_for_port(port)`` and yield ``http://127.0.0.1:PORT`` once ``health_path`` answers 200."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_fh:
        proc = subprocess.Popen(
            command_for_port(port),
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {proc.returncode} before it was ready; "
                    f"its log ({log_path}) ends with:\n{_tail(log_path)}"
                )
            try:
                if requests.get(base + health_path, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server not ready after {ready_timeout:.0f}s; log ({log_path}) ends with:\n{_tail(log_path)}"
                )
            time.sleep(0.5)
        yield base
    finally:
        stop_process(proc)


def main(argv: list[str] | None = None) -> None:
    """``python -m aerie.api.serve serve MODEL_DIR [transformers serve options] --trust-remote-code``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "serve":
        raise SystemExit("usage: python -m aerie.api.serve serve MODEL_DIR [transformers serve options]")
    expose_remote_architecture(argv[1])
    from transformers.cli.transformers import app

    app(argv, prog_name="transformers")


if __name__ == "__main__":
    main()
