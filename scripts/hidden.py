"""Rule hidden: target hidden states for one tokens shard (aerie.hidden)."""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.hidden import capture_shard  # noqa: E402
from aerie.rulelog import snakemake_threads  # noqa: E402

cfg = snakemake.params.hidden
target = snakemake.params.target
capture_shard(
    Path(snakemake.input.tokens),
    Path(snakemake.output[0]),
    target["path"],
    aux_layer_ids=cfg["aux_layer_ids"],
    layout=cfg["layout"],
    target_topk=cfg["target_topk"],
    backend=cfg["backend"],
    backend_options=cfg.get("sglang") if cfg["backend"] == "sglang" else None,
    batch_tokens=cfg["batch_tokens"],
    storage_dtype=cfg["storage_dtype"],
    device=target["device"],
    dtype=target["dtype"],
    threads=snakemake_threads(snakemake),
    min_next_token_agreement=cfg["min_next_token_agreement"],
    min_next_token_in_topk=cfg["min_next_token_in_topk"],
    log=log,
)
