# Stage 6: speculative decoding with the trained drafter vs the plain target, measured in one run.


rule bench:
    input:
        drafter="results/drafter/{run}",
        prompts=get_bench_prompts(),
        target=get_target_input(),
    output:
        "results/bench/{run}.json",
    params:
        bench=config["bench"],
        target=config["target"],
    threads: all_cores()
    resources:
        gpu=gpus("bench"),
    log:
        "results/logs/bench/{run}.log",
    benchmark:
        "results/benchmarks/bench/{run}.tsv"
    conda:
        "../envs/aerie.yaml"
    script:
        "../scripts/bench.py"
