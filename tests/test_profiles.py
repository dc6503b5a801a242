"""Profiles: `snakemake -n --workflow-profile profiles/{gpu-host,slurm}` on the Kimi K2.5 example config
resolves, per rule, the resources and threads the profile says (and at least the GPUs the config's rules
need); profiles/default finds the GPU count the same way as aerie.tools.gpu_slots.

The prompt files of the Kimi config are small stand-ins written here.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conda_stand_in import conda_on_path
from conftest import REPO

from aerie.tools import gpu_slots

PROFILES = REPO / "profiles"
# Rules whose GPU count comes from config resources.<rule>_gpus.
GPU_RULES = ("responses", "hidden", "drafter", "bench")


def kimi_workdir(workdir: Path) -> Path:
    """The Kimi example config with 3-row local stand-ins for its datasets; returns the config path."""
    from test_prompt_sources import kimi_stand_in_config

    config = kimi_stand_in_config(workdir, rows=3)
    for ds in config["datasets"].values():
        ds["shard_size"] = 2
        ds.pop("max_prompts", None)
        if ds.get("bench_prompts"):
            ds["bench_prompts"] = 3
    path = workdir / "kimi.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def parse_jobs(out: str) -> list[dict]:
    """Each job of a dry run: its rule, threads (1 when not printed) and resources (as printed)."""
    jobs = []
    for block in re.split(r"^\[.*\]\n(?=(?:local)?rule )", out, flags=re.M)[1:]:
        rule = re.match(r"(?:local)?rule (\w+):", block).group(1)
        threads = re.search(r"^\s+threads: (\d+)$", block, flags=re.M)
        res = re.search(r"^\s+resources: (.*)$", block, flags=re.M)
        resources = dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {}
        jobs.append({"rule": rule, "threads": int(threads.group(1)) if threads else 1, "resources": resources})
    return jobs


def expected(profile: dict, rule: str) -> tuple[dict, int | None]:
    res = {**(profile.get("default-resources") or {}), **(profile.get("set-resources") or {}).get(rule, {})}
    threads = (profile.get("set-threads") or {}).get(rule)
    if threads is not None:
        threads = min(threads, profile["cores"]) if isinstance(profile.get("cores"), int) else threads
    return res, threads


def dry_run(workdir: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "-n", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def check_profile(name: str, workdir: Path, *extra: str) -> str:
    profile = yaml.safe_load((PROFILES / name / "profile.yaml").read_text())
    configfile = kimi_workdir(workdir)
    config = yaml.safe_load(configfile.read_text())
    # The profile enables conda deployment, and even a dry run asks conda where it keeps environments.
    rc, out = dry_run(
        workdir,
        "--workflow-profile",
        str(PROFILES / name),
        *extra,
        "--configfile",
        str(configfile),
        env=conda_on_path(workdir.parent),
    )
    assert rc == 0, out
    jobs = parse_jobs(out)
    rules = {j["rule"] for j in jobs}
    assert {"prompts", "responses", "tokens", "hidden", "draft_vocab", "drafter", "bench"} <= rules, rules
    table = {}
    for job in jobs:
        rule = job["rule"]
        if rule == "all":
            continue
        want, threads = expected(profile, rule)
        got = job["resources"]
        for key, value in want.items():
            assert got.get(key) == str(value), f"{name}: rule {rule}: {key}={got.get(key)}, profile says {value}"
        if threads is not None:
            assert job["threads"] == threads, f"{name}: rule {rule}: threads {job['threads']}, profile says {threads}"
        if rule in GPU_RULES:
            needed = config["resources"][f"{rule}_gpus"]
            if rule == "responses" and config["responses"]["backend"] != "hf":
                needed = 0  # an API backend needs no GPU
            assert int(got.get("gpu", 0)) >= needed, f"{name}: rule {rule} gets gpu={got.get('gpu')}, needs {needed}"
            if "gpu" not in want:
                assert int(got["gpu"]) == needed  # left to the config
        table[rule] = (
            job["threads"],
            {k: got[k] for k in ("gpu", "gpu_model", "mem_mb", "runtime", "slurm_partition") if k in got},
        )
    print(f"\n{name}: " + "\n".join(f"  {rule}: threads={t} {r}" for rule, (t, r) in sorted(table.items())))
    return out


def test_gpu_host_profile_resolves_per_rule_resources_and_environments(workdir: Path) -> None:
    """README step 6 as written, dry: each SGLang rule of the Kimi config in SGLang's env, nothing refused."""
    # --cores as on the host (the profile says `all`, which is 2 here and would cap the threads).
    out = check_profile("gpu-host", workdir, "--cores", "128")
    profile = yaml.safe_load((PROFILES / "gpu-host" / "profile.yaml").read_text())
    assert profile["resources"]["gpu"] == 8 and profile["rerun-triggers"] == ["mtime", "input"]
    assert_sglang_envs(out)


