"""Padding and stragglers of the drafter's batches on the Kimi K2.5 config's length distribution (issue 29 item 2).

    .venv/bin/python bench/batch_packing.py run      # writes bench/results/batch_packing.json
    .venv/bin/python bench/tables.py                 # renders its RESULTS.md block (``table``)

For each batching (padded: random groups, one window per row, the order dealt to ranks as it comes - the code
before issue 29; packed: windows sharing rows of max_seq_len, the order balanced by cost across ranks) and each
``batch_size``, one epoch of the training windows as ``aerie.drafter.data`` groups them (the same functions the
trainer calls), dealt to 8 ranks by ``shard_for_rank``:
- **padded / real**: the rows the batches occupy (rows x the longest row: what is computed) over real rows;
- **slowest rank / mean**: per optimizer step the costliest rank's batch over the mean of the 8, summed over
  steps (DDP waits for the slowest at every step), cost from ``data.batch_cost``: every computed row 1, plus
  the causal attention's n^2 / 2 per block of n rows (the whole padded row for the chunked kernel over padded
  batches; each packed sequence alone), in units of ``memory.attention_cost_rows`` of Kimi's MLA drafter.

Lengths: no Kimi shards exist here, so each dataset of config/kimi-k2.5.yaml contributes as many samples as its
output quota admits at its ``expected_output_tokens`` (max_output_tokens // expected), each of (an assumed prompt
length, in PROMPT_TOKENS) + a log-normal output length with that mean (sigma LENGTH_SIGMA), cut at
tokens.max_seq_len - the assumption is recorded in the JSON. The table is regenerable; the run takes ~1 min.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results" / "batch_packing.json"
CONFIG = REPO / "config" / "kimi-k2.5.yaml"
TEXT_CONFIG = REPO / "config" / "kimi-k2.5.config.json"
PROMPT_TOKENS = {"sharegpt": 300, "ultrachat": 200, "code": 250, "math": 100, "tool_use": 700}  # assumed
LENGTH_SIGMA = 0.8
WORLD = 8
BATCH_SIZES = (4, 16)


def kimi_lengths(seed: int = 0) -> tuple[list[int], dict]:
    """Sample lengths (prompt + output tokens) for the Kimi config's training datasets."""
    import random

    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    cap = int(config["tokens"]["max_seq_len"])
    rng = random.Random(seed)
    lengths, per_dataset = [], {}
    for name, ds in config["datasets"].items():
        if ds.get("bench_prompts") or name not in PROMPT_TOKENS:
            continue
        mean = float(ds["expected_output_tokens"])
        count = int(ds["max_output_tokens"] // mean)
        mu = math.log(mean) - LENGTH_SIGMA**2 / 2
        mine = [
            min(cap, PROMPT_TOKENS[name] + max(1, round(rng.lognormvariate(mu, LENGTH_SIGMA)))) for _ in range(count)
        ]
        per_dataset[name] = {"samples": count, "mean_tokens": statistics.fmean(mine)}
        lengths += mine
    return lengths, {"datasets": per_dataset, "max_seq_len": cap, "prompt_tokens_assumed": PROMPT_TOKENS,
                     "output_length": f"log-normal, sigma {LENGTH_SIGMA}, mean expected_output_tokens"}  # fmt: skip


def measure(lengths: list[int], packing: bool, balanced: bool, batch_size: int) -> dict:
    import torch
    import yaml

    from aerie.drafter.config import TrainConfig
    from aerie.drafter.data import Window, balance_ranks, batch_cost, epoch_batches, padded_tokens, real_tokens
    from aerie.drafter.distributed import shard_for_rank
    from aerie.drafter_kinds.eagle3.memory import attention_cost_rows, drafter_shape

    drafter = yaml.safe_load(CONFIG.read_text())["drafter"]
    cfg = TrainConfig.of(**{**drafter, "batch_size": batch_size, "packing": packing})
    d = drafter_shape(cfg, json.loads(TEXT_CONFIG.read_text()), 32000, 3)
    rows = attention_cost_rows(d)
    windows, start = [], 0
    for n in lengths:  # whole samples (max_seq_len = tokens.max_seq_len: none is cut)
        windows.append(Window(0, start, start + n, start + n, 0))
        start += n
    groups = epoch_batches(windows, cfg, 1)
    capacity = cfg.max_seq_len if packing else None
    cost = lambda g: batch_cost(g, capacity, rows)  # noqa: E731
    if balanced:
        groups = balance_ranks(groups, WORLD, cost, torch.Generator().manual_seed(1))
    shares = [shard_for_rank(groups, r, WORLD) for r in range(WORLD)]
    steps = list(zip(*shares))
    slowest = sum(max(cost(g) for g in step) for step in steps)
    mean = sum(statistics.fmean(cost(g) for g in step) for step in steps)
    padded = sum(padded_tokens(g, capacity) for g in groups)
    real = sum(real_tokens(g) for g in groups)
    return {
        "batching": "packed" if packing else "padded",
        "rank_order": "balanced by cost" if balanced else "as shuffled",
        "batch_size": batch_size,
        "max_batch_tokens": cfg.max_batch_tokens,
        "batches": len(groups),
        "steps": len(steps),
        "real_tokens": real,
        "padded_tokens": padded,
        "padded_per_real": padded / real,
        "slowest_rank_over_mean": slowest / mean,
        "cost_per_real_token": sum(cost(g) for g in groups) / real,
        "step_time_total": slowest,  # in cost units: what the epoch takes on 8 ranks
        "attention_cost_rows": rows,
    }


def run() -> dict:
    sys.path.insert(0, str(REPO))
    lengths, source = kimi_lengths()
    rows = []
    for batch_size in BATCH_SIZES:
        rows.append(measure(lengths, packing=False, balanced=False, batch_size=batch_size))
        rows.append(measure(lengths, packing=True, balanced=True, batch_size=batch_size))
    data = {"bench": "batch_packing", "world": WORLD, "samples": len(lengths), "tokens": sum(lengths),
            "lengths": source, "rows": rows}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(data: dict | None = None) -> str:
    data = data or json.loads(RESULTS.read_text())
    out = [
        "## Drafter batches on the Kimi config's lengths (issue 29 item 2): padding and stragglers, before and after",
        "",
        "`.venv/bin/python bench/batch_packing.py run`, raw rows `bench/results/batch_packing.json`: one epoch of "
        f"{data['samples']:,} samples ({data['tokens'] / 1e6:.1f}M tokens; per-dataset counts from the config's "
        "quotas, lengths log-normal around each `expected_output_tokens` plus an assumed prompt length: no Kimi "
        "shards exist "
        f"yet) grouped by aerie.drafter.data and dealt to {data['world']} ranks. Goal: <= 1.1x for both ratios. "
        "Cost: computed rows plus the causal attention (memory.attention_cost_rows); the epoch column is the sum "
        "over steps of the slowest rank's cost, relative to the padded batch_size 4 row.",
        "",
        "| batching | rank order | batch_size | batches | padded / real tokens | slowest rank / mean | epoch time |",
        "|---|---|---|---|---|---|---|",
    ]
    base = data["rows"][0]["step_time_total"]
    for r in data["rows"]:
        out.append(
            f"| {r['batching']} | {r['rank_order']} | {r['batch_size']} | {r['batches']:,} | "
            f"{r['padded_per_real']:.2f}x | {r['slowest_rank_over_mean']:.2f}x | {r['step_time_total'] / base:.2f} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["run", "table"])
    args = parser.parse_args()
    print(table(run() if args.what == "run" else None))


if __name__ == "__main__":
    main()
