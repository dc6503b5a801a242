"""Rule responses_hf: the target answers every in-process prompt shard of the run with one target load
(aerie.responses.in_process.generate_hf_shards; finished shards are kept in the generation store across attempts)."""

from aerie.tools.gpu_slots import acquire_rule_gpus
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from aerie.responses.in_process import generate_hf_job  # noqa: E402
from aerie.tools.rulelog import snakemake_threads  # noqa: E402

generate_hf_job(
    snakemake.input.prompts,
    list(snakemake.output),
    snakemake.params.shard_logs,
    snakemake.params.datasets,
    snakemake.params.sampling,
    snakemake.params.target,
    threads=snakemake_threads(snakemake),
    log=log,
)
