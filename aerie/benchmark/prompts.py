"""The benchmark's prompts: every dataset's held-out ``prompts/bench.jsonl`` and every ``bench.sets`` file, one set
per file, read in one order for both backends.

Torch-free (the SGLang backend runs in SGLang's environment).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.sources.datasets import PromptSet, read_prompts


def load_bench_prompts(prompt_files: Sequence[Path], max_prompts: int | None = None) -> list[dict[str, Any]]:
    """The ``aerie.prompts/1`` records of ``prompt_files`` in file order, the first ``max_prompts`` of each file."""
    prompts: list[dict[str, Any]] = []
    for path in prompt_files:
        records = read_prompts(Path(path))
        prompts.extend(records[:max_prompts] if max_prompts is not None else records)
    seen: set[str] = set()
    for p in prompts:
        if p["id"] in seen:
            raise ValueError(f"duplicate prompt id {p['id']!r} across {list(map(str, prompt_files))}")
        seen.add(p["id"])
    return prompts


def set_name(path: Path) -> str:
    """A prompt file's set: its dataset for ``results/{dataset}/prompts/bench.jsonl``, else the file's stem
    (``results/bench/sets/{set}.jsonl``)."""
    path = Path(path)
    return path.parent.parent.name if path.parent.name == "prompts" else path.stem


def bench_prompt_sets(prompt_files: Sequence[Path], max_prompts: int | None = None) -> list[PromptSet]:
    """The same prompts as :func:`load_bench_prompts`, one set per file (:func:`set_name`); an empty file gives no
    set."""
    load_bench_prompts(prompt_files, max_prompts)  # the checks across files
    sets = []
    for path in prompt_files:
        records = read_prompts(Path(path))
        chunk = records[:max_prompts] if max_prompts is not None else records
        if chunk:
            sets.append(
                PromptSet(
                    name=set_name(path),
                    prompts=[
                        {"id": p["id"], "messages": p["messages"], **({"tools": p["tools"]} if p.get("tools") else {})}
                        for p in chunk
                    ],
                    kind="aerie",
                    source=str(path),
                )
            )
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark prompt files give the same set name twice: {list(map(str, prompt_files))}")
    return sets
