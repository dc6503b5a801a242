"""Every attempt of a job keeps its log (aerie.tools.rulelog): Snakemake deletes a job's declared log when
it restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake

from aerie.tools.rulelog import attempt_log_path, attempt_logs, keep_attempt_log, open_rule_log


@pytest.fixture()
def restore_stderr():
    import logging

    before = sys.stderr
    yield
    sys.stderr = before
    logging.basicConfig(stream=before, level=logging.WARNING, force=True)


def test_each_attempt_is_numbered_and_survives_the_next(tmp_path: Path, restore_stderr) -> None:
    declared = tmp_path / "logs" / "shard-00003.log"
    log = open_rule_log(declared, echo=False)
    log("first attempt working")
    print("Traceback: first attempt died", file=sys.stderr)
    first = attempt_log_path(declared, 1)
    assert first.name == "shard-00003.attempt-1.log" and os.path.samefile(first, declared)

    declared.unlink()  # what Snakemake does when the job starts again
    log = open_rule_log(declared, echo=False)
    log("second attempt working")
    assert attempt_logs(declared) == {1: first, 2: tmp_path / "logs" / "shard-00003.attempt-2.log"}
    text1, text2 = first.read_text(), attempt_log_path(declared, 2).read_text()
    assert "attempt 1 " in text1 and "first attempt working" in text1 and "first attempt died" in text1
    assert "second" not in text1
    assert text2.splitlines()[0].endswith("earlier attempts: shard-00003.attempt-1.log")
    assert "second attempt working" in text2 and "first attempt" not in text2
    assert declared.read_text() == text2


def test_opening_the_same_attempt_twice_keeps_its_number(tmp_path: Path, restore_stderr) -> None:
    declared = tmp_path / "run.log"
    open_rule_log(declared, echo=False)
    assert keep_attempt_log(declared) == (1, attempt_log_path(declared, 1))
    assert list(attempt_logs(declared)) == [1]


def test_without_hard_links_the_copy_is_written_alongside(tmp_path: Path, restore_stderr, monkeypatch) -> None:
    """Some network and FUSE file systems refuse os.link: the attempt copy is then a second file, written in step."""

    def refuse(*args, **kwargs):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "link", refuse)
    declared = tmp_path / "run.log"
    log = open_rule_log(declared, echo=False)
    log("kept")
    print("a warning", file=sys.stderr)
    sys.stderr.flush()
    copy = attempt_log_path(declared, 1)
    assert not os.path.samefile(copy, declared)
    assert copy.read_text() == declared.read_text() and "kept" in copy.read_text()
    assert "a warning" in copy.read_text()


def test_kill_9_of_snakemake_mid_job_keeps_both_attempts_logs(workdir: Path) -> None:
    """A real responses job (the emulator as provider) killed mid-run with SIGKILL, then rerun to completion:
    the killed attempt's log is still there, beside the one Snakemake recreated."""
    from aerie.emulator import EmulatorSettings, serve_in_thread
    from aerie.responses.api.journal import journal_path

    n = 120
    shard = "results/chat/responses/shard-00000.jsonl"
    declared = workdir / "results/logs/chat/responses/shard-00000.log"
    src = workdir / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} + {i}?"}) + "\n" for i in range(n + 1)))
    emu = EmulatorSettings(api_key="sk-test", latency_mean=0.1, output_tokens_mean=40)
    with serve_in_thread(emu) as base:
        config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        # The responses job reads only the target's tokenizer (checked before any request): a tiny target built in
        # seconds, not the demo's trained one (minutes).
        from tiny_world import save_tiny_llama_target

        target = save_tiny_llama_target(workdir.parent / "target")
        config["target"] = {"path": str(target), "device": "cpu", "dtype": "float32"}
        config["hidden"]["aux_layer_ids"] = [1, 2, 4]  # of its 6 layers
        config["datasets"] = {
            "chat": {
                "source": {"kind": "jsonl", "path": str(src), "id_field": "id"},
                "shard_size": n,
                "bench_prompts": 1,
            }
        }
        config["responses"] = {
            "backend": "openrouter",
            "model": "moonshotai/kimi-k2.5",
            "base_url": base,
            "concurrency": 2,
            "max_new_tokens": 64,
            "progress_interval_s": 0.5,
            "price_per_million_output_usd": 1.0,
            "live_prices": False,
        }
        cfg = workdir / "config.yaml"
        cfg.write_text(yaml.safe_dump(config))
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
            shard,
            "--configfile",
            str(cfg),
        ]
        env = {**os.environ, "OPENROUTER_API_KEY": "sk-test"}
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
        )
        journal = journal_path(workdir / shard)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.exists() and journal.read_bytes().count(b"\n") >= 10:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stdout.read()
        os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its job, as a crash or an OOM kill takes them
        proc.wait()
        killed = declared.read_text()
        assert "attempt 1 " in killed
        unlock = snakemake(workdir, "--unlock", shard, "--configfile", str(cfg))
        assert unlock.returncode == 0, unlock.stderr
        rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr

    logs = attempt_logs(declared)
    assert list(logs) == [1, 2]
    first, second = logs[1].read_text(), logs[2].read_text()
    assert first.startswith(killed)  # the killed attempt's log, whole (its job may have written a little more)
    assert "earlier attempts" not in first.splitlines()[0]
    assert second.splitlines()[0].endswith("earlier attempts: shard-00000.attempt-1.log")
    assert os.path.samefile(logs[2], declared) and "attempt 1 " not in declared.read_text()


def test_the_log_ends_with_the_jobs_exact_peak_memory(tmp_path: Path) -> None:
    """A job that held ~256 MiB for a moment (far shorter than Snakemake's 0.5 s benchmark sampling) says so in its
    log's last line; the fit plan's check reads that line (tests/fit_check.py)."""
    from aerie.tools.rulelog import PEAK_MEMORY

    log = tmp_path / "job.log"
    code = (
        "from aerie.tools.rulelog import open_rule_log\n"
        f"log = open_rule_log({str(log)!r}, echo=False)\n"
        "block = bytearray(256 * 2**20)\n"  # zero-filled and touched: resident
        "del block\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    last = log.read_text().splitlines()[-1]
    peak = PEAK_MEMORY.search(last)
    assert peak and last.endswith("(VmHWM)"), last
    assert 256 < int(peak.group(1).replace(",", "")) < 256 + 200, last  # the block + the interpreter and aerie


def test_third_party_progress_bars_stay_out_of_the_log(tmp_path: Path) -> None:
    """transformers' "Loading weights" bar (tqdm on stderr, which the log takes) is not written to the job's log:
    the job's own lines say what it does. Both orders: transformers imported before the log is opened (as a rule
    script that imports the stage first does) and after."""
    from tiny_world import save_tiny_llama_target

    target = save_tiny_llama_target(tmp_path / "target")
    for order in ("before", "after"):
        declared = tmp_path / f"{order}.log"
        program = f"""
import sys
if {order!r} == "before":
    import transformers
from aerie.tools.rulelog import open_rule_log
log = open_rule_log({str(declared)!r}, echo=False)
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({str(target)!r})
log("loaded")
"""
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        text = declared.read_text()
        assert "loaded" in text and "Loading weights" not in text and "%|" not in text, (order, text)
