"""The demo target's settings (``target.demo`` in the config): torch-free, so parse time can check them."""

from __future__ import annotations

from dataclasses import dataclass

from aerie.sources.synthetic import FAMILIES


@dataclass
class DemoTargetConfig:
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
    # data
    families: tuple[str, ...] = FAMILIES
    system_prob: float = 0.1  # share of prompts with a non-default system message
    history_prob: float = 0.1  # share of prompts with one finished earlier turn
    max_seq_len: int = 768  # longer training sequences are dropped
    prompt_loss_weight: float = 0.0  # loss weight of prompt tokens (1.0 measured no better at equal steps)
    # optimisation
    train_steps: int = 300  # ~5 min on 2 quiet cores
    batch_size: int = 16  # sequences per step
    learning_rate: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # bf16 autocast (training only; weights stay fp32) pays off from hidden ~384 up; at 256 it measured
    # no faster here, and fp32 keeps the build deterministic for a given seed and thread count.
    bf16: bool = False
    seed: int = 0
    threads: int = 2
    log_every: int = 25
    # evaluation
    eval_prompts: int = 90
    eval_max_new_tokens: int = 192
    eval_batch_size: int = 16
    humaneval_prompts: int = 24  # real HumanEval prompts, wrapped like the code family (0 = skip)
    latency_steps: int = 48
