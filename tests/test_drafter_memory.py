"""aerie.drafter.memory: the torch-free estimate of a drafter training process's peak memory.

* it imports no torch (the fit plan calls it while Snakemake parses the workflow);
* it sizes the drafter exactly as training builds it (trainable parameters counted on the real modules);
* Kimi K2.5's shipped drafter settings fit an H200.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from aerie.drafter.config import TrainConfig
from aerie.drafter.memory import GIB, drafter_shape, estimate_training_memory, trainable_parameters
from aerie.drafter.model import Eagle3Drafter

# moonshotai/Kimi-K2.5 config.json's text_config (the fields the drafter reads)
KIMI_TEXT = dict(
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
)
SMALL_MLA = dict(KIMI_TEXT, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 vocab_size=300)  # fmt: skip
SMALL_LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
H200_BYTES = 141 * 10**9


def test_the_estimate_imports_no_torch() -> None:
    heavy = ("torch", "safetensors", "transformers")
    code = f"import sys, aerie.drafter.memory; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("text", "shape"),
    [
        (SMALL_MLA, {}),
        (SMALL_MLA, {"attention": "llama"}),
        (SMALL_MLA, {"fc_norm": True, "intermediate_size": 40}),
        (SMALL_LLAMA, {}),
        (SMALL_LLAMA, {"num_key_value_heads": 4, "head_dim": 8}),
    ],
)
def test_trainable_parameters_are_the_modules(text: dict, shape: dict) -> None:
    d = drafter_shape(TrainConfig(**shape), text, 100, 3)
    with torch.device("meta"):
        model = Eagle3Drafter(d)
    assert trainable_parameters(d) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_kimi_shipped_settings_fit_an_h200() -> None:
    for attention in ("mla", "llama"):
        train = TrainConfig(attention=attention, max_seq_len=32768, batch_size=4, max_batch_tokens=32768)
        m = estimate_training_memory(train, {"text_config": KIMI_TEXT}, 32000, 8, hidden_layout="compact")
        assert m.batch_tokens == 32768 and m.activation_bytes == 2
        assert m.total < 0.8 * H200_BYTES, m.describe()
        assert m.parts["parameters"] == 4 * trainable_parameters(drafter_shape(train, KIMI_TEXT, 32000, 3))
        assert f"{m.total / GIB:.1f} GiB" in m.describe()
