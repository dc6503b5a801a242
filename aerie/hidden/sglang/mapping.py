"""What the SGLang capture asks SGLang for, decided without SGLang or torch: layer ids, server arguments, GPUs.

aerie's aux id ``i`` is the output of 0-based decoder layer ``i`` (transformers' ``output_hidden_states[i + 1]``).
SGLang captures the residual stream at the *input* of the layers in ``layers_to_capture``; its
``set_eagle3_layers_to_capture(ids)`` sets that to ``[i + 1 for i in ids]`` for most models, the same tensor.
DeepseekV2/V3 (and so Kimi K2.5) add the 1 only when the first id is 1 (see
:data:`aerie.target_model.config.FIRST_ID_MUST_BE_ONE`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aerie.target_model.config import architectures, captured_output_ids, sglang_capture_inputs, text_config

TESTED_SGLANG_VERSION = "0.5.23"  # the version the adapter (sglang_0523.py) was written against (envs/sglang.yaml)
ANY_VERSION_ENV = "AERIE_SGLANG_ANY_VERSION"  # set to 1 to try another SGLang version anyway

# Keys aerie sets itself: a user value would change what is captured or how.
MANAGED_KWARGS = frozenset(
    {
        "model_path",
        "enable_return_aux_hidden_states",
        "return_aux_hidden_state_layer_ids",
        "speculative_algorithm",
        "speculative_draft_model_path",
        "enable_return_hidden_states",
        "return_hidden_states_mode",
    }
)
# Settings the capture cannot support: hidden rows would be split across ranks or pipeline stages (SGLang 0.5.23's
# ServerArgs: pipeline, data-parallel attention, attention/decode/prefill context parallelism, several nodes).
# Under plain tensor parallelism every rank holds every row, which the capture checks batch by batch.
REFUSED_KWARGS = {
    "pp_size": 1,
    "dp_size": 1,
    "attn_dp_size": 1,
    "enable_dp_attention": False,
    "attn_cp_size": 1,
    "dcp_size": 1,
    "enable_prefill_cp": False,
    "nnodes": 1,
}


class SGLangUnavailableError(ImportError):
    """SGLang is not importable here (it lives in its own environment, envs/sglang.yaml)."""


class SGLangCaptureError(RuntimeError):
    """SGLang would capture something other than what aerie asked for, or a worker failed."""


class SGLangMappingError(SGLangCaptureError):
    """SGLang maps the aux layer ids to other layers than aerie's convention (a drafter would be served off by one)."""


# ---- layer-id convention --------------------------------------------------------------------------------


def check_capture_mapping(
    layer_ids: Sequence[int], layers_to_capture: Sequence[int], model: str = "the target"
) -> None:
    """Refuse unless SGLang captures exactly the outputs of ``layer_ids`` (aerie's convention)."""
    expected = sglang_capture_inputs(layer_ids)
    got = [int(j) for j in layers_to_capture]
    if got == expected:
        return
    raise SGLangMappingError(
        f"SGLang maps the aux layer ids {list(layer_ids)} of {model} to layer inputs {got}, i.e. decoder-layer "
        f"outputs {captured_output_ids(got)}, not {list(layer_ids)} (inputs {expected}). SGLang applies the same "
        f"mapping when it serves a drafter with these eagle_config ids, so a drafter trained on aerie's convention "
        f"would be served off by one. DeepseekV2/V3 and Kimi K2.5 in SGLang add 1 only when the first id is 1: "
        f"choose ids starting with 1 (SGLang's default [1, L//2-1, L-4] does)."
    )


