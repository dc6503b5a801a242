"""Benchmark a drafter: greedy vs. speculative decoding of the same prompts, timed interleaved.

Writes ``bench/{run}.json`` (format ``aerie.bench/1``, docs/formats.md). On a shared machine a
neighbour's load can change latency many times over within seconds, so every prompt is decoded by
both modes back to back, alternating which goes first, and the report gives ratios from the same run.
Times are end to end per request (prefill + decode), measured with ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from aerie.artifacts import atomic_write_json
from aerie.bench.speculative import SpecResult, first_mismatch, greedy_generate, speculative_generate
from aerie.prompts import read_prompts
from aerie.target import end_of_turn_ids, load_target, render_prompt_ids, set_threads

BENCH_FORMAT = "aerie.bench/1"


def load_bench_prompts(prompt_files: Sequence[Path], max_prompts: int | None = None) -> list[dict[str, Any]]:
    prompts: list[dict[str, Any]] = []
    for path in prompt_files:
        prompts.extend(read_prompts(Path(path)))
    seen: set[str] = set()
    for p in prompts:
        if p["id"] in seen:
            raise ValueError(f"duplicate prompt id {p['id']!r} across {list(map(str, prompt_files))}")
        seen.add(p["id"])
    return prompts[:max_prompts] if max_prompts is not None else prompts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time the work, not the launch
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


@torch.inference_mode()
def logit_gap(target: torch.nn.Module, ids: Sequence[int], device: torch.device) -> float:
    """Top-1 minus top-2 logit of the target's next-token prediction after ``ids`` (one full forward).

    Reported where speculative and greedy output diverge: a gap near 0 means a numerical tie between
    a multi-token verify forward and a one-token decode step, a large gap means a bug.
    """
    logits = target(input_ids=torch.tensor([list(ids)], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def run_benchmark(
    target_path: str | Path,
    drafter_dir: str | Path,
    prompt_files: Sequence[Path],
    out_json: Path,
    *,
    max_new_tokens: int,
    num_draft_steps: int,
    repeats: int = 1,
    warmup: int = 1,
    threads: int | None = None,
    max_prompts: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Decode every benchmark prompt greedily and speculatively; write and return the report.

    ``repeats``: timed runs of each mode per prompt. ``warmup``: untimed rounds (both modes, first
    prompt) before timing, so lazy initialisation and allocator growth are not charged to either mode.
    """
    from aerie.drafter.model import Eagle3Drafter

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    set_threads(threads)
    target, tok, dev = load_target(target_path, device=device, dtype=dtype)
    # The drafter computes in the target's dtype (its folder stores bf16, as SGLang serves it).
    drafter = Eagle3Drafter.from_pretrained(drafter_dir, dtype=next(target.parameters()).dtype).to(dev).eval()
    if drafter.cfg.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"drafter {drafter_dir} was built for a vocab of {drafter.cfg.vocab_size}, "
            f"target {target_path} has {target.config.vocab_size}"
        )
    eos_ids = end_of_turn_ids(tok, target.generation_config)
    prompts = load_bench_prompts(prompt_files, max_prompts)
    if not prompts:
        raise ValueError(f"no benchmark prompts in {list(map(str, prompt_files))}")
    rendered = [render_prompt_ids(tok, p["messages"]) for p in prompts]

    def base(ids: list[int]) -> list[int]:
        return greedy_generate(target, torch.tensor([ids], device=dev), max_new_tokens, eos_ids)

    def spec(ids: list[int]) -> SpecResult:
        ids_t = torch.tensor([ids], device=dev)
        return speculative_generate(target, drafter, ids_t, max_new_tokens, eos_ids, num_draft_steps)

    for _ in range(warmup):
        base(rendered[0])
        spec(rendered[0])

    per_prompt: list[dict[str, Any]] = []
    paired_speedups: list[float] = []
    totals = {"base_tokens": 0, "base_s": 0.0, "spec_tokens": 0, "spec_s": 0.0}
    steps_total = committed_total = 0
    accepted_pos = [0] * num_draft_steps
    drafted_pos = [0] * num_draft_steps
    for i, (prompt, ids) in enumerate(zip(prompts, rendered)):
        base_runs: list[tuple[list[int], float]] = []
        spec_runs: list[tuple[SpecResult, float]] = []
        for r in range(repeats):
            # Alternate the order so neither mode systematically runs on a warmer (or busier) machine.
            if (i + r) % 2 == 0:
                base_runs.append(_timed(lambda: base(ids), dev))
                spec_runs.append(_timed(lambda: spec(ids), dev))
            else:
                spec_runs.append(_timed(lambda: spec(ids), dev))
                base_runs.append(_timed(lambda: base(ids), dev))

        ref = base_runs[0][0]
        sres = spec_runs[0][0]
        mismatch = next(
            (m for m in (first_mismatch(s.tokens, ref) for s, _ in spec_runs) if m is not None), None
        )
        base_stable = all(b == ref for b, _ in base_runs)
        lossless = mismatch is None and base_stable

        b_tok = sum(len(b) for b, _ in base_runs)
        b_s = sum(t for _, t in base_runs)
        s_tok = sum(len(s.tokens) for s, _ in spec_runs)
        s_s = sum(t for _, t in spec_runs)
        totals["base_tokens"] += b_tok
        totals["base_s"] += b_s
        totals["spec_tokens"] += s_tok
        totals["spec_s"] += s_s
        for (b, bt), (s, st) in zip(base_runs, spec_runs):
            pair = _ratio(_ratio(len(s.tokens), st) or 0.0, _ratio(len(b), bt) or 0.0)
            if pair is not None:
                paired_speedups.append(pair)

        # Decoding is deterministic, so acceptance comes from the first speculative run.
        steps_total += sres.verify_steps
        committed_total += sum(sres.committed_per_step)
        for k in range(num_draft_steps):
            accepted_pos[k] += sres.accepted_per_position[k]
            drafted_pos[k] += sres.drafted_per_position[k]

        b_tps, s_tps = _ratio(b_tok, b_s), _ratio(s_tok, s_s)
        entry: dict[str, Any] = {
            "id": prompt["id"],
            "prompt_tokens": len(ids),
            "generated_tokens": len(ref),
            "finish_reason": sres.finish_reason,
            "baseline_s": [round(t, 6) for _, t in base_runs],
            "speculative_s": [round(t, 6) for _, t in spec_runs],
            "baseline_tokens_per_s": b_tps,
            "speculative_tokens_per_s": s_tps,
            "speedup": _ratio(s_tps, b_tps) if s_tps and b_tps else None,
            "verify_steps": sres.verify_steps,
            "acceptance_length": sres.acceptance_length,
            "lossless": lossless,
            "first_mismatch": mismatch,
        }
        if not base_stable:
            entry["baseline_nondeterministic"] = True
        if mismatch is not None:
            # Was it a near-tie (numerics) or a real divergence (a bug)? Look at the target's margin.
            entry["mismatch_logit_gap"] = logit_gap(target, ids + ref[:mismatch], dev)
            log(f"WARNING {prompt['id']}: speculative output diverges from greedy at token {mismatch} "
                f"(target top-2 logit gap there {entry['mismatch_logit_gap']:.3g})")
        per_prompt.append(entry)
        al = sres.acceptance_length
        log(f"[{i + 1}/{len(prompts)}] {prompt['id']}: {len(ref)} tokens, baseline {b_tps or 0:.1f} tok/s, "
            f"speculative {s_tps or 0:.1f} tok/s, acceptance {al if al is not None else float('nan'):.2f}"
            f"{'' if lossless else ', NOT LOSSLESS'}")

    base_tps = _ratio(totals["base_tokens"], totals["base_s"])
    spec_tps = _ratio(totals["spec_tokens"], totals["spec_s"])
    report: dict[str, Any] = {
        "format": BENCH_FORMAT,
        "target": str(target_path),
        "drafter": str(drafter_dir),
        "prompt_files": [str(p) for p in prompt_files],
        "prompts": len(prompts),
        "num_draft_steps": num_draft_steps,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "warmup": warmup,
        "timing": "end-to-end per request (prefill + decode), baseline and speculative interleaved per prompt",
        "baseline": {"tokens_per_s": base_tps, "tokens": totals["base_tokens"], "seconds": totals["base_s"]},
        "speculative": {
            "tokens_per_s": spec_tps,
            "tokens": totals["spec_tokens"],
            "seconds": totals["spec_s"],
            "verify_steps": steps_total,
        },
        "speedup": _ratio(spec_tps, base_tps) if spec_tps and base_tps else None,
        # Robust to a neighbour's load burst hitting one run: the median of per-run paired ratios.
        "speedup_median_paired": statistics.median(paired_speedups) if paired_speedups else None,
        "acceptance_length": _ratio(committed_total, steps_total),
        "acceptance_per_position": [_ratio(a, steps_total) for a in accepted_pos],
        "accepted_per_position": accepted_pos,  # raw counts, for rates conditional on drafting
        "drafted_per_position": drafted_pos,
        "lossless": all(p["lossless"] for p in per_prompt),
        "eos_token_ids": eos_ids,
        "aux_layer_ids": [int(x) for x in drafter.cfg.aux_layer_ids],
        "device": str(dev),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "versions": {
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()
        },
        "per_prompt": per_prompt,
    }
    atomic_write_json(out_json, report)
    log(f"{out_json}: speedup {report['speedup'] or float('nan'):.3f}x "
        f"(median paired {report['speedup_median_paired'] or float('nan'):.3f}x), "
        f"acceptance length {report['acceptance_length'] or float('nan'):.2f}, lossless={report['lossless']}")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True, nargs="+", type=Path, help="aerie.prompts/1 JSONL files")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-prompts", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)
    run_benchmark(
        a.target, a.drafter, a.prompts, a.out,
        max_new_tokens=a.max_new_tokens, num_draft_steps=a.num_draft_steps, repeats=a.repeats,
        warmup=a.warmup, threads=a.threads, max_prompts=a.max_prompts, device=a.device, dtype=a.dtype,
    )


if __name__ == "__main__":
    main()
