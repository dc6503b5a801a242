"""Rule demo_target: build and pre-train the demo target (aerie.demo_target)."""

from aerie.demo_target.build import build_demo_target
from aerie.demo_target.config import DemoTargetConfig
from aerie.rulelog import open_rule_log, snakemake_threads

log = open_rule_log(snakemake.log[0])
cfg = DemoTargetConfig(**{"threads": snakemake_threads(snakemake), **(snakemake.params.demo or {})})
build_demo_target(snakemake.output[0], cfg, log=log)
