"""Rule responses: an API backend answers one prompt shard (aerie.api.shard.run_api_responses_job)."""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before anything starts a server: this job's own GPUs (CUDA_VISIBLE_DEVICES) when it serves the
# target on loopback (responses.serve), or a clear failure when Snakemake granted fewer; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.api.shard import run_api_responses_job  # noqa: E402

run_api_responses_job(
    Path(snakemake.input.prompts),
    Path(snakemake.output[0]),
    snakemake.params.config,
    snakemake.wildcards.dataset,
    log=log,
)
