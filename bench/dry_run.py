"""Parse-time cost: `snakemake -n` on a finished demo workdir vs a bare `snakemake -n` of an empty workflow.

Usage (from the repository root, with the project installed; WORKDIR holds a finished demo run):
    .venv/bin/python bench/dry_run.py WORKDIR [--configfile FILE] [--repeats 5]

Both commands run interleaved in the same process tree, so load from other work hits both alike; prints the
median wall of each, their ratio, and what the aerie dry run imports (torch must not be among them).
Goal (issue "one home per concept"): <= 2 s for the finished demo on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EMPTY_WORKFLOW = "rule all:\n    input: []\n"


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--configfile", type=Path, help="the config the demo ran with (default: the workflow's)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    snakemake = [sys.executable, "-m", "snakemake"]
    aerie = [*snakemake, "-s", str(REPO / "Snakefile"), "--directory", str(args.workdir), "-n", "--quiet"]
    if args.configfile:
        aerie += ["--configfile", str(args.configfile)]
    with tempfile.TemporaryDirectory() as empty:
        (Path(empty) / "Snakefile").write_text(EMPTY_WORKFLOW)
        bare = [*snakemake, "-s", str(Path(empty) / "Snakefile"), "--directory", empty, "-n", "--quiet"]
        timed(aerie), timed(bare)  # warm the page cache and __pycache__
        walls: dict[str, list[float]] = {"aerie": [], "bare": []}
        for _ in range(args.repeats):
            walls["aerie"].append(timed(aerie))
            walls["bare"].append(timed(bare))
    a, b = statistics.median(walls["aerie"]), statistics.median(walls["bare"])
    print(f"snakemake -n, finished demo: median {a:.2f} s over {args.repeats} (min {min(walls['aerie']):.2f})")
    print(f"snakemake -n, empty workflow: median {b:.2f} s (min {min(walls['bare']):.2f})")
    print(f"ratio aerie / bare: {a / b:.2f}x; aerie's own parse-time cost: {a - b:.2f} s")
    code = (
        "import sys; import aerie.plan, aerie.disk, aerie.api.shard; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    heavy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout.strip()
    print(f"heavy modules imported at parse time: {heavy}")


if __name__ == "__main__":
    main()
