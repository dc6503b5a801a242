"""The bench rule's settings: which backend measures, which references it runs, checked at parse time.

``bench.backend``: ``inprocess`` decodes with the target in the job's own Python (``aerie.bench.run``; the target
must fit the job's GPUs, ``aerie.target_model.placement``), ``sglang`` has SGLang serve it (``aerie.bench.serving``, the
serving harness: baseline, EAGLE-3 and NGRAM servers in turn, config ``sglang:``). Both write the same report and
pass the same gate (``aerie.bench.gate``).

Torch-free: imported while Snakemake parses the workflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BACKENDS = ("inprocess", "sglang")
# Reference drafters each backend can run, and its default set (config bench.references absent).
REFERENCES = {"inprocess": ("untrained", "ngram"), "sglang": ("ngram",)}


def bench_references(bench: Mapping[str, Any]) -> list[str]:
    """The references of this run: ``bench.references``, or the backend's default set."""
    backend = bench.get("backend", "inprocess")
    refs = bench.get("references")
    return list(REFERENCES[backend] if refs is None else refs)


def check_bench_config(config: Mapping[str, Any]) -> None:
    """ValueError naming the setting when the bench settings cannot work together (called by rules/bench.smk)."""
    bench = config.get("bench") or {}
    backend = bench.get("backend", "inprocess")
    if backend not in BACKENDS:
        raise ValueError(f"bench.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    unknown = [r for r in bench_references(bench) if r not in REFERENCES[backend]]
    if unknown:
        raise ValueError(
            f"bench.references: {', '.join(unknown)} cannot run with bench.backend: {backend} (it runs "
            f"{', '.join(REFERENCES[backend])}; untrained - the drafter as training starts it - is decoded by aerie "
            "in-process only); set bench.references: [" + ", ".join(REFERENCES[backend]) + "]"
        )
    if backend != "sglang":
        return
    from aerie.bench.sglang_server import sglang_settings

    settings = sglang_settings(config.get("sglang"))
    gpus = (config.get("resources") or {}).get("bench_gpus", 1)
    if settings["tp"] > gpus:
        raise ValueError(
            f"sglang.tp: {settings['tp']} GPUs per server, but rule bench gets resources.bench_gpus: {gpus}; "
            f"set resources.bench_gpus: {settings['tp']} (the servers run inside the bench job, on its GPUs)"
        )
