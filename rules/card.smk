# The published drafter: after the benchmark, one folder to `hf upload` - the drafter's files (hard links), the
# benchmark report and the full model card (Hub metadata, the benchmark table per prompt set, training data and
# spend; aerie/model_card.py, docs/model-card.md). The drafter job's own card (results/drafter/{run}/README.md,
# training facts only) is written by that job into its own output; this rule writes only its own folder.


rule model_card:
    input:
        drafter="results/drafter/{run}",
        bench="results/bench/{run}.json",
        hidden=get_shards("hidden", "safetensors"),
        responses=get_shards("responses", "jsonl"),
    output:
        directory("results/publish/{run}"),
    log:
        "results/logs/card/{run}.log",
    localrule: True
    conda:
        "../envs/aerie.yaml"
    params:
        card=config["card"],
        target=lambda w: TARGET,
        sglang=config.get("sglang") or {},
    script:
        "../scripts/model_card.py"
