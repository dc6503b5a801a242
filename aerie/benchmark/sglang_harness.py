"""Serving benchmark on the GPU host: the target under SGLang, without and with each drafter.

The bench job's SGLang backend (:mod:`aerie.benchmark.serving`) runs it inside the pipeline; ``aerie-sglang-bench``
runs it by hand. For each mode in turn (``baseline``, each trained drafter by its name, then each reference:
``ngram`` / ``ngram_default``, SGLang's NGRAM speculative algorithm, or a reference drafter folder), each drafter
served with its kind's flags (:func:`aerie.benchmark.sglang_server.drafter_flags`: EAGLE-3's ``EAGLE3``, DFlash's
``DFLASH``), the harness starts ``python -m sglang.launch_server`` on a free loopback port
(:func:`aerie.target_model.serve.serve_on_loopback`), waits for ``/health``, sends warm-up requests, then runs every
prompt set at every configured concurrency level against the native ``/generate`` endpoint (greedy: temperature 0,
``skip_special_tokens: false``, ``max_new_tokens`` from the config), and stops the server - SIGTERM, then SIGKILL,
then every process the server left behind - on every exit path. Prompts are rendered once, before any server
starts, by the target's chat template (``input_ids``) or to a string (``text``), so every mode sees the same input.
The radix cache is flushed before every (set, concurrency) run so no mode profits from prefixes cached by an
earlier run.

SGLang lives in its own environment (envs/sglang.yaml); the harness runs there too in the bench job (which
starts the servers with its own interpreter), or in any environment with aiohttp, requests and transformers when
run by hand, launching the server with ``--sglang-python`` (default: this interpreter). After a speculative
server's timed runs, each output that differs from the baseline's is probed on that server for the target's top-2
logit gap at the first differing token (:func:`aerie.benchmark.sglang_client.probe_divergences`).

One job per module: :mod:`aerie.benchmark.sglang_server` (settings, command lines, the server's processes),
:mod:`aerie.benchmark.sglang_client` (requests and responses), :mod:`aerie.benchmark.sglang_stats` (statistics;
what the acceptance figures mean), :mod:`aerie.sources.datasets` (the benchmark prompt sets); this one runs the
benchmark and holds the command line.

Usage (``aerie-sglang-bench`` is the installed console script; ``python -m aerie.benchmark.sglang_harness``
runs the same)::

    aerie-sglang-bench --config config/kimi-k2.5.yaml \\
        --drafter results/drafter/kimi-k2.5-eagle3 --drafter results/drafter/kimi-k2.5-dflash \\
        --sglang-python /opt/sglang-env/bin/python \\
        --prompt-set mtbench:prompts/mt_bench_questions.jsonl --prompt-set gsm8k:prompts/gsm8k_test.jsonl \\
        --prompt-set humaneval --out results/bench/kimi-k2.5-eagle3.sglang.json

Output: one JSON file, format ``aerie.sglang-bench/5``, documented in docs/formats.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from aerie.benchmark.methods import BASELINE, NGRAM, NGRAM_DEFAULT, TRAINED, Method, bench_methods, folder_kind
from aerie.benchmark.plots import plot_sglang_benchmark
from aerie.benchmark.settings import BenchRun, resolve_reference_folder
from aerie.benchmark.sglang_client import SGLangClient, drive_server
from aerie.benchmark.sglang_server import (
    MARKER_ENV,
    NGRAM_DEFAULT_DRAFT_TOKENS,
    drafter_flags,
    flag_value,
    kill_leftovers,
    marked_pids,
    ngram_flags,
    redact_command,
    server_command,
    sglang_settings,
)
from aerie.benchmark.sglang_stats import SERVER_COUNTER_NOTE, build_rows, summarize
from aerie.sources.datasets import BENCHMARK_KINDS, PromptSet, parse_prompt_set
from aerie.target_model.model import load_tokenizer
from aerie.target_model.serve import serve_on_loopback
from aerie.target_model.template import render_prompt_ids
from aerie.tools.artifacts import atomic_write_text

# /2: degenerate outputs as in the in-process benchmark, notes; /3: reference servers (SGLang's NGRAM), the target's
# logit gap at each divergence, acceptance histograms; /4: one name per acceptance definition (acceptance_length,
# spec_accept_length), reference drafter folders and NGRAM at the EAGLE-3 width (ngram) or SGLang's (ngram_default);
# /5: any number of trained drafters of any kind (a server each, by name, with its kind's flags), each mode's role,
# kind and draft width (methods), every speculative mode alike in rows (versus) and summary (modes)
SGLANG_BENCH_FORMAT = "aerie.sglang-bench/5"
REFERENCE_MODES = (NGRAM, NGRAM_DEFAULT)  # servers without a drafter the harness can run beside the drafters'


@dataclass(frozen=True)
class ServerPlan:
    """One server of a run: its method (None: the baseline), the drafter folder it serves and its speculative
    flags (none: the baseline)."""

    method: Method | None
    flags: list[str]

    @property
    def folder(self) -> Path | None:
        return self.method.folder if self.method is not None else None


def _gpus() -> list[str] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


def _versions(sglang_version: str | None) -> dict[str, Any]:
    def ver(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "sglang": sglang_version,
        "aerie": ver("aerie"),
        "python": platform.python_version(),
        "aiohttp": ver("aiohttp"),
        "transformers": ver("transformers") if "transformers" in sys.modules else None,
    }


def tokenizer_render(
    tokenizer_path: str | Path,
    *,
    as_text: bool = False,
    trust_remote_code: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Callable[..., list[int] | str]:
    """A render callable from the target's tokenizer: chat template + generation prompt, as ids or text, with the
    prompt's tools and ``chat_template_kwargs`` (e.g. ``{thinking: true}``) as a server renders a request."""
    tok = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    kwargs = dict(chat_template_kwargs or {})
    if as_text:
        return lambda messages, tools=None: tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **({"tools": tools} if tools else {}), **kwargs
        )
    return lambda messages, tools=None: render_prompt_ids(tok, messages, tools, **kwargs)


