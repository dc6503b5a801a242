"""A target's config.json, read without torch or transformers (parse time, dry runs, SGLang's env).

Multimodal wrappers (Kimi K2.5: ``KimiK25ForConditionalGeneration`` around DeepseekV3) keep the language
model's entries in ``text_config``; every reader here unwraps it the same way.

Aux-layer convention (SGLang's): aux id ``i`` is the output of 0-based decoder layer ``i`` - the residual
stream after that layer, before any norm - which equals transformers' ``output_hidden_states[i + 1]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

NESTED_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")

# Architectures whose SGLang set_eagle3_layers_to_capture adds the +1 (output i = input of layer i+1) only
# when the first id is 1, and otherwise captures the INPUTS of the ids, one layer early (sglang 0.5.23
# models/deepseek_v2.py, inherited by DeepseekV3/V32, wrapped by Kimi K2.5; models/glm4_moe_lite.py). The
# same mapping applies when SGLang serves the drafter, so for these targets ids must start with 1.
FIRST_ID_MUST_BE_ONE = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "MistralLarge3ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Glm4MoeLiteForCausalLM",
    }
)


def read_config(target_path: str | Path) -> dict[str, Any]:
    """The target folder's config.json as a dict (the wrapper's, when there is one)."""
    path = Path(target_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: the target has no config.json (is target.path a save_pretrained folder?)"
        ) from None


def read_described_config(config_json: str | Path) -> dict[str, Any]:
    """``target.config_json``: the real target's config.json before its folder is here. A relative path is read from
    the workflow's directory, else beside the repository's configs (config/kimi-k2.5.config.json ships there)."""
    path = Path(config_json)
    if not path.exists() and not path.is_absolute():
        path = Path(__file__).resolve().parents[2] / path
    return json.loads(path.read_text())


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's entries: a wrapper's nested text config, else the config itself."""
    for key in NESTED_TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, Mapping) and "hidden_size" in nested:
            return dict(nested)
    return dict(config)


def read_text_config(target_path: str | Path) -> dict[str, Any]:
    """``text_config(read_config(target_path))``: reads no weights."""
    return text_config(read_config(target_path))


def architectures(config: Mapping[str, Any]) -> list[str]:
    """Top-level ``architectures`` followed by the nested text config's (Kimi K2.5 wraps DeepseekV3)."""
    nested = [
        a
        for key in NESTED_TEXT_CONFIG_KEYS
        if isinstance(config.get(key), Mapping)
        for a in config[key].get("architectures") or []
    ]
    return [*(config.get("architectures") or []), *nested]


def target_architectures(target_path: str | Path) -> list[str]:
    """``architectures`` of a target folder's config.json and of its text config."""
    return architectures(read_config(target_path))


def target_num_hidden_layers(target_path: str | Path) -> int:
    """The target's decoder-layer count (a multimodal wrapper's text config)."""
    return int(read_text_config(target_path)["num_hidden_layers"])


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def weight_dtype_bytes(config: Mapping[str, Any]) -> int:
    """Bytes per element of the (text) model's unquantized weights - embeddings, lm_head - from config.json's
    ``dtype`` / ``torch_dtype`` (2, bf16, when it names none)."""
    text = text_config(config)
    name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    return DTYPE_BYTES.get(str(name).removeprefix("torch."), 2)


def is_mla(config: Mapping[str, Any]) -> bool:
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2.x): the text config sets ``kv_lora_rank``."""
    return text_config(config).get("kv_lora_rank") is not None


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """SGLang's default when a drafter names no ids: layer inputs [2, L//2, L-3] = outputs [1, L//2-1, L-4]."""
    return [1, num_hidden_layers // 2 - 1, num_hidden_layers - 4]


def sglang_capture_inputs(layer_ids: Sequence[int]) -> list[int]:
    """aerie aux ids (decoder-layer outputs) -> the layer indices whose *input* SGLang must capture.

    The output of layer ``i`` is the input of layer ``i + 1`` (the residual stream between them)."""
    return [int(i) + 1 for i in layer_ids]


def captured_output_ids(layers_to_capture: Sequence[int]) -> list[int]:
    """The inverse: what aerie calls the tensors SGLang captures at the inputs of ``layers_to_capture``."""
    return [int(j) - 1 for j in layers_to_capture]


def predicted_capture_inputs(architectures: Sequence[str], layer_ids: Sequence[int]) -> list[int]:
    """What sglang 0.5.23's set_eagle3_layers_to_capture will set for these ids (FIRST_ID_MUST_BE_ONE)."""
    ids = [int(i) for i in layer_ids]
    if any(a in FIRST_ID_MUST_BE_ONE for a in architectures) and ids and ids[0] != 1:
        return ids
    return sglang_capture_inputs(ids)


def check_aux_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """The ids as ints, refused when out of range, duplicated or not ascending."""
    ids = [int(i) for i in layer_ids]
    bad = [i for i in ids if not 0 <= i < num_hidden_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} out of range for a target with {num_hidden_layers} decoder layers")
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux layer ids {ids} contain duplicates: the drafter would see the same layer twice")
    if ids != sorted(ids):
        # SGLang concatenates captured layers in execution order; any other order would not line up.
        raise ValueError(f"aux layer ids {ids} must be ascending (SGLang concatenates them in layer order)")
    return ids


def check_servable_aux_layer_ids(
    layer_ids: Sequence[int], num_hidden_layers: int, architectures: Sequence[str] = ()
) -> list[int]:
    """check_aux_layer_ids plus what SGLang can serve: a drafter trained on these ids must see the same
    layers when SGLang runs it, or acceptance silently drops.

    - At least two ids: with one, SGLang's drafter skips fc (captured width == hidden size).
    - SGLang captures output ``i`` at the input of layer ``i + 1``: the last layer's output never.
    - DeepSeek-family models in SGLang read ids not starting with 1 as layer inputs (one layer early).
    """
    ids = check_aux_layer_ids(layer_ids, num_hidden_layers)
    if len(ids) < 2:
        raise ValueError(
            f"aux layer ids {ids}: at least two are needed. With one aux layer the captured width equals the "
            "hidden size, and SGLang's EAGLE-3 drafter then skips its fc projection entirely, so the drafter would "
            "be served with unprojected features it was never trained on"
        )
    if ids[-1] >= num_hidden_layers - 1:
        raise ValueError(
            f"aux layer id {ids[-1]} is the last decoder layer's output: SGLang captures a layer's output at the next "
            f"layer's input, and no layer follows layer {num_hidden_layers - 1} (use ids <= {num_hidden_layers - 2})"
        )
    family = sorted(set(architectures) & FIRST_ID_MUST_BE_ONE)
    if family and ids[0] != 1:
        raise ValueError(
            f"aux layer ids {ids} do not start with 1: SGLang's {family[0]} adds 1 to the ids (output i = input of "
            f"layer i+1) only when the first id is 1, so it would capture and serve these layers one early and the "
            f"drafter would see other features than it was trained on. Start the ids with 1 (SGLang's default "
            f"[1, L//2-1, L-4] does)"
        )
    return ids


def resolve_aux_layer_ids(
    configured: Sequence[int] | None, num_hidden_layers: int, architectures: Sequence[str] = ()
) -> list[int]:
    """The configured ids (null: SGLang's default), refused unless SGLang can capture and serve exactly them."""
    ids = list(configured) if configured else default_aux_layer_ids(num_hidden_layers)
    return check_servable_aux_layer_ids(ids, num_hidden_layers, architectures)
