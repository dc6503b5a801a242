# Stage 5: the draft vocabulary (for the drafter kinds that have one: EAGLE-3) from loss-masked token frequencies,
# then each of the run's drafters (aerie.plan.drafters: its kind, aerie.drafter_kinds) trained on every hidden shard.


rule draft_vocab:
    input:
        tokens=get_shards("tokens", "safetensors"),
        target=get_target_input(),
        init=get_drafter_init(None),
    output:
        "results/vocab/draft_vocab.safetensors",
    log:
        "results/logs/vocab/draft_vocab.log",
    benchmark:
        "results/benchmarks/vocab/draft_vocab.tsv"
    conda:
        "../envs/aerie.yaml"
    params:
        # vocab.* resolved (aerie.plan.resolve.vocab_settings): the size, and a warm start's keep / follow / auto
        settings=vocab_settings(config),
        # warm start: the folder's vocab, kept or following the data
        drafter={"init": VOCAB_INITS[0] if VOCAB_INITS else ""},
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
        vocab=get_drafter_vocab,
        target=get_target_input(),
        init=get_drafter_init,
    output:
        directory("results/drafter/{drafter}"),
    log:
        "results/logs/drafter/{drafter}.log",
    benchmark:
        "results/benchmarks/drafter/{drafter}.tsv"
    conda:
        "../envs/aerie.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("drafter"),
    params:
        drafter=lambda w: DRAFTERS[w.drafter].section,  # its resolved settings (its kind's keys included)
        target=lambda w: TARGET,
        aux_layer_ids=config["hidden"]["aux_layer_ids"],  # checked against every hidden shard
        card=config["card"],  # the exported folder's README.md (aerie/publish/card.py)
        sglang=config.get("sglang") or {},  # its serve command
    script:
        "../scripts/drafter.py"
