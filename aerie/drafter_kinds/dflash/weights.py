"""Writing and loading DFlash drafter folders (folder.py reads and checks them without torch).

``export_dflash`` writes what SGLang 0.5.23 serves: ``model.safetensors`` (the drafter's state_dict, float
tensors in bf16 by default; tests/test_dflash_export.py checks it against SGLang's own loader, recorded in
tests/fixtures/sglang/dflash_weights.json) and ``config.json`` (``DFlashShape.to_sglang_config``), each published
atomically, config.json last. ``load_dflash`` builds a DFlashDrafter from a folder written by any tool after
checking every tensor by name and shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from aerie.drafter_kinds.dflash.folder import canonical_name, check_dflash_folder, read_dflash_folder, tensor_problems
from aerie.drafter_kinds.dflash.model import DFlashDrafter
from aerie.drafter_kinds.dflash.shape import FORMAT, DFlashShape
from aerie.drafter_kinds.folders import DrafterFolderError, weight_files
from aerie.tools.artifacts import atomic_publish, write_safetensors

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def export_dflash(
    model: DFlashDrafter,
    shape: DFlashShape,
    folder: str | Path,
    facts: Mapping[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write ``model`` (of ``shape``) to ``folder`` as SGLang loads it; ``facts`` go into config.json's ``aerie``
    block (data, recipe, code version: whatever the caller wants to carry)."""
    if model.shape != shape:
        raise ValueError(f"the model was built for {model.shape}, not {shape}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().to(dtype).contiguous() for name, t in model.state_dict().items()}
    atomic_publish(folder / "model.safetensors", lambda p: write_safetensors(p, tensors, {"format": FORMAT}))
    config = shape.to_sglang_config(_DTYPE_NAMES[dtype], dict(facts))
    atomic_publish(folder / "config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))


def read_state(folder: Path) -> dict[str, Tensor]:
    """Every stored tensor of a folder by canonical name (SGLang's resolution of prefixes and aliases)."""
    state: dict[str, Tensor] = {}
    for file in weight_files(folder):
        state.update({canonical_name(name): t for name, t in load_file(str(file)).items()})
    return state


def load_dflash(
    folder: str | Path,
    target_text_config: Any = None,
    *,
    mask_token_valid: Callable[[int], bool] | None = None,
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """The drafter in ``folder`` (aerie's export or another tool's), for a warm start or the benchmark. With the
    target's text config it is checked against the target first (check_dflash_folder; warnings are dropped: the
    ignored tensors are not loaded); without, against its own config.json. Every drafter tensor is checked by name
    and shape before any is loaded; float weights are cast to ``dtype``."""
    folder = Path(folder)
    if target_text_config is not None:
        checked = check_dflash_folder(folder, target_text_config, mask_token_valid)
        shape, tensors = checked.shape, checked.tensors
    else:
        shape, tensors = read_dflash_folder(folder)
    problems, _ = tensor_problems(shape, tensors)
    if problems:
        raise DrafterFolderError(folder, problems)
    state = read_state(folder)
    drafter = DFlashDrafter(shape)
    wanted = drafter.state_dict().keys()
    drafter.load_state_dict({name: state[name] for name in wanted}, strict=True)
    return drafter.to(dtype)
