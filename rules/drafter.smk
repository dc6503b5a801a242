# Stage 5: draft vocabulary from loss-masked token frequencies, then EAGLE-3 drafter training.


rule draft_vocab:
    input:
        tokens=get_shards("tokens", "safetensors"),
        target=get_target_input(),
        init=get_drafter_init(),
    output:
        "results/vocab/draft_vocab.safetensors",
    log:
        "results/logs/vocab/draft_vocab.log",
    benchmark:
        "results/benchmarks/vocab/draft_vocab.tsv"
    conda:
        "../envs/aerie.yaml"
    params:
        vocab=config["vocab"],
        drafter={"init": config["drafter"].get("init", "")},  # warm start: the folder's vocab, not counted
        target=lambda w: TARGET,
    script:
        "../scripts/draft_vocab.py"


# Training runs in the job's process, or as torchrun processes (one per GPU, DDP) when resources.gpu > 1
# and CUDA sees more than one GPU. A killed or failed job resumes from its last checkpoint on the next run:
# the state lives beside the declared output, in results/drafter/.{run}.train_state/ (Snakemake deletes a
# failed job's outputs, never that folder); it is removed when training completes, except last/ and best/.
rule drafter:
    input:
        hidden=get_shards("hidden", "safetensors"),
        vocab="results/vocab/draft_vocab.safetensors",
        target=get_target_input(),
        init=get_drafter_init(),
    output:
        directory("results/drafter/{run}"),
    log:
        "results/logs/drafter/{run}.log",
    benchmark:
        "results/benchmarks/drafter/{run}.tsv"
    conda:
        "../envs/aerie.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("drafter"),
    params:
        drafter=config["drafter"],
        target=lambda w: TARGET,
        aux_layer_ids=config["hidden"]["aux_layer_ids"],  # checked against every hidden shard
        card=config["card"],  # the exported folder's README.md (aerie/model_card.py)
        sglang=config.get("sglang") or {},  # its serve command
    script:
        "../scripts/drafter.py"
