"""Capture a target's EAGLE-3 aux hidden states with forward hooks on only the needed layers.

Layer convention (SGLang's): aux id ``i`` is the output of 0-based decoder layer ``i`` - the residual
stream after that layer, before any norm - which equals transformers' ``output_hidden_states[i + 1]``.
Only the hooked layers' outputs are kept, so memory does not grow with the number of layers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """SGLang's default when a drafter names no ids: layer inputs [2, L//2, L-3] = outputs [1, L//2-1, L-4]."""
    return [1, num_hidden_layers // 2 - 1, num_hidden_layers - 4]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of a transformers causal LM (Llama, DeepseekV3, Qwen, ...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList: cannot hook decoder layers")
    return layers


def check_aux_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
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


# Architectures whose SGLang set_eagle3_layers_to_capture adds the +1 (output i = input of layer i+1) only
# when the first id is 1, and otherwise captures the INPUTS of the ids, one layer early (sglang 0.5.23
# models/deepseek_v2.py, inherited by DeepseekV3/V32, wrapped by Kimi K2.5; models/glm4_moe_lite.py). The
# same mapping applies when SGLang serves the drafter, so for these targets ids must start with 1.
FIRST_ID_MUST_BE_ONE = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "MistralLarge3ForCausalLM", "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM",
})


def target_architectures(target_path: str | Path) -> list[str]:
    """``architectures`` of a target folder's config.json and of its text_config (Kimi K2.5 wraps DeepseekV3)."""
    cfg = json.loads((Path(target_path) / "config.json").read_text())
    return [*(cfg.get("architectures") or []), *((cfg.get("text_config") or {}).get("architectures") or [])]


def check_servable_aux_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int,
                                 architectures: Sequence[str] = ()) -> list[int]:
    """check_aux_layer_ids plus what SGLang can serve: a drafter trained on these ids must see the same
    layers when SGLang runs it, or acceptance silently drops.

    - SGLang captures output ``i`` at the input of layer ``i + 1``: the last layer's output never.
    - DeepSeek-family models in SGLang read ids not starting with 1 as layer inputs (one layer early).
    """
    ids = check_aux_layer_ids(layer_ids, num_hidden_layers)
    if ids[-1] >= num_hidden_layers - 1:
        raise ValueError(
            f"aux layer id {ids[-1]} is the last decoder layer's output: SGLang captures a layer's output at the next "
            f"layer's input, and no layer follows layer {num_hidden_layers - 1} (use ids <= {num_hidden_layers - 2})")
    family = sorted(set(architectures) & FIRST_ID_MUST_BE_ONE)
    if family and ids[0] != 1:
        raise ValueError(
            f"aux layer ids {ids} do not start with 1: SGLang's {family[0]} adds 1 to the ids (output i = input of "
            f"layer i+1) only when the first id is 1, so it would capture and serve these layers one early and the "
            f"drafter would see other features than it was trained on. Start the ids with 1 (SGLang's default "
            f"[1, L//2-1, L-4] does)")
    return ids


class AuxHiddenCapture:
    """Context manager: while active, every forward of ``model`` records the aux layers' outputs.

    >>> with AuxHiddenCapture(model, [1, 3, 4]) as cap:
    ...     out = model(input_ids)
    ...     aux = cap.aux_hidden_states()  # [B, T, 3*H], layers concatenated in id order
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        layers = decoder_layers(model)
        self.layer_ids = check_aux_layer_ids(layer_ids, len(layers))
        self._layers = layers
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._captured: dict[int, torch.Tensor] = {}

    def _hook(self, layer_id: int):
        def hook(_module: nn.Module, _args, output) -> None:
            # transformers 5 returns a tensor; older versions return (hidden, ...) tuples.
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[layer_id] = hidden.detach()

        return hook

    def __enter__(self) -> "AuxHiddenCapture":
        for i in self.layer_ids:
            self._handles.append(self._layers[i].register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._captured.clear()

    def aux_hidden_states(self) -> torch.Tensor:
        """[B, T, A*H] for the last forward; raises if a hooked layer did not run (capture silently off)."""
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:
            raise RuntimeError(f"aux layers {missing} produced no output in the last forward: capture is off")
        states = [self._captured[i] for i in self.layer_ids]
        self._captured.clear()
        return torch.cat(states, dim=-1)
