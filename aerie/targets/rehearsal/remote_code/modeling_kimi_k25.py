"""The rehearsal target's model: Kimi-K2.5's wrapper layout around transformers' own DeepseekV3ForCausalLM.

Weights sit where Kimi K2.5 keeps them: the language model under ``language_model.`` (``language_model.model.
layers.N...``, ``language_model.lm_head.weight``), the vision tower and projector beside it. Text-only inputs
run the language model alone, so generation, hidden states and logits are exactly DeepseekV3's.
Shipped in the target folder and loaded with ``trust_remote_code``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class KimiK25VisionTower(nn.Module):
    """Patch embedding + projection into the text model's width (images are not part of the rehearsal)."""

    def __init__(self, config: KimiK25Config):
        super().__init__()
        v = config.vision_config
        self.patch_embed = nn.Conv2d(v["in_channels"], v["hidden_size"], v["patch_size"], stride=v["patch_size"])
        self.norm = nn.LayerNorm(v["hidden_size"])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.norm(self.patch_embed(pixel_values).flatten(2).transpose(1, 2))


class KimiK25PreTrainedModel(PreTrainedModel):
    config_class = KimiK25Config
    config: KimiK25Config
    base_model_prefix = "kimi_k25"  # no checkpoint key starts with it: keys are loaded as saved
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True


class KimiK25ForConditionalGeneration(KimiK25PreTrainedModel, GenerationMixin):
    def __init__(self, config: KimiK25Config):
        super().__init__(config)
        self.vision_tower = KimiK25VisionTower(config)
        self.mm_projector = nn.Linear(config.vision_config["hidden_size"], config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    # Embeddings and head are the language model's. get_decoder() is transformers' default, which for a
    # wrapper returns ``language_model`` - the DeepseekV3ForCausalLM, not its base model - so code that needs
    # the decoder stack must unwrap get_decoder() until it stops changing (as for Kimi K2.5's own code).
    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_output_embeddings(value)

    def forward(self, input_ids: torch.LongTensor | None = None, pixel_values: torch.Tensor | None = None, **kwargs):
        if pixel_values is not None:
            raise NotImplementedError("the rehearsal target is text-only: its vision tower is never trained")
        return self.language_model(input_ids=input_ids, **kwargs)
