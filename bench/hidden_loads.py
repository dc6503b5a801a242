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
import shutil
from pathlib import Path

from load_counting import compare_modes, report, worker_program

WORKER = worker_program(
    "from aerie.hidden.run import ShardTask, capture_shards; from aerie.hidden.shard import capture_shard; "
    "from aerie.hidden.settings import CaptureSettings",
    """
settings = CaptureSettings(aux_layer_ids=None, layout="compact", batch_tokens=args["batch_tokens"], device="cpu",
                           dtype="float32", trust_remote_code=True, threads=1)
if args["mode"] == "per-run":
    shards = [ShardTask(Path(t), Path(o)) for t, o in args["shards"]]
    r = capture_shards(shards, args["target"], settings, log=logs.append)
    out = {"loads": r["target_loads"], "load_s": r["load_seconds"], "capture_s": r["capture_seconds"]}
else:
    (t, o), = args["shards"]
    r = capture_shard(Path(t), Path(o), args["target"], settings, log=logs.append)
    loads, load_s = logged_loads()
    out = {"loads": loads, "load_s": load_s, "capture_s": r["seconds"]}
""",
)


def build_target(out: Path) -> dict:
    """The rehearsal target's architecture and default size, random weights, saved with its custom code."""
    import torch

    from aerie.targets.rehearsal import remote_code
    from aerie.targets.rehearsal.build import REMOTE_MODEL_FILES, build_model
    from aerie.targets.rehearsal.config import VOCAB_SIZE, RehearsalTargetConfig
    from aerie.targets.rehearsal.tokenizer import SPECIAL_TOKENS_START

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

    from aerie.formats.tokens import TOKENS_FORMAT
    from aerie.tools.artifacts import save_packed

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


def same_files(a: Path, b: Path) -> bool:
    import torch

    from aerie.formats.hidden import HIDDEN_FORMAT
    from aerie.tools.artifacts import load_packed

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
    rows = compare_modes(
        WORKER,
        {"target": str(target), "batch_tokens": a.batch_tokens},
        tokens,
        a.shards,
        a.workdir,
        stage="hidden",
        fields=("loads", "wall_s", "import_s", "load_s", "capture_s"),
        size=lambda n: {"tokens": n * a.seqs * a.seq_len},
        same=("bit_identical", same_files),
    )
    report(facts, rows, a.out)


if __name__ == "__main__":
    main()
