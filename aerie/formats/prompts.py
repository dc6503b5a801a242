"""``aerie.prompts/1``: a prompts shard, one record per line (docs/formats.md, "Prompts shard").

The format's reader lives here, below every stage that reads a shard (the API job, in-process generation, the
benchmark); writing a shard from a dataset's sources is the planning layer's (aerie.prompts.write_prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aerie.artifacts import FormatError, iter_jsonl

PROMPTS_FORMAT = "aerie.prompts/1"


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """Read an ``aerie.prompts/1`` shard, refusing other formats."""
    records = []
    for lineno, obj in iter_jsonl(Path(path)):
        if obj.get("format") != PROMPTS_FORMAT:
            raise FormatError(f"{path}:{lineno}: not an {PROMPTS_FORMAT} record (format={obj.get('format')!r})")
        records.append(obj)
    return records
