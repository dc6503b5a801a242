"""The bench rule's job: measure every trained drafter of the run with ``bench.backend``, write the report and its
plot, then the gate.

``inprocess``: :mod:`aerie.benchmark.run` (aerie decodes with the target in this process); ``sglang``:
:mod:`aerie.benchmark.serving` (SGLang serves it, in SGLang's environment). Both write ``aerie.bench/4``
(docs/formats.md); :mod:`aerie.benchmark.gate` judges either, each trained drafter on its own. The in-process
decoder is imported only when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aerie.benchmark.gate import apply_gate
from aerie.benchmark.plots import plot_benchmark
from aerie.benchmark.serving import run_serving_benchmark
from aerie.benchmark.settings import BenchSettings, TargetLoad, check_references
from aerie.benchmark.summary import log_summary
from aerie.formats.backends import backend_named


def job_references(target: Mapping[str, Any], bench: BenchSettings) -> tuple[list[str], dict[str, Path]]:
    """(reference names, {name: folder} of the drafter folders) for the job, each folder checked against the target
    now that it is here; a folder still not here stops the job before anything is measured."""
    refs = check_references({"target": target, "bench": bench.as_config()}, Path.cwd())
    missing = [r for r in refs if r.role == "drafter" and r.folder is None]
    if missing:
        raise SystemExit("bench.references: " + "; ".join(f"{r.name}: {r.missing}" for r in missing))
    return [r.name for r in refs], {r.name: r.folder for r in refs if r.folder is not None}


def _served(target, drafters, prompt_files, out_json, run, *, sglang, references, log) -> dict[str, Any]:
    return run_serving_benchmark(
        target, drafters, prompt_files, out_json, run, sglang=sglang, reference_drafters=references, log=log
    )


def _in_process(target, drafters, prompt_files, out_json, run, *, sglang, references, log) -> dict[str, Any]:
    from aerie.benchmark.run import run_benchmark  # the decoder and its torch: only when it runs

    return run_benchmark(
        TargetLoad.of(target), drafters, prompt_files, out_json, run, reference_drafters=references, log=log
    )


# bench.backend -> the function that measures with it (aerie.formats.backends names them; each has one, tested)
RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {"inprocess": _in_process, "sglang": _served}


def gated_benchmark(
    target: Mapping[str, Any],
    drafters: Mapping[str, Path],
    prompt_files: Sequence[Path],
    out_json: Path,
    out_png: Path,
    bench: BenchSettings,
    *,
    sglang: Mapping[str, Any] | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The bench rule's work: measure every trained drafter (``drafters``: name -> folder, in the run's order) and
    every reference in the same run with ``bench.backend``, write the report and the plot, then the gate.
    ``threads``: the job's (``bench.threads`` first)."""
    references, folders = job_references(target, bench)
    run = replace(bench.run, references=tuple(references), threads=bench.run.threads or threads)
    drafters = {name: Path(folder) for name, folder in drafters.items()}
    runner = RUNNERS[backend_named("bench", bench.backend).name]
    report = runner(target, drafters, list(prompt_files), out_json, run, sglang=sglang, references=folders, log=log)
    log_summary(report, out_json, log)
    plot_benchmark(report, out_png)
    apply_gate(report, bench.gate, out_json, out_png, log)
    return report
