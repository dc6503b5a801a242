"""``aerie.responses/1``: the responses stage's JSONL shards, one record per sample, and the
``aerie.responses-completion/1`` record beside each API shard (docs/formats.md).

Written by the API client from its journal lines and by in-process generation; read by the tokens stage.
Torch-free and aiohttp-free, so every environment (SGLang's included) can import it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aerie.artifacts import FormatError, atomic_write_bytes, iter_jsonl

RESPONSES_FORMAT = "aerie.responses/1"
# Beside each API shard: how it completed (all prompts answered, or cut at the dataset's output-token quota).
COMPLETION_FORMAT = "aerie.responses-completion/1"
QUOTA_REASON = "max_output_tokens"


def iter_responses(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a responses shard, each checked to be an ``aerie.responses/1`` record."""
    for line, record in iter_jsonl(path):
        if record.get("format") != RESPONSES_FORMAT:
            raise FormatError(f"{path}:{line}: not an {RESPONSES_FORMAT} record (format={record.get('format')!r})")
        yield record


def completion_path(shard_output: str | Path) -> Path:
    """``shard-00000.jsonl`` -> ``shard-00000.completion.json`` (``aerie.responses-completion/1``)."""
    p = Path(shard_output)
    return p.with_name(p.name.removesuffix(".jsonl") + ".completion.json")


def write_completion(shard_output: str | Path, record: dict[str, Any]) -> None:
    """Publish the completion record of a responses shard (before the shard itself: a published shard always
    has one beside it)."""
    if record.get("format") != COMPLETION_FORMAT:
        raise ValueError(f"not an {COMPLETION_FORMAT} record: {record.get('format')!r}")
    atomic_write_bytes(completion_path(shard_output), (json.dumps(record, indent=1) + "\n").encode())


def read_completion(shard_output: str | Path) -> dict[str, Any] | None:
    """The completion record beside a responses shard; None when there is none (in-process shards)."""
    path = completion_path(shard_output)
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if rec.get("format") != COMPLETION_FORMAT:
        raise FormatError(f"{path}: not an {COMPLETION_FORMAT} record (format={rec.get('format')!r})")
    return rec