def capture_layers_of(model: Any) -> list[int]:
    """The layer inputs a loaded SGLang model will capture (``layers_to_capture`` of its decoder stack).

    ``model`` is an ``nn.Module`` (only ``named_modules`` is used). Raises when the model cannot capture
    EAGLE-3 states or captures nothing: never a silent empty capture."""
    if not callable(getattr(model, "set_eagle3_layers_to_capture", None)):
        raise SGLangCaptureError(
            f"{type(model).__name__} has no set_eagle3_layers_to_capture: this SGLang model cannot capture EAGLE-3 "
            f"aux hidden states (older Kimi K2.5 wrappers lack it; use an SGLang whose model class has it)"
        )
    found = {
        name: list(m.layers_to_capture)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "layers_to_capture", None), (list, tuple)) and len(m.layers_to_capture)
    }
    if not found:
        raise SGLangCaptureError(
            f"{type(model).__name__}: set_eagle3_layers_to_capture left every layers_to_capture empty: "
            f"SGLang would capture nothing"
        )
    if len({tuple(v) for v in found.values()}) > 1:
        raise SGLangCaptureError(f"{type(model).__name__}: several decoder stacks capture different layers: {found}")
    return next(iter(found.values()))


# ---- target and SGLang arguments ------------------------------------------------------------------------


def target_dims(config: Mapping[str, Any]) -> dict[str, Any]:
    """num_hidden_layers, hidden_size, vocab_size (of the text config, which Kimi K2.5 nests) and the
    architectures (the wrapper's, then the text config's), from a config.json mapping."""
    text = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)} (top level keys: {sorted(config)})")
    return {
        "num_hidden_layers": int(text["num_hidden_layers"]),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "architectures": architectures(config),
    }


