"""Rule bench: speculative decoding with the drafter vs the plain target, measured in the same run."""

from pathlib import Path

from aerie.bench.run import run_benchmark
from aerie.rulelog import open_rule_log, snakemake_threads

log = open_rule_log(snakemake.log[0])
cfg = snakemake.params.bench
target = snakemake.params.target
run_benchmark(
    Path(target["path"]),
    Path(snakemake.input.drafter),
    [Path(p) for p in snakemake.input.prompts],
    Path(snakemake.output[0]),
    max_new_tokens=cfg["max_new_tokens"],
    num_draft_steps=cfg["num_draft_steps"],
    repeats=cfg["repeats"],
    warmup=cfg["warmup"],
    threads=snakemake_threads(snakemake),
    max_prompts=cfg.get("max_prompts"),
    device=target["device"],
    dtype=target["dtype"],
    log=log,
)
