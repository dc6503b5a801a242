"""What the target-load benchmarks share (bench/hidden_loads.py, bench/responses_loads.py): the worker process
each configuration runs in, and the table of one load per shard against one load per run.

Each configuration runs as the pipeline runs it, in fresh processes: "per-shard" starts one process per shard
(what each per-shard job did, without Snakemake's own per-job overhead), "per-run" one process for every
shard. A worker times its imports, runs its stage, and prints one ``RESULT {json}`` line. The scripts run as
``python bench/<name>.py``, so this folder is on ``sys.path`` and they import this module by its name.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmarks measure this checkout's aerie, installed or not

MODES = ("per-shard", "per-run")

WORKER = """
import json, sys, time
t0 = time.perf_counter()
from pathlib import Path
import torch
torch.set_num_threads(1)
@IMPORTS@
imported = time.perf_counter() - t0
args = json.loads(sys.argv[1])
logs = []

def logged_loads():
    # (loads, load seconds) of a job that logs its loads ("target loaded in 1.2s"), as one shard alone does
    load = [float(l.split("loaded in ")[1].split("s")[0]) for l in logs if "target loaded in" in l]
    return len(load), sum(load)

@BODY@
out["import_s"] = round(imported, 2)
print("RESULT " + json.dumps(out))
"""


def worker_program(imports: str, body: str) -> str:
    """A worker's program: ``imports`` (timed, with torch's), then ``body``, which sees ``args`` (the worker's
    JSON argument), ``logs`` (give ``logs.append`` as the job's log) and ``logged_loads()``, and sets ``out``
    (``loads``, ``load_s`` and the stage's own seconds)."""
    return WORKER.replace("@IMPORTS@", imports.strip()).replace("@BODY@", body.strip())


def run_worker(program: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """Run one worker in a fresh process (one thread, this checkout on its path): its ``RESULT`` and its wall."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", program, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[7:]), "wall_s": time.perf_counter() - started}


def compare_modes(
    program: str,
    common: Mapping[str, Any],
    inputs: Sequence[Path],
    shard_counts: Sequence[int],
    workdir: Path,
    *,
    stage: str,
    fields: Sequence[str],
    size: Callable[[int], dict[str, int]],
    same: tuple[str, Callable[[Path, Path], bool]],
) -> list[dict[str, Any]]:
    """One row per shard count N: each mode's ``fields`` summed over its workers (the first N ``inputs``
    answered into ``workdir/<mode>-<N>/<stage>/``, ``common`` given to every worker with its mode and shards),
    ``size(N)``, and ``same = (name, check)``: whether every shard of the two modes passes ``check``."""
    rows = []
    for n in shard_counts:
        row: dict[str, Any] = {"shards": n, **size(n)}
        for mode in MODES:
            out_dir = workdir / f"{mode}-{n}" / stage
            out_dir.mkdir(parents=True)
            pairs = [[str(p), str(out_dir / p.name)] for p in inputs[:n]]
            batches = [pairs] if mode == "per-run" else [[pair] for pair in pairs]
            results = [run_worker(program, {**common, "mode": mode, "shards": b}) for b in batches]
            row[mode] = {k: round(sum(r[k] for r in results), 2) for k in fields}
            print(f"N={n} {mode}: {row[mode]}", flush=True)
        name, check = same
        before, after = (workdir / f"{mode}-{n}" / stage for mode in MODES)
        row[name] = all(check(before / p.name, after / p.name) for p in inputs[:n])
        rows.append(row)
    return rows


def report(facts: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], out: Path | None) -> None:
    """Print the target's facts and the rows as JSON, and write them to ``out`` when given."""
    text = json.dumps({"target": facts, "rows": rows}, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")
