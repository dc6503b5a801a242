"""Measure drafter training throughput (tokens/s) on CPU for the demo-sized drafter.

Usage (from the repository root, with the project installed):
    .venv/bin/python bench/drafter_train.py [--seqs 24] [--seq-len 256] [--threads 1]

A random target with the demo target's shapes (Llama, 8 layers x 256, vocab 2048, untied) supplies the
embeddings and lm_head; the hidden shard holds random features of the right shapes (the training cost does
not depend on their values). The drafter trains one epoch with the default TrainConfig (ttt_steps 7,
batch_size 4) and again with ttt_steps=3, nothing held out. "tokens/s" is the trainer's own figure: real
sequence rows per second of optimizer steps (batch loading, target soft labels, TTT unroll, backward,
AdamW), each row running ttt_steps draft steps. Prints one JSON line per setting; figures go to
bench/RESULTS.md by hand, with the command that made them.

``--reference``: the default setting again with the TTT unroll and loss aerie trained with before issue 22
(tests/ttt_reference.py: full [T, T] attention, no checkpointing, whole-window logits), interleaved with the
current path (new, old, new, old, ...) ``--repeats`` times in the same process, and the ratio of their tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not
sys.path.insert(0, str(REPO / "tests"))  # the reference (old) TTT path lives with the tests

from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.drafter.loop import train_drafter  # noqa: E402

DEMO_TARGET = dict(  # aerie.targets.demo.pretrain defaults
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
AUX_LAYER_IDS = [1, 3, 4]  # SGLang's default for 8 layers
PROMPT_FRACTION = 0.4  # the rest of each sequence counts as generated (loss-masked)


def build_inputs(root: Path, seqs: int, seq_len: int) -> tuple[list[Path], Path, Path]:
    torch.manual_seed(0)
    target_dir = root / "target"
    LlamaForCausalLM(LlamaConfig(**DEMO_TARGET)).save_pretrained(target_dir)
    V, H, A = DEMO_TARGET["vocab_size"], DEMO_TARGET["hidden_size"], len(AUX_LAYER_IDS)
    T = seqs * seq_len
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    mask[int(PROMPT_FRACTION * seq_len) :] = 1
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
            "aux_layer_ids": json.dumps(AUX_LAYER_IDS),
            "hidden_size": str(H),
            "vocab_size": str(V),
            "num_hidden_layers": "8",
            "target": str(target_dir),
            "sample_ids": json.dumps([f"bench/{i}" for i in range(seqs)]),
        },
    )
    vocab = root / "draft_vocab.safetensors"  # the demo's draft vocab: 32000 capped at the target's 2048
    save_file(
        {"d2t": torch.zeros(V, dtype=torch.int64), "t2d": torch.ones(V, dtype=torch.bool)},
        str(vocab),
        metadata={"format": "aerie.draft-vocab/1"},
    )
    return [shard], vocab, target_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=24, help="sequences in the shard (steps = seqs / batch_size)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reference", action="store_true", help="also the pre-issue-22 TTT path, interleaved")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the interleaved comparison")
    args = ap.parse_args()
    settings = [("default", {}, False), ("ttt_steps=3", {"ttt_steps": 3}, False)]
    if args.reference:
        settings = [(name, {}, old) for _ in range(args.repeats) for name, old in (("new", False), ("old", True))]
    speeds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="aerie-drafter-bench-") as tmp:
        root = Path(tmp)
        shards, vocab, target = build_inputs(root, args.seqs, args.seq_len)
        for i, (name, overrides, old) in enumerate(settings):
            cfg = TrainConfig.of(**{"epochs": 1, "eval_fraction": 0.0, "threads": args.threads, **overrides})
            t0 = time.perf_counter()
            with reference_path() if old else contextlib.nullcontext():
                result = train_drafter(shards, vocab, target, root / f"drafter-{i}", cfg, log=lambda _: None)
            speeds.setdefault(name, []).append(result["tokens_per_s"])
            print(
                json.dumps(
                    {
                        "setting": name + (" (pre-issue-22 TTT path)" if old else ""),
                        "ttt_steps": cfg.ttt_steps,
                        "batch_size": cfg.batch_size,
                        "tokens_per_s": round(result["tokens_per_s"], 1),
                        "tokens": result["tokens_trained"],
                        "optimizer_steps": result["optimizer_steps"],
                        "s_per_step": round(result["train_seconds"] / result["optimizer_steps"], 3),
                        "wall_s": round(time.perf_counter() - t0, 2),
                        "threads": torch.get_num_threads(),
                        "cpu_count": os.cpu_count(),
                        "torch": torch.__version__,
                        "python": platform.python_version(),
                    }
                ),
                flush=True,
            )
    if args.reference:
        new_s, old_s = (sum(speeds[k]) / len(speeds[k]) for k in ("new", "old"))
        print(json.dumps({"tokens_per_s new / old": round(new_s / old_s, 3), "load_avg_1m": os.getloadavg()[0]}))


@contextlib.contextmanager
def reference_path():
    """Train with the TTT path of tests/ttt_reference.py (as aerie did before issue 22) while inside."""
    from ttt_reference import naive_loss, naive_unroll

    from aerie.drafter_kinds.eagle3 import evaluate, ttt

    def old_forward(model, b, targets, steps, decay, checkpointing=True):
        logits = naive_unroll(model, b.aux, b.ids, b.position_ids, steps)
        q = targets.rows(0, b.ids.shape[1])  # [B, W, Vd] for the whole window, as before
        loss, stats = naive_loss(logits, q, b, targets.ok, decay)
        return loss, stats, [x.argmax(-1) for x in logits]

    saved = ttt.ttt_forward, evaluate.ttt_forward
    ttt.ttt_forward = evaluate.ttt_forward = old_forward
    try:
        yield
    finally:
        ttt.ttt_forward, evaluate.ttt_forward = saved


if __name__ == "__main__":
    main()
