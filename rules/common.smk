import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")

# Scripts import the aerie package; make it importable from this checkout in every job (also inside
# per-rule conda envs, which do not have it installed).
sys.path.insert(0, workflow.basedir)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (workflow.basedir, os.environ.get("PYTHONPATH")) if p
)

from aerie.plan import check_config, plan_datasets  # noqa: E402


validate(config, schema=workflow.source_path("../config/schema.yaml"))
try:
    check_config(config)
    PLANS = plan_datasets(config)
except ValueError as e:
    raise WorkflowError(f"bad configuration: {e}") from None

RUN = config["run"]
TARGET = config["target"]["path"]
DEMO_TARGET = "demo" in config["target"]


wildcard_constraints:
    dataset="|".join(sorted(config["datasets"])),
    shard=r"\d{5}",
    run=r"[A-Za-z0-9][A-Za-z0-9_.-]*",


def get_target_input():
    """The demo target is built by a rule (a dependency); a real target is an existing folder."""
    return [TARGET] if DEMO_TARGET else []


def get_prompt_source(wildcards):
    from aerie.prompts import source_file

    path = source_file(config["datasets"][wildcards.dataset]["source"])
    return [str(path)] if path is not None else []


def get_shards(stage, suffix):
    """Every training shard of every dataset for a stage, e.g. get_shards("hidden", "safetensors")."""
    return [
        f"results/{name}/{stage}/shard-{shard}.{suffix}"
        for name, plan in PLANS.items()
        for shard in plan.shard_names
    ]


def get_bench_prompts():
    return [
        f"results/{name}/prompts/bench.jsonl"
        for name, plan in PLANS.items()
        if plan.bench > 0
    ]


def get_final_outputs():
    return [f"results/bench/{RUN}.json"]


def gpus(rule_key):
    return config["resources"][f"{rule_key}_gpus"]
