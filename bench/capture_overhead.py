"""Hidden-state capture overhead vs a plain forward pass (goal: under 25%).

Usage (from the repository root):
    .venv/bin/python bench/capture_overhead.py [--batches 3] [--seqs 4] [--seq-len 512] [--repeats 6]

For each random-init target (fp32, CPU) the same padded batches (``--seqs`` x ``--seq-len`` tokens, as
aerie.hidden's HF backend builds them) go through two paths:

- ``plain``: ``model.get_decoder()(input_ids)``, the base model's forward (what any use of the target pays);
- ``capture``: the same forward with aerie.target_model.capture.AuxHiddenCapture hooks on the 3 default aux layers, then
  what aerie.hidden's HF backend does per batch to collect the states: concatenate the aux layers, cut each
  sequence's rows, and copy aux + final to CPU in the storage dtype (bf16).

After ``--warmup`` untimed rounds, round i sends batch i mod ``--batches`` through both paths, in
alternating order so load drift on a shared machine hits both. Overhead = median capture time / median
plain time - 1 (the median of the per-round ratios is printed too). The collection step is also timed
alone on one forward's states (``collect_s``): on a busy machine the difference of two multi-second
forwards is mostly noise, this part is not. Prints one JSON line per target and a
PASS/FAIL line; figures go to bench/RESULTS.md by hand, with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not

from aerie.target_model.capture import AuxHiddenCapture  # noqa: E402
from aerie.target_model.config import default_aux_layer_ids  # noqa: E402

GOAL = 0.25


def targets(which: list[str]) -> dict[str, nn.Module]:
    """Random-init targets, fp32, eval mode; sized so the whole run stays near 2-3 minutes on 2 busy cores."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out: dict[str, nn.Module] = {}
    if "llama" in which:
        out["llama 12L x 640"] = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=8192,
                hidden_size=640,
                intermediate_size=1792,
                num_hidden_layers=12,
                num_attention_heads=10,
                num_key_value_heads=5,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
            )
        ).eval()
    if "deepseek" in which:  # Kimi K2.5's structure (MLA, dense first layer, MoE with a shared expert), small
        out["deepseek-v3 8L x 512 (MoE 8x top-2)"] = DeepseekV3ForCausalLM(
            DeepseekV3Config(
                vocab_size=8192,
                hidden_size=512,
                intermediate_size=1536,
                moe_intermediate_size=256,
                num_hidden_layers=8,
                first_k_dense_replace=1,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                n_group=1,
                topk_group=1,
                num_attention_heads=8,
                num_key_value_heads=8,
                q_lora_rank=256,
                kv_lora_rank=128,
                qk_rope_head_dim=32,
                qk_nope_head_dim=64,
                v_head_dim=64,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
            )
        ).eval()
    return out


def plain_forward(model: nn.Module, batch: torch.Tensor) -> None:
    model.get_decoder()(input_ids=batch, use_cache=False)


def collect(cap: AuxHiddenCapture, final: torch.Tensor, lengths: list[int], store: torch.dtype) -> None:
    aux = cap.aux_hidden_states()  # [b, T, A*H]
    for r, n in enumerate(lengths):
        aux[r, :n].to("cpu", store)
        final[r, :n].to("cpu", store)


def capture_forward(
    model: nn.Module, batch: torch.Tensor, cap: AuxHiddenCapture, lengths: list[int], store: torch.dtype
) -> None:
    """aerie.hidden HFCapture.capture's work for one batch (hooks on the aux layers while it runs)."""
    with cap:  # registering 3 hooks costs microseconds; the shard stage keeps them for all batches
        final = model.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state  # [b, T, H]
        collect(cap, final, lengths, store)


