"""The capture store: finished hidden shards kept across attempts of the one capture job of a run.

Loading a 1T-parameter target costs more than capturing with it (bench/RESULTS.md), so rule ``hidden`` is one
job that loads the target once and captures every shard of the run (aerie.hidden.capture_shards). Snakemake
deletes every declared output of a job before it starts and after it fails, so a job with many outputs would
lose finished shards to a crash and redo them all. Each shard is therefore written first to the store,
``results/<dataset>/hidden/captured/shard-NNNNN.safetensors`` (not a declared output: Snakemake never deletes
it), and then hard-linked to its declared path (one file under two names: no extra disk). A later attempt of
the job - after a crash, a failed shard, or a newer tokens shard - reuses every store entry whose capture key
still matches and captures only the rest, with one target load (none when nothing is left to capture).

The capture key (metadata ``capture_key`` of the shard, docs/formats.md) is a sha256 over the tokens shard's
bytes, the target's identity (config.json and custom code by content, weight files by name, size and mtime)
and every setting that decides the shard's bytes. Deleting a published shard is not enough to recapture it
while its store entry matches: delete the store entry too.

Torch-free: ``snakemake -n`` uses it to say how many target loads the plan contains.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

STORE_DIR = "captured"
KEY_FIELD = "capture_key"
HASH_CHUNK = 1 << 22


def store_path(hidden_path: str | Path) -> Path:
    """Where the store keeps the shard published at ``hidden_path`` (``.../hidden/captured/<name>``)."""
    path = Path(hidden_path)
    return path.parent / STORE_DIR / path.name


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def target_identity(target_path: str | Path) -> dict[str, Any]:
    """What identifies the target's weights without reading them: small files (config, custom code, weight
    index) by content, weight files by name, size and mtime (a re-downloaded target is recaptured)."""
    root = Path(target_path)
    small, weights = {}, {}
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_file():
            continue
        if p.suffix in (".json", ".py") and p.stat().st_size < (1 << 24):
            small[p.name] = file_sha256(p)
        elif p.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            st = p.stat()
            weights[p.name] = [st.st_size, st.st_mtime_ns]
    return {"files": small, "weights": weights}


def capture_key(tokens_sha256: str, target: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """The key a store entry must carry to be reused for these tokens, this target and these settings."""
    blob = json.dumps(
        {"tokens": tokens_sha256, "target": target, "settings": settings}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def read_metadata(path: str | Path) -> dict[str, str] | None:
    """A safetensors file's ``__metadata__`` from its header alone (no tensor is read); None when the file
    is missing or not a complete safetensors header."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > (1 << 27):
                return None
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (OSError, struct.error, ValueError):
        return None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:  # truncated (a copy cut short): not a finished shard
        return None
    return header.get("__metadata__") or {}


def stored_facts(store: str | Path, key: str) -> dict[str, Any] | None:
    """The facts of the store entry at ``store`` when it exists and carries ``key``; else None."""
    meta = read_metadata(store)
    if meta is None or meta.get(KEY_FIELD) != key:
        return None
    return {k: _decode(v) for k, v in meta.items()}