def server_plans(
    drafters: Mapping[str, Path], references: Sequence[str], reference_drafters: Mapping[str, Path], settings
) -> dict[str, ServerPlan]:
    """``{mode: plan}`` in the order the servers run: the baseline, each trained drafter, then each reference; each
    drafter folder with its kind's flags, NGRAM at the chain's width (``ngram``) or at SGLang's own (``ngram_default``).
    ValueError for an unknown reference or two modes of one name."""
    for name in reference_drafters:
        if name not in references:
            raise ValueError(f"reference drafter {name!r} is not in references")
    unknown = [r for r in references if r not in REFERENCE_MODES and r not in reference_drafters]
    if unknown:
        raise ValueError(
            f"unknown reference server {unknown[0]!r} (built in: {', '.join(REFERENCE_MODES)}; a drafter folder needs "
            "its path in reference_drafters)"
        )
    methods = bench_methods(
        drafters,
        list(dict.fromkeys(references)),
        reference_drafters,
        num_draft_steps=settings["speculative_num_steps"],
        ngram_draft_tokens=settings["speculative_num_draft_tokens"] - 1,  # the verified token is not a draft
        ngram_default_draft_tokens=NGRAM_DEFAULT_DRAFT_TOKENS - 1,
    )
    plans = {BASELINE: ServerPlan(None, [])}
    for name, m in methods.items():
        if m.folder is not None:
            flags = drafter_flags(m.folder, settings)
        else:
            flags = ngram_flags(settings, at_chain_width=m.role == NGRAM)
        plans[name] = ServerPlan(m, flags)
    return plans


