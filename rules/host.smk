# The host's floor, checked on the GPU host before the first paid request (aerie/host_check.py): the NVIDIA driver
# against the CUDA of the SGLang environment's torch, glibc against SGLang's wheels, /dev/shm against one capture
# batch, the free disk against the disk preview, the GPUs against resources.<rule>_gpus and the fit plan, conda, the
# SGLang environment built and importable. Each used to fail hours in, after the API spend. Rule host_check runs
# before rule responses - unless host_check.api_elsewhere says the API stage may run on another machine - and before
# the first GPU job (responses_hf, hidden) in any case; those take the check file as an input, ancient there, so a
# check written again never re-runs them. It runs in SGLang's environment when a rule does (that environment's
# Python is the one that must import sglang), else in aerie's; under SLURM on a GPU node (profiles/slurm).

from dataclasses import asdict

from aerie.environments import SGLANG_SETTINGS, conda_deployment_on, uses_sglang

HOST_CHECK = "results/host/check.json"
HOST_CHECK_API_ELSEWHERE = config["host_check"]["api_elsewhere"]
# Which rules of this run wait for the check (the dry run names them).
HOST_CHECK_BEFORE = [
    consumer
    for consumer, backends in (
        ("responses", lambda b: b not in ("hf", "recorded")),
        ("responses_hf", lambda b: b == "hf"),
    )
    if any(backends(responses_config(config, name)["backend"]) for name in PLANS)
    and not (consumer == "responses" and HOST_CHECK_API_ELSEWHERE)
] + ["hidden"]


def host_check_input(consumer):
    """The check file as an input of rule ``consumer``: none for rule responses with host_check.api_elsewhere."""
    return [ancient(HOST_CHECK)] if consumer in HOST_CHECK_BEFORE else []


_HOST_NEEDS = []


def host_needs():
    """What the host check asks of the host (aerie.fit.host_needs), worked out once per parse."""
    if not _HOST_NEEDS:
        from aerie.fit import host_needs as needs

        _HOST_NEEDS.append(
            needs(
                config,
                PLANS,
                Path("results"),
                conda_deployment=conda_deployment_on(
                    workflow.deployment_settings.deployment_method
                ),
                fit=FIT if workflow.is_main_process else None,
                before=HOST_CHECK_BEFORE,
            )
        )
    return _HOST_NEEDS[0]


rule host_check:
    output:
        HOST_CHECK,
    log:
        "results/logs/host_check.log",
    benchmark:
        "results/benchmarks/host_check.tsv"
    conda:  # the Python that must import sglang when a rule runs in SGLang's environment
        (
            "../envs/sglang.yaml"
            if any(uses_sglang(config, r) for r in SGLANG_SETTINGS)
            else "../envs/aerie.yaml"
        )
    resources:
        gpu=0,
    params:
        needs=lambda wildcards: asdict(host_needs()),
    script:
        "../scripts/host_check.py"


# `snakemake -n` lists the checks and what each needs.
if workflow.is_main_process and getattr(workflow.output_settings, "dryrun", False):
    from aerie.host_check import needs_text

    print(needs_text(host_needs()), file=sys.stderr)
