"""Rule responses_recorded: a recorded dataset's shard of the target's own answers (aerie.sources.recorded), $0."""

from pathlib import Path

from aerie.responses.recorded import write_recorded_shard
from aerie.tools.rulelog import open_rule_log

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
