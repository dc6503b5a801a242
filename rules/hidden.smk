# Stage 4: target hidden states at the EAGLE-3 aux layers + the final layer (stored as it is, or as the
# target's top-k next tokens), checked per shard.


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
    conda:  # SGLang capture runs in SGLang's own environment (it pins its own torch and transformers)
        (
            "../envs/sglang.yaml"
            if config["hidden"]["backend"] == "sglang"
            else "../envs/aerie.yaml"
        )
    threads: all_cores()
    resources:
        gpu=gpus("hidden"),
    params:
        hidden=config["hidden"],
        target=config["target"],
        gpus=gpus("hidden"),  # what the job needs; checked against what it is granted (aerie.gpu_slots)
    script:
        "../scripts/hidden.py"
