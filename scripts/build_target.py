"""Rule <key>_target: build a target folder with its builder (aerie.targets: the demo, the Kimi rehearsal target)."""

from aerie.targets import builders
from aerie.tools.rulelog import open_rule_log, snakemake_threads

log = open_rule_log(snakemake.log[0])
builder = builders()[snakemake.params.builder]
# The schema (target.<key>) and the builder's settings have checked every key, type and range at parse time.
settings = {"threads": snakemake_threads(snakemake), **(snakemake.params.settings or {})}
builder.build(snakemake.output[0], settings, log=log)
