"""In-process responses (``responses.backend: hf``) load the target once per run, through Snakemake.

A tiny random Llama target with a Kimi-style tokenizer and two in-process datasets with different sampling
settings (greedy, and sampled at temperature 0.9 with another seed), their prompt shards written by the
pipeline's own prompts rule: rule ``responses_hf`` answers every shard of both in one job with one target
load (counted from the job's log), each shard equals the shard ``generate_hf`` writes alone with a load of
its own (every field but the measured ``latency_s``), a run killed mid-way (SIGKILL of the whole Snakemake
process group) is resumed with one load that generates only the shards the killed run had not finished, a
changed setting regenerates only its dataset's shards, and ``snakemake -n`` says how many target loads the
responses stage contains and what the job asks for (threads, GPUs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake
from tiny_world import save_tiny_llama_target

from aerie.responses.in_process import generate_hf
from aerie.responses.sampling import Sampling
from aerie.target_model.store import (
    GENERATION_STORE_DIR,
    generation_record_path,
    responses_loads_text,
    store_path,
    stored_generation,
)
from aerie.tools.artifacts import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# Two datasets of 3 shards each (3 prompts a shard, one held out for the benchmark); ~1 s a shard here.
DATASETS = {"greedy": {"temperature": 0.0, "seed": 0}, "sampled": {"temperature": 0.9, "seed": 11}}
SHARDS_PER_DATASET, SHARD_SIZE = 3, 3
SHARDS = len(DATASETS) * SHARDS_PER_DATASET
LOADS = re.compile(r"^\S+ aerie responses: .* target loads in this job: (\d+)", flags=re.M)  # the job's summary
LOADING = "loading the target "  # logged by each load (aerie.responses.in_process.GenerationSession.open)


def loads(log: str) -> int:
    """Target loads of one attempt of the job, from its log: the loads it logged, checked against its summary."""
    (summary,) = LOADS.findall(log)
    assert int(summary) == log.count(LOADING), log
    return int(summary)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_tiny_llama_target(tmp_path_factory.mktemp("responses_loads") / "target")


def make_config(root: Path, target: Path, **resources: int) -> Path:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"] = {"path": str(target), "device": "cpu", "dtype": "float32"}
    config["responses"].update(backend="hf", max_new_tokens=24, batch_size=2)
    config["datasets"] = {
        name: {
            "source": {"kind": "synthetic", "families": ["arith", "lists"], "count": 10, "seed": 3 + i},
            "shard_size": SHARD_SIZE,
            "bench_prompts": 1,
            "responses": settings,
        }
        for i, (name, settings) in enumerate(DATASETS.items())
    }
    config["hidden"]["aux_layer_ids"] = [1, 3, 4]  # not captured here; set because SGLang's default needs 8+ layers
    config["resources"] = {**{k: 0 for k in config["resources"]}, **resources}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def responses_paths(root: Path) -> list[Path]:
    return [
        root / "results" / name / "responses" / f"shard-{s:05d}.jsonl"
        for name in DATASETS
        for s in range(SHARDS_PER_DATASET)
    ]


def prompts_of(out: Path) -> Path:
    return out.parent.parent / "prompts" / out.name


def targets(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in responses_paths(root)]


def run(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return snakemake(
        root, *targets(root), "--cores", "1", *extra, "--configfile", str(root / "config.yaml"), timeout=900
    )


def dry_run(root: Path, *extra: str) -> str:
    proc = snakemake(root, "-n", *targets(root), *extra, "--configfile", str(root / "config.yaml"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def plan_line(root: Path, *extra: str) -> str:
    # Only the line of rules/responses.smk (one job for every in-process shard).
    lines = re.findall(r"^aerie responses plan: (?:rule responses_hf|all) .*$", dry_run(root, *extra), flags=re.M)
    assert len(lines) == 1, lines
    return lines[0]


def attempt_log(root: Path, attempt: int) -> str:
    return (root / "results" / "logs" / f"responses_hf.attempt-{attempt}.log").read_text()


def without_timing(path: Path) -> list[dict]:
    """The shard's records without ``latency_s`` (a measurement; everything else is decided by the inputs)."""
    return [{k: v for k, v in r.items() if k != "latency_s"} for r in read_jsonl(path)]


