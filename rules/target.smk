# The demo target: a tiny Llama + Kimi-style tokenizer, pre-trained here on a synthetic task language.
# A real target (Kimi K2.5) is an existing folder and has no rule.


if DEMO_TARGET:

    rule demo_target:
        output:
            directory(TARGET),
        log:
            "results/logs/demo_target.log",
        benchmark:
            "results/benchmarks/demo_target.tsv"
        conda:
            "../envs/aerie.yaml"
        threads: all_cores()
        params:
            demo=config["target"]["demo"],
        script:
            "../scripts/build_demo_target.py"
