"""The bench rule's SGLang backend (``bench.backend: sglang``): the gated benchmark at the target's real size.

The serving harness (:mod:`aerie.benchmark.sglang_harness`) starts SGLang in turn without speculation (``baseline``),
with each trained drafter (named by its drafter name, served with its kind's flags: EAGLE-3 with the config's EAGLE3
flags, DFlash with DFLASH and its block), and with each reference (``ngram``: SGLang's NGRAM at the EAGLE-3 chain's
width; ``ngram_default``: NGRAM at SGLang's own; a drafter folder: its kind's flags), each over every benchmark prompt
at every ``sglang.concurrency`` level after a cache flush, greedy (temperature 0); it keeps its full report beside
the bench report (``{run}.sglang.json``, ``aerie.sglang-bench/5``). :func:`bench_report_from_serving` turns it into the
in-process benchmark's report (``aerie.bench/4``), which the same plot and gate (:mod:`aerie.benchmark.gate`) read:

- speed: per concurrency level, output tokens/s pooled over the prompt sets and the median over prompts of the paired
  per-request ratio; the report's figures (``baseline``, each method's tokens/s and speedups, each set's table) are
  those of the level where a trained drafter does worst (the lower of the two ratios, the lowest of the trained
  drafters), named in ``concurrency``; ``by_concurrency`` lists every level, and the gate judges each trained
  drafter at the level where it does worst: it must pay off at every level the config serves at.
- acceptance, over every request of the method at every level: ``acceptance_length`` (aerie's, the gate's: tokens
  committed per verify step, the prefill token left out: ``sum(completion_tokens - 1) / sum(spec_verify_ct)``, the
  in-process definition) and ``spec_accept_length`` (SGLang's: ``sum(completion_tokens) / sum(spec_verify_ct)``, as
  the published cards report it); per draft position from SGLang's ``spec_correct_drafts_histogram``.
- failed requests, per method and set: a request without an answer (a server that died mid-run answers every later
  request with an error) is counted, never dropped silently; the gate fails on any.
- lossless (temperature 0): every speculative output must equal the baseline server's output for the same prompt at
  the same concurrency level; each that differs is a divergence, with the target's top-2 logit gap at the first
  differing token, read from the speculative server (``probe_divergences``): a near-tie within
  ``bench.gate.lossless_max_gap`` is numerics (batch shapes, multi-token verify), anything else is a loss.

Runs in SGLang's environment (envs/sglang.yaml): torch-free at import; the prompts are rendered by the target's own
chat template (transformers, SGLang's) before any server starts.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aerie.benchmark.gate import BENCH_FORMAT, gate_speedup, simulated_facts
from aerie.benchmark.methods import trained_drafters
from aerie.benchmark.prompts import bench_prompt_sets
from aerie.benchmark.settings import BenchRun
from aerie.benchmark.sglang_harness import ServerControl, run_sglang_benchmark, tokenizer_render
from aerie.benchmark.sglang_server import sglang_settings
from aerie.benchmark.sglang_stats import correct_drafts_histogram
from aerie.tools.artifacts import atomic_write_json

TIMING = (
    "server throughput: output tokens over the wall time of each (prompt set, concurrency) run; the servers "
    "(baseline, each trained drafter, then each reference) run one after another over the same prompts, the radix "
    "cache flushed before every run; figures at the concurrency level where a trained drafter does worst"
)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _requests(rows: Sequence[dict[str, Any]], mode: str, concurrency: int | None = None) -> list[dict[str, Any]]:
    """Every answered request of ``mode`` (at one concurrency level, or all)."""
    return [
        p
        for r in rows
        if r.get(mode) and (concurrency is None or r["concurrency"] == concurrency)
        for p in r[mode]["per_request"]
        if not p.get("error")
    ]


def _median_paired(rows: Sequence[dict[str, Any]], mode: str, concurrency: int) -> float | None:
    """Median over prompts of (per-request tok/s of ``mode``) / (the baseline's, same prompt), at one level."""
    base = {
        (r["set"], p["id"]): p
        for r in rows
        if r["concurrency"] == concurrency and r.get("baseline")
        for p in r["baseline"]["per_request"]
        if not p.get("error")
    }
    ratios = []
    for r in rows:
        if r["concurrency"] != concurrency or not r.get(mode):
            continue
        for p in r[mode]["per_request"]:
            b = base.get((r["set"], p["id"]))
            if p.get("error") or b is None or not p.get("latency_s") or not b.get("latency_s"):
                continue
            ratio = _ratio(p["completion_tokens"] / p["latency_s"], b["completion_tokens"] / b["latency_s"])
            if ratio is not None:
                ratios.append(ratio)
    return statistics.median(ratios) if ratios else None


def _acceptance(reqs: Sequence[dict[str, Any]], steps: int) -> dict[str, Any]:
    spec = [p for p in reqs if p.get("spec_verify_ct")]
    verify = sum(int(p["spec_verify_ct"]) for p in spec)
    committed = sum(int(p["completion_tokens"]) - 1 for p in spec)  # the first token comes from prefill
    served = sum(int(p["completion_tokens"]) for p in spec)  # SGLang's spec_accept_length counts it
    clean = [p for p in spec if not p.get("degenerate")]
    histogram = correct_drafts_histogram(spec)
    accepted = [sum(histogram[i:]) for i in range(1, steps + 1)]  # steps whose i-th draft was accepted
    return {
        "verify_steps": verify,
        "acceptance_length": _ratio(committed, verify),
        "spec_accept_length": _ratio(served, verify),
        "acceptance_length_excluding_degenerate": _ratio(
            sum(int(p["completion_tokens"]) - 1 for p in clean), sum(int(p["spec_verify_ct"]) for p in clean)
        ),
        "acceptance_per_position": [_ratio(a, sum(histogram)) for a in accepted] if histogram else [None] * steps,
        "accepted_per_position": accepted,
        "drafted_per_position": None,  # SGLang reports accepted drafts per step, not proposed ones per position
    }


def _level(entry: Mapping[str, Any], rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
    """One concurrency level's throughput figures, from the harness summary's ``by_concurrency`` entry."""
    c, tps = entry["concurrency"], entry["output_tokens_per_s"]
    base = tps["baseline"]
    return {
        "concurrency": c,
        "baseline_tokens_per_s": base,
        "methods": {
            m: {
                "tokens_per_s": tps[m],
                "speedup": _ratio(tps[m], base),
                "speedup_median_paired": _median_paired(rows, m, c),
            }
            for m in methods
        },
    }


def _worst_level(levels: Sequence[Mapping[str, Any]], trained: Sequence[str]) -> int:
    """The concurrency level where a trained drafter does worst (its gate figure: the lower of its speedups)."""

    def figure(level: Mapping[str, Any]) -> float:
        return min(gate_speedup(level["methods"][m]) or 0.0 for m in trained)

    return min(levels, key=figure)["concurrency"]


def _totals(rows: Sequence[dict[str, Any]], mode: str, c: int) -> dict[str, Any]:
    stats = [r[mode] for r in rows if r["concurrency"] == c and r.get(mode)]
    tokens, seconds = sum(s["output_tokens"] for s in stats), sum(s["wall_s"] for s in stats)
    return {"tokens_per_s": _ratio(tokens, seconds), "tokens": tokens, "seconds": seconds}


def _failed(rows: Sequence[dict[str, Any]], mode: str) -> int:
    """Requests of ``mode`` that got no answer, over every row; a row its server never ran counts all its prompts."""
    return sum(r[mode]["failed"] if r.get(mode) else r["prompts"] for r in rows)


def _lossless_check(row: Mapping[str, Any], mode: str) -> dict[str, Any] | None:
    return (row["versus"].get(mode) or {}).get("lossless")


def _divergences(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """Every speculative output that left the baseline's, of every method (references included), every level."""
    return [
        {"method": m, "id": d["id"], "concurrency": r["concurrency"], "set": r["set"], **d}
        for r in rows
        for m in methods
        for d in (_lossless_check(r, m) or {}).get("divergences") or []
    ]


def _method_table(rows: Sequence[dict[str, Any]], m: str, c: int, steps: int) -> dict[str, Any]:
    """One method's figures over ``rows`` (a set's, or all): speed at level ``c`` against the baseline at ``c``,
    acceptance over every level (per draft position up to its width ``steps``), lossless and failed requests over
    every level."""
    tot, base = _totals(rows, m, c), _totals(rows, "baseline", c)
    checks = [_lossless_check(r, m) for r in rows]
    return {
        **tot,
        "speedup": _ratio(tot["tokens_per_s"], base["tokens_per_s"]),
        "speedup_median_paired": _median_paired(rows, m, c),
        **_acceptance(_requests(rows, m), steps),
        "lossless": all(x is not None and x["differing"] == 0 for x in checks),
        "failed_requests": _failed(rows, m),
    }


def _set_tables(rows: Sequence[dict[str, Any]], widths: Mapping[str, int], c: int) -> dict[str, Any]:
    """``{set: {prompts, baseline, methods}}``: one table per prompt set (``widths``: each method's draft width)."""
    tables = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        tables[name] = {
            "prompts": mine[0]["prompts"],
            "baseline": {**_totals(mine, "baseline", c), "failed_requests": _failed(mine, "baseline")},
            "methods": {m: _method_table(mine, m, c, w) for m, w in widths.items()},
        }
    return tables


def _per_prompt(rows, methods, c: int, divergences) -> list[dict[str, Any]]:
    """Per prompt at level ``c``: the baseline's figures and each method's."""
    base_by_id: dict[str, dict[str, Any]] = {}
    set_of: dict[str, str] = {}
    for r in rows:
        if r["concurrency"] == c and r.get("baseline"):
            for p in r["baseline"]["per_request"]:
                if not p.get("error"):
                    base_by_id.setdefault(p["id"], p)
                    set_of.setdefault(p["id"], r["set"])
    out = []
    for pid, b in base_by_id.items():
        b_tps = _ratio(b["completion_tokens"], b["latency_s"])
        entry: dict[str, Any] = {
            "id": pid,
            "set": set_of[pid],
            "prompt_tokens": b.get("prompt_tokens"),
            "generated_tokens": b["completion_tokens"],
            "degenerate": b.get("degenerate") or [],
            "baseline_s": [b["latency_s"]],
            "baseline_tokens_per_s": b_tps,
            "methods": {},
        }
        for m in methods:
            p = next((x for x in _requests(rows, m, c) if x["id"] == pid), None)
            if p is None:
                continue
            div = next((d for d in divergences if d["method"] == m and d["id"] == pid and d["concurrency"] == c), None)
            tps = _ratio(p["completion_tokens"], p["latency_s"])
            entry["methods"][m] = {
                "seconds": [p["latency_s"]],
                "tokens_per_s": tps,
                "speedup": _ratio(tps, b_tps),
                "verify_steps": p.get("spec_verify_ct"),
                "acceptance_length": _ratio(p["completion_tokens"] - 1, p.get("spec_verify_ct")),
                "spec_accept_length": p.get("spec_accept_length"),
                "finish_reason": p.get("finish_reason"),
                "lossless": div is None,
                "first_mismatch": div["first_diff"] if div else None,
                **({"mismatch_logit_gap": div["logit_gap"]} if div else {}),
            }
        out.append(entry)
    return out


def bench_report_from_serving(
    serving: Mapping[str, Any],
    *,
    prompt_files: Sequence[Path],
    serving_report: Path,
    max_new_tokens: int,
) -> dict[str, Any]:
    """The ``aerie.bench/4`` report (the in-process benchmark's schema) of a harness report (module docstring)."""
    described = serving["methods"]  # {mode: role, kind, draft_tokens, folder, twin_of} of every speculative server
    methods = list(described)
    rows = serving["rows"]
    levels = [_level(entry, rows, methods) for entry in serving["summary"]["by_concurrency"]]
    c = _worst_level(levels, trained_drafters(described))
    divergences = _divergences(rows, methods)
    widths = {m: int(v["draft_tokens"]) for m, v in described.items()}
    summary = {m: {**described[m], **_method_table(rows, m, c, widths[m])} for m in methods}
    servers = serving["servers"]
    return {
        "format": BENCH_FORMAT,
        "backend": "sglang",
        "target": serving["target"],
        "drafters": {
            name: {
                "kind": facts["kind"],
                "folder": facts["folder"],
                "draft_tokens": widths[name],
                "layer_ids": None,  # SGLang feeds each drafter the layers its config.json names (``config``)
                "config": facts["config"],
                **simulated_facts(Path(facts["folder"]), widths[name], summary[name]["acceptance_length"]),
            }
            for name, facts in serving["drafters"].items()
        },
        "prompt_files": [str(p) for p in prompt_files],
        "prompts": sum(ps["prompts"] for ps in serving["prompt_sets"]),
        "num_draft_steps": int(serving["sglang"]["speculative_num_steps"]),
        "max_new_tokens": max_new_tokens,
        "repeats": 1,
        "warmup": serving["warmup"],
        "timing": TIMING,
        "concurrency": c,
        "baseline": _totals(rows, "baseline", c),
        "lossless": all(summary[m]["lossless"] for m in methods),
        "divergences": divergences,
        "failed_requests": {m: _failed(rows, m) for m in serving["modes"]},
        "methods": summary,
        "sets": _set_tables(rows, widths, c),
        "by_concurrency": levels,
        "degenerate_prompts": sorted({p["id"] for p in _requests(rows, "baseline") if p.get("degenerate")}),
        "eos_token_ids": None,  # the server ends a turn by the target folder's own settings
        "device": f"SGLang, tp {serving['sglang']['tp']}",
        "dtype": ((servers.get("baseline") or {}).get("server_info") or {}).get("dtype"),
        "gpus": (serving.get("host") or {}).get("gpus"),
        "versions": {**serving["versions"], "python": platform.python_version()},
        "serving_report": str(serving_report),
        "serving_summary": serving["summary"],
        "servers": {
            m: {k: s.get(k) for k in ("role", "kind", "command_line", "ready_s", "log", "error")}
            for m, s in servers.items()
        },
        "per_prompt": _per_prompt(rows, methods, c, divergences),
    }


def run_serving_benchmark(
    target: Mapping[str, Any],
    drafters: Mapping[str, Path],
    prompt_files: Sequence[Path],
    out_json: Path,
    run: BenchRun,
    *,
    sglang: Mapping[str, Any] | None,
    reference_drafters: Mapping[str, Path] | None = None,
    render: Callable[..., list[int] | str] | None = None,
    sglang_python: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the harness over the benchmark prompts and write ``out_json`` (``aerie.bench/4``); return the report.
    ``drafters``: the run's trained drafters, name -> folder, in order; ``run``: how every method decodes
    (aerie.benchmark.settings.BenchRun: the draft width and threads are SGLang's, ``sglang.*``).

    The harness's own report goes beside it as ``{run}.sglang.json``, the servers' logs as
    ``{run}.sglang.{mode}.server.log``. Servers run with this interpreter unless ``sglang_python`` is given
    (in the bench job: SGLang's environment) and inherit its environment (the job's CUDA_VISIBLE_DEVICES).
    ``reference_drafters``: ``{name: folder}`` of the references that are drafter folders."""
    settings = sglang_settings(sglang)
    sets = bench_prompt_sets(prompt_files, run.max_prompts)
    if not sets:
        raise ValueError(f"no benchmark prompts in {list(map(str, prompt_files))}")
    if render is None:
        render = tokenizer_render(
            target["path"],
            trust_remote_code=bool(target.get("trust_remote_code")),
            chat_template_kwargs=run.chat_template_kwargs,
        )
    out_json = Path(out_json)
    serving_json = out_json.with_name(out_json.stem + ".sglang.json")
    serving = run_sglang_benchmark(
        target["path"],
        drafters,
        sets,
        serving_json,
        run,
        sglang=settings,
        control=ServerControl(sglang_python=sglang_python),
        render=render,
        reference_drafters=reference_drafters,
        log=log,
    )
    report = bench_report_from_serving(
        serving, prompt_files=prompt_files, serving_report=serving_json, max_new_tokens=run.max_new_tokens
    )
    report["chat_template_kwargs"] = dict(run.chat_template_kwargs)
    atomic_write_json(out_json, report)
    return report
