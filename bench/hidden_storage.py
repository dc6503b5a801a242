"""Compact vs full hidden-state storage on the demo pipeline's data: bytes per token and drafter fidelity.

Usage (from the repository root, after the demo ran, i.e. results/ holds its tokens shards, draft vocab and
target):
    .venv/bin/python bench/hidden_storage.py [--results results] [--work /tmp/aerie-hidden-storage]
                                             [--datasets tasks] [--target-topk 32] [--threads 2]

All demo data (5 shards, 63k tokens): about 11 minutes on 2 cores, the two trainings most of it;
``--datasets tasks`` (2 shards, 20k tokens) about 4 minutes.

1. Captures every tokens shard twice with the demo target: ``layout: full`` (aux + final in bf16, the layout
   SpecForge stores: 8H bytes a token) and ``layout: compact`` (fp8 aux + the target's top-k next tokens).
   Prints bytes per token of each and its ratio to SpecForge's 8H.
2. Trains the drafter on each with the demo's drafter settings (config/config.yaml) and the same seed, and
   prints the held-out simulated acceptance length of each (eval.json) and their relative difference.
3. Evaluates both trained drafters on the same held-out windows of the *full* shards (bf16 aux states,
   targets from the full lm_head): what the drafter meets at inference, where SGLang feeds it the target's
   unquantized states. This is the figure that says whether compact storage costs acceptance.

Tokens shards of an older run (``aerie.tokens/1``: the same three tensors) are relabelled into the work
folder. Writes ``{work}/hidden_storage.json``; figures go to bench/RESULTS.md by hand, with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not

from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.drafter.data import batches, load_batch, make_windows, split_heldout  # noqa: E402
from aerie.drafter.loop import train_drafter  # noqa: E402
from aerie.drafter_kinds.eagle3.evaluate import evaluate  # noqa: E402
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter  # noqa: E402
from aerie.drafter_kinds.eagle3.ttt import TargetHead  # noqa: E402
from aerie.formats.hidden import dequantize_aux, open_hidden_shards  # noqa: E402
from aerie.formats.tokens import TOKENS_FORMAT  # noqa: E402
from aerie.formats.vocab import load_draft_vocab  # noqa: E402
from aerie.hidden.settings import CaptureSettings
from aerie.hidden.shard import capture_shard  # noqa: E402
from aerie.preview.disk import specforge_bytes_per_token  # noqa: E402
from aerie.target_model.heads import read_target_heads  # noqa: E402

OLDER_TOKENS_FORMATS = ("aerie.tokens/1",)  # same tensors (input_ids, loss_mask, seq_offsets)


def tokens_shards(results: Path, work: Path, datasets: list[str] | None = None) -> dict[str, Path]:
    """{dataset-shard name: path} of the demo's tokens shards, relabelled into ``work`` when they were written by
    an older version."""
    out = {}
    for path in sorted(results.glob("*/tokens/shard-*.safetensors")):
        name = f"{path.parent.parent.name}-{path.name}"
        if datasets and path.parent.parent.name not in datasets:
            continue
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") == TOKENS_FORMAT:
                out[name] = path
                continue
            if meta.get("format") not in OLDER_TOKENS_FORMATS:
                raise SystemExit(f"{path}: format {meta.get('format')!r} is neither {TOKENS_FORMAT} nor an older one")
            tensors = {k: f.get_tensor(k) for k in ("input_ids", "loss_mask", "seq_offsets")}
        dst = work / "tokens" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(dst), metadata={**meta, "format": TOKENS_FORMAT})
        out[name] = dst
    if not out:
        raise SystemExit(f"no tokens shards under {results}/*/tokens/: run the demo first")
    return out


def heldout_eval(drafter_dir: Path, hidden: list[Path], vocab_path: Path, target: Path, cfg: TrainConfig) -> dict:
    """A trained drafter's held-out evaluation on ``hidden`` (the split training used: same seed, sample ids)."""
    shards = open_hidden_shards(hidden)
    vocab = load_draft_vocab(vocab_path)
    lm_head = read_target_heads(target).lm_head.float()
    head = TargetHead(full=lm_head, draft=lm_head[vocab.target_ids], t2d=vocab.t2d)
    held = split_heldout(shards, cfg.eval_fraction, cfg.seed)
    windows = [w for si, q in sorted(held) for w in make_windows(si, shards[si], q, cfg.max_seq_len, cfg.ttt_steps + 1)]
    model = Eagle3Drafter.from_pretrained(drafter_dir)  # fp32 of the exported (bf16) weights, as SGLang serves them
    cpu = torch.device("cpu")
    capacity = cfg.max_seq_len if cfg.packing else None
    heldout = (
        load_batch(g, shards, cfg.ttt_steps + 1, cpu, torch.float32, capacity) for g in batches(windows, cfg, None)
    )
    return evaluate(model, heldout, head, cfg.kind_settings, "chunked", cpu)


