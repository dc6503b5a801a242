"""Loading the target model and tokenizer by path, the same way for the demo target and Kimi K2.5; devices."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aerie.target_model.placement import plan_placement, weight_bytes


def pick_device(requested: str = "auto") -> torch.device:
    """``auto`` -> the first visible CUDA device when there is one, else the CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 on GPU, fp32 on CPU (CPU runs stay exact and deterministic)."""
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, requested)


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(max(1, int(threads)))


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.chat_template is None:
        raise ValueError(
            f"{path}: the tokenizer has no chat_template; aerie renders prompts with the model's own template"
        )
    return tok


def visible_gpu_memory() -> list[int]:
    """Total bytes of each visible CUDA device (the job's own: CUDA_VISIBLE_DEVICES); [] without CUDA."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def load_target(
    path: str | Path,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    *,
    spread: bool = False,
):
    """(model in eval mode, tokenizer, device of its input embeddings) for a local save_pretrained folder.

    ``spread``: place the weights by :mod:`aerie.target_model.placement` (one GPU when they fit it, else balanced over
    every visible GPU with ``device_map``/``max_memory``; too large for them all: ValueError before loading).
    Without it, or on the CPU, the whole model goes to ``device``."""
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    placement = None
    if spread and dev.type == "cuda":
        placement = plan_placement(weight_bytes(path, str(torch_dtype).removeprefix("torch.")), visible_gpu_memory())
        if placement.kind == "spread":
            kwargs.update(device_map="auto", max_memory=placement.max_memory)
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if placement is not None and placement.kind == "spread":
        off = sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()} & {"cpu", "disk"})
        if off:  # accelerate put layers off the GPUs after all: every step would stream them
            raise ValueError(f"{path}: {placement.describe()} left layers on {off}; set bench.backend: sglang")
        dev = model.get_input_embeddings().weight.device
    else:
        model = model.to(dev)
    model.eval()
    return model, load_tokenizer(path, trust_remote_code), dev


def read_generation_config(path: str | Path) -> Any | None:
    """The target folder's generation_config.json as attributes (its eos ids end generation too), if any."""
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return None

    return SimpleNamespace(**json.loads(file.read_text()))


def end_of_turn_ids(tokenizer, model_config: Any | None = None) -> list[int]:
    """Ids that end a generated turn: the tokenizer's eos plus generation_config's eos ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(gen, int):
        ids.add(gen)
    elif isinstance(gen, (list, tuple)):
        ids.update(int(i) for i in gen)
    return sorted(ids)
