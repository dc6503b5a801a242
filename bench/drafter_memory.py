"""Peak memory of one drafter training step per window at Kimi K2.5's drafter dims, old vs new TTT path, and the
shipped Kimi config's estimate per H200.

Usage (from the repository root):
    nice -n 10 .venv/bin/python bench/drafter_memory.py run --points all     # then --points long (T = 32768)
    .venv/bin/python bench/drafter_memory.py table                           # the bench/RESULTS.md section

``run`` measures every point in its own subprocess, one after another (``point`` is what each runs), and keeps the
rows in bench/results/drafter_memory.json (committed); ``table`` prints the RESULTS section made from that file:
the rows beside ``aerie.drafter_kinds.eagle3.memory``'s estimate, least-squares fits of the window bytes against T (and
T^2),
the H200 budget of the shipped config, and the CPU tokens/s.

A point: a drafter built by ``DrafterConfig.from_target`` on Kimi K2.5's text config (hidden 7168, 64 heads, MLA
q_lora 1536 / kv_lora 512 / nope 128 / rope 64 / v 128, intermediate 18432; ``mla`` or ``llama`` kind), draft vocab
32000, aux layers [1, 29, 57], ttt_steps 7, random weights; one window of T rows (batch 1) of random features with
compact top-32 targets (the Kimi config's layout), 70 % of tokens generated; one forward, backward and gradient
clip exactly as the trainer runs them (``ttt.ttt_forward`` for ``new``; ``tests/ttt_reference.naive_forward``, the
code aerie trained with before issue 22, for ``old``). The embedding table is built at 32000 rows instead of
Kimi's 163840: it is frozen and only looked up, so its size changes no activation (the H200 budget counts its
4.7 GB). AdamW's step is not run: its state (2 x 4 bytes per parameter) is counted, not measured.

Method. Peak tensor bytes from torch's own allocation stream (``TensorBytes``: a dispatch mode that sees every
op's output storage, backward's included, with a weak reference per storage that notes its release). "window
bytes" = that peak minus the parameters: gradients, activations, transients, and under bf16 autocast its bf16
weight copies. Three executions of the same code: ``cpu`` computes (fp32, what the CPU trainer runs; a process
passes ~10 GiB beyond T = 128 at these dims, so only there), with the process's peak RSS growth as a cross-check
(VmHWM reset through /proc/self/clear_refs; glibc maps every block over 64 KiB on its own so freed memory leaves
the RSS) and tokens/s (T / seconds of the step on a shared 2-core CPU: noisy, the load is recorded); ``meta``
runs on meta tensors (shapes and lifetimes without data: any T, no memory, fp32 flow); ``fake`` on fake CPU
tensors, which CPU bf16 autocast treats as CPU tensors: the GPU trainer's dtype flow (bf16 autocast, fp32 master
weights). tests/test_drafter_memory.py shows the tracker's peak to be the same on meta and real CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's aerie, installed or not
sys.path.insert(0, str(REPO / "tests"))  # the reference (old) TTT path lives with the tests

from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.drafter_kinds.eagle3.memory import estimate_training_memory  # noqa: E402
from aerie.drafter_kinds.kind import GIB  # noqa: E402

RESULTS = REPO / "bench" / "results" / "drafter_memory.json"
FORMAT = "aerie.bench.drafter-memory/1"
KIMI_TEXT = dict(  # moonshotai/Kimi-K2.5 config.json text_config (the fields the drafter reads)
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
    rope_scaling={
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
KIMI_AUX = [1, 29, 57]
DRAFT_VOCAB = 32000
TTT_STEPS = 7
TOPK = 32
BENCH_EMBED_ROWS = 32000  # the frozen embedding table's rows in the bench (Kimi: 163840; counted, not measured)
# Points: (kind, implementation, dtype flow, execution, T). "cpu" points run the arithmetic (fp32, the CPU trainer)
# and stop where a process would pass ~10 GiB: parameters and their gradients alone are 8.1 GB for the mla kind.
# "meta" points run the same code on meta tensors (shapes and lifetimes, no data: any T, no memory), fp32 flow;
# "fake" points on fake CPU tensors, which autocast treats as CPU tensors: the GPU trainer's bf16 flow.
KINDS = ("mla", "llama")
FLOWS = (("fp32", "meta"), ("bf16", "fake"))
POINTS = {
    "cpu": [(kind, impl, "fp32", "cpu", 128) for impl in ("new", "old") for kind in KINDS],
    "meta": [(kind, "new", "fp32", "meta", T) for kind in KINDS for T in (256, 512, 1024, 2048, 4096, 8192)]
    + [(kind, "old", "fp32", "meta", T) for kind in KINDS for T in (256, 512, 1024, 2048, 4096)],
    "fake": [(kind, "new", "bf16", "fake", T) for kind in KINDS for T in (256, 512, 1024, 2048, 4096)]
    + [(kind, "old", "bf16", "fake", T) for kind in KINDS for T in (256, 512)],
    # the shipped window itself (a batch of 32,768 tokens), both dtype flows
    "long": [(kind, "new", dtype, execution, 32768) for kind in KINDS for dtype, execution in FLOWS],
}
POINTS["all"] = POINTS["cpu"] + POINTS["meta"] + POINTS["fake"]
POINTS["new"] = [p for p in POINTS["all"] + POINTS["long"] if p[1] == "new"]  # after a change of the new path
KEY = ("kind", "impl", "dtype", "execution", "T")


def build_drafter(kind: str, text: dict, seed: int = 0):
    import torch

    from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter

    torch.manual_seed(seed)
    tc = SimpleNamespace(**{**text, "vocab_size": max(BENCH_EMBED_ROWS, DRAFT_VOCAB)})
    cfg = DrafterConfig.from_target(tc, DRAFT_VOCAB, KIMI_AUX, attention=kind)
    return Eagle3Drafter(cfg)


def random_batch(model, B: int, T: int, steps: int, seed: int = 1):
    """One batch as data.load_batch makes it, compact layout (fp32 aux, top-k targets), and its TargetHead."""
    import torch

    from aerie.drafter_kinds.batch import Batch
    from aerie.drafter_kinds.eagle3.ttt import TargetHead

    g = torch.Generator().manual_seed(seed)
    c = model.cfg
    W = T + steps + 2
    draft_ids = torch.randint(0, c.draft_vocab_size, (B, W, TOPK), generator=g)  # in-vocab top-k entries
    b = Batch(
        aux=torch.randn(B, T, c.num_aux_layers * c.hidden_size, generator=g),
        position_ids=torch.arange(T).expand(B, T).contiguous(),
        row_valid=torch.ones(B, T, dtype=torch.bool),
        ids=torch.randint(0, c.vocab_size, (B, W), generator=g),
        have=torch.ones(B, W, dtype=torch.bool),
        gen=torch.rand(B, W, generator=g) < 0.7,
        final=None,
        rows=B * T,
        topk_ids=draft_ids,  # the default vocab maps: draft id i is target id i
        topk_logprobs=torch.sort(torch.randn(B, W, TOPK, generator=g), -1, descending=True).values.log_softmax(-1),
    )
    return b, TargetHead(full=None, draft=None, t2d=model.t2d, draft_vocab_size=c.draft_vocab_size)


def train_step(model, b, head, cfg: TrainConfig, impl: str, bf16: bool, opt=None) -> float:
    """One batch as loop.train_drafter runs it: forward, gradients cleared, backward, clip, and the AdamW step
    when ``opt`` is given; returns the loss."""
    import torch

    from aerie.drafter_kinds.eagle3.ttt import ttt_forward

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    if impl == "old":
        from ttt_reference import naive_forward

        with ctx:
            loss, _, _ = naive_forward(model, b, head, cfg, cfg.ttt_steps)
    else:
        targets = head.prepare(b, cfg.mask_out_of_vocab_targets)
        with ctx:
            loss, _, _ = ttt_forward(model, b, targets, cfg.ttt_steps, cfg.step_loss_decay)
    model.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if opt is not None:
        opt.step()
    from torch._subclasses.fake_tensor import is_fake

    return None if loss.is_meta or is_fake(loss) else float(loss.detach())


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class TensorBytes:
    """Live bytes of the tensor storages torch allocates while active (a dispatch mode sees every op's outputs,
    backward's included; a weak reference per storage notes when it is freed), and their peak. ``track`` adds
    tensors that existed before (the parameters)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.live: dict[int, tuple[object, int]] = {}
        self.current = self.peak = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                import torch
                from torch.utils._pytree import tree_map_only

                tree_map_only(torch.Tensor, tracker.track, out)
                return out

        self.mode = Mode()

    def track(self, t) -> None:
        import weakref

        st = t.untyped_storage()
        key = id(st)
        if key in self.live or st.nbytes() == 0:
            return
        size = st.nbytes()

        def freed(_ref, key=key, size=size) -> None:
            self.live.pop(key, None)
            self.current -= size

        self.live[key] = (weakref.ref(st, freed), size)
        self.current += size
        self.peak = max(self.peak, self.current)

    def __enter__(self) -> TensorBytes:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


def measure(model, b, head, cfg: TrainConfig, impl: str, bf16: bool, steps: int = 1, opt=None) -> dict:
    """Peak tensor bytes (parameters included) and peak RSS growth over ``steps`` training steps."""
    tracker = TensorBytes()
    for p in model.parameters():
        tracker.track(p)
    rss_before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    with tracker:
        for _ in range(steps):
            loss = train_step(model, b, head, cfg, impl, bf16, opt)
    seconds = (time.perf_counter() - t0) / steps
    return {
        "peak_tensor_bytes": tracker.peak,
        "peak_rss_growth_bytes": (_rss_kib("VmHWM") - rss_before) * 1024,
        "seconds": seconds,
        "loss": loss,
    }


def point(spec: dict) -> dict:
    """One measurement (run in a fresh process by ``run``)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.set_num_threads(spec["threads"])
    execution = spec["execution"]
    if execution == "meta":
        where = torch.device("meta")
    elif execution == "fake":
        where = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        where = contextlib.nullcontext()
    cfg = TrainConfig.of(ttt_steps=TTT_STEPS, attention=spec["kind"])
    with where:
        model = build_drafter(spec["kind"], KIMI_TEXT)
        b, head = random_batch(model, 1, spec["T"], TTT_STEPS)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        m = measure(model, b, head, cfg, spec["impl"], spec["dtype"] == "bf16")
    row = {
        **spec,
        **m,
        "parameter_bytes": params,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "window_bytes": m["peak_tensor_bytes"] - params,
        "load_avg_1m": os.getloadavg()[0],
        "torch": torch.__version__,
    }
    if execution == "cpu":
        row["tokens_per_s"] = spec["T"] / m["seconds"]
    else:  # nothing was computed: neither the RSS nor the time say anything
        del row["peak_rss_growth_bytes"], row["loss"]
    return row


def run(which: str, threads: int) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "OMP_NUM_THREADS": str(threads)}
    done = json.loads(RESULTS.read_text())["points"] if RESULTS.exists() else []
    for values in POINTS[which]:
        spec = {**dict(zip(KEY, values)), "threads": threads}
        cmd = [sys.executable, __file__, "point", json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"{spec}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        done = [p for p in done if tuple(p[k] for k in KEY) != tuple(values)] + [row]
        print(json.dumps({k: row.get(k) for k in (*KEY, "window_bytes", "tokens_per_s", "seconds")}), flush=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "command": "nice -n 10 .venv/bin/python bench/drafter_memory.py run --points all",
                    "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
                    "points": sorted(done, key=lambda p: tuple(p[k] for k in KEY)),
                },
                indent=1,
            )
            + "\n"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--points", choices=sorted(POINTS), default="all")
    r.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("point")
    p.add_argument("spec")
    sub.add_parser("table")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.points, args.threads)
    elif args.cmd == "point":
        print(json.dumps(point(json.loads(args.spec))))
    else:
        print(table())


H200_BYTES = 141 * 10**9  # HBM3e of one H200 (141 GB = 131.3 GiB)
LINEAR_FROM = 4096  # the fits' linear regime: from here on the attention backward is the peak (both kinds)
GB = 10**9


def window_estimate(kind: str, T: int, bf16: bool) -> int:
    """aerie.drafter_kinds.eagle3.memory's figure for what a point measures: gradients, activations
    (and bf16 copies)."""
    est = estimate_training_memory(
        TrainConfig.of(ttt_steps=TTT_STEPS, attention=kind, max_seq_len=T, batch_size=1),
        KIMI_TEXT,
        DRAFT_VOCAB,
        1 if bf16 else 0,
        hidden_layout="compact",
        target_topk=TOPK,
    )
    return sum(est.parts[k] for k in ("gradients", "activations", "bf16 weight copies") if k in est.parts)


def fit(points: list[dict], quadratic: bool) -> dict:
    """Least squares window_bytes = a + b T (+ c T^2) and the largest relative residual."""
    import numpy as np

    T = np.array([p["T"] for p in points], dtype=float)
    y = np.array([p["window_bytes"] for p in points], dtype=float)
    X = np.stack([np.ones_like(T), T] + ([T**2] if quadratic else []), axis=1)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    worst = float(np.max(np.abs(X @ coef - y) / y))
    return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]) if quadratic else 0.0, "worst": worst}


def shipped_drafter_config() -> dict:
    """The shipped Kimi drafter's batch settings (each kind's row keeps aerie's default shape of that kind: the warm
    start's published-drafter shape and init are not what this table compares)."""
    import yaml

    from aerie.plan.drafters import drafter_sections

    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    drafter = drafter_sections(config)[("drafters", "eagle3")]  # the shipped EAGLE-3 drafter's merged section
    return {
        k: drafter[k] for k in ("ttt_steps", "epochs", "learning_rate", "max_seq_len", "batch_size", "max_batch_tokens")
    }


def table() -> str:
    data = json.loads(RESULTS.read_text())
    points = data["points"]
    out = [
        "## Drafter training memory at Kimi K2.5's size (issue 22 item 1): linear in the window, the shipped Kimi "
        "settings at about half an H200",
        "",
        "`nice -n 10 .venv/bin/python bench/drafter_memory.py run --points all` (then `--points long`), table by",
        "`.venv/bin/python bench/drafter_memory.py table`; raw rows: `bench/results/drafter_memory.json`. One",
        "training step (forward, backward, clip; no AdamW step) of one window of T rows at Kimi K2.5's drafter dims",
        "(hidden 7168, 64 heads, MLA 1536/512/128/64/128, intermediate 18432, draft vocab 32000, 7 TTT steps, top-32",
        "compact targets), `old` = the code before issue 22 (tests/ttt_reference.py), `new` = now. **window** = peak",
        "live tensor bytes minus parameters (gradients, activations, transients; bf16 weight copies under autocast),",
        "tracked per storage through torch's dispatcher; `cpu` rows computed in fp32 (peak RSS growth beside them),",
        "`meta` rows ran the same code on meta tensors (fp32 flow, no data), `fake` rows on fake CPU tensors under",
        "bf16 autocast (the GPU trainer's dtypes). The script's docstring has the details.",
        "",
        "What changed (aerie/drafter_kinds/eagle3/layers.py, ttt.py): the TTT attention runs in chunks of 64 "
        "query rows with the",
        "exact softmax over each row's keys and recomputes them in backward (`TTTAttention`: no [T, T] tensor is",
        "kept); each TTT step is checkpointed; the vocabulary loss takes 256 rows of logits at a time and builds its",
        "soft targets per chunk. Why not flex attention: torch 2.13's has no CPU backward (\"FlexAttention does not",
        'support backward on CPU") and its eager path materialises the full score matrix, so CI could not train with',
        "it; this kernel runs the same on CPU and CUDA with plain matmuls. Not measured on a GPU (none was lent): its",
        "softmax passes read and write fp32 score blocks (h x T^2 / 2 elements per step), which a fused kernel would",
        "not; at the Kimi data's ~3.5k-token answers that is a small share of a step.",
        "",
        "| kind | path | dtypes | run on | T | window GB | estimate GB (memory.py) | estimate / measured "
        "| peak RSS growth GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        est = window_estimate(p["kind"], p["T"], p["dtype"] == "bf16") if p["impl"] == "new" else None
        rss = p.get("peak_rss_growth_bytes")
        ratio = "" if est is None else f"{est / p['window_bytes']:.2f}"
        out.append(
            f"| {p['kind']} | {p['impl']} | {p['dtype']} | {p['execution']} | {p['T']:,} | "
            f"{p['window_bytes'] / GB:.2f} | {'' if est is None else f'{est / GB:.2f}'} | {ratio} | "
            f"{'' if rss is None else f'{rss / GB:.2f}'} |"
        )
    out += [
        "",
        "Growth per series: the window bytes added per token between consecutive points (`slopes`, KB/token), and",
        "least-squares fits (`worst` = largest relative residual): a + b T + c T^2 over all points, and a + b T over",
        f"the points from T = {LINEAR_FROM:,} on. The new path has no T^2 term: its peak is the largest of a few",
        "moments of backward, each linear in T (the loss chunk's, constant, for short windows; the attention's",
        "backward from a few thousand rows on), so its slope settles, and the fit from there has no residual to",
        "speak of. The old path's c is the ~2.7 KB per T^2 (fp32) issue 22 measured.",
        "",
        "| kind | path | dtypes | points (T) | slopes KB/token | all points: a GB, b KB/token, c bytes/token^2 "
        f"| from T = {LINEAR_FROM:,}: a GB, b KB/token, worst |",
        "|---|---|---|---|---|---|---|",
    ]
    series: dict[tuple, list[dict]] = {}
    for p in points:
        series.setdefault((p["kind"], p["impl"], p["dtype"]), []).append(p)
    fits = {}
    for key, pts in sorted(series.items()):
        if len(pts) < 3:
            continue
        pts = sorted(pts, key=lambda p: p["T"])
        slopes = [(b["window_bytes"] - a["window_bytes"]) / (b["T"] - a["T"]) / 1e3 for a, b in zip(pts, pts[1:])]
        q = fit(pts, True)
        tail = [p for p in pts if p["T"] >= LINEAR_FROM]
        lin = fit(tail, False) if len(tail) >= 2 else None
        if lin:
            fits[key] = lin
        tail_cell = f"{lin['a'] / GB:.2f}, {lin['b'] / 1e3:.1f}, {lin['worst']:.1%}" if lin else ""
        out.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {', '.join(str(p['T']) for p in pts)} | "
            f"{', '.join(f'{s:.0f}' for s in slopes)} | {q['a'] / GB:.2f}, {q['b'] / 1e3:.1f}, {q['c']:.1f} | "
            f"{tail_cell} |"
        )
    shipped = shipped_drafter_config()
    out += [
        "",
        f"The shipped `config/kimi-k2.5.yaml` drafter settings (`max_seq_len: {shipped['max_seq_len']}`, "
        f"`batch_size: {shipped['batch_size']}`, `max_batch_tokens: {shipped['max_batch_tokens']}`) on one H200 per",
        "training process (torchrun + DDP: every GPU holds a whole replica, fp32 master weights, gradients and AdamW",
        "state, and trains its own batch; gradients live in DDP's buckets), bf16 autocast, compact hidden shards",
        "(no target lm_head on the GPU), Kimi's 163,840-row frozen embeddings. `estimate`: "
        "aerie.drafter_kinds.eagle3.memory, what",
        "the fit plan uses. `measured`: the same static parts plus the window measured at the shipped batch (bf16,",
        "`fake` rows at T = 32,768; else the linear fit of the bf16 rows extrapolated to it).",
        "",
        "| kind | parameters + frozen embeddings + AdamW + batch GiB | window GiB (estimate / measured) "
        "| total GiB (estimate / measured) | larger of the two, of 131.3 GiB (141e9 bytes) | margin |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        train = TrainConfig.of(**{**shipped, "attention": kind})
        est = estimate_training_memory(train, KIMI_TEXT, DRAFT_VOCAB, 8, hidden_layout="compact", target_topk=TOPK)
        window_parts = ("gradients", "activations", "bf16 weight copies")
        static = sum(v for k, v in est.parts.items() if k not in window_parts)
        window = est.total - static
        lin = fits.get((kind, "new", "bf16"))
        direct = [p for p in series.get((kind, "new", "bf16"), []) if p["T"] == train.largest_batch_tokens]
        if direct:  # measured at the shipped batch itself
            measured = direct[0]["window_bytes"]
        else:
            measured = lin["a"] + lin["b"] * train.largest_batch_tokens if lin else None
        cell = f"{window / GIB:.1f} / {measured / GIB:.1f}" if measured else f"{window / GIB:.1f} / -"
        total = f"{est.total / GIB:.1f} / {(static + measured) / GIB:.1f}" if measured else f"{est.total / GIB:.1f}"
        worst = max(est.total, static + (measured or 0))
        out.append(
            f"| {kind} | {static / GIB:.1f} | {cell} | {total} | {worst / H200_BYTES:.0%} | "
            f"{(H200_BYTES - worst) / GIB:.1f} GiB |"
        )
    cpu = [p for p in points if p["execution"] == "cpu"]
    if cpu:
        out += [
            "",
            "CPU tokens/s of those steps (T rows / seconds of forward + backward + clip, 1 thread, fp32, random",
            "weights; a shared 2-core machine, so noisy: the 1-minute load average is beside each). The new path",
            "recomputes each TTT step in backward (activation checkpointing): about one more forward.",
            "",
            "| kind | path | T | tokens/s | seconds | load |",
            "|---|---|---|---|---|---|",
        ]
        for p in cpu:
            out.append(
                f"| {p['kind']} | {p['impl']} | {p['T']} | {p['tokens_per_s']:.2f} | {p['seconds']:.0f} | "
                f"{p['load_avg_1m']:.1f} |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    main()
