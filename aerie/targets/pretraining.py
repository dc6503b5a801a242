"""What the built targets share: the settings of their pre-training data, optimisation and evaluation.

Both builders (``target.demo``, ``target.rehearsal``) pre-train with one loop (``aerie.targets.demo.pretrain``) and
evaluate the same way, so these fields are declared once, here; a builder's settings class inherits them and
declares its own tokenizer and model fields (and restates a default only where its target differs). Torch-free:
parse time reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from aerie.sources.synthetic import FAMILIES


@dataclass
class PretrainingConfig:
    # data
    families: tuple[str, ...] = FAMILIES
    system_prob: float = 0.1  # share of prompts with a non-default system message
    history_prob: float = 0.1  # share of prompts with one finished earlier turn
    max_seq_len: int = 768  # longer training sequences are dropped
    prompt_loss_weight: float = 0.0  # loss weight of prompt tokens (1.0 measured no better at equal steps)
    # optimisation
    train_steps: int = 300  # the demo's: ~5 min on 2 quiet cores
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
