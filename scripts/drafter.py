"""Rule drafter: train the EAGLE-3 drafter on all hidden shards and export it for SGLang (aerie.drafter.cli)."""

from aerie.gpu_slots import acquire_rule_gpus
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.drafter.cli import run_training_job  # noqa: E402
from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.model_card import CardSettings  # noqa: E402
from aerie.rulelog import snakemake_threads  # noqa: E402

run_training_job(
    [Path(p) for p in snakemake.input.hidden],
    Path(snakemake.input.vocab),
    Path(snakemake.params.target),
    Path(snakemake.output[0]),
    TrainConfig(**{"threads": snakemake_threads(snakemake), **(snakemake.params.drafter or {})}),
    gpus=int(getattr(snakemake.resources, "gpu", 0) or 0),
    configured_aux_layer_ids=snakemake.params.aux_layer_ids,
    log=log,
    log_path=Path(snakemake.log[0]),
    card=CardSettings.from_config(snakemake.params.card),
    sglang=snakemake.params.sglang,
)
