# Stage 2: the target answers every prompt: in-process (hf), or through an API (openrouter, openai,
# sglang) with a journal next to the shard so a restarted job never pays twice for a finished sample.


rule responses:
    input:
        prompts="results/{dataset}/prompts/shard-{shard}.jsonl",
        target=get_responses_target,
    output:
        "results/{dataset}/responses/shard-{shard}.jsonl",
    params:
        config=config,
        responses=get_responses_config,
    threads: get_responses_threads
    resources:
        gpu=get_responses_gpus,
    log:
        "results/logs/{dataset}/responses/shard-{shard}.log",
    benchmark:
        "results/benchmarks/{dataset}/responses/shard-{shard}.tsv"
    conda:
        "../envs/aerie.yaml"
    script:
        "../scripts/responses.py"
