"""``aerie.responses/1``: the responses stage's JSONL shards, one record per sample (docs/formats.md).

Written by the API client from its journal lines and by in-process generation; read by the tokens stage.
Torch-free and aiohttp-free, so every environment (SGLang's included) can import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aerie.artifacts import FormatError, iter_jsonl

RESPONSES_FORMAT = "aerie.responses/1"


def iter_responses(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a responses shard, each checked to be an ``aerie.responses/1`` record."""
    for line, record in iter_jsonl(path):
        if record.get("format") != RESPONSES_FORMAT:
            raise FormatError(f"{path}:{line}: not an {RESPONSES_FORMAT} record (format={record.get('format')!r})")
        yield record
