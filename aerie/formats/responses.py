"""``aerie.responses/1``: the responses stage's JSONL shards, one record per sample, and the
``aerie.responses-completion/1`` record beside each API shard (docs/formats.md).

Written by the API client from its journal lines and by in-process generation; read by the tokens stage.
Torch-free and aiohttp-free, so every environment (SGLang's included) can import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aerie.tools.artifacts import FormatError, atomic_write_bytes

RESPONSES_FORMAT = "aerie.responses/1"
# Beside each API shard: how it completed (all prompts answered, or cut at the dataset's output-token quota).
COMPLETION_FORMAT = "aerie.responses-completion/1"
QUOTA_REASON = "max_output_tokens"

# Where a record's answer came from (its ``backend``, as config ``responses.backend`` names it): the one place these
# names are compared. ``hf``: the target generated it in the job's own process (aerie.responses.in_process);
# ``recorded``: read back from a recorded log (aerie.responses.recorded); else an API backend's name (the registry of
# aerie.responses.api.backends), with ``responses.serve`` a server of the target the job started itself.
IN_PROCESS = "hf"
RECORDED = "recorded"


def is_in_process(backend: str | None) -> bool:
    """The target generated (generates) it in the job's own process; a record that names no backend is one."""
    return backend in (None, IN_PROCESS)


def is_recorded(backend: str | None) -> bool:
    return backend == RECORDED


def loads_target(responses: dict[str, Any]) -> bool:
    """Whether a dataset's responses job holds the target itself (``responses``: its merged settings): in-process,
    or a local server of the target it starts. It then needs the target's folder and the job's cores and GPUs."""
    return is_in_process(responses.get("backend")) or bool(responses.get("serve"))


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
