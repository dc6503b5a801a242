# Stage 6: speculative decoding with the trained drafter (and reference drafters) vs the plain target,
# measured in one run; the job fails when the drafter does not pay off (bench.gate).
#
# bench.backend inprocess: aerie decodes with the target in the job (it must fit the job's GPUs);
# sglang: SGLang serves the target (no drafter, the trained drafter with the sglang: EAGLE-3 flags, SGLang's
# NGRAM reference), in SGLang's environment. Same report, plot and gate either way (aerie/bench/).

from aerie.bench.settings import check_bench_config
from aerie.environments import conda_directive, rule_environment_check

try:
    check_bench_config(config)
except ValueError as e:
    raise WorkflowError(f"bad configuration: {e}") from None


rule bench:
    input:
        drafter="results/drafter/{run}",
        prompts=get_bench_prompts(),
        target=get_target_input(),
        # No file: while the DAG is built, before any job, refuses bench.backend sglang outside SGLang's env.
        environment=rule_environment_check(workflow, config, "bench"),
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
        conda_directive(config, "bench")
    threads: all_cores()
    resources:
        gpu=gpus("bench"),
    params:
        bench=config["bench"],
        target=config["target"],
        sglang=config.get("sglang") or {},
        gpus=gpus("bench"),  # what the job needs; checked against what it is granted (aerie.gpu_slots)
    script:
        "../scripts/bench.py"
