"""The dry run's benchmark lines: backend, sets, every reference and what the gate requires."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aerie.benchmark.methods import DRAFTER, folder_kind
from aerie.benchmark.settings import BUILTIN_NOTES, Reference
from aerie.formats.backends import backend_named
from aerie.prompts.bench_sets import bench_sets


def bench_preview_text(config: Mapping[str, Any], refs: list[Reference]) -> str:
    """The dry run's benchmark lines: backend, sets, every reference and what the gate requires."""
    bench = config.get("bench") or {}
    held_out = [n for n, d in (config.get("datasets") or {}).items() if d.get("bench_prompts", 0) > 0]
    sets = [f"{n} (held out of datasets.{n})" for n in held_out]
    for name, spec in bench_sets(config).items():
        src = spec["source"]
        label = src.get("name") or src.get("path") or src.get("data_files") or src["kind"]
        fallback = spec.get("fallback") or {}
        fb = fallback.get("path") or fallback.get("data_files") or fallback.get("name")
        sets.append(f"{name} ({label}" + (f", else {fb}" if fb else "") + ")")
    gate = bench.get("gate") or {}
    beat = gate.get("must_beat_references", True)
    traffic = bench.get("traffic") or {}
    on = ", ".join(f.replace("_", " ") for f in gate.get("beat_references_on") or ("acceptance_length", "speedup"))
    total = sum(traffic.values()) or 1.0
    references = (
        ", on the traffic mix "
        + ", ".join(f"{s} {w / total:.2f}" for s, w in traffic.items())
        + f": no loss to a reference on any set beyond its spread, above the best reference on the weighted mix ({on})"
        if traffic
        else f", beat every reference on every set ({on})"
    )
    backend = backend_named("bench", bench.get("backend")).name
    lines = [
        f"aerie benchmark: backend {backend}, one table per set: {', '.join(sets)}",
        f"  the gate, for each trained drafter on its own: speedup >= {gate.get('min_speedup', 1.0)}, lossless, no "
        "failed request" + (references if beat else "") + "; the job fails only when no "
        "trained drafter passes (the one to serve: the fastest that passes"
        + (", on the traffic mix" if traffic else "")
        + ")",
        references_text(refs),
    ]
    return "\n".join(lines)


def references_text(refs: list[Reference]) -> str:
    """The dry run's lines about the references."""
    lines = []
    for r in refs:
        if r.role != DRAFTER:
            lines.append(f"  reference {r.name}: built in{BUILTIN_NOTES.get(r.role, '')}")
        elif r.folder is not None:
            kind, _ = folder_kind(r.folder)
            lines.append(f"  reference {r.name}: {kind.name} drafter folder {r.folder}")
        else:
            lines.append(f"  reference {r.name}: NOT HERE YET - the bench job will refuse to start. {r.missing}")
    return "\n".join(lines)
