"""Rule hidden: target hidden states for every tokens shard of the run, with one target load
(aerie.hidden.capture_shards; finished shards are kept in the capture store across attempts)."""

from aerie.tools.gpu_slots import acquire_rule_gpus
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

from aerie.hidden.run import ShardTask, capture_shards  # noqa: E402
from aerie.tools.rulelog import snakemake_threads  # noqa: E402

tokens, outputs, shard_logs = snakemake.input.tokens, list(snakemake.output), snakemake.params.shard_logs
if not len(tokens) == len(outputs) == len(shard_logs):
    raise SystemExit(f"rule hidden: {len(tokens)} tokens shards, {len(outputs)} outputs, {len(shard_logs)} shard logs")
capture_shards(
    [ShardTask(Path(t), Path(o), Path(lg)) for t, o, lg in zip(tokens, outputs, shard_logs)],
    snakemake.params.target["path"],
    replace(snakemake.params.settings, threads=snakemake_threads(snakemake)),  # aerie.plan.resolve.hidden_settings
    log=log,
)
