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
from collections import Counter
from pathlib import Path

import pytest
import requests
import yaml
from api_world import api_pipeline_config
from conftest import REPO, snakemake

from aerie.emulator import EmulatorSettings, serve_in_thread
from aerie.responses.api.journal import journal_path, read_journal
from aerie.tools.artifacts import read_jsonl

SECRET = "sk-or-v1-aerie-test-SECRET-7f3a9c"  # must never land on disk
TARGET: dict[str, Path] = {}


@pytest.fixture(autouse=True, scope="module")
def api_target(tmp_path_factory) -> Path:
    """The target the configs name: a tiny Llama with a Kimi-style tokenizer (seconds to build), not the demo's
    trained one (minutes): the responses job reads only its tokenizer (checked before any request is paid)."""
    from tiny_world import save_tiny_llama_target

    TARGET["path"] = save_tiny_llama_target(tmp_path_factory.mktemp("target") / "tiny")
    return TARGET["path"]


def api_config(
    workdir: Path, base_url: str, n_prompts: int, datasets: dict[str, dict] | None = None, **responses
) -> Path:
    """The demo config with one jsonl dataset ``chat`` of ``n_prompts`` prompts in one shard regenerated through
    'OpenRouter' (the emulator); or, with ``datasets``, one per name (tests/api_world.py)."""
    datasets = datasets or {"chat": {"n": n_prompts, "shard_size": n_prompts}}
    return api_pipeline_config(workdir, base_url, TARGET["path"], datasets, **responses)


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
        row = next(line for line in text.splitlines() if re.match(r"\s+chat\s+\d+\s+\d+", line))
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
        row2 = next(line for line in text2.splitlines() if re.match(r"\s+chat\s+\d+\s+\d+", line))
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
        # What remains is what the account leaves (room for 30 samples), not what the journals alone would.
        remaining = re.search(r"budget \$[\d.]+, remaining \$(-?[\d.]+)", text)
        assert remaining and abs(float(remaining.group(1)) - 30 * per_sample) < 10 * per_sample, text
        assert "OVER BUDGET" in text
        refused = subprocess.run(
            [*sm, "--cores", "1", shard, "--configfile", str(cfg)], capture_output=True, text=True, timeout=300, env=env
        )
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "lost to interrupted requests" in said
        only = re.search(r"but only \$(-?[\d.]+) of responses.budget_usd", said)
        assert only and abs(float(only.group(1)) - 30 * per_sample) < 10 * per_sample, said
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


# ---- one account, one set of limits, whatever Snakemake schedules ------------------------------------------------

# Every prompt of api_config's named datasets has 8 words ("<name> question <i>: what is <i> + <i>?"), the emulator's
# prompt tokens; with 100 fixed output tokens at Chutes' prices (sort: price, int4) every request costs this.
PER_REQUEST = 8 * 0.45e-6 + 100 * 1.9e-6


def run_snakemake(workdir: Path, cfg: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), *args]
    env = {**os.environ, "OPENROUTER_API_KEY": SECRET}
    return subprocess.run([*cmd, "--configfile", str(cfg)], capture_output=True, text=True, timeout=timeout, env=env)


def dataset_of_request(workdir: Path) -> dict[str, str]:
    """messages sha256 (the emulator's request log) -> dataset, from the prompt shards."""
    return {
        hash_messages(p["messages"]): p["dataset"]
        for path in (workdir / "results").glob("*/prompts/shard-*.jsonl")
        for p in read_jsonl(path)
    }


def journal_totals(workdir: Path, dataset: str) -> tuple[float, int, int]:
    """USD, output tokens and samples in a dataset's journals."""
    records = [r for j in (workdir / "results" / dataset / "responses").glob("*.journal.jsonl") for r in read_jsonl(j)]
    return sum(r["cost"] for r in records), sum(r["usage"]["completion_tokens"] for r in records), len(records)


