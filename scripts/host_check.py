"""Rule host_check: this host against the run's floor (aerie.preview.host); the check file is an input of rule
responses (unless host_check.api_elsewhere) and of the first GPU jobs."""

from aerie.preview.host import run_host_check
from aerie.tools.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
run_host_check(snakemake.params.needs, snakemake.output[0], log=log)
