"""Rule hidden: target hidden states for one tokens shard (aerie.hidden)."""

from pathlib import Path

from aerie.hidden import capture_shard
from aerie.rulelog import open_rule_log, snakemake_threads

log = open_rule_log(snakemake.log[0])
cfg = snakemake.params.hidden
target = snakemake.params.target
capture_shard(
    Path(snakemake.input.tokens),
    Path(snakemake.output[0]),
    target["path"],
    aux_layer_ids=cfg["aux_layer_ids"],
    batch_tokens=cfg["batch_tokens"],
    storage_dtype=cfg["storage_dtype"],
    device=target["device"],
    dtype=target["dtype"],
    threads=snakemake_threads(snakemake),
    min_next_token_agreement=cfg["min_next_token_agreement"],
    log=log,
)