def aux_error(full: list[Path], compact: list[Path]) -> float:
    """Mean over tokens of |fp8 aux - bf16 aux| / |bf16 aux| (row L2 norms), first shard."""
    with safe_open(str(full[0]), framework="pt") as f, safe_open(str(compact[0]), framework="pt") as c:
        ref = f.get_tensor("aux_hidden_states").float()
        deq = dequantize_aux(c.get_tensor("aux_hidden_states"), c.get_tensor("aux_scales"))
    return float(((deq - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=REPO / "results", help="the demo's results folder")
    ap.add_argument("--target", type=Path, help="the target (default: RESULTS/demo-target)")
    ap.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml", help="drafter settings from here")
    ap.add_argument("--work", type=Path, default=Path("/tmp/aerie-hidden-storage"))
    ap.add_argument("--datasets", nargs="*", help="only these datasets' shards (default: all)")
    ap.add_argument("--target-topk", type=int, default=32)
    ap.add_argument(
        "--eval-fraction",
        type=float,
        default=0.1,
        help="held-out share (more than the demo's 5%%: a steadier comparison)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    target = args.target or args.results / "demo-target"
    vocab = args.results / "vocab" / "draft_vocab.safetensors"
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    report: dict = {"results": str(args.results), "target": str(target), "target_topk": args.target_topk}

    tokens = tokens_shards(args.results, work, args.datasets)
    report["tokens_shards"] = {name: str(t) for name, t in tokens.items()}
    started = time.perf_counter()
    hidden: dict[str, list[Path]] = {}
    for layout in ("full", "compact"):
        t0 = time.perf_counter()
        hidden[layout] = []
        n_tokens = n_bytes = 0
        for name, tok in tokens.items():
            out = work / layout / name
            s = capture_shard(
                tok,
                out,
                str(target),
                CaptureSettings(
                    aux_layer_ids=None,
                    layout=layout,
                    target_topk=args.target_topk,
                    storage_dtype="bfloat16",
                    threads=args.threads,
                    min_next_token_agreement=0.995,
                ),
                log=lambda _: None,
            )
            hidden[layout].append(out)
            n_tokens += s["tokens"]
            n_bytes += out.stat().st_size
            if layout == "compact":
                report.setdefault("target_topk_mass", []).append(s["target_topk_mass"])
            report.setdefault("next_token_agreement", {})[name] = s["next_token_agreement"]
        H = open_hidden_shards(hidden[layout][:1])[0].hidden_size
        report[layout] = {
            "tokens": n_tokens,
            "bytes": n_bytes,
            "bytes_per_token": n_bytes / n_tokens,
            "ratio_to_specforge_8H": n_bytes / n_tokens / specforge_bytes_per_token(H),
            "capture_s": round(time.perf_counter() - t0, 1),
        }
        print(
            f"{layout:8s} {n_tokens:,} tokens, {n_bytes / n_tokens:,.1f} bytes/token = "
            f"{report[layout]['ratio_to_specforge_8H']:.3f} x SpecForge's 8H ({specforge_bytes_per_token(H):,})",
            flush=True,
        )
    report["aux_relative_error_fp8_vs_bf16"] = aux_error(hidden["full"], hidden["compact"])

    drafter_cfg = yaml.safe_load(args.config.read_text()).get("drafter") or {}
    cfg = TrainConfig.of(**{**drafter_cfg, "eval_fraction": args.eval_fraction, "threads": args.threads})
    report["train_config"] = {k: v for k, v in vars(cfg).items()}
    for layout in ("full", "compact"):
        t0 = time.perf_counter()
        out = work / f"drafter-{layout}"
        result = train_drafter(
            hidden[layout],
            vocab,
            target,
            out,
            TrainConfig.of(**{**vars(cfg), "resume": False}),
            log=lambda m, layout=layout: print(f"  [{layout}] {m}", flush=True),
        )
        report[layout].update(
            simulated_acceptance_length=result["simulated_acceptance_length"],
            acceptance_per_position=result["acceptance_per_position"],
            untrained_acceptance_length=result["untrained"]["simulated_acceptance_length"],
            heldout_start_positions=result["heldout_start_positions"],
            train_s=round(time.perf_counter() - t0, 1),
        )
        # both drafters on the same held-out data as inference serves it: the full shards' bf16 states
        report[layout]["acceptance_on_full_states"] = heldout_eval(out, hidden["full"], vocab, target, cfg)[
            "simulated_acceptance_length"
        ]
    full, compact = report["full"], report["compact"]
    report["relative_difference"] = compact["simulated_acceptance_length"] / full["simulated_acceptance_length"] - 1
    report["relative_difference_on_full_states"] = (
        compact["acceptance_on_full_states"] / full["acceptance_on_full_states"] - 1
    )
    report["wall_s"] = round(time.perf_counter() - started, 1)
    (work / "hidden_storage.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{'layout':8s} {'bytes/token':>12s} {'x 8H':>6s} {'acceptance (eval.json)':>23s} {'on full states':>15s}")
    for layout in ("full", "compact"):
        r = report[layout]
        print(
            f"{layout:8s} {r['bytes_per_token']:12,.1f} {r['ratio_to_specforge_8H']:6.3f} "
            f"{r['simulated_acceptance_length']:23.4f} {r['acceptance_on_full_states']:15.4f}"
        )
    print(
        f"compact vs full: {report['relative_difference']:+.2%} (eval.json), "
        f"{report['relative_difference_on_full_states']:+.2%} (on full states); goal within 2%; "
        f"fp8 aux error {report['aux_relative_error_fp8_vs_bf16']:.2%}; "
        f"top-{args.target_topk} mass {sum(report['target_topk_mass']) / len(report['target_topk_mass']):.3f}"
    )
    print(f"{report['wall_s']:.0f} s; written {work / 'hidden_storage.json'}")


if __name__ == "__main__":
    main()
