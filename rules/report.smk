# Report: the figures of `snakemake --report report.html`, read from the finished artifacts (CPU, seconds).
# Only small things are read: JSONL records, JSON reports, safetensors metadata and a few sampled rows.


report: "../report/workflow.rst"


rule report_figures:
    input:
        responses=get_shards("responses", "jsonl"),
        token_reports=get_shards("tokens", "report.json"),
        hidden=get_shards("hidden", "safetensors"),
        drafters=[f"results/drafter/{name}" for name in DRAFTERS],
        bench=f"results/bench/{RUN}.json",
        # The SGLang serving benchmark runs on a GPU host, outside the workflow: shown when present.
        sglang=lambda w: [
            p for p in [f"results/bench/{RUN}.sglang.json"] if os.path.exists(p)
        ],
    output:
        spend=report(
            "results/report/spend.png",
            caption="../report/spend.rst",
            category="1. Data",
        ),
        lengths=report(
            "results/report/lengths.png",
            caption="../report/lengths.rst",
            category="1. Data",
        ),
        quality=report(
            "results/report/quality.png",
            caption="../report/quality.rst",
            category="1. Data",
        ),
        hidden=report(
            "results/report/hidden.png",
            caption="../report/hidden.rst",
            category="2. Hidden states",
        ),
        training=report(
            "results/report/training.png",
            caption="../report/training.rst",
            category="3. Drafter",
        ),
        benchmark=report(
            "results/report/benchmark.png",
            caption="../report/benchmark.rst",
            category="4. Benchmark",
        ),
    log:
        "results/logs/report/report_figures.log",
    localrule: True
    conda:
        "../envs/aerie.yaml"
    params:
        drafters=list(DRAFTERS),  # names input.drafters, in order
        # Each drafter's TensorBoard curves where they are (the training figure's caption links them).
        curves={
            name: Path(f"results/drafter/{name}/tensorboard").resolve().as_uri()
            for name in DRAFTERS
        },
    script:
        "../scripts/report_figures.py"