@pytest.fixture(scope="module")
def full_run(target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("full") / "work"
    make_config(root, target)
    assert plan_line(root) == (
        f"aerie responses plan: rule responses_hf (one job for all {SHARDS} in-process shards) publishes "
        f"{SHARDS} pending: 1 target load when it runs (one job per shard: {SHARDS})"
    )
    proc = run(root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def test_one_job_one_load_for_every_shard_of_every_dataset(full_run) -> None:
    root = full_run
    log = attempt_log(root, 1)
    assert loads(log) == 1, log
    assert f"aerie responses: {SHARDS} in-process shards, {SHARDS} generated, 0 reused" in log, log
    for out in responses_paths(root):
        # Each shard has its own file (a hard link to the store entry), its own record and its own log.
        store = store_path(out, GENERATION_STORE_DIR)
        assert out.exists() and os.path.samefile(out, store) and generation_record_path(store).exists()
        assert len(read_jsonl(out)) == len(read_jsonl(prompts_of(out))) > 0
        shard_log = (
            root / "results" / "logs" / out.parent.parent.name / "responses" / out.name.replace(".jsonl", ".log")
        )
        text = shard_log.read_text()
        assert f"{out.relative_to(root)} [" in text and '"samples":' in text, text
    assert {r["params"]["temperature"] for r in read_jsonl(responses_paths(root)[-1])} == {0.9}
    assert (
        plan_line(root)
        == f"aerie responses plan: all {SHARDS} in-process responses shards are published: 0 target loads"
    )


def test_shards_equal_those_generated_alone_with_a_load_each(full_run, target, tmp_path) -> None:
    """Seeds are per shard and batch, so sharing one load changes nothing: also for the sampled dataset."""
    config = yaml.safe_load((full_run / "config.yaml").read_text())
    for out in responses_paths(full_run)[:: SHARDS_PER_DATASET - 1]:  # shards 0 and 2 of greedy, 1 of sampled
        r = {**config["responses"], **config["datasets"][out.parent.parent.name]["responses"]}
        alone = tmp_path / out.parent.parent.name / out.name
        summary = generate_hf(
            prompts_of(out),
            alone,
            str(target),
            Sampling(
                temperature=r["temperature"],
                top_p=r["top_p"],
                max_new_tokens=r["max_new_tokens"],
                batch_size=r["batch_size"],
                seed=r["seed"],
            ),
            device="cpu",
            dtype="float32",
            threads=1,
            log=lambda _: None,
        )
        assert summary["samples"] > 0
        assert without_timing(out) == without_timing(alone), out


def test_killed_run_resumes_with_one_load_and_only_the_missing_shards(full_run, target, tmp_path) -> None:
    root = tmp_path / "work"
    config = make_config(root, target)
    # The prompts first (cheap, CPU), so the kill below lands inside the responses job.
    assert snakemake(root, *(str(prompts_of(p).relative_to(root)) for p in responses_paths(root)), "--cores", "1",
                     "--configfile", str(config)).returncode == 0  # fmt: skip
    records = [generation_record_path(store_path(p, GENERATION_STORE_DIR)) for p in responses_paths(root)]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(root)]
    cmd += [*targets(root), "--cores", "1", "--configfile", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if sum(r.exists() for r in records) >= 2:
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # Snakemake, the job and everything it started: a crash
        proc.wait()
    finished = [r.exists() for r in records]
    assert 2 <= sum(finished) < SHARDS, f"the kill came too late to test a resumption: {finished}"
    assert attempt_log(root, 1).count(LOADING) == 1
    # The plan judges from the files: a shard the killed job published is not pending (the rerun relinks it);
    # one it finished but had not published yet is, served by the store.
    published, done = sum(p.exists() for p in responses_paths(root)), sum(finished)
    stored = f", {done - published} of them from the generation store" if done > published else ""
    assert plan_line(root, "--rerun-incomplete") == (
        f"aerie responses plan: rule responses_hf (one job for all {SHARDS} in-process shards) publishes "
        f"{SHARDS - published} pending{stored}: 1 target load when it runs (one job per shard: {SHARDS - done})"
    )

    # What a user does after a crash: unlock the folder, then rerun (the killed job's outputs are incomplete).
    assert snakemake(root, "--unlock", *targets(root), "--configfile", str(config)).returncode == 0
    proc = run(root, "--rerun-incomplete")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 2)
    assert loads(log) == 1, log
    assert f"{SHARDS - sum(finished)} generated, {sum(finished)} reused from the generation store" in log, log
    for n, (out, done) in enumerate(zip(responses_paths(root), finished), 1):
        reused = f"{out.relative_to(root)} [{n}/{SHARDS}]: reused from the generation store"
        assert (reused in log) == done, log
        assert without_timing(out) == without_timing(full_run / out.relative_to(root)), out


def test_a_forced_rerun_loads_nothing_and_a_changed_setting_regenerates_its_dataset_alone(full_run, tmp_path) -> None:
    root = tmp_path / "work"
    shutil.copytree(full_run, root, symlinks=True)  # separate files: the original run stays untouched
    proc = run(root, "--forcerun", "responses_hf")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 2)
    assert loads(log) == 0 and f"0 generated, {SHARDS} reused" in log, log

    config = yaml.safe_load((root / "config.yaml").read_text())
    config["datasets"]["sampled"]["responses"]["max_new_tokens"] = 8
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    os.remove(responses_paths(root)[0])  # the job must run (parameters alone never rerun paid work)
    proc = run(root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = attempt_log(root, 3)
    assert loads(log) == 1, log
    assert f"{SHARDS_PER_DATASET} generated, {SHARDS - SHARDS_PER_DATASET} reused" in log, log
    for out in responses_paths(root):
        changed = out.parent.parent.name == "sampled"
        assert all(len(r["output_token_ids"]) <= 8 for r in read_jsonl(out)) or not changed
        if not changed:
            assert without_timing(out) == without_timing(full_run / out.relative_to(root))


def test_a_store_entry_whose_bytes_changed_is_not_reused(full_run, tmp_path) -> None:
    out = responses_paths(full_run)[1]
    store = tmp_path / "generated" / out.name
    store.parent.mkdir()
    shutil.copyfile(store_path(out, GENERATION_STORE_DIR), store)
    shutil.copyfile(generation_record_path(store_path(out, GENERATION_STORE_DIR)), generation_record_path(store))
    key = json.loads(generation_record_path(store).read_text())["key"]
    assert stored_generation(store, key) is not None
    assert stored_generation(store, "0" * 64) is None  # other prompts, target or settings
    store.write_bytes(store.read_bytes()[:-10])  # cut short
    assert stored_generation(store, key) is None
    generation_record_path(store).unlink()  # a crash between the shard and its record
    assert stored_generation(store, key) is None


def test_dry_run_job_resources_and_served_shards(target, tmp_path) -> None:
    root = tmp_path / "work"
    make_config(root, target, responses_gpus=1)
    out = dry_run(root, "--cores", "2", "--resources", "gpu=1")  # a host with one GPU (the default profile: 0)
    job = re.search(r"^rule responses_hf:\n(?:    .*\n)+", out, flags=re.M).group(0)
    # One job with every core and the configured GPUs (checked against the grant in the job: aerie.tools.gpu_slots).
    assert "threads: 2" in job and re.search(r"resources: .*\bgpu=1\b", job), job
    assert re.search(r"^responses_hf\s+1$", out, flags=re.M) and not re.search(r"^responses\s+\d+$", out, flags=re.M)

    # A dataset served by the server rule responses starts: one load for the one job of every API shard.
    config = yaml.safe_load((root / "config.yaml").read_text())
    responses = {n: {**config["responses"], **d["responses"]} for n, d in config["datasets"].items()}
    responses["sampled"].update(backend="openai", serve="transformers")
    names = {n: [f"{s:05d}" for s in range(SHARDS_PER_DATASET)] for n in DATASETS}
    assert responses_loads_text(config["target"], responses, names, root / "results") == (
        f"aerie responses plan: rule responses_hf (one job for all {SHARDS_PER_DATASET} in-process shards) publishes "
        f"{SHARDS_PER_DATASET} pending: 1 target load when it runs (one job per shard: {SHARDS_PER_DATASET}); "
        f"{SHARDS_PER_DATASET} pending shards through the server rule responses starts (responses.serve): "
        "1 target load (one job for every API shard)"
    )
