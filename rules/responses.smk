# Stage 2: the target answers every prompt: in-process (hf), or through an API (openrouter, openai,
# sglang) with a journal next to the shard so a restarted job never pays twice for a finished sample.
#
# In-process generation (backend hf) is one job for every such shard of the run (rule responses_hf), so the
# target is loaded once per run (on one host: one sbatch job under SLURM) instead of once per shard, the
# design of rule hidden (rules/hidden.smk, aerie/shard_store.py): each shard is generated into an
# undeclared store (results/<dataset>/responses/generated/) and hard-linked to its output, so a rerun after
# a crash or a failed shard reuses the finished ones (same prompts bytes, target and settings) and generates
# only the rest, still with one load; each shard keeps its own log (results/logs/<dataset>/responses/).
# API datasets keep one job per shard (rule responses): no target to load, and the budget guard, journal
# and keep-going work per shard.

IN_PROCESS_RESPONSES = [
    (name, shard)
    for name, plan in PLANS.items()
    if responses_config(config, name)["backend"] == "hf"
    for shard in plan.shard_names
]
API_RESPONSES_DATASETS = sorted(
    name for name in PLANS if responses_config(config, name)["backend"] != "hf"
)
# The i-th in-process shard's prompts, output and own log (rule responses_hf lists them in this order).
IN_PROCESS_PROMPTS, IN_PROCESS_OUTPUTS, IN_PROCESS_SHARD_LOGS = (
    [
        f"{root}/{name}/{stage}/shard-{shard}.{suffix}"
        for name, shard in IN_PROCESS_RESPONSES
    ]
    for root, stage, suffix in (
        ("results", "prompts", "jsonl"),
        ("results", "responses", "jsonl"),
        ("results/logs", "responses", "log"),
    )
)


if API_RESPONSES_DATASETS:

    rule responses:
        input:
            prompts="results/{dataset}/prompts/shard-{shard}.jsonl",
            target=get_responses_target,
        output:
            "results/{dataset}/responses/shard-{shard}.jsonl",
        log:
            "results/logs/{dataset}/responses/shard-{shard}.log",
        benchmark:
            "results/benchmarks/{dataset}/responses/shard-{shard}.tsv"
        wildcard_constraints:
            dataset="|".join(API_RESPONSES_DATASETS),
        conda:
            "../envs/aerie.yaml"
        threads: get_responses_threads
        resources:
            gpu=get_responses_gpus,
        params:
            config=config,
            gpus=get_responses_gpus,  # what the job needs (0 for an API); checked by aerie.gpu_slots
        script:
            "../scripts/responses.py"


if IN_PROCESS_RESPONSES:

    rule responses_hf:
        input:
            prompts=IN_PROCESS_PROMPTS,
            target=get_target_input(),
        output:
            IN_PROCESS_OUTPUTS,
        log:
            "results/logs/responses_hf.log",
        benchmark:
            "results/benchmarks/responses_hf.tsv"
        conda:
            "../envs/aerie.yaml"
        threads: all_cores()
        resources:
            gpu=gpus("responses"),
        params:
            datasets=[name for name, _ in IN_PROCESS_RESPONSES],
            responses={
                name: responses_config(config, name)
                for name, _ in IN_PROCESS_RESPONSES
            },
            target=config["target"],
            gpus=gpus("responses"),  # what the job needs; checked against what it is granted (aerie.gpu_slots)
            shard_logs=IN_PROCESS_SHARD_LOGS,
        script:
            "../scripts/responses_hf.py"


# `snakemake -n` says how many times the plan loads the target for responses.
if workflow.is_main_process and getattr(workflow.output_settings, "dryrun", False):
    from aerie.shard_store import responses_loads_text

    _text = responses_loads_text(
        config["target"],
        {name: responses_config(config, name) for name in PLANS},
        {name: plan.shard_names for name, plan in PLANS.items()},
    )
    if _text:
        print(_text, file=sys.stderr)
