"""Rule drafter: train one of the run's drafters (its kind: aerie.drafter_kinds) on all hidden shards and export it
for SGLang (aerie.drafter.cli)."""

from aerie.tools.gpu_slots import acquire_rule_gpus
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
# First, before torch is imported: this job's own GPUs (CUDA_VISIBLE_DEVICES), or a clear failure when
# Snakemake granted fewer than the rule needs; a no-op without GPUs.
acquire_rule_gpus(snakemake, log)

from pathlib import Path  # noqa: E402

from aerie.drafter.cli import run_training_job  # noqa: E402
from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.publish.card import CardSettings, write_export_card  # noqa: E402
from aerie.tools.rulelog import snakemake_threads  # noqa: E402

vocab = [snakemake.input.vocab] if isinstance(snakemake.input.vocab, str) else list(snakemake.input.vocab)
run_training_job(
    [Path(p) for p in snakemake.input.hidden],
    Path(vocab[0]) if vocab else None,  # kinds without a draft vocabulary (DFlash) get none
    Path(snakemake.params.target),
    Path(snakemake.output[0]),
    TrainConfig.of({"threads": snakemake_threads(snakemake), **snakemake.params.drafter}),
    gpus=int(getattr(snakemake.resources, "gpu", 0) or 0),
    configured_aux_layer_ids=snakemake.params.aux_layer_ids,
    log=log,
    log_path=Path(snakemake.log[0]),
)
# The exported folder's model card (README.md): config section card, the serve command's flags from section sglang.
write_export_card(
    Path(snakemake.output[0]),
    CardSettings.from_config(snakemake.params.card),
    str(snakemake.params.target),
    snakemake.input.hidden,
    snakemake.params.sglang,
)
