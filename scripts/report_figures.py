"""Rule report_figures: the figures of the HTML report (snakemake --report), read from finished artifacts."""

from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])

from aerie.publish.report import FIGURES, write_figures  # noqa: E402

# Snakemake hands a one-item list input over as its item.
folders = [snakemake.input.drafters] if isinstance(snakemake.input.drafters, str) else list(snakemake.input.drafters)

summary = write_figures(
    {name: snakemake.output[name] for name in FIGURES},
    responses=snakemake.input.responses,
    token_reports=snakemake.input.token_reports,
    hidden=snakemake.input.hidden,
    drafters=dict(zip(snakemake.params.drafters, folders, strict=True)),
    bench=snakemake.input.bench,
    sglang=snakemake.input.sglang[0] if snakemake.input.sglang else None,
)
log(f"report figures written: {summary}")
