"""Measure the demo: wall time of `snakemake --cores all` from scratch, per-job time and peak memory.

Usage (from the repository root, with the project installed):
    .venv/bin/python bench/demo.py [--workdir DIR] [--keep]

Prints one line per heavy job (from Snakemake's benchmark: files) and the totals; the figures go to
bench/RESULTS.md by hand, with the command that made them.
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, help="run here instead of a fresh temporary folder")
    ap.add_argument("--cores", default="all")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="aerie-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        args.cores,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"demo failed (exit {proc.returncode}) in {workdir}")
    peak_child_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024

    print(f"workdir: {workdir}")
    print(f"{'job':58s} {'seconds':>8s} {'max_rss_MiB':>12s}")
    jobs_peak = 0.0
    for tsv in sorted((workdir / "results" / "benchmarks").rglob("*.tsv")):
        with open(tsv) as fh:
            row = next(csv.DictReader(fh, delimiter="\t"))
        rss = float(row["max_rss"]) if row["max_rss"] not in ("-", "NA") else 0.0
        jobs_peak = max(jobs_peak, rss)
        print(f"{str(tsv.relative_to(workdir / 'results' / 'benchmarks')):58s} {float(row['s']):8.1f} {rss:12.0f}")
    bench = json.loads((workdir / "results" / "bench" / "demo.json").read_text())
    target = json.loads((workdir / "results" / "demo-target" / "aerie_demo_target.json").read_text())
    print(f"demo wall time: {wall:.0f} s ({wall / 60:.1f} min)")
    print(f"peak memory of one job: {jobs_peak:.0f} MiB (largest child process: {peak_child_mib:.0f} MiB)")
    print(
        f"benchmark: acceptance length {bench['acceptance_length']:.2f}, baseline "
        f"{bench['baseline']['tokens_per_s']:.1f} tok/s, speculative {bench['speculative']['tokens_per_s']:.1f} tok/s, "
        f"speedup {bench['speedup']:.2f}x, lossless {bench['lossless']}"
    )
    print(f"demo target: {json.dumps(target.get('metrics', target))[:600]}")


if __name__ == "__main__":
    main()
