"""Start an OpenAI-compatible server on loopback for the duration of a job (``transformers serve``).

Lets a rule regenerate a dataset through a real HTTP server with the same client as OpenRouter:
pick a free port, start the server in its own process group, wait until ``/health`` answers (failing
early, with the server's log tail, when the process dies), and stop it - SIGTERM, then SIGKILL - on
every exit path.

Targets with custom code (Kimi K2.5, the rehearsal target: ``auto_map`` in config.json, loaded with
``trust_remote_code``) are served through ``python -m aerie.target_model.serve serve MODEL_DIR ...``: transformers
5's ``serve`` ignores ``auto_map`` when it picks the model class (see ``expose_remote_architecture``), so this
launcher makes the folder's own classes the ones it finds, then runs ``transformers serve`` sampling as an API does
(``honour_request_sampling``: a positive temperature samples, seeded per request).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
import torch
import transformers
from transformers import AutoConfig, AutoModelForMultimodalLM
from transformers.cli.serving import utils as serving
from transformers.cli.transformers import app
from transformers.dynamic_module_utils import get_class_from_dynamic_module

DEFAULT_REQUEST_SEED_FLAG = "--default-request-seed"  # the launcher's own option; not passed to transformers


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
    default_request_seed: int | None = None,
) -> list[str]:
    """``transformers serve`` for one model folder; custom-code folders and seeded sampling go through this
    module's launcher. ``default_request_seed``: requests without a ``seed`` are sampled as if they carried
    this one (see ``honour_request_sampling``): each answer is then a function of its request alone."""
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
    if trust_remote_code or default_request_seed is not None:
        launcher = [sys.executable, "-m", "aerie.target_model.serve", *args]
        if default_request_seed is not None:
            launcher += [DEFAULT_REQUEST_SEED_FLAG, str(default_request_seed)]
        return launcher + (["--trust-remote-code"] if trust_remote_code else [])
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


def request_seed(seed: int, prompt_ids: list[int]) -> int:
    """The torch seed for one request: its ``seed`` mixed with its prompt ids, so that one seed sent with every
    request (as aerie's ``responses.send_seed`` does) still gives different prompts independent draws."""
    digest = hashlib.sha256(f"{seed}\n{prompt_ids}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


class _SeededGenerate:
    """The served model with ``generate`` seeded first; everything else is the model's own."""

    def __init__(self, model: Any, seed: int):
        self._model, self._seed = model, seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        torch.manual_seed(self._seed)  # on the inference thread, which runs one generate at a time
        return self._model.generate(*args, **kwargs)


def honour_request_sampling(default_seed: int | None = None) -> None:
    """Make ``transformers serve`` sample as an API does, each answer a function of its request alone.

    Sampling: a request with a positive ``temperature`` is sampled (``do_sample``), as OpenAI-compatible servers and
    OpenRouter's providers do. transformers 5's server only ever turns sampling off (temperature 0) and otherwise
    keeps the model's ``generation_config.do_sample``, False unless the folder's generation_config.json says
    otherwise: such a folder would be decoded greedily whatever temperature and top_p the request asks for.

    Seeds: each request is seeded right before its ``generate``, on the thread that generates, from the request's
    ``seed`` (``default_seed`` when it has none; unseeded when both are None) mixed with its prompt ids
    (``request_seed``), so one seed sent with every request still gives different prompts independent draws and a
    retried request gets the same answer whatever else is in flight. Covers the sequential generation path, the one
    the launcher serves (continuous batching is never enabled by it).

    Two layouts of ``transformers.cli.serving`` are known; anything else is refused by name rather than served
    with sampling that silently differs:
    - 5.24: ``BaseHandler._build_generation_config`` seeds the process-wide RNG on the event-loop thread when a
      request arrives, while ``GenerateManager`` generates later on its inference thread (answers depend on timing):
      the seed is moved to the inference thread.
    - 5.25: ``BaseHandler._build_generation_kwargs`` carries the ``seed`` to ``GenerateRunner``, which seeds in the
      model's own (spawned) process right before ``generate``: the request's seed is mixed with its prompt there.
      That process re-imports this module as ``__mp_main__``; the launcher's settings reach it through the
      environment (``LAUNCHER_ENV``), and ``_prepare_spawned_process`` patches it the same way.
    """
    base = getattr(serving, "BaseHandler", None)
    if base is not None and hasattr(base, "_build_generation_kwargs") and hasattr(serving, "GenerateRunner"):
        _seed_per_request_runner(serving, default_seed)
    elif base is not None and hasattr(base, "_build_generation_config") and hasattr(serving, "GenerateManager"):
        _seed_per_request_manager(serving, default_seed)
    else:
        raise RuntimeError(
            f"transformers {transformers.__version__}: transformers.cli.serving.utils has neither BaseHandler."
            "_build_generation_kwargs with GenerateRunner (5.25) nor BaseHandler._build_generation_config with "
            "GenerateManager (5.24), which aerie.target_model.serve seeds per request; install transformers>=5.24,<5.26"
        )


def _prompt_ids(inputs: dict) -> list[int]:
    """The prompt's token ids, from a batch of one (tensors) or a plain list (continuous batching)."""
    ids = inputs["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]


def _samples_when_warm(body: dict) -> bool:
    return body.get("temperature") is not None and float(body["temperature"]) > 0


def _seed_per_request_runner(serving: Any, default_seed: int | None) -> None:
    """transformers 5.25: the request's seed travels in its generation kwargs to ``GenerateRunner.generate``."""
    base, runner = serving.BaseHandler, serving.GenerateRunner
    build, generate = base._build_generation_kwargs, runner.generate

    def build_generation_kwargs(self: Any, body: dict, model_generation_config: Any) -> dict:
        kwargs = build(self, body, model_generation_config)
        if _samples_when_warm(body):
            kwargs["do_sample"] = True
        if kwargs.get("seed") is None and default_seed is not None:
            kwargs["seed"] = int(default_seed)
        return kwargs

    def seeded_generate(self: Any, request_id: int, inputs: dict, generation_kwargs: dict, stream: bool) -> None:
        if generation_kwargs.get("seed") is not None:
            seed = request_seed(int(generation_kwargs["seed"]), _prompt_ids(inputs))
            generation_kwargs = {**generation_kwargs, "seed": seed}
        return generate(self, request_id, inputs, generation_kwargs, stream)

    base._build_generation_kwargs = build_generation_kwargs
    runner.generate = seeded_generate


def _seed_per_request_manager(serving: Any, default_seed: int | None) -> None:
    """transformers 5.24: the seed is taken off the request at arrival and set right before its ``generate``."""
    base, manager = serving.BaseHandler, serving.GenerateManager
    seeds: dict[int, int] = {}  # id(generation config) -> the request's seed, until its generate starts
    build, non_streaming, streaming = (
        base._build_generation_config,
        manager.generate_non_streaming,
        manager.generate_streaming,
    )

    def build_generation_config(self: Any, body: dict, model_generation_config: Any, use_cb: bool = False) -> Any:
        seed = body["seed"] if body.get("seed") is not None else default_seed
        config = build(self, {k: v for k, v in body.items() if k != "seed"}, model_generation_config, use_cb=use_cb)
        if _samples_when_warm(body):
            config.do_sample = True
        if seed is not None:
            seeds[id(config)] = int(seed)
        return config

    def seeded(model: Any, inputs: dict, gen_config: Any) -> Any:
        seed = seeds.pop(id(gen_config), None)
        if seed is None:
            return model
        return _SeededGenerate(model, request_seed(seed, _prompt_ids(inputs)))

    async def generate_non_streaming(
        self: Any, model: Any, processor: Any, inputs: dict, gen_config: Any, request_id: str
    ) -> Any:
        return await non_streaming(self, seeded(model, inputs, gen_config), processor, inputs, gen_config, request_id)

    def generate_streaming(
        self: Any,
        model: Any,
        processor: Any,
        inputs: dict,
        gen_config: Any,
        request_id: str,
        response_parser: Any = None,
    ) -> Any:
        model = seeded(model, inputs, gen_config)
        return streaming(self, model, processor, inputs, gen_config, request_id, response_parser=response_parser)

    base._build_generation_config = build_generation_config
    manager.generate_non_streaming = generate_non_streaming
    manager.generate_streaming = generate_streaming


# The launcher's settings, for the processes `transformers serve` spawns (5.25 loads the model in one of its own).
LAUNCHER_ENV = "AERIE_SERVE_LAUNCHER"


def _prepare(model_path: str, default_seed: int | None) -> None:
    expose_remote_architecture(model_path)
    honour_request_sampling(default_seed)


def _prepare_spawned_process() -> None:
    """In a process ``transformers serve`` spawned from the launcher: the same preparation as the launcher's."""
    settings = os.environ.get(LAUNCHER_ENV)
    if settings:
        launcher = json.loads(settings)
        _prepare(launcher["model"], launcher["default_seed"])


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
    """``python -m aerie.target_model.serve serve MODEL_DIR [transformers serve options]
    [--default-request-seed N]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: python -m aerie.target_model.serve serve MODEL_DIR [transformers serve options] "
        f"[{DEFAULT_REQUEST_SEED_FLAG} N]"
    )
    if len(argv) < 2 or argv[0] != "serve":
        raise SystemExit(usage)
    default_seed = None
    if DEFAULT_REQUEST_SEED_FLAG in argv:
        at = argv.index(DEFAULT_REQUEST_SEED_FLAG)
        try:
            default_seed = int(argv[at + 1])
        except (IndexError, ValueError):
            raise SystemExit(f"{DEFAULT_REQUEST_SEED_FLAG} takes an integer\n{usage}") from None
        del argv[at : at + 2]

    os.environ[LAUNCHER_ENV] = json.dumps({"model": argv[1], "default_seed": default_seed})  # spawned processes
    _prepare(argv[1], default_seed)

    app(argv, prog_name="transformers")


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # this launcher's module, re-imported by a process `transformers serve` spawned
    _prepare_spawned_process()
