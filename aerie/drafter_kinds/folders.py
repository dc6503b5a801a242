"""Drafter folders of any kind and any tool, found and read without torch: the folder a spec names (a path or a Hub
repo id in the offline Hugging Face cache), its config.json and its safetensors headers. Each kind's ``folder``
module reads its own config and tensor names on top (aerie.drafter_kinds.eagle3.folder, .dflash.folder).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class DrafterFolderError(ValueError):
    """A drafter folder that cannot be read, or does not fit the config; ``problems`` lists every reason, each
    naming the tensor or the setting."""

    def __init__(self, folder: str | Path, problems: Sequence[str]):
        self.folder = str(folder)
        self.problems = list(problems)
        super().__init__(f"drafter folder {folder}: " + "; ".join(self.problems))


# ---- finding a folder -----------------------------------------------------------------------------------------


def hub_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloaded repos, in its own order of precedence."""
    dirs = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    dirs.append((Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def looks_like_repo_id(spec: str) -> bool:
    """``owner/name`` (optionally ``@revision``) and not an existing path."""
    name = spec.split("@", 1)[0]
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def resolve_drafter_folder(spec: str | Path, base: Path | None = None) -> Path:
    """The folder ``spec`` names: a local path (relative to ``base``, the workflow's directory) or a Hub repo id
    (``owner/name[@revision]``) already in the Hugging Face cache - nothing is downloaded. Raises
    FileNotFoundError saying every place it looked."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if (path / "config.json").is_file():
        return path
    looked = [str(path)]
    if looks_like_repo_id(spec):
        repo, _, revision = spec.partition("@")
        for cache in hub_cache_dirs():
            repo_dir = cache / ("models--" + repo.replace("/", "--"))
            ref = repo_dir / "refs" / (revision or "main")
            snapshot = ref.read_text().strip() if ref.is_file() else (revision or "")
            candidate = repo_dir / "snapshots" / snapshot if snapshot else repo_dir / "snapshots" / "<refs/main>"
            if snapshot and (candidate / "config.json").is_file():
                return candidate
            looked.append(str(candidate))
        hint = (
            f"download it where the network is reachable: huggingface-cli download {repo}"
            + (f" --revision {revision}" if revision else "")
            + " (or set HF_HUB_CACHE / HF_HOME to the cache that has it)"
        )
    else:
        hint = "give the folder that holds its config.json and safetensors weights"
    raise FileNotFoundError(
        f"drafter folder {spec!r} not found (no config.json); looked in: {', '.join(looked)}. {hint}"
    )


# ---- reading it -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    dtype: str  # safetensors dtype name: F32, BF16, I64, BOOL ...
    shape: tuple[int, ...]
    file: str  # the safetensors file (name within the folder)
    stored_name: str  # its name in that file


def read_safetensors_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(tensors by stored name, metadata) of one safetensors file, from its JSON header only."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    tensors = {
        name: StoredTensor(str(info["dtype"]), tuple(int(x) for x in info["shape"]), path.name, name)
        for name, info in header.items()
    }
    return tensors, meta


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the index's shards, else model.safetensors, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        raise DrafterFolderError(
            folder,
            [
                "no safetensors weights"
                + (
                    f" (it has {', '.join(other)}: convert them to safetensors, which can be checked unloaded)"
                    if other
                    else ""
                )
            ],
        )
    return files


def read_folder_config(folder: Path) -> dict[str, Any]:
    """A drafter folder's config.json; DrafterFolderError when it is absent or not JSON."""
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except FileNotFoundError:
        raise DrafterFolderError(folder, ["no config.json"]) from None
    except json.JSONDecodeError as e:
        raise DrafterFolderError(folder, [f"config.json is not JSON: {e}"]) from None


def warm_start_of(folder: Path, base: Path | None = None) -> Path | None:
    """The folder an aerie-trained drafter's training started from (its config.json's ``aerie`` block:
    ``train_config.init``, or ``init`` in an export of the start itself, when no epoch beat it), found as training
    found it (``resolve_drafter_folder`` from ``base``); None for a drafter trained from scratch or written by another
    tool. FileNotFoundError, naming both folders, when the start is recorded but no longer there."""
    aerie = read_folder_config(Path(folder)).get("aerie") or {}
    init = (aerie.get("train_config") or {}).get("init") or aerie.get("init")
    if not init:
        return None
    try:
        return resolve_drafter_folder(init, base=base)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{folder} was warm-started from drafter.init {init!r}, which is gone: {e}") from e


def read_tensor_index(folder: Path, canonical: Callable[[str], str]) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(every stored tensor by its ``canonical`` name, the files' metadata); a name stored twice is refused."""
    tensors: dict[str, StoredTensor] = {}
    metadata: dict[str, str] = {}
    for file in weight_files(folder):
        found, meta = read_safetensors_header(file)
        metadata.update(meta)
        for stored, info in found.items():
            name = canonical(stored)
            if name in tensors:
                raise DrafterFolderError(folder, [f"tensor {name} is stored twice ({tensors[name].file}, {file.name})"])
            tensors[name] = info
    return tensors, metadata
