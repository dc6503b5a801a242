"""Rule draft_vocab: the most frequent generated target tokens (aerie.draft-vocab)."""

from pathlib import Path

from transformers import AutoConfig

from aerie.rulelog import open_rule_log
from aerie.vocab import build_draft_vocab

log = open_rule_log(snakemake.log[0])
target_config = AutoConfig.from_pretrained(snakemake.params.target)
target_config = getattr(target_config, "text_config", target_config)
build_draft_vocab(
    [Path(p) for p in snakemake.input.tokens],
    Path(snakemake.output[0]),
    target_vocab_size=target_config.vocab_size,
    draft_vocab_size=snakemake.params.vocab["draft_vocab_size"],
    log=log,
)
