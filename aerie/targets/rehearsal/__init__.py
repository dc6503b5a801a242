"""The Kimi-shaped rehearsal target: Kimi K2.5's structure at toy size, built offline by the pipeline.

A tiny DeepseekV3 (MLA, MoE, dense first layer) inside Kimi K2.5's multimodal wrapper (``text_config``,
weights under ``language_model.``), a tiktoken tokenizer class with Kimi's special tokens at Kimi's ids in a
163,840-id vocabulary, and a K2.5-style chat template - all loaded with ``trust_remote_code`` from custom code
in the folder, as Kimi K2.5 is. Pre-trained briefly on the demo's task language so its answers are structured
(``reasoning</think>answer<|im_end|>``). Modules:
- ``remote_code``: the files copied into the folder (configuration, modeling, tokenization);
- ``tokenizer``: BPE training, ``tiktoken.model`` and ``tokenizer_config.json``;
- ``chat_template``: the template; ``build``: config, loss, training (the demo's loop), atomic publish.
"""

from aerie.targets.builder import PlannedTarget, TargetBuilder
from aerie.targets.rehearsal.config import ARCHITECTURES, VOCAB_SIZE, RehearsalTargetConfig


def planned_rehearsal_target(cfg: RehearsalTargetConfig) -> PlannedTarget:
    """The text config the rehearsal build writes (aerie.targets.rehearsal.build: a DeepseekV3 text model in Kimi
    K2.5's wrapper, fp32, Kimi's vocabulary size)."""
    text = {
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "vocab_size": VOCAB_SIZE,
    }
    return PlannedTarget(text, ARCHITECTURES, 4, "target.rehearsal")


BUILDER = TargetBuilder(
    "rehearsal", RehearsalTargetConfig, planned_rehearsal_target, "aerie.targets.rehearsal.build:build_rehearsal_target"
)
