# Stage 3: exact token ids + loss masks over the generated part, with a fidelity report per shard.


rule tokens:
    input:
        responses="results/{dataset}/responses/shard-{shard}.jsonl",
        target=get_target_input(),
    output:
        tokens="results/{dataset}/tokens/shard-{shard}.safetensors",
        report="results/{dataset}/tokens/shard-{shard}.report.json",
    params:
        tokens=config["tokens"],
        target=TARGET,
    log:
        "results/logs/{dataset}/tokens/shard-{shard}.log",
    conda:
        "../envs/aerie.yaml"
    script:
        "../scripts/tokens.py"
