"""Rule model_card: one drafter's published folder with its full model card, and the card as the report's page
(aerie.publish.card)."""

from pathlib import Path

from aerie.publish.card import CardSettings, write_published_folder
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
out = write_published_folder(
    Path(snakemake.output.folder),
    Path(snakemake.input.drafter),
    Path(snakemake.input.bench),
    CardSettings.from_config(snakemake.params.card),
    str(snakemake.params.target),
    hidden_shards=[Path(p) for p in snakemake.input.hidden],
    response_shards=[Path(p) for p in snakemake.input.responses],
    sglang=snakemake.params.sglang,
    page=Path(snakemake.output.page),
)
log(f"model card and published folder written: {out} (hf upload <repo> {out} .); report page {snakemake.output.page}")
