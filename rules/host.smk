# The host's floor, checked on the GPU host before the first paid request (aerie/preview/host.py): the NVIDIA driver
# against the CUDA of the SGLang environment's torch, glibc against SGLang's wheels, /dev/shm against one capture
# batch, the free disk against the disk preview, the GPUs against resources.<rule>_gpus and the fit plan, conda, the
# SGLang environment built and importable. Each used to fail hours in, after the API spend. Rule host_check runs
# before rule responses - unless host_check.api_elsewhere says the API stage may run on another machine - and rule
# responses_hf, else before rule hidden (aerie.preview.host.check_consumers); those take the check file as an input,
# ancient there, so a check written again never re-runs them. It runs in SGLang's environment when a rule does (that environment's
# Python is the one that must import sglang), else in aerie's; under SLURM on a GPU node (profiles/slurm).

from dataclasses import asdict

from aerie.plan.environments import SGLANG_SETTINGS, conda_deployment_on, uses_sglang
from aerie.preview.fit import host_needs
from aerie.preview.host import check_consumers

HOST_CHECK = "results/host/check.json"
# Which rules of this run wait for the check (the dry run names them).
HOST_CHECK_BEFORE = check_consumers(
    [responses_config(config, name)["backend"] for name in PLANS],
    config["host_check"]["api_elsewhere"],
)


# The check file as an input of each of those rules (`HOST_CHECK_INPUTS.get(rule, [])` in its input).
HOST_CHECK_INPUTS = {consumer: [ancient(HOST_CHECK)] for consumer in HOST_CHECK_BEFORE}
# What the check asks of the host (aerie.preview.fit.host_needs; a SLURM job's own parse has no FIT: it plans again).
HOST_NEEDS = lambda: host_needs(
    config,
    PLANS,
    Path("results"),
    conda_deployment=conda_deployment_on(
        workflow.deployment_settings.deployment_method
    ),
    fit=FIT if workflow.is_main_process else None,
    before=HOST_CHECK_BEFORE,
)


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
        needs=lambda wildcards: asdict(HOST_NEEDS()),
    script:
        "../scripts/host_check.py"


# `snakemake -n` lists the checks and what each needs; the conda environments are built before rule host_check
# can run, so an SGLang environment this machine cannot build is said now.
if workflow.is_main_process:
    from aerie.preview.host import env_build_warning, glibc_version, needs_text

    if getattr(workflow.output_settings, "dryrun", False):
        print(needs_text(HOST_NEEDS()), file=sys.stderr)
    if conda_deployment_on(workflow.deployment_settings.deployment_method) and (
        warning := env_build_warning(HOST_NEEDS(), glibc_version())
    ):
        print(warning, file=sys.stderr)
