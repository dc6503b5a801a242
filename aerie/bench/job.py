"""The bench rule's job: measure with ``bench.backend``, write the report and its plot, then the gate.

``inprocess``: :mod:`aerie.bench.run` (aerie decodes with the target in this process); ``sglang``:
:mod:`aerie.bench.serving` (SGLang serves it, in SGLang's environment). Both write ``aerie.bench/3``
(docs/formats.md); :mod:`aerie.bench.gate` judges either. Torch-free: a backend is imported when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aerie.bench.gate import Gate, apply_gate
from aerie.bench.settings import check_references


def job_references(target: Mapping[str, Any], bench: Mapping[str, Any]) -> tuple[list[str], dict[str, Path]]:
    """(reference names, {name: folder} of the drafter folders) for the job, each folder checked against the target
    now that it is here; a folder still not here stops the job before anything is measured."""
    refs = check_references({"target": target, "bench": bench}, Path.cwd())
    missing = [r for r in refs if r.kind == "drafter" and r.folder is None]
    if missing:
        raise SystemExit("bench.references: " + "; ".join(f"{r.name}: {r.missing}" for r in missing))
    return [r.name for r in refs], {r.name: r.folder for r in refs if r.folder is not None}


def gated_benchmark(
    target: Mapping[str, Any],
    drafter_dir: Path,
    prompt_files: Sequence[Path],
    out_json: Path,
    out_png: Path,
    bench: Mapping[str, Any],
    *,
    sglang: Mapping[str, Any] | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The bench rule's work: measure with ``bench.backend``, write the report and the plot, then the gate."""
    from aerie.bench.plots import plot_benchmark

    references, folders = job_references(target, bench)
    backend = bench.get("backend", "inprocess")
    common = {
        "max_new_tokens": bench["max_new_tokens"],
        "max_prompts": bench.get("max_prompts"),
        "references": references,
        "reference_drafters": folders,
        "chat_template_kwargs": bench.get("chat_template_kwargs") or {},
        "log": log,
    }
    if backend == "sglang":
        from aerie.bench.serving import run_serving_benchmark

        report = run_serving_benchmark(
            target, drafter_dir, list(prompt_files), out_json, sglang=sglang, warmup=bench.get("warmup", 1), **common
        )
    elif backend == "inprocess":
        from aerie.bench.run import run_benchmark

        report = run_benchmark(
            Path(target["path"]),
            drafter_dir,
            list(prompt_files),
            out_json,
            num_draft_steps=bench["num_draft_steps"],
            repeats=bench["repeats"],
            warmup=bench["warmup"],
            threads=bench.get("threads") or threads,
            device=target["device"],
            dtype=target["dtype"],
            trust_remote_code=target.get("trust_remote_code", False),
            **common,
        )
    else:
        raise ValueError(f"bench.backend: {backend!r} is not one of inprocess, sglang")
    plot_benchmark(report, out_png)
    apply_gate(report, Gate(**bench["gate"]), out_json, out_png, log)
    return report
