"""Benchmark a drafter in-process: greedy vs. speculative decoding of the same prompts, timed interleaved.

Writes ``bench/{run}.json`` (format ``aerie.bench/3``, docs/formats.md). On a shared machine a neighbour's load can
change latency many times over within seconds, so every prompt is decoded by every method back to back, the order
rotated from prompt to prompt, and the report gives ratios from the same run. Times are end to end per request
(prefill + decode), measured with ``time.perf_counter``. Methods: the trained drafter (``eagle3``) and each reference
(``untrained``: the drafter as training starts it; ``ngram``: prompt lookup at the same width; a drafter folder:
loaded with the same reader as the trained one). One table per benchmark set (``sets``) and over all of them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from aerie.artifacts import atomic_write_json
from aerie.bench.degenerate import degenerate_flags
from aerie.bench.gate import BENCH_FORMAT, beats_references, simulated_acceptance
from aerie.bench.prompts import bench_prompt_sets
from aerie.bench.settings import method_kinds
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

REFERENCES = ("untrained", "ngram")  # built-in references the trained drafter must beat


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


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


@dataclass
class _Observation:
    """What one method did on one prompt (every repeat)."""

    tokens: int = 0
    seconds: float = 0.0
    verify_steps: int = 0
    committed: int = 0  # tokens committed by verify steps (the prefill token not counted)
    generated: int = 0  # tokens of the first run (committed + the prefill token)
    accepted_pos: list[int] = field(default_factory=list)
    drafted_pos: list[int] = field(default_factory=list)
    lossless: bool = True
    paired_speedups: list[float] = field(default_factory=list)
    degenerate: bool = False


def _summary(obs: Sequence[_Observation], base: Sequence[_Observation], steps: int) -> dict[str, Any]:
    """A method's figures over some prompts (a set, or all), against the baseline's over the same prompts."""
    tokens, seconds = sum(o.tokens for o in obs), sum(o.seconds for o in obs)
    verify, committed = sum(o.verify_steps for o in obs), sum(o.committed for o in obs)
    clean = [o for o in obs if not o.degenerate]
    base_tps = _ratio(sum(b.tokens for b in base), sum(b.seconds for b in base))
    tps = _ratio(tokens, seconds)
    paired = [x for o in obs for x in o.paired_speedups]
    accepted = [sum(o.accepted_pos[k] for o in obs) for k in range(steps)]
    return {
        "tokens_per_s": tps,
        "tokens": tokens,
        "seconds": seconds,
        "verify_steps": verify,
        "speedup": _ratio(tps, base_tps) if tps else None,
        # Robust to a neighbour's load burst hitting one run: the median of per-run paired ratios.
        "speedup_median_paired": statistics.median(paired) if paired else None,
        "acceptance_length": _ratio(committed, verify),
        "spec_accept_length": _ratio(sum(o.generated for o in obs if o.verify_steps), verify),
        "acceptance_length_excluding_degenerate": _ratio(
            sum(o.committed for o in clean), sum(o.verify_steps for o in clean)
        ),
        "acceptance_per_position": [_ratio(a, verify) for a in accepted],
        "accepted_per_position": accepted,  # raw counts, for rates conditional on drafting
        "drafted_per_position": [sum(o.drafted_pos[k] for o in obs) for k in range(steps)],
        "lossless": all(o.lossless for o in obs),
        "failed_requests": 0,  # in-process decoding either answers or fails the job
    }


def _untrained_drafter(target: torch.nn.Module, trained, seed: int = 0):
    """The drafter exactly as training starts it (same config, vocab maps and init): the floor."""
    from aerie.drafter.model import Eagle3Drafter

    torch.manual_seed(seed)
    fresh = Eagle3Drafter.from_target(target, trained.cfg, trained.d2t, trained.t2d, init_head_from_target=True)
    return fresh.to(device=next(trained.parameters()).device, dtype=next(trained.parameters()).dtype).eval()


def load_drafter_for(target: torch.nn.Module, target_path: str | Path, folder: str | Path, device: torch.device):
    """A drafter folder (written by any tool in SGLang's layout) ready to draft for ``target``: fed the layers SGLang
    would feed it on that target, in the target's dtype (the folder stores bf16, as SGLang serves it), with the
    target's embeddings (an export has none: like SGLang's EAGLE worker, it takes the target's)."""
    from aerie.drafter.model import Eagle3Drafter

    drafter = Eagle3Drafter.from_pretrained(folder, dtype=next(target.parameters()).dtype, target=target_path)
    vocab = target.config.get_text_config().vocab_size
    if drafter.cfg.vocab_size != vocab:
        raise ValueError(f"drafter {folder} was built for a vocab of {drafter.cfg.vocab_size}, the target has {vocab}")
    drafter.load_target_embeddings(target.get_input_embeddings().weight)
    return drafter.to(device).eval()


def _proposers(target, target_path, drafter, device, references: Sequence[str], folders: Mapping[str, Path]) -> dict:
    """Every speculative method of the run: the trained drafter first, then each reference in config order."""
    proposers: dict[str, Any] = {"eagle3": drafter}
    for name in references:
        if name == "untrained":
            proposers[name] = _untrained_drafter(target, drafter)
        elif name == "ngram":
            proposers[name] = NgramProposer()  # drafts up to num_draft_steps, as the drafter: the same width
        else:
            proposers[name] = load_drafter_for(target, target_path, folders[name], device)
    return proposers


@dataclass
class _Decoder:
    """Decodes one prompt with one method: the baseline (greedy) or a proposer."""

    target: torch.nn.Module
    proposers: dict[str, Any]
    device: torch.device
    max_new_tokens: int
    eos_ids: list[int]
    num_draft_steps: int

    @property
    def methods(self) -> list[str]:
        return ["baseline", *self.proposers]

    def __call__(self, method: str, ids: list[int]) -> list[int] | SpecResult:
        ids_t = torch.tensor([ids], device=self.device)
        if method == "baseline":
            return greedy_generate(self.target, ids_t, self.max_new_tokens, self.eos_ids)
        return speculative_generate(
            self.target, self.proposers[method], ids_t, self.max_new_tokens, self.eos_ids, self.num_draft_steps
        )

    def timed_runs(self, ids: list[int], index: int, repeats: int) -> dict[str, list[tuple[Any, float]]]:
        """Every method ``repeats`` times, back to back, in an order rotated with the prompt's index."""
        methods = self.methods
        runs: dict[str, list[tuple[Any, float]]] = {m: [] for m in methods}
        for r in range(repeats):
            shift = (index + r) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                runs[m].append(_timed(lambda m=m: self(m, ids), self.device))
        return runs


def _observe(runs, ref: list[int], base_stable: bool, flags: list[str], steps: int) -> dict[str, _Observation]:
    """Each method's observation of one prompt from its timed runs."""
    obs = {
        "baseline": _Observation(
            tokens=sum(len(b) for b, _ in runs["baseline"]),
            seconds=sum(t for _, t in runs["baseline"]),
            lossless=base_stable,
            degenerate=bool(flags),
        )
    }
    for m, spec_runs in runs.items():
        if m == "baseline":
            continue
        res: SpecResult = spec_runs[0][0]  # decoding is deterministic: acceptance from the first run
        mismatch = next((x for x in (first_mismatch(s.tokens, ref) for s, _ in spec_runs) if x is not None), None)
        paired = [
            _ratio(_ratio(len(s.tokens), st) or 0.0, _ratio(len(b), bt) or 0.0)
            for (b, bt), (s, st) in zip(runs["baseline"], spec_runs)
        ]
        obs[m] = _Observation(
            tokens=sum(len(s.tokens) for s, _ in spec_runs),
            seconds=sum(t for _, t in spec_runs),
            verify_steps=res.verify_steps,
            committed=sum(res.committed_per_step),
            generated=len(res.tokens),
            accepted_pos=list(res.accepted_per_position[:steps]),
            drafted_pos=list(res.drafted_per_position[:steps]),
            lossless=mismatch is None and base_stable,
            paired_speedups=[p for p in paired if p is not None],
            degenerate=bool(flags),
        )
    return obs


def _prompt_entry(
    set_name: str,
    prompt: dict[str, Any],
    ids: list[int],
    runs,
    dec: _Decoder,
    divergences: list[dict[str, Any]],
    log: Callable[[str], None],
) -> tuple[dict[str, Any], dict[str, _Observation]]:
    """One prompt measured: its ``per_prompt`` entry and every method's observation; divergences appended."""
    ref = runs["baseline"][0][0]
    base_stable = all(b == ref for b, _ in runs["baseline"])
    flags = degenerate_flags(ref)
    obs = _observe(runs, ref, base_stable, flags, dec.num_draft_steps)
    b_tps = _ratio(obs["baseline"].tokens, obs["baseline"].seconds)
    entry: dict[str, Any] = {
        "id": prompt["id"],
        "set": set_name,
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
    for m in dec.proposers:
        res: SpecResult = runs[m][0][0]
        mismatch = next((x for x in (first_mismatch(s.tokens, ref) for s, _ in runs[m]) if x is not None), None)
        s_tps = _ratio(obs[m].tokens, obs[m].seconds)
        info: dict[str, Any] = {
            "seconds": [round(t, 6) for _, t in runs[m]],
            "tokens_per_s": s_tps,
            "speedup": _ratio(s_tps, b_tps) if s_tps else None,
            "verify_steps": res.verify_steps,
            "acceptance_length": res.acceptance_length,
            "finish_reason": res.finish_reason,
            "lossless": obs[m].lossless,
            "first_mismatch": mismatch,
        }
        if mismatch is not None:
            # Was it a near-tie (numerics) or a real divergence (a bug)? Look at the target's margin.
            info["mismatch_logit_gap"] = logit_gap(dec.target, ids + ref[:mismatch], dec.device)
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
    return entry, obs


def _tables(observed: list[tuple[str, dict[str, _Observation]]], methods: Iterable[str], steps: int) -> dict:
    """``{"all": {method: summary}, "sets": {set: {prompts, baseline, methods}}}`` from every prompt's observations."""

    def table(rows: list[dict[str, _Observation]]) -> dict[str, Any]:
        base = [r["baseline"] for r in rows]
        return {
            "prompts": len(rows),
            "baseline": {
                "tokens_per_s": _ratio(sum(b.tokens for b in base), sum(b.seconds for b in base)),
                "tokens": sum(b.tokens for b in base),
                "seconds": sum(b.seconds for b in base),
                "failed_requests": 0,
            },
            "methods": {m: _summary([r[m] for r in rows], base, steps) for m in methods},
        }

    set_names = list(dict.fromkeys(s for s, _ in observed))
    return {
        "all": table([o for _, o in observed]),
        "sets": {name: table([o for s, o in observed if s == name]) for name in set_names},
    }


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
    reference_drafters: Mapping[str, str | Path] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Decode every benchmark prompt greedily, with the drafter and with each reference; write the report.

    Per prompt the methods run back to back in an order rotated from prompt to prompt, so none of them
    systematically runs on a warmer (or busier) machine. ``repeats``: timed runs of each method per
    prompt. ``warmup``: untimed rounds (every method, first prompt) before timing. ``max_prompts``: the first N
    prompts of each set (one set per prompt file). ``references``: ``untrained`` (the drafter as training starts
    it), ``ngram`` (prompt lookup) and/or names of ``reference_drafters`` (``{name: drafter folder}``).
    """
    folders = {k: Path(v) for k, v in (reference_drafters or {}).items()}
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    unknown = sorted(set(references) - set(REFERENCES) - set(folders))
    if unknown:
        raise ValueError(f"unknown reference drafters {unknown}; known: {list(REFERENCES)} and drafter folders")
    set_threads(threads)
    # Larger than one GPU: spread over the job's GPUs (aerie.target_model.placement); too large for them all: refused.
    target, tok, dev = load_target(
        target_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code, spread=True
    )
    drafter = load_drafter_for(target, target_path, drafter_dir, dev)
    sets = bench_prompt_sets(prompt_files, max_prompts)
    if not sets:
        raise ValueError(f"no benchmark prompts in {list(map(str, prompt_files))}")
    prompts = [(ps.name, p) for ps in sets for p in ps.prompts]
    kwargs = dict(chat_template_kwargs or {})
    rendered = [render_prompt_ids(tok, p["messages"], p.get("tools"), **kwargs) for _, p in prompts]
    eos_ids = end_of_turn_ids(tok, target.generation_config)
    dec = _Decoder(
        target,
        _proposers(target, target_path, drafter, dev, references, folders),
        dev,
        max_new_tokens,
        eos_ids,
        num_draft_steps,
    )

    for _ in range(warmup):
        for m in dec.methods:
            dec(m, rendered[0])
    per_prompt: list[dict[str, Any]] = []
    divergences: list[dict[str, Any]] = []  # outputs that differ from greedy: the gate's lossless check
    observed: list[tuple[str, dict[str, _Observation]]] = []
    bar = job_progress("bench", len(prompts), unit="prompt", log=log)  # prompts done, rate, ETA (aerie.progress)
    for i, ((set_name, prompt), ids) in enumerate(zip(prompts, rendered)):
        runs = dec.timed_runs(ids, i, repeats)
        entry, obs = _prompt_entry(set_name, prompt, ids, runs, dec, divergences, log)
        per_prompt.append(entry)
        observed.append((set_name, obs))
        _log_prompt(entry, i, len(prompts), list(dec.proposers), log)
        bar.update(1)
    bar.close()

    tables = _tables(observed, dec.proposers, num_draft_steps)
    report = _report(
        tables,
        per_prompt=per_prompt,
        divergences=divergences,
        target_path=target_path,
        drafter_dir=drafter_dir,
        drafter=drafter,
        target=target,
        device=dev,
        prompt_files=prompt_files,
        num_draft_steps=num_draft_steps,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        warmup=warmup,
        eos_ids=eos_ids,
        references=references,
        folders=folders,
        chat_template_kwargs=kwargs,
    )
    atomic_write_json(out_json, report)
    _log_summary(report, out_json, log)
    return report


def _log_prompt(entry: dict[str, Any], i: int, n: int, methods: list[str], log: Callable[[str], None]) -> None:
    log(
        f"[{i + 1}/{n}] {entry['id']}: {entry['generated_tokens']} tokens, baseline "
        f"{entry['baseline_tokens_per_s'] or 0:.1f} tok/s; "
        + "; ".join(
            f"{m} {entry['methods'][m]['tokens_per_s'] or 0:.1f} tok/s, acceptance_length "
            f"{entry['methods'][m]['acceptance_length'] or float('nan'):.2f}"
            for m in methods
        )
        + (f" [degenerate: {', '.join(entry['degenerate'])}]" if entry["degenerate"] else "")
        + ("" if entry["lossless"] else ", NOT LOSSLESS")
    )


def _report(tables: dict[str, Any], **k: Any) -> dict[str, Any]:
    """The ``aerie.bench/3`` report (docs/formats.md) of the run's tables."""
    summary = tables["all"]["methods"]
    for m, info in method_kinds(k["references"], k["folders"]).items():
        summary[m].update(info)
    eagle = summary["eagle3"]
    steps = k["num_draft_steps"]
    simulated = simulated_acceptance(Path(k["drafter_dir"]), steps)
    measured = eagle["acceptance_length"]
    refs = {m: summary[m]["acceptance_length"] or 0.0 for m in summary if m != "eagle3"}
    target, dev = k["target"], k["device"]
    return {
        "format": BENCH_FORMAT,
        "backend": "inprocess",
        "target": str(k["target_path"]),
        "drafter": str(k["drafter_dir"]),
        "prompt_files": [str(p) for p in k["prompt_files"]],
        "prompts": len(k["per_prompt"]),
        "num_draft_steps": steps,
        "max_new_tokens": k["max_new_tokens"],
        "repeats": k["repeats"],
        "warmup": k["warmup"],
        "chat_template_kwargs": k["chat_template_kwargs"],
        "timing": "end-to-end per request (prefill + decode); every method interleaved per prompt, order rotated",
        "baseline": {x: tables["all"]["baseline"][x] for x in ("tokens_per_s", "tokens", "seconds")},
        "speculative": {x: eagle[x] for x in ("tokens_per_s", "tokens", "seconds", "verify_steps")},
        "speedup": eagle["speedup"],
        "speedup_median_paired": eagle["speedup_median_paired"],
        "acceptance_length": measured,
        "spec_accept_length": eagle["spec_accept_length"],
        "acceptance_length_excluding_degenerate": eagle["acceptance_length_excluding_degenerate"],
        "acceptance_per_position": eagle["acceptance_per_position"],
        "accepted_per_position": eagle["accepted_per_position"],
        "drafted_per_position": eagle["drafted_per_position"],
        "lossless": all(s["lossless"] for s in summary.values()),
        "divergences": k["divergences"],
        "failed_requests": {"baseline": 0, **{m: 0 for m in summary}},
        "methods": summary,
        "sets": tables["sets"],
        "beats_references": beats_references(measured, refs),
        "simulated_acceptance_length": simulated,
        "simulated_vs_measured": (abs(simulated - measured) / measured) if simulated and measured else None,
        "degenerate_prompts": [p["id"] for p in k["per_prompt"] if p["degenerate"]],
        "eos_token_ids": k["eos_ids"],
        "aux_layer_ids": [int(x) for x in k["drafter"].cfg.aux_layer_ids],
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
        "per_prompt": k["per_prompt"],
    }


def _log_summary(report: dict[str, Any], out_json: Path, log: Callable[[str], None]) -> None:
    for m, sm in report["methods"].items():
        log(
            f"{m}: speedup {sm['speedup'] or float('nan'):.3f}x (median paired "
            f"{sm['speedup_median_paired'] or float('nan'):.3f}x), acceptance_length "
            f"{sm['acceptance_length'] or float('nan'):.2f} (aerie's), spec_accept_length "
            f"{sm['spec_accept_length'] or float('nan'):.2f} (SGLang's), lossless={sm['lossless']}"
        )
    simulated, measured = report["simulated_acceptance_length"], report["acceptance_length"]
    log(
        f"{out_json}: baseline {report['baseline']['tokens_per_s'] or 0:.1f} tok/s; simulated acceptance "
        f"{simulated or float('nan'):.2f} vs measured {measured or float('nan'):.2f}; degenerate prompts "
        f"{len(report['degenerate_prompts'])}/{report['prompts']}"
    )


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
    ap.add_argument("--max-prompts", type=int, default=None, help="the first N prompts of each file")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--references", nargs="*", default=list(REFERENCES), choices=list(REFERENCES))
    ap.add_argument(
        "--reference-drafter", action="append", default=[], metavar="FOLDER", help="a reference drafter folder"
    )
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
        references=[*a.references, *a.reference_drafter],
        reference_drafters={f: Path(f) for f in a.reference_drafter},
    )


if __name__ == "__main__":
    main()
