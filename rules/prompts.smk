# Stage 1: prompt sources -> fixed-size shards (+ the held-out benchmark prompts).


# Both rules only cut JSONL into shards (well under a second): they run where snakemake runs, never as
# cluster jobs.
rule prompts:
    input:
        get_prompt_source,
    output:
        "results/{dataset}/prompts/shard-{shard}.jsonl",
    log:
        "results/logs/{dataset}/prompts/shard-{shard}.log",
    localrule: True
    conda:
        "../envs/aerie.yaml"
    params:
        dataset=lambda w: config["datasets"][w.dataset],
        range=lambda w: PLANS[w.dataset].shard_range(int(w.shard)),
        order=lambda w: PLANS[w.dataset].order(),  # a quota'd dataset's seeded sample
        cache=PROMPT_CACHE,
    script:
        "../scripts/prompts.py"


rule bench_prompts:
    input:
        get_prompt_source,
    output:
        "results/{dataset}/prompts/bench.jsonl",
    log:
        "results/logs/{dataset}/prompts/bench.log",
    localrule: True
    conda:
        "../envs/aerie.yaml"
    params:
        dataset=lambda w: config["datasets"][w.dataset],
        range=lambda w: PLANS[w.dataset].bench_range(),
        order=None,  # the held-out prompts are the source's last ones
        cache=PROMPT_CACHE,
    script:
        "../scripts/prompts.py"
