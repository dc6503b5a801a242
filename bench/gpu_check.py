"""The drafter trainer on a GPU, measured in one go (issue 29 item 6, issue 36 item 8): per drafter kind and window T,
one training step (forward, backward, clip) on the CPU path and on the CUDA path - EAGLE-3 (llama, mla): the chunked
TTT attention kernel vs compiled flex attention + log-sum-exp merge; DFlash (dflash): the dense reference block mask
vs a compiled flex BlockMask - step time, peak memory, and their numeric agreement (loss and every gradient); then the
loader's tokens/s (packed batches of a compact hidden shard, read, pinned, copied and dequantised on the device, with
the next one prefetched).

    python bench/gpu_check.py --out bench/results/gpu_check.json            # on the GPU host (H200: ~6-10 min)
    python bench/gpu_check.py --toy --out /tmp/gpu_check.json              # CPU, tiny dims (tests/test_gpu_check.py)
    python bench/gpu_check.py --table bench/results/gpu_check.json          # the RESULTS table from a JSON

Dims: Kimi K2.5's drafters (bench/drafter_memory.py: hidden 7168, 64 heads, MLA 1536/512/128/64/128, llama kind
64 x 128 heads over 8 kv heads, draft vocab 32000, 7 TTT steps, top-32 compact targets; DFlash as z-lab's K2.5
drafter: 6 layers, 64 x 128 heads over 8 kv heads, MLP 18432, block 8, 512 anchors, 6 target layers, the full
163,840-row lm_head), bf16 autocast as the trainer runs on CUDA; ``--toy``: the same code at hidden 64 in fp32 on the
CPU (the flex path then runs forward
only, eagerly: torch 2.13 has no CPU backward for it, so the toy compares outputs and skips its gradients).
Each step is timed after a warm-up step (the compile), median of ``--repeats``; a kernel that fails (out of memory,
a compile error) is recorded with its error and the run goes on. bench/tables.py renders the JSON
(``table``); aerie.preview.timing reads its step times as the training throughput of that GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
FORMAT = "aerie.bench.gpu-check/1"
LENGTHS = (4096, 8192, 16384, 32768)
TOY_LENGTHS = (64, 96)
TOY_TEXT = dict(vocab_size=600, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip
TOY_LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def build(kind: str, toy: bool, device):
    import drafter_memory
    import torch

    from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter

    torch.manual_seed(0)
    text = TOY_TEXT if toy else {**drafter_memory.KIMI_TEXT, "vocab_size": drafter_memory.BENCH_EMBED_ROWS}
    vocab = 200 if toy else drafter_memory.DRAFT_VOCAB
    shape = TOY_LLAMA if toy and kind == "llama" else {}
    cfg = DrafterConfig.from_target(SimpleNamespace(**text), vocab, [1, 2, 3], attention=kind, **shape)
    return Eagle3Drafter(cfg).to(device)


def to_device(b, device):
    from dataclasses import fields, replace

    import torch

    moved = {f.name: getattr(b, f.name).to(device) for f in fields(b) if isinstance(getattr(b, f.name), torch.Tensor)}
    return replace(b, **moved)


def one_step(model, b, head, cfg, kernel: str, device, want_grads: bool):
    """(loss, gradients or None, seconds, peak bytes) of one forward + backward + clip."""
    import torch

    from aerie.drafter_kinds.eagle3.ttt import autocast, ttt_forward

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    grad = want_grads and (cuda or kernel == "chunked")  # flex has no CPU backward
    with torch.set_grad_enabled(grad), autocast(device):
        loss, _, _ = ttt_forward(
            model, b, head.prepare(b, cfg.mask_out_of_vocab_targets), cfg.ttt_steps, cfg.step_loss_decay, kernel=kernel
        )
    if grad:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    grads = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None] if grad else None
    return float(loss.detach()), grads, seconds, peak


def check_point(kind: str, T: int, toy: bool, repeats: int, device) -> dict:
    """Both kernels at one (kind, T): times, peaks, and flex against chunked."""
    import drafter_memory
    import torch

    from aerie.drafter.config import TrainConfig

    model = build(kind, toy, device)
    cfg = TrainConfig.of(ttt_steps=drafter_memory.TTT_STEPS if not toy else 3, max_seq_len=T, batch_size=1)
    b, head = drafter_memory.random_batch(model, 1, T, cfg.ttt_steps)
    b = to_device(b, device)
    head.t2d = head.t2d.to(device)
    row: dict = {"kind": kind, "T": T, "kernels": {}}
    results = {}
    for kernel in ("chunked", "flex"):
        try:
            loss, grads, _, _ = one_step(model, b, head, cfg, kernel, device, want_grads=True)  # warm-up / compile
            times, peaks = [], []
            for _ in range(repeats):
                _, _, seconds, peak = one_step(model, b, head, cfg, kernel, device, want_grads=False)
                times.append(seconds)
                peaks.append(peak)
            _, _, train_seconds, train_peak = one_step(model, b, head, cfg, kernel, device, want_grads=True)
            row["kernels"][kernel] = {
                "forward_seconds": statistics.median(times),
                "step_seconds": train_seconds,  # forward + backward + clip (flex on the CPU: forward only)
                "peak_bytes": train_peak,
                "tokens_per_s": T / train_seconds,
                "loss": loss,
            }
            results[kernel] = (loss, grads)
        except Exception as e:  # out of memory, a compile failure: recorded, the run goes on
            row["kernels"][kernel] = {
                "error": f"{type(e).__name__}: {e}"[:500],
                "trace": traceback.format_exc()[-1500:],
            }
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(results) == 2:
        row["agreement"] = _agreement(results, "chunked", "flex")
    return row


DFLASH_KERNELS = ("reference", "flex")


def build_dflash(toy: bool, device):
    """(DFlash drafter, its target's embedding and lm_head [V, H] in the compute dtype) at Kimi's or toy dims."""
    import drafter_memory
    import torch

    from aerie.drafter_kinds.dflash.model import DFlashDrafter
    from aerie.drafter_kinds.dflash.shape import DFlashShape

    torch.manual_seed(0)
    text = (
        {**TOY_TEXT, "num_hidden_layers": 8, "head_dim": 16}
        if toy
        else {**drafter_memory.KIMI_TEXT, "num_hidden_layers": 61}
    )
    shape = DFlashShape.from_target(
        text, num_layers=2 if toy else 6, block_size=4 if toy else 8, mask_token_id=int(text["vocab_size"]) - 1
    )
    dtype = torch.float32 if toy else torch.bfloat16
    V, H = int(text["vocab_size"]), int(text["hidden_size"])
    heads = [(torch.randn(V, H, device=device) * 0.02).to(dtype) for _ in range(2)]
    return DFlashDrafter(shape).to(device), heads[0], heads[1]


def dflash_step(model, batch, embed, lm_head, kernel: str, device, want_grads: bool, anchors: int):
    """(loss, gradients or None, seconds, peak bytes) of one DFlash forward + backward + clip."""
    import torch

    from aerie.drafter.loop import autocast
    from aerie.drafter_kinds.dflash.objective import dflash_loss

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    grad = want_grads and (cuda or kernel == "reference")  # flex has no CPU backward
    with torch.set_grad_enabled(grad), autocast(device):
        out = dflash_loss(
            model, batch, embed_weight=embed, lm_head_weight=lm_head, num_anchors=anchors,
            generator=torch.Generator().manual_seed(0), kernel=kernel,
        )  # fmt: skip
    if grad:
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    grads = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None] if grad else None
    return float(out.loss.detach()), grads, seconds, peak


def check_dflash_point(T: int, toy: bool, repeats: int, device) -> dict:
    """Both DFlash mask paths at one window T (one sequence, its last three quarters generated): times, peaks,
    and flex against the reference."""
    import torch

    from aerie.drafter_kinds.dflash.objective import DFlashBatch

    model, embed, lm_head = build_dflash(toy, device)
    g = torch.Generator().manual_seed(1)
    K, H = model.shape.num_context_features, model.shape.hidden_size
    loss_mask = torch.zeros(1, T)
    loss_mask[:, T // 4 :] = 1
    batch = DFlashBatch(
        input_ids=torch.randint(0, embed.shape[0] - 1, (1, T), generator=g).to(device),
        loss_mask=loss_mask.to(device),
        target_features=torch.randn(1, T, K * H, generator=g).to(device, embed.dtype),
    )
    anchors = 32 if toy else 512
    row: dict = {"kind": "dflash", "T": T, "kernels": {}}
    results = {}
    for kernel in DFLASH_KERNELS:
        try:
            loss, grads, _, _ = dflash_step(model, batch, embed, lm_head, kernel, device, True, anchors)  # warm-up
            times = [
                dflash_step(model, batch, embed, lm_head, kernel, device, False, anchors)[2] for _ in range(repeats)
            ]
            _, _, train_seconds, train_peak = dflash_step(model, batch, embed, lm_head, kernel, device, True, anchors)
            row["kernels"][kernel] = {
                "forward_seconds": statistics.median(times),
                "step_seconds": train_seconds,
                "peak_bytes": train_peak,
                "tokens_per_s": T / train_seconds,
                "loss": loss,
            }
            results[kernel] = (loss, grads)
        except Exception as e:  # out of memory, a compile failure: recorded, the run goes on
            row["kernels"][kernel] = {
                "error": f"{type(e).__name__}: {e}"[:500],
                "trace": traceback.format_exc()[-1500:],
            }
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["agreement"] = _agreement(results, *DFLASH_KERNELS)
    return row


def _agreement(results: dict, cpu_path: str, cuda_path: str) -> dict:
    """The CUDA path against the CPU path: relative loss, largest and median relative gradient error."""
    if len(results) != 2:
        return {}
    (l0, g0), (l1, g1) = results[cpu_path], results[cuda_path]
    agreement = {"loss_rel": abs(l1 - l0) / max(abs(l0), 1e-12)}
    if g0 is not None and g1 is not None:
        errs = [float((b_ - a).norm() / a.norm().clamp_min(1e-30)) for a, b_ in zip(g0, g1)]
        agreement["grad_rel_max"] = max(errs)
        agreement["grad_rel_median"] = statistics.median(errs)
    return agreement


def loader_check(toy: bool, device, batches: int = 8) -> dict:
    """Tokens/s of packed batches from a compact hidden shard at the drafter's dims (fp8 aux + scales, top-k)."""
    import drafter_memory
    import torch

    from aerie.drafter.config import TrainConfig
    from aerie.drafter.data import epoch_batches, load_batch, plan_windows, prefetched
    from aerie.formats.hidden import HiddenShard, quantize_aux, write_hidden_shard

    H = TOY_TEXT["hidden_size"] if toy else drafter_memory.KIMI_TEXT["hidden_size"]
    T = 512 if toy else 32768
    seqs = 4 * batches
    length = T // 4  # four sequences a row
    n = seqs * length
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.safetensors"
        aux, scales = quantize_aux(torch.randn(n, 3 * H, generator=g, dtype=torch.bfloat16), 3)
        k = drafter_memory.TOPK
        tensors = {
            "input_ids": torch.randint(0, 1000, (n,), generator=g),
            "loss_mask": torch.ones(n, dtype=torch.bool),
            "seq_offsets": torch.arange(0, n + 1, length),
            "aux_hidden_states": aux,
            "aux_scales": scales,
            "target_topk_ids": torch.randint(0, 1000, (n, k), generator=g, dtype=torch.int32),
            "target_topk_logprobs": torch.randn(n, k, generator=g).to(torch.bfloat16),
        }
        meta = {"layout": "compact", "aux_layer_ids": [1, 2, 3], "hidden_size": H, "vocab_size": 1000,
                "target_topk": k, "num_hidden_layers": 4}  # fmt: skip
        write_hidden_shard(path, tensors, meta)
        shard = HiddenShard(path)
        cfg = TrainConfig.of(max_seq_len=T, batch_size=8, max_batch_tokens=T, ttt_steps=7)
        plan = plan_windows([shard], set(), T, cfg.ttt_steps + 1)
        groups = epoch_batches(plan.train, cfg, 1)

        def load(group):
            return load_batch(group, [shard], cfg.ttt_steps + 1, device, torch.float32, cfg.max_seq_len)

        t0 = time.perf_counter()
        rows = sum(b.rows for b in (load(g) for g in groups))
        sync = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows2 = 0
        for b in prefetched(groups, load):
            rows2 += b.rows
            if device.type == "cuda":
                torch.cuda.synchronize()
        prefetch = time.perf_counter() - t0
    return {"tokens": rows, "batches": len(groups), "window": T, "hidden": H,
            "tokens_per_s": rows / sync, "tokens_per_s_prefetched": rows2 / prefetch}  # fmt: skip


def run(out: Path, toy: bool, lengths, kinds, repeats: int) -> dict:
    import torch

    device = torch.device("cpu" if toy or not torch.cuda.is_available() else "cuda")
    if toy:
        torch.set_num_threads(1)
    data = {
        "format": FORMAT,
        "toy": toy,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "points": [],
    }
    for kind in kinds:
        for T in lengths:
            point = (
                check_dflash_point(T, toy, repeats, device)
                if kind == "dflash"
                else check_point(kind, T, toy, repeats, device)
            )
            data["points"].append(point)
            print(json.dumps(data["points"][-1])[:400], flush=True)
            out.write_text(json.dumps(data, indent=1) + "\n")  # what finished survives a timeout
    data["loader"] = loader_check(toy, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(path: Path) -> str:
    data = json.loads(Path(path).read_text())
    out = [
        f"## Drafter training on {data['device']} (issue 29 item 6): chunked vs the CUDA attention path",
        "",
        f"`python bench/gpu_check.py --out {Path(path).name}` ({'toy dims, CPU' if data['toy'] else 'Kimi dims'}, "
        f"torch {data['torch']}, {data['when']}); one step = forward + backward + clip of one window of T rows. "
        "CPU path: EAGLE-3's chunked TTT kernel, DFlash's dense reference mask. Agreement: flex against the CPU path, "
        "relative (loss; largest and median gradient relative error).",
        "",
        "| kind | T | CPU path s/step | flex s/step | speedup | CPU path peak GiB | flex peak GiB | loss rel "
        "| grad rel max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gib = lambda b: f"{b / 2**30:.1f}" if b else "-"  # noqa: E731
    for p in data["points"]:
        c = p["kernels"].get("reference" if p["kind"] == "dflash" else "chunked", {})
        f = p["kernels"].get("flex", {})
        cs = f"{c['step_seconds']:.3f}" if "step_seconds" in c else c.get("error", "-")[:40]
        fs = f"{f['step_seconds']:.3f}" if "step_seconds" in f else f.get("error", "-")[:40]
        both = "step_seconds" in c and "step_seconds" in f and not data["toy"]  # toy flex: forward only
        speed = f"{c['step_seconds'] / f['step_seconds']:.1f}x" if both else "-"
        a = p.get("agreement", {})
        loss = f"{a['loss_rel']:.1e}" if "loss_rel" in a else "-"
        grad = f"{a['grad_rel_max']:.1e}" if "grad_rel_max" in a else "-"
        out.append(
            f"| {p['kind']} | {p['T']:,} | {cs} | {fs} | {speed} | {gib(c.get('peak_bytes'))} | "
            f"{gib(f.get('peak_bytes'))} | {loss} | {grad} |"
        )
    ld = data.get("loader")
    if ld:
        out += ["", f"Loader (read, pin, copy, dequantise on the device; no step running beside it): "
                f"{ld['tokens_per_s']:,.0f} tokens/s one batch after another, {ld['tokens_per_s_prefetched']:,.0f} "
                f"through the prefetching iterator ({ld['batches']} packed batches of {ld['window']:,} rows, "
                f"hidden {ld['hidden']}, fp8 aux)."]  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "gpu_check.json")
    parser.add_argument("--toy", action="store_true", help="tiny dims on the CPU (the test)")
    parser.add_argument("--lengths", type=int, nargs="*", help="windows T (default 4k/8k/16k/32k; toy 64, 96)")
    parser.add_argument("--kinds", nargs="*", default=["llama", "mla", "dflash"], help="EAGLE-3 llama/mla, DFlash")
    parser.add_argument("--repeats", type=int, default=1, help="timed forward passes after the warm-up")
    parser.add_argument("--table", type=Path, help="print the RESULTS table of this JSON and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    lengths = args.lengths or (TOY_LENGTHS if args.toy else LENGTHS)
    run(args.out, args.toy, lengths, args.kinds, args.repeats)
    print(table(args.out))


if __name__ == "__main__":
    main()
