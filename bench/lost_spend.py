"""Spend lost at a ``kill -9`` with 2,000 requests in flight: what the provider billed vs what aerie counts.

One emulator process (``python -m aerie.emulator``, 2 s fixed latency, 40 output tokens) bills like a
provider: requests in flight when the client dies are still charged. A responses job
(``aerie.responses.api.job.regenerate_api_shard``, the path the responses rule runs) runs one shard at
concurrency 2,000 in its own process and is killed with SIGKILL once the journal holds >= 2,000 samples
and the emulator has >= 1,900 requests in flight (on a busy 2-core machine the steady state sits a little
under 2,000). After the emulator has finished (and billed) them, the script compares:

- billed: the account's usage (``GET /key``);
- before (main at 1cfab1c): what aerie budgeted the rerun against - the journals' sum;
- after: journals + "lost to interrupted requests", the folder's books a rerun counts at its start
  (``aerie.responses.api.books.folder_money``: the key's books, the account read live).

    .venv/bin/python bench/lost_spend.py            # about 30 s
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
KEY = "sk-bench-lost-spend"


def config(base: str, results: Path) -> dict:
    responses = {
        "backend": "openrouter",
        "model": "moonshotai/kimi-k2.5",
        "base_url": base,
        "api_key_env": "OPENROUTER_API_KEY",
        "temperature": 1.0,
        "top_p": 0.95,
        "max_new_tokens": 256,
        "seed": 0,
        "send_seed": False,
        "concurrency": 2000,
        "connect_timeout_s": 30,
        "read_timeout_s": 900,
        "max_attempts": 8,
        "backoff_base_s": 0.2,
        "backoff_max_s": 2.0,
        "progress_interval_s": 5,
        "require_reasoning": True,
        "expected_output_tokens": 40,
        "budget_usd": 100.0,
        "live_prices": True,
        "provider": {"sort": "price"},
        "reasoning": {"enabled": True},
    }
    return {
        "target": {"path": str(results / "no-target")},
        "responses": responses,
        "datasets": {"chat": {"source": {"kind": "jsonl", "path": "unused"}}},
    }


def main() -> None:
    from aerie.responses.api.books import account_ledger_path, folder_money, read_folder_books, where_from_record
    from aerie.responses.api.journal import read_journal
    from aerie.responses.api.money import RequestCosts

    n = 16000
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        port_file = tmp / "port"
        emu = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aerie.emulator",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--latency-mean",
                "2",
                "--output-tokens-mean",
                "40",
                "--output-tokens-dist",
                "fixed",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            while not (port_file.exists() and port_file.read_text().strip()):
                time.sleep(0.05)
            base = f"http://127.0.0.1:{port_file.read_text().strip()}/api/v1"
            results = tmp / "results"
            shard_dir = results / "chat" / "responses"
            shard_dir.mkdir(parents=True)
            prompts = results / "chat" / "prompts" / "shard-00000.jsonl"
            prompts.parent.mkdir(parents=True)
            prompts.write_text(
                "".join(
                    json.dumps(
                        {
                            "format": "aerie.prompts/1",
                            "id": f"chat/{i}",
                            "dataset": "chat",
                            "messages": [{"role": "user", "content": f"Question {i}: say hi"}],
                            "source": {"kind": "bench"},
                        }
                    )
                    + "\n"
                    for i in range(n)
                )
            )
            cfg = config(base, results)
            (tmp / "config.json").write_text(json.dumps(cfg))
            out = shard_dir / "shard-00000.jsonl"
            job = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import json, sys; from pathlib import Path; "
                    "from aerie.responses.api.job import regenerate_api_shard; from aerie.plan.resolve import api_run; "
                    f"regenerate_api_shard(Path({str(prompts)!r}), Path({str(out)!r}), "
                    f"api_run(json.load(open({str(tmp / 'config.json')!r}))), 'chat', Path({str(results)!r}), "
                    "log=lambda m: None)",
                ],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), "OPENROUTER_API_KEY": KEY},
                start_new_session=True,
                stderr=open(tmp / "job.err", "w"),
            )
            journal = shard_dir / "shard-00000.journal.jsonl"
            peak = 0
            while job.poll() is None:
                stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
                lines = journal.read_bytes().count(b"\n") if journal.exists() else 0
                if lines >= 2000 and stats["in_flight"] >= 1900:
                    peak = stats["in_flight"]
                    break
                time.sleep(0.01)
            if job.poll() is not None:
                raise SystemExit(
                    f"the job ended (rc {job.returncode}, {lines} journaled) before the kill:\n"
                    f"{(tmp / 'job.err').read_text()[-3000:]}"
                )
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            while requests.get(f"{base}/emulator/stats", timeout=5).json()["in_flight"]:
                time.sleep(0.05)  # the provider finishes and bills what was in flight
            billed = requests.get(f"{base}/key", timeout=5).json()["data"]["usage"]
            finished = read_journal(journal).finished
            journaled = sum(r["cost"] for r in finished.values())
            per_request = 40 * 1.9e-6 + 6 * 0.45e-6  # the emulator's Chutes prices, 40 output and 6 prompt tokens
            where = where_from_record(read_folder_books(account_ledger_path(results))[-1])
            os.environ["OPENROUTER_API_KEY"] = KEY  # the rerun reads the key's books and the account live
            money = folder_money(results, where, ["chat"], {"chat": RequestCosts(per_request, per_request)})
            lost = money.parts.lost + money.parts.retries + money.parts.pending
            stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
        finally:
            emu.terminate()
            emu.wait(timeout=30)
    row = {
        "in_flight_at_kill": peak,
        "journaled_samples": len(finished),
        "answered": stats["outcomes"].get("ok", 0),
        "billed_unseen_requests": stats["outcomes"].get("client-gone", 0),
        "billed_usd": billed,
        "before_counted_usd": journaled,
        "before_invisible_usd": billed - journaled,
        "after_counted_usd": journaled + lost,
        "after_lost_usd": lost,
        "after_invisible_usd": billed - journaled - lost,
    }
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
