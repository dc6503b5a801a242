"""Benchmark the run's drafters in-process: greedy vs. speculative decoding of the same prompts, timed interleaved.

Writes ``bench/{run}.json`` (format ``aerie.bench/4``, docs/formats.md). On a shared machine a neighbour's load can
change latency many times over within seconds, so every prompt is decoded by every method back to back, the order
rotated from prompt to prompt, and the report gives ratios from the same run. Times are end to end per request
(prefill + decode), measured with ``time.perf_counter``. Methods (aerie.benchmark.methods): every trained drafter of
the run, each read by its kind (``DrafterKind.torch_side``: ``load_for_bench``, ``proposer``) and drafting at its
kind's width, and each reference (``untrained``: each trained drafter's twin as training starts it; ``ngram``: prompt
lookup at ``num_draft_steps``; a drafter folder of any kind aerie reads, loaded by its kind). One table per
benchmark set (``sets``) and over all of them.
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

from aerie.benchmark.gate import BENCH_FORMAT, simulated_facts
from aerie.benchmark.methods import DRAFTER, NGRAM, TRAINED, UNTRAINED, Method, bench_methods
from aerie.benchmark.prompts import bench_prompt_sets
from aerie.benchmark.settings import BenchRun, TargetLoad
from aerie.benchmark.speculative import (
    NgramProposer,
    SpecResult,
    first_mismatch,
    greedy_generate,
    speculative_generate,
)
from aerie.benchmark.summary import log_summary
from aerie.drafter_kinds import kind_named
from aerie.target_model.model import end_of_turn_ids, load_target, set_threads
from aerie.target_model.template import render_prompt_ids
from aerie.tools.artifacts import atomic_write_json
from aerie.tools.degenerate import degenerate_flags
from aerie.tools.progress import job_progress

REFERENCES = (UNTRAINED, NGRAM)  # built-in references the trained drafters must beat


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


def _summary(obs: Sequence[_Observation], base: Sequence[_Observation]) -> dict[str, Any]:
    """A method's figures over some prompts (a set, or all), against the baseline's over the same prompts."""
    tokens, seconds = sum(o.tokens for o in obs), sum(o.seconds for o in obs)
    verify, committed = sum(o.verify_steps for o in obs), sum(o.committed for o in obs)
    clean = [o for o in obs if not o.degenerate]
    base_tps = _ratio(sum(b.tokens for b in base), sum(b.seconds for b in base))
    tps = _ratio(tokens, seconds)
    paired = [x for o in obs for x in o.paired_speedups]
    steps = max((len(o.accepted_pos) for o in obs), default=0)  # the method's draft width
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


@dataclass
class _Loaded:
    """The run's methods ready to draft: each one's proposer, and each trained drafter's layers."""

    proposers: dict[str, Any]
    layer_ids: dict[str, list[int]]


def load_methods(target, target_path, methods: Mapping[str, Method], device: torch.device) -> _Loaded:
    """Every method's proposer: a drafter folder (trained or reference) through its kind's torch side, an untrained
    twin as its trained drafter's training started (its start folder, else ``untrained_like``), prompt lookup as
    it is."""
    proposers: dict[str, Any] = {}
    drafters: dict[str, tuple[Any, Any]] = {}  # trained drafter -> (its kind's torch side, the loaded drafter)
    for name, m in methods.items():
        if m.role in (TRAINED, DRAFTER):
            side = kind_named(m.kind).torch_side()
            drafter = side.load_for_bench(target, target_path, m.folder, device)
            proposers[name] = side.proposer(drafter, target)
            if m.role == TRAINED:
                drafters[name] = (side, drafter)
        elif m.role == UNTRAINED:
            side, trained = drafters[m.twin_of]
            # a warm start's twin is its start folder; from scratch, the kind's fresh init of the same shape
            if m.folder is not None:
                twin = side.load_for_bench(target, target_path, m.folder, device)
            else:
                twin = side.untrained_like(trained, target)
            proposers[name] = side.proposer(twin, target)
        elif m.role == NGRAM:
            proposers[name] = NgramProposer()  # drafts up to num_draft_steps, as a chain drafter: the same width
        else:
            raise ValueError(f"{name}: a {m.role} reference cannot run in-process (SGLang only)")
    layer_ids = {n: [int(i) for i in side.capture_layer_ids(d)] for n, (side, d) in drafters.items()}
    return _Loaded(proposers, layer_ids)


