"""Rule responses_recorded: a recorded dataset's shard of the target's own answers (aerie.recorded), $0."""

from pathlib import Path

from aerie.recorded_responses import write_recorded_shard
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
write_recorded_shard(
    snakemake.wildcards.dataset,
    snakemake.params.dataset,
    snakemake.params.datasets,
    list(snakemake.params.positions),
    Path(snakemake.input.prompts),
    Path(snakemake.output[0]),
    Path(snakemake.params.cache),
    snakemake.params.model,
    log=log,
)
