"""Books per results folder on a shared API key, and the batch path at size (issue 39).

``books``: two runs on one key against a hostile emulator process (lognormal answers, refusals, and answers that
outlast the jobs' read timeout: billed, retried - money no journal holds), in three schedules - at once; one
SIGKILLed with its requests in flight and restarted at once; one after the other - each run a responses job in a
process of its own over its own results folder (``aerie.responses.api.job.regenerate_api_shards``, the path rule
``responses`` runs), for the code before (83082ff, the account's growth since the folder's first start read as the
folder's) and after (the key's books). Per folder: what the emulator billed for its requests (its request log, by
the hash of each request's messages) against what the folder's report says (``spend_story``, read live with the
key, after both runs: what a user sees when they open the first folder's report later).

``batch``: one run of 20,000 prompts through ``responses.mode: batch`` (batches of 2,000) against an emulator whose
batches fail entries, expire, and lose polls and submissions, SIGKILLed once mid-run and started again: answers
paid more than once, billed vs journaled vs budget, the measured batch price, batches, wall time, CPU and peak
memory of the job processes.

    .venv/bin/python bench/shared_key.py                    # both, about 10 minutes on 2 busy cores
    .venv/bin/python bench/shared_key.py --only batch
    .venv/bin/python bench/shared_key.py --table            # the tables of bench/results/shared_key.json

Writes ``bench/results/shared_key.json`` (one row per scenario and code, with the commits, command and load).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from run_record import code_identity, command_line, machine, machine_load, write_json_atomic  # noqa: E402

BEFORE = "83082ff"
KEY = "sk-bench-shared-key"
CHUTES = (0.45e-6, 1.9e-6)
OUT = REPO / "bench" / "results" / "shared_key.json"
SCHEDULES = ("at-once", "killed-restarted", "one-after-the-other")

JOB = (
    "import json, sys; from pathlib import Path; "
    "from aerie.responses.api.job import ApiShardTask, regenerate_api_shards; from aerie.plan.resolve import api_run; "
    "c, t = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])); "
    "r = regenerate_api_shards([ApiShardTask(d, Path(p), Path(o)) for d, p, o in t], api_run(c), log=lambda m: None); "
    "print(json.dumps({'unfinished': sum(isinstance(v, str) for v in r.values())}), flush=True)"
)
REPORT = {
    "before": "from aerie.responses.api.money import spend_story",
    "after": "from aerie.responses.api.books import spend_story",
}


def snapshot(ref: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], capture_output=True, text=True, check=True)
    (dest / ".commit").write_text(commit.stdout.strip() + "\n")
    return dest


class Emulator:
    """An emulator process on a free port with its own request log, stopped with SIGTERM."""

    def __init__(self, folder: Path, *args: str):
        port_file = folder / "emulator.port"
        self.log = folder / "requests.jsonl"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aerie.emulator", "--port", "0", "--port-file", str(port_file),
             "--request-log", str(self.log), *args],
            cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the emulator did not start")
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{port_file.read_text().strip()}/api/v1"

    def stats(self) -> dict:
        return requests.get(f"{self.base}/emulator/stats", timeout=10).json()

    def settled(self, timeout: float = 600) -> dict:
        """The figures once nothing is in flight and no batch is running (everything finished and billed)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if not s["in_flight"] and not set(s.get("batches", {})) & {"validating", "in_progress"}:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def config(base: str, budget: float, **responses) -> dict:
    """The settings a responses job reads (the schema's defaults written out: the before code reads them as a dict)."""
    return {
        "target": {"path": "unused-by-openrouter"},
        "datasets": {"chat": {"source": {"kind": "jsonl", "path": "unused"}}},
        "responses": {
            "backend": "openrouter", "model": "moonshotai/kimi-k2.5", "base_url": base,
            "api_key_env": "OPENROUTER_API_KEY", "temperature": 1.0, "top_p": 0.95, "max_new_tokens": 512,
            "seed": 0, "send_seed": False, "concurrency": 100, "connect_timeout_s": 30, "read_timeout_s": 2,
            "max_attempts": 8, "backoff_base_s": 0.05, "backoff_max_s": 0.5, "progress_interval_s": 1,
            "require_reasoning": True, "expected_output_tokens": 100, "live_prices": False,
            "price_per_million_input_usd": CHUTES[0] * 1e6, "price_per_million_output_usd": CHUTES[1] * 1e6,
            "provider": {"sort": "price"}, "reasoning": {"enabled": True}, "budget_usd": budget, **responses,
        },
    }  # fmt: skip


