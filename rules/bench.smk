# Stage 6: speculative decoding with every trained drafter of the run (DRAFTERS, any kind) and the reference drafters
# vs the plain target, measured in one run on the same prompts; each trained drafter is gated on its own
# (bench.gate), and the job fails when none pays off.
#
# bench.backend inprocess: aerie decodes with the target in the job (it must fit the job's GPUs), each drafter
# through its kind; sglang: SGLang serves the target (no drafter, each drafter with its kind's flags, SGLang's
# NGRAM reference), in SGLang's environment. Same report, plot and gate either way (aerie/benchmark/).

from aerie.prompts.bench_sets import SETS_DIR, bench_set_files
from aerie.plan.bench import check_bench_config
from aerie.plan.environments import conda_directive, rule_environment_check

try:
    # Reference drafter folders that are here are checked against the target; the others are named by the dry run.
    BENCH_REFERENCES = check_bench_config(config, Path.cwd(), drafters=list(DRAFTERS))
except ValueError as e:
    raise WorkflowError(f"bad configuration: {e}") from None

if workflow.is_main_process and getattr(workflow.output_settings, "dryrun", False):
    from aerie.preview.bench import bench_preview_text

    print(bench_preview_text(config, BENCH_REFERENCES), file=sys.stderr)


# A benchmark set of bench.sets (the published cards' MT-Bench, GSM8K test, HumanEval): its prompts, without any the
# training datasets hold (aerie.prompts.bench_sets).
rule bench_set:
    output:
        f"{SETS_DIR}/{{set}}.jsonl",
    log:
        "results/logs/bench/sets/{set}.log",
    localrule: True
    conda:
        "../envs/aerie.yaml"
    params:
        cache=PROMPT_CACHE,
    script:
        "../scripts/bench_set.py"


rule bench:
    input:
        # every trained drafter, in DRAFTERS' order (params.drafters names them)
        drafters=[f"results/drafter/{name}" for name in DRAFTERS],
        prompts=get_bench_prompts() + bench_set_files(config),
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
        drafters=list(DRAFTERS),
        # bench.* resolved (aerie.plan.resolve.bench_settings): decoding, references as configured, the gate
        bench=bench_settings(config),
        target=config["target"],
        sglang=config.get("sglang") or {},
        gpus=gpus("bench"),  # what the job needs; checked against what it is granted (aerie.tools.gpu_slots)
    script:
        "../scripts/bench.py"
