"""``aerie.prompts/1``: a prompts shard, one record per line (docs/formats.md, "Prompts shard").

The format's reader lives here, below every stage that reads a shard (the API job, in-process generation, the
benchmark); writing a shard from a dataset's sources is the planning layer's (aerie.sources.datasets.write_prompts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aerie.tools.artifacts import FormatError, iter_jsonl

PROMPTS_FORMAT = "aerie.prompts/1"
# Characters per token of the previews' estimates before any tokenizer has run (usage and the tokens stage give the
# truth afterwards).
CHARS_PER_TOKEN = 4


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """Read an ``aerie.prompts/1`` shard, refusing other formats."""
    records = []
    for lineno, obj in iter_jsonl(Path(path)):
        if obj.get("format") != PROMPTS_FORMAT:
            raise FormatError(f"{path}:{lineno}: not an {PROMPTS_FORMAT} record (format={obj.get('format')!r})")
        records.append(obj)
    return records


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """About CHARS_PER_TOKEN characters per token: good enough for a preview; usage gives the truth afterwards."""
    return max(1, len(json.dumps(messages, ensure_ascii=False)) // CHARS_PER_TOKEN)
