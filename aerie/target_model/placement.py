"""Where an in-process target's weights go: one device, or spread over the job's GPUs (torch-free).

The rule :func:`aerie.target_model.model.load_target` follows, and the one a fit plan mirrors (import it; do not
copy it):

- CPU: the whole model on the CPU (``device: cpu``, or ``auto`` without CUDA).
- CUDA, one visible device, or weights that fit in :data:`GPU_WEIGHT_FRACTION` of the first device's memory: the
  whole model on ``cuda:0`` (the job's first GPU: aerie.tools.gpu_slots sets CUDA_VISIBLE_DEVICES to the job's own).
- CUDA, several visible devices, weights larger than that: the decoder layers balanced over every visible device
  (transformers' ``device_map="auto"``, i.e. accelerate's balanced placement) with at most
  :data:`GPU_WEIGHT_FRACTION` of each device's memory for weights; the rest of each device is left for activations,
  the KV cache and (on the first device, beside the embeddings) the drafter.
- Weights above that fraction of all visible devices together: refused before loading, naming ``bench.backend:
  sglang`` (SGLang serves a target of that size with tensor parallelism; accelerate would otherwise put the rest on
  the CPU or disk, and every decode step would stream it).

Weight bytes are the folder's ``*.safetensors`` tensors as stored (their headers), scaled from their stored dtype
to the loading dtype when both are known (a bf16 folder loaded as fp32 takes twice its size).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

GPU_WEIGHT_FRACTION = 0.85  # of each device's total memory, for weights; the rest for activations, KV cache, drafter
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1, "uint8": 1}
_FLOAT_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors' names of the rescalable dtypes


def stored_weights(path: str | Path) -> tuple[int, int | None] | None:
    """(bytes of the folder's ``*.safetensors`` tensors as stored, bytes per element when every tensor is one float
    dtype) from the files' headers (the 8-byte length and the JSON: no tensor is read); None without files. Packed
    ints and fp8 (quantized folders such as Kimi K2.5's int4 experts) or mixed dtypes give None: taken as stored."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    total, per_element = 0, set()
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, stop = t["data_offsets"]
            total += stop - start
            if t["dtype"] != "BOOL":
                per_element.add(_FLOAT_DTYPE_BYTES.get(t["dtype"]))
    return total, (per_element.pop() if len(per_element) == 1 else None)


def weight_bytes(path: str | Path, load_dtype: str | None = None) -> int:
    """Bytes the target's weights take once loaded: its safetensors tensors, scaled to ``load_dtype`` when the files
    hold one floating dtype (int4/quantized folders are taken as stored)."""
    stored = stored_weights(path)
    if stored is None:
        return 0
    total, per_element = stored
    if per_element is None or load_dtype not in DTYPE_BYTES:
        return total
    return total * DTYPE_BYTES[load_dtype] // per_element


@dataclass(frozen=True)
class TargetPlacement:
    """``kind``: ``cpu``, ``one_gpu`` or ``spread``; ``max_memory``: per device index, the weight budget (spread)."""

    kind: str
    weight_bytes: int
    max_memory: dict[int, int] = field(default_factory=dict)

    def describe(self) -> str:
        gib = self.weight_bytes / 2**30
        if self.kind == "spread":
            return f"{gib:.1f} GiB of weights spread over {len(self.max_memory)} GPUs (device_map auto)"
        return f"{gib:.1f} GiB of weights on {'the CPU' if self.kind == 'cpu' else 'one GPU'}"


def plan_placement(
    weights: int, gpu_memory: Sequence[int], *, fraction: float = GPU_WEIGHT_FRACTION
) -> TargetPlacement:
    """The placement of ``weights`` bytes on devices with ``gpu_memory`` bytes each (empty: the CPU).

    ValueError when they do not fit the devices together, naming ``bench.backend: sglang``."""
    if not gpu_memory:
        return TargetPlacement("cpu", weights)
    budget = [int(m * fraction) for m in gpu_memory]
    if len(gpu_memory) == 1 or weights <= budget[0]:
        if weights > budget[0]:
            raise ValueError(_refusal(weights, budget, fraction))
        return TargetPlacement("one_gpu", weights)
    if weights > sum(budget):
        raise ValueError(_refusal(weights, budget, fraction))
    return TargetPlacement("spread", weights, {i: b for i, b in enumerate(budget)})


def _refusal(weights: int, budget: Sequence[int], fraction: float) -> str:
    return (
        f"the target's weights ({weights / 2**30:.1f} GiB) do not fit the job's {len(budget)} GPU(s) "
        f"({sum(budget) / 2**30:.1f} GiB for weights: {fraction:.0%} of each): set bench.backend: sglang "
        "(SGLang serves it with tensor parallelism, config sglang.tp), or give the job more GPUs (resources.bench_gpus)"
    )
