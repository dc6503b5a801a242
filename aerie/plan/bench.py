"""The benchmark's settings checked together at parse time (rules/bench.smk): backend, references, drafter names,
bench sets and the SGLang servers' GPUs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aerie.benchmark.settings import RESERVED_NAMES, Reference, check_references
from aerie.benchmark.sglang_server import sglang_settings
from aerie.formats.backends import stage_backend
from aerie.prompts.bench_sets import check_bench_sets


def check_bench_config(
    config: Mapping[str, Any], base: Path | None = None, drafters: Sequence[str] = ()
) -> list[Reference]:
    """ValueError naming the setting when the bench settings cannot work together (called by rules/bench.smk with
    the run's drafter names: each is a method of the report, so no reference may take its name); returns the
    references (:func:`check_references`)."""
    backend = stage_backend(config, "bench")  # a ValueError naming bench.backend when it is none of them
    refs = check_references(config, base)
    taken = sorted({r.name for r in refs} & set(drafters) | set(drafters) & set(RESERVED_NAMES))
    if taken:
        raise ValueError(
            f"the drafter name(s) {taken} are also a reference's or the report's own method names; rename the run "
            "(run) or the drafters entry"
        )
    check_bench_sets(config)
    if not backend.in_sglang:
        return refs
    settings = sglang_settings(config.get("sglang"))
    gpus = (config.get("resources") or {}).get("bench_gpus", 1)
    if settings["tp"] > gpus:
        raise ValueError(
            f"sglang.tp: {settings['tp']} GPUs per server, but rule bench gets resources.bench_gpus: {gpus}; "
            f"set resources.bench_gpus: {settings['tp']} (the servers run inside the bench job, on its GPUs)"
        )
    return refs
