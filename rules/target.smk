# Targets the pipeline builds itself; a real target (Kimi K2.5) is an existing folder and has no rule.
# - target.demo: a tiny Llama + Kimi-style tokenizer, pre-trained here on a synthetic task language;
# - target.rehearsal: Kimi K2.5's structure at toy size (DeepseekV3 MLA + MoE in Kimi's multimodal wrapper,
#   tiktoken tokenizer with Kimi's ids, custom code loaded with trust_remote_code), same task language.
# Every target's tokenizer is checked (rule tokenizer_check, at the end).

from aerie.target_model.markers import package_version, tokenizer_files

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


# The target's tokenizer as loaded must keep each special marker its chat template writes one id (<think>, the
# turn end, tool-call markers: aerie.target_model.markers). Checked once per run, before any responses job (no API
# request is paid on a target whose tokenizer splits one) and any tokens job, which take the check file as an
# input; ancient there, so checking again (a new transformers, changed tokenizer files) never re-runs them.
TOKENIZER_CHECK = "results/target/tokenizer_check.json"


rule tokenizer_check:
    input:
        get_target_input() or tokenizer_files(TARGET),
    output:
        TOKENIZER_CHECK,
    log:
        "results/logs/tokenizer_check.log",
    benchmark:
        "results/benchmarks/tokenizer_check.tsv"
    localrule: True
    conda:
        "../envs/aerie.yaml"
    params:
        target=config["target"],
        # a transformers upgrade checks again (a params change re-runs the rule; read without importing it)
        transformers=package_version("transformers"),
    script:
        "../scripts/tokenizer_check.py"
