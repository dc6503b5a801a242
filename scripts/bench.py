"""Rule bench: the drafter and the reference drafters vs the plain target, measured in the same run; gated.
bench.backend inprocess runs in aerie's environment, sglang in SGLang's (the servers start inside this job)."""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES, which the SGLang servers inherit),
# or a clear failure when Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.bench.job import gated_benchmark  # noqa: E402
from aerie.rulelog import snakemake_threads  # noqa: E402

gated_benchmark(
    snakemake.params.target,
    Path(snakemake.input.drafter),
    [Path(p) for p in snakemake.input.prompts],
    Path(snakemake.output.report),
    Path(snakemake.output.plot),
    snakemake.params.bench,
    sglang=snakemake.params.sglang,
    threads=snakemake_threads(snakemake),
    log=log,
)
