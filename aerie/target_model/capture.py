"""Capture a target's EAGLE-3 aux hidden states with forward hooks on only the needed layers.

Layer convention (SGLang's, see aerie.target_model.config): aux id ``i`` is the output of 0-based decoder layer
``i`` - the residual stream after that layer, before any norm - which equals transformers'
``output_hidden_states[i + 1]``.
Only the hooked layers' outputs are kept, so memory does not grow with the number of layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aerie.target_model.config import check_aux_layer_ids


def base_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, layers, final norm) of a causal LM or of a wrapper around one.

    ``get_decoder()`` is followed until it returns the module itself: for a plain causal LM it gives the base
    model at once; for a multimodal wrapper such as Kimi K2.5's ``KimiK25ForConditionalGeneration`` (loaded
    with trust_remote_code) transformers' default returns the wrapped ``language_model`` - itself a causal
    LM - whose own ``get_decoder()`` then gives the base model."""
    inner = model
    for _ in range(8):  # a wrapper of a wrapper at most, in practice; a cycle would be a bug in the model code
        getter = getattr(inner, "get_decoder", None)
        nxt = getter() if callable(getter) else None
        if nxt is None or nxt is inner:
            return inner
        inner = nxt
    raise TypeError(f"{type(model).__name__}.get_decoder() does not settle on a decoder stack")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of a transformers causal LM (Llama, DeepseekV3, Qwen, ...) or of a wrapper whose
    layers live deeper (Kimi K2.5: ``language_model.model.layers``)."""
    layers = getattr(base_decoder(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no decoder-layer ModuleList (looked for get_decoder().layers, "
            "following get_decoder() through wrappers): cannot hook decoder layers"
        )
    return layers


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

    def __enter__(self) -> AuxHiddenCapture:
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
        # A target spread over several GPUs (device_map) captures each layer on its own device: join on the first's.
        return torch.cat([s.to(states[0].device) for s in states], dim=-1)
