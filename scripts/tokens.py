"""Rule tokens: exact token ids + loss masks for one responses shard (aerie.tokens)."""

import os
from pathlib import Path

# The tokenizer's thread pool (read once, at its first batch): the job's threads, not every core of the host.
os.environ.setdefault("RAYON_NUM_THREADS", str(snakemake.threads))

from aerie.tokens.stage import tokenize_shard
from aerie.tools.rulelog import open_rule_log

tokenize_shard(
    Path(snakemake.input.responses),
    Path(snakemake.output.tokens),
    Path(snakemake.output.report),
    snakemake.params.target["path"],
    snakemake.params.settings,
    reasoning_requested=snakemake.params.reasoning_requested,
    log=open_rule_log(snakemake.log[0]),
)
