# Stage 2: the target answers every prompt: in-process (hf), or through an API (openrouter, openai,
# sglang) with a journal next to the shard so a restarted job never pays twice for a finished sample.


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
    conda:
        "../envs/aerie.yaml"
    threads: get_responses_threads
    resources:
        gpu=get_responses_gpus,
    params:
        config=config,
        responses=get_responses_config,
        gpus=get_responses_gpus,  # what the job needs (0 for an API); checked by aerie.gpu_slots
    script:
        "../scripts/responses.py"
