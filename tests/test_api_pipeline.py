"""The responses rule against the OpenRouter emulator, as a user runs it: snakemake, kill -9, preview, secrets."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
import yaml
from conftest import REPO, snakemake

from aerie.api.emulator import EmulatorSettings, serve_in_thread
from aerie.api.journal import journal_path, read_journal
from aerie.artifacts import read_jsonl

SECRET = "sk-or-v1-aerie-test-SECRET-7f3a9c"  # must never land on disk


def api_config(workdir: Path, base_url: str, n_prompts: int, **responses) -> Path:
    """The demo config with one jsonl dataset regenerated through 'OpenRouter' (the emulator)."""
    src = workdir / "prompts.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"Question {i}: what is {i} + {i}?"}) + "\n"
            for i in range(n_prompts + 1)
        )
    )
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["datasets"] = {
        "chat": {
            "source": {"kind": "jsonl", "path": str(src), "id_field": "id"},
            "shard_size": n_prompts,
            "bench_prompts": 1,
        }
    }
    config["responses"] = {
        "backend": "openrouter",
        "model": "moonshotai/kimi-k2.5",
        "base_url": base_url,
        "temperature": 1.0,
        "top_p": 0.95,
        "max_new_tokens": 256,
        "concurrency": 100,
        "provider": {"sort": "price", "quantizations": ["int4"]},
        "reasoning": {"enabled": True},
        "backoff_base_s": 0.05,
        "backoff_max_s": 0.5,
        "progress_interval_s": 1,
        "expected_output_tokens": 100,
        **responses,
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(workdir: Path, cfg: Path, *targets: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        "1",
        *targets,
        "--configfile",
        str(cfg),
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OPENROUTER_API_KEY": SECRET},
    )


def test_kill_9_three_times_then_rerun_never_requests_a_finished_sample_again(workdir: Path) -> None:
    n = 2000
    shard = "results/chat/responses/shard-00000.jsonl"
    out = workdir / shard
    log = workdir.parent / "emulator-requests.jsonl"
    emu = EmulatorSettings(
        api_key=SECRET,
        latency_mean=0.25,
        latency_dist="exponential",
        request_log=str(log),
        output_tokens_mean=80,
        faults={"429-retry-after": 0.03, "500": 0.02},
        retry_after=0.1,
    )
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
        again = [
            by_hash[x["messages_sha256"]]
            for x in requests_log
            if x["t"] > t_kill and by_hash.get(x["messages_sha256"]) in finished
        ]
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
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OPENROUTER_API_KEY": SECRET},
        )
        dry = env_run("-n", "results/chat/responses/shard-00000.jsonl", "--configfile", str(cfg))
        text = dry.stdout + dry.stderr
        assert dry.returncode == 0, text
        assert "aerie cost preview" in text and "live: Chutes" in text  # the cheapest int4 endpoint, live
        row = next(line for line in text.splitlines() if line.strip().startswith("chat "))
        # 400 prompts x 100 expected output tokens at Chutes' $1.90/M out (+ prompt tokens at $0.45/M)
        assert row.split()[1:5] == ["1", "400", "400", "40,000"], row
        assert float(row.split()[5]) >= 0.076 and "responses.expected_output_tokens 100/sample" in row
        assert "OVER BUDGET" in text
        real = env_run("--cores", "1", "results/chat/responses/shard-00000.jsonl", "--configfile", str(cfg))
        assert real.returncode != 0
        assert "only $0.02 of responses.budget_usd $0.02 remains" in real.stdout + real.stderr
        assert requests.get(f"{base}/emulator/stats", timeout=5).json()["requests"] == 0  # nothing spent
        # The user overrides: the run goes until the budget stops it, keeping what finished.
        over = env_run(
            "--cores",
            "1",
            "results/chat/responses/shard-00000.jsonl",
            "--configfile",
            str(cfg),
            "--config",
            "allow_over_budget=True",
        )
        assert over.returncode != 0
        assert "budget: $0.0" in over.stdout + over.stderr
        finished = read_journal(journal_path(workdir / "results/chat/responses/shard-00000.jsonl")).finished
        assert 50 < len(finished) < 400
        # The preview now counts the money spent and only the prompts still pending.
        dry2 = env_run("-n", "results/chat/responses/shard-00000.jsonl", "--configfile", str(cfg))
        text2 = dry2.stdout + dry2.stderr
        row2 = next(line for line in text2.splitlines() if line.strip().startswith("chat "))
        assert int(row2.split()[2]) == 400 - len(finished)
        # The pilot measured the lengths: the preview now uses the journals' mean, not the configured guess.
        assert f"mean of {len(finished)} journaled" in row2, row2
        # Nothing billed beyond the journals (no request failed or was interrupted): the journals are the spend.
        assert re.search(r"spent: \$0\.0\d+ journaled = \$0\.0\d+; budget \$0\.02", text2), text2
    assert_secret_absent(workdir)


def test_kill_9_at_peak_in_flight_then_the_lost_spend_counts_against_the_budget(workdir: Path) -> None:
    """Requests in flight at a kill are billed by the provider and journaled nowhere. The rerun reconciles
    the account (GET /key) with the journals, shows the difference as lost, refuses a budget that the
    loss exhausts, and - forced to run - stops before the account passes the budget by more than one of
    its own in-flight windows (concurrency x the per-sample cost)."""
    n, shard = 3000, "results/chat/responses/shard-00000.jsonl"
    out = workdir / shard
    emu = EmulatorSettings(
        api_key=SECRET, latency_mean=1.0, latency_dist="fixed", output_tokens_mean=100, output_tokens_dist="fixed"
    )
    per_sample = 7 * 0.45e-6 + 100 * 1.9e-6  # 7 prompt words, 100 output tokens, at Chutes' prices
    auth = {"Authorization": f"Bearer {SECRET}"}
    with serve_in_thread(emu) as base:

        def stats() -> dict:
            return requests.get(f"{base}/emulator/stats", timeout=5).json()

        cfg = api_config(workdir, base, n, concurrency=200, budget_usd=100.0)
        proc = start(workdir, cfg, shard)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            jp = journal_path(out)
            if jp.exists() and jp.read_bytes().count(b"\n") >= 200 and stats()["in_flight"] >= 150:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stdout.read()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        while stats()["in_flight"]:  # the provider finishes (and bills) what was in flight
            time.sleep(0.05)
        billed = requests.get(f"{base}/key", headers=auth, timeout=5).json()["data"]["usage"]
        journaled = read_journal(journal_path(out)).cost
        lost = billed - journaled
        assert lost >= 100 * per_sample, (billed, journaled)  # >= 100 answers paid and never seen
        assert stats()["outcomes"]["client-gone"] >= 100
        assert snakemake(workdir, "--unlock", shard, "--configfile", str(cfg)).returncode == 0

        # A budget the lost spend exhausts, but the journals alone would not: room for 30 more samples.
        budget = round(billed + 30 * per_sample, 6)
        cfg = api_config(workdir, base, n, concurrency=20, budget_usd=budget)
        env = {**os.environ, "OPENROUTER_API_KEY": SECRET}
        sm = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
        dry = subprocess.run(
            [*sm, "-n", shard, "--configfile", str(cfg)], capture_output=True, text=True, timeout=300, env=env
        )
        text = dry.stdout + dry.stderr
        assert dry.returncode == 0, text
        shown = re.search(r"spent: \$([\d.]+) journaled \+ \$([\d.]+) lost to interrupted requests", text)
        assert shown and abs(float(shown.group(2)) - lost) < 0.006, text
        assert "OVER BUDGET" in text
        refused = subprocess.run(
            [*sm, "--cores", "1", shard, "--configfile", str(cfg)], capture_output=True, text=True, timeout=300, env=env
        )
        assert refused.returncode != 0 and "lost to interrupted requests" in refused.stdout + refused.stderr
        forced = subprocess.run(
            [*sm, "--cores", "1", shard, "--configfile", str(cfg), "--config", "allow_over_budget=True"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        log = forced.stdout + forced.stderr
        assert forced.returncode != 0 and "lost to interrupted requests" in log, log
        final = requests.get(f"{base}/key", headers=auth, timeout=5).json()["data"]["usage"]
    window = 20 * per_sample
    assert final <= budget + window, f"account ${final:.4f} for a budget of ${budget:.4f} (window ${window:.4f})"
    assert final > billed  # it did use the room that was left
    # The job log names the samples that were sent before the kill and never answered.
    job_log = (workdir / "results/logs/chat/responses/shard-00000.log").read_text()
    assert "may have been billed unseen" in job_log


def test_quota_reached_through_snakemake_completes_the_shard_and_a_raised_quota_is_resumable(workdir: Path) -> None:
    """The job succeeds with the samples that fit; after the quota is raised, the preview says how to request the
    rest, and `--forcerun` on the shard requests only the prompts the old quota left out."""
    shard = "results/chat/responses/shard-00000.jsonl"
    env = {**os.environ, "OPENROUTER_API_KEY": SECRET}
    sm = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    with serve_in_thread(EmulatorSettings(api_key=SECRET, output_tokens_mean=100, output_tokens_dist="fixed")) as base:
        cfg = api_config(workdir, base, 50)
        config = yaml.safe_load(cfg.read_text())
        config["datasets"]["chat"]["max_output_tokens"] = 2000
        cfg.write_text(yaml.safe_dump(config))
        first = subprocess.run(
            [*sm, "--cores", "1", shard, "--configfile", str(cfg)], capture_output=True, text=True, timeout=300, env=env
        )
        assert first.returncode == 0, first.stdout + first.stderr
        assert len(read_jsonl(workdir / shard)) == 20
        completion = json.loads((workdir / "results/chat/responses/shard-00000.completion.json").read_text())
        assert (completion["samples"], completion["not_requested"], completion["reason"]) == (
            20,
            30,
            "max_output_tokens",
        )
        config["datasets"]["chat"]["max_output_tokens"] = 4000
        cfg.write_text(yaml.safe_dump(config))
        dry = subprocess.run(
            [*sm, "-n", shard, "--configfile", str(cfg)], capture_output=True, text=True, timeout=300, env=env
        )
        assert f"`snakemake --forcerun {shard}`" in dry.stdout + dry.stderr
        more = subprocess.run(
            [*sm, "--cores", "1", "--forcerun", shard, "--configfile", str(cfg), "--", shard],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert more.returncode == 0, more.stdout + more.stderr
        assert requests.get(f"{base}/emulator/stats", timeout=5).json()["requests"] == 40  # 20 + 20, none twice
    assert len(read_jsonl(workdir / shard)) == 40
