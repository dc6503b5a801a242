"""The demo target: a tiny Llama with Kimi K2.5's chat tokens, pre-trained on a synthetic task language.

Built by the pipeline itself (``python -m aerie.targets.demo.build OUT_DIR``) and loaded downstream by path
with AutoModelForCausalLM / AutoTokenizer, exactly like a real target. Modules:
- ``tasks``: the task families and the prompt generator the pipeline's prompt stage uses;
- ``tokenizer``: byte-level BPE + Kimi special tokens + Kimi-structured chat template;
- ``pretrain``: config, training loop and evaluation; ``build``: the atomic save_pretrained folder.
"""

from aerie.targets.builder import PlannedTarget, TargetBuilder
from aerie.targets.demo.config import DemoTargetConfig


def planned_demo_target(cfg: DemoTargetConfig) -> PlannedTarget:
    """The config.json the demo build writes (aerie.targets.demo.pretrain: a LlamaForCausalLM in fp32)."""
    text = {
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    return PlannedTarget(text, ("LlamaForCausalLM",), 4, "target.demo")


BUILDER = TargetBuilder("demo", DemoTargetConfig, planned_demo_target, "aerie.targets.demo.build:build_demo_target")
