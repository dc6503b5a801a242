"""The target is loaded once per run for capture, through Snakemake, however many shards there are.

A tiny Llama target and hand-written tokens shards (the target's input; no responses or tokens job runs):
rule ``hidden`` captures every shard in one job with one target load (counted from the job's log), its
shards are bit-identical to shards captured one at a time with a load each, a run killed mid-way
(SIGKILL of the whole Snakemake process group) is resumed with one load that captures only the shards the
killed run had not finished, a shard that fails its checks stops the job without losing the shards before
it, and ``snakemake -n`` says how many target loads the plan contains.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, snakemake
from tiny_world import save_random_llama, write_random_tokens_shard

from aerie.formats.hidden import HIDDEN_FORMAT
from aerie.hidden.settings import CaptureSettings
from aerie.hidden.shard import capture_shard
from aerie.target_model.store import KEY_FIELD, store_path
from aerie.tools.artifacts import load_packed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SHARDS = 6
SEQS, SEQ_LEN = 64, 16  # per shard; with batch_tokens 16 one forward per sequence: ~2 s a shard here
AUX = [1, 3, 4]
LOADS = re.compile(r"^\S+ aerie capture: .* target loads in this job: (\d+)", flags=re.M)  # the job's summary
LOADING = "loading the target "  # logged by each load (aerie.hidden.TargetSession.open)


def loads(log: str) -> int:
    """Target loads of one attempt of the capture job, from its log: the loads it logged, checked against the
    count in its summary line."""
    (summary,) = LOADS.findall(log)
    assert int(summary) == log.count(LOADING), log
    return int(summary)


def hidden_paths(root: Path) -> list[Path]:
    return [root / "results" / "tasks" / "hidden" / f"shard-{s:05d}.safetensors" for s in range(SHARDS)]


def tokens_paths(root: Path) -> list[Path]:
    return [root / "results" / "tasks" / "tokens" / f"shard-{s:05d}.safetensors" for s in range(SHARDS)]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("capture_once") / "target")


def make_workdir(root: Path, target: Path) -> Path:
    """A workdir whose tokens shards exist (random ids, so the agreement check is off) and a config for them."""
    root.mkdir(parents=True)
    for s, path in enumerate(tokens_paths(root)):
        write_random_tokens_shard(path, SEQS, SEQ_LEN, seed=s)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"] = {"path": str(target), "device": "cpu", "dtype": "float32"}
    config["datasets"] = {
        "tasks": {
            "source": {"kind": "synthetic", "families": ["arith"], "count": 2 * SHARDS + 1, "seed": 7},
            "shard_size": 2,
            "bench_prompts": 1,
        }
    }
    config["hidden"].update(aux_layer_ids=AUX, batch_tokens=SEQ_LEN, min_next_token_agreement=0.0)
    config["resources"] = {k: 0 for k in config["resources"]}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def hidden_args(root: Path) -> list[str]:
    return [
        *(str(p.relative_to(root)) for p in hidden_paths(root)),
        "--cores",
        "1",
        "--configfile",
        str(root / "config.yaml"),
    ]


def run_hidden(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return snakemake(root, *hidden_args(root), *extra, timeout=900)


def plan_line(root: Path) -> str:
    proc = snakemake(root, "-n", *hidden_args(root))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return re.search(r"^aerie capture plan: .*$", out, flags=re.M).group(0)


def attempt_log(root: Path, attempt: int) -> str:
    return (root / "results" / "logs" / f"hidden.attempt-{attempt}.log").read_text()


def same_shards(a: Path, b: Path) -> None:
    """Equal tensors (bit for bit) and equal metadata, the store's capture key aside."""
    ta, ma = load_packed(a, HIDDEN_FORMAT)
    tb, mb = load_packed(b, HIDDEN_FORMAT)
    assert ta.keys() == tb.keys(), (a, b)
    for k in ta:
        x, y = ta[k], tb[k]
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert x.dtype == y.dtype and torch.equal(x, y), (a, b, k)
    ma.pop(KEY_FIELD, None), mb.pop(KEY_FIELD, None)
    assert ma == mb, (a, b)