def _check_run(settings: Mapping[str, Any], plans: Mapping[str, ServerPlan], prompt_sets, max_new_tokens, log) -> None:
    """ValueError on a bad budget, empty or ambiguous prompt sets; a warning where SGLang changes a chain's flags."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    chains = [m for m, p in plans.items() if "--speculative-eagle-topk" in p.flags]
    if (
        chains
        and settings["speculative_eagle_topk"] == 1
        and settings["speculative_num_draft_tokens"] != settings["speculative_num_steps"] + 1
    ):
        log(
            "WARNING: with speculative_eagle_topk 1 SGLang sets speculative_num_draft_tokens to "
            f"speculative_num_steps + 1; the effective values are in servers.{chains[0]}.server_info"
        )
    if not prompt_sets:
        raise ValueError("no prompt sets")
    names = [ps.name for ps in prompt_sets]
    if len(set(names)) != len(names):
        raise ValueError(f"prompt set names must be unique, got {names}")
    for ps in prompt_sets:
        if not ps.prompts:
            raise ValueError(f"prompt set {ps.name!r} is empty")
        ids = [p["id"] for p in ps.prompts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt set {ps.name!r} has duplicate prompt ids")


def render_inputs(prompt_sets: Sequence[PromptSet], render: Callable[..., list[int] | str]):
    """``({set: [(prompt id, ids or text)]}, "input_ids" | "text")``: every prompt rendered once, before any server."""
    inputs: dict[str, list[tuple[str, Any]]] = {}
    kinds = set()
    for ps in prompt_sets:
        rendered = []
        for p in ps.prompts:
            x = render(p["messages"], p.get("tools")) if p.get("tools") else render(p["messages"])
            if isinstance(x, str):
                kinds.add("text")
            else:
                x = [int(i) for i in x]
                kinds.add("input_ids")
            rendered.append((p["id"], x))
        inputs[ps.name] = rendered
    if len(kinds) != 1:
        raise ValueError("render must return token ids for every prompt or text for every prompt, not a mix")
    return inputs, kinds.pop()


def _file_name(mode: str) -> str:
    """A mode's name in file names (a Hub repo id has a slash)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "--", mode)


def _client_factory(settings: Mapping[str, Any], max_new_tokens: int, input_key: str, timeout: float):
    """New clients for the servers, authenticated as the servers' own ``--api-key`` / ``--admin-api-key`` say."""
    extra = settings["extra_args"]
    api_key = flag_value(extra, "--api-key")
    admin_key = flag_value(extra, "--admin-api-key") or api_key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    return lambda: SGLangClient("", max_new_tokens, input_key, timeout, headers, admin_headers)


@dataclass
class _Servers:
    """What every server of one benchmark run shares: target, settings, where logs go, how to reach it."""

    target_path: str
    settings: Mapping[str, Any]
    sglang_python: str | None
    log_dir: Path
    stem: str
    run_id: str
    server_env: Mapping[str, str]
    health_path: str
    ready_timeout: float
    stop_grace_s: float
    client: Callable[[], SGLangClient]

    def run(self, mode: str, plan: ServerPlan, drive: Callable[[SGLangClient], Any], log) -> tuple[dict, Any]:
        """Start ``mode``'s server, ``drive`` it, stop it and every process it left: (server info, drive's result or
        the exception it raised)."""
        marker = f"{self.run_id}-{_file_name(mode)}"
        log_path = self.log_dir / f"{self.stem}.{_file_name(mode)}.server.log"
        launched: dict[str, list[str]] = {}

        def command_for_port(port: int) -> list[str]:
            launched["cmd"] = server_command(
                self.target_path, port, self.settings, speculative=plan.flags, python=self.sglang_python
            )
            return launched["cmd"]

        info: dict[str, Any] = {
            "role": plan.method.role if plan.method is not None else BASELINE,
            "kind": plan.method.kind if plan.method is not None else None,
            "drafter": str(plan.folder) if plan.folder is not None else None,
            "command": None,
            "command_line": None,
            "log": str(log_path),
            "env_keys": sorted(self.server_env),
            "ready_s": None,
            "server_info_endpoint": None,
            "server_info": None,
            "pids": [],
            "leftover_pids_killed": [],
            "error": None,
        }
        client = self.client()
        log(f"{mode}: starting SGLang (log {log_path})")
        t0 = time.monotonic()
        result: Any = None
        try:
            env = {**self.server_env, MARKER_ENV: marker}
            with serve_on_loopback(command_for_port, self.health_path, log_path, self.ready_timeout, env=env) as base:
                info["ready_s"] = time.monotonic() - t0
                info["pids"] = sorted(marked_pids(marker))
                log(f"{mode}: ready at {base} after {info['ready_s']:.0f}s")
                client.base = base
                result = drive(client)
                info["server_info_endpoint"] = client.info_endpoint
        except BaseException as e:  # noqa: BLE001 - recorded in the report, then raised by the caller
            info["error"] = f"{mode}: {type(e).__name__}: {e}"
            result = e
        finally:
            if "cmd" in launched:
                info["command"] = redact_command(launched["cmd"])
                info["command_line"] = shlex.join(info["command"])
            info["leftover_pids_killed"] = kill_leftovers(marker, self.stop_grace_s)
            if info["leftover_pids_killed"]:
                log(f"{mode}: killed processes left by the server: {info['leftover_pids_killed']}")
        return info, result


