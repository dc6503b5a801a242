"""Rule tokenizer_check: the target's tokenizer as loaded keeps each special marker of its chat template one id
(aerie.target_model.markers; the check file is an input of every responses and tokens job)."""

from aerie.target_model.markers import write_tokenizer_check
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
write_tokenizer_check(
    snakemake.params.target["path"],
    snakemake.output[0],
    trust_remote_code=snakemake.params.target.get("trust_remote_code", False),
    log=log,
)
