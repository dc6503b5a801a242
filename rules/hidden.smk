# Stage 4: target hidden states at the EAGLE-3 aux layers + the final layer, checked per shard.


rule hidden:
    input:
        tokens="results/{dataset}/tokens/shard-{shard}.safetensors",
        target=get_target_input(),
    output:
        "results/{dataset}/hidden/shard-{shard}.safetensors",
    log:
        "results/logs/{dataset}/hidden/shard-{shard}.log",
    benchmark:
        "results/benchmarks/{dataset}/hidden/shard-{shard}.tsv"
    conda:
        "../envs/aerie.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("hidden"),
    params:
        hidden=config["hidden"],
        target=config["target"],
        gpus=gpus("hidden"),  # what the job needs; checked against what it is granted (aerie.gpu_slots)
    script:
        "../scripts/hidden.py"
