"""Rule bench_set: one set of bench.sets as an aerie.prompts/1 file, without the prompts training holds."""

from pathlib import Path

from aerie.prompts.bench_sets import write_bench_set
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
write_bench_set(
    snakemake.wildcards.set,
    snakemake.config,
    Path(snakemake.output[0]),
    cache_dir=Path(snakemake.params.cache),
    log=log,
)