def sglang_server_kwargs(
    target_path: str, layer_ids: Sequence[int], dtype: Any = "auto", user_kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """ServerArgs keyword arguments for the capture: aux capture on the target, no draft, no CUDA graphs.

    ``dtype``: a string or a ``torch.dtype``. ``user_kwargs`` (tp_size, mem_fraction_static, trust_remote_code,
    context_length, ...) go on to SGLang; the keys aerie manages and settings that would split hidden rows
    across processes are refused."""
    user = dict(user_kwargs or {})
    clash = sorted(set(user) & MANAGED_KWARGS)
    if clash:
        raise ValueError(f"hidden.sglang: {clash} are set by aerie's SGLang capture and cannot be overridden")
    for key, allowed in REFUSED_KWARGS.items():
        if key in user and user[key] != allowed:
            raise ValueError(
                f"hidden.sglang: {key}={user[key]!r} is not supported by the capture (only {allowed!r}): "
                f"use tp_size to spread the target over GPUs"
            )
    tp = user.get("tp_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"hidden.sglang: tp_size must be an integer >= 1, got {tp!r}")
    return {
        "model_path": str(target_path),
        "dtype": str(dtype).removeprefix("torch."),  # torch.bfloat16 -> "bfloat16"
        # Capture-only mode: SGLang calls set_eagle3_layers_to_capture(ids) as when serving an EAGLE-3 drafter
        # with these eagle_config ids, loads no draft, and keeps the post-norm final state beside the aux ones.
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": [int(i) for i in layer_ids],
        # One eager prefill per batch: graphs would only pin memory, a radix cache would skip cached prefixes.
        "disable_cuda_graph": True,
        "disable_radix_cache": True,
        "skip_tokenizer_init": True,  # requests carry token ids; Kimi's tiktoken tokenizer is never needed
        "log_level": "warning",
        **user,
    }


def gpu_ids(server_kwargs: Mapping[str, Any]) -> list[int]:
    """The device index of each tensor-parallel rank (SGLang's base_gpu_id / gpu_id_step)."""
    tp = int(server_kwargs.get("tp_size", 1))
    base, step = int(server_kwargs.get("base_gpu_id", 0)), int(server_kwargs.get("gpu_id_step", 1))
    return [base + r * step for r in range(tp)]


# ---- the lm_head copy for the compact layout's top-k targets ------------------------------------------------

# aerie.hidden.head.lm_head_topk keeps each fp32 temporary under TOPK_CHUNK_ELEMENTS floats, and at most
# TOPK_LIVE_TEMPORARIES are alive at once (by its code: the fp32 copy of a head chunk, the chunk logits so far, one
# row block's logits, logsumexp's scratch): the workspace bound. `aerie-sglang-capture check` reports what the
# allocator really reserves on the GPU (lm_head_copy.reserved_bytes).
TOPK_CHUNK_ELEMENTS = 1 << 26
TOPK_LIVE_TEMPORARIES = 4


@dataclass(frozen=True)
class HeadCopy:
    """Where the SGLang capture keeps its copy of the target's lm_head, and how much memory it holds there.

    SGLang keeps its own (vocab-parallel) lm_head to itself, so the capture reads ``lm_head.weight`` from the
    target's safetensors to compute the compact layout's top-k targets from SGLang's final states. The copy and
    the top-k workspace go on ``gpu`` - by default SGLang's rank-0 GPU (``base_gpu_id``) - *before* the SGLang
    workers start: SGLang sizes its KV pool from the free memory it measures (the minimum over its ranks), so it
    leaves room for them instead of the copy eating SGLang's activation headroom. Kimi K2.5: [163840, 7168] bf16
    = 2.35 GB + 1.07 GB workspace on GPU 0."""

    vocab_size: int
    hidden_size: int
    dtype_bytes: int  # as stored in the checkpoint (Kimi K2.5: bf16, 2)
    gpu: int | None  # the CUDA device index; None: host memory (target.device: cpu)

    @property
    def weight_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def workspace_bytes(self) -> int:
        """lm_head_topk's fp32 temporaries at their bound (a fp32 head needs no chunk copy, counted anyway)."""
        return TOPK_LIVE_TEMPORARIES * TOPK_CHUNK_ELEMENTS * 4

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.workspace_bytes

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"

    def describe(self) -> str:
        where = "host memory" if self.gpu is None else f"GPU {self.gpu}"
        return (
            f"lm_head copy for the top-k targets: [{self.vocab_size}, {self.hidden_size}] x {self.dtype_bytes} bytes "
            f"= {self.weight_bytes / 1e9:.2f} GB + {self.workspace_bytes / 1e9:.2f} GB top-k workspace on {where}"
        )


def lm_head_copy(
    vocab_size: int,
    hidden_size: int,
    sglang_options: Mapping[str, Any] | None = None,
    device: str = "auto",
    dtype_bytes: int = 2,
) -> HeadCopy:
    """Where the SGLang capture puts its lm_head copy (``target.device``: ``auto``/``cuda`` -> SGLang's rank-0 GPU,
    ``cuda:N`` -> GPU N, ``cpu`` -> host memory) and its size; ``sglang_options``: ``hidden.sglang``. Torch-free:
    the fit plan of ``snakemake -n`` counts it against that GPU."""
    if device == "cpu":
        gpu = None
    elif device.startswith("cuda:"):
        gpu = int(device.removeprefix("cuda:"))
    elif device in ("auto", "cuda"):
        gpu = gpu_ids(sglang_options or {})[0]
    else:
        raise ValueError(f"target.device: {device!r} is not auto, cpu, cuda or cuda:N")
    return HeadCopy(int(vocab_size), int(hidden_size), int(dtype_bytes), gpu)


def plan_forwards(
    lengths: Sequence[int],
    *,
    max_tokens: int,
    max_requests: int,
    context_len: int | None = None,
    chunk_tokens: int | None = None,
) -> list[list[int]]:
    """Split a batch into forwards (lists of indices, in order) that fit SGLang's pools.

    ``max_tokens``/``max_requests``: the KV and request pools (a forward must fit whole). ``chunk_tokens``:
    SGLang's chunked_prefill_size, the prefill size its memory budget assumes; a longer sequence runs alone."""
    if max_requests < 1:
        raise ValueError(f"SGLang's request pool holds {max_requests} requests: nothing can run")
    limit = max_tokens if not chunk_tokens or chunk_tokens < 0 else min(max_tokens, chunk_tokens)
    forwards: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if context_len is not None and n > context_len:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the target's context length {context_len} in SGLang"
            )
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than SGLang's KV pool holds ({max_tokens}): "
                f"raise mem_fraction_static or lower tokens.max_seq_len"
            )
        if current and (used + n > limit or len(current) >= max_requests):
            forwards.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        forwards.append(current)
    return forwards
