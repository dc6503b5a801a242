"""The bench rule's job: measure with ``bench.backend``, write the report and its plot, then the gate.

``inprocess``: :mod:`aerie.bench.run` (aerie decodes with the target in this process); ``sglang``:
:mod:`aerie.bench.serving` (SGLang serves it, in SGLang's environment). Both write ``aerie.bench/2``
(docs/formats.md); :mod:`aerie.bench.gate` judges either. Torch-free: a backend is imported when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aerie.bench.gate import Gate, apply_gate
from aerie.bench.settings import bench_references


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

    references = bench_references(bench)
    backend = bench.get("backend", "inprocess")
    if backend == "sglang":
        from aerie.bench.serving import run_serving_benchmark

        report = run_serving_benchmark(
            target,
            drafter_dir,
            list(prompt_files),
            out_json,
            sglang=sglang,
            max_new_tokens=bench["max_new_tokens"],
            max_prompts=bench.get("max_prompts"),
            warmup=bench.get("warmup", 1),
            references=references,
            log=log,
        )
    elif backend == "inprocess":
        from aerie.bench.run import run_benchmark

        report = run_benchmark(
            Path(target["path"]),
            drafter_dir,
            list(prompt_files),
            out_json,
            max_new_tokens=bench["max_new_tokens"],
            num_draft_steps=bench["num_draft_steps"],
            repeats=bench["repeats"],
            warmup=bench["warmup"],
            threads=bench.get("threads") or threads,
            max_prompts=bench.get("max_prompts"),
            device=target["device"],
            dtype=target["dtype"],
            references=references,
            trust_remote_code=target.get("trust_remote_code", False),
            log=log,
        )
    else:
        raise ValueError(f"bench.backend: {backend!r} is not one of inprocess, sglang")
    plot_benchmark(report, out_png)
    apply_gate(report, Gate(**bench["gate"]), out_json, out_png, log)
    return report
