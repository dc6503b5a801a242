"""The prompt cache (format ``aerie.prompt-cache/1``): a dataset's converted prompts, kept on disk by what they
were converted from, so parse time reads a count instead of converting a dataset again.

Converting a large prompt source (a 400 MB chat dump through HF ``datasets``, turn splitting, filters, dedup)
takes minutes; Snakemake parses the workflow on every ``snakemake -n``, every run and in every SLURM job. An
entry is found by a key: the SHA-256 of everything the conversion depends on (the source settings, the data
files' path/size/mtime_ns, the datasets listed before it when dedup spans datasets, aerie's converting code).
A changed file or setting is a new key, never a stale hit. Layout and fields: docs/formats.md ("Prompt cache").

Parse time imports this module: no torch, no ``datasets``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

CACHE_FORMAT = "aerie.prompt-cache/1"
# Entries kept per dataset name (older ones are deleted when a new one is written): a workdir that alternates
# between two configs does not convert on every switch, and the folder does not grow without bound.
KEEP_PER_DATASET = 3
DEDUP_KEY_BYTES = 16  # aerie.sources.tables.DEDUP_KEY_BYTES


def _file(stem: Path, ext: str) -> Path:
    """``<dataset>.<key>`` + ext (Path.with_suffix would replace the key: it is the stem's last suffix)."""
    return stem.parent / (stem.name + ext)


def cache_key(material: dict[str, Any]) -> str:
    """The SHA-256 of the key material (canonical JSON)."""
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def code_fingerprint(*modules: Path) -> str:
    """SHA-256 of the converting modules' text: a change to how prompts are converted invalidates every entry."""
    h = hashlib.sha256()
    for path in modules:
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


class CachedPrompts(Sequence):
    """One entry, read lazily: ``len`` from its metadata, a record by position (one seek), or all in order."""

    def __init__(self, stem: Path, meta: dict[str, Any]) -> None:
        self.stem = stem
        self.meta = meta
        self._offsets: array | None = None

    def __len__(self) -> int:
        return int(self.meta["count"])

    def _line_offsets(self) -> array:
        if self._offsets is None:
            offsets = array("Q")
            offsets.frombytes(_file(self.stem, ".offsets").read_bytes())
            if sys.byteorder != "little":
                offsets.byteswap()
            self._offsets = offsets
        return self._offsets

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.take([index])[0]

    def take(self, positions: Iterable[int]) -> list[dict[str, Any]]:
        """The records at ``positions`` (in that order), each read with one seek."""
        positions = list(positions)
        offsets = self._line_offsets()
        out: list[Any] = [None] * len(positions)
        with open(_file(self.stem, ".jsonl"), "rb") as fh:
            for slot, i in sorted(enumerate(positions), key=lambda x: x[1]):
                fh.seek(offsets[i])
                out[slot] = json.loads(fh.read(offsets[i + 1] - offsets[i]))
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with open(_file(self.stem, ".jsonl"), "rb") as fh:
            for line in fh:
                yield json.loads(line)

    def dedup_keys(self) -> set[bytes]:
        """The :func:`aerie.sources.tables.dedup_key` digest of every record."""
        blob = _file(self.stem, ".keys").read_bytes()
        return {blob[i : i + DEDUP_KEY_BYTES] for i in range(0, len(blob), DEDUP_KEY_BYTES)}


class PromptCache:
    """The entries under one folder (``results/.cache/prompts/``), each ``<dataset>.<key[:20]>`` + ``.jsonl``
    (records), ``.offsets``, ``.keys`` (dedup digests) and ``.json`` (metadata, written last)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _stem(self, dataset: str, key: str) -> Path:
        return self.root / f"{dataset}.{key[:20]}"

    def get(self, dataset: str, key: str) -> CachedPrompts | None:
        """The entry for ``key``, or None (absent, or written only in part: every file's size is checked)."""
        stem = self._stem(dataset, key)
        try:
            meta = json.loads(_file(stem, ".json").read_text())
            if meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
                return None
            n = int(meta["count"])
            sizes = {
                ".jsonl": meta["records_bytes"],
                ".offsets": 8 * (n + 1),
                ".keys": DEDUP_KEY_BYTES * n,
            }
            if any(_file(stem, ext).stat().st_size != size for ext, size in sizes.items()):
                return None
        except (OSError, ValueError, KeyError):
            return None
        return CachedPrompts(stem, meta)

    def put(
        self,
        dataset: str,
        key: str,
        material: dict[str, Any],
        records: Iterable[tuple[dict[str, Any], bytes]],
        extra: dict[str, Any] | None = None,
    ) -> CachedPrompts:
        """Write an entry from (record, dedup key) pairs: data files first, each atomically, the metadata last (an
        entry without it is never read); then delete this dataset's entries beyond the newest KEEP_PER_DATASET."""
        self.root.mkdir(parents=True, exist_ok=True)
        stem = self._stem(dataset, key)
        tmp = f".tmp-{os.getpid()}"
        offsets, count = array("Q", [0]), 0
        with (
            open(_file(stem, ".jsonl" + tmp), "wb") as lines,
            open(_file(stem, ".keys" + tmp), "wb") as keys,
        ):
            for record, digest in records:
                if len(digest) != DEDUP_KEY_BYTES:
                    raise ValueError(f"a dedup key is {len(digest)} bytes, not {DEDUP_KEY_BYTES}")
                line = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
                lines.write(line)
                keys.write(digest)
                offsets.append(offsets[-1] + len(line))
                count += 1
        if sys.byteorder != "little":
            offsets.byteswap()
        _file(stem, ".offsets" + tmp).write_bytes(offsets.tobytes())
        for ext in (".jsonl", ".keys", ".offsets"):
            os.replace(_file(stem, ext + tmp), _file(stem, ext))
        meta = {
            "format": CACHE_FORMAT,
            "dataset": dataset,
            "key": key,
            "count": count,
            "records_bytes": _file(stem, ".jsonl").stat().st_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "material": material,
            # read after the records are written: a converter may count while it yields (aerie.sources.recorded's stats)
            **{k: dict(v) for k, v in (extra or {}).items()},
        }
        _file(stem, ".json" + tmp).write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(_file(stem, ".json" + tmp), _file(stem, ".json"))
        self._prune(dataset)
        entry = self.get(dataset, key)
        assert entry is not None, f"{stem}: the entry just written does not read back"
        return entry

    def _prune(self, dataset: str) -> None:
        metas = sorted(self.root.glob(f"{dataset}.*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for meta in metas[KEEP_PER_DATASET:]:
            stem = meta.parent / meta.name.removesuffix(".json")
            for ext in (".json", ".jsonl", ".keys", ".offsets"):
                _file(stem, ext).unlink(missing_ok=True)
