# Targets the pipeline builds itself; a real target (Kimi K2.5) is an existing folder and has no rule.
# - target.demo: a tiny Llama + Kimi-style tokenizer, pre-trained here on a synthetic task language;
# - target.rehearsal: Kimi K2.5's structure at toy size (DeepseekV3 MLA + MoE in Kimi's multimodal wrapper,
#   tiktoken tokenizer with Kimi's ids, custom code loaded with trust_remote_code), same task language.

if DEMO_TARGET and REHEARSAL_TARGET:
    raise WorkflowError(
        "bad configuration: target.demo and target.rehearsal both ask the pipeline to build the target; keep one"
    )


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


if REHEARSAL_TARGET:

    rule rehearsal_target:
        output:
            directory(TARGET),
        log:
            "results/logs/rehearsal_target.log",
        benchmark:
            "results/benchmarks/rehearsal_target.tsv"
        conda:
            "../envs/aerie.yaml"
        threads: all_cores()
        params:
            rehearsal=config["target"]["rehearsal"],
        script:
            "../scripts/build_rehearsal_target.py"