@dataclass
class _Decoder:
    """Decodes one prompt with one method: the baseline (greedy) or a proposer at its draft width."""

    target: torch.nn.Module
    proposers: dict[str, Any]
    widths: dict[str, int]
    device: torch.device
    max_new_tokens: int
    eos_ids: list[int]

    @property
    def methods(self) -> list[str]:
        return ["baseline", *self.proposers]

    def __call__(self, method: str, ids: list[int]) -> list[int] | SpecResult:
        ids_t = torch.tensor([ids], device=self.device)
        if method == "baseline":
            return greedy_generate(self.target, ids_t, self.max_new_tokens, self.eos_ids)
        return speculative_generate(
            self.target, self.proposers[method], ids_t, self.max_new_tokens, self.eos_ids, self.widths[method]
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


def _observe(runs, ref: list[int], base_stable: bool, flags: list[str]) -> dict[str, _Observation]:
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
            accepted_pos=list(res.accepted_per_position),
            drafted_pos=list(res.drafted_per_position),
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
    obs = _observe(runs, ref, base_stable, flags)
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
    return entry, obs


def _tables(observed: list[tuple[str, dict[str, _Observation]]], methods: Iterable[str]) -> dict:
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
            "methods": {m: _summary([r[m] for r in rows], base) for m in methods},
        }

    set_names = list(dict.fromkeys(s for s, _ in observed))
    return {
        "all": table([o for _, o in observed]),
        "sets": {name: table([o for s, o in observed if s == name]) for name in set_names},
    }


