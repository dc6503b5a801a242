"""The capture job of a run (rule ``hidden``): every missing shard captured with at most one target load.

Each shard is captured into the capture store and hard-linked to its declared output (aerie.capture_store),
so a rerun after a crash or a failed shard reuses every finished shard and captures only the rest; each keeps
its own file, checks (aerie.hidden.checks) and log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aerie.capture_store import (
    KEY_FIELD,
    capture_key,
    capture_settings,
    file_sha256,
    publish,
    shard_logger,
    store_path,
    stored_facts,
    target_identity,
)
from aerie.hidden.checks import check_agreement
from aerie.hidden.shard import CaptureSettings, capture_into


@dataclass(frozen=True)
class ShardTask:
    """One shard of the capture job: its tokens shard, its declared output, and its own log file."""

    tokens: Path
    out: Path
    log: Path | None = None


@torch.no_grad()
def capture_shards(
    shards: Sequence[ShardTask], target_path: str, *, log: Callable[[str], None] = print, **settings: Any
) -> dict[str, Any]:
    """Capture every shard with at most one target load; each shard keeps its own file, checks and log.

    A shard is captured into the capture store and hard-linked to its output (aerie.capture_store). A store
    entry whose capture key matches - same tokens bytes, target and settings - is reused without any work,
    after its recorded next-token figures pass the current thresholds; so a rerun after a crash or a failed
    shard captures only what is missing, and loads the target only if something is. The first shard that
    fails stops the job (a capture problem is rarely confined to one shard, and GPU hours are not free):
    the shards finished before it stay in the store. ``settings`` are the fields of
    :class:`aerie.hidden.shard.CaptureSettings`."""
    options = CaptureSettings(**settings)
    started = time.perf_counter()
    session = options.open_session(target_path, log)
    key_settings = capture_settings(
        aux_layer_ids=session.layer_ids,
        layout=options.layout,
        backend=options.backend,
        backend_options=options.backend_options,
        batch_tokens=options.batch_tokens,
        device=options.device,
        dtype=options.dtype,
        target_topk=options.target_topk,
        storage_dtype=options.storage_dtype,
    )
    target = target_identity(target_path)
    captured: list[str] = []
    reused: list[str] = []
    capture_seconds = 0.0
    with session:
        for n, task in enumerate(shards, 1):
            shard_log = shard_logger(task.log, log)
            store = store_path(task.out)
            try:
                key = capture_key(file_sha256(task.tokens), target, key_settings)
                facts = stored_facts(store, key)
                if facts is not None:
                    check_agreement(
                        str(store),
                        float(facts["next_token_agreement"]),
                        float(facts["next_token_in_topk"]),
                        int(facts.get("target_topk") or 0),
                        options.min_next_token_agreement,
                        options.min_next_token_in_topk,
                    )
                    shard_log(
                        f"{task.out} [{n}/{len(shards)}]: reused from the capture store ({store}: same "
                        f"tokens, target and settings), nothing captured"
                    )
                    reused.append(str(task.out))
                else:
                    shard_log(f"{task.out} [{n}/{len(shards)}]: capturing {task.tokens}")
                    store.parent.mkdir(parents=True, exist_ok=True)
                    summary = capture_into(
                        session,
                        task.tokens,
                        store,
                        options,
                        extra_facts={KEY_FIELD: key},
                        log=shard_log,
                    )
                    capture_seconds += summary["seconds"]
                    captured.append(str(task.out))
                publish(store, task.out)
            except Exception as e:
                shard_log(f"{task.out}: FAILED: {type(e).__name__}: {e}")
                log(
                    f"capture stopped at {task.out} ({n} of {len(shards)}): {len(captured)} captured and "
                    f"{len(reused)} reused before it stay in the capture store for the next attempt"
                )
                raise
    result = {
        "shards": len(shards),
        "captured": len(captured),
        "reused": len(reused),
        "target_loads": session.loads,
        "load_seconds": round(session.load_seconds, 2),
        "capture_seconds": round(capture_seconds, 2),
        "seconds": round(time.perf_counter() - started, 2),
    }
    log(
        f"aerie capture: {result['shards']} shards, {result['captured']} captured, {result['reused']} reused from "
        f"the capture store; target loads in this job: {session.loads} ({result['load_seconds']}s loading, "
        f"{result['capture_seconds']}s capturing)"
    )
    return result