def prepare(folder: Path, base: str, budget: float, n: int, **responses) -> tuple[Path, Path]:
    """The folder's prompts (tagged with its name: whose a request was, by its messages' hash), config and tasks."""
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"format": "aerie.prompts/1", "id": f"{folder.name}/{i}", "dataset": "chat", "source": {},
                        "messages": [{"role": "user", "content": f"{folder.name} question {i}"}]}) + "\n"
            for i in range(n)
        )
    )  # fmt: skip
    out = folder / "results" / "chat" / "responses" / "shard-00000.jsonl"
    (folder / "config.json").write_text(json.dumps(config(base, budget, **responses)))
    (folder / "tasks.json").write_text(json.dumps([["chat", str(prompts), str(out)]]))
    return folder / "config.json", folder / "tasks.json"


def start(tree: Path, folder: Path, state: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENROUTER_API_KEY": KEY, "AERIE_STATE_DIR": str(state)}
    return subprocess.Popen(
        ["/usr/bin/time", "-f", "%U %S %M", sys.executable, "-c", JOB,
         str(folder / "config.json"), str(folder / "tasks.json")],
        cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the job and the time(1) wrapping it: its whole process group, as a lost node or kill -9 of
    snakemake's group does."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=1800)
    user, system, rss_kb = err.strip().splitlines()[-1].split()[-3:]
    return {"rc": proc.returncode, "cpu_s": float(user) + float(system), "peak_rss_mb": int(rss_kb) / 1024}


def report(tree: Path, code: str, folder: Path, state: Path) -> float:
    """What the folder's report says was spent (its spend story, the account read live with the key)."""
    shard = folder / "results" / "chat" / "responses" / "shard-00000.jsonl"
    code_text = f"{REPORT[code]}; print(spend_story([__import__('pathlib').Path({str(shard)!r})]).total)"
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENROUTER_API_KEY": KEY, "AERIE_STATE_DIR": str(state)}
    out = subprocess.run([sys.executable, "-c", code_text], cwd=tree, env=env, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def billed_per_folder(log: Path, folders: list[Path]) -> tuple[dict[str, float], Counter]:
    """What the emulator billed for each folder's requests, and how many times each answer was paid."""
    whose = {}
    for folder in folders:
        for line in (folder / "prompts.jsonl").read_text().splitlines():
            messages = json.loads(line)["messages"]
            canon = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            whose[hashlib.sha256(canon.encode()).hexdigest()] = folder.name
    billed: dict[str, float] = defaultdict(float)
    paid: Counter = Counter()
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec["cost"]:
            billed[whose[rec["messages_sha256"]]] += rec["cost"]
            paid[rec["messages_sha256"]] += 1
    return dict(billed), paid


HOSTILE = ["--output-tokens-mean", "100", "--output-tokens-dist", "lognormal", "--latency-mean", "0.5",
           "--latency-dist", "lognormal", "--slow-seconds", "3", "--faults", "429=0.04,500=0.03,slow=0.03"]  # fmt: skip


def wait_for_answers(folder: Path, n: int) -> None:
    journal = folder / "results" / "chat" / "responses" / "shard-00000.journal.jsonl"
    while not journal.exists() or len(journal.read_bytes().splitlines()) < n:
        time.sleep(0.02)


def books_scenario(code: str, tree: Path, work: Path, schedule: str) -> dict:
    """Two runs on one key in ``schedule``: per folder what was billed for its requests and what its report says."""
    emu = Emulator(work, *HOSTILE)
    state = work / "state"
    a, b = work / "first", work / "second"
    budget, n = 0.20, 2000
    for folder in (a, b):
        prepare(folder, emu.base, budget, n)
    t0 = time.monotonic()
    try:
        if schedule == "at-once":
            procs = [start(tree, a, state), start(tree, b, state)]
            jobs = [finish(p) for p in procs]
        elif schedule == "killed-restarted":
            first, second = start(tree, a, state), start(tree, b, state)
            wait_for_answers(a, 300)
            kill(first)
            jobs = [finish(start(tree, a, state)), finish(second)]
        else:
            jobs = [finish(start(tree, a, state))]
            emu.settled()
            jobs.append(finish(start(tree, b, state)))
        stats = emu.settled()
        reported = {f.name: report(tree, code, f, state) for f in (a, b)}
    finally:
        emu.stop()
    billed, paid = billed_per_folder(emu.log, [a, b])
    return {
        "scenario": f"books/{schedule}",
        "code": code,
        "budget_usd_each": budget,
        "prompts_each": n,
        "billed_usd": billed,
        "reported_usd": reported,
        "account_usd": stats["charged_usd"],
        "late_answers": stats["outcomes"].get("client-gone", 0),
        "paid_twice": sum(v > 1 for v in paid.values()),
        "jobs": jobs,
        "seconds": round(time.monotonic() - t0, 1),
    }


BATCH_FAULTS = ["--batch-fault", "entry-error=0.02", "--batch-fault", "expire=0.05", "--batch-fault",
                "lost-poll=0.1", "--batch-fault", "lost-submit=0.1"]  # fmt: skip


def batch_scenario(tree: Path, work: Path, n: int = 20000, budget: float = 2.5) -> dict:
    """One batch-mode run of ``n`` prompts, killed once mid-run and started again."""
    emu = Emulator(work, "--output-tokens-mean", "100", "--output-tokens-dist", "lognormal", "--batch-latency-mean",
                   "3", "--batch-validate-s", "0.5", *BATCH_FAULTS)  # fmt: skip
    state = work / "state"
    run = work / "run"
    batch = {"size": 2000, "poll_interval_s": 0.5, "max_batches_in_flight": 4}
    prepare(run, emu.base, budget, n, mode="batch", batch=batch, max_new_tokens=200)
    batches = run / "results" / "chat" / "responses" / "shard-00000.batches.jsonl"
    t0 = time.monotonic()
    try:
        first = start(tree, run, state)
        while not (batches.exists() and batches.read_bytes().count(b'"finished"') >= 2):
            time.sleep(0.1)
        kill(first)
        jobs = [{"killed": True}]
        jobs.append(finish(start(tree, run, state)))
        stats = emu.settled()
    finally:
        emu.stop()
    billed, paid = billed_per_folder(emu.log, [run])
    journal = run / "results" / "chat" / "responses" / "shard-00000.journal.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    at_list = sum(
        r["usage"]["prompt_tokens"] * CHUTES[0] + r["usage"]["completion_tokens"] * CHUTES[1] for r in records
    )
    events = [json.loads(line) for line in batches.read_text().splitlines() if line.strip()]
    finished = [e for e in events if e.get("event") == "finished"]
    return {
        "scenario": "batch",
        "code": "after",
        "prompts": n,
        "budget_usd": budget,
        "billed_usd": billed.get("run", 0.0),
        "journaled_usd": sum(r["cost"] for r in records),
        "answers": len(records),
        "paid_twice": sum(v > 1 for v in paid.values()),
        "price_factor_measured": sum(r["cost"] for r in records) / at_list if at_list else None,
        "batches": Counter(e["status"] for e in finished),
        "batch_seconds_median": sorted(e["seconds"] for e in finished)[len(finished) // 2] if finished else None,
        "entries": {k: v for k, v in stats["outcomes"].items() if k.startswith("batch-")},
        "jobs": jobs,
        "seconds": round(time.monotonic() - t0, 1),
    }


def tables(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "| schedule | code | folder | billed for its requests | its report says | off by |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["scenario"].startswith("books/"):
            continue
        for folder in ("first", "second"):
            billed, said = r["billed_usd"].get(folder, 0.0), r["reported_usd"][folder]
            lines.append(
                f"| {r['scenario'][6:]} | {r['code']} | {folder} | ${billed:.4f} | ${said:.4f} | "
                f"{(said - billed) / billed:+.1%} |"
            )
    batch = [r for r in rows if r["scenario"] == "batch"]
    if batch:
        b = batch[0]
        lines += [
            "",
            "| batch run | prompts | answers | answers billed twice | billed | journaled | budget | batch price | "
            "batches | median batch | job CPU s | peak RSS MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| killed once, restarted | {b['prompts']:,} | {b['answers']:,} | {b['paid_twice']} | "
            f"${b['billed_usd']:.4f} | ${b['journaled_usd']:.4f} | ${b['budget_usd']:.2f} | "
            f"{b['price_factor_measured']:.0%} | {', '.join(f'{k} {v}' for k, v in sorted(b['batches'].items()))} | "
            f"{b['batch_seconds_median']:.0f} s | {b['jobs'][-1]['cpu_s']:.1f} | {b['jobs'][-1]['peak_rss_mb']:.0f} |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=["books", "batch"], default=["books", "batch"])
    ap.add_argument("--json", type=Path, default=OUT)
    ap.add_argument("--table", type=Path, help="print the tables of a results file and exit")
    args = ap.parse_args()
    if args.table:
        print(tables(json.loads(args.table.read_text())))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="aerie-shared-key-") as tmp:
        trees = {"before": snapshot(BEFORE, Path(tmp) / "before"), "after": snapshot("HEAD", Path(tmp) / "after")}
        load = [machine_load()]
        if "books" in args.only:
            for schedule in SCHEDULES:
                for code in ("before", "after"):  # interleaved: the same load for both
                    rows.append(books_scenario(code, trees[code], Path(tmp) / f"{schedule}-{code}", schedule))
                    print(json.dumps(rows[-1]), flush=True)
        if "batch" in args.only:
            rows.append(batch_scenario(trees["after"], Path(tmp) / "batch"))
            print(json.dumps(rows[-1]), flush=True)
        load.append(machine_load())
        result = {
            "bench": "shared_key",
            "codes": {c: code_identity(t) for c, t in trees.items()},
            "command": command_line(),
            "machine": machine(),
            "load": load,
            "self_cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime,
            "rows": rows,
        }
    write_json_atomic(args.json, result)
    print(tables(result))


if __name__ == "__main__":
    main()
