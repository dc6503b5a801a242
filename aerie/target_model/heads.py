"""The target's embeddings, output head and final norm, read from its safetensors without loading the model
(Kimi K2.5 is ~1T parameters in many shards; the drafter needs three tensors of it).

Only the tensors asked for are read, and only the files that hold them are opened: the SGLang capture path
needs the output head alone, training needs all three.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open
from torch import Tensor

from aerie.target_model.config import read_config, text_config

ROLES = ("embed", "lm_head", "norm")


@dataclass
class TargetHeads:
    """What the drafter takes from the target (as stored), with the language model's config.

    A role that was not asked for is None. ``lm_head`` is the input embeddings themselves when tied.
    """

    config: dict  # the language model's config.json entries (a multimodal wrapper's text_config)
    embed: Tensor | None  # [V, H] input embeddings
    lm_head: Tensor | None  # [V, H] output embeddings
    norm: Tensor | None  # [H] final norm weight (None also when the checkpoint has none)
    tied: bool
    names: dict = field(default_factory=dict)  # role -> checkpoint tensor name that was read


def tensor_files(target: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors.index.json when sharded, else file headers."""
    index = target / "model.safetensors.index.json"
    if index.exists():
        return {name: target / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target}: no model.safetensors.index.json and no *.safetensors file")
    names = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), path))
    return names


def _find_embed(names: Iterable[str]) -> str | None:
    """``model.embed_tokens.weight``, ``language_model.model.embed_tokens.weight``, ...: the shallowest one
    (DeepSeek-style MTP layers carry their own ``model.layers.N.embed_tokens.weight``)."""
    found = [n for n in names if n == "embed_tokens.weight" or n.endswith(".embed_tokens.weight")]
    return min(found, key=lambda n: (n.count("."), n)) if found else None


def _find_lm_head(names: Iterable[str], embed_name: str) -> str | None:
    """``lm_head.weight`` under the same wrapper as the embeddings (``language_model.lm_head.weight`` for Kimi)."""
    found = [n for n in names if n == "lm_head.weight" or n.endswith(".lm_head.weight")]
    same_wrapper = lambda n: embed_name.startswith(n[: -len("lm_head.weight")])  # noqa: E731
    return min(found, key=lambda n: (not same_wrapper(n), n.count("."), n)) if found else None


def read_target_heads(target: str | Path, roles: Iterable[str] = ROLES) -> TargetHeads:
    """Read the asked ``roles`` of embed / lm_head / norm from the target's safetensors, opening only the
    files that hold them. Tied embeddings (``tie_word_embeddings``, or no lm_head tensor) read embed_tokens."""
    target = Path(target)
    roles = set(roles)
    if roles - set(ROLES):
        raise ValueError(f"unknown target head role(s) {sorted(roles - set(ROLES))}; known: {list(ROLES)}")
    raw = read_config(target)
    config = text_config(raw)
    files = tensor_files(target)
    embed_name = _find_embed(files)
    if embed_name is None:
        raise ValueError(f"{target}: no embed_tokens.weight among its {len(files)} tensors")
    head_name = _find_lm_head(files, embed_name)
    norm_name = embed_name[: -len("embed_tokens.weight")] + "norm.weight"  # model.norm.weight, ...
    tie = config.get("tie_word_embeddings", raw.get("tie_word_embeddings"))
    tied = bool(tie) or head_name is None
    names = {"embed": embed_name, "lm_head": embed_name if tied else head_name}
    if norm_name in files:
        names["norm"] = norm_name
    wanted = {role: name for role, name in names.items() if role in roles}
    tensors: dict[str, Tensor] = {}
    by_name: dict[str, Tensor] = {}
    for path in sorted({files[name] for name in wanted.values()}):
        with safe_open(str(path), framework="pt") as f:
            for name in {n for n in wanted.values() if files[n] == path}:
                by_name[name] = f.get_tensor(name)
    tensors = {role: by_name[name] for role, name in wanted.items()}
    for role in ("embed", "lm_head"):
        if role in tensors and not tensors[role].is_floating_point():
            raise ValueError(
                f"{target}: {wanted[role]} is {tensors[role].dtype}; quantized embeddings and heads are not supported"
            )
    return TargetHeads(config, tensors.get("embed"), tensors.get("lm_head"), tensors.get("norm"), tied, wanted)
