"""The responses rule against the OpenRouter emulator, as a user runs it: snakemake, kill -9, preview, secrets."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
import yaml

from aerie.api.emulator import EmulatorSettings, serve_in_thread
from aerie.api.journal import journal_path, read_journal
from aerie.artifacts import read_jsonl
from conftest import REPO, snakemake

SECRET = "sk-or-v1-aerie-test-SECRET-7f3a9c"  # must never land on disk


def api_config(workdir: Path, base_url: str, n_prompts: int, **responses) -> Path:
    """The demo config with one jsonl dataset regenerated through 'OpenRouter' (the emulator)."""
    src = workdir / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: what is {i} + {i}?"}) + "\n"
                           for i in range(n_prompts + 1)))
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["datasets"] = {"chat": {"source": {"kind": "jsonl", "path": str(src), "id_field": "id"},
                                   "shard_size": n_prompts, "bench_prompts": 1}}
    config["responses"] = {"backend": "openrouter", "model": "moonshotai/kimi-k2.5", "base_url": base_url,
                           "temperature": 1.0, "top_p": 0.95, "max_new_tokens": 256, "concurrency": 100,
                           "provider": {"sort": "price", "quantizations": ["int4"]}, "reasoning": {"enabled": True},
                           "backoff_base_s": 0.05, "backoff_max_s": 0.5, "progress_interval_s": 1,
                           "expected_output_tokens": 100, **responses}
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(workdir: Path, cfg: Path, *targets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--cores", "1", *targets, "--configfile", str(cfg)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OPENROUTER_API_KEY": SECRET})


def test_kill_9_three_times_then_rerun_never_requests_a_finished_sample_again(workdir: Path) -> None:
    n = 2000
    shard = "results/chat/responses/shard-00000.jsonl"
    out = workdir / shard
    log = workdir.parent / "emulator-requests.jsonl"
    emu = EmulatorSettings(api_key=SECRET, latency_mean=0.25, latency_dist="exponential", request_log=str(log),
                           output_tokens_mean=80, faults={"429-retry-after": 0.03, "500": 0.02}, retry_after=0.1)
    rng = random.Random(20261201)
    kills: list[tuple[float, set[str]]] = []
    with serve_in_thread(emu) as base:
        cfg = api_config(workdir, base, n)
        for threshold in sorted(rng.sample(range(100, 1800), 3)):
            proc = start(workdir, cfg, shard)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                jp = journal_path(out)
                if jp.exists() and jp.read_bytes().count(b"\n") >= threshold:
                    break
                time.sleep(0.02)
            assert proc.poll() is None, proc.stdout.read()
            os.killpg(proc.pid, signal.SIGKILL)  # the whole job: snakemake and its script
            proc.wait()
            t_kill = time.time()
            finished = set(read_journal(journal_path(out)).finished)  # a torn tail does not count
            assert len(finished) >= threshold - 1
            kills.append((t_kill, finished))
            assert not out.exists()
            # As after any kill -9 of snakemake, the user removes its stale lock first.
            unlock = snakemake(workdir, "--unlock", shard, "--configfile", str(cfg))
            assert unlock.returncode == 0, unlock.stderr
        proc = start(workdir, cfg, shard)
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output
    by_hash = {}
    for r in read_jsonl(out):
        by_hash[hash_messages(r["messages"])] = r["id"]
    assert len(by_hash) == n
    requests_log = [json.loads(line) for line in log.read_text().splitlines()]
    for t_kill, finished in kills:
        again = [by_hash[x["messages_sha256"]] for x in requests_log
                 if x["t"] > t_kill and by_hash.get(x["messages_sha256"]) in finished]
        assert not again, f"{len(again)} samples finished before a kill were requested again: {again[:5]}"
    ok = [x["messages_sha256"] for x in requests_log if x["outcome"] == "ok"]
    # Only requests in flight at a kill may have been answered twice (paid, then lost with the process).
    assert len(ok) - len(set(ok)) <= 3 * 100
    assert len(read_jsonl(out)) == n and len({r["id"] for r in read_jsonl(out)}) == n
    assert_secret_absent(workdir)


def hash_messages(messages) -> str:
    import hashlib

    blob = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def assert_secret_absent(workdir: Path) -> None:
    """The key is read from the environment only: never in results, journals, logs or .snakemake/."""
    hits = []
    for path in workdir.rglob("*"):
        if path.is_file() and SECRET.encode() in path.read_bytes():
            hits.append(str(path.relative_to(workdir)))
    assert not hits, f"the API key leaked into {hits}"


def test_dry_run_previews_cost_and_a_real_run_refuses_over_budget(workdir: Path) -> None:
    with serve_in_thread(EmulatorSettings(api_key=SECRET, output_tokens_mean=100)) as base:
        cfg = api_config(workdir, base, 400, budget_usd=0.02)
        env_run = lambda *a: subprocess.run(  # noqa: E731
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), *a],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OPENROUTER_API_KEY": SECRET})
        dry = env_run("-n", "results/chat/responses/shard-00000.jsonl", "--configfile", str(cfg))
        text = dry.stdout + dry.stderr
        assert dry.returncode == 0, text
        assert "aerie cost preview" in text and "live: Chutes" in text  # the cheapest int4 endpoint, live
        row = next(line for line in text.splitlines() if line.strip().startswith("chat "))
        # 400 prompts x 100 expected output tokens at Chutes' $1.90/M out (+ prompt tokens at $0.45/M)
        assert row.split()[1:4] == ["1", "400", "40,000"], row
        assert float(row.split()[4]) >= 0.076
        assert "OVER BUDGET" in text
        real = env_run("--cores", "1", "results/chat/responses/shard-00000.jsonl", "--configfile", str(cfg))
        assert real.returncode != 0
        assert "only $0.02 of responses.budget_usd $0.02 remains" in real.stdout + real.stderr
        assert requests.get(f"{base}/emulator/stats", timeout=5).json()["requests"] == 0  # nothing spent
        # The user overrides: the run goes until the budget stops it, keeping what finished.
        over = env_run("--cores", "1", "results/chat/responses/shard-00000.jsonl", "--configfile", str(cfg),
                       "--config", "allow_over_budget=True")
        assert over.returncode != 0
        assert "budget: $0.0" in over.stdout + over.stderr
        finished = read_journal(journal_path(workdir / "results/chat/responses/shard-00000.jsonl")).finished
        assert 50 < len(finished) < 400
        # The preview now counts the money spent and only the prompts still pending.
        dry2 = env_run("-n", "results/chat/responses/shard-00000.jsonl", "--configfile", str(cfg))
        text2 = dry2.stdout + dry2.stderr
        row2 = next(line for line in text2.splitlines() if line.strip().startswith("chat "))
        assert int(row2.split()[2]) == 400 - len(finished)
        assert "already spent: $0.0" in text2
    assert_secret_absent(workdir)