@pytest.mark.slow
def test_shards_and_datasets_scheduled_at_once_share_one_concurrency_budget_and_quota(workdir: Path) -> None:
    """Rule responses is one job for every API shard (aerie.responses.api.job), so `--cores 4` / `--jobs 4` cannot
    multiply
    the run's limits. With one job per shard, 4 shards of one dataset kept 4 x 40 requests in flight and were billed
    ~4x the budget, and shards of one dataset each used the whole quota (issue 23's table: +315% at 4 jobs). Here,
    against the emulator with overlapping requests: (1) one dataset in 4 shards, a budget for 150 of its 400
    prompts; (2) four datasets, one of them quota'd, a budget for 260 requests. The emulator's own figures - most
    requests in flight at once, dollars billed, output tokens billed per dataset - stay within the single-client
    bound (with fixed-length answers: not a cent, not a token over)."""
    concurrency = 40
    emu = lambda log: EmulatorSettings(  # noqa: E731
        api_key=SECRET, latency_mean=0.2, output_tokens_mean=100, output_tokens_dist="fixed", request_log=str(log)
    )
    # (1) one dataset, 4 shards, --cores 4
    one = workdir / "one"
    one.mkdir()
    budget = round(150 * PER_REQUEST, 6)
    with serve_in_thread(emu(workdir / "one.requests.jsonl")) as base:
        cfg = api_config(
            one, base, 0, {"talk": {"n": 400, "shard_size": 100}}, concurrency=concurrency, budget_usd=budget
        )
        proc = run_snakemake(one, cfg, "--cores", "4", "responses", "--config", "allow_over_budget=True")
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "budget: $" in out, out  # the budget stopped the run
    assert re.search(r"^responses\s+1$", out, flags=re.M), out  # one job for the 4 shards
    shards = sorted((one / "results/talk/prompts").glob("shard-*.jsonl"))
    assert len(shards) == 4
    billed = stats["charged_usd"]
    assert budget - 3 * PER_REQUEST <= billed <= budget + 1e-9, (billed, budget)
    assert concurrency / 2 <= stats["max_in_flight"] <= concurrency, stats
    assert journal_totals(one, "talk")[0] == pytest.approx(billed)  # nothing billed that no journal holds

    # (2) four datasets (one quota'd at 30 answers), --jobs 4
    four = workdir / "four"
    four.mkdir()
    budget = round(260 * PER_REQUEST, 6)
    quota = 3000
    datasets = {name: {"n": 100, "shard_size": 50} for name in ("alpha", "beta", "gamma")}
    datasets["quota"] = {"n": 200, "shard_size": 50, "max_output_tokens": quota}
    with serve_in_thread(emu(workdir / "four.requests.jsonl")) as base:
        cfg = api_config(four, base, 0, datasets, concurrency=concurrency, budget_usd=budget)
        proc = run_snakemake(
            four, cfg, "--jobs", "4", "--cores", "4", "responses", "--config", "allow_over_budget=True"
        )
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "budget: $" in out, out
    assert re.search(r"^responses\s+1$", out, flags=re.M), out
    billed = stats["charged_usd"]
    assert budget - 3 * PER_REQUEST <= billed <= budget + 1e-9, (billed, budget)
    assert concurrency / 2 <= stats["max_in_flight"] <= concurrency, stats
    dataset_of = dataset_of_request(four)
    tokens = Counter()
    for line in request_log(workdir / "four.requests.jsonl"):
        tokens[dataset_of[line["messages_sha256"]]] += line["completion_tokens"]
    assert tokens["quota"] == journal_totals(four, "quota")[1] <= quota, tokens
    assert tokens["quota"] > quota - 2 * 100  # and it did use its quota
    # The datasets took turns: the budget reached every one of them, none was finished while another starved.
    samples = {name: journal_totals(four, name)[2] for name in ("alpha", "beta", "gamma")}
    assert max(samples.values()) - min(samples.values()) <= concurrency and min(samples.values()) >= 60, samples
    assert sum(journal_totals(four, d)[0] for d in datasets) == pytest.approx(billed)


