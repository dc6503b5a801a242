# Stage 6: speculative decoding with the trained drafter (and two reference drafters) vs the plain
# target, measured in one run; the job fails when the drafter does not pay off (bench.gate).


rule bench:
    input:
        drafter="results/drafter/{run}",
        prompts=get_bench_prompts(),
        target=get_target_input(),
    output:
        report="results/bench/{run}.json",
        plot=report(
            "results/bench/{run}.png",
            caption="../report/bench_plot.rst",
            category="4. Benchmark",
        ),
    log:
        "results/logs/bench/{run}.log",
    benchmark:
        "results/benchmarks/bench/{run}.tsv"
    conda:
        "../envs/aerie.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("bench"),
    params:
        bench=config["bench"],
        target=config["target"],
        gpus=gpus("bench"),  # what the job needs; checked against what it is granted (aerie.gpu_slots)
    script:
        "../scripts/bench.py"
