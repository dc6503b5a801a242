"""Rule host_check: this host against the run's floor (aerie.host_check); the check file is an input of rule
responses (unless host_check.api_elsewhere) and of the first GPU jobs."""

from aerie.host_check import run_host_check
from aerie.rulelog import open_rule_log

log = open_rule_log(snakemake.log[0])
run_host_check(snakemake.params.needs, snakemake.output[0], log=log)
