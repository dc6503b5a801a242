"""The host check (rule ``host_check``): the GPU host's floor, checked before the first paid request.

Each of these used to fail hours into a run, after the API spend: an NVIDIA driver too old for the CUDA build of
the SGLang environment's torch, a glibc older than SGLang's wheel needs, a container's 64 MB ``/dev/shm`` under the
capture's shared-memory batches, a disk smaller than the hidden states, too few or too small GPUs, no conda, an
SGLang environment that does not import. Rule ``host_check`` (rules/host.smk) runs first - before rule
``responses`` unless ``host_check.api_elsewhere`` says the API stage runs on another machine, then before the first
GPU job (:func:`check_consumers`) - and refuses the host, naming the fix of each condition it fails
(``results/host/check.json``, docs/formats.md).

What is checked against what (:class:`HostNeeds`, decided from the plan by :func:`aerie.preview.fit.host_needs`), and
what the host has (:class:`HostFacts`, probed by :func:`probe_host` where the job runs) are plain values, so
:func:`check_host` is tested by faking each condition. A check a config does not need (the SGLang ones without an
SGLang stage, the GPU ones on the CPU) is skipped with the reason.

Torch-free: imported while Snakemake parses the workflow (the dry run lists the checks, :func:`needs_text`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from aerie.formats.responses import is_in_process
from aerie.hidden.sglang.mapping import TESTED_SGLANG_VERSION
from aerie.responses.api.backends import is_api_backend
from aerie.tools.artifacts import atomic_write_json

CHECK_FORMAT = "aerie.host-check/1"
GIB = 1024**3

# ---- SGLang 0.5.23's floor (envs/sglang.yaml pins sglang==0.5.23), in one place ----------------------------------
# From the review of sglang 0.5.23 against the pip index that issue 30 records (not re-read here: no index access
# from CI): sglang 0.5.23 requires torch==2.14.1, whose default PyPI build is for CUDA 13, and ships only a cp311
# manylinux_2_34 wheel, so pip finds it only for CPython 3.11 on glibc >= 2.34 (Ubuntu 22.04+, Debian 12+,
# RHEL/Rocky/Alma 9+). When the SGLang env's torch imports, its own torch.version.cuda decides the driver floor.
SGLANG_TORCH_CUDA = "13.0"  # the CUDA of the torch sglang 0.5.23 pins, when the env's own torch cannot be asked
SGLANG_GLIBC = (2, 34)  # manylinux_2_34
SGLANG_PYTHON = (3, 11)  # cp311
# The oldest Linux driver each CUDA major runs on (NVIDIA's CUDA toolkit release notes, "minor version
# compatibility": 11.x >= 450.80.02, 12.x >= 525.60.13, 13.x >= 580.65.06).
DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}

NVIDIA_SMI_QUERY = ["--query-gpu=driver_version,memory.total", "--format=csv,noheader,nounits"]


@dataclass
class HostNeeds:
    """What this run needs of the host it runs on (JSON-able: the rule's params)."""

    gpus: int = 0  # the most GPUs one job of the run holds (resources.<rule>_gpus), 0: no GPU job
    gpu_rules: dict[str, int] = field(default_factory=dict)  # rule -> its GPUs
    gpu_device: str = "auto"  # target.device: cpu (no GPU checks), auto (only where GPUs are), cuda...
    gpu_memory_bytes: int | None = None  # the fit plan's largest estimate per GPU (None: not estimated)
    gpu_memory_job: str = ""  # which job that is
    sglang_rules: list[str] = field(default_factory=list)  # rules that run in SGLang's environment
    shm_bytes: int | None = None  # one capture batch through /dev/shm (hidden.backend: sglang), else None
    shm_from: str = ""  # how shm_bytes was counted
    disk_bytes: int | None = None  # the disk preview's pending hidden states (None: unknown)
    disk_path: str = "results"
    conda: bool = False  # conda deployment is on: Snakemake builds each rule's environment with conda
    skip: list[str] = field(default_factory=list)  # host_check.skip
    before: list[str] = field(default_factory=list)  # the rules that wait for the check (for the record)


@dataclass
class HostFacts:
    """What the host has. ``nvidia_smi``: the output of ``nvidia-smi`` :data:`NVIDIA_SMI_QUERY` (None: not found
    or failed, ``nvidia_smi_error`` says how); ``shm``/``disk``: (total, free) bytes (None: no such folder)."""

    nvidia_smi: str | None = None
    nvidia_smi_error: str = ""
    glibc: str | None = None  # "2.35"
    shm: tuple[int, int] | None = None
    disk: tuple[int, int] | None = None
    conda: str | None = None  # conda's (or mamba's) path
    python: tuple[int, int] = (sys.version_info.major, sys.version_info.minor)
    python_executable: str = sys.executable
    sglang_version: str | None = None  # importable here (None: not, sglang_error says why)
    sglang_error: str = ""
    torch_cuda: str | None = None  # the CUDA this environment's torch was built for (torch.version.cuda)


@dataclass
class Check:
    name: str
    required: str
    found: str
    ok: bool | None  # None: skipped
    fix: str = ""  # what to do when it fails
    skipped: str = ""  # why it does not apply

    def line(self) -> str:
        if self.ok is None:
            return f"  {self.name:<11}skipped: {self.skipped}"
        verdict = "ok" if self.ok else "REFUSED"
        text = f"  {self.name:<11}{verdict}: needs {self.required}; found {self.found}"
        return text + (f"\n    fix: {self.fix}" if self.ok is False else "")


class HostCheckError(RuntimeError):
    """The host fails one or more checks; the message names each and its fix."""


def check_consumers(backends: Sequence[str], api_elsewhere: bool) -> list[str]:
    """The rules that take the check file as an input, given the run's responses backends (one per dataset): the
    first jobs that spend. Rule responses (API backends), unless ``host_check.api_elsewhere`` (the API stage may
    run on another machine); rule responses_hf (in-process generation on the GPUs); else rule hidden, the first GPU
    job when the responses come from elsewhere. Only these: a new input of a finished job re-runs it under the
    profiles' ``rerun-triggers: [mtime, input]``, and every later job comes after one of them."""
    api = any(is_api_backend(b) for b in backends) and not api_elsewhere
    consumers = [*(["responses"] if api else []), *(["responses_hf"] if any(map(is_in_process, backends)) else [])]
    return consumers or ["hidden"]


# ---- the host's facts ----------------------------------------------------------------------------------------


def parse_nvidia_smi(text: str) -> tuple[str, list[int]]:
    """``driver_version, memory.total`` rows (MiB) -> (the driver version, each GPU's memory in bytes)."""
    drivers, memory = [], []
    for row in text.strip().splitlines():
        parts = [p.strip() for p in row.split(",")]
        if len(parts) < 2 or not re.match(r"^\d+(\.\d+)*$", parts[0]):
            raise ValueError(f"unexpected nvidia-smi row {row!r}")
        drivers.append(parts[0])
        memory.append(int(float(parts[1])) * 2**20)
    return (drivers[0] if drivers else ""), memory


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or ""))


