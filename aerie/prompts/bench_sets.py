"""Benchmark sets besides the datasets' held-out prompts: ``bench.sets`` (the cards' MT-Bench, GSM8K, HumanEval).

A set is ``{source, fallback?, max_prompts?}``: ``source`` has the shape of a dataset's source (``datasets.*.source``:
``hf`` by Hub name read from the offline datasets cache, ``jsonl``, ``humaneval`` ...); ``fallback`` is read instead
when ``source`` cannot be (a Hub set not in the cache: local files of the same benchmark). Rule ``bench_set`` writes
``results/bench/sets/{set}.jsonl`` (``aerie.prompts/1``, ids ``{set}/{id}``), which the bench rule reads beside every
dataset's ``prompts/bench.jsonl``: one table per set in the report.

A benchmark prompt that is also a training prompt (same normalised text, :func:`aerie.sources.tables.dedup_key`) would
measure what the drafter memorised: it is dropped from the set, and the rule's log counts it.

Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aerie.sources.datasets import _converted, iter_prompts
from aerie.sources.tables import PromptSourceError, dedup_key
from aerie.tools.artifacts import atomic_write_text

SETS_DIR = "results/bench/sets"


def bench_sets(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``bench.sets`` of the config (empty when absent)."""
    return dict(((config.get("bench") or {}).get("sets")) or {})


def bench_set_files(config: Mapping[str, Any]) -> list[str]:
    """The prompt files rule ``bench_set`` writes, one per set."""
    return [f"{SETS_DIR}/{name}.jsonl" for name in bench_sets(config)]


def check_bench_sets(config: Mapping[str, Any]) -> None:
    """ValueError naming the setting: a set named like a dataset that holds out benchmark prompts (two tables of one
    name), or a set without a source."""
    datasets = config.get("datasets") or {}
    for name, spec in bench_sets(config).items():
        if not isinstance(spec, Mapping) or not isinstance(spec.get("source"), Mapping):
            raise ValueError(f"bench.sets.{name}: needs a source (the shape of datasets.*.source)")
        if (datasets.get(name) or {}).get("bench_prompts", 0) > 0:
            raise ValueError(
                f"bench.sets.{name}: dataset {name} also holds out bench_prompts; rename the set or set "
                f"datasets.{name}.bench_prompts: 0"
            )


def _read(name: str, source: Mapping[str, Any], max_prompts: int | None, cache_dir: Path | None) -> list[dict]:
    dataset = {"source": dict(source), "bench_prompts": 0, **({"max_prompts": max_prompts} if max_prompts else {})}
    return list(iter_prompts(name, dataset, None, cache_dir))


def read_bench_set(
    name: str, spec: Mapping[str, Any], cache_dir: Path | None = None, log: Callable[[str], None] = print
) -> tuple[list[dict[str, Any]], str]:
    """(the set's ``aerie.prompts/1`` records, which source gave them): ``source``, else ``fallback``."""
    max_prompts = spec.get("max_prompts")
    try:
        return _read(name, spec["source"], max_prompts, cache_dir), "source"
    except PromptSourceError as e:
        if not spec.get("fallback"):
            raise PromptSourceError(f"bench.sets.{name}: {e}") from None
        log(f"bench.sets.{name}: source unreadable ({e}); reading its fallback")
    try:
        return _read(name, spec["fallback"], max_prompts, cache_dir), "fallback"
    except PromptSourceError as e:
        raise PromptSourceError(f"bench.sets.{name}.fallback: {e}") from None


def training_keys(config: Mapping[str, Any], cache_dir: Path | None = None) -> set[bytes]:
    """Normalised texts of every training prompt of the config's datasets (their dedup keys)."""
    datasets = config.get("datasets") or {}
    keys: set[bytes] = set()
    for name, dataset in datasets.items():
        keys |= _converted(name, dataset, datasets, cache_dir).dedup_keys()
    return keys


def write_bench_set(
    name: str,
    config: Mapping[str, Any],
    out: Path,
    cache_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """Write set ``name`` of ``bench.sets`` to ``out`` without the prompts the training datasets hold; the count."""
    records, used = read_bench_set(name, bench_sets(config)[name], cache_dir, log)
    seen = training_keys(config, cache_dir)
    kept = [r for r in records if dedup_key(r["messages"]) not in seen]
    if len(kept) < len(records):
        log(f"bench.sets.{name}: {len(records) - len(kept)} prompt(s) are also training prompts: left out")
    if not kept:
        raise PromptSourceError(f"bench.sets.{name}: no prompt left (source empty, or every prompt is trained on)")
    atomic_write_text(Path(out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    log(f"{out}: {len(kept)} prompts of bench.sets.{name} (its {used})")
    return len(kept)