def request_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(what, deadline_s: float, step: float = 0.05):
    """Poll ``what()`` until it is truthy (its value) or the deadline passes (AssertionError)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not within {deadline_s} s: {what}")


@pytest.mark.slow
def test_a_rerun_at_once_after_kill_9_prices_answers_still_in_flight_and_the_report_adds_up_to_the_account(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aerie.publish.report import figure_spend, load_responses
    from aerie.responses.api.books import spend_story

    """Long reasoning: 40 requests are sent and the job is killed (kill -9 of snakemake and its job) while their
    30 s answers are still being generated; a rerun starts at once. The account does not show them yet and no
    journal holds them, but the intents log does: the rerun prices them at the expected cost until the account
    settles, so it stays within the budget once they are billed (without that it ended 40 requests over, +40%).
    Then the budget is raised and the run finishes with timeouts billed and retried; the spend figure of the report
    adds up, part by part, to what the emulator billed: journaled + billed retries + lost to interrupted requests."""
    concurrency, first_wave = 40, 40
    shard_logs = workdir / "results/logs/talk/responses"
    emu = EmulatorSettings(api_key=SECRET, latency_mean=45.0, output_tokens_mean=100, output_tokens_dist="fixed")
    budget = round(100 * PER_REQUEST, 6)
    with serve_in_thread(emu) as base:

        def stats() -> dict:
            return requests.get(f"{base}/emulator/stats", timeout=5).json()

        cfg = api_config(
            workdir,
            base,
            0,
            {"talk": {"n": 200, "shard_size": 100}},
            concurrency=concurrency,
            budget_usd=budget,
            progress_interval_s=0.5,
            read_timeout_s=60,
        )
        proc = start(workdir, cfg, "responses", "--config", "allow_over_budget=True")
        wait_for(lambda: proc.poll() is not None or stats()["in_flight"] >= first_wave, 180)
        assert proc.poll() is None, proc.stdout.read()
        os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its job, 40 answers still being generated
        proc.wait()
        emu.latency_mean = 0.3  # the rerun's own answers come quickly; the 40 above still take their 45 s
        assert snakemake(workdir, "--unlock", "--configfile", str(cfg)).returncode == 0
        rerun = run_snakemake(workdir, cfg, "--cores", "1", "responses", "--config", "allow_over_budget=True")
        wait_for(lambda: stats()["in_flight"] == 0, 90)  # the provider finishes (and bills) the 40
        billed = stats()["charged_usd"]
        assert stats()["outcomes"]["client-gone"] == first_wave

        # The scenario: when the rerun started, the account showed none of the 40 (the ledger's start reading).
        starts = [r for r in read_jsonl(workdir / "results/api_account.jsonl") if r["event"] == "start"]
        assert len(starts) == 2 and starts[-1]["usage"] == 0.0, starts
        # The preview at its start (onstart) and its log say what is priced, in the same words.
        out = rerun.stdout + rerun.stderr
        pending = re.search(r"\+ \$([\d.]+) sent before an interruption, not yet billed = ", out)
        assert pending and float(pending.group(1)) == pytest.approx(first_wave * PER_REQUEST, rel=0.1), out
        assert rerun.returncode != 0 and "budget: $" in out
        assert "sent before an interruption, not yet billed" in (workdir / "results/logs/responses.log").read_text()
        assert billed <= budget + 1e-9, f"billed ${billed:.6f} for a budget of ${budget:.6f}"
        assert billed >= budget - 3 * PER_REQUEST  # and the rerun used the room that was left
        assert "may have been billed unseen" in (shard_logs / "shard-00000.log").read_text()

        # Finish with a raised budget; 5% of the answers outlast the read timeout (billed, retried).
        emu.faults, emu.slow_seconds = {"slow": 0.05}, 3.0
        config = yaml.safe_load(cfg.read_text())
        config["responses"].update(budget_usd=10.0, read_timeout_s=1.5)
        cfg.write_text(yaml.safe_dump(config))
        done = run_snakemake(workdir, cfg, "--cores", "1", "responses")
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(lambda: stats()["in_flight"] == 0, 60)
        final = stats()
        preview = run_snakemake(workdir, cfg, "-n", "responses")
        # The report's spend figure, from the artifacts and the account read live (as the report rule does).
        monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
        shards = sorted((workdir / "results/talk/responses").glob("shard-?????.jsonl"))
        spend = figure_spend(load_responses(shards), workdir / "spend.png", story=spend_story(shards))
    timeouts = final["outcomes"]["client-gone"] - first_wave
    assert timeouts > 0, final
    # The preview names every part as the report does (all costs equal here, so the split is exact).
    words = re.search(
        r"spent: \$([\d.]+) journaled \+ \$([\d.]+) billed retries \+ \$([\d.]+) lost to interrupted requests",
        preview.stdout + preview.stderr,
    )
    assert words, preview.stdout + preview.stderr
    assert float(words.group(2)) == pytest.approx(timeouts * PER_REQUEST, abs=1e-4)
    assert float(words.group(3)) == pytest.approx(first_wave * PER_REQUEST, abs=1e-4)
    assert spend["account_usd"] == pytest.approx(final["charged_usd"], abs=1e-9)
    assert spend["total_usd"] == pytest.approx(final["charged_usd"], abs=1e-9)
    assert spend["journaled_usd"] == pytest.approx(journal_totals(workdir, "talk")[0])
    assert spend["lost_usd"] == pytest.approx(first_wave * PER_REQUEST, rel=1e-6)
    assert spend["billed_retries_usd"] == pytest.approx(timeouts * PER_REQUEST, rel=1e-6)
