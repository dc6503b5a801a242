# Stage 6: speculative decoding with the trained drafter (and two reference drafters) vs the plain
# target, measured in one run; the job fails when the drafter does not pay off (bench.gate).


rule bench:
    input:
        drafter="results/drafter/{run}",
        prompts=get_bench_prompts(),
        target=get_target_input(),
    output:
        report="results/bench/{run}.json",
        plot="results/bench/{run}.png",
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
