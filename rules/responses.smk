# Stage 2: the target answers every prompt (in-process here; API backends write the same records).


rule responses:
    input:
        prompts="results/{dataset}/prompts/shard-{shard}.jsonl",
        target=get_target_input(),
    output:
        "results/{dataset}/responses/shard-{shard}.jsonl",
    params:
        responses=config["responses"],
        target=config["target"],
    threads: workflow.cores
    resources:
        gpu=gpus("responses") if config["responses"]["backend"] in ("hf", "sglang") else 0,
    log:
        "results/logs/{dataset}/responses/shard-{shard}.log",
    benchmark:
        "results/benchmarks/{dataset}/responses/shard-{shard}.tsv"
    conda:
        "../envs/aerie.yaml"
    script:
        "../scripts/responses.py"
