"""The benchmark's prompts: every dataset's held-out ``prompts/bench.jsonl``, read in one order for both backends.

Torch-free (the SGLang backend runs in SGLang's environment).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.prompts import PromptSet, read_prompts


def load_bench_prompts(prompt_files: Sequence[Path], max_prompts: int | None = None) -> list[dict[str, Any]]:
    """The ``aerie.prompts/1`` records of ``prompt_files`` in file order, the first ``max_prompts`` of them."""
    prompts: list[dict[str, Any]] = []
    for path in prompt_files:
        prompts.extend(read_prompts(Path(path)))
    seen: set[str] = set()
    for p in prompts:
        if p["id"] in seen:
            raise ValueError(f"duplicate prompt id {p['id']!r} across {list(map(str, prompt_files))}")
        seen.add(p["id"])
    return prompts[:max_prompts] if max_prompts is not None else prompts


def bench_prompt_sets(prompt_files: Sequence[Path], max_prompts: int | None = None) -> list[PromptSet]:
    """The same prompts as :func:`load_bench_prompts`, one set per file, named after its dataset
    (``results/{dataset}/prompts/bench.jsonl``); a file the cap leaves empty gives no set."""
    prompts = load_bench_prompts(prompt_files, max_prompts)
    sets, start = [], 0
    for path in prompt_files:
        n = len(read_prompts(Path(path)))
        chunk = prompts[start : start + n]
        start += n
        if chunk:
            name = Path(path).parent.parent.name if Path(path).parent.name == "prompts" else Path(path).stem
            sets.append(
                PromptSet(
                    name=name,
                    prompts=[{"id": p["id"], "messages": p["messages"]} for p in chunk],
                    kind="aerie",
                    source=str(path),
                )
            )
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark prompt files give the same set name twice: {list(map(str, prompt_files))}")
    return sets
