# Stage 4: target hidden states at the EAGLE-3 aux layers + the final layer (stored as it is, or as the
# target's top-k next tokens), checked per shard.
#
# One job for every shard of the run, so the target is loaded once per run (on one host: one sbatch job
# under SLURM) instead of once per shard: ~0.6 TB of weights for Kimi K2.5, minutes of loading against a
# capture of ~40M tokens (bench/RESULTS.md). Snakemake deletes every declared output of a job before it
# runs and after it fails, so each shard is captured into an undeclared store first
# (results/<dataset>/hidden/captured/, aerie/target_model/store.py) and hard-linked to its output: a rerun after
# a crash or a failed shard reuses the finished ones (same tokens bytes, target and settings) and captures
# only the rest, still with one load; each shard keeps its own checks and its own log
# (results/logs/<dataset>/hidden/shard-NNNNN.log). Weighed and not chosen (docs/formats.md, "Capture
# job"): a service() job serving per-shard consumers in one group - Snakemake sums the resources of every
# member of a service group (N shards need N + the server's cores at once) and starts all members
# together, and a service that is not the direct child of its shell outlives the run.

from aerie.plan.environments import conda_directive, rule_environment_check


rule hidden:
    input:
        tokens=get_shards("tokens", "safetensors"),
        target=get_target_input(),
        # No file: while the DAG is built, before any job, refuses hidden.backend sglang outside SGLang's env.
        environment=rule_environment_check(workflow, config, "hidden"),
        host_check=HOST_CHECK_INPUTS.get("hidden", []),  # this host's floor (rules/host.smk)
    output:
        get_shards("hidden", "safetensors"),
    log:
        "results/logs/hidden.log",
    benchmark:
        "results/benchmarks/hidden.tsv"
    conda:  # SGLang capture runs in SGLang's own environment (it pins its own torch and transformers)
        conda_directive(config, "hidden")
    threads: all_cores()
    resources:
        gpu=gpus("hidden"),
    params:
        # hidden.* resolved (aerie.plan.resolve.hidden_settings): the layers every drafter reads, one capture
        settings=hidden_settings(config),
        target=config["target"],
        gpus=gpus("hidden"),  # what the job needs; checked against what it is granted (aerie.tools.gpu_slots)
        shard_logs=[
            p.replace("results/", "results/logs/", 1).replace(".safetensors", ".log")
            for p in get_shards("hidden", "safetensors")
        ],
    script:
        "../scripts/hidden.py"


# `snakemake -n` says how many times the plan loads the target for capture.
if workflow.is_main_process and getattr(workflow.output_settings, "dryrun", False):
    from aerie.target_model.store import (
        capture_plan,
        capture_plan_text,
        config_key_function,
    )

    print(
        capture_plan_text(
            capture_plan(
                get_shards("hidden", "safetensors"),
                get_shards("tokens", "safetensors"),
                config_key_function(config, HIDDEN_LAYER_IDS),
            )
        ),
        file=sys.stderr,
    )
