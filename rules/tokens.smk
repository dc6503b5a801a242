# Stage 3: exact token ids + loss masks over the generated part, with a fidelity report per shard.

from aerie.tokens.reasoning import requested_by_config


rule tokens:
    input:
        responses="results/{dataset}/responses/shard-{shard}.jsonl",
        target=get_target_input(),
        tokenizer_check=ancient(TOKENIZER_CHECK),
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
        # tokens.* resolved (aerie.plan.resolve.token_settings)
        settings=token_settings(config),
        target=config["target"],
        # reasoning asked of the target (its missing reasoning is missing data); a record's own flags say it first
        reasoning_requested=lambda w: requested_by_config(get_responses_config(w)),
    script:
        "../scripts/tokens.py"
