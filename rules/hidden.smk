# Stage 4: target hidden states at the EAGLE-3 aux layers + the final layer, checked per shard.


rule hidden:
    input:
        tokens="results/{dataset}/tokens/shard-{shard}.safetensors",
        target=get_target_input(),
    output:
        "results/{dataset}/hidden/shard-{shard}.safetensors",
    params:
        hidden=config["hidden"],
        target=config["target"],
    threads: all_cores()
    resources:
        gpu=gpus("hidden"),
    log:
        "results/logs/{dataset}/hidden/shard-{shard}.log",
    benchmark:
        "results/benchmarks/{dataset}/hidden/shard-{shard}.tsv"
    conda:
        "../envs/aerie.yaml"
    script:
        "../scripts/hidden.py"
