"""Rule hidden: target hidden states for every tokens shard of the run, with one target load
(aerie.hidden.capture_shards; finished shards are kept in the capture store across attempts)."""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.hidden import ShardTask, capture_shards  # noqa: E402
from aerie.rulelog import snakemake_threads  # noqa: E402

cfg = snakemake.params.hidden
target = snakemake.params.target
tokens, outputs, shard_logs = snakemake.input.tokens, list(snakemake.output), snakemake.params.shard_logs
if not len(tokens) == len(outputs) == len(shard_logs):
    raise SystemExit(f"rule hidden: {len(tokens)} tokens shards, {len(outputs)} outputs, {len(shard_logs)} shard logs")
capture_shards(
    [ShardTask(Path(t), Path(o), Path(lg)) for t, o, lg in zip(tokens, outputs, shard_logs)],
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
    trust_remote_code=bool(target.get("trust_remote_code", False)),
    threads=snakemake_threads(snakemake),
    min_next_token_agreement=cfg["min_next_token_agreement"],
    min_next_token_in_topk=cfg["min_next_token_in_topk"],
    log=log,
)
