# Stage 2: the target answers every prompt: in-process (hf), or through an API (openrouter, openai,
# sglang) with a journal next to the shard so a restarted job never pays twice for a finished sample.
#
# In-process generation (backend hf) is one job for every such shard of the run (rule responses_hf), so the
# target is loaded once per run (on one host: one sbatch job under SLURM) instead of once per shard, the
# design of rule hidden (rules/hidden.smk, aerie/target_model/store.py): each shard is generated into an
# undeclared store (results/<dataset>/responses/generated/) and hard-linked to its output, so a rerun after
# a crash or a failed shard reuses the finished ones (same prompts bytes, target and settings) and generates
# only the rest, still with one load; each shard keeps its own log (results/logs/<dataset>/responses/).
# API datasets are one job too (rule responses, aerie/responses/api/job.py): one process owns the run's limits - requests in
# flight (responses.concurrency), the budget and each dataset's quota - whatever Snakemake schedules (--cores all,
# --jobs N, SLURM). Finished samples live in each shard's journal, so a rerun publishes the finished shards again
# without a request and asks only for what is missing; each shard keeps its own log.

from aerie.formats.responses import is_in_process, is_recorded
from aerie.responses.api.backends import api_backend, is_api_backend

IN_PROCESS_RESPONSES = [
    (name, shard)
    for name, plan in PLANS.items()
    if is_in_process(responses_config(config, name)["backend"])
    for shard in plan.shard_names
]
API_RESPONSES_DATASETS = sorted(
    name for name in PLANS if is_api_backend(responses_config(config, name)["backend"])
)
# Recorded datasets (source.kind: recorded, aerie.sources.recorded): the target's answers exist already; rule
# responses_recorded copies each shard's out of the prompt cache, no request, $0 (never part of rule responses).
RECORDED_DATASETS = sorted(
    name for name in PLANS if is_recorded(responses_config(config, name)["backend"])
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


API_RESPONSES = [
    (name, shard)
    for name in API_RESPONSES_DATASETS
    for shard in PLANS[name].shard_names
]
# The i-th API shard's prompts, output and own log (rule responses lists them in this order).
API_PROMPTS, API_OUTPUTS, API_SHARD_LOGS = (
    [f"{root}/{name}/{stage}/shard-{shard}.{suffix}" for name, shard in API_RESPONSES]
    for root, stage, suffix in (
        ("results", "prompts", "jsonl"),
        ("results", "responses", "jsonl"),
        ("results/logs", "responses", "log"),
    )
)


# A loopback server (responses.serve) takes the cores and the GPUs of the job; sglang's ids need the target's
# tokenizer; a remote API needs one core and no GPU.
API_RESPONSES_SERVED = any(
    responses_config(config, name).get("serve") for name in API_RESPONSES_DATASETS
)
API_RESPONSES_NEED_TARGET = API_RESPONSES_SERVED or any(
    api_backend(responses_config(config, name)["backend"]).sends_token_ids
    for name in API_RESPONSES_DATASETS
)


if API_RESPONSES:

    rule responses:
        input:
            prompts=API_PROMPTS,
            target=get_target_input() if API_RESPONSES_NEED_TARGET else [],
            # checked before any request is paid: the target's tokenizer keeps its markers one id (rules/target.smk)
            tokenizer_check=ancient(TOKENIZER_CHECK),
            # this host's floor, before any request is paid (rules/host.smk; none with host_check.api_elsewhere)
            host_check=HOST_CHECK_INPUTS.get("responses", []),
        output:
            API_OUTPUTS,
        log:
            job="results/logs/responses.log",
            shards=API_SHARD_LOGS,
        benchmark:
            "results/benchmarks/responses.tsv"
        conda:
            "../envs/aerie.yaml"
        threads: all_cores() if API_RESPONSES_SERVED else 1
        resources:
            gpu=gpus("responses") if API_RESPONSES_SERVED else 0,
        params:
            datasets=[name for name, _ in API_RESPONSES],
            config=config,
            # what the job needs (0 for a remote API); checked against what it is granted (aerie.tools.gpu_slots)
            gpus=gpus("responses") if API_RESPONSES_SERVED else 0,
        script:
            "../scripts/responses.py"


if RECORDED_DATASETS:

    # A file conversion (seconds per shard): it runs where snakemake runs, never as a cluster job.
    rule responses_recorded:
        input:
            prompts="results/{dataset}/prompts/shard-{shard}.jsonl",
            source=get_prompt_source,
        output:
            "results/{dataset}/responses/shard-{shard}.jsonl",
        log:
            "results/logs/{dataset}/responses/shard-{shard}.log",
        wildcard_constraints:
            dataset="|".join(RECORDED_DATASETS),
        localrule: True
        conda:
            "../envs/aerie.yaml"
        params:
            dataset=lambda w: config["datasets"][w.dataset],
            datasets=config["datasets"],
            positions=lambda w: PLANS[w.dataset].positions(
                *PLANS[w.dataset].shard_range(int(w.shard))
            ),
            cache=PROMPT_CACHE,
            model=TARGET,  # who answered, where neither the rows nor source.model say
        script:
            "../scripts/responses_recorded.py"


if IN_PROCESS_RESPONSES:

    rule responses_hf:
        input:
            prompts=IN_PROCESS_PROMPTS,
            target=get_target_input(),
            # checked before any request is paid: the target's tokenizer keeps its markers one id (rules/target.smk)
            tokenizer_check=ancient(TOKENIZER_CHECK),
            host_check=HOST_CHECK_INPUTS.get("responses_hf", []),  # this host's floor (rules/host.smk)
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
            # each dataset's sampling, resolved (aerie.plan.resolve.sampling_settings)
            sampling={
                name: sampling_settings(config, name)
                for name, _ in IN_PROCESS_RESPONSES
            },
            target=config["target"],
            gpus=gpus("responses"),  # what the job needs; checked against what it is granted (aerie.tools.gpu_slots)
            shard_logs=IN_PROCESS_SHARD_LOGS,
        script:
            "../scripts/responses_hf.py"


# `snakemake -n` says how many times the plan loads the target for responses.
if workflow.is_main_process and getattr(workflow.output_settings, "dryrun", False):
    from aerie.target_model.store import responses_loads_text

    _text = responses_loads_text(
        config["target"],
        {name: responses_config(config, name) for name in PLANS},
        {name: plan.shard_names for name, plan in PLANS.items()},
    )
    if _text:
        print(_text, file=sys.stderr)
