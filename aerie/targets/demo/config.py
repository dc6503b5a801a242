"""The demo target's settings (``target.demo`` in the config): torch-free, so parse time can check them."""

from __future__ import annotations

from dataclasses import dataclass

from aerie.targets.pretraining import PretrainingConfig


@dataclass
class DemoTargetConfig(PretrainingConfig):
    """The demo target: a tiny Llama and its BPE tokenizer; pre-training and evaluation as PretrainingConfig's
    defaults (the shared fields come first in the class, and so in the schema's ``target.demo``)."""

    # tokenizer
    vocab_size: int = 2048
    tokenizer_examples: int = 8000
    tokenizer_stdlib_chars: int = 0  # optional Python stdlib source in the BPE corpus
    # model (LlamaConfig)
    hidden_size: int = 256
    num_hidden_layers: int = 8  # depth makes a decode step cost several 1-layer drafter steps
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # untied like Kimi (tying did not help these tasks)