def test_the_preview_runs_where_conda_is_not(workdir: Path) -> None:
    """README's preview command (the GPU profile: conda deployment) on a machine without conda: every preview is
    printed and the dry run ends cleanly saying why the job list is not, instead of Snakemake's conda failure."""
    path = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "conda").exists()]
    env = {**os.environ, "PATH": os.pathsep.join(path)}
    configfile = str(kimi_workdir(workdir))
    rc, out = dry_run(workdir, "--workflow-profile", str(PROFILES / "gpu-host"), "--configfile", configfile, env=env)
    assert rc == 0, out
    previews = ("aerie shard plan", "aerie cost preview", "aerie disk preview", "aerie fit plan", "time preview")
    for preview in (*previews, "aerie benchmark: backend"):  # rules/bench.smk's part too
        assert preview in out, (preview, out)
    assert "conda is not on PATH here" in out and "nothing run, nothing spent" in out, out
    assert "Is conda installed" not in out and "Job stats" not in out
    # With conda there, the same command lists the jobs (the message is not printed).
    rc, out = dry_run(
        workdir, "--workflow-profile", str(PROFILES / "gpu-host"), "--configfile", configfile,
        env=conda_on_path(workdir.parent),
    )  # fmt: skip
    assert rc == 0 and "Job stats" in out and "conda is not on PATH" not in out, out


def assert_sglang_envs(out: str) -> None:
    for rule, setting in (("hidden", "hidden.backend"), ("bench", "bench.backend")):
        assert (
            f"aerie environment: rule {rule} ({setting}: sglang) runs in envs/sglang.yaml (conda deployment on)" in out
        )
    assert re.search(r"^Conda environment \S*envs/sglang\.yaml will be created", out, flags=re.M), out
    assert re.search(r"^Conda environment \S*envs/aerie\.yaml will be created", out, flags=re.M), out


@pytest.mark.parametrize("name", ["gpu-host", "slurm"])
def test_gpu_profiles_enable_conda_deployment(name: str) -> None:
    profile = yaml.safe_load((PROFILES / name / "profile.yaml").read_text())
    assert profile["software-deployment-method"] == ["conda"]
    default = yaml.safe_load((PROFILES / "default" / "profile.yaml").read_text())
    assert "software-deployment-method" not in default  # the demo runs in the installed venv, no conda needed


def test_sglang_backends_outside_sglangs_env_are_refused_before_any_job(workdir: Path, tmp_path: Path) -> None:
    """The Kimi config without conda deployment (the default profile) fails the dry run - nothing runs, nothing is
    paid - naming the setting and the fixes; with sglang importable by Snakemake's Python it runs there; a pilot that
    only asks for a responses shard needs no SGLang and is not refused."""
    configfile = str(kimi_workdir(workdir))
    rc, out = dry_run(workdir, "--configfile", configfile)
    assert rc != 0, out
    assert "bench.backend: sglang runs rule bench in SGLang's own environment (envs/sglang.yaml)" in out, out
    assert "--workflow-profile profiles/gpu-host" in out and "--software-deployment-method conda" in out
    assert "set bench.backend: inprocess" in out
    assert "Job stats" not in out  # refused while the DAG was built: no plan was printed
    # The same with bench.backend inprocess (and references it can decode): now rule hidden is the one refused.
    inprocess = "bench={'backend': 'inprocess', 'references': ['ngram']}"
    rc, out = dry_run(workdir, "--configfile", configfile, "--config", inprocess)
    assert rc != 0 and "hidden.backend: sglang runs rule hidden in SGLang's own environment" in out, out
    assert "set hidden.backend: hf" in out
    # sglang importable by this Python (a package of that name first on its path): the jobs would run here.
    fake = tmp_path / "importable"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rc, out = dry_run(workdir, "--configfile", configfile, env=env)
    assert rc == 0, out
    assert "aerie environment: rule bench (bench.backend: sglang) runs in Snakemake's own Python" in out
    # The pilot (README step 5): only API responses, no job of rule hidden or bench in the plan.
    rc, out = dry_run(workdir, "results/sharegpt/responses/shard-00000.jsonl", "--configfile", configfile)
    assert rc == 0, out


def test_slurm_profile_resolves_per_rule_resources(workdir: Path) -> None:
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("snakemake-executor-plugin-slurm is missing, and CI must run every test")
        pytest.skip('snakemake-executor-plugin-slurm not installed (pip install -e ".[slurm]")')
    check_profile("slurm", workdir)
    profile = yaml.safe_load((PROFILES / "slurm" / "profile.yaml").read_text())
    assert profile["executor"] == "slurm" and profile["slurm-status-command"] == "squeue"
    assert profile["rerun-triggers"] == ["mtime", "input"]


def default_profile_gpus() -> int:
    """The default profile's `resources: gpu`, evaluated as Snakemake does (YTE) in this environment."""
    import yte

    text = (PROFILES / "default" / "profile.yaml").read_text()
    return yte.process_yaml(io.StringIO(text), require_use_yte=True)["resources"]["gpu"]


@pytest.mark.parametrize(
    "env",
    [
        {"AERIE_GPUS": "3"},
        {"AERIE_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb,GPU-ccc"},
        {"CUDA_VISIBLE_DEVICES": ""},
        {"CUDA_VISIBLE_DEVICES": "-1"},
        {"CUDA_VISIBLE_DEVICES": "4", "SLURM_JOB_ID": "9"},
        {},
    ],
)
def test_default_profile_detects_the_gpus_like_the_allocator(
    env: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("AERIE_GPUS", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if not env:  # nvidia-smi: a fake one listing two GPUs
        fake = tmp_path / "nvidia-smi"
        fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert default_profile_gpus() == gpu_slots.gpu_count()
    if not env:
        assert gpu_slots.detect_devices() == (["0", "1"], "nvidia-smi")


def test_default_profile_keeps_rerun_triggers() -> None:
    import yte

    text = (PROFILES / "default" / "profile.yaml").read_text()
    profile = yte.process_yaml(io.StringIO(text), require_use_yte=True)
    assert profile["rerun-triggers"] == ["mtime", "input"]
