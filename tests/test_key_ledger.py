"""One budget per key across runs (aerie.api.key_ledger): the ledger's figures, leases, dead runs and torn files, and
two responses jobs at once on one key against the emulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from test_api import exact_cost, job_config, make_prompts, write_prompt_file

from aerie.api.emulator import EmulatorSettings, serve_in_thread
from aerie.api.journal import journal_path, read_journal
from aerie.api.key_ledger import (
    KEY_LEDGER_FORMAT,
    KeyLedger,
    key_ledger_path,
    other_runs_note,
    read_key_ledger,
    state_dir,
)

REPO = Path(__file__).resolve().parents[1]


def ledger(path: Path, label: str, **kw) -> KeyLedger:
    return KeyLedger(path, label=label, settle_s=kw.pop("settle_s", 60.0), **kw)


def test_the_ledger_lives_outside_the_results_folder_and_never_holds_the_key(tmp_path: Path) -> None:
    env = {"AERIE_STATE_DIR": str(tmp_path / "state")}
    path = key_ledger_path("https://openrouter.ai/api/v1/", "sk-or-SECRET", env)
    assert path.parent == tmp_path / "state" / "keys"
    assert path == key_ledger_path("https://openrouter.ai/api/v1", "sk-or-SECRET", env)  # one key, one ledger
    assert path != key_ledger_path("https://openrouter.ai/api/v1", "sk-or-OTHER", env)
    assert state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/aerie")
    assert state_dir({}) == Path.home() / ".local" / "state" / "aerie"
    a = ledger(path, "host:/runs/a")
    a.open()
    assert a.take(0.0, 0.0, 1.0, lambda: 10.0, 4.0)
    for f in path.parent.iterdir():
        assert "SECRET" not in f.name and b"SECRET" not in f.read_bytes()
    doc = read_key_ledger(path)
    assert doc["format"] == KEY_LEDGER_FORMAT and doc["runs"][a.run_id]["reserved"] == 4.0
    # The preview of another run on the key names it; this run's own entry is not "another run".
    assert other_runs_note(path, "host:/runs/b").startswith("1 other run(s) on this API key (host:/runs/a) hold $4.00")
    assert other_runs_note(path, "host:/runs/a") == ""


def test_leases_of_two_runs_never_add_up_past_the_budget(tmp_path: Path) -> None:
    """Run A has spent 2 of a $10 budget and leases 4 more; B, joining, counts A's spend and lease and can take at
    most the 4 left; a run that leaves keeps its spend counted and gives its lease back."""
    path = tmp_path / "k.json"
    budget = 10.0
    a, b = ledger(path, "a"), ledger(path, "b")
    a.open()
    assert a.take(2.0, 2.0, 1.0, lambda: budget - 2.0 - a.others.committed, 4.0)  # spent 2 before B came
    assert a.lease == 6.0  # committed 2 + 4 of headroom
    b.open()
    assert b.others.runs == 1 and b.others.spent == pytest.approx(2.0) and b.others.reserved == pytest.approx(4.0)
    assert not b.take(0.0, 0.0, 4.5, lambda: budget - b.others.committed, 8.0)  # 4.5 > 10 - 6 (A's spend and lease)
    assert b.take(0.0, 0.0, 1.0, lambda: budget - b.others.committed, 8.0)
    assert b.lease == pytest.approx(4.0)  # headroom capped by what the budget leaves
    # A answers 3 of its leased requests ($3); its lease is unchanged: B sees $5 spent, $1 still leased.
    a.sync(5.0, 5.0, busy=True)
    b.sync(0.0, 0.0, busy=True)
    assert b.others.spent == pytest.approx(5.0) and b.others.reserved == pytest.approx(1.0)
    # A, 1 more in flight: the budget has nothing left for another (5 + 1 + B's 4).
    assert not a.take(5.0, 6.0, 1.0, lambda: budget - 6.0 - a.others.committed, 4.0)
    # A ends; its last answer was not published before: the ended entry carries it to B.
    a.close(True, 6.0, 0.0)
    b.sync(0.0, 0.0, busy=True)
    assert b.others.runs == 0 and b.others.reserved == 0.0 and b.others.spent == pytest.approx(6.0)
    late = ledger(path, "late")  # a run that opens after A ended does not count A
    assert late.open().spent == 0.0 and late.others.reserved == pytest.approx(4.0)
    # An idle run gives back its headroom: what it still has in flight stays leased.
    b.sync(0.5, 2.0, busy=False)
    assert b.lease == 2.0 and read_key_ledger(path)["runs"][b.run_id]["reserved"] == pytest.approx(1.5)


def test_a_refused_run_gives_back_its_headroom(tmp_path: Path) -> None:
    """Two runs, each with a sliver of lease headroom left and nothing in flight, each refused because the other's
    sliver counts: both would wait for ever. A refused run gives its headroom back, so the other sees only what is
    really in flight."""
    path = tmp_path / "k.json"
    a, b = ledger(path, "a"), ledger(path, "b")
    a.open(), b.open()
    assert a.take(0.0, 0.0, 1.0, lambda: 10.0 - a.others.committed, 5.0)
    assert b.take(0.0, 0.0, 1.0, lambda: 10.0 - b.others.committed, 5.0)
    a.sync(4.6, 4.6, busy=True)  # answered; 0.4 of headroom left, less than a request
    b.give_back(4.6, 4.6)  # b: answered too, and refused
    assert b.lease == 4.6 and b.others.reserved == pytest.approx(0.4)
    a.give_back(4.6, 4.6)
    assert a.others.reserved == 0.0 and a.others.live_reserved == 0.0
    b.sync(4.6, 4.6, busy=True)
    assert b.others.reserved == 0.0 and b.others.spent == pytest.approx(4.6)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_lease_counts_until_its_requests_settle_then_its_entry_goes(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    logged: list[str] = []
    killed = ledger(path, "other", settle_s=0.6)
    killed.open()
    killed.take(0.0, 0.0, 1.0, lambda: 10.0, 3.0)
    doc = json.loads(path.read_text())
    doc["runs"][killed.run_id]["pid"] = dead_pid()  # kill -9: the entry stays, its process is gone
    path.write_text(json.dumps(doc))
    # A later job of the same run skips it (its intents log prices those requests); another run counts it.
    same = ledger(path, "other", log=logged.append)
    same.open()
    assert same.others.runs == 0 and same.others.reserved == 0.0
    b = ledger(path, "b", log=logged.append)
    b.open()
    assert b.others.reserved == pytest.approx(3.0) and b.others.live_reserved == 0.0  # dead: nothing to wait for
    time.sleep(0.7)
    b.sync(0.0, 0.0, busy=True)
    assert b.others.reserved == 0.0 and killed.run_id not in read_key_ledger(path)["runs"]
    assert any("dropped the entry of run other: dead" in line for line in logged), logged
    # On another host a silent run is dead once its heartbeat is older than stale_s.
    remote = ledger(path, "remote", settle_s=0.0)
    remote.open()
    remote.take(0.0, 0.0, 1.0, lambda: 10.0, 2.0)
    doc = json.loads(path.read_text())
    doc["runs"][remote.run_id] |= {"host": "elsewhere", "heartbeat": time.time() - 5}
    path.write_text(json.dumps(doc))
    c = ledger(path, "c", stale_s=60.0)
    c.open()
    assert c.others.live_reserved == pytest.approx(2.0)  # 5 s silent of 60: alive
    c2 = ledger(path, "c2", stale_s=2.0)
    c2.open()
    assert remote.run_id not in read_key_ledger(path)["runs"]  # dead, settled at once: dropped


def test_an_unclean_end_keeps_the_lease_reserved_and_a_torn_ledger_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    a = ledger(path, "a")
    a.open()
    a.take(1.0, 1.0, 1.0, lambda: 10.0, 2.0)
    a.close(False, 1.0, 2.0)  # an exception or ^C: requests may still be billed
    assert read_key_ledger(path)["runs"][a.run_id]["reserved"] == 2.0
    path.write_text('{"format": "aerie.key-led')  # a crash mid-write
    logged: list[str] = []
    b = ledger(path, "b", log=logged.append)
    b.open()
    assert b.others.runs == 0 and any("unreadable" in line and "started afresh" in line for line in logged)
    assert read_key_ledger(path)["format"] == KEY_LEDGER_FORMAT


JOB = (
    "import json, sys, time; from pathlib import Path; "
    "from aerie.api.job import ApiShardTask, regenerate_api_shards; from aerie.plan import api_run; "
    "c, t, go = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), Path(sys.argv[3]); "
    "tasks = [ApiShardTask(d, Path(p), Path(o)) for d, p, o in t]\n"
    "while not go.exists(): time.sleep(0.01)\n"
    "r = regenerate_api_shards(tasks, api_run(c), log=lambda m: print(m, flush=True)); "
    "print(json.dumps({'unfinished': sum(isinstance(v, str) for v in r.values())}))"
)


def start_job(folder: Path, base: str, budget: float, go: Path, n: int, env: dict[str, str]) -> subprocess.Popen:
    """A responses job of its own run (results folder) in a process of its own, started when ``go`` appears."""
    prompts = [{**p, "id": f"{folder.name}/{i}", "dataset": "chat"} for i, p in enumerate(make_prompts(n, folder.name))]
    prompt_file = write_prompt_file(folder / "prompts.jsonl", prompts)
    out = folder / "results" / "chat" / "responses" / "shard-00000.jsonl"
    config = job_config(base, {"chat": {}}, budget_usd=budget, concurrency=20, progress_interval_s=1)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tasks.json").write_text(json.dumps([["chat", str(prompt_file), str(out)]]))
    return subprocess.Popen(
        [sys.executable, "-c", JOB, str(folder / "config.json"), str(folder / "tasks.json"), str(go)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_runs_at_once_on_one_key_stay_within_one_budget(tmp_path: Path) -> None:
    """Two responses jobs of two results folders, started together on one key, each with the same budget for 120
    of its 300 requests, against an emulator that refuses 20% of requests (429s with and without Retry-After,
    500, 503): together they are billed at most that one budget, and use it. Without the key ledger each keeps
    its 20 requests in flight and spends its own budget (2x, issue 30)."""
    per = exact_cost(100)
    budget = round(120 * per, 9)
    go = tmp_path / "go"
    env = {**os.environ, "OPENROUTER_API_KEY": "sk-shared", "PYTHONPATH": str(REPO)}
    emu = EmulatorSettings(
        output_tokens_mean=100,
        output_tokens_dist="fixed",
        latency_mean=0.3,
        faults={"429": 0.05, "429-retry-after": 0.05, "500": 0.05, "503": 0.05},
        retry_after=0.1,
    )
    with serve_in_thread(emu) as base:
        jobs = {}
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            jobs[name] = start_job(tmp_path / name, base, budget, go, 300, env)
        time.sleep(3)  # both imported and waiting
        go.touch()
        logs = {name: proc.communicate(timeout=240)[0] for name, proc in jobs.items()}
        stats = requests.get(f"{base}/emulator/stats", timeout=5).json()
    assert all(proc.returncode == 0 for proc in jobs.values()), logs
    assert stats["max_in_flight"] > 20, stats  # the two ran at once (one job keeps at most 20 in flight)
    billed = stats["charged_usd"]
    assert billed <= budget + 1e-9, f"{billed / per:.1f} requests billed for a budget of 120"
    for name in jobs:
        assert "budget: $" in logs[name] and "other runs on the key" in logs[name], logs[name][-3000:]
    assert billed >= budget - 3 * per, billed / per  # and the budget was used
    journaled = sum(
        read_journal(journal_path(tmp_path / n / "results/chat/responses/shard-00000.jsonl")).cost for n in jobs
    )
    assert journaled == pytest.approx(billed)
    assert sum(n for k, n in stats["outcomes"].items() if k != "ok") > 0, stats["outcomes"]  # faults were met
    ended = read_key_ledger(key_ledger_path(base, "sk-shared"))["runs"].values()
    assert len(ended) == 2 and all(e["ended"] and e["reserved"] == 0 for e in ended)  # both left cleanly
    assert sum(e["spent"] for e in ended) == pytest.approx(billed)  # with their last answers
