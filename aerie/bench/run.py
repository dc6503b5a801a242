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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from aerie.artifacts import atomic_write_json
from aerie.bench.degenerate import degenerate_flags
from aerie.bench.gate import BENCH_FORMAT, beats_references, simulated_acceptance
from aerie.bench.prompts import load_bench_prompts
from aerie.bench.speculative import (
    NgramProposer,
    SpecResult,
    first_mismatch,
    greedy_generate,
    speculative_generate,
)
from aerie.progress import job_progress
from aerie.target_model.model import end_of_turn_ids, load_target, set_threads
from aerie.target_model.template import render_prompt_ids

REFERENCES = ("untrained", "ngram")  # drafters the trained one must beat


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


@dataclass
class _MethodTotals:
    """What one decoding method accumulated over all prompts."""

    tokens: int = 0
    seconds: float = 0.0
    verify_steps: int = 0
    committed: int = 0
    accepted_pos: list[int] = field(default_factory=list)
    drafted_pos: list[int] = field(default_factory=list)
    lossless: bool = True
    paired_speedups: list[float] = field(default_factory=list)
    # the same, without prompts whose greedy output is degenerate (loops inflate acceptance)
    clean_steps: int = 0
    clean_committed: int = 0


def _untrained_drafter(target: torch.nn.Module, trained, seed: int = 0):
    """The drafter exactly as training starts it (same config, vocab maps and init): the floor."""
    from aerie.drafter.model import Eagle3Drafter

    torch.manual_seed(seed)
    fresh = Eagle3Drafter.from_target(target, trained.cfg, trained.d2t, trained.t2d, init_head_from_target=True)
    return fresh.to(device=next(trained.parameters()).device, dtype=next(trained.parameters()).dtype).eval()


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
    references: Sequence[str] = REFERENCES,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Decode every benchmark prompt greedily, with the drafter and with each reference; write the report.

    Per prompt the methods run back to back in an order rotated from prompt to prompt, so none of them
    systematically runs on a warmer (or busier) machine. ``repeats``: timed runs of each method per
    prompt. ``warmup``: untimed rounds (every method, first prompt) before timing.
    ``references``: ``untrained`` (the drafter as training starts it) and/or ``ngram`` (prompt lookup).
    """
    from aerie.drafter.model import Eagle3Drafter

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    unknown = sorted(set(references) - set(REFERENCES))
    if unknown:
        raise ValueError(f"unknown reference drafters {unknown}; known: {list(REFERENCES)}")
    set_threads(threads)
    # Larger than one GPU: spread over the job's GPUs (aerie.target_model.placement); too large for them all: refused.
    target, tok, dev = load_target(
        target_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code, spread=True
    )
    # The drafter computes in the target's dtype (its folder stores bf16, as SGLang serves it). Its export
    # has no embeddings: like SGLang's EAGLE worker, it takes the target's.
    drafter = Eagle3Drafter.from_pretrained(drafter_dir, dtype=next(target.parameters()).dtype)
    if drafter.cfg.vocab_size != target.config.get_text_config().vocab_size:
        raise ValueError(
            f"drafter {drafter_dir} was built for a vocab of {drafter.cfg.vocab_size}, "
            f"target {target_path} has {target.config.get_text_config().vocab_size}"
        )
    drafter.load_target_embeddings(target.get_input_embeddings().weight)
    drafter = drafter.to(dev).eval()
    eos_ids = end_of_turn_ids(tok, target.generation_config)
    prompts = load_bench_prompts(prompt_files, max_prompts)
    if not prompts:
        raise ValueError(f"no benchmark prompts in {list(map(str, prompt_files))}")
    rendered = [render_prompt_ids(tok, p["messages"]) for p in prompts]

    proposers: dict[str, Any] = {"eagle3": drafter}
    if "untrained" in references:
        proposers["untrained"] = _untrained_drafter(target, drafter)
    if "ngram" in references:
        proposers["ngram"] = NgramProposer()
    methods = ["baseline", *proposers]

    def decode(method: str, ids: list[int]) -> list[int] | SpecResult:
        ids_t = torch.tensor([ids], device=dev)
        if method == "baseline":
            return greedy_generate(target, ids_t, max_new_tokens, eos_ids)
        return speculative_generate(target, proposers[method], ids_t, max_new_tokens, eos_ids, num_draft_steps)

    for _ in range(warmup):
        for m in methods:
            decode(m, rendered[0])

    totals = {m: _MethodTotals(accepted_pos=[0] * num_draft_steps, drafted_pos=[0] * num_draft_steps) for m in methods}
    per_prompt: list[dict[str, Any]] = []
    degenerate_ids: list[str] = []
    divergences: list[dict[str, Any]] = []  # outputs that differ from greedy: the gate's lossless check
    bar = job_progress("bench", len(prompts), unit="prompt", log=log)  # prompts done, rate, ETA (aerie.progress)
    for i, (prompt, ids) in enumerate(zip(prompts, rendered)):
        runs: dict[str, list[tuple[Any, float]]] = {m: [] for m in methods}
        for r in range(repeats):
            shift = (i + r) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                runs[m].append(_timed(lambda m=m, ids=ids: decode(m, ids), dev))

        ref = runs["baseline"][0][0]
        base_stable = all(b == ref for b, _ in runs["baseline"])
        flags = degenerate_flags(ref)
        if flags:
            degenerate_ids.append(prompt["id"])
        b_tok = sum(len(b) for b, _ in runs["baseline"])
        b_s = sum(t for _, t in runs["baseline"])
        totals["baseline"].tokens += b_tok
        totals["baseline"].seconds += b_s
        totals["baseline"].lossless &= base_stable
        b_tps = _ratio(b_tok, b_s)
        entry: dict[str, Any] = {
            "id": prompt["id"],
            "prompt_tokens": len(ids),
            "generated_tokens": len(ref),
            "degenerate": flags,
            "baseline_s": [round(t, 6) for _, t in runs["baseline"]],
            "baseline_tokens_per_s": b_tps,
            "methods": {},
        }
        if not base_stable:
            entry["baseline_nondeterministic"] = True
            first = next(first_mismatch(b, ref) for b, _ in runs["baseline"] if b != ref)
            divergences.append(
                {"method": "baseline", "id": prompt["id"], "concurrency": None, "first_diff": first, "logit_gap": None}
            )
        for m in proposers:
            res: SpecResult = runs[m][0][0]  # decoding is deterministic: acceptance from the first run
            mismatch = next((x for x in (first_mismatch(s.tokens, ref) for s, _ in runs[m]) if x is not None), None)
            tot = totals[m]
            s_tok = sum(len(s.tokens) for s, _ in runs[m])
            s_s = sum(t for _, t in runs[m])
            tot.tokens += s_tok
            tot.seconds += s_s
            tot.verify_steps += res.verify_steps
            tot.committed += sum(res.committed_per_step)
            if not flags:
                tot.clean_steps += res.verify_steps
                tot.clean_committed += sum(res.committed_per_step)
            for k in range(num_draft_steps):
                tot.accepted_pos[k] += res.accepted_per_position[k]
                tot.drafted_pos[k] += res.drafted_per_position[k]
            tot.lossless &= mismatch is None and base_stable
            for (b, bt), (s, st) in zip(runs["baseline"], runs[m]):
                pair = _ratio(_ratio(len(s.tokens), st) or 0.0, _ratio(len(b), bt) or 0.0)
                if pair is not None:
                    tot.paired_speedups.append(pair)
            s_tps = _ratio(s_tok, s_s)
            info: dict[str, Any] = {
                "seconds": [round(t, 6) for _, t in runs[m]],
                "tokens_per_s": s_tps,
                "speedup": _ratio(s_tps, b_tps) if s_tps and b_tps else None,
                "verify_steps": res.verify_steps,
                "acceptance_length": res.acceptance_length,
                "finish_reason": res.finish_reason,
                "lossless": mismatch is None and base_stable,
                "first_mismatch": mismatch,
            }
            if mismatch is not None:
                # Was it a near-tie (numerics) or a real divergence (a bug)? Look at the target's margin.
                info["mismatch_logit_gap"] = logit_gap(target, ids + ref[:mismatch], dev)
                divergences.append(
                    {
                        "method": m,
                        "id": prompt["id"],
                        "concurrency": None,
                        "first_diff": mismatch,
                        "logit_gap": info["mismatch_logit_gap"],
                    }
                )
                log(
                    f"WARNING {prompt['id']} ({m}): output diverges from greedy at token {mismatch} "
                    f"(target top-2 logit gap there {info['mismatch_logit_gap']:.3g})"
                )
            entry["methods"][m] = info
        # The trained drafter's numbers also at the top of the entry (format 1 readers).
        eagle = entry["methods"]["eagle3"]
        entry.update(
            speculative_s=eagle["seconds"],
            speculative_tokens_per_s=eagle["tokens_per_s"],
            speedup=eagle["speedup"],
            verify_steps=eagle["verify_steps"],
            acceptance_length=eagle["acceptance_length"],
            finish_reason=eagle["finish_reason"],
            lossless=eagle["lossless"],
            first_mismatch=eagle["first_mismatch"],
            **({"mismatch_logit_gap": eagle["mismatch_logit_gap"]} if "mismatch_logit_gap" in eagle else {}),
        )
        per_prompt.append(entry)
        log(
            f"[{i + 1}/{len(prompts)}] {prompt['id']}: {len(ref)} tokens, baseline {b_tps or 0:.1f} tok/s; "
            + "; ".join(
                f"{m} {entry['methods'][m]['tokens_per_s'] or 0:.1f} tok/s, acceptance "
                f"{entry['methods'][m]['acceptance_length'] or float('nan'):.2f}"
                for m in proposers
            )
            + (f" [degenerate: {', '.join(flags)}]" if flags else "")
            + ("" if entry["lossless"] else ", NOT LOSSLESS")
        )
        bar.update(1)
    bar.close()

    base = totals["baseline"]
    base_tps = _ratio(base.tokens, base.seconds)
    summary: dict[str, dict[str, Any]] = {}
    for m in proposers:
        tot = totals[m]
        tps = _ratio(tot.tokens, tot.seconds)
        summary[m] = {
            "tokens_per_s": tps,
            "tokens": tot.tokens,
            "seconds": tot.seconds,
            "verify_steps": tot.verify_steps,
            "speedup": _ratio(tps, base_tps) if tps and base_tps else None,
            # Robust to a neighbour's load burst hitting one run: the median of per-run paired ratios.
            "speedup_median_paired": statistics.median(tot.paired_speedups) if tot.paired_speedups else None,
            "acceptance_length": _ratio(tot.committed, tot.verify_steps),
            "acceptance_length_excluding_degenerate": _ratio(tot.clean_committed, tot.clean_steps),
            "acceptance_per_position": [_ratio(a, tot.verify_steps) for a in tot.accepted_pos],
            "accepted_per_position": tot.accepted_pos,  # raw counts, for rates conditional on drafting
            "drafted_per_position": tot.drafted_pos,
            "lossless": tot.lossless,
        }
    eagle = summary["eagle3"]
    simulated = simulated_acceptance(Path(drafter_dir), num_draft_steps)
    measured = eagle["acceptance_length"]
    refs = {m: summary[m]["acceptance_length"] or 0.0 for m in proposers if m != "eagle3"}
    report: dict[str, Any] = {
        "format": BENCH_FORMAT,
        "backend": "inprocess",
        "target": str(target_path),
        "drafter": str(drafter_dir),
        "prompt_files": [str(p) for p in prompt_files],
        "prompts": len(prompts),
        "num_draft_steps": num_draft_steps,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "warmup": warmup,
        "timing": "end-to-end per request (prefill + decode); every method interleaved per prompt, order rotated",
        "baseline": {"tokens_per_s": base_tps, "tokens": base.tokens, "seconds": base.seconds},
        "speculative": {k: eagle[k] for k in ("tokens_per_s", "tokens", "seconds", "verify_steps")},
        "speedup": eagle["speedup"],
        "speedup_median_paired": eagle["speedup_median_paired"],
        "acceptance_length": measured,
        "acceptance_length_excluding_degenerate": eagle["acceptance_length_excluding_degenerate"],
        "acceptance_per_position": eagle["acceptance_per_position"],
        "accepted_per_position": eagle["accepted_per_position"],
        "drafted_per_position": eagle["drafted_per_position"],
        "lossless": all(summary[m]["lossless"] for m in proposers),
        "divergences": divergences,
        "methods": summary,
        "beats_references": beats_references(measured, refs),
        "simulated_acceptance_length": simulated,
        "simulated_vs_measured": (abs(simulated - measured) / measured) if simulated and measured else None,
        "degenerate_prompts": degenerate_ids,
        "eos_token_ids": eos_ids,
        "aux_layer_ids": [int(x) for x in drafter.cfg.aux_layer_ids],
        "device": str(dev),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "per_prompt": per_prompt,
    }
    atomic_write_json(out_json, report)
    for m in proposers:
        sm = summary[m]
        log(
            f"{m}: speedup {sm['speedup'] or float('nan'):.3f}x (median paired "
            f"{sm['speedup_median_paired'] or float('nan'):.3f}x), acceptance length "
            f"{sm['acceptance_length'] or float('nan'):.2f}, lossless={sm['lossless']}"
        )
    log(
        f"{out_json}: baseline {base_tps or 0:.1f} tok/s; simulated acceptance {simulated or float('nan'):.2f} vs "
        f"measured {measured or float('nan'):.2f}; degenerate prompts {len(degenerate_ids)}/{len(prompts)}"
    )
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
    ap.add_argument("--references", nargs="*", default=list(REFERENCES), choices=list(REFERENCES))
    a = ap.parse_args(argv)
    run_benchmark(
        a.target,
        a.drafter,
        a.prompts,
        a.out,
        max_new_tokens=a.max_new_tokens,
        num_draft_steps=a.num_draft_steps,
        repeats=a.repeats,
        warmup=a.warmup,
        threads=a.threads,
        max_prompts=a.max_prompts,
        device=a.device,
        dtype=a.dtype,
        references=a.references,
    )


if __name__ == "__main__":
    main()
