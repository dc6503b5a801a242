"""Rule draft_vocab: the most frequent generated target tokens, or drafter.init's own vocabulary (aerie.vocab, format
aerie.formats.vocab)."""

from pathlib import Path

from aerie.rulelog import open_rule_log
from aerie.vocab import build_draft_vocab_for_target, draft_vocab_from_folder

log = open_rule_log(snakemake.log[0])
init = (snakemake.params.drafter or {}).get("init")
if init:  # warm start: the folder's vocabulary, kept (its lm_head rows are those ids)
    draft_vocab_from_folder(
        [Path(p) for p in snakemake.input.tokens],
        Path(snakemake.output[0]),
        target_path=Path(snakemake.params.target),
        init=init,
        log=log,
    )
else:
    build_draft_vocab_for_target(
        [Path(p) for p in snakemake.input.tokens],
        Path(snakemake.output[0]),
        target_path=Path(snakemake.params.target),
        draft_vocab_size=snakemake.params.vocab["draft_vocab_size"],
        log=log,
    )
