"""Each rule's environment (aerie/plan/environments.py, envs/): which env a rule gets, the refusal's words, and whether
the env files would let the rules run - aerie's lists the package's dependencies, SGLang's (with what SGLang 0.5.23
itself requires, tests/fixtures/sglang/requirements_0523.txt) covers every package the SGLang rules import."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from aerie.plan import environments as env

SGLANG_REQUIREMENTS = Path(__file__).parent / "fixtures" / "sglang" / "requirements_0523.txt"


def test_rule_env_and_refusal() -> None:
    config = {"hidden": {"backend": "sglang"}, "bench": {"backend": "inprocess"}}
    assert env.conda_directive(config, "hidden") == "../envs/sglang.yaml"
    assert env.rule_env(config, "bench") == env.rule_env(config, "tokens") == "envs/aerie.yaml"
    from snakemake_interface_executor_plugins.settings import DeploymentMethod

    assert env.conda_deployment_on({DeploymentMethod.CONDA}) and env.conda_deployment_on(["conda"])
    assert not env.conda_deployment_on({DeploymentMethod.APPTAINER}) and not env.conda_deployment_on(set())
    why = env.sglang_env_refusal(config, "hidden", conda_deployment=False, sglang_available=False)
    assert why.startswith("hidden.backend: sglang runs rule hidden in SGLang's own environment (envs/sglang.yaml)")
    assert "set hidden.backend: hf" in why and "profiles/gpu-host" in why
    assert env.sglang_env_refusal(config, "hidden", conda_deployment=True, sglang_available=False) is None
    assert env.sglang_env_refusal(config, "hidden", conda_deployment=False, sglang_available=True) is None
    assert env.sglang_env_refusal(config, "bench", conda_deployment=False, sglang_available=False) is None


def env_pip(name: str) -> list[str]:
    spec = yaml.safe_load((REPO / "envs" / name).read_text())
    (pip,) = [d["pip"] for d in spec["dependencies"] if isinstance(d, dict)]
    return pip


def dist_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)).lower()


def test_aerie_env_lists_the_package_dependencies() -> None:
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(re.sub(r"\s", "", d) for d in env_pip("aerie.yaml")) == sorted(re.sub(r"\s", "", d) for d in deps)


def installed_closure(roots: set[str]) -> set[str]:
    """``roots`` and, for those installed here, everything they require (markers and extras aside)."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [dist_name(r) for r in requires if "extra ==" not in r]
    return seen


# What the SGLang rules' jobs import: rule bench's script with bench.backend sglang (the serving backend, the harness
# and its client, the target's chat template, the plot), and rule hidden's with hidden.backend sglang.
SGLANG_RULE_MODULES = {
    "bench": [
        "aerie.tools.gpu_slots",
        "aerie.tools.rulelog",
        "aerie.benchmark.job",
        "aerie.benchmark.serving",
        "aerie.benchmark.sglang_harness",
        "aerie.benchmark.sglang_client",
        "aerie.target_model.model",
        "aerie.target_model.template",
        "aiohttp",
        "transformers",
        "matplotlib.pyplot",
    ],
    "hidden": ["aerie.tools.gpu_slots", "aerie.tools.rulelog", "aerie.hidden", "aerie.hidden.sglang"],
}
PROBE = """
import importlib, importlib.metadata as md, json, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
dists = md.packages_distributions()
tops = {n.split(".")[0] for n in sys.modules} - set(sys.stdlib_module_names)
print(json.dumps(sorted({d for t in tops for d in dists.get(t, [])} - {"aerie"})))
"""


@pytest.mark.parametrize("rule", sorted(SGLANG_RULE_MODULES))
def test_sglang_env_has_what_its_rules_import(rule: str) -> None:
    import json

    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *SGLANG_RULE_MODULES[rule]], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    imported = {dist_name(d) for d in json.loads(proc.stdout)}
    sglang_reqs = {dist_name(line) for line in SGLANG_REQUIREMENTS.read_text().splitlines() if line[:1].isalnum()}
    assert {"torch", "transformers", "aiohttp", "requests"} <= sglang_reqs
    provided = installed_closure({dist_name(r) for r in env_pip("sglang.yaml")} | sglang_reqs)
    missing = sorted(imported - provided)
    assert not missing, f"rule {rule} imports {missing}, which neither envs/sglang.yaml nor sglang 0.5.23 brings"