def glibc_version() -> str | None:
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.35"
    except (AttributeError, ValueError, OSError):
        value = None
    if not value:
        lib, version = platform.libc_ver()
        value = version if lib == "glibc" else None
    return value.split()[-1] if value else None


def _usage(path: str | Path) -> tuple[int, int] | None:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:  # the results folder before the first job: its nearest parent
        p = p.parent
    try:
        u = shutil.disk_usage(p)
    except OSError:
        return None
    return u.total, u.free


def _sglang_here(with_torch: bool) -> tuple[str | None, str, str | None]:
    """(sglang's version, why not, torch's CUDA) in this Python; the CUDA only when ``with_torch``."""
    try:
        import sglang  # noqa: F401 - the check is that it imports
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return None, f"import sglang failed: {type(e).__name__}: {e}", None

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = getattr(sys.modules["sglang"], "__version__", "unknown")
    cuda = None
    if with_torch:
        try:
            import torch

            cuda = torch.version.cuda
        except Exception:  # noqa: BLE001 - the driver check then uses the pinned torch's CUDA
            cuda = None
    return found, "", cuda


def probe_host(needs: HostNeeds, shm_path: str = "/dev/shm", nvidia_smi: str = "nvidia-smi") -> HostFacts:
    """The facts of the machine this runs on (the job's: on the GPU host, in the check's environment)."""
    facts = HostFacts(glibc=glibc_version(), shm=_usage(shm_path) if Path(shm_path).is_dir() else None)
    facts.disk = _usage(needs.disk_path)
    facts.conda = shutil.which("conda") or shutil.which("mamba")
    smi = shutil.which(nvidia_smi)
    if smi is None:
        facts.nvidia_smi_error = f"{nvidia_smi} is not on PATH"
    else:
        try:
            out = subprocess.run([smi, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=60)
            if out.returncode == 0:
                facts.nvidia_smi = out.stdout
            else:
                facts.nvidia_smi_error = f"{smi} exited {out.returncode}: {(out.stderr or out.stdout).strip()[:300]}"
        except (OSError, subprocess.SubprocessError) as e:
            facts.nvidia_smi_error = f"{smi}: {e}"
    if needs.sglang_rules and "sglang_env" not in needs.skip:
        facts.sglang_version, facts.sglang_error, facts.torch_cuda = _sglang_here(with_torch=needs.gpus > 0)
    return facts


# ---- the checks ----------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB"


def _sglang_settings(needs: HostNeeds) -> str:
    names = {"hidden": "hidden.backend: hf", "bench": "bench.backend: inprocess"}
    return " / ".join(names.get(r, r) for r in needs.sglang_rules)


GPU_CHECKS = ("driver", "gpus", "gpu_memory")


def gpus_skipped(needs: HostNeeds, facts: HostFacts | None) -> str:
    """Why the GPU checks (driver, count, memory) do not apply; "" when they do. ``facts`` None: the plan's view
    (under ``target.device: auto`` they then apply where the job finds a GPU)."""
    if not needs.gpu_rules:
        return "no job of this run holds a GPU (resources.<rule>_gpus are 0)"
    if needs.sglang_rules:
        return ""  # SGLang runs on GPUs only
    if needs.gpu_device == "cpu":
        return "target.device: cpu: the GPU rules run on the CPU"
    if needs.gpu_device == "auto" and facts is not None and not _gpu_memory(facts):
        return "target.device: auto and no GPU here: the GPU rules run on the CPU (target.device: cuda requires GPUs)"
    return ""


def planned_skip(needs: HostNeeds, name: str) -> str:
    """Why check ``name`` does not apply to this run, whatever the host ("" when it applies)."""
    if name in needs.skip:
        return "skipped by host_check.skip"
    if name in GPU_CHECKS and gpus_skipped(needs, None):
        return gpus_skipped(needs, None)
    no_sglang = "" if needs.sglang_rules else "no rule runs in SGLang's environment (hidden.backend, bench.backend)"
    return {
        "glibc": no_sglang,
        "sglang_env": no_sglang,
        "shm": "" if needs.shm_bytes is not None else needs.shm_from or "no capture batch passes through /dev/shm",
        "disk": "" if needs.disk_bytes is not None else "the disk preview cannot size the hidden states",
        "gpu_memory": "" if needs.gpu_memory_bytes else "the fit plan has no GPU estimate",
        "conda": "" if needs.conda else "conda deployment is off: the jobs run in Snakemake's own Python",
    }.get(name, "")


def _gpu_memory(facts: HostFacts) -> list[int]:
    if facts.nvidia_smi is None:
        return []
    try:
        return parse_nvidia_smi(facts.nvidia_smi)[1]
    except ValueError:
        return []


def driver_floor(needs: HostNeeds, facts: HostFacts | None) -> tuple[int | None, str]:
    """(the oldest driver major that runs the SGLang environment's torch, why); (None, ...) without SGLang."""
    if not needs.sglang_rules:
        return None, "an NVIDIA driver (nvidia-smi answers)"
    cuda = (facts.torch_cuda if facts else None) or SGLANG_TORCH_CUDA
    floor = DRIVER_FOR_CUDA.get(_version(cuda)[0], max(DRIVER_FOR_CUDA.values()))
    whose = "the SGLang env's torch" if facts and facts.torch_cuda else f"sglang {TESTED_SGLANG_VERSION}'s torch"
    return floor, f"NVIDIA driver >= {floor} ({whose} is built for CUDA {cuda})"


def required(needs: HostNeeds, name: str, facts: HostFacts | None = None) -> str:
    """What check ``name`` asks of the host."""
    if name == "driver":
        return driver_floor(needs, facts)[1]
    if name == "gpus":
        rules = ", ".join(f"{r} {n}" for r, n in needs.gpu_rules.items())
        return f"{needs.gpus} GPU(s) (resources.<rule>_gpus: {rules})"
    if name == "gpu_memory":
        return f"each GPU >= {_gib(needs.gpu_memory_bytes or 0)} (the fit plan's largest job: {needs.gpu_memory_job})"
    if name == "glibc":
        return "glibc >= {}.{} (SGLang's manylinux_2_34 wheels)".format(*SGLANG_GLIBC)
    if name == "shm":
        return f"/dev/shm >= {_gib(needs.shm_bytes or 0)} free ({needs.shm_from})"
    if name == "disk":
        return f"{_gib(needs.disk_bytes or 0)} free under {needs.disk_path}/ (the disk preview's pending hidden states)"
    if name == "conda":
        return "conda (or mamba) on PATH: Snakemake builds envs/aerie.yaml and envs/sglang.yaml with it"
    return "sglang=={} importable by CPython {}.{} (envs/sglang.yaml)".format(TESTED_SGLANG_VERSION, *SGLANG_PYTHON)


def check_driver(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    floor, _ = driver_floor(needs, facts)
    no_gpu_fix = (
        "no NVIDIA driver answers here: install it (nvidia-smi must list the GPUs); in a container start it with "
        "the GPUs (`docker run --gpus all`, the NVIDIA Container Toolkit)"
    )
    if facts.nvidia_smi is None:
        return Check("driver", want, facts.nvidia_smi_error or "no nvidia-smi", False, no_gpu_fix)
    try:
        driver, _ = parse_nvidia_smi(facts.nvidia_smi)
    except ValueError as e:
        return Check("driver", want, str(e), False, no_gpu_fix)
    if floor is None or _version(driver)[:1] >= (floor,):
        return Check("driver", want, f"driver {driver}", True)
    fix = (
        f"upgrade the NVIDIA driver to >= {floor} (CUDA 13; e.g. Ubuntu: `apt install nvidia-driver-{floor}-server`, "
        "then reboot; in a container the driver is the host's: upgrade it there), or run on a host that has it; "
        f"or keep SGLang out of the run ({_sglang_settings(needs)})"
    )
    return Check("driver", want, f"driver {driver}", False, fix)


def check_glibc(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    if facts.glibc and _version(facts.glibc)[:2] >= SGLANG_GLIBC:
        return Check("glibc", want, f"glibc {facts.glibc}", True)
    fix = (
        f"glibc 2.34+ is needed by sglang {TESTED_SGLANG_VERSION}'s manylinux_2_34 wheels (pip finds none on an older "
        "one): use Ubuntu 22.04+, Debian 12+ or RHEL/Rocky/Alma 9+, or run inside a container of one (e.g. "
        f"lmsysorg/sglang); or keep SGLang out of the run ({_sglang_settings(needs)})"
    )
    return Check("glibc", want, f"glibc {facts.glibc}" if facts.glibc else "no glibc (musl?)", False, fix)


def check_shm(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    assert needs.shm_bytes is not None
    if facts.shm is None:
        found, ok = "no /dev/shm", False
    else:
        found, ok = f"{_gib(facts.shm[1])} free of {_gib(facts.shm[0])}", facts.shm[1] >= needs.shm_bytes
    size = max(1, -(-needs.shm_bytes * 2 // GIB))  # twice a batch, in whole GiB
    fix = (
        f"give /dev/shm at least {size} GiB: run the container with `--shm-size={size}g` (Kubernetes: an emptyDir "
        f"with medium: Memory mounted on /dev/shm), or `sudo mount -o remount,size={size}G /dev/shm`; or lower "
        "hidden.batch_tokens (a batch is its tokens x the captured states)"
    )
    return Check("shm", want, found, ok, "" if ok else fix)


def check_disk(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    assert needs.disk_bytes is not None
    where = needs.disk_path
    if facts.disk is None:
        return Check("disk", want, f"cannot read the free space of {where}", False, f"create {where}/ writable")
    ok = facts.disk[1] >= needs.disk_bytes
    fix = (
        f"free {_gib(needs.disk_bytes - facts.disk[1])} more under {where}/ (or make it a link to a bigger disk), "
        "or lower the datasets' max_output_tokens / max_samples, or set hidden.layout: compact"
    )
    return Check("disk", want, f"{_gib(facts.disk[1])} free", ok, "" if ok else fix)


def check_gpus(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    found = len(_gpu_memory(facts))
    ok = found >= needs.gpus
    fix = (
        f"run on a host with {needs.gpus} GPUs (in a container: `--gpus all`), or lower resources.<rule>_gpus (and "
        "hidden.sglang.tp_size / sglang.tp to match) and run `snakemake -n` again for the fit plan"
    )
    why = "" if facts.nvidia_smi is not None else f" ({facts.nvidia_smi_error})"
    return Check("gpus", want, f"{found} GPU(s){why}", ok, "" if ok else fix)


def check_gpu_memory(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    memory = _gpu_memory(facts)
    if not memory:
        return Check("gpu_memory", want, "no GPU", False, "see the gpus and driver checks")
    ok = min(memory) >= (needs.gpu_memory_bytes or 0)
    fix = (
        f"use GPUs of >= {_gib(needs.gpu_memory_bytes or 0)}, or set resources.gpu_memory_gib to this host's "
        f"{min(memory) / GIB:,.0f} and run `snakemake -n` again: the fit plan names the setting to lower"
    )
    return Check(
        "gpu_memory", want, f"the smallest of {len(memory)} GPU(s): {_gib(min(memory))}", ok, "" if ok else fix
    )


def check_conda(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    ok = facts.conda is not None
    fix = "install conda or mamba on PATH (e.g. Miniforge: https://github.com/conda-forge/miniforge)"
    return Check("conda", want, facts.conda or "not on PATH", ok, "" if ok else fix)


def check_sglang_env(needs: HostNeeds, facts: HostFacts, want: str) -> Check:
    here = "Python {}.{} ({})".format(*facts.python, facts.python_executable)
    if facts.sglang_version is None:
        where = (
            "Snakemake built SGLang's environment (envs/sglang.yaml) but it does not import: read the error, remove "
            "its folder under .snakemake/conda/ and run again to rebuild it"
            if needs.conda
            else "conda deployment is off, so the SGLang rules run in this Python: run with --workflow-profile "
            "profiles/gpu-host (or --software-deployment-method conda), or `pip install sglang=="
            f"{TESTED_SGLANG_VERSION}` into a Python 3.11 environment and run Snakemake from it"
        )
        fix = f"{where}; or keep SGLang out of the run ({_sglang_settings(needs)})"
        return Check("sglang_env", want, f"{facts.sglang_error} in {here}", False, fix)
    found = f"sglang {facts.sglang_version} in {here}"
    if facts.python != SGLANG_PYTHON:
        fix = "SGLang's wheels are cp311: build its environment with Python 3.11 (envs/sglang.yaml pins python =3.11)"
        return Check("sglang_env", want, found, False, fix)
    if facts.sglang_version != TESTED_SGLANG_VERSION:
        fix = (
            f"aerie's capture adapter is written for sglang {TESTED_SGLANG_VERSION} (envs/sglang.yaml): rebuild the "
            "environment from envs/sglang.yaml, or try this version anyway with AERIE_SGLANG_ANY_VERSION=1 after "
            "`aerie-sglang-capture check` passes with it (docs/sglang-capture-check.md)"
        )
        return Check("sglang_env", want, found, os.environ.get("AERIE_SGLANG_ANY_VERSION") == "1", fix)
    return Check("sglang_env", want, found, True)


_CHECKERS: dict[str, Callable[[HostNeeds, HostFacts, str], Check]] = {
    "driver": check_driver,
    "glibc": check_glibc,
    "shm": check_shm,
    "disk": check_disk,
    "gpus": check_gpus,
    "gpu_memory": check_gpu_memory,
    "conda": check_conda,
    "sglang_env": check_sglang_env,
}
CHECKS = tuple(_CHECKERS)


def check_host(needs: HostNeeds, facts: HostFacts) -> list[Check]:
    """Every check, in order: passed, refused with its fix, or skipped with the reason (in ``fix``)."""
    out = []
    for name in CHECKS:
        planned = planned_skip(needs, name)
        want = "-" if planned else required(needs, name, facts)
        skip = planned or (gpus_skipped(needs, facts) if name in GPU_CHECKS else "")
        out.append(Check(name, want, "-", None, skipped=skip) if skip else _CHECKERS[name](needs, facts, want))
    return out


def refusal(checks: Sequence[Check]) -> str | None:
    """The error of a host that fails a check: each failure, what it needs, what is here and the fix."""
    failed = [c for c in checks if c.ok is False]
    if not failed:
        return None
    return "this host fails the host check (rules/host.smk; nothing was run, nothing spent):\n" + "\n".join(
        f"- {c.name}: needs {c.required}; found {c.found}. Fix: {c.fix}" for c in failed
    )


# ---- the dry run's part, the job -----------------------------------------------------------------------------


def env_build_warning(needs: HostNeeds, glibc: str | None) -> str:
    """Snakemake builds every conda environment on the machine that runs it, before any job - rule host_check
    included - starts: with an SGLang rule in the run and a glibc older than its wheels need there, pip fails while
    building ``envs/sglang.yaml`` with its own error. The line said at parse time instead, or ``""``."""
    if not (needs.conda and needs.sglang_rules) or (glibc and _version(glibc)[:2] >= SGLANG_GLIBC):
        return ""
    found = f"glibc {glibc}" if glibc else "no glibc (musl?)"
    return (
        f"WARNING host check: this machine has {found}; Snakemake builds envs/sglang.yaml here (for rules "
        f"{', '.join(needs.sglang_rules)}) and pip finds no sglang {TESTED_SGLANG_VERSION} wheel below glibc 2.34. "
        "Build the environments on the GPU host (Ubuntu 22.04+, Debian 12+, RHEL/Rocky/Alma 9+, or a container of "
        "one) with `snakemake --conda-create-envs-only`, or keep SGLang out of the run"
    )


def needs_text(needs: HostNeeds) -> str:
    """``snakemake -n``'s lines: the checks rule host_check will run on its host and what each needs."""
    before = ", ".join(needs.before) or "the first GPU job"
    lines = [f"aerie host check (rule host_check -> results/host/check.json) runs before rule {before}, on its host:"]
    for name in CHECKS:
        skip = planned_skip(needs, name)
        if skip:
            lines.append(f"  {name:<11}skipped: {skip}")
            continue
        auto = name in GPU_CHECKS and not needs.sglang_rules and needs.gpu_device == "auto"
        lines.append(
            f"  {name:<11}{required(needs, name)}" + (" (target.device auto: where a GPU is found)" if auto else "")
        )
    return "\n".join(lines)


def host_record(needs: HostNeeds, facts: HostFacts, checks: Sequence[Check]) -> dict[str, Any]:
    """The check file's content (``aerie.host-check/1``, docs/formats.md), as JSON reads it back."""
    return json.loads(
        json.dumps(
            {
                "format": CHECK_FORMAT,
                "host": platform.node(),
                "ok": all(c.ok is not False for c in checks),
                "checks": [asdict(c) for c in checks],
                "needs": asdict(needs),
                "facts": {k: v for k, v in asdict(facts).items() if k != "nvidia_smi"}
                | {"nvidia_smi": (facts.nvidia_smi or "").strip().splitlines()},
            }
        )
    )


def run_host_check(
    needs: Mapping[str, Any] | HostNeeds,
    out: str | Path,
    log: Callable[[str], None] = print,
    facts: HostFacts | None = None,
) -> dict[str, Any]:
    """Rule host_check: probe this host, log each check, write the record (``aerie.host-check/1``) when every
    check passes or is skipped; otherwise raise :class:`HostCheckError` naming each failure's fix (no file)."""
    needs = needs if isinstance(needs, HostNeeds) else HostNeeds(**needs)
    facts = facts if facts is not None else probe_host(needs)
    checks = check_host(needs, facts)
    log(f"host check on {platform.node()}:\n" + "\n".join(c.line() for c in checks))
    record = host_record(needs, facts, checks)
    why = refusal(checks)
    if why:
        log(f"REFUSED: {why}")
        raise HostCheckError(why)
    atomic_write_json(Path(out), record)
    return record
