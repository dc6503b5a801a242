"""Peak memory of one drafter training step per window, at Kimi K2.5's drafter dims, old vs new TTT path.

Usage (from the repository root):
    nice -n 10 .venv/bin/python bench/drafter_memory.py run [--points all|new|old] [--threads 1]
    .venv/bin/python bench/drafter_memory.py table      # the bench/RESULTS.md section, from the committed JSON

``run`` measures every point in its own subprocess, one after another (``point`` is what each runs), and writes
bench/results/drafter_memory.json; ``table`` prints the RESULTS section made from that file: the measured rows,
a least-squares fit of the per-window bytes against T and T^2 per (kind, implementation), and the estimate of
``aerie.drafter.memory`` for the shipped Kimi config on an H200.

A point: a drafter built by ``DrafterConfig.from_target`` on Kimi K2.5's text config (hidden 7168, 64 heads, MLA
q_lora 1536 / kv_lora 512 / nope 128 / rope 64 / v 128, intermediate 18432; ``mla`` or ``llama`` kind), draft vocab
32000, aux layers [1, 29, 57], ttt_steps 7, random weights; one window of T rows (batch 1) of random features with
compact top-32 targets (the Kimi config's layout), 70 % of tokens generated; one forward + backward + gradient
clip exactly as the trainer runs them (``ttt.ttt_forward`` for ``new``; ``tests/ttt_reference.naive_forward``, the
code aerie trained with before issue 22, for ``old``). The embedding table is built at 32000 rows instead of
Kimi's 163840: it is frozen and only looked up, so its size changes no activation (aerie.drafter.memory counts
its 4.7 GB). AdamW's step is not run: its state (2 x 4 bytes per parameter) is counted, not measured, to keep a
point under the shared machine's ~10 GiB per process.

Method: peak tensor bytes from torch's own allocation stream (``TensorBytes``: a dispatch mode that sees every
op's output storage, backward's included, and a weak reference per storage that notes its release), and as a
cross-check the process's
peak RSS (VmHWM after resetting it through /proc/self/clear_refs, glibc told to map every block over 64 KiB on
its own so freed memory leaves the RSS) minus the RSS before the step. "window bytes" = peak tensor bytes minus
the parameters (gradients included: they exist only during a step). ``fp32`` is what the CPU trainer runs;
``bf16`` runs the same code under CPU bf16 autocast, the dtype flow of the GPU trainer (autocast bf16, fp32
master weights). tokens/s: T / seconds of the step on this shared 2-core CPU (noisy: load recorded per point).
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
POINTS = {
    "cpu": [(kind, impl, "fp32", "cpu", 128) for impl in ("new", "old") for kind in KINDS],
    "meta": [(kind, "new", "fp32", "meta", T) for kind in KINDS for T in (256, 512, 1024, 2048, 4096, 8192)]
    + [(kind, "old", "fp32", "meta", T) for kind in KINDS for T in (256, 512, 1024, 2048, 4096)],
    "fake": [(kind, "new", "bf16", "fake", T) for kind in KINDS for T in (256, 512, 1024)]
    + [(kind, "old", "bf16", "fake", T) for kind in KINDS for T in (256, 512)],
    "long": [("mla", "new", "fp32", "meta", 32768)],
}
POINTS["all"] = POINTS["cpu"] + POINTS["meta"] + POINTS["fake"]
KEY = ("kind", "impl", "dtype", "execution", "T")


def build_drafter(kind: str, text: dict, seed: int = 0):
    import torch

    from aerie.drafter.model import DrafterConfig, Eagle3Drafter

    torch.manual_seed(seed)
    tc = SimpleNamespace(**{**text, "vocab_size": max(BENCH_EMBED_ROWS, DRAFT_VOCAB)})
    cfg = DrafterConfig.from_target(tc, DRAFT_VOCAB, KIMI_AUX, attention=kind)
    return Eagle3Drafter(cfg)


def random_batch(model, B: int, T: int, steps: int, seed: int = 1):
    """One batch as data.load_batch makes it, compact layout (fp32 aux, top-k targets), and its TargetHead."""
    import torch

    from aerie.drafter.data import Batch
    from aerie.drafter.ttt import TargetHead

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

    from aerie.drafter.ttt import ttt_forward

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    if impl == "old":
        from ttt_reference import naive_forward

        with ctx:
            loss, _, _ = naive_forward(model, b, head, cfg, cfg.ttt_steps)
    else:
        targets = head.prepare(b, cfg)
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
    cfg = TrainConfig(ttt_steps=TTT_STEPS, attention=spec["kind"])
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


def table() -> str:
    raise NotImplementedError  # filled in below once the points exist


if __name__ == "__main__":
    main()
