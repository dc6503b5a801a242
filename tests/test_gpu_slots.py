"""GPU slots: concurrent jobs get disjoint CUDA_VISIBLE_DEVICES, a SIGKILLed job frees its GPUs, and a
job granted fewer GPUs than it needs fails with a message naming the rule, the setting and the limit.

Fake GPUs (AERIE_GPUS=N) and a private lock directory per test: no GPU needed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from itertools import combinations
from pathlib import Path

import pytest
from conftest import REPO

from aerie.tools import gpu_slots
from aerie.tools.gpu_slots import GpuSlotError, acquire_gpus, detect_devices

# One fake GPU job: take `count` GPUs, record what it got and when, hold them `hold` seconds.
JOB = textwrap.dedent(
    """
    import json, os, sys, time
    from aerie.tools.gpu_slots import acquire_gpus
    name, count, hold, record = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    got = acquire_gpus(count, count, name, poll_s=0.02, log=lambda m: None)
    start = time.time()
    with open(record + ".tmp", "w") as f:
        json.dump({"name": name, "count": count, "cvd": os.environ["CUDA_VISIBLE_DEVICES"], "got": got,
                   "start": start, "pid": os.getpid()}, f)
    os.replace(record + ".tmp", record)
    time.sleep(hold)
    with open(record) as f:
        rec = json.load(f)
    rec["end"] = time.time()
    with open(record + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(record + ".tmp", record)
    """
)


@pytest.fixture()
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """8 fake GPUs, a private lock dir, no scheduler; in this process too (restored afterwards)."""
    locks = tmp_path / "locks"
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "SLURM_JOB_ID", gpu_slots.ENV_WAIT_S):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(gpu_slots.ENV_FAKE_GPUS, "8")
    monkeypatch.setenv(gpu_slots.ENV_LOCK_DIR, str(locks))
    yield {**os.environ, "PYTHONPATH": str(REPO)}
    gpu_slots.release_gpus()


def start_job(env: dict[str, str], name: str, count: int, hold: float, record: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", JOB, name, str(count), str(hold), str(record)], env=env)


def wait_for(path: Path, timeout: float = 20.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"{path} not written within {timeout} s")


def test_concurrent_jobs_get_disjoint_devices(fake_env: dict[str, str], tmp_path: Path) -> None:
    """Ten jobs asking for 1-4 GPUs each (22 in all) on 8 GPUs: whoever runs at the same time has
    disjoint devices, and every job gets exactly the number it asked for."""
    counts = [1, 2, 3, 4, 1, 2, 3, 1, 4, 1]
    records = [tmp_path / f"job{i}.json" for i in range(len(counts))]
    procs = [start_job(fake_env, f"job{i}", c, 0.5, r) for i, (c, r) in enumerate(zip(counts, records))]
    for p in procs:
        assert p.wait(timeout=60) == 0
    jobs = [json.loads(r.read_text()) for r in records]
    overlapping = 0
    for job in jobs:
        devices = job["cvd"].split(",")
        assert len(devices) == job["count"] == len(set(devices))
        assert devices == job["got"] and set(devices) <= {str(i) for i in range(8)}
    for a, b in combinations(jobs, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            overlapping += 1
            assert not set(a["got"]) & set(b["got"]), (a, b)
    assert overlapping >= len(jobs) // 2  # they really ran side by side
    # At no moment were more than 8 GPUs in use.
    for job in jobs:
        t = job["start"]
        assert sum(j["count"] for j in jobs if j["start"] <= t < j["end"]) <= 8


def test_sigkill_frees_the_slot(fake_env: dict[str, str], tmp_path: Path) -> None:
    env = {**fake_env, gpu_slots.ENV_FAKE_GPUS: "2"}
    holder = start_job(env, "holder", 2, 60, tmp_path / "holder.json")
    try:
        held = wait_for(tmp_path / "holder.json")
        assert sorted(held["got"]) == ["0", "1"]
        waiter = start_job(env, "waiter", 1, 0, tmp_path / "waiter.json")
        time.sleep(0.5)
        assert waiter.poll() is None and not (tmp_path / "waiter.json").exists()  # both GPUs are held
        # Who holds what is visible while it is held.
        status = subprocess.run(
            [sys.executable, "-m", "aerie.tools.gpu_slots"], env=env, capture_output=True, text=True
        )
        assert f"pid {held['pid']}" in status.stdout and "rule holder" in status.stdout
        os.kill(holder.pid, signal.SIGKILL)
        got = wait_for(tmp_path / "waiter.json", timeout=10)
        assert got["got"][0] in held["got"]
        assert waiter.wait(timeout=10) == 0
    finally:
        holder.kill()
        holder.wait()


def test_scaled_down_grant_fails_with_the_setting_and_the_limit(fake_env: dict[str, str]) -> None:
    with pytest.raises(GpuSlotError) as e:
        acquire_gpus(8, 4, "hidden", log=lambda m: None)
    msg = str(e.value)
    assert "rule hidden needs 8 GPU(s)" in msg and "resources.hidden_gpus" in msg
    assert "granted gpu=4" in msg and "--resources gpu=8" in msg
    assert gpu_slots.held_gpus() == []


def test_more_than_the_machine_has_fails(fake_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpu_slots.ENV_FAKE_GPUS, "2")
    with pytest.raises(GpuSlotError, match="only 2 are available"):
        acquire_gpus(4, 4, "drafter", log=lambda m: None)


def test_wait_times_out_naming_the_holder(fake_env: dict[str, str], tmp_path: Path) -> None:
    env = {**fake_env, gpu_slots.ENV_FAKE_GPUS: "1"}
    holder = start_job(env, "holder", 1, 30, tmp_path / "holder.json")
    try:
        held = wait_for(tmp_path / "holder.json")
        os.environ[gpu_slots.ENV_FAKE_GPUS] = "1"
        lines: list[str] = []
        with pytest.raises(GpuSlotError, match=f"pid {held['pid']}"):
            acquire_gpus(1, 1, "bench", log=lines.append, timeout_s=0.3, poll_s=0.05)
        assert any("waiting for 1 free GPU(s)" in line and "rule holder" in line for line in lines)
    finally:
        holder.kill()
        holder.wait()


def test_no_gpu_is_a_no_op(fake_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpu_slots.ENV_FAKE_GPUS, "0")
    lines: list[str] = []
    assert acquire_gpus(8, 0, "hidden", log=lines.append) == []  # scaled down, but there is no GPU anyway
    assert "no GPU: running on CPU" in lines[0]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_a_job_that_needs_no_gpu_sees_none(fake_env: dict[str, str]) -> None:
    assert acquire_gpus(0, 0, "responses", log=lambda m: None) == []
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_in_process_grant_sets_cuda_visible_devices(fake_env: dict[str, str]) -> None:
    got = acquire_gpus(2, 3, "drafter", log=lambda m: None)  # takes what Snakemake reserved
    assert got == ["0", "1", "2"] and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert gpu_slots.held_gpus() == got


def test_device_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"PATH": "/nonexistent"}  # no nvidia-smi
    assert detect_devices(base) == ([], "none")
    assert detect_devices({**base, "AERIE_GPUS": "3"}) == (["0", "1", "2"], "AERIE_GPUS")
    assert detect_devices({**base, "CUDA_VISIBLE_DEVICES": ""}) == ([], "CUDA_VISIBLE_DEVICES")
    assert detect_devices({**base, "CUDA_VISIBLE_DEVICES": "-1"}) == ([], "CUDA_VISIBLE_DEVICES")
    assert detect_devices({**base, "CUDA_VISIBLE_DEVICES": "2,5"}) == (["2", "5"], "CUDA_VISIBLE_DEVICES")
    assert detect_devices({**base, "CUDA_VISIBLE_DEVICES": "2,5", "SLURM_JOB_ID": "7"}) == (["2", "5"], "scheduler")


def test_scheduler_allocation_is_used_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu_slots.ENV_FAKE_GPUS, raising=False)
    monkeypatch.setenv(gpu_slots.ENV_LOCK_DIR, str(tmp_path / "locks"))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert acquire_gpus(2, 2, "hidden", log=lambda m: None) == ["3", "5"]
    assert not (tmp_path / "locks").exists()  # SLURM already isolates jobs: no locks
    with pytest.raises(GpuSlotError, match="only 2 are available"):
        acquire_gpus(4, 4, "hidden", log=lambda m: None)


SNAKEFILE = textwrap.dedent(
    """
    rule all:
        input:
            expand("out/{name}.json", name=["a", "b", "c", "d", "e", "f"]),

    NEEDS = {"a": 1, "b": 2, "c": 3, "d": 1, "e": 2, "f": 1}

    rule job:
        output:
            "out/{name}.json",
        params:
            gpus=lambda w: NEEDS[w.name],
        resources:
            gpu=lambda w: NEEDS[w.name],
        script:
            "job.py"

    rule too_big:
        output:
            "big/out.json",
        params:
            gpus=4,
        resources:
            gpu=4,
        script:
            "job.py"
    """
)
RULE_SCRIPT = textwrap.dedent(
    """
    import json, os, time
    from aerie.tools.gpu_slots import acquire_rule_gpus
    log = open(snakemake.output[0] + ".log", "a")
    got = acquire_rule_gpus(snakemake, lambda m: print(m, file=log, flush=True))
    start = time.time()
    time.sleep(0.3)
    with open(snakemake.output[0], "w") as f:
        json.dump({"got": got, "cvd": os.environ["CUDA_VISIBLE_DEVICES"], "start": start, "end": time.time(),
                   "granted": snakemake.resources.gpu}, f)
    """
)


def test_snakemake_jobs_under_a_global_limit(fake_env: dict[str, str], tmp_path: Path) -> None:
    """Real Snakemake jobs (gpu=1..3) under --resources gpu=4 on 4 fake GPUs: disjoint devices among
    running jobs; a gpu=4 rule scaled down to the limit of 2 fails naming the rule and the limit."""
    wf = tmp_path / "wf"
    wf.mkdir()
    (wf / "Snakefile").write_text(SNAKEFILE)
    (wf / "job.py").write_text(RULE_SCRIPT)
    env = {**fake_env, gpu_slots.ENV_FAKE_GPUS: "4"}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(wf / "Snakefile"), "--directory", str(wf), "--cores", "6"]
    proc = subprocess.run([*cmd, "--resources", "gpu=4"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = {n: json.loads((wf / "out" / f"{n}.json").read_text()) for n in "abcdef"}
    needs = {"a": 1, "b": 2, "c": 3, "d": 1, "e": 2, "f": 1}
    for name, job in jobs.items():
        assert len(job["got"]) == needs[name] == job["granted"] and job["cvd"] == ",".join(job["got"])
    for a, b in combinations(jobs.values(), 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            assert not set(a["got"]) & set(b["got"]), (a, b)
    proc = subprocess.run(
        [*cmd, "big/out.json", "--resources", "gpu=2"], env=env, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    log = (wf / "big" / "out.json.log").read_text()
    assert "rule too_big needs 4 GPU(s)" in log and "granted gpu=2" in log and "--resources gpu=4" in log
    assert not (wf / "big" / "out.json").exists()


def test_run_holds_the_gpus_for_the_command(fake_env: dict[str, str], tmp_path: Path) -> None:
    """`python -m aerie.tools.gpu_slots run N -- CMD` (for SGLang servers started by hand): CMD sees its GPUs and
    holds them across exec until it exits."""
    env = {**fake_env, gpu_slots.ENV_FAKE_GPUS: "1"}
    seen = tmp_path / "seen.txt"
    cmd = [
        sys.executable,
        "-m",
        "aerie.tools.gpu_slots",
        "run",
        "1",
        "--",
        "sh",
        "-c",
        f'echo "$CUDA_VISIBLE_DEVICES" > {seen}; exec sleep 30',
    ]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while not (seen.exists() and seen.read_text().strip()) and time.time() < deadline:
            time.sleep(0.02)
        assert seen.read_text().strip() == "0"
        os.environ[gpu_slots.ENV_FAKE_GPUS] = "1"
        with pytest.raises(GpuSlotError, match=f"pid {proc.pid} .*rule sh"):
            acquire_gpus(1, 1, "bench", log=lambda m: None, timeout_s=0.2, poll_s=0.05)
    finally:
        proc.kill()
        proc.wait()
    assert acquire_gpus(1, 1, "bench", log=lambda m: None, timeout_s=5, poll_s=0.05) == ["0"]
