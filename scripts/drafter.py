"""Rule drafter: train the EAGLE-3 drafter on all hidden shards and export it for SGLang."""

from pathlib import Path

from aerie.drafter.train import TrainConfig, train_drafter
from aerie.rulelog import open_rule_log, snakemake_threads

log = open_rule_log(snakemake.log[0])
cfg = TrainConfig(**{"threads": snakemake_threads(snakemake), **(snakemake.params.drafter or {})})
train_drafter(
    [Path(p) for p in snakemake.input.hidden],
    Path(snakemake.input.vocab),
    Path(snakemake.params.target),
    Path(snakemake.output[0]),
    cfg,
    log=log,
)
