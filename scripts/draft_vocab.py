"""Rule draft_vocab: the most frequent generated target tokens, or drafter.init's own vocabulary - kept, or following
the data (vocab.warm_start) - (aerie.vocab.draft_vocab, format aerie.formats.vocab)."""

from pathlib import Path

from aerie.tools.rulelog import open_rule_log
from aerie.vocab.draft_vocab import build_draft_vocab_for_target, draft_vocab_from_folder

log = open_rule_log(snakemake.log[0])
settings = snakemake.params.settings
init = (snakemake.params.drafter or {}).get("init")
if init:  # warm start: the folder's vocabulary (its lm_head rows are those ids), kept or following the data
    draft_vocab_from_folder(
        [Path(p) for p in snakemake.input.tokens],
        Path(snakemake.output[0]),
        target_path=Path(snakemake.params.target),
        init=init,
        settings=settings,
        log=log,
    )
else:
    build_draft_vocab_for_target(
        [Path(p) for p in snakemake.input.tokens],
        Path(snakemake.output[0]),
        target_path=Path(snakemake.params.target),
        draft_vocab_size=settings.draft_vocab_size,
        log=log,
    )