def _drive_every_server(
    plans: Mapping[str, ServerPlan],
    servers_run: _Servers,
    prompt_sets: Sequence[PromptSet],
    inputs: Mapping[str, list[tuple[str, Any]]],
    concurrency: Sequence[int],
    warmup: int,
    flush_cache: bool,
    log: Callable[[str], None],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], BaseException | None]:
    """Each mode's server in turn, over every prompt set and level: (runs, server infos, the error that stopped
    the run, if one did: the servers after it do not start)."""
    runs: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    servers: dict[str, dict[str, Any]] = {}
    for mode, plan in plans.items():

        def drive(client: SGLangClient, mode: str = mode) -> Any:
            baseline = runs.get("baseline") if mode != "baseline" else None
            return asyncio.run(
                drive_server(
                    client, prompt_sets, inputs, concurrency, warmup, flush_cache, mode, log, baseline_runs=baseline
                )
            )

        servers[mode], result = servers_run.run(mode, plan, drive, log)
        if isinstance(result, BaseException):
            return runs, servers, result
        runs[mode], server_info = result
        if server_info is not None:
            servers[mode]["server_info"] = {
                **server_info["fields"],
                "avg_spec_accept_length": server_info["avg_spec_accept_length"],
            }
    return runs, servers, None


@dataclass(frozen=True)
class ServerControl:
    """How the harness runs each SGLang server and what its report keeps. ``sglang_python``: the interpreter that
    starts the servers (SGLang's environment; None: this one), with ``server_env`` added to their environment;
    ``health_path``: the readiness endpoint (``/health`` or ``/health_generate``); ``stop_grace_s``: how long a
    stopped server's processes may take to exit before they are killed (GPU memory must be free before the next
    server starts); ``log_dir``: the servers' logs (None: beside the report); ``flush_cache``: flush the radix cache
    between runs; ``record_outputs=False`` keeps output ids and text out of the report (the lossless check still
    compares them)."""

    sglang_python: str | None = None
    server_env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    ready_timeout: float = 3600.0
    request_timeout: float = 3600.0
    stop_grace_s: float = 30.0
    log_dir: Path | None = None
    flush_cache: bool = True
    record_outputs: bool = True


