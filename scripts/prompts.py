"""Rules prompts / bench_prompts: write one slice of a dataset's prompts (aerie.sources.datasets)."""

from pathlib import Path

from aerie.sources.datasets import write_prompts
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
start, stop = snakemake.params.range
# All datasets: an hf source drops the prompts a dataset listed before it holds (as the shard plan did).
n = write_prompts(
    snakemake.wildcards.dataset,
    snakemake.params.dataset,
    start,
    stop,
    Path(snakemake.output[0]),
    datasets=snakemake.config["datasets"],
    order=snakemake.params.order,
    cache_dir=Path(snakemake.params.cache),
)
log(f"{snakemake.output[0]}: {n} prompts ({start}..{stop})")
