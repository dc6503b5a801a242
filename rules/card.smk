# The published drafters: after the benchmark, one folder per trained drafter to `hf upload` - the drafter's files
# (hard links, no dotfiles: the output is a link to results/publish/{drafter}.files, which Snakemake marks with no
# .snakemake_timestamp), the run's benchmark report and the full model card (Hub metadata, its kind, its gate
# verdict and which drafter the run recommends serving, the benchmark table per prompt set, training data and spend;
# aerie/publish/card.py, docs/model-card.md) - and the card as a page of the HTML report. The drafter job's own card
# (results/drafter/{drafter}/README.md, training facts only) is written by that job into its own output; this rule
# writes only its own files.


rule model_card:
    input:
        drafter="results/drafter/{drafter}",
        bench=f"results/bench/{RUN}.json",
        hidden=get_shards("hidden", "safetensors"),
        responses=get_shards("responses", "jsonl"),
    output:
        folder=directory("results/publish/{drafter}"),
        page=report(
            "results/report/cards/{drafter}.html",
            caption="../report/card.rst",
            category="5. Published drafters",
            labels={"drafter": "{drafter}", "page": "model card"},
        ),
    log:
        "results/logs/card/{drafter}.log",
    localrule: True
    conda:
        "../envs/aerie.yaml"
    params:
        card=config["card"],
        target=lambda w: TARGET,
        sglang=config.get("sglang") or {},
    script:
        "../scripts/model_card.py"
