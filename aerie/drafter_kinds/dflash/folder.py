"""DFlash drafter folders written by aerie or another tool, read and checked without torch (parse time can call
it); weights.py writes and loads them.

A folder is what SGLang 0.5.23 loads with ``--speculative-draft-model-path`` for ``--speculative-algorithm
DFLASH``: ``config.json`` (``architectures: ["DFlashDraftModel"]``, a Qwen3 config with ``layer_types``,
``block_size``, ``num_target_layers``, and ``dflash_config: {mask_token_id, target_layer_ids}`` - or those two
top-level, which SGLang also reads) and safetensors weights (``model.safetensors`` or shards named by
``model.safetensors.index.json``). What SGLang's ``DFlashDraftModel.load_weights`` accepts and this module
absorbs: tensor names with a ``model.`` prefix (it strips it), ``encoder.fc.weight`` /
``encoder.output_norm_enc.weight`` (its aliases of ``fc.weight`` / ``hidden_norm.weight``). What it silently
drops is reported: an ``lm_head.weight``, ``embed_tokens.weight``, ``d2t``/``t2d`` or rotary cache is a warning
(SGLang ignores it: the target's embeddings and lm_head are used); anything else unknown is refused. Options of
the newer DFlash variants SGLang also parses (grouped convolutions, candidate selector, Domino projector,
attention sinks, value scale, logit multiplier/softcap, Gemma norms, a causal override, a draft embedding) are
refused by name: aerie's drafter does not compute them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aerie.drafter_kinds.dflash.shape import (
    SGLANG_ARCHITECTURE,
    SGLANG_MODEL_TYPE,
    DFlashShape,
    config_value,
    default_target_layer_ids,
    text_config_of,
)
from aerie.drafter_kinds.folders import FLOAT_DTYPES, DrafterFolderError, StoredTensor, read_folder_config
from aerie.drafter_kinds.folders import read_tensor_index as read_stored_tensors

# SGLang 0.5.23 load_weights' vendor aliases (models/dflash.py _VENDOR_ENCODER_ALIASES).
SGLANG_NAME_ALIASES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
# Tensors load_weights drops without a word that a folder commonly carries.
IGNORED_BY_SGLANG = ("lm_head.weight", "embed_tokens.weight", "d2t", "t2d")
# Options SGLang 0.5.23 parses (speculative/dflash_utils.py, models/dflash.py) that aerie's drafter does not have,
# with the value meaning "off".
_UNSUPPORTED_DFLASH_OPTIONS = {
    "conv_kernel_size": 0,
    "conv_group_size": 0,
    "selector_rank": 0,
    "selector_top_k": 0,
    "projector_type": None,
    "attention_sink_bias": False,
    "attention_value_scale": None,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}
_UNSUPPORTED_TOP_LEVEL = {
    "use_gemma_norm": False,
    "is_causal": None,
    "has_embed_tokens": False,
    "rope_is_neox_style": True,
    "is_neox_style": True,
    "partial_rotary_factor": 1.0,
    "attention_bias": False,
    "hidden_act": "silu",
}


def canonical_name(stored: str) -> str:
    """The drafter's parameter name SGLang resolves a stored name to: its aliases, else without ``model.``."""
    return SGLANG_NAME_ALIASES.get(stored, stored.removeprefix("model."))


def read_tensor_index(folder: Path) -> dict[str, StoredTensor]:
    """Every stored tensor by the name SGLang resolves it to; a name stored twice is refused."""
    return read_stored_tensors(folder, canonical_name)[0]


def config_problems(cfg: Mapping[str, Any]) -> list[str]:
    """What in a config.json is not a DFlash drafter aerie computes exactly (each names the key)."""
    problems = []
    if (cfg.get("architectures") or [None])[0] != SGLANG_ARCHITECTURE:
        problems.append(f"config.json architectures {cfg.get('architectures')!r}: not [{SGLANG_ARCHITECTURE!r}]")
    if cfg.get("model_type") != SGLANG_MODEL_TYPE:
        problems.append(
            f"config.json model_type {cfg.get('model_type')!r}: SGLang reads a DFlash draft as a Qwen3Config "
            f"({SGLANG_MODEL_TYPE!r})"
        )
    nested = cfg.get("dflash_config") or {}
    for key, off in _UNSUPPORTED_DFLASH_OPTIONS.items():
        value = nested.get(key, cfg.get(key) if key == "projector_type" else None)
        if value is not None and value != off and not (key == "final_logit_softcapping" and not value):
            problems.append(f"config.json dflash_config.{key} {value!r}: not computed by aerie's DFlash drafter")
    for key, off in _UNSUPPORTED_TOP_LEVEL.items():
        if cfg.get(key) is not None and cfg[key] != off:
            problems.append(f"config.json {key} {cfg[key]!r}: not computed by aerie's DFlash drafter (expects {off})")
    for key in ("rope_scaling", "rope_parameters"):
        if "rope_dim" in (cfg.get(key) or {}):
            problems.append(f"config.json {key}.rope_dim: a partial rotary width, not computed by aerie's drafter")
    types = cfg.get("layer_types") or []
    if "sliding_attention" in types and not cfg.get("use_sliding_window"):
        problems.append(
            "config.json has sliding_attention layers without use_sliding_window: true - transformers' Qwen3Config "
            "then drops sliding_window and SGLang refuses the sliding layers"
        )
    return problems


