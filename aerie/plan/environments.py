"""Which software environment each rule runs in, checked when the workflow is parsed, before any job runs.

aerie has two environments (``envs/``): its own (``envs/aerie.yaml``) and SGLang's (``envs/sglang.yaml``, GPU host
only). They cannot merge: SGLang 0.5.23 pins transformers 5.19.0 and its own torch, aerie needs transformers >= 5.20.
A rule whose setting selects SGLang (:data:`SGLANG_SETTINGS`: ``hidden.backend``, ``bench.backend``) declares
``envs/sglang.yaml`` as its ``conda:`` environment, every other rule ``envs/aerie.yaml``. Snakemake only uses them
with conda deployment on (``software-deployment-method: conda`` in ``profiles/gpu-host`` and ``profiles/slurm``, or
``--sdm conda``); without it a job runs in Snakemake's own Python, where an SGLang rule works only if ``sglang``
imports. Anything else would fail at the capture or the benchmark, after the paid responses: :func:`sglang_env_refusal`
says so while the workflow is parsed instead, naming the setting and the fixes.

How ``aerie`` itself reaches a job in either environment: ``rules/common.smk`` puts the checkout first on Snakemake's
``sys.path``, and Snakemake's script preamble appends that ``sys.path`` to the job's (Snakemake strips ``PYTHONPATH``
inside conda environments unless told not to), so the environments list only aerie's third-party dependencies.

Torch-free: imported while Snakemake parses the workflow.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from aerie.formats.backends import STAGE_BACKENDS, stage_backend

AERIE_ENV = "envs/aerie.yaml"
SGLANG_ENV = "envs/sglang.yaml"
# The rules whose backend setting can move them into SGLang's environment (aerie.formats.backends).
SGLANG_SETTINGS = tuple(
    rule for rule, (backends, _) in STAGE_BACKENDS.items() if any(b.in_sglang for b in backends.values())
)


def _setting(config: Mapping[str, Any], rule: str) -> tuple[str, Any]:
    backend = stage_backend(config, rule)
    return backend.setting, backend.name


def _outside_sglang(rule: str) -> str:
    """A backend of ``rule`` that runs in aerie's own environment, for the message."""
    return next(name for name, b in STAGE_BACKENDS[rule][0].items() if not b.in_sglang)


def uses_sglang(config: Mapping[str, Any], rule: str) -> bool:
    """Whether ``rule``'s job runs in SGLang's environment under this config."""
    return rule in SGLANG_SETTINGS and stage_backend(config, rule).in_sglang


def rule_env(config: Mapping[str, Any], rule: str) -> str:
    """The environment file of ``rule``, relative to the workflow's root: SGLang's or aerie's."""
    return SGLANG_ENV if uses_sglang(config, rule) else AERIE_ENV


def conda_directive(config: Mapping[str, Any], rule: str) -> str:
    """The ``conda:`` value of ``rule`` in ``rules/*.smk`` (paths there are relative to the rule file)."""
    return "../" + rule_env(config, rule)


def conda_deployment_on(methods: Iterable[Any]) -> bool:
    """Whether Snakemake's ``deployment_settings.deployment_method`` (a set of enums or names) includes conda."""
    return any(getattr(m, "name", str(m)).lower() == "conda" for m in methods)


def preview_without_conda(workflow: Any) -> str | None:
    """Under ``snakemake -n`` with conda deployment on and no ``conda`` on PATH (a laptop looking at the price
    first): the message that ends the dry run cleanly after aerie's previews, which need no conda. Snakemake itself
    would go on to ask conda where its environments live while it builds the DAG and fail there. None otherwise."""
    if not getattr(workflow.output_settings, "dryrun", False) or not workflow.is_main_process:
        return None
    if not conda_deployment_on(workflow.deployment_settings.deployment_method) or shutil.which("conda"):
        return None
    return (
        "aerie preview: complete above (shard plan, money, recorded responses, disk, fit, time). conda is not on PATH "
        "here, so Snakemake cannot list the jobs of a conda-deployment profile (it asks conda for its environments "
        "while it builds the DAG); this dry run ends here, nothing run, nothing spent. On the GPU host install conda "
        "(e.g. Miniforge) and run the same command to see the jobs."
    )


def sglang_importable() -> bool:
    """Whether this Python (Snakemake's, which runs jobs when conda deployment is off) can import sglang."""
    return importlib.util.find_spec("sglang") is not None


def sglang_env_refusal(
    config: Mapping[str, Any], rule: str, *, conda_deployment: bool, sglang_available: bool
) -> str | None:
    """Why ``rule`` cannot run in SGLang's environment as configured (None: it can, or it does not need it)."""
    if not uses_sglang(config, rule) or conda_deployment or sglang_available:
        return None
    setting, _ = _setting(config, rule)
    return (
        f"{setting}: sglang runs rule {rule} in SGLang's own environment ({SGLANG_ENV}), but conda deployment is off "
        f"and sglang is not importable by this Python ({sys.executable}): the job would fail after every job before "
        "it had run (and been paid for). Run with a profile that enables conda deployment (--workflow-profile "
        "profiles/gpu-host or profiles/slurm), or add --software-deployment-method conda; or install sglang==0.5.23 "
        f"into this environment; or set {setting}: {_outside_sglang(rule)}"
    )


def environment_line(config: Mapping[str, Any], rule: str, *, conda_deployment: bool) -> str:
    """One line for ``snakemake -n``: where ``rule``'s job will run."""
    setting, value = _setting(config, rule)
    if not conda_deployment:
        where = "Snakemake's own Python (conda deployment off)"
    else:
        where = rule_env(config, rule) + " (conda deployment on)"
    return f"aerie environment: rule {rule} ({setting}: {value}) runs in {where}"


def rule_environment_check(workflow: Any, config: Mapping[str, Any], rule: str) -> Callable[[Any], list[str]]:
    """An input function for ``rules/<rule>.smk`` that adds no input: Snakemake calls it while it builds the DAG,
    before any job runs and only when the plan holds a job of ``rule`` (a pilot that only asks for responses shards
    is not refused). It raises ValueError with :func:`sglang_env_refusal`'s reason, and under ``snakemake -n``
    prints once where an SGLang rule's job will run."""
    printed: list[bool] = []

    def check(_wildcards: Any) -> list[str]:
        conda = conda_deployment_on(workflow.deployment_settings.deployment_method)
        refusal = sglang_env_refusal(config, rule, conda_deployment=conda, sglang_available=sglang_importable())
        if refusal:
            raise ValueError(refusal)
        dry = getattr(workflow.output_settings, "dryrun", False)
        if uses_sglang(config, rule) and dry and workflow.is_main_process and not printed:
            printed.append(True)
            print(environment_line(config, rule, conda_deployment=conda), file=sys.stderr)
        return []

    return check
