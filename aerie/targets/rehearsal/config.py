"""The rehearsal target's settings (``target.rehearsal`` in the config): torch-free, so parse time can check them."""

from __future__ import annotations

from dataclasses import dataclass

from aerie.targets.pretraining import PretrainingConfig

# What the built folder's config.json will say (parse time needs it before the folder exists: SGLang's
# DeepSeek aux-id rule applies to these architectures).
ARCHITECTURES = ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")
VOCAB_SIZE = 163_840  # Kimi K2.5's vocab_size


@dataclass
class RehearsalTargetConfig(PretrainingConfig):
    """Settings of the rehearsal target (``target.rehearsal`` in the config overrides any of them).

    The data, optimisation and evaluation fields are PretrainingConfig's, because the training loop and evaluation
    are the demo's; the few defaults it changes are restated at the end (they keep PretrainingConfig's place in
    the field order, which the schema's ``target.rehearsal`` follows).
    """

    # tokenizer
    bpe_ranks: int = 2048  # tiktoken ranks (256 bytes + merges); Kimi has 163,584 (see tokenizer.py)
    tokenizer_examples: int = 8000
    tokenizer_stdlib_chars: int = 0
    # text model (DeepseekV3Config): Kimi K2.5's structure at toy size
    hidden_size: int = 128
    num_hidden_layers: int = 8  # SGLang's default aux ids for 8 layers are [1, 3, 4]
    first_k_dense_replace: int = 1  # Kimi: the first layer is dense, the others MoE
    intermediate_size: int = 384  # dense MLP
    moe_intermediate_size: int = 96
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.827  # Kimi K2's
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    max_position_embeddings: int = 8192
    rope_theta: float = 50000.0
    yarn_factor: float = 4.0  # yarn rope scaling as Kimi's (factor 64 over 4,096 there)
    yarn_original_max_position_embeddings: int = 2048
    vision_hidden_size: int = 32
    # where the rehearsal differs from PretrainingConfig: a smaller, faster build and evaluation
    train_steps: int = 200
    warmup: int = 20
    eval_prompts: int = 45
    eval_max_new_tokens: int = 160
    eval_batch_size: int = 15
    humaneval_prompts: int = 0
    latency_steps: int = 24