@pytest.fixture(scope="module")
def full_run(target, tmp_path_factory) -> Path:
    root = make_workdir(tmp_path_factory.mktemp("full") / "work", target)
    assert plan_line(root) == (
        f"aerie capture plan: rule hidden (one job for all {SHARDS} shards) publishes "
        f"{SHARDS} pending: 1 target load when it runs (one job per shard: {SHARDS})"
    )
    proc = run_hidden(root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def test_one_job_one_load_for_every_shard(full_run) -> None:
    root = full_run
    log = attempt_log(root, 1)
    assert loads(log) == 1, log
    assert f"aerie capture: {SHARDS} shards, {SHARDS} captured, 0 reused" in log, log
    for out in hidden_paths(root):
        # Each shard has its own file (a hard link to the store entry), its own checks and its own log.
        assert out.exists() and os.path.samefile(out, store_path(out))
        shard_log = root / "results" / "logs" / "tasks" / "hidden" / out.name.replace(".safetensors", ".log")
        text = shard_log.read_text()
        assert f"{out.relative_to(root)} [" in text and "'next_token_agreement'" in text
    assert plan_line(root) == f"aerie capture plan: all {SHARDS} hidden shards are published: 0 target loads"


def test_shards_are_bit_identical_to_one_load_per_shard(full_run, target, tmp_path) -> None:
    for tokens, out in list(zip(tokens_paths(full_run), hidden_paths(full_run)))[:2]:
        alone = tmp_path / out.name
        capture_shard(
            tokens,
            alone,
            str(target),
            CaptureSettings(aux_layer_ids=AUX, batch_tokens=SEQ_LEN, device="cpu", dtype="float32", threads=1),
            log=lambda _: None,
        )
        same_shards(out, alone)


def test_a_changed_tokens_shard_is_recaptured_alone_and_a_forced_rerun_loads_nothing(full_run, tmp_path) -> None:
    import shutil

    root = tmp_path / "work"
    shutil.copytree(full_run, root, symlinks=True)  # separate files: the original run stays untouched
    changed = tokens_paths(root)[2]
    write_random_tokens_shard(
        changed, SEQS, SEQ_LEN, seed=100
    )  # e.g. the tokens job redone after its responses changed
    assert plan_line(root) == (
        f"aerie capture plan: rule hidden (one job for all {SHARDS} shards) publishes 1 "
        "pending: 1 target load when it runs (one job per shard: 1)"
    )
    proc = run_hidden(root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 2)
    assert loads(log) == 1 and f"1 captured, {SHARDS - 1} reused" in log, log
    assert "shard-00002.safetensors [3/6]: capturing" in log, log
    for out in hidden_paths(root):
        if out.name != changed.name:
            same_shards(out, full_run / out.relative_to(root))

    # Rerunning the job on purpose (nothing changed) reuses every shard and never loads the target.
    proc = run_hidden(root, "--forcerun", "hidden")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 3)
    assert loads(log) == 0 and f"0 captured, {SHARDS} reused" in log, log


def test_killed_run_resumes_with_one_load_and_only_the_missing_shards(full_run, target, tmp_path) -> None:
    root = make_workdir(tmp_path / "work", target)
    store = store_path(hidden_paths(root)[0]).parent
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(root),
        *hidden_args(root),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if store.is_dir() and len(list(store.glob("shard-*.safetensors"))) >= 2:
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # Snakemake, the job and everything it started: a crash
        proc.wait()
    finished = sorted(p.name for p in store.glob("shard-*.safetensors"))
    assert 2 <= len(finished) < SHARDS, f"the kill came too late to test a resumption: {finished}"
    assert attempt_log(root, 1).count(LOADING) == 1

    # What a user does after a crash: unlock the folder, then rerun (the killed job's outputs are incomplete).
    assert snakemake(root, "--unlock", *hidden_args(root)).returncode == 0
    proc = run_hidden(root, "--rerun-incomplete")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 2)
    assert loads(log) == 1, log
    assert f"{SHARDS - len(finished)} captured, {len(finished)} reused from the capture store" in log, log
    for out in hidden_paths(root):
        reused = f"{out.relative_to(root)} [{int(out.stem[-5:]) + 1}/{SHARDS}]: reused from the capture store"
        assert (reused in log) == (out.name in finished), log
        same_shards(out, full_run / out.relative_to(root))


def test_a_failing_shard_stops_the_job_and_keeps_the_shards_before_it(target, tmp_path) -> None:
    root = make_workdir(tmp_path / "work", target)
    bad = tokens_paths(root)[3]
    good = bad.read_bytes()
    bad.write_bytes(good[: len(good) // 2])  # a tokens shard cut short
    proc = run_hidden(root)
    assert proc.returncode != 0
    log = attempt_log(root, 1)
    assert "capture stopped at results/tasks/hidden/shard-00003.safetensors (4 of 6): 3 captured" in log, log
    shard_log = (root / "results" / "logs" / "tasks" / "hidden" / "shard-00003.log").read_text()
    assert "FAILED" in shard_log, shard_log
    assert not any(p.exists() for p in hidden_paths(root))  # Snakemake removed the failed job's outputs ...
    assert [store_path(p).exists() for p in hidden_paths(root)] == [True] * 3 + [False] * 3  # ... not the store

    bad.write_bytes(good)
    proc = run_hidden(root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 2)
    assert loads(log) == 1 and "3 captured, 3 reused" in log, log


def test_changed_settings_are_not_reused(full_run, tmp_path) -> None:
    """A store entry captured with other settings (here top-k) is recaptured, never published as this run's."""
    import shutil

    root = tmp_path / "work"
    shutil.copytree(full_run, root, symlinks=True)
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["hidden"]["target_topk"] = 8
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    os.remove(hidden_paths(root)[0])  # the job must run; its other outputs are removed by Snakemake
    proc = run_hidden(root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 2)
    assert loads(log) == 1 and f"{SHARDS} captured, 0 reused" in log, log
    _, meta = load_packed(hidden_paths(root)[0], HIDDEN_FORMAT)
    assert meta["target_topk"] == 8
