"""The capture job of a run (rule ``hidden``): every missing shard captured with at most one target load.

Each shard is captured into the capture store and hard-linked to its declared output by the store job
(aerie.target_model.store.run_store_job), so a rerun after a crash or a failed shard reuses every finished shard
and captures only the rest; each keeps its own file, checks (aerie.hidden.checks) and log.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aerie.hidden.checks import check_agreement
from aerie.hidden.settings import CaptureSettings
from aerie.hidden.shard import capture_into, open_session
from aerie.target_model.store import (
    KEY_FIELD,
    STORE_DIR,
    StoreStage,
    capture_key,
    capture_settings,
    file_sha256,
    run_store_job,
    stored_facts,
    target_identity,
)

CAPTURE_STAGE = StoreStage(
    store_dir=STORE_DIR,
    produced="captured",
    seconds="capture_seconds",
    reused="reused from the capture store ({store}: same tokens, target and settings), nothing captured",
    producing="capturing {task.tokens}",
    stopped=(
        "capture stopped at {out} ({n} of {shards}): {captured} captured and {reused} reused before it stay in "
        "the capture store for the next attempt"
    ),
    summary=(
        "aerie capture: {shards} shards, {captured} captured, {reused} reused from the capture store; target loads "
        "in this job: {target_loads} ({load_seconds}s loading, {capture_seconds}s capturing)"
    ),
)


@dataclass(frozen=True)
class ShardTask:
    """One shard of the capture job: its tokens shard, its declared output, and its own log file."""

    tokens: Path
    out: Path
    log: Path | None = None


@torch.no_grad()
def capture_shards(
    shards: Sequence[ShardTask], target_path: str, settings: CaptureSettings, *, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Capture every shard with at most one target load; each shard keeps its own file, checks and log.

    The store job (aerie.target_model.store.run_store_job) captures a shard into the capture store and hard-links
    it to its output. A store entry whose capture key matches - same tokens bytes, target and settings - is
    reused without any work, after its recorded next-token figures pass the current thresholds; so a rerun
    after a crash or a failed shard captures only what is missing, and loads the target only if something
    is. The first shard that fails stops the job: the shards finished before it stay in the store."""
    session = open_session(settings, target_path, log)
    key_settings = capture_settings(
        aux_layer_ids=session.layer_ids,
        layout=settings.layout,
        backend=settings.backend,
        backend_options=settings.backend_options,
        batch_tokens=settings.batch_tokens,
        device=settings.device,
        dtype=settings.dtype,
        target_topk=settings.target_topk,
        storage_dtype=settings.storage_dtype,
    )
    target = target_identity(target_path)

    def key_of(task: ShardTask) -> str:
        return capture_key(file_sha256(task.tokens), target, key_settings)

    def reuse(task: ShardTask, store: Path, key: str) -> bool:
        facts = stored_facts(store, key)
        if facts is None:
            return False
        # A stored shard passes the thresholds of this run, as a captured one must (it raises otherwise).
        check_agreement(
            str(store),
            float(facts["next_token_agreement"]),
            float(facts["next_token_in_topk"]),
            int(facts.get("target_topk") or 0),
            settings.min_next_token_agreement,
            settings.min_next_token_in_topk,
        )
        return True

    def produce(task: ShardTask, store: Path, key: str, shard_log: Callable[[str], None]) -> float:
        summary = capture_into(session, task.tokens, store, settings, extra_facts={KEY_FIELD: key}, log=shard_log)
        return summary["seconds"]

    with session:
        return run_store_job(shards, CAPTURE_STAGE, key=key_of, reuse=reuse, produce=produce, session=session, log=log)
