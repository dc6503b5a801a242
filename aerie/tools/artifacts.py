"""Reading and writing aerie's artifacts: atomic publication and versioned packed shards.

Every output is published by ``atomic_publish``: written to a temporary name in the same folder,
fsynced, given the user's umask mode and renamed into place, so an interrupted job never leaves a
half-written file that a later run would take for finished work. The formats themselves live in
aerie.formats and are documented in docs/formats.md.

Every safetensors file aerie writes goes through ``write_safetensors``: its bytes depend only on the tensors and
the metadata, never on the process (the safetensors library writes ``__metadata__`` in a per-process hash order),
so two runs of a deterministic job publish byte-identical files. Reading stays with the safetensors library.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are handled: the API client process stays small
    import torch


class FormatError(ValueError):
    """An artifact is missing, of another format version, or inconsistent."""


def publish_mode() -> int:
    """0666 minus the process umask, read without changing it (os.umask would race with other threads).

    Temporary files are created 0600 (mkstemp, safetensors); published files get the mode any other file
    the user creates would get (0644 under umask 022)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: read it the racy way, once
    os.umask(mask)
    return 0o666 & ~mask


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a folder's contents and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_publish(path: str | Path, write: Callable[[str], None]) -> None:
    """The one way aerie publishes a file: ``write(tmp)`` writes a temporary file in the same folder, which
    is fsynced, given the user's umask mode, renamed over ``path`` and made durable by fsyncing the folder.

    Readers never see a partial file, and a crash at any point leaves either the old file or the new one
    (plus, at worst, a dot-named ``.tmp`` file that the next publication of a sibling ignores)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        fsync_path(tmp)
        os.chmod(tmp, publish_mode())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_path(path.parent)


def publish_folder(tmp: str | Path, out_dir: str | Path) -> None:
    """Publish a folder built at ``tmp`` (a sibling of ``out_dir``) as ``out_dir``: any old folder is moved aside to
    ``out_dir.old``, the new one renamed in, then the old one deleted, so ``out_dir`` is never partial (a crash
    between the two renames leaves ``out_dir.old`` whole; the next publication removes it)."""
    tmp, out_dir = Path(tmp), Path(out_dir)
    old = out_dir.with_name(out_dir.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old.exists():
        shutil.rmtree(old)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_publish(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# The safetensors format's dtype names (its spec: README of huggingface/safetensors), by torch dtype name.
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
_WRITE_CHUNK = 64 << 20  # bytes per write call: bounded, and far above any per-call overhead


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
    """Write ``tensors`` and string ``metadata`` to ``path`` as a safetensors file whose bytes are a function of
    the content alone (not atomic by itself: publish through ``atomic_publish``).

    The layout is the format's (8-byte little-endian header length, a JSON header, the tensors' raw bytes) with
    every choice fixed: ``__metadata__`` first with its keys sorted, then the tensors in data order, which is by
    element size (largest first, so every tensor starts aligned to its element size) then name; compact JSON;
    the header padded with spaces to a multiple of 8 bytes. Tensors are streamed to the file one at a time from
    their own memory (a copy only where one is not contiguous or not on the CPU), never joined into one buffer.
    """
    import torch

    if sys.byteorder != "little":  # safetensors stores little-endian; aerie runs on x86-64 and arm64 only
        raise RuntimeError(f"{path}: writing safetensors needs a little-endian machine, this one is {sys.byteorder}")
    meta = dict(metadata or {})
    bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"{path}: safetensors metadata must map str to str; not so for {bad}")
    items: list[tuple[str, torch.Tensor, str]] = []
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"{path}: invalid tensor name {name!r}")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"{path}: tensor {name!r} is not a dense torch.Tensor")
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise TypeError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        items.append((name, t.detach().cpu().contiguous(), dtype))
    items.sort(key=lambda item: (-item[1].element_size(), item[0]))

    header: dict[str, Any] = {"__metadata__": dict(sorted(meta.items()))} if meta else {}
    offset = 0
    for name, t, dtype in items:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data then starts at a multiple of 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t, _ in items:
            if t.numel() == 0:
                continue
            data = t.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes, no copy
            for start in range(0, len(data), _WRITE_CHUNK):
                f.write(data[start : start + _WRITE_CHUNK])


def save_packed(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Save a packed shard: tensors + metadata (non-string values JSON-encoded), atomically and byte-deterministic
    (``write_safetensors``)."""
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    atomic_publish(path, lambda tmp: write_safetensors(tmp, tensors, meta))


def load_packed(
    path: str | Path, expected_format: str, names: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a packed shard, refusing a different format version. Metadata JSON values are decoded."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FormatError(f"{path}: file not found")
    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
        fmt = raw.get("format")
        if fmt != expected_format:
            raise FormatError(f"{path}: format {fmt!r}, expected {expected_format!r}")
        keys = list(f.keys()) if names is None else names
        missing = [k for k in keys if k not in f.keys()]
        if missing:
            raise FormatError(f"{path}: missing tensors {missing}")
        tensors = {k: f.get_tensor(k) for k in keys}
    meta: dict[str, Any] = {}
    for k, v in raw.items():
        try:
            meta[k] = json.loads(v)
        except json.JSONDecodeError:
            meta[k] = v
    return tensors, meta


def split_packed(values: torch.Tensor, seq_offsets: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed [T, ...] tensor into per-sequence views using ``seq_offsets`` [N+1]."""
    bounds = seq_offsets.tolist()
    return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for every non-blank line of a JSONL (or .jsonl.gz) file.

    A missing file, a malformed line or a non-object line raises FormatError naming file:line.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        fh = opener(path, "rt", encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise FormatError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise FormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [obj for _, obj in iter_jsonl(path)]


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
