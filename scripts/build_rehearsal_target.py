"""Rule rehearsal_target: build and pre-train the Kimi-shaped rehearsal target (aerie.rehearsal_target)."""

from aerie.rehearsal_target.build import build_rehearsal_target
from aerie.rehearsal_target.config import RehearsalTargetConfig
from aerie.rulelog import open_rule_log, snakemake_threads

log = open_rule_log(snakemake.log[0])
# The schema (target.rehearsal, x-defaults-from) has checked every key, type and range at parse time.
settings = {"threads": snakemake_threads(snakemake), **(snakemake.params.rehearsal or {})}
if "families" in settings:
    settings["families"] = tuple(settings["families"])
build_rehearsal_target(snakemake.output[0], RehearsalTargetConfig(**settings), log=log)
