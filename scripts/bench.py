"""Rule bench: the drafter and two reference drafters vs the plain target, measured in the same run; gated."""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

import os  # noqa: E402
from pathlib import Path  # noqa: E402

from aerie.bench.plots import plot_benchmark  # noqa: E402
from aerie.bench.run import Gate, gate_failures, run_benchmark  # noqa: E402
from aerie.rulelog import snakemake_threads  # noqa: E402

cfg = snakemake.params.bench
target = snakemake.params.target
out_json, out_png = Path(snakemake.output.report), Path(snakemake.output.plot)
report = run_benchmark(
    Path(target["path"]),
    Path(snakemake.input.drafter),
    [Path(p) for p in snakemake.input.prompts],
    out_json,
    max_new_tokens=cfg["max_new_tokens"],
    num_draft_steps=cfg["num_draft_steps"],
    repeats=cfg["repeats"],
    warmup=cfg["warmup"],
    threads=cfg.get("threads") or snakemake_threads(snakemake),
    max_prompts=cfg.get("max_prompts"),
    device=target["device"],
    dtype=target["dtype"],
    references=cfg["references"],
    log=log,
)
plot_benchmark(report, out_png)
failures = gate_failures(report, Gate(**cfg["gate"]))
if failures:
    # Snakemake deletes a failed job's outputs: keep the evidence under names it does not own.
    kept = out_json.with_name(out_json.stem + ".gate-failed.json")
    os.replace(out_json, kept)
    os.replace(out_png, out_png.with_name(out_png.stem + ".gate-failed.png"))
    message = "the drafter does not pay off: " + "; ".join(failures) + f" (full report: {kept})"
    log(message)
    raise SystemExit(message)
log(f"gate passed: {Gate(**cfg['gate'])}")
