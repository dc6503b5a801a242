"""A recorded source at the public set's size: lightseekorg/kimi-mtp-dataset holds ~476k-600k ShareGPT conversations
(~6B tokens, ~40 KB of text each). How long the first parse converts it into the prompt cache, what the cache takes
on disk and in memory, and what every later parse and a shard's responses job cost (aerie.sources.recorded,
aerie.sources.cache, aerie.responses.recorded).

Two stand-in files measure the two costs apart (the full-size file, ~24 GB, does not fit this machine): the full row
count with short turns (the per-row cost: JSON parse, turn split, dedup digest, offsets) and 1/50 of the rows at the
real ~40 KB per conversation (the per-byte cost). The extrapolation to 600k x 40 KB is their sum. Each step runs in
its own process (a fresh parse, as every `snakemake` invocation and SLURM job is), with its peak RSS.

    python bench/recorded_scale.py [--rows 600000] [--long-rows 12000] [--out bench/results/recorded_scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "recorded_scale.json"
FULL_ROWS = 600_000
FULL_BYTES_PER_ROW = 40_000  # ~10k tokens a conversation (6B tokens / 600k) at ~4 characters a token
WORDS = "the of and to in is that for it as with on was by this be are from at or an have not which but".split()


def write_stand_in(path: Path, rows: int, answer_chars: int, seed: int) -> int:
    """ShareGPT rows: a system turn, 1-3 user/gpt pairs, reasoning inline in <think>; returns the bytes written."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        out, size = [], 0
        while size < n:
            w = rng.choice(WORDS)
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    with open(path, "w") as fh:
        for i in range(rows):
            turns = [{"from": "system", "value": "You are Kimi, an AI assistant created by Moonshot AI."}]
            pairs = rng.randint(1, 3)
            for _ in range(pairs):
                turns.append({"from": "human", "value": f"question {i}: {text(answer_chars // 8)}"})
                reasoning, content = text(answer_chars // (2 * pairs)), text(answer_chars // (4 * pairs))
                turns.append({"from": "gpt", "value": f"<think>{reasoning}</think>{content}"})
            fh.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return path.stat().st_size


def step(kind: str, data: str, cache: str, shard_size: int) -> dict[str, Any]:
    """One measured step in this process: ``plan`` (a parse: the cache's count, or the conversion when the cache has
    no entry) or ``shard`` (a responses job: one shard of a seeded sample, read from the cache by seeking)."""
    sys.path.insert(0, str(REPO))
    from aerie.plan.resolve import recorded_sample
    from aerie.responses.recorded import recorded_preview, write_recorded_shard
    from aerie.sources.datasets import plan_dataset, write_prompts

    ds = {
        "source": {"kind": "recorded", "data_files": data, "shape": "sharegpt", "id_field": "id"},
        "shard_size": shard_size,
        "bench_prompts": 0,
        "max_samples": 10_000,
        "sample_seed": 0,
    }
    datasets = {"mtp": ds}
    started = time.perf_counter()
    plan = recorded_sample(plan_dataset("mtp", ds, datasets, cache_dir=Path(cache)), 10_000, 0, "datasets.mtp")
    out: dict[str, Any] = {"samples": plan.total, "planned": plan.planned_prompts}
    if kind == "plan":
        preview = recorded_preview({"datasets": datasets}, {"mtp": plan}, Path(cache) / "results")
        out["preview"] = preview.splitlines()[1].strip()
    else:
        folder = Path(cache) / "shard"
        folder.mkdir(exist_ok=True)
        start, stop = plan.shard_range(0)
        write_prompts("mtp", ds, start, stop, folder / "p.jsonl", datasets, order=plan.order(), cache_dir=Path(cache))
        write_recorded_shard(
            "mtp",
            ds,
            datasets,
            plan.positions(start, stop),
            folder / "p.jsonl",
            folder / "r.jsonl",
            Path(cache),
            "target",
            log=lambda m: None,
        )
        out["shard_bytes"] = (folder / "r.jsonl").stat().st_size
    out["seconds"] = round(time.perf_counter() - started, 2)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def measure(rows: int, answer_chars: int, shard_size: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("AERIE_BENCH_TMP")) as tmp:
        data = Path(tmp) / "stand-in.jsonl"
        size = write_stand_in(data, rows, answer_chars, seed)
        cache = Path(tmp) / "cache"

        def run(kind: str) -> dict[str, Any]:
            cmd = [
                sys.executable,
                __file__,
                "--step",
                kind,
                "--data",
                str(data),
                "--cache",
                str(cache),
                "--shard-size",
                str(shard_size),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            return json.loads(proc.stdout.strip().splitlines()[-1])

        first = run("plan")  # converts: the cache has no entry
        cached = run("plan")
        shard = run("shard")
        cache_bytes = sum(p.stat().st_size for p in cache.glob("mtp.*"))
        return {
            "rows": rows,
            "file_bytes": size,
            "bytes_per_row": round(size / rows),
            "first_parse": first,
            "cached_parse": cached,
            "shard_job": shard,
            "cache_bytes": cache_bytes,
        }


def extrapolate(short: dict[str, Any], long: dict[str, Any]) -> dict[str, Any]:
    """600k x 40 KB from the two runs: conversion seconds = a * rows + b * bytes (solved from both)."""
    r1, b1, t1 = short["rows"], short["file_bytes"], short["first_parse"]["seconds"]
    r2, b2, t2 = long["rows"], long["file_bytes"], long["first_parse"]["seconds"]
    det = r1 * b2 - r2 * b1
    per_row = (t1 * b2 - t2 * b1) / det
    per_byte = (r1 * t2 - r2 * t1) / det
    rows, size = FULL_ROWS, FULL_ROWS * FULL_BYTES_PER_ROW
    return {
        "rows": rows,
        "file_bytes": size,
        "seconds_per_row": per_row,
        "seconds_per_mb": per_byte * 1e6,
        "first_parse_s": round(per_row * rows + per_byte * size),
        "cache_bytes": round(long["cache_bytes"] / long["file_bytes"] * size),
    }


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for name in ("short", "long"):
        m = result[name]
        rows.append(
            f"| {m['rows']:,} x {m['bytes_per_row']:,} B ({m['file_bytes'] / 2**20:,.0f} MiB) "
            f"| {m['first_parse']['seconds']:,.1f} s, {m['first_parse']['peak_rss_mib']:,.0f} MiB "
            f"| {m['cached_parse']['seconds']:,.2f} s, {m['cached_parse']['peak_rss_mib']:,.0f} MiB "
            f"| {m['shard_job']['seconds']:,.2f} s, {m['shard_job']['peak_rss_mib']:,.0f} MiB "
            f"| {m['cache_bytes'] / 2**20:,.0f} MiB |"
        )
    x = result["extrapolated"]
    rows.append(
        f"| {x['rows']:,} x {FULL_BYTES_PER_ROW:,} B ({x['file_bytes'] / 2**30:,.0f} GiB), extrapolated "
        f"| ~{x['first_parse_s'] / 60:,.0f} min | as measured (a count) | as measured (seeks) "
        f"| ~{x['cache_bytes'] / 2**30:,.0f} GiB |"
    )
    head = (
        "| stand-in (rows x bytes) | first parse (converts) | later parse (cache) | one 2,000-sample shard job "
        "| cache on disk |"
    )
    return "\n".join([head, "|---|---|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=FULL_ROWS)
    ap.add_argument("--long-rows", type=int, default=FULL_ROWS // 50)
    ap.add_argument("--shard-size", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--step", choices=["plan", "shard"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.step:
        print(json.dumps(step(args.step, args.data, args.cache, args.shard_size)))
        return 0
    short = measure(args.rows, 400, args.shard_size, seed=1)
    long = measure(args.long_rows, FULL_BYTES_PER_ROW, args.shard_size, seed=2)
    result = {
        "format": "aerie.recorded-scale/1",
        "command": "python bench/recorded_scale.py " + " ".join(argv or sys.argv[1:]),
        "cpu_count": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
        "short": short,
        "long": long,
        "extrapolated": extrapolate(short, long),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
