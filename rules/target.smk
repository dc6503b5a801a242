# Targets the pipeline builds itself; a real target (Kimi K2.5) is an existing folder and has no rule.
# - target.demo: a tiny Llama + Kimi-style tokenizer, pre-trained here on a synthetic task language;
# - target.rehearsal: Kimi K2.5's structure at toy size (DeepseekV3 MLA + MoE in Kimi's multimodal wrapper,
#   tiktoken tokenizer with Kimi's ids, custom code loaded with trust_remote_code), same task language.
# Every target's tokenizer is checked (rule tokenizer_check, at the end).

from aerie.target_model.markers import package_version, tokenizer_files

if TARGET_BUILDER is not None:

    # One rule per builder (aerie.targets: target.demo -> rule demo_target, target.rehearsal -> rehearsal_target).
    rule:
        name:
            TARGET_BUILDER.rule
        output:
            directory(TARGET),
        log:
            f"results/logs/{TARGET_BUILDER.rule}.log",
        benchmark:
            f"results/benchmarks/{TARGET_BUILDER.rule}.tsv"
        conda:
            "../envs/aerie.yaml"
        threads: all_cores()
        params:
            builder=TARGET_BUILDER.key,
            settings=config["target"][TARGET_BUILDER.key],
        script:
            "../scripts/build_target.py"


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
