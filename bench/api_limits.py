"""One account, one set of limits: what the API responses stage spends and keeps in flight when Snakemake runs
several shards or datasets at once, before (one job per shard: main at 27746c1) and after (one job per run), and
what an immediate rerun after ``kill -9`` spends while the killed job's 30 s answers are still being generated.

Every run is a real ``snakemake`` of a code snapshot (``git archive REF | tar -x``: before and after measured
interleaved, against the same kind of emulator process, same prompts and sizes) in a fresh folder, against a fresh
emulator (``python -m aerie.emulator``, 100 fixed output tokens at Chutes' $0.45/$1.90 per M: every request
costs the same, so any overshoot is the guard's, not the answers'). The emulator's own figures are recorded:
dollars billed (``GET /key``), the most chat requests in flight at once, output tokens billed per dataset.

Scenarios (``--only`` picks some):
- ``budget-1``: one dataset, one shard of 4,000 prompts, ``budget_usd: 0.50``, ``concurrency: 200``;
- ``budget-4x1``: the same prompts in 4 shards of 1,000, ``--cores 4``;
- ``budget-1x4``: 4 datasets of 1,000 prompts, one shard each, ``--jobs 4 --cores 4``;
- ``quota-1`` / ``quota-4x1``: one dataset's 4,000 prompts in 1 / 4 shards with ``max_output_tokens: 100,000``
  (1,000 answers), no budget stop;
- ``rerun`` / ``rerun-400``: 30 s answers, ``concurrency: 200`` / ``400``, ``budget_usd: 0.10`` (515 requests):
  the job is killed (``kill -9`` of snakemake's process group) once ``concurrency`` requests are in flight, and
  rerun at once (``--unlock``, then the same command with ``allow_over_budget=True``); billed is read after the
  provider has finished everything. Before, a rerun whose first wave fits in what the budget leaves after the
  killed requests is saved by its account polls (they see those billed 30 s later, before its second wave);
  ``rerun-400``'s first wave does not fit;
- ``one-key-1`` / ``one-key-2``: one run alone / two runs at once (two results folders, one config each, started
  together) on one API key against a hostile emulator (answers of lognormal length, mean 100 tokens, and 429s,
  5xx, errors inside 200, torn bodies and resets: 20% of requests), each ``budget_usd: 0.50``,
  ``concurrency: 200``, 4,000 prompts; before = 4161ae5 (one budget per run), after = the key ledger
  (aerie.responses.api.key_ledger): billed for the key in all against one budget;
- ``scale``: the user's size without Snakemake: 5 datasets x 2 shards x 2,000 prompts through the job's own path
  (``aerie.responses.api.job.regenerate_api_shards``) at ``concurrency: 2000``, 2 s answers (40 output tokens), a budget
  for ~60% of it and one dataset quota'd at half its prompts: in-flight high-water, billed vs budget, quota, wall
  time, CPU and peak memory of the job process (``after`` only: ``before`` ran one process per shard).

    .venv/bin/python bench/api_limits.py                      # everything, about 15 minutes on 2 busy cores
    .venv/bin/python bench/api_limits.py --only rerun scale

Writes ``bench/results/api_limits.json`` (one row per scenario and code, with the commits, command and load).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))
from api_world import api_pipeline_config  # noqa: E402
from run_record import code_identity, command_line, machine, machine_load, write_json_atomic  # noqa: E402

BEFORE = "27746c1"
BEFORE_OF = {"one-key-1": "4161ae5", "one-key-2": "4161ae5"}  # the scenarios of a later change, and its parent
HOSTILE = "429=0.04,429-retry-after=0.04,500=0.03,503=0.03,200-error=0.03,torn=0.015,reset=0.015"
KEY = "sk-bench-api-limits"
PER_REQUEST = 8 * 0.45e-6 + 100 * 1.9e-6  # 8 prompt words + 100 output tokens at Chutes' prices
SCENARIOS = (
    "budget-1", "budget-4x1", "budget-1x4", "quota-1", "quota-4x1", "rerun", "rerun-400", "one-key-1", "one-key-2",
    "scale",
)  # fmt: skip


def snapshot(ref: str, dest: Path) -> Path:
    """The code of ``ref`` in ``dest`` (git archive), with its commit beside it (bench/run_record.py)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], capture_output=True, text=True, check=True)
    (dest / ".commit").write_text(commit.stdout.strip() + "\n")
    return dest


