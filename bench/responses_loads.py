"""Target loads and wall time of in-process responses (``responses.backend: hf``) with N shards: one load per
shard (before issue 16, one job per shard) vs one load per run (rule responses_hf now,
aerie.responses.in_process.generate_hf_shards).

The target is the Kimi-shaped rehearsal target (KimiK25ForConditionalGeneration around a DeepseekV3, Kimi's
tiktoken tokenizer and chat template, loaded through its own code with trust_remote_code) at its default size,
built with a few training steps only: load and generation costs do not depend on training. Prompts are the
demo's synthetic tasks. Each configuration runs as the pipeline runs it, in fresh processes: "per shard"
starts one process per shard that imports, loads the target and answers its shard (what each per-shard job
did, without Snakemake's own per-job overhead); "per run" starts one process that loads once and answers every
shard. Both write the same shards (every record field but the measured ``latency_s``; checked here).

    python bench/responses_loads.py --shards 1 2 4 8          # ~10 min on a quiet 2-core machine
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from load_counting import compare_modes, report, worker_program

WORKER = worker_program(
    "from aerie.responses.in_process import ResponsesTask, generate_hf, generate_hf_shards\n"
    "from aerie.responses.sampling import Sampling",
    """
settings = Sampling(**args["settings"])
kw = dict(device="cpu", dtype="float32", trust_remote_code=True, threads=1, log=logs.append)
if args["mode"] == "per-run":
    tasks = [ResponsesTask(Path(p), Path(o), settings) for p, o in args["shards"]]
    r = generate_hf_shards(tasks, args["target"], **kw)
    out = {"loads": r["target_loads"], "load_s": r["load_seconds"], "generate_s": r["generate_seconds"]}
else:
    (p, o), = args["shards"]
    r = generate_hf(Path(p), Path(o), args["target"], settings, **kw)
    loads, load_s = logged_loads()
    out = {"loads": loads, "load_s": load_s, "generate_s": r["seconds"]}
""",
)


def build_target(out: Path, train_steps: int) -> dict:
    """The rehearsal target at its default size, barely trained (its build also trains the tokenizer)."""
    from aerie.targets.rehearsal.build import build_rehearsal_target
    from aerie.targets.rehearsal.config import RehearsalTargetConfig

    cfg = RehearsalTargetConfig(
        train_steps=train_steps, warmup=0, log_every=max(train_steps, 1), eval_prompts=1, eval_batch_size=1,
        eval_max_new_tokens=4, latency_steps=1, threads=1, tokenizer_examples=2000,
    )  # fmt: skip
    build_rehearsal_target(out, cfg, log=lambda _: None)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"weight_bytes": size, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}


def same_records(a: Path, b: Path) -> bool:
    from aerie.tools.artifacts import read_jsonl

    def strip(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "latency_s"} for r in read_jsonl(path)]

    return strip(a) == strip(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per shard")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=2, help="training steps of the rehearsal target")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/aerie-responses-loads"))
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args()
    from aerie.sources.datasets import write_prompts

    if a.workdir.exists():
        shutil.rmtree(a.workdir)
    a.workdir.mkdir(parents=True)
    target = a.workdir / "target"
    t = time.perf_counter()
    facts = build_target(target, a.train_steps)
    print(f"target: {facts} (built in {time.perf_counter() - t:.0f}s)", flush=True)
    source = {"source": {"kind": "synthetic", "families": ["arith", "lists", "code"], "count": 10_000, "seed": 7}}
    prompts = [a.workdir / "prompts" / f"shard-{s:05d}.jsonl" for s in range(max(a.shards))]
    for s, path in enumerate(prompts):
        write_prompts("tasks", source, s * a.prompts, (s + 1) * a.prompts, path)
    # Sampled, as a user's run would be: also checks that a shard's seeds do not depend on the shards before it.
    settings = {
        "temperature": 0.7,
        "top_p": 0.95,
        "max_new_tokens": a.max_new_tokens,
        "batch_size": a.prompts,
        "seed": 0,
    }
    rows = compare_modes(
        WORKER,
        {"target": str(target), "settings": settings},
        prompts,
        a.shards,
        a.workdir,
        stage="responses",
        fields=("loads", "wall_s", "import_s", "load_s", "generate_s"),
        size=lambda n: {"prompts": n * a.prompts},
        same=("same_records", same_records),
    )
    report(facts, rows, a.out)


if __name__ == "__main__":
    main()