def _decode(value: str) -> Any:
    """Metadata values are JSON unless they were plain strings (aerie.artifacts.save_packed)."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def publish(store: str | Path, out: str | Path) -> None:
    """Give the store entry its declared name: a hard link (a copy where the file system has none), swapped
    in atomically, with a fresh mtime so Snakemake sees the output newer than its inputs."""
    import shutil

    store, out = Path(store), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.publish-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(store, tmp)
    except OSError:
        shutil.copyfile(store, tmp)
    os.replace(tmp, out)
    os.utime(out)


def capture_settings(
    *,
    aux_layer_ids: Sequence[int],
    layout: str,
    backend: str,
    backend_options: Mapping | None,
    batch_tokens: int,
    device: str,
    dtype: str,
    target_topk: int,
    storage_dtype: str,
) -> dict[str, Any]:
    """Every setting that decides a captured shard's bytes (the thresholds only accept or refuse a shard:
    a reused entry is checked against them again instead)."""
    return {
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "layout": layout,
        "backend": backend,
        "backend_options": dict(backend_options or {}),
        "batch_tokens": int(batch_tokens),
        "device": device,
        "dtype": dtype,
        **({"target_topk": int(target_topk)} if layout == "compact" else {"storage_dtype": storage_dtype}),
    }


def config_key_function(config: Mapping[str, Any]) -> Callable[[Path], str] | None:
    """tokens path -> capture key, from the pipeline config as rule ``hidden`` would compute it; None when the
    target is not there yet (its layer count and identity are unknown)."""
    from aerie.target.config import read_text_config, resolve_aux_layer_ids, target_architectures

    hidden, target = config["hidden"], config["target"]
    try:
        layers = int(read_text_config(target["path"])["num_hidden_layers"])
        ids = resolve_aux_layer_ids(hidden.get("aux_layer_ids"), layers, target_architectures(target["path"]))
        identity = target_identity(target["path"])
    except (OSError, KeyError, ValueError):
        return None
    settings = capture_settings(
        aux_layer_ids=ids,
        layout=hidden["layout"],
        backend=hidden["backend"],
        backend_options=hidden.get("sglang") if hidden["backend"] == "sglang" else None,
        batch_tokens=hidden["batch_tokens"],
        device=target["device"],
        dtype=target["dtype"],
        target_topk=hidden["target_topk"],
        storage_dtype=hidden["storage_dtype"],
    )
    return lambda tokens: capture_key(file_sha256(tokens), identity, settings)


def capture_plan(
    hidden_paths: Sequence[str | Path], tokens_paths: Sequence[str | Path], key_of: Callable[[Path], str] | None = None
) -> dict[str, int]:
    """What the capture job has left to do, judged from the files (as Snakemake judges, by mtime): ``pending``
    shards (published shard missing, or older than its tokens shard), of which ``stored`` have a store entry
    the job will reuse (its capture key equals ``key_of(tokens)``; without ``key_of``, any entry newer than its
    tokens shard) and ``to_capture`` do not; ``loads``: target loads of the job (1 when something is left to
    capture, else 0)."""
    pending = stored = 0
    for hidden, tokens in zip(hidden_paths, tokens_paths):
        hidden, tokens = Path(hidden), Path(tokens)
        if hidden.exists() and tokens.exists() and hidden.stat().st_mtime >= tokens.stat().st_mtime:
            continue
        pending += 1
        store = store_path(hidden)
        if not (tokens.exists() and store.exists()):
            continue
        if key_of is not None:
            stored += stored_facts(store, key_of(tokens)) is not None
        else:
            stored += store.stat().st_mtime >= tokens.stat().st_mtime
    to_capture = pending - stored
    return {
        "shards": len(hidden_paths),
        "pending": pending,
        "stored": stored,
        "to_capture": to_capture,
        "loads": int(to_capture > 0),
    }


def capture_plan_text(plan: Mapping[str, int]) -> str:
    """The ``snakemake -n`` line: target loads of the capture job, against one load per pending shard. Judged
    from the files, like ``capture_plan``: Snakemake may still leave the job out (a shard missing while
    everything downstream is complete is not redone unless asked for)."""
    if not plan["pending"]:
        return f"aerie capture plan: all {plan['shards']} hidden shards are published: 0 target loads"
    stored = f", {plan['stored']} of them from the capture store" if plan["stored"] else ""
    return (
        f"aerie capture plan: rule hidden (one job for all {plan['shards']} shards) publishes "
        f"{plan['pending']} pending{stored}: {plan['loads']} target load{'' if plan['loads'] == 1 else 's'} "
        f"when it runs (one job per shard: {plan['to_capture']})"
    )