def run_benchmark(
    target: TargetLoad,
    drafters: Mapping[str, str | Path],
    prompt_files: Sequence[Path],
    out_json: Path,
    run: BenchRun,
    *,
    reference_drafters: Mapping[str, str | Path] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Decode every benchmark prompt greedily, with each trained drafter and with each reference; write the report.

    ``drafters``: the run's trained drafters, name -> folder, in the run's order. Per prompt the methods run back to
    back in an order rotated from prompt to prompt, so none of them systematically runs on a warmer (or busier)
    machine. ``run`` says how (aerie.benchmark.settings.BenchRun; one set per prompt file). ``run.references``:
    ``untrained`` (each trained drafter as training starts it), ``ngram`` (prompt lookup) and/or names of
    ``reference_drafters`` (``{name: drafter folder}``).
    """
    folders = {k: Path(v) for k, v in (reference_drafters or {}).items()}
    unknown = sorted(set(run.references) - set(REFERENCES) - set(folders))
    if unknown:
        raise ValueError(f"unknown reference drafters {unknown}; known: {list(REFERENCES)} and drafter folders")
    methods = bench_methods(
        {k: Path(v) for k, v in drafters.items()},
        run.references,
        folders,
        num_draft_steps=run.num_draft_steps,
        ngram_draft_tokens=run.num_draft_steps,
    )
    set_threads(run.threads)
    # Larger than one GPU: spread over the job's GPUs (aerie.target_model.placement); too large for them all: refused.
    model, tok, dev = load_target(
        target.path, device=target.device, dtype=target.dtype, trust_remote_code=target.trust_remote_code, spread=True
    )
    loaded = load_methods(model, target.path, methods, dev)
    sets = bench_prompt_sets(prompt_files, run.max_prompts)
    if not sets:
        raise ValueError(f"no benchmark prompts in {list(map(str, prompt_files))}")
    prompts = [(ps.name, p) for ps in sets for p in ps.prompts]
    kwargs = dict(run.chat_template_kwargs)
    rendered = [render_prompt_ids(tok, p["messages"], p.get("tools"), **kwargs) for _, p in prompts]
    eos_ids = end_of_turn_ids(tok, model.generation_config)
    widths = {n: m.draft_tokens for n, m in methods.items()}
    dec = _Decoder(model, loaded.proposers, widths, dev, run.max_new_tokens, eos_ids)

    for _ in range(run.warmup):
        for m in dec.methods:
            dec(m, rendered[0])
    per_prompt: list[dict[str, Any]] = []
    divergences: list[dict[str, Any]] = []  # outputs that differ from greedy: the gate's lossless check
    observed: list[tuple[str, dict[str, _Observation]]] = []
    bar = job_progress("bench", len(prompts), unit="prompt", log=log)  # prompts done, rate, ETA (aerie.tools.progress)
    for i, ((set_name, prompt), ids) in enumerate(zip(prompts, rendered)):
        runs = dec.timed_runs(ids, i, run.repeats)
        entry, obs = _prompt_entry(set_name, prompt, ids, runs, dec, divergences, log)
        per_prompt.append(entry)
        observed.append((set_name, obs))
        _log_prompt(entry, i, len(prompts), log)
        bar.update(1)
    bar.close()

    report = _report(
        _tables(observed, dec.proposers),
        methods,
        loaded.layer_ids,
        run,
        per_prompt=per_prompt,
        divergences=divergences,
        target_path=target.path,
        target=model,
        device=dev,
        prompt_files=prompt_files,
        eos_ids=eos_ids,
    )
    atomic_write_json(out_json, report)
    return report


def _log_prompt(entry: dict[str, Any], i: int, n: int, log: Callable[[str], None]) -> None:
    methods = entry["methods"]
    lossy = [m for m, v in methods.items() if not v["lossless"]]
    log(
        f"[{i + 1}/{n}] {entry['id']}: {entry['generated_tokens']} tokens, baseline "
        f"{entry['baseline_tokens_per_s'] or 0:.1f} tok/s; "
        + "; ".join(
            f"{m} {v['tokens_per_s'] or 0:.1f} tok/s, acceptance_length {v['acceptance_length'] or float('nan'):.2f}"
            for m, v in methods.items()
        )
        + (f" [degenerate: {', '.join(entry['degenerate'])}]" if entry["degenerate"] else "")
        + (f", NOT LOSSLESS: {', '.join(lossy)}" if lossy else "")
    )


def drafter_facts(
    methods: Mapping[str, Method], summary: Mapping[str, Mapping[str, Any]], layer_ids: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The report's ``drafters``: each trained drafter's kind, folder, width, the target layers it reads, and its
    training eval's simulated acceptance at its width beside the measured one."""
    out = {}
    for name, m in methods.items():
        if m.role != TRAINED:
            continue
        out[name] = {
            "kind": m.kind,
            "folder": str(m.folder),
            "draft_tokens": m.draft_tokens,
            "layer_ids": layer_ids.get(name),
            **simulated_facts(m.folder, m.draft_tokens, summary[name]["acceptance_length"]),
        }
    return out


def _report(
    tables: dict[str, Any], methods: Mapping[str, Method], layer_ids: Mapping[str, list[int]], run: BenchRun, **k: Any
) -> dict[str, Any]:
    """The ``aerie.bench/4`` report (docs/formats.md) of the run's tables."""
    summary = {m: {**methods[m].describe(), **figures} for m, figures in tables["all"]["methods"].items()}
    target, dev = k["target"], k["device"]
    return {
        "format": BENCH_FORMAT,
        "backend": "inprocess",
        "target": str(k["target_path"]),
        "drafters": drafter_facts(methods, summary, layer_ids),
        "prompt_files": [str(p) for p in k["prompt_files"]],
        "prompts": len(k["per_prompt"]),
        "num_draft_steps": run.num_draft_steps,
        "max_new_tokens": run.max_new_tokens,
        "repeats": run.repeats,
        "warmup": run.warmup,
        "chat_template_kwargs": dict(run.chat_template_kwargs),
        "timing": "end-to-end per request (prefill + decode); every method interleaved per prompt, order rotated",
        "baseline": {x: tables["all"]["baseline"][x] for x in ("tokens_per_s", "tokens", "seconds")},
        "lossless": all(s["lossless"] for s in summary.values()),
        "divergences": k["divergences"],
        "failed_requests": {"baseline": 0, **{m: 0 for m in summary}},
        "methods": summary,
        "sets": tables["sets"],
        "degenerate_prompts": [p["id"] for p in k["per_prompt"] if p["degenerate"]],
        "eos_token_ids": k["eos_ids"],
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


def _named_folder(spec: str) -> tuple[str, Path]:
    """``NAME=FOLDER`` or ``FOLDER`` (named by its folder's name)."""
    name, sep, folder = spec.partition("=")
    return (name, Path(folder)) if sep else (Path(spec).name, Path(spec))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument(
        "--drafter", required=True, action="append", metavar="[NAME=]FOLDER", help="a trained drafter (repeatable)"
    )
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
    report = run_benchmark(
        TargetLoad(Path(a.target), a.device, a.dtype),
        dict(map(_named_folder, a.drafter)),
        a.prompts,
        a.out,
        BenchRun(
            max_new_tokens=a.max_new_tokens,
            num_draft_steps=a.num_draft_steps,
            repeats=a.repeats,
            warmup=a.warmup,
            threads=a.threads,
            max_prompts=a.max_prompts,
            references=(*a.references, *a.reference_drafter),
        ),
        reference_drafters={f: Path(f) for f in a.reference_drafter},
    )
    log_summary(report, a.out, print)


if __name__ == "__main__":
    main()
