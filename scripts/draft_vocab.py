"""Rule draft_vocab: the most frequent generated target tokens (aerie.vocab, format aerie.formats.vocab)."""

from pathlib import Path

from aerie.rulelog import open_rule_log
from aerie.vocab import build_draft_vocab_for_target

log = open_rule_log(snakemake.log[0])
build_draft_vocab_for_target(
    [Path(p) for p in snakemake.input.tokens],
    Path(snakemake.output[0]),
    target_path=Path(snakemake.params.target),
    draft_vocab_size=snakemake.params.vocab["draft_vocab_size"],
    log=log,
)
