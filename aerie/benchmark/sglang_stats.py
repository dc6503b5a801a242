"""Statistics of the serving benchmark: per run, per (set, concurrency) row, and the summary.

One name per acceptance definition (docs/formats.md, "Acceptance figures"):

- ``acceptance_length``: aerie's, the gate's: tokens committed per verify step, pooled over the requests, the first
  token left out (it comes from prefill, not from a verify step): ``sum(completion_tokens - 1) / sum(spec_verify_ct)``,
  the in-process benchmark's definition.
- ``spec_accept_length``: SGLang's: ``completion_tokens / spec_verify_ct`` (each ``/generate`` response's
  ``meta_info.spec_accept_length``, the prefill token counted), pooled over the requests as the published cards'
  benchmarks (SpecForge's ``bench_eagle3.py``) pool it: ``sum(completion_tokens) / sum(spec_verify_ct)``;
  ``spec_accept_length_mean`` is its plain mean over requests.
- ``server_avg_spec_accept_length``: SGLang's server counter, kept only as a cross-check: in SGLang 0.5.23 it is
  reset by ``/flush_cache`` (which the harness calls before every run), folded in only every ``decode_log_interval``
  (default 40) decode steps, so the last steps of a run may be missing, and leaves the prefill token out:
  :data:`SERVER_COUNTER_NOTE`.

Outputs that loop or repeat (:mod:`aerie.tools.degenerate`, the same definition as the in-process benchmark)
are counted, and acceptance is also given without them: a loop is trivially predictable.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from aerie.sources.datasets import PromptSet
from aerie.tools.degenerate import degenerate_flags

_MAX_DIFF_EXAMPLES = 5

SERVER_COUNTER_NOTE = (
    "server_avg_spec_accept_length is SGLang's own avg_spec_accept_length read from /server_info right after the "
    "run: accepted tokens per verify step over the decode steps since the last /flush_cache (the harness flushes "
    "before every run unless told not to), folded in only every decode_log_interval (default 40) decode steps, "
    "and without the first (prefill) token; acceptance_length (aerie's, the gate's: prefill token left out) and "
    "spec_accept_length (SGLang's per-request completion_tokens / spec_verify_ct, pooled) are the figures"
)


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def correct_drafts_histogram(records: Sequence[dict[str, Any]]) -> list[int]:
    """``[j]``: verify steps that accepted ``j`` drafts (the bonus token not counted), summed over the records'
    ``spec_correct_drafts_histogram`` (SGLang 0.5.23's per-request meta_info)."""
    histogram: list[int] = []
    for r in records:
        for j, count in enumerate(r.get("spec_correct_drafts_histogram") or []):
            histogram.extend([0] * (j + 1 - len(histogram)))
            histogram[j] += int(count)
    return histogram


def mode_stats(
    records: Sequence[dict[str, Any]],
    wall_s: float,
    server_avg_spec_accept_length: float | None = None,
    record_outputs: bool = True,
    *,
    cache_flushed: bool | None = None,
) -> dict[str, Any]:
    """Statistics of one (mode, set, concurrency) run from its per-request records.

    ``record_outputs=False`` leaves ``output_ids`` and ``text`` out of ``per_request`` (set to null).
    """
    kept = (
        "id",
        "latency_s",
        "e2e_latency_s",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "spec_verify_ct",
        "spec_accept_length",
        "spec_correct_drafts_histogram",
        "degenerate",
        "finish_reason",
        "output_ids",
        "text",
        "error",
    )
    # Judged on the output ids (None without them: the server did not return ids).
    records = [
        {**r, "degenerate": degenerate_flags(r["output_ids"]) if r.get("output_ids") is not None else None}
        if not r.get("error")
        else r
        for r in records
    ]
    ok = [r for r in records if not r.get("error")]
    failed = [r for r in records if r.get("error")]
    out_tokens = sum(int(r["completion_tokens"] or 0) for r in ok)
    lat = sorted(float(r["latency_s"]) for r in ok if r.get("latency_s") is not None)
    per_req_tps = [r["completion_tokens"] / r["latency_s"] for r in ok if r.get("latency_s")]
    e2e = [float(r["e2e_latency_s"]) for r in ok if isinstance(r.get("e2e_latency_s"), (int, float))]
    spec = [r for r in ok if r.get("spec_verify_ct")]
    spec_clean = [r for r in spec if not r.get("degenerate")]
    verify = sum(int(r["spec_verify_ct"]) for r in spec)
    histogram = correct_drafts_histogram(spec)
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
        "acceptance_length": _ratio(sum(int(r["completion_tokens"]) - 1 for r in spec), verify) if spec else None,
        "spec_accept_length": _ratio(sum(int(r["completion_tokens"]) for r in spec), verify) if spec else None,
        "spec_accept_length_mean": statistics.fmean(r["spec_accept_length"] for r in spec) if spec else None,
        "spec_accept_length_mean_excluding_degenerate": (
            statistics.fmean(r["spec_accept_length"] for r in spec_clean) if spec_clean else None
        ),
        "correct_drafts_histogram": histogram if spec else None,
        "server_avg_spec_accept_length": server_avg_spec_accept_length,
        "cache_flushed": cache_flushed,
        "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in ok)),
        "degenerate_requests": sum(1 for r in ok if r.get("degenerate")),
        "per_request": [
            {k: r.get(k) if record_outputs or k not in ("output_ids", "text") else None for k in kept} for r in records
        ],
    }


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first differing element (a length difference counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(
    baseline: Sequence[dict[str, Any]],
    other: Sequence[dict[str, Any]],
    mode: str,
    logit_gaps: Mapping[str, float | None] | None = None,
) -> dict[str, Any]:
    """Per-prompt output equality of two runs over the same prompts (ids when both have them, else text).

    ``logit_gaps``: the target's top-2 logit gap at each divergence, when the server was probed for it
    (:func:`aerie.benchmark.sglang_client.probe_divergences`); ``divergences`` lists every differing prompt."""
    b_by_id = {r["id"]: r for r in baseline if not r.get("error")}
    pairs = [(b_by_id[r["id"]], r) for r in other if not r.get("error") and r["id"] in b_by_id]
    use_ids = all(b.get("output_ids") is not None and e.get("output_ids") is not None for b, e in pairs)
    key = "output_ids" if use_ids else "text"
    differing = []
    for b, e in pairs:
        d = first_difference(b.get(key) or [], e.get(key) or [])
        if d is not None:
            differing.append(
                {
                    "id": e["id"],
                    "first_diff": d,
                    "baseline_tokens": b.get("completion_tokens"),
                    f"{mode}_tokens": e.get("completion_tokens"),
                    "logit_gap": (logit_gaps or {}).get(e["id"]),
                }
            )
    return {
        "compared_on": key,
        "compared": len(pairs),
        "identical": len(pairs) - len(differing),
        "differing": len(differing),
        "first_differing": differing[:_MAX_DIFF_EXAMPLES],
        "divergences": [{"id": d["id"], "first_diff": d["first_diff"], "logit_gap": d["logit_gap"]} for d in differing],
    }


def _run_stats(run: dict[str, Any] | None, record_outputs: bool) -> dict[str, Any] | None:
    if run is None:
        return None
    return mode_stats(
        run["records"],
        run["wall_s"],
        run.get("server_avg_spec_accept_length"),
        record_outputs,
        cache_flushed=run.get("cache_flushed"),
    )


def build_rows(
    prompt_sets: Sequence[PromptSet],
    concurrency: Sequence[int],
    runs: Mapping[str, Mapping[tuple[str, int], dict[str, Any]]],
    record_outputs: bool = True,
    modes: Sequence[str] = ("baseline",),
) -> list[dict[str, Any]]:
    """Rows from raw runs: ``runs[mode][(set, c)] = {records, wall_s, server_avg_spec_accept_length, logit_gaps}``;
    ``modes[0]`` is the baseline. Each row holds every mode's statistics and, under ``versus``, each speculative
    mode's speedup, per-request speedup and lossless check against the baseline of the same row."""
    baseline = modes[0]
    rows = []
    for ps in prompt_sets:
        for c in concurrency:
            row: dict[str, Any] = {"set": ps.name, "concurrency": c, "prompts": len(ps.prompts)}
            for mode in modes:
                row[mode] = _run_stats(runs.get(mode, {}).get((ps.name, c)), record_outputs)
            versus = {}
            for mode in modes[1:]:
                b, e = row[baseline], row[mode]
                run = runs.get(mode, {}).get((ps.name, c))
                versus[mode] = {
                    "speedup": _ratio(e["output_tokens_per_s"], b["output_tokens_per_s"]) if b and e else None,
                    "speedup_per_request": (
                        _ratio(e["per_request_tokens_per_s_mean"], b["per_request_tokens_per_s_mean"])
                        if b and e
                        else None
                    ),
                    "lossless": (
                        compare_outputs(
                            runs[baseline][(ps.name, c)]["records"], run["records"], mode, run.get("logit_gaps")
                        )
                        if b and e
                        else None
                    ),
                }
            row["versus"] = versus
            rows.append(row)
    return rows


def _acceptance(rows: Sequence[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Acceptance over every request of ``mode`` that ran a verify step (all rows)."""
    reqs = [p for r in rows if r.get(mode) for p in r[mode]["per_request"] if not p["error"] and p["spec_verify_ct"]]
    clean = [p for p in reqs if not p["degenerate"]]
    verify = sum(p["spec_verify_ct"] for p in reqs)
    return {
        "acceptance_length": _ratio(sum(p["completion_tokens"] - 1 for p in reqs), verify) if reqs else None,
        "spec_accept_length": _ratio(sum(p["completion_tokens"] for p in reqs), verify) if reqs else None,
        "spec_accept_length_mean": statistics.fmean(p["spec_accept_length"] for p in reqs) if reqs else None,
        "spec_accept_length_mean_excluding_degenerate": (
            statistics.fmean(p["spec_accept_length"] for p in clean) if clean else None
        ),
    }


def _lossless(checks: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    done = [x for x in checks if x]
    compared, identical = sum(x["compared"] for x in done), sum(x["identical"] for x in done)
    return {
        "compared": compared,
        "identical": identical,
        "differing": compared - identical,
        "all_identical": bool(done) and compared == identical,
    }


def _cross_concurrency(prompt_sets, concurrency, base_runs: Mapping[tuple[str, int], dict[str, Any]]) -> dict:
    """The baseline against itself: each set's outputs at the first level vs every other level."""
    cross = {"compared": 0, "identical": 0}
    for ps in prompt_sets:
        first = base_runs.get((ps.name, concurrency[0]))
        for c in concurrency[1:]:
            other = base_runs.get((ps.name, c))
            if first and other:
                cmp = compare_outputs(first["records"], other["records"], "baseline")
                cross["compared"] += cmp["compared"]
                cross["identical"] += cmp["identical"]
    return cross


def _mode_summary(rows: Sequence[dict[str, Any]], mode: str) -> dict[str, Any]:
    """One speculative mode over every row: its speedup range, acceptance, SGLang's own counter (the last run's),
    the lossless check."""
    speedups = [r["versus"][mode]["speedup"] for r in rows if r["versus"][mode]["speedup"]]
    last_server = next(
        (
            r[mode]["server_avg_spec_accept_length"]
            for r in reversed(rows)
            if r[mode] and r[mode]["server_avg_spec_accept_length"] is not None
        ),
        None,
    )
    return {
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
        "speedup_geomean": math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None,
        **_acceptance(rows, mode),
        "server_avg_spec_accept_length": last_server,
        "lossless": _lossless([r["versus"][mode]["lossless"] for r in rows]),
    }


def summarize(
    rows: Sequence[dict[str, Any]],
    prompt_sets: Sequence[PromptSet],
    concurrency: Sequence[int],
    runs: Mapping[str, Mapping[tuple[str, int], dict[str, Any]]],
    modes: Sequence[str] = ("baseline",),
) -> dict[str, Any]:
    """The report's ``summary``: output tokens/s of every mode and each speculative mode's speedup per concurrency;
    per speculative mode its speedups, acceptance over every request and the lossless check; the baseline against
    itself across concurrency levels; failed and degenerate requests per mode. ``modes[0]`` is the baseline."""
    baseline = modes[0]
    by_c = []
    for c in concurrency:
        tps = {}
        for mode in modes:
            stats = [r[mode] for r in rows if r["concurrency"] == c and r[mode]]
            tok, wall = sum(s["output_tokens"] for s in stats), sum(s["wall_s"] for s in stats)
            tps[mode] = _ratio(tok, wall) if stats else None
        by_c.append(
            {
                "concurrency": c,
                "output_tokens_per_s": tps,
                "speedup": {m: _ratio(tps[m], tps[baseline]) for m in modes[1:]},
            }
        )
    return {
        "by_concurrency": by_c,
        "modes": {m: _mode_summary(rows, m) for m in modes[1:]},
        "baseline_cross_concurrency": _cross_concurrency(prompt_sets, concurrency, runs.get(baseline, {})),
        "failed_requests": {m: sum(r[m]["failed"] for r in rows if r[m]) for m in modes},
        "degenerate_requests": {m: sum(r[m]["degenerate_requests"] for r in rows if r[m]) for m in modes},
    }