def _where(cfg: Mapping[str, Any], key: str) -> str:
    """How the config names a dflash key: nested (``dflash_config.key``) or the top-level fallback."""
    return f"dflash_config.{key}" if key in (cfg.get("dflash_config") or {}) else f"{key} (top level)"


def read_dflash_folder(
    folder: str | Path, *, vocab_size: int | None = None, num_target_layers: int | None = None
) -> tuple[DFlashShape, dict[str, StoredTensor]]:
    """(the drafter's shape, its stored tensors by canonical name) of a folder written by aerie or another tool.
    ``vocab_size`` / ``num_target_layers``: the target's, where config.json lacks them. Refuses (DrafterFolderError,
    every reason named) what is unreadable or not representable; the fit to a target is ``check_dflash_folder``'s."""
    folder = Path(folder)
    cfg = read_folder_config(folder)
    problems = config_problems(cfg)
    if problems:
        raise DrafterFolderError(folder, problems)
    try:
        shape = DFlashShape.from_sglang_config(cfg, vocab_size=vocab_size, num_target_layers=num_target_layers)
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterFolderError(folder, [f"config.json: {e}"]) from None
    return shape, read_tensor_index(folder)


def expected_tensor_shapes(shape: DFlashShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the drafter of ``shape`` (= DFlashDrafter's state_dict) with its shape."""
    H, h, kv, d, I = (  # noqa: E741
        shape.hidden_size,
        shape.num_attention_heads,
        shape.num_key_value_heads,
        shape.head_dim,
        shape.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(shape.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (h * d, H),
                p + "self_attn.k_proj.weight": (kv * d, H),
                p + "self_attn.v_proj.weight": (kv * d, H),
                p + "self_attn.o_proj.weight": (H, h * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "post_attention_layernorm.weight": (H,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
        )
    shapes.update({"norm.weight": (H,), "fc.weight": (H, shape.num_context_features * H), "hidden_norm.weight": (H,)})
    return shapes


def _ignored_by_sglang(name: str) -> bool:
    return name in IGNORED_BY_SGLANG or name.endswith("rotary_emb.inv_freq")


def tensor_problems(shape: DFlashShape, tensors: Mapping[str, StoredTensor]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of stored tensors against the drafter of ``shape``: missing, mis-shaped, non-float and
    unknown tensors are problems; tensors SGLang drops (lm_head, embeddings, vocab maps, rotary caches) warnings."""
    expected = expected_tensor_shapes(shape)
    problems, warnings = [], []
    for name, want in expected.items():
        info = tensors.get(name)
        if info is None:
            problems.append(f"tensor {name} is missing (expected shape {list(want)})")
        elif info.shape != want and name == "fc.weight":
            problems.append(
                f"tensor fc.weight has shape {list(info.shape)}, expected {list(want)}: hidden {shape.hidden_size} "
                f"x (K = {shape.num_context_features} target layers {list(shape.target_layer_ids)} x hidden) - "
                "SGLang refuses an fc whose width is not K x hidden"
            )
        elif info.shape != want:
            problems.append(f"tensor {name} has shape {list(info.shape)}, expected {list(want)}")
        elif info.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name} is {info.dtype}: expected a float dtype")
    for name in sorted(set(tensors) - set(expected)):
        where = f"tensor {name} (stored as {tensors[name].stored_name} in {tensors[name].file})"
        if _ignored_by_sglang(name):
            warnings.append(
                f"{where}: SGLang ignores it - a DFlash draft embeds with the target's embeddings and projects "
                "with the target's lm_head; it is not loaded"
            )
        else:
            problems.append(f"{where} is not part of the DFlash drafter (SGLang's load_weights would drop it)")
    return problems, warnings


@dataclass
class CheckedDFlashFolder:
    path: Path
    shape: DFlashShape  # with the target's vocab and depth
    tensors: dict[str, StoredTensor]
    warnings: list[str] = field(default_factory=list)


def _target_problems(
    cfg: Mapping[str, Any], shape: DFlashShape, target: Any, mask_token_valid: Callable[[int], bool] | None
) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a folder's settings against the target's text config."""
    problems, warnings = [], []
    hidden, vocab, depth = (int(config_value(target, k)) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if shape.hidden_size != hidden:
        problems.append(
            f"config.json hidden_size {shape.hidden_size} != the target's hidden_size {hidden} (the block is embedded "
            "with the target's embeddings and its features are the target's width)"
        )
    if cfg.get("vocab_size") is not None and int(cfg["vocab_size"]) != vocab:
        problems.append(f"config.json vocab_size {cfg['vocab_size']} != the target's vocab_size {vocab}")
    stated_depth = (cfg.get("dflash_config") or {}).get("num_target_layers", cfg.get("num_target_layers"))
    if stated_depth is not None and int(stated_depth) != depth:
        warnings.append(
            f"config.json num_target_layers {stated_depth} != the target's {depth} layers: SGLang warns and uses the "
            "target's depth"
        )
    ids = list(shape.target_layer_ids)
    too_deep = [i for i in ids if i >= depth - 1]
    if too_deep:
        problems.append(
            f"config.json {_where(cfg, 'target_layer_ids')} {ids}: {too_deep} not below {depth - 1} for a target of "
            f"{depth} layers (an id >= {depth} is out of range; {depth - 1}, the last layer, is never captured)"
        )
    mask = shape.mask_token_id
    if not 0 <= mask < vocab:
        problems.append(
            f"config.json {_where(cfg, 'mask_token_id')} {mask} is outside the target's vocab 0..{vocab - 1}"
        )
    elif mask_token_valid is not None and not mask_token_valid(mask):
        problems.append(
            f"config.json {_where(cfg, 'mask_token_id')} {mask} is a real token of the target's tokenizer: the MASK "
            "slots would read as that token"
        )
    return problems, warnings


def _relaxed_shape(cfg: Mapping[str, Any], target_depth: int) -> DFlashShape:
    """The folder's shape with the bounds that depend on the target lifted (vocab, depth): those are compared with
    the target by _target_problems, each named. Without stated ids, SGLang's default for the target's depth."""
    nested = {k: v for k, v in (cfg.get("dflash_config") or {}).items() if k != "num_target_layers"}
    if nested.get("target_layer_ids", cfg.get("target_layer_ids")) is None:
        nested["target_layer_ids"] = default_target_layer_ids(target_depth, int(cfg["num_hidden_layers"]))
    unbounded = 2**62
    return DFlashShape.from_sglang_config(
        {**cfg, "dflash_config": nested, "vocab_size": unbounded, "num_target_layers": unbounded}
    )


def check_dflash_folder(
    folder: str | Path, target_text_config: Any, mask_token_valid: Callable[[int], bool] | None = None
) -> CheckedDFlashFolder:
    """The drafter in ``folder`` if it fits the target (``target_text_config``: a transformers config, a
    config.json dict or a namespace; a multimodal wrapper's text config is used); else DrafterFolderError naming
    every tensor or setting that does not: hidden size, vocab, target layer ids (out of range or the never-captured
    last layer), the mask id (outside the vocab, or refused by ``mask_token_valid(id)`` - the caller's "usable as
    MASK: not a token that occurs in text"), a trained ``mask_embedding.pt`` (SGLang writes it into the target's
    embedding row; aerie trains with the target's own row), missing, extra, mis-shaped or non-float tensors, fc's
    width. Tensors SGLang ignores are returned as warnings."""
    folder = Path(folder)
    target = text_config_of(target_text_config)
    cfg = read_folder_config(folder)
    problems = config_problems(cfg)
    if problems:
        raise DrafterFolderError(folder, problems)
    depth = int(config_value(target, "num_hidden_layers"))
    try:
        raw = _relaxed_shape(cfg, depth)
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterFolderError(folder, [f"config.json: {e}"]) from None
    problems, warnings = _target_problems(cfg, raw, target, mask_token_valid)
    if (folder / "mask_embedding.pt").exists():
        problems.append(
            "mask_embedding.pt: SGLang writes this trained vector into the target's embedding row of the mask id; "
            "aerie's drafter is trained and served with the target's own row"
        )
    tensors = read_tensor_index(folder)
    bad, ignored = tensor_problems(raw, tensors)
    problems += bad
    if problems:
        raise DrafterFolderError(folder, problems)
    shape = replace(raw, vocab_size=int(config_value(target, "vocab_size")), num_target_layers=depth)
    return CheckedDFlashFolder(folder, shape, tensors, warnings + ignored)
