"""Target loads and wall time of the hidden stage with N shards: one load per shard (before issue 16) vs
one load per run (rule hidden now, aerie.hidden.capture_shards).

The target is the Kimi-shaped rehearsal target's architecture (KimiK25ForConditionalGeneration around a
DeepseekV3 with Kimi's 163,840-token vocabulary, loaded through its own code with trust_remote_code) at
its default size, with random weights: load and capture costs do not depend on training. Tokens shards are
random ids (the agreement check is off). Each configuration runs as the pipeline runs it, in fresh
processes: "per shard" starts one process per shard that imports, loads the target and captures its
shard (what each per-shard job did, without Snakemake's own per-job overhead); "per run" starts one
process that loads once and captures every shard. Both write bit-identical shards (checked here).

    python bench/hidden_loads.py --shards 1 2 4 8          # ~10 min on a quiet 2-core machine
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORKER = """
import json, sys, time
t0 = time.perf_counter()
from pathlib import Path
import torch
torch.set_num_threads(1)
from aerie.hidden import ShardTask, capture_shard, capture_shards
imported = time.perf_counter() - t0
args = json.loads(sys.argv[1])
logs = []
kw = dict(aux_layer_ids=None, layout="compact", batch_tokens=args["batch_tokens"], device="cpu", dtype="float32",
          trust_remote_code=True, threads=1, log=logs.append)
if args["mode"] == "per-run":
    r = capture_shards([ShardTask(Path(t), Path(o)) for t, o in args["shards"]], args["target"], **kw)
    out = {"loads": r["target_loads"], "load_s": r["load_seconds"], "capture_s": r["capture_seconds"]}
else:
    (t, o), = args["shards"]
    r = capture_shard(Path(t), Path(o), args["target"], **kw)
    load = [float(l.split("loaded in ")[1].split("s")[0]) for l in logs if "target loaded in" in l]
    out = {"loads": len(load), "load_s": sum(load), "capture_s": r["seconds"]}
out["import_s"] = round(imported, 2)
print("RESULT " + json.dumps(out))
"""


def build_target(out: Path) -> dict:
    """The rehearsal target's architecture and default size, random weights, saved with its custom code."""
    import torch

    from aerie.rehearsal_target import remote_code
    from aerie.rehearsal_target.build import REMOTE_MODEL_FILES, build_model
    from aerie.rehearsal_target.config import RehearsalTargetConfig
    from aerie.rehearsal_target.tokenizer import SPECIAL_TOKENS_START, VOCAB_SIZE

    cfg = RehearsalTargetConfig()
    model = build_model(cfg, [*range(cfg.bpe_ranks), *range(SPECIAL_TOKENS_START, VOCAB_SIZE)])
    model.save_pretrained(out)
    for name in REMOTE_MODEL_FILES:
        shutil.copyfile(Path(remote_code.__file__).parent / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"parameters": params, "weight_bytes": size, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}


def write_tokens(path: Path, seed: int, seqs: int, seq_len: int, vocab: int) -> None:
    import torch

    from aerie.artifacts import save_packed
    from aerie.formats.tokens import TOKENS_FORMAT

    ids = torch.randint(0, vocab, (seqs, seq_len), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    mask[seq_len // 2 :] = 1
    save_packed(
        path,
        {
            "input_ids": ids.flatten().to(torch.int32),
            "loss_mask": mask.repeat(seqs),
            "seq_offsets": torch.arange(seqs + 1, dtype=torch.int64) * seq_len,
        },
        {
            "format": TOKENS_FORMAT,
            "sample_ids": [f"b/{seed}-{i}" for i in range(seqs)],
            "generation_prompt_ids": [],
            "stop_ids": [],
            "cut_sequences": list(range(seqs)),
        },
    )


def run_worker(args: dict) -> dict:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[7:]), "wall_s": time.perf_counter() - started}


def same_files(a: Path, b: Path) -> bool:
    import torch

    from aerie.artifacts import load_packed
    from aerie.formats.hidden import HIDDEN_FORMAT

    ta, ma = load_packed(a, HIDDEN_FORMAT)
    tb, mb = load_packed(b, HIDDEN_FORMAT)
    ma.pop("capture_key", None), mb.pop("capture_key", None)
    as_bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return ma == mb and ta.keys() == tb.keys() and all(torch.equal(as_bits(ta[k]), as_bits(tb[k])) for k in ta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--seqs", type=int, default=8, help="sequences per shard")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/aerie-hidden-loads"))
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args()
    if a.workdir.exists():
        shutil.rmtree(a.workdir)
    a.workdir.mkdir(parents=True)
    target = a.workdir / "target"
    facts = build_target(target)
    print(f"target: {facts}", flush=True)
    tokens = [a.workdir / "tokens" / f"shard-{s:05d}.safetensors" for s in range(max(a.shards))]
    tokens[0].parent.mkdir()
    for s, path in enumerate(tokens):
        write_tokens(path, s, a.seqs, a.seq_len, 163_840)
    rows = []
    for n in a.shards:
        row = {"shards": n, "tokens": n * a.seqs * a.seq_len}
        for mode in ("per-shard", "per-run"):
            out_dir = a.workdir / f"{mode}-{n}" / "hidden"
            out_dir.mkdir(parents=True)
            outs = [out_dir / p.name for p in tokens[:n]]
            common = {"target": str(target), "batch_tokens": a.batch_tokens, "mode": mode}
            if mode == "per-run":
                results = [run_worker({**common, "shards": [[str(t), str(o)] for t, o in zip(tokens, outs)]})]
            else:
                results = [run_worker({**common, "shards": [[str(t), str(o)]]}) for t, o in zip(tokens, outs)]
            row[mode] = {
                k: round(sum(r[k] for r in results), 2) for k in ("loads", "wall_s", "import_s", "load_s", "capture_s")
            }
            print(f"N={n} {mode}: {row[mode]}", flush=True)
        row["bit_identical"] = all(
            same_files(a.workdir / f"per-shard-{n}" / "hidden" / p.name, a.workdir / f"per-run-{n}" / "hidden" / p.name)
            for p in tokens[:n]
        )
        rows.append(row)
    print(json.dumps({"target": facts, "rows": rows}, indent=1))
    if a.out:
        a.out.write_text(json.dumps({"target": facts, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