class Emulator:
    """An emulator process on a free port (its own counters), stopped with SIGTERM."""

    def __init__(self, folder: Path, *args: str):
        port_file = folder / "emulator.port"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aerie.emulator", "--port", "0", "--port-file", str(port_file),
             "--output-tokens-mean", "100", "--output-tokens-dist", "fixed", "--request-log",
             str(folder / "requests.jsonl"), *args],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the emulator did not start")
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{port_file.read_text().strip()}/api/v1"
        self.log = folder / "requests.jsonl"

    def stats(self) -> dict:
        return requests.get(f"{self.base}/emulator/stats", timeout=10).json()

    def drained(self, timeout: float = 300) -> dict:
        """The figures once nothing is in flight (the provider has finished and billed everything)."""
        deadline = time.monotonic() + timeout
        while (s := self.stats())["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.2)
        return s

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def write_config(work: Path, base: str, target: Path, datasets: dict, **responses) -> Path:
    return api_pipeline_config(work, base, target, datasets, **responses)


def snakemake(
    tree: Path, work: Path, cfg: Path, *args: str, popen: bool = False, env: dict | None = None, log: Path | None = None
):
    """A snakemake of the code in ``tree``; ``popen``: started, not waited for (its output to ``log``, if given)."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(tree / "Snakefile"), "--directory", str(work), *args,
           "--configfile", str(cfg)]  # fmt: skip
    env = {**os.environ, "OPENROUTER_API_KEY": KEY, **(env or {})}
    if popen:
        sink = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)


def targets(code: str, datasets: dict) -> list[str]:
    """What to ask for: before, every responses shard (one job each); after, rule ``responses`` (one job for all of
    them, however many shards the plan gives a quota'd dataset)."""
    if code == "after":
        return ["responses"]
    return [
        f"results/{name}/responses/shard-{i:05d}.jsonl"
        for name, spec in datasets.items()
        for i in range(-(-spec["n"] // spec["shard_size"]))
    ]


def tokens_by_dataset(log: Path, datasets: dict) -> dict[str, int]:
    """Output tokens the emulator billed per dataset (the request log's messages hash -> the prompt's dataset)."""
    import hashlib

    def sha(name: str, i: int) -> str:
        messages = [{"role": "user", "content": f"{name} question {i}: what is {i} + {i}?"}]
        blob = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    owner = {sha(name, i): name for name, spec in datasets.items() for i in range(spec["n"] + 1)}
    out: dict[str, int] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        name = owner.get(rec["messages_sha256"], "?")
        out[name] = out.get(name, 0) + int(rec.get("completion_tokens") or 0)
    return out


def limits_run(
    code: str, tree: Path, folder: Path, target: Path, datasets: dict, cores: list[str], **responses
) -> dict:
    work = folder / "work"
    work.mkdir(parents=True)
    emu = Emulator(folder, "--latency-mean", "0.5")
    try:
        cfg = write_config(work, emu.base, target, datasets, concurrency=200, **responses)
        t0 = time.monotonic()
        proc = snakemake(tree, work, cfg, *cores, *targets(code, datasets), "--config", "allow_over_budget=True")
        wall = time.monotonic() - t0
        stats = emu.drained()
    finally:
        emu.stop()
    out = proc.stdout + proc.stderr
    jobs = sum(1 for line in out.splitlines() if line.startswith(("rule responses:", "localrule responses:")))
    return {
        "returncode": proc.returncode,
        "stop": next(
            (line.strip() for line in reversed(out.splitlines()) if "STOPPING" in line or "Error" in line), ""
        ),
        "responses_jobs": jobs,
        "billed_usd": round(stats["charged_usd"], 6),
        "max_in_flight": stats["max_in_flight"],
        "requests": stats["requests"],
        "output_tokens_by_dataset": tokens_by_dataset(emu.log, datasets),
        "seconds": round(wall, 1),
    }


def rerun_scenario(code: str, tree: Path, folder: Path, target: Path, concurrency: int = 200) -> dict:
    """30 s answers; kill -9 with ``concurrency`` in flight; rerun at once; billed once everything is finished."""
    work = folder / "work"
    work.mkdir(parents=True)
    datasets = {"talk": {"n": 2000, "shard_size": 2000}}
    budget = 0.10
    emu = Emulator(folder, "--latency-mean", "30")
    try:
        cfg = write_config(
            work, emu.base, target, datasets, concurrency=concurrency, budget_usd=budget, read_timeout_s=120
        )
        shard = targets(code, datasets)
        first = snakemake(tree, work, cfg, "--cores", "1", *shard, "--config", "allow_over_budget=True", popen=True)
        deadline = time.monotonic() + 300
        while emu.stats()["in_flight"] < concurrency and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        t_kill = time.monotonic()
        snakemake(tree, work, cfg, "--unlock")
        started = time.monotonic() - t_kill
        billed_at_rerun = emu.stats()["charged_usd"]
        rerun = snakemake(tree, work, cfg, "--cores", "1", *shard, "--config", "allow_over_budget=True")
        stats = emu.drained()
    finally:
        emu.stop()
    return {
        "budget_usd": budget,
        "killed_in_flight": concurrency,
        "rerun_started_s_after_kill": round(started, 1),
        "billed_when_rerun_started_usd": round(billed_at_rerun, 6),
        "rerun_returncode": rerun.returncode,
        "billed_usd": round(stats["charged_usd"], 6),
        "over_budget": round(stats["charged_usd"] / budget - 1, 4),
        "billed_unseen": stats["outcomes"].get("client-gone", 0),
    }


def one_key_scenario(code: str, tree: Path, folder: Path, target: Path, runs: int) -> dict:
    """``runs`` snakemake invocations at once, each its own results folder and config, on one key and one hostile
    emulator, each with the same budget; the emulator's bill once everything is finished."""
    budget = 0.50
    emu = Emulator(folder, "--latency-mean", "0.5", "--output-tokens-dist", "lognormal", "--faults", HOSTILE)
    state = {"AERIE_STATE_DIR": str(folder / "state")}  # the key's ledger: this measurement's own
    try:
        procs = []
        for k in range(runs):
            work = folder / f"work-{k}"
            work.mkdir(parents=True)
            cfg = write_config(
                work, emu.base, target, {"talk": {"n": 4000, "shard_size": 4000}}, concurrency=200, budget_usd=budget
            )
            args = ("--cores", "1", "responses", "--config", "allow_over_budget=True")
            procs.append(snakemake(tree, work, cfg, *args, popen=True, env=state, log=folder / f"run-{k}.log"))
        t0 = time.monotonic()
        for proc in procs:
            proc.wait(timeout=3600)
        wall = time.monotonic() - t0
        outs = [(folder / f"run-{k}.log").read_text() for k in range(runs)]
        stats = emu.drained()
    finally:
        emu.stop()
    return {
        "runs": runs,
        "budget_usd": budget,
        "billed_usd": round(stats["charged_usd"], 6),
        "over_budget": round(stats["charged_usd"] / budget - 1, 4),
        "max_in_flight": stats["max_in_flight"],
        "requests": stats["requests"],
        "stops": [next((x.strip() for x in reversed(o.splitlines()) if "STOPPING" in x), "") for o in outs],
        "seconds": round(wall, 1),
    }


def scale_scenario(folder: Path, tree: Path = REPO) -> dict:
    """The user's size through the job's own path (the code of ``tree``), in a process of its own (its CPU and
    peak memory)."""
    datasets = [f"d{k}" for k in range(5)]
    emu_args = ["--latency-mean", "2", "--output-tokens-mean", "40"]
    emu = Emulator(folder, *emu_args)
    results = folder / "results"
    tasks = []
    for name in datasets:
        for shard in range(2):
            path = results / name / "prompts" / f"shard-{shard:05d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                "".join(
                    json.dumps({"format": "aerie.prompts/1", "id": f"{name}/{shard}/{i}", "dataset": name,
                                "messages": [{"role": "user", "content": f"{name} {shard} question {i}"}],
                                "source": {"kind": "bench"}}) + "\n"
                    for i in range(2000)
                )
            )  # fmt: skip
            tasks.append([name, str(path), str(results / name / "responses" / f"shard-{shard:05d}.jsonl")])
    expected = 40 * 1.9e-6 + 8 * 0.45e-6
    budget = round(0.6 * 20000 * expected, 4)
    quota = 40 * 2000  # half of d0's 4,000 prompts
    config = {
        "target": {"path": "unused"},
        "datasets": {
            n: {"source": {"kind": "jsonl", "path": "unused"}, **({"max_output_tokens": quota} if n == "d0" else {})}
            for n in datasets
        },
        "responses": {
            "backend": "openrouter", "model": "moonshotai/kimi-k2.5", "base_url": emu.base,
            "api_key_env": "OPENROUTER_API_KEY", "temperature": 1.0, "top_p": 0.95, "max_new_tokens": 256, "seed": 0,
            "send_seed": False, "concurrency": 2000, "connect_timeout_s": 30, "read_timeout_s": 900,
            "max_attempts": 8, "backoff_base_s": 0.2, "backoff_max_s": 2.0, "progress_interval_s": 5,
            "require_reasoning": True, "expected_output_tokens": 40, "budget_usd": budget, "live_prices": True,
            "provider": {"sort": "price"}, "reasoning": {"enabled": True},
        },
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tasks.json").write_text(json.dumps(tasks))
    code = (
        "import json, resource, sys, time; from pathlib import Path; "
        "from aerie.responses.api.job import ApiShardTask, regenerate_api_shards; "
        "from aerie.plan.resolve import api_run; "
        f"c = json.load(open({str(folder / 'config.json')!r})); "
        f"t = [ApiShardTask(d, Path(p), Path(o)) for d, p, o in json.load(open({str(folder / 'tasks.json')!r}))]; "
        "t0 = time.monotonic(); r = regenerate_api_shards(t, api_run(c), log=lambda m: None); "
        "wall = time.monotonic() - t0; "
        "u = resource.getrusage(resource.RUSAGE_SELF); "
        # VmHWM, not ru_maxrss: ru_maxrss keeps the parent's size from before exec (this script imports torch).
        "hwm = int(next(x for x in open('/proc/self/status') if x.startswith('VmHWM')).split()[1]); "
        "print(json.dumps({'wall_s': wall, 'cpu_s': u.ru_utime + u.ru_stime, 'peak_rss_mib': hwm / 1024, "
        "'unfinished': sum(isinstance(v, str) for v in r.values())}))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=3600,
            env={**os.environ, "PYTHONPATH": str(tree), "OPENROUTER_API_KEY": KEY},
        )  # fmt: skip
        stats = emu.drained()
    finally:
        emu.stop()
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    job = json.loads(proc.stdout.strip().splitlines()[-1])
    from aerie.responses.api.journal import read_journal

    journaled = {n: 0 for n in datasets}
    tokens = {n: 0 for n in datasets}
    for name, _, out in tasks:
        for rec in read_journal(
            Path(out).with_name(Path(out).name.replace(".jsonl", ".journal.jsonl"))
        ).finished.values():
            journaled[name] += 1
            tokens[name] += rec["usage"]["completion_tokens"]
    requests_done = stats["outcomes"].get("ok", 0)
    return {
        "prompts": 20000,
        "concurrency": 2000,
        "budget_usd": budget,
        "billed_usd": round(stats["charged_usd"], 6),
        "over_budget": round(stats["charged_usd"] / budget - 1, 6),
        "max_in_flight": stats["max_in_flight"],
        "quota_tokens": quota,
        "quota_dataset_tokens": tokens["d0"],
        "journaled_by_dataset": journaled,
        "requests": requests_done,
        "wall_s": round(job["wall_s"], 1),
        "cpu_s_per_1000_requests": round(1000 * job["cpu_s"] / max(1, requests_done), 3),
        "peak_rss_mib": round(job["peak_rss_mib"], 1),
        "unfinished_shards": job["unfinished"],
    }


def tables(result: dict) -> str:
    """bench/RESULTS.md's tables, from a result file of this script."""
    rows = {(r["scenario"], r["code"]): r for r in result["rows"]}
    names = {
        "budget-1": "1 shard",
        "budget-4x1": "4 shards of one dataset (`--cores 4`)",
        "budget-1x4": "4 datasets, 1 shard each (`--jobs 4`)",
        "quota-1": "1 shard",
        "quota-4x1": "4 shards of one dataset (`--cores 4`)",
    }
    out = [
        "| budget $0.50, concurrency 200 | code | responses jobs | billed | over budget | most in flight |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("budget-1", "budget-4x1", "budget-1x4"):
        for code in ("before", "after"):
            r = rows.get((name, code))
            if r:
                out.append(
                    f"| {names[name]} | {code} | {r['responses_jobs']} | ${r['billed_usd']:.4f} | "
                    f"{100 * r['over_budget']:+.1f}% | {r['max_in_flight']} |"
                )
    out += [
        "",
        "| quota 100,000 output tokens | code | responses jobs | output tokens billed | x quota | most in flight |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("quota-1", "quota-4x1"):
        for code in ("before", "after"):
            r = rows.get((name, code))
            if r:
                tokens = sum(r["output_tokens_by_dataset"].values())
                out.append(
                    f"| {names[name]} | {code} | {r['responses_jobs']} | {tokens:,} | {tokens / 100_000:.2f} | "
                    f"{r['max_in_flight']} |"
                )
    out += [
        "",
        "| kill -9 with N answers of 30 s in flight, rerun at once, budget $0.10 | code | rerun started | "
        "billed then | billed in the end | over budget |",
        "|---|---|---|---|---|---|",
    ]
    for name, code in [(n, c) for n in ("rerun", "rerun-400") for c in ("before", "after")]:
        r = rows.get((name, code))
        if r:
            started, then = r["rerun_started_s_after_kill"], r["billed_when_rerun_started_usd"]
            out.append(
                f"| N = {r['killed_in_flight']} | {code} | {started} s after the kill | ${then:.4f} | "
                f"${r['billed_usd']:.4f} | {100 * r['over_budget']:+.1f}% |"
            )
    one_key = [(n, c) for n in ("one-key-1", "one-key-2") for c in ("before", "after") if (n, c) in rows]
    if one_key:
        out += [
            "",
            "| one key, budget $0.50 per run, hostile emulator, concurrency 200 | code | billed for the key | "
            "over one budget | most in flight |",
            "|---|---|---|---|---|",
        ]
        for name, code in one_key:
            r = rows[(name, code)]
            what = "1 run alone" if r["runs"] == 1 else f"{r['runs']} runs at once (two folders)"
            out.append(
                f"| {what} | {code} | ${r['billed_usd']:.4f} | {100 * r['over_budget']:+.1f}% | {r['max_in_flight']} |"
            )
    r = rows.get(("scale", "after"))
    if r:
        out += [
            "",
            "| the user's size (job path, no Snakemake) | figure |",
            "|---|---|",
            f"| prompts / concurrency | {r['prompts']:,} in 10 shards of 5 datasets / {r['concurrency']:,} |",
            f"| most in flight (emulator) | {r['max_in_flight']:,} |",
            f"| billed / budget | ${r['billed_usd']:.4f} / ${r['budget_usd']:.4f} ({100 * r['over_budget']:+.3f}%) |",
            f"| quota'd dataset: output tokens / quota | {r['quota_dataset_tokens']:,} / {r['quota_tokens']:,} |",
            f"| requests answered, wall | {r['requests']:,} in {r['wall_s']} s |",
            f"| job CPU per 1,000 requests, peak RSS | {r['cpu_s_per_1000_requests']} s, {r['peak_rss_mib']} MiB |",
        ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--after", default="HEAD", help="the code measured as after (a commit)")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "api_limits.json")
    ap.add_argument("--table", nargs="*", type=Path, help="print bench/RESULTS.md's tables from these result files")
    args = ap.parse_args()
    if args.table is not None:
        rows = [row for path in args.table or [args.json] for row in json.loads(path.read_text())["rows"]]
        print(tables({"rows": rows}))
        return
    from tiny_world import save_tiny_llama_target

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trees = {"before": snapshot(BEFORE, tmp / "before"), "after": snapshot(args.after, tmp / "after")}
        for ref in sorted({BEFORE_OF[n] for n in args.only if n in BEFORE_OF}):
            trees[ref] = snapshot(ref, tmp / f"before-{ref}")
        target = save_tiny_llama_target(tmp / "target")
        cases = {
            "budget-1": ({"talk": {"n": 4000, "shard_size": 4000}}, ["--cores", "1"], {"budget_usd": 0.5}),
            "budget-4x1": ({"talk": {"n": 4000, "shard_size": 1000}}, ["--cores", "4"], {"budget_usd": 0.5}),
            "budget-1x4": (
                {name: {"n": 1000, "shard_size": 1000} for name in ("alpha", "beta", "gamma", "delta")},
                ["--jobs", "4", "--cores", "4"],
                {"budget_usd": 0.5},
            ),
            "quota-1": ({"talk": {"n": 4000, "shard_size": 4000, "max_output_tokens": 100_000}}, ["--cores", "1"], {}),
            "quota-4x1": (
                {"talk": {"n": 4000, "shard_size": 1000, "max_output_tokens": 100_000}},
                ["--cores", "4"],
                {},
            ),
        }
        for name in args.only:
            for code in ("before", "after"):  # interleaved: the same load for both
                if name == "scale" and code == "before":
                    continue
                folder = tmp / f"{name}-{code}"
                folder.mkdir()
                load = machine_load()
                tree = trees[BEFORE_OF[name]] if code == "before" and name in BEFORE_OF else trees[code]
                if name.startswith("one-key"):
                    row = one_key_scenario(code, tree, folder, target, int(name[-1]))
                elif name.startswith("rerun"):
                    row = rerun_scenario(code, trees[code], folder, target, 400 if name == "rerun-400" else 200)
                elif name == "scale":
                    row = scale_scenario(folder, trees[code])
                else:
                    datasets, cores, responses = cases[name]
                    row = limits_run(code, trees[code], folder, target, datasets, cores, **responses)
                    if "budget_usd" in responses:
                        row["budget_usd"] = responses["budget_usd"]
                        row["over_budget"] = round(row["billed_usd"] / responses["budget_usd"] - 1, 4)
                row = {"scenario": name, "code": code, "commit": (tree / ".commit").read_text().strip(), **row,
                       "load": load["loadavg"]}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    write_json_atomic(
        args.json,
        {
            "format": "aerie.bench-api-limits/1",
            "command": command_line(),
            "code": code_identity(REPO),
            "machine": machine(),
            "per_request_usd": PER_REQUEST,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 2,000 connections (and the emulator's side of them)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))
    main()
