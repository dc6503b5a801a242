"""Rule responses: every API shard of the run in one job (aerie.responses.api.job.run_api_responses_job)."""

from aerie.tools.gpu_slots import acquire_rule_gpus
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log.job)
# First, before anything starts a server: this job's own GPUs (CUDA_VISIBLE_DEVICES) when it serves the
# target on loopback (responses.serve), or a clear failure when Snakemake granted fewer; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.plan.resolve import api_run  # noqa: E402
from aerie.responses.api.job import ApiShardTask, run_api_responses_job  # noqa: E402

run_api_responses_job(
    [
        ApiShardTask(dataset, Path(prompts), Path(out), Path(shard_log))
        for dataset, prompts, out, shard_log in zip(
            snakemake.params.datasets, snakemake.input.prompts, snakemake.output, snakemake.log.shards, strict=True
        )
    ],
    api_run(snakemake.params.config),  # the settings resolved once, in the planning layer
    log=log,
)
