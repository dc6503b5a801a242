"""The demo pipeline through a real SLURM cluster (single node on loopback) with profiles/slurm.

Installs Debian's slurm-wlm and munge when missing (root + apt-get; skipped elsewhere, never under
CI=true), starts munged/slurmctld/slurmd in a temp dir, runs the whole DAG of a shrunk demo with
``--workflow-profile profiles/slurm`` plus the overrides a 2-core CPU node needs, checks from the
job-completion log that every Snakemake job ran as its own sbatch job that COMPLETED, and that the
deterministic outputs equal those of a local run of the same config. The daemons are stopped by PID.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake
from slurm_cluster import local_slurm, read_jobcomp
from test_pipeline_e2e import small_demo_config

pytestmark = pytest.mark.slow

# Both runs use the same cores, so every job gets the same thread count (scripts pin torch to it) and
# the fp32 CPU results are bit-identical.
CORES = min(2, os.cpu_count() or 1)


def slurm_demo_config() -> dict:
    """small_demo_config() shrunk further: one humaneval shard, fewer bench prompts, a shorter benchmark."""
    config = small_demo_config()
    # The target and the tasks dataset stay as in small_demo_config(): a smaller tokenizer corpus and 20
    # training steps made the target answer HumanEval prompts with an empty turn (the tokens job fails).
    config["datasets"]["humaneval"]["max_prompts"] = 4
    config["datasets"]["humaneval"]["shard_size"] = 4
    config["datasets"]["humaneval"]["bench_prompts"] = 1
    config["datasets"]["tasks"]["bench_prompts"] = 1
    config["bench"].update({"max_new_tokens": 8, "max_prompts": 2, "warmup": 0})
    config["bench"]["gate"] = {"min_speedup": 0.0, "must_beat_references": False}
    # A CPU node: no job asks for (or checks) a GPU.
    config["resources"] = {k: 0 for k in config["resources"]}
    return config


def slurm_overrides() -> list[str]:
    """What the loopback cluster needs on top of profiles/slurm (a value on the command line wins).

    The profile's partitions (cpu, gpu), GPUs (8 x h200) and memory (up to 512 GB) are examples for a
    real cluster: this one has one 2-core node, partition ``debug``, no GPU and no accounting.
    ``--default-resources``/``--set-resources`` replace the profile's lists as a whole.
    """
    rules = ("responses", "responses_hf", "tokens", "draft_vocab", "hidden", "drafter", "bench")
    return [
        "--cores",
        str(CORES),
        "--jobs",
        "2",
        "--slurm-no-account",
        "--slurm-init-seconds-before-status-checks",
        "5",
        "--latency-wait",
        "10",
        "--default-resources",
        "slurm_partition=debug",
        "mem_mb=500",
        "runtime=30",
        "--set-resources",
        *[f"{r}:{k}" for r in rules for k in ("slurm_partition=debug", "mem_mb=500", "gpu=0")],
        # The profile deploys each rule's conda env; this node has no conda and the demo needs only the installed
        # venv. env-modules replaces conda in the profile's list, and no rule declares modules: nothing is deployed.
        "--software-deployment-method",
        "env-modules",
    ]


def load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def same_tensors(a: Path, b: Path) -> bool:
    import torch

    ta, tb = load_tensors(a), load_tensors(b)
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape and torch.equal(ta[k], tb[k]) for k in ta
    )


def same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


# Outputs that must be equal in both runs: (glob under results/, comparison).
DETERMINISTIC = [
    ("*/prompts/*.jsonl", same_bytes),  # seeded synthetic tasks / the shipped HumanEval prompts
    ("demo-target/*.safetensors", same_tensors),  # fp32 CPU training, fixed seed and threads
    ("demo-target/tokenizer.json", same_bytes),
    ("tasks/tokens/shard-*.safetensors", same_tensors),  # greedy in-process generation, kept ids
    ("humaneval/tokens/shard-*.safetensors", same_tensors),  # greedy through transformers serve
    ("vocab/draft_vocab.safetensors", same_tensors),
    ("*/hidden/shard-*.safetensors", same_tensors),
    ("drafter/demo/model.safetensors", same_tensors),
]
# Not compared: responses/*.jsonl and tokens/*.report.json (timings, ports, attempts), logs and
# benchmarks (timings), bench/demo.json and .png (tokens/s are measurements).


def compare(local: Path, slurm: Path) -> dict[str, bool]:
    result = {}
    for pattern, same in DETERMINISTIC:
        files = sorted((local / "results").glob(pattern))
        assert files, f"the local run wrote nothing matching results/{pattern}"
        for f in files:
            rel = f.relative_to(local)
            other = slurm / rel
            assert other.exists(), f"the SLURM run did not write {rel}"
            result[str(rel)] = same(f, other)
    return result


# rules/prompts.smk, rules/report.smk and bench_set: jobs of a second or less, never worth an sbatch round trip.
LOCAL_RULES = ("prompts", "bench_prompts", "bench_set", "report_figures", "tokenizer_check", "model_card")


def expected_jobs(workdir: Path, configfile: Path) -> dict[str, int]:
    proc = snakemake(workdir, "-n", "--cores", str(CORES), "--configfile", str(configfile))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    counts = {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M)}
    counts.pop("total")
    counts.pop("all")  # the target rule runs nothing: the main process marks it done
    return counts


def test_demo_pipeline_through_slurm_matches_local_run(tmp_path: Path) -> None:
    config = slurm_demo_config()
    local, slurm = tmp_path / "local", tmp_path / "slurm"
    for d in (local, slurm):
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump(config))

    with local_slurm(tmp_path / "cluster", cpus=CORES) as cluster:
        jobs = expected_jobs(slurm, slurm / "config.yaml")
        proc = snakemake(
            slurm,
            "--workflow-profile",
            str(REPO / "profiles" / "slurm"),
            *slurm_overrides(),
            "--configfile",
            str(slurm / "config.yaml"),
            timeout=1800,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-8000:] + cluster.logs()
        assert not cluster.queued_job_ids()
        records = read_jobcomp(cluster.jobcomp)

    # Every job of a working rule was submitted with sbatch, once, and its SLURM job COMPLETED; the tiny rules
    # (localrule: cutting prompt shards, drawing the report's figures) ran on the submitting host instead.
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+)/", out)
    per_rule: dict[str, int] = {}
    for _, rule in submitted:
        per_rule[rule] = per_rule.get(rule, 0) + 1
    cluster_jobs = {rule: n for rule, n in jobs.items() if rule not in LOCAL_RULES}
    assert per_rule == cluster_jobs, (per_rule, cluster_jobs, out[-5000:])
    ran_here = re.findall(r"^localrule (\w+):", out, flags=re.M)
    assert {r: ran_here.count(r) for r in LOCAL_RULES} == {r: jobs[r] for r in LOCAL_RULES}, (ran_here, jobs)
    for slurm_id, rule in submitted:
        assert slurm_id in records, f"no job-completion record for SLURM job {slurm_id} ({rule})"
        rec = records[slurm_id]
        assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", rec
        assert rec["Partition"] == "debug" and rec["NodeList"] == "localhost", rec
    assert len(records) == sum(cluster_jobs.values()), records  # nothing else ran on the cluster

    # The same config run locally gives the same deterministic outputs.
    proc = snakemake(local, "--cores", str(CORES), "--configfile", str(local / "config.yaml"), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    result = compare(local, slurm)
    print("\n".join(f"{'same' if v else 'DIFFERENT'}  {k}" for k, v in result.items()))
    assert all(result.values()), {k: v for k, v in result.items() if not v}
    for d in (local, slurm):
        assert (d / "results" / "bench" / "demo.json").exists()
