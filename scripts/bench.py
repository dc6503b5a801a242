"""Rule bench: every trained drafter of the run and the reference drafters vs the plain target, measured in the same
run; each trained drafter gated on its own.
bench.backend inprocess runs in aerie's environment, sglang in SGLang's (the servers start inside this job)."""

from aerie.tools.gpu_slots import acquire_rule_gpus
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES, which the SGLang servers inherit),
# or a clear failure when Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.benchmark.job import gated_benchmark  # noqa: E402
from aerie.tools.rulelog import snakemake_threads  # noqa: E402

# Snakemake hands a one-item list input over as its item.
folders = [snakemake.input.drafters] if isinstance(snakemake.input.drafters, str) else list(snakemake.input.drafters)
gated_benchmark(
    snakemake.params.target,
    dict(zip(snakemake.params.drafters, map(Path, folders), strict=True)),  # name -> folder, in the run's order
    [Path(p) for p in snakemake.input.prompts],
    Path(snakemake.output.report),
    Path(snakemake.output.plot),
    snakemake.params.bench,
    sglang=snakemake.params.sglang,
    threads=snakemake_threads(snakemake),
    log=log,
)
