# Stage 3: exact token ids + loss masks over the generated part, with a fidelity report per shard.


rule tokens:
    input:
        responses="results/{dataset}/responses/shard-{shard}.jsonl",
        target=get_target_input(),
    output:
        tokens="results/{dataset}/tokens/shard-{shard}.safetensors",
        report="results/{dataset}/tokens/shard-{shard}.report.json",
    log:
        "results/logs/{dataset}/tokens/shard-{shard}.log",
    benchmark:
        "results/benchmarks/{dataset}/tokens/shard-{shard}.tsv"
    conda:
        "../envs/aerie.yaml"
    threads: config["tokens"]["threads"]
    params:
        tokens=config["tokens"],
        target=config["target"],
    script:
        "../scripts/tokens.py"
