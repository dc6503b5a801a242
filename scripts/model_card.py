"""Rule model_card: the published drafter folder with its full model card (aerie.model_card)."""

from pathlib import Path

from aerie.model_card import CardSettings, write_published_folder
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
out = write_published_folder(
    Path(snakemake.output[0]),
    Path(snakemake.input.drafter),
    Path(snakemake.input.bench),
    CardSettings.from_config(snakemake.params.card),
    str(snakemake.params.target),
    hidden_shards=[Path(p) for p in snakemake.input.hidden],
    response_shards=[Path(p) for p in snakemake.input.responses],
    sglang=snakemake.params.sglang,
)
log(f"model card and published folder written: {out} (hf upload <repo> {out} .)")