def run_sglang_benchmark(
    target_path: str | Path,
    drafters: Mapping[str, str | Path],
    prompt_sets: Sequence[PromptSet],
    out_json: str | Path,
    run: BenchRun,
    *,
    sglang: Mapping[str, Any] | None = None,
    control: ServerControl = ServerControl(),
    render: Callable[..., list[int] | str] | None = None,
    reference_drafters: Mapping[str, str | Path] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Benchmark the target served by SGLang without a drafter and with each one; write and return the report.

    ``drafters``: the trained drafters, name -> folder, each served with its kind's flags (in this order, after the
    baseline). ``run.references``: further servers run after those, each over the same prompts: ``ngram`` (SGLang's
    NGRAM at the EAGLE-3 chain's width), ``ngram_default`` (NGRAM at SGLang's defaults), or the name of a drafter
    folder in ``reference_drafters`` (``{name: folder}``), served with its kind's flags. Every speculative server's
    outputs are compared with the baseline's, and each divergence is probed for the target's top-2 logit gap there,
    on that server. Of ``run`` the harness reads ``max_new_tokens``, ``warmup`` (requests per server) and
    ``references``.

    ``render(messages[, tools])`` returns the prompt as token ids (sent as ``input_ids``) or as a string (sent as
    ``text``); None renders ids with the tokenizer at ``target_path``. ``sglang`` is the config's ``sglang:``
    section; ``control`` how the servers run (:class:`ServerControl`).
    """
    settings = sglang_settings(sglang)
    max_new_tokens, warmup = run.max_new_tokens, run.warmup
    plans = server_plans(
        {k: Path(v) for k, v in drafters.items()},
        run.references,
        {k: Path(v) for k, v in (reference_drafters or {}).items()},
        settings,
    )
    target_path, out_json = str(target_path), Path(out_json)
    _check_run(settings, plans, prompt_sets, max_new_tokens, log)
    if render is None:
        trust = "--trust-remote-code" in settings["extra_args"]
        render = tokenizer_render(target_path, trust_remote_code=trust)
    inputs, input_key = render_inputs(prompt_sets, render)

    servers_run = _Servers(
        target_path=target_path,
        settings=settings,
        sglang_python=control.sglang_python,
        log_dir=Path(control.log_dir) if control.log_dir is not None else out_json.parent,
        stem=out_json.name.removesuffix(".json"),
        run_id=uuid.uuid4().hex[:12],
        server_env=dict(control.server_env),
        health_path=control.health_path,
        ready_timeout=control.ready_timeout,
        stop_grace_s=control.stop_grace_s,
        client=_client_factory(settings, max_new_tokens, input_key, control.request_timeout),
    )

    runs, servers, error = _drive_every_server(
        plans, servers_run, prompt_sets, inputs, settings["concurrency"], warmup, control.flush_cache, log
    )
    report = _serving_report(
        plans=plans,
        runs=runs,
        servers=servers,
        error=error,
        prompt_sets=prompt_sets,
        settings=settings,
        target_path=target_path,
        input_key=input_key,
        max_new_tokens=max_new_tokens,
        warmup=warmup,
        flush_cache=control.flush_cache,
        record_outputs=control.record_outputs,
    )
    atomic_write_text(out_json, _dumps(report))
    if error is not None:
        log(f"{out_json}: partial report written; {report['error']}")
        raise error
    for mode, m in report["summary"]["modes"].items():
        log(
            f"{out_json}: {mode}: speedup {m['speedup_min'] or float('nan'):.2f}x.."
            f"{m['speedup_max'] or float('nan'):.2f}x, acceptance_length {m['acceptance_length'] or float('nan'):.2f} "
            f"(aerie's), spec_accept_length {m['spec_accept_length'] or float('nan'):.2f} (SGLang's), lossless "
            f"{m['lossless']['identical']}/{m['lossless']['compared']}, failed requests "
            f"{report['summary']['failed_requests'][mode]}"
        )
    return report


def _folder_facts(plan: ServerPlan) -> dict[str, Any]:
    """What the report keeps of a drafter server's folder: where it is, its kind, its config.json."""
    return {"folder": str(plan.folder), "kind": plan.method.kind, "config": folder_kind(plan.folder)[1]}


def _serving_report(
    *,
    plans: Mapping[str, ServerPlan],
    runs: Mapping[str, Any],
    servers: dict[str, dict[str, Any]],
    error: BaseException | None,
    prompt_sets: Sequence[PromptSet],
    settings: Mapping[str, Any],
    target_path: str,
    input_key: str,
    max_new_tokens: int,
    warmup: int,
    flush_cache: bool,
    record_outputs: bool,
) -> dict[str, Any]:
    """The harness's report (``aerie.sglang-bench/5``, docs/formats.md) of the runs so far."""
    modes = list(plans)
    rows = build_rows(prompt_sets, settings["concurrency"], runs, record_outputs, modes)
    sglang_version = next(
        (
            s["server_info"].get("version")
            for s in servers.values()
            if s.get("server_info") and s["server_info"].get("version")
        ),
        None,
    )
    drafter_plans = {m: p for m, p in plans.items() if p.folder is not None}
    return {
        "format": SGLANG_BENCH_FORMAT,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "complete": error is None and all(r[m] for r in rows for m in modes),
        "modes": modes,
        "error": next((s["error"] for s in servers.values() if s.get("error")), None),
        "target": target_path,
        "methods": {m: p.method.describe() for m, p in plans.items() if p.method is not None},
        "drafters": {m: _folder_facts(p) for m, p in drafter_plans.items() if p.method.role == TRAINED},
        "reference_drafters": {m: _folder_facts(p) for m, p in drafter_plans.items() if p.method.role != TRAINED},
        "sglang": {**settings, "extra_args": redact_command(settings["extra_args"])},
        "sampling": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "skip_special_tokens": False},
        "input": input_key,
        "warmup": warmup,
        "flush_cache": flush_cache,
        "record_outputs": record_outputs,
        "prompt_sets": [
            {"name": ps.name, "kind": ps.kind, "source": ps.source, "prompts": len(ps.prompts)} for ps in prompt_sets
        ],
        "servers": servers,
        "versions": _versions(sglang_version),
        "host": {"hostname": platform.node(), "gpus": _gpus()},
        "rows": rows,
        "summary": summarize(rows, prompt_sets, settings["concurrency"], runs, modes),
        "notes": {
            "acceptance": SERVER_COUNTER_NOTE,
            "degenerate": "degenerate lists the flags of aerie.tools.degenerate (loop: the output ends in a "
            "short cycle; repetitive: mostly repeated 4-grams), the in-process benchmark's "
            "definition; such outputs inflate acceptance",
        },
    }


