"""Rule tokens: exact token ids + loss masks for one responses shard (aerie.tokens)."""

import os
from pathlib import Path

# The tokenizer's thread pool (read once, at its first batch): the job's threads, not every core of the host.
os.environ.setdefault("RAYON_NUM_THREADS", str(snakemake.threads))

from aerie.rulelog import open_rule_log
from aerie.tokens.stage import tokenize_shard

log = open_rule_log(snakemake.log[0])
cfg = snakemake.params.tokens
tokenize_shard(
    Path(snakemake.input.responses),
    Path(snakemake.output.tokens),
    Path(snakemake.output.report),
    snakemake.params.target["path"],
    max_seq_len=cfg["max_seq_len"],
    overlong=cfg["overlong"],
    drop_truncated=cfg["drop_truncated"],
    max_dropped_fraction=cfg["max_dropped_fraction"],
    reasoning_requested=snakemake.params.reasoning_requested,
    keep_missing_reasoning=cfg["keep_missing_reasoning"],
    drop_filtered=cfg["drop_filtered"],
    drop_degenerate=cfg["drop_degenerate"],
    special_token_text=cfg["special_token_text"],
    trust_remote_code=snakemake.params.target.get("trust_remote_code", False),
    log=log,
)
