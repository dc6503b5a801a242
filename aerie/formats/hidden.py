"""``aerie.hidden/2``: the target's captured states for one tokens shard - constants, codecs, writer, reader.

Two layouts (docs/formats.md): ``full`` stores aux [T, A*H] and final [T, H] in ``storage_dtype``;
``compact`` stores aux in float8 e4m3 with one fp32 scale per (token, aux layer) and, instead of the final
state, the target's top-k next-token log-probabilities. ``aerie.hidden/1`` files read as ``full``.
Every shard also carries the tokens shard's ids, mask and mask facts, so readers can check the mask again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from aerie.tools.artifacts import save_packed

HIDDEN_FORMAT = "aerie.hidden/2"
READABLE_FORMATS = ("aerie.hidden/1", HIDDEN_FORMAT)  # aerie.hidden/1 is read as the full layout
LAYOUTS = ("compact", "full")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8 e4m3fn value


# ----------------------------------------------------------------------------------------------------------
# the compact layout's codecs


def quantize_aux(aux: torch.Tensor, num_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, A*H] -> (float8 e4m3fn [n, A*H], fp32 scales [n, A]); scale = absmax / 448 per (token, layer).

    One scale per layer row keeps each layer's own range (residual streams grow with depth, and a few
    outlier channels set it); e4m3's 3 mantissa bits then bound every value's error at 1/16 of itself."""
    x = aux.float().reshape(aux.shape[0], num_aux, -1)
    scale = x.abs().amax(-1) / FP8_MAX  # [n, A]
    q = (x / scale.clamp_min(1e-30)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(aux.shape), scale


def dequantize_aux(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(float8 [n, A*H], scales [n, A]) -> [n, A*H] in ``dtype``."""
    n, A = scale.shape
    return (q.float().reshape(n, A, -1) * scale.float()[..., None]).reshape(n, -1).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# writer


def write_hidden_shard(path: str | Path, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Publish a hidden shard atomically (``meta`` without ``format``: it is set here)."""
    if meta.get("layout") not in LAYOUTS:
        raise ValueError(f"{path}: layout {meta.get('layout')!r} is not one of {', '.join(LAYOUTS)}")
    save_packed(path, tensors, {"format": HIDDEN_FORMAT, **meta})


# ----------------------------------------------------------------------------------------------------------
# reader


class HiddenShard:
    """One hidden shard (aerie.hidden/2, either layout; aerie.hidden/1 reads as ``full``): small tensors in
    memory, the big per-token tensors read lazily per window."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
        meta = self._file.metadata() or {}
        if meta.get("format") not in READABLE_FORMATS:
            raise ValueError(
                f"{self.path}: format {meta.get('format')!r}, expected one of {', '.join(READABLE_FORMATS)}"
            )
        self.layout = meta.get("layout", "full")
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.path}: unknown layout {self.layout!r}")
        self.aux_layer_ids: list[int] = [int(i) for i in json.loads(meta["aux_layer_ids"])]
        layers = meta.get("num_hidden_layers")
        self.num_hidden_layers: int | None = int(layers) if layers is not None else None
        self.hidden_size = int(meta["hidden_size"])
        self.vocab_size = int(meta["vocab_size"])
        self.sample_ids: list[str] = json.loads(meta.get("sample_ids", "[]"))
        self.input_ids = self._file.get_tensor("input_ids").long()  # [T]
        self.loss_mask = self._file.get_tensor("loss_mask").bool()  # [T]
        self.seq_offsets = self._file.get_tensor("seq_offsets").long()  # [N+1]
        T, A = len(self.input_ids), len(self.aux_layer_ids)
        expected = {"aux_hidden_states": [T, A * self.hidden_size]}
        if self.layout == "full":
            expected["final_hidden_states"] = [T, self.hidden_size]
            self.topk = 0
        else:
            self.topk = int(meta["target_topk"])
            expected.update(aux_scales=[T, A], target_topk_ids=[T, self.topk], target_topk_logprobs=[T, self.topk])
        for name, shape in expected.items():
            if name not in self._file.keys() or self._file.get_slice(name).get_shape() != shape:
                raise ValueError(f"{self.path}: {name} missing or not of shape {shape} ({self.layout} layout)")
        if len(self.sample_ids) != self.num_seqs:
            self.sample_ids = [f"{self.path.name}#{i}" for i in range(self.num_seqs)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_offsets) - 1

    def rows(self, name: str, start: int, end: int) -> Tensor:
        return self._file.get_slice(name)[start:end]

    def aux_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        """[n, A*H] aux features in ``dtype`` (the compact layout's float8 values times their scales)."""
        if self.layout == "compact":
            return dequantize_aux(
                self.rows("aux_hidden_states", start, end), self.rows("aux_scales", start, end), dtype
            )
        return self.rows("aux_hidden_states", start, end).to(dtype)


def open_hidden_shards(paths: Sequence[Path]) -> list[HiddenShard]:
    if not paths:
        raise ValueError("no hidden shards given")
    shards = [HiddenShard(Path(p)) for p in paths]
    first = shards[0]
    for s in shards[1:]:
        # Mixing layer conventions would silently train on inconsistent features: refuse.
        if s.aux_layer_ids != first.aux_layer_ids:
            raise ValueError(
                f"hidden shards disagree on aux_layer_ids: {first.path} has {first.aux_layer_ids}, "
                f"{s.path} has {s.aux_layer_ids}; recapture them with one setting"
            )
        if (s.hidden_size, s.vocab_size) != (first.hidden_size, first.vocab_size):
            raise ValueError(f"hidden shards disagree on hidden_size/vocab_size: {first.path} vs {s.path}")
        # A batch holds one kind of target (final states or top-k lists): one layout, one k for all shards.
        if (s.layout, s.topk) != (first.layout, first.topk):
            raise ValueError(
                f"hidden shards disagree on their layout: {first.path} is {first.layout} (top-k {first.topk}), "
                f"{s.path} is {s.layout} (top-k {s.topk}); recapture them with one hidden.layout / target_topk"
            )
    return shards


def shard_layer_columns(
    shards: Sequence[HiddenShard], layer_ids: Sequence[int], num_hidden_layers: int
) -> list[int] | None:
    """Where the drafter's layers ``layer_ids`` sit among the shards' captured layers (indices into their
    aux_layer_ids, in the drafter's order; None when they are exactly the captured ones). Refuses shards of a
    target of another depth or without one of the layers: the drafter would be trained on features SGLang never
    feeds it."""
    want = [int(i) for i in layer_ids]
    for s in shards:
        missing = [i for i in want if i not in s.aux_layer_ids]
        if missing or s.num_hidden_layers != num_hidden_layers:
            raise ValueError(
                f"{s.path} was captured at layers {s.aux_layer_ids} of a {s.num_hidden_layers}-layer target, but "
                f"the drafter reads layers {want} of the {num_hidden_layers}-layer target"
                + (f" ({missing} not captured)" if missing else "")
                + ": recapture the hidden shards (delete them and rerun) or fix the setting (hidden.aux_layer_ids, "
                "drafter.target_layer_ids)"
            )
    captured = shards[0].aux_layer_ids
    return None if want == captured else [captured.index(i) for i in want]