def _dumps(report: dict[str, Any]) -> str:
    """Indented JSON with every list of integers (token ids, pids) on one line: a run keeps ~10^6 ids."""
    token = uuid.uuid4().hex
    packed: list[str] = []

    def pack(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: pack(v) for k, v in x.items()}
        if isinstance(x, list):
            if x and all(isinstance(i, int) and not isinstance(i, bool) for i in x):
                packed.append(json.dumps(x, separators=(",", ":")))
                return f"{token}:{len(packed) - 1}"
            return [pack(v) for v in x]
        return x

    text = json.dumps(pack(report), indent=2, ensure_ascii=False)
    return re.sub(f'"{token}:([0-9]+)"', lambda m: packed[int(m.group(1))], text) + "\n"


# ---- command line -------------------------------------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    cfg = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return cfg


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="aerie-sglang-bench",
        description="Benchmark the target under SGLang without and with each drafter (its kind's flags) "
        f"(writes {SGLANG_BENCH_FORMAT} JSON).",
    )
    ap.add_argument(
        "--config",
        type=Path,
        help="pipeline config YAML: its sglang: section, bench.max_new_tokens, "
        "target.path and target.trust_remote_code are the defaults",
    )
    ap.add_argument("--target", help="target model path for SGLang (default: target.path of --config)")
    ap.add_argument(
        "--drafter",
        required=True,
        action="append",
        metavar="[NAME=]FOLDER",
        help="a trained drafter folder in SGLang's layout, any kind aerie reads (EAGLE-3, DFlash), served with its "
        "kind's flags; repeatable; named NAME, else by its folder's name",
    )
    ap.add_argument(
        "--prompt-set",
        action="append",
        required=True,
        metavar="[NAME=]KIND[:PATH]",
        help=f"repeatable; KIND is one of {', '.join(BENCHMARK_KINDS)} (humaneval needs no PATH)",
    )
    ap.add_argument("--max-prompts", type=int, help="first N prompts of each set")
    ap.add_argument("--out", required=True, type=Path, help=f"report ({SGLANG_BENCH_FORMAT} JSON)")
    ap.add_argument(
        "--sglang-python", metavar="PATH", help="python of SGLang's environment (default: this interpreter)"
    )
    over = "overrides sglang.%s of --config"
    ap.add_argument("--tp", type=int, help=over % "tp" + " (sent as --tp-size)")
    ap.add_argument("--speculative-num-steps", type=int, help=over % "speculative_num_steps")
    ap.add_argument("--speculative-eagle-topk", type=int, help=over % "speculative_eagle_topk")
    ap.add_argument("--speculative-num-draft-tokens", type=int, help=over % "speculative_num_draft_tokens")
    ap.add_argument("--mem-fraction-static", type=float, help=over % "mem_fraction_static")
    ap.add_argument(
        "--extra-args",
        metavar="'ARGS'",
        help="extra launch_server arguments as one shell-quoted string, written --extra-args='--a b' "
        "(replaces the config's extra_args)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", help=over % "concurrency" + " (levels, e.g. 1 8 32)")
    ap.add_argument("--max-new-tokens", type=int, help="default: bench.max_new_tokens of --config, else 128")
    ap.add_argument(
        "--input",
        choices=["input_ids", "text"],
        default="input_ids",
        help="send the chat-templated prompt as token ids (default) or as text",
    )
    ap.add_argument("--tokenizer", help="tokenizer folder for rendering (default: the target path)")
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="load the tokenizer with trust_remote_code (default: target.trust_remote_code)",
    )
    ap.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="ngram|ngram_default|FOLDER",
        help="also run this reference server (repeatable): ngram (SGLang's NGRAM at the EAGLE-3 width), ngram_default "
        "(NGRAM at SGLang's defaults), or a drafter folder - a path or a Hub repo id in the offline HF cache - served "
        "with its kind's flags",
    )
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per server (default 2)")
    ap.add_argument("--no-flush-cache", action="store_true", help="do not flush the radix cache between runs")
    ap.add_argument("--health-path", default="/health", help="readiness endpoint (/health or /health_generate)")
    ap.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds to wait for a server (default 3600)")
    ap.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request (default 3600)")
    ap.add_argument(
        "--stop-grace",
        type=float,
        default=30.0,
        help="seconds a stopped server's processes get before they are killed (default 30)",
    )
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for the servers (repeatable; values never reported)",
    )
    ap.add_argument("--log-dir", type=Path, help="server logs (default: beside --out)")
    ap.add_argument(
        "--no-outputs",
        action="store_true",
        help="leave output ids and text out of the report (the lossless check still runs)",
    )
    return ap


