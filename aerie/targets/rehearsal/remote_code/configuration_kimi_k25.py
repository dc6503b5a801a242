"""Configuration of the rehearsal target: a Kimi-K2.5-shaped multimodal wrapper around a DeepseekV3 text model.

Like Kimi K2.5's ``config.json``: ``model_type`` ``kimi_k25``, the language model's settings under
``text_config`` (a DeepseekV3 config: MLA attention, MoE with a dense first layer), the vision settings
under ``vision_config``. Shipped in the target folder and loaded with ``trust_remote_code``.
"""

from __future__ import annotations

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"
    sub_configs = {"text_config": DeepseekV3Config}

    def __init__(
        self,
        text_config: dict | DeepseekV3Config | None = None,
        vision_config: dict | None = None,
        media_placeholder_token_id: int | None = None,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        # A tiny patch-embedding tower: its weights exist (as Kimi's vision tower's do) but text never uses it.
        self.vision_config = dict(vision_config or {"in_channels": 3, "patch_size": 14, "hidden_size": 32})
        self.media_placeholder_token_id = media_placeholder_token_id
        kwargs.setdefault("tie_word_embeddings", self.text_config.tie_word_embeddings)
        super().__init__(**kwargs)
