"""The host check (aerie/preview/host.py, rules/host.smk): each bad host condition, faked, is refused naming its fix;
a good host passes; the checks a run does not need are skipped with the reason; rule responses waits for the check
(unless host_check.api_elsewhere), and the dry run lists the checks."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import snakemake

from aerie.preview.fit import capture_shm
from aerie.preview.host import (
    CHECKS,
    GIB,
    HostCheckError,
    HostFacts,
    HostNeeds,
    check_consumers,
    check_host,
    needs_text,
    probe_host,
    run_host_check,
)

SMI_H200 = "580.65.06, 143771\n" * 8  # nvidia-smi --query-gpu=driver_version,memory.total (MiB)


def kimi_needs(**changes) -> HostNeeds:
    """What config/kimi-k2.5.yaml asks on the 8-GPU host (numbers as aerie.preview.fit.host_needs finds them)."""
    needs = HostNeeds(
        gpus=8,
        gpu_rules={"hidden": 8, "drafter": 8, "bench": 8},
        gpu_device="cuda",
        gpu_memory_bytes=int(130.8 * GIB),
        gpu_memory_job="hidden, GPU 0",
        sglang_rules=["hidden", "bench"],
        shm_bytes=65536 * 4 * 7168 * 2,
        shm_from="one capture batch",
        disk_bytes=500 * GIB,
        conda=True,
        before=["responses", "hidden"],
    )
    return dataclasses.replace(needs, **changes)


def good_host(**changes) -> HostFacts:
    facts = HostFacts(
        nvidia_smi=SMI_H200,
        glibc="2.35",
        shm=(64 * GIB, 60 * GIB),
        disk=(4000 * GIB, 2000 * GIB),
        conda="/opt/miniforge/bin/conda",
        python=(3, 11),
        python_executable="/work/.snakemake/conda/abc/bin/python",
        sglang_version="0.5.23",
        torch_cuda="13.0",
    )
    return dataclasses.replace(facts, **changes)


def test_a_good_host_passes_and_the_record_says_so(tmp_path: Path) -> None:
    out = tmp_path / "host" / "check.json"
    lines: list[str] = []
    record = run_host_check(dataclasses.asdict(kimi_needs()), out, log=lines.append, facts=good_host())
    assert record["ok"] and json.loads(out.read_text()) == record
    assert record["format"] == "aerie.host-check/1"
    assert [c["name"] for c in record["checks"]] == list(CHECKS)
    assert all(c["ok"] is True for c in record["checks"]), record["checks"]
    assert "REFUSED" not in lines[0] and "driver     ok: needs NVIDIA driver >= 580" in lines[0]


# (what is wrong with the host, the check that refuses it, words of its fix); without a driver nvidia-smi lists no GPU,
# so the GPU count and memory checks refuse too.
CASCADE = {"no driver": {"gpus", "gpu_memory"}}
BAD_HOSTS = {
    "old driver": (dict(nvidia_smi="550.54.15, 143771\n" * 8), "driver", "upgrade the NVIDIA driver to >= 580"),
    "no driver": (dict(nvidia_smi=None, nvidia_smi_error="nvidia-smi is not on PATH"), "driver", "--gpus all"),
    "old glibc": (dict(glibc="2.28"), "glibc", "Ubuntu 22.04+, Debian 12+ or RHEL/Rocky/Alma 9+"),
    "64 MB /dev/shm": (dict(shm=(64 * 2**20, 64 * 2**20)), "shm", "--shm-size=7g"),  # twice a batch
    "no /dev/shm": (dict(shm=None), "shm", "--shm-size="),
    "low disk": (dict(disk=(1000 * GIB, 100 * GIB)), "disk", "free 400.0 GiB more under results/"),
    "4 GPUs": (dict(nvidia_smi="580.65.06, 143771\n" * 4), "gpus", "lower resources.<rule>_gpus"),
    "80 GB GPUs": (dict(nvidia_smi="580.65.06, 81559\n" * 8), "gpu_memory", "set resources.gpu_memory_gib to this"),
    # every GPU must hold the largest job's share: one small one among large ones is refused (judged by the smallest)
    "one 80 GB GPU": (
        dict(nvidia_smi="580.65.06, 143771\n" * 7 + "580.65.06, 81559\n"),
        "gpu_memory",
        "the smallest of 8 GPU(s): 79.6 GiB",
    ),
    # what a capture batch needs is free space, not the mount's size
    "full /dev/shm": (dict(shm=(64 * GIB, 1 * GIB)), "shm", "--shm-size=7g"),
    "no conda": (dict(conda=None), "conda", "Miniforge"),
    "SGLang env not importable": (
        dict(sglang_version=None, sglang_error="import sglang failed: ImportError: libcuda.so.1"),
        "sglang_env",
        "remove its folder under .snakemake/conda/",
    ),
    "SGLang env on Python 3.12": (dict(python=(3, 12)), "sglang_env", "build its environment with Python 3.11"),
    "another SGLang": (dict(sglang_version="0.5.30"), "sglang_env", "rebuild the environment from envs/sglang.yaml"),
}


@pytest.mark.parametrize("bad", list(BAD_HOSTS))
def test_each_bad_host_condition_is_refused_naming_its_fix(bad: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("AERIE_SGLANG_ANY_VERSION", raising=False)
    changes, name, fix = BAD_HOSTS[bad]
    out = tmp_path / "check.json"
    with pytest.raises(HostCheckError) as err:
        run_host_check(kimi_needs(), out, log=lambda _m: None, facts=good_host(**changes))
    message = str(err.value)
    assert f"- {name}: needs " in message and fix in message, message
    failed = set(re.findall(r"^- (\w+): needs", message, flags=re.M))
    assert failed == {name, *CASCADE.get(bad, ())}, f"{bad}: only {name} should fail:\n{message}"
    assert "nothing spent" in message and not out.exists()


def test_sglang_rules_need_the_gpus_even_when_target_device_is_auto_and_none_is_seen(tmp_path: Path) -> None:
    """``target.device: auto`` runs the in-process GPU rules on the CPU where no GPU is seen; SGLang's rules have no
    CPU fallback, so a host without a GPU is refused for them (driver, GPU count, memory), never skipped."""
    no_gpu = good_host(nvidia_smi=None, nvidia_smi_error="nvidia-smi is not on PATH")
    checks = {c.name: c for c in check_host(kimi_needs(gpu_device="auto"), no_gpu)}
    assert all(checks[name].ok is False and not checks[name].skipped for name in ("driver", "gpus", "gpu_memory"))
    without_sglang = kimi_needs(gpu_device="auto", sglang_rules=[])
    checks = {c.name: c for c in check_host(without_sglang, no_gpu)}
    assert "no GPU here" in checks["gpus"].skipped  # in-process rules only: they run on the CPU


def test_the_driver_floor_follows_the_cuda_of_the_sglang_envs_torch() -> None:
    """A driver of 570 runs a CUDA 12.8 torch (floor 525), not the CUDA 13 one sglang 0.5.23 pins (580)."""
    old = "570.86.15, 143771\n" * 8
    [driver] = [c for c in check_host(kimi_needs(), good_host(nvidia_smi=old, torch_cuda="12.8")) if c.name == "driver"]
    assert driver.ok and "525" in driver.required and "the SGLang env's torch is built for CUDA 12.8" in driver.required
    # the env's torch not asked (it did not import): sglang 0.5.23's pin, CUDA 13.0
    [driver] = [c for c in check_host(kimi_needs(), good_host(nvidia_smi=old, torch_cuda=None)) if c.name == "driver"]
    assert (
        driver.ok is False and "NVIDIA driver >= 580 (sglang 0.5.23's torch is built for CUDA 13.0)" in driver.required
    )


def test_conda_off_names_the_profile_for_a_missing_sglang() -> None:
    checks = check_host(kimi_needs(conda=False), good_host(sglang_version=None, sglang_error="No module named sglang"))
    by_name = {c.name: c for c in checks}
    assert by_name["conda"].ok is None and "conda deployment is off" in by_name["conda"].skipped
    assert by_name["sglang_env"].ok is False and "--workflow-profile profiles/gpu-host" in by_name["sglang_env"].fix
    assert "hidden.backend: hf / bench.backend: inprocess" in by_name["sglang_env"].fix


def test_an_sglang_env_this_machine_cannot_build_is_said_at_parse_time() -> None:
    """Snakemake builds the conda environments before rule host_check runs: below glibc 2.34 pip would fail on
    envs/sglang.yaml with its own error, so the parse says why first (and only when it would build it)."""
    from aerie.preview.host import env_build_warning

    warning = env_build_warning(kimi_needs(), "2.28")
    assert "glibc 2.28" in warning and "envs/sglang.yaml" in warning and "--conda-create-envs-only" in warning
    assert "hidden, bench" in warning
    assert env_build_warning(kimi_needs(), "2.35") == ""
    assert env_build_warning(kimi_needs(conda=False), "2.28") == ""  # conda off: nothing is built here
    assert env_build_warning(kimi_needs(sglang_rules=[]), "2.28") == ""  # no SGLang rule: no SGLang env
    assert "no glibc" in env_build_warning(kimi_needs(), None)


def test_what_a_run_does_not_need_is_skipped_with_the_reason() -> None:
    """The demo on a CPU machine: no SGLang, no conda deployment, target.device auto and no GPU here."""
    demo = HostNeeds(gpus=1, gpu_rules={"responses": 1, "hidden": 1}, disk_bytes=GIB // 10, before=["responses"])
    cpu = HostFacts(nvidia_smi=None, nvidia_smi_error="nvidia-smi is not on PATH", glibc="2.17", shm=None,
                    disk=(100 * GIB, 50 * GIB), python=(3, 12))  # fmt: skip
    checks = {c.name: c for c in check_host(demo, cpu)}
    assert checks.pop("disk").ok is True
    assert all(c.ok is None and c.skipped for c in checks.values()), checks
    assert "no GPU here" in checks["gpus"].skipped and "SGLang" in checks["glibc"].skipped
    # target.device: cuda asks for the GPUs the CPU machine does not have
    refused = {c.name for c in check_host(dataclasses.replace(demo, gpu_device="cuda"), cpu) if c.ok is False}
    assert refused == {"driver", "gpus"}
    # host_check.skip: a check the host misjudges is recorded as skipped
    skipped = check_host(kimi_needs(skip=["glibc"]), good_host(glibc="2.28"))
    assert [c.skipped for c in skipped if c.name == "glibc"] == ["skipped by host_check.skip"]
    assert all(c.ok is not False for c in skipped)


def test_the_capture_batch_through_shm_is_sized_from_the_config() -> None:
    kimi = yaml.safe_load((Path(__file__).parents[1] / "config" / "kimi-k2.5.yaml").read_text())
    kimi["tokens"].setdefault("max_seq_len", 4096)
    size, how = capture_shm(kimi)
    assert size == 65536 * 4 * 7168 * 2 and abs(size / 1e9 - 3.76) < 0.01, size  # the issue's ~3.7 GB per batch
    assert "hidden.batch_tokens 65,536" in how and "4 states x 7,168 x 2 bytes" in how
    kimi["hidden"]["backend"] = "hf"
    assert capture_shm(kimi)[0] is None


def test_the_probe_reads_this_machine_and_a_fake_nvidia_smi(tmp_path: Path, monkeypatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '580.65.06, 143771\\n580.65.06, 143771\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = probe_host(HostNeeds(disk_path=str(tmp_path / "results")))
    assert facts.nvidia_smi and facts.nvidia_smi.count("580.65.06") == 2
    assert facts.disk is not None and facts.disk[1] > 0 and facts.sglang_version is None  # not asked without SGLang
    assert facts.glibc is None or re.match(r"^\d+\.\d+", facts.glibc)
    gpus = [c for c in check_host(HostNeeds(gpus=2, gpu_rules={"hidden": 2}), facts) if c.name == "gpus"]
    assert gpus[0].ok is True and gpus[0].found == "2 GPU(s)"


def test_rule_responses_waits_for_the_check_unless_the_api_stage_runs_elsewhere(workdir: Path) -> None:
    assert check_consumers(["openrouter", "recorded"], api_elsewhere=False) == ["responses"]
    assert check_consumers(["openrouter", "recorded"], api_elsewhere=True) == ["hidden"]  # the first GPU job
    assert check_consumers(["hf", "openai"], api_elsewhere=True) == ["responses_hf"]
    assert check_consumers(["hf", "openai"], api_elsewhere=False) == ["responses", "responses_hf"]
    assert check_consumers(["recorded"], api_elsewhere=False) == ["hidden"]
    assert "runs before rule hidden, on its host" in needs_text(HostNeeds(before=["hidden"]))
    # The demo's DAG (one dry run): the check is an input of rule responses and responses_hf, and is listed.
    proc = snakemake(workdir, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert (
        "aerie host check (rule host_check -> results/host/check.json) runs before rule responses, responses_hf" in out
    )
    inputs = dict(re.findall(r"^(?:local)?rule (\w+):\n    input: (.*)$", out, flags=re.M))
    for rule in ("responses", "responses_hf"):
        assert "results/host/check.json" in inputs[rule].split(", "), (rule, inputs.get(rule))
    assert "results/host/check.json" not in inputs["hidden"]  # it comes after them
    assert re.search(r"^host_check\s+1$", out, flags=re.M), out