_SGLANG_OVERRIDES = (
    "tp",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "mem_fraction_static",
    "concurrency",
)


def _sglang_section(a: argparse.Namespace, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config's ``sglang:`` section with the command line's overrides."""
    sglang = dict(cfg.get("sglang") or {})
    for key in _SGLANG_OVERRIDES:
        if getattr(a, key) is not None:
            sglang[key] = getattr(a, key)
    if a.extra_args is not None:
        sglang["extra_args"] = shlex.split(a.extra_args)
    return sglang


def _server_env(items: Sequence[str], ap: argparse.ArgumentParser) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--server-env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def _cli_references(specs: Sequence[str], ap: argparse.ArgumentParser) -> tuple[list[str], dict[str, Path]]:
    """(reference names, {name: folder}) of the --reference values; a folder must be here."""
    drafters = {}
    for spec in specs:
        if spec in REFERENCE_MODES:
            continue
        folder, missing = resolve_reference_folder(spec, None)
        if folder is None:
            ap.error(f"--reference {spec}: {missing}")
        drafters[spec] = folder
    return list(specs), drafters


def _named_folder(spec: str) -> tuple[str, Path]:
    """``NAME=FOLDER``, or ``FOLDER`` named by its folder's name."""
    name, sep, folder = spec.partition("=")
    return (name, Path(folder)) if sep else (Path(spec).name, Path(spec))


def main(argv: Sequence[str] | None = None) -> None:
    ap = _parser()
    a = ap.parse_args(argv)
    cfg = _read_config(a.config) if a.config else {}
    target_cfg = cfg.get("target") or {}
    bench_cfg = cfg.get("bench") or {}
    target = a.target or target_cfg.get("path")
    if not target:
        ap.error("--target is required (or a --config with target.path)")
    max_new_tokens = a.max_new_tokens or bench_cfg.get("max_new_tokens") or 128
    trust = a.trust_remote_code if a.trust_remote_code is not None else bool(target_cfg.get("trust_remote_code"))
    references, reference_drafters = _cli_references(a.reference, ap)
    try:
        sets = [parse_prompt_set(spec, a.max_prompts) for spec in a.prompt_set]
        render = tokenizer_render(
            a.tokenizer or target,
            as_text=a.input == "text",
            trust_remote_code=trust,
            chat_template_kwargs=bench_cfg.get("chat_template_kwargs"),
        )
    except (ValueError, OSError) as e:
        ap.error(str(e))
    report = run_sglang_benchmark(
        target,
        dict(map(_named_folder, a.drafter)),
        sets,
        a.out,
        BenchRun(max_new_tokens=max_new_tokens, warmup=a.warmup, references=tuple(references)),
        sglang=_sglang_section(a, cfg),
        control=ServerControl(
            sglang_python=a.sglang_python,
            server_env=_server_env(a.server_env, ap),
            health_path=a.health_path,
            ready_timeout=a.ready_timeout,
            request_timeout=a.request_timeout,
            stop_grace_s=a.stop_grace,
            log_dir=a.log_dir,
            flush_cache=not a.no_flush_cache,
            record_outputs=not a.no_outputs,
        ),
        render=render,
        reference_drafters=reference_drafters,
    )
    try:  # the figure is a convenience: SGLang's env may lack matplotlib
        plot_sglang_benchmark(report, Path(a.out).with_suffix(".png"))
    except ImportError:
        pass


if __name__ == "__main__":
    main()
