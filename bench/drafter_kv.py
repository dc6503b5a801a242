"""The two drafter kinds for Kimi K2.5: draft KV bytes per token when served, size, and CPU training tokens/s.

Usage (from the repository root):
    .venv/bin/python bench/drafter_kv.py [--seqs 24] [--seq-len 256] [--threads 1]

Part 1 (no weights): DrafterConfig.from_target on Kimi K2.5's text config (values of its config.json: hidden
7168, 64 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, intermediate 18432,
vocab 163840, yarn factor 64, theta 50000), a 32000-token draft vocab and aux layers [1, 29, 57], for
``mla`` (SGLang's Eagle3DeepseekV2ForCausalLM), ``llama`` as aerie now sizes it for an MLA target (head_dim
128, 8 KV heads) and ``llama`` as aerie sized it before (the target's 64 KV heads, head_dim 7168/64 = 112).
KV bytes per token are what SGLang's cache holds for the drafter's one layer in bf16; parameters are counted
on the meta device, without the embeddings (the target's, not exported).

Part 2 (CPU): no trained rehearsal target exists yet, so a DeepseekV3 target built from a config with random
weights supplies embeddings, lm_head and norm: ``--target tiny`` (Kimi's layout: MLA, a dense first layer, then
MoE; hidden 256, 8 heads, q_lora 96, kv_lora 64, nope 32, rope 16, v 32, vocab 2048) or ``--target rehearsal``
(the text config aerie.targets.rehearsal builds: hidden 128, 4 heads, q_lora 64, kv_lora 32, Kimi's 163,840
vocab; draft vocab 32000). The hidden shard holds random features of the right shapes (cost does not depend
on values). Each kind trains one epoch (TrainConfig defaults: ttt_steps 7, batch 4, nothing
held out); "tokens/s" is the trainer's own figure. Prints one JSON line per row, then the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not

from aerie.drafter.config import TrainConfig
from aerie.drafter.loop import train_drafter
from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter

KIMI_K25_TEXT = dict(  # moonshotai/Kimi-K2.5 config.json text_config (the fields the drafter reads)
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
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
KIMI_AUX = [1, 29, 57]
TINY_KIMI = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TINY_AUX = [1, 3, 4]


def kimi_rows() -> list[dict]:
    kimi = DeepseekV3Config(**KIMI_K25_TEXT)
    configs = {
        "mla": DrafterConfig.from_target(kimi, 32000, KIMI_AUX),
        "llama (head_dim 128, 8 KV heads)": DrafterConfig.from_target(kimi, 32000, KIMI_AUX, attention="llama"),
        "llama as before (64 KV heads x 112)": DrafterConfig.from_target(
            kimi, 32000, KIMI_AUX, attention="llama", num_key_value_heads=64, head_dim=7168 // 64
        ),
    }
    rows = []
    for name, cfg in configs.items():
        with torch.device("meta"):
            model = Eagle3Drafter(cfg)
        params = sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")
        rows.append(
            {
                "kimi_drafter": name,
                "kv_bytes_per_token_bf16": cfg.serving_kv_bytes_per_token(),
                "params_without_embeddings": params,
            }
        )
    return rows


def target_config(which: str) -> DeepseekV3Config:
    if which == "tiny":
        return DeepseekV3Config(**TINY_KIMI)
    from aerie.targets.rehearsal.build import text_config  # the rehearsal target's own shapes
    from aerie.targets.rehearsal.config import RehearsalTargetConfig

    return text_config(RehearsalTargetConfig())


def build_inputs(root: Path, seqs: int, seq_len: int, config: DeepseekV3Config) -> tuple[list[Path], Path, Path]:
    torch.manual_seed(0)
    target_dir = root / "target"
    DeepseekV3ForCausalLM(config).save_pretrained(target_dir)
    V, H, A = config.vocab_size, config.hidden_size, len(TINY_AUX)
    Vd = min(V, 32000)
    T = seqs * seq_len
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    mask[int(0.4 * seq_len) :] = 1
    shard = root / "shard-00000.safetensors"
    save_file(
        {
            "input_ids": torch.randint(0, V, (T,), dtype=torch.int32),
            "loss_mask": mask.repeat(seqs),
            "seq_offsets": torch.arange(seqs + 1, dtype=torch.int64) * seq_len,
            "aux_hidden_states": torch.randn(T, A * H).to(torch.bfloat16),
            "final_hidden_states": torch.randn(T, H).to(torch.bfloat16),
        },
        str(shard),
        metadata={
            "format": "aerie.hidden/1",
            "aux_layer_ids": json.dumps(TINY_AUX),
            "hidden_size": str(H),
            "vocab_size": str(V),
            "num_hidden_layers": str(config.num_hidden_layers),
            "target": str(target_dir),
            "sample_ids": json.dumps([f"bench/{i}" for i in range(seqs)]),
        },
    )
    vocab = root / "draft_vocab.safetensors"
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True  # the draft vocab: the first Vd ids
    save_file(
        {"d2t": torch.zeros(Vd, dtype=torch.int64), "t2d": t2d},
        str(vocab),
        metadata={"format": "aerie.draft-vocab/1"},
    )
    return [shard], vocab, target_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=24, help="sequences in the shard (steps = seqs / batch_size)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target", choices=["tiny", "rehearsal"], default="tiny", help="shape of the random target")
    args = ap.parse_args()

    rows = kimi_rows()
    for row in rows:
        print(json.dumps(row), flush=True)
    mla_kv = rows[0]["kv_bytes_per_token_bf16"]
    print(
        json.dumps(
            {
                f"kv_bytes_ratio {r['kimi_drafter']} / mla": round(r["kv_bytes_per_token_bf16"] / mla_kv, 2)
                for r in rows[1:]
            }
        ),
        flush=True,
    )

    speeds = {}
    with tempfile.TemporaryDirectory(prefix="aerie-drafter-kv-") as tmp:
        root = Path(tmp)
        shards, vocab, target = build_inputs(root, args.seqs, args.seq_len, target_config(args.target))
        for kind in ("mla", "llama"):
            cfg = TrainConfig.of(epochs=1, eval_fraction=0.0, threads=args.threads, attention=kind)
            result = train_drafter(shards, vocab, target, root / f"drafter-{kind}", cfg, log=lambda _: None)
            exported = json.loads((root / f"drafter-{kind}" / "config.json").read_text())
            speeds[kind] = result["tokens_per_s"]
            print(
                json.dumps(
                    {
                        "training": kind,
                        "target": args.target,
                        "architecture": exported["architectures"][0],
                        "tokens_per_s": round(result["tokens_per_s"], 1),
                        "tokens": result["tokens_trained"],
                        "optimizer_steps": result["optimizer_steps"],
                        "s_per_step": round(result["train_seconds"] / result["optimizer_steps"], 3),
                        "ttt_steps": cfg.ttt_steps,
                        "threads": torch.get_num_threads(),
                        "cpu_count": os.cpu_count(),
                        "torch": torch.__version__,
                        "python": platform.python_version(),
                    }
                ),
                flush=True,
            )
    print(json.dumps({"training_tokens_per_s_ratio mla / llama": round(speeds["mla"] / speeds["llama"], 2)}))


if __name__ == "__main__":
    main()