def collect_only_s(
    model: nn.Module,
    batch: torch.Tensor,
    cap: AuxHiddenCapture,
    lengths: list[int],
    store: torch.dtype,
    repeats: int = 7,
) -> float:
    """The collection step alone (concatenate + copy to CPU in bf16), timed on one forward's states: a
    figure the machine's load barely moves, unlike the difference of two multi-second forwards."""
    with cap:
        final = model.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state
        kept = dict(cap._captured)
        times = []
        for _ in range(repeats):
            cap._captured.update(kept)  # aux_hidden_states() empties it
            times.append(timed(lambda: collect(cap, final, lengths, store)))
    return statistics.median(times)


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.no_grad()
def measure(name: str, model: nn.Module, args: argparse.Namespace) -> dict:
    cfg = model.config
    layer_ids = default_aux_layer_ids(cfg.num_hidden_layers)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (args.seqs, args.seq_len), generator=gen) for _ in range(args.batches)]
    # Right-padded like aerie.hidden's length batches: the last sequences are shorter, their padding not kept.
    lengths = [args.seq_len - (r * args.seq_len) // (4 * args.seqs) for r in range(args.seqs)]
    cap = AuxHiddenCapture(model, layer_ids)
    runs: dict[str, Callable[[torch.Tensor], None]] = {
        "plain": lambda b: plain_forward(model, b),
        "capture": lambda b: capture_forward(model, b, cap, lengths, torch.bfloat16),
    }
    for i in range(args.warmup):
        for fn in runs.values():
            fn(batches[i % len(batches)])
    times: dict[str, list[float]] = {"plain": [], "capture": []}
    for i in range(args.repeats):  # round i: batch i mod n through both paths, in alternating order (load drift)
        batch = batches[i % len(batches)]
        for key in ("plain", "capture") if i % 2 == 0 else ("capture", "plain"):
            times[key].append(timed(lambda key=key, batch=batch: runs[key](batch)))
    collect_s = collect_only_s(model, batches[0], cap, lengths, torch.bfloat16)
    plain_s, capture_s = statistics.median(times["plain"]), statistics.median(times["capture"])
    paired = statistics.median(c / p for c, p in zip(times["capture"], times["plain"]))
    tokens = args.seqs * args.seq_len
    return {
        "target": name,
        "aux_layer_ids": layer_ids,
        "tokens_per_batch": tokens,
        "batch": [args.seqs, args.seq_len],
        "plain_s": round(plain_s, 4),
        "capture_s": round(capture_s, 4),
        "overhead": round(capture_s / plain_s - 1, 4),
        "overhead_median_paired": round(paired - 1, 4),
        "collect_s": round(collect_s, 4),
        "collect_share": round(collect_s / plain_s, 4),
        "plain_tokens_per_s": round(tokens / plain_s, 1),
        "plain_all_s": [round(t, 4) for t in times["plain"]],
        "capture_all_s": [round(t, 4) for t in times["capture"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", default=["llama", "deepseek"], choices=["llama", "deepseek"])
    ap.add_argument("--batches", type=int, default=3, help="distinct batches; round i times batch i mod n")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=512, help="padded length of a batch (seqs x seq-len tokens)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=6, help="timed rounds (one batch through both paths each)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(json.dumps({"machine": machine}))
    started = time.perf_counter()
    for name, model in targets(args.targets).items():
        r = measure(name, model, args)
        print(json.dumps(r))
        verdict = "PASS" if r["overhead"] < GOAL else "FAIL"
        print(
            f"{verdict} {name}: plain {r['plain_s']:.3f} s, capture {r['capture_s']:.3f} s per "
            f"{r['tokens_per_batch']}-token batch -> overhead {r['overhead']:+.1%} "
            f"(median paired {r['overhead_median_paired']:+.1%}; collection step alone {r['collect_s'] * 1000:.0f} ms "
            f"= {r['collect_share']:.1%} of a plain forward; goal < {GOAL:.0%})",
            flush=True,
        )
    print(
        json.dumps({"wall_s": round(time.perf_counter() - started, 1), "load_avg_1m_end": round(os.getloadavg()[0], 2)})
    )


if __name__ == "__main__":
    main()
