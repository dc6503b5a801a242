"""`snakemake -n --configfile config/kimi-k2.5.yaml` with the user's prompt counts previews under its budget.

The user's story: five prompt sets (5,000 / 5,000 / 3,000 / 1,319 / 1,000 prompts), a $100 OpenRouter
budget, and a 7M output-token quota per dataset. The plan holds only the shards each quota can use; the preview
must cut each dataset at its quota, use the per-dataset expected lengths, say how many responses it will produce,
and stay under the budget.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import yaml
from conda_stand_in import CONDA_DEPLOYMENT, conda_on_path
from conftest import REPO

KIMI = REPO / "config" / "kimi-k2.5.yaml"
COUNTS = {"sharegpt": 5000, "ultrachat": 5000, "code": 3000, "math": 1319, "tool_use": 1000}


def kimi_config_with_prompt_files(workdir: Path) -> Path:
    """config/kimi-k2.5.yaml with only each dataset's ``source`` replaced by a local prompt file of the story's
    size (the shipped sources name Hub datasets, read from a cache a test cannot fill offline); caps, expected
    lengths, prices and the budget are the shipped file's own."""
    config = yaml.safe_load(KIMI.read_text())
    recorded = {n for n, d in config["datasets"].items() if d["source"]["kind"] == "recorded"}
    assert set(config["datasets"]) - recorded == set(COUNTS)  # the recorded ones are optional: absent here, $0
    for name, ds in config["datasets"].items():
        if name in recorded:
            continue
        path = workdir / "prompts" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            for i in range(COUNTS[name]):
                text = f"{name} prompt {i}: explain the idea behind item {i} step by step."
                fh.write(json.dumps({"id": f"{name}-{i}", "messages": [{"role": "user", "content": text}]}) + "\n")
        ds["source"] = {"kind": "jsonl", "path": str(path), "messages_field": "messages", "id_field": "id"}
    out = workdir / "kimi-k2.5.yaml"
    out.write_text(yaml.safe_dump(config))
    return out


def test_kimi_config_previews_under_budget_with_quotas(workdir: Path) -> None:
    cfg = kimi_config_with_prompt_files(workdir)
    # No key: nothing live to read. Conda deployment, as profiles/gpu-host sets it: the config's SGLang rules need
    # SGLang's env (tests/conda_stand_in.py: the conda a dry run asks).
    env = {k: v for k, v in conda_on_path(workdir).items() if k != "OPENROUTER_API_KEY"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            "-n",
            *CONDA_DEPLOYMENT,
            "--configfile",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "OVER BUDGET" not in out, out
    # each drafter's warm start is shown: the published drafters are not in this machine's Hub cache, so a real run
    # would refuse
    for name, init in (("eagle3", "lightseekorg/kimi-k2.5-eagle3"), ("dflash", "z-lab/Kimi-K2.5-DFlash")):
        assert f"aerie warm start (kimi-k2.5-{name}): drafters.{name}.init '{init}' is NOT here" in out, out
        assert f"models--{init.replace('/', '--')}" in out and "huggingface-cli download" in out
    header = next(x for x in out.splitlines() if x.startswith("aerie cost preview"))
    price_in, price_out = (float(v) / 1e6 for v in re.search(r"price ([\d.]+)/([\d.]+) USD", header).groups())
    config = yaml.safe_load(KIMI.read_text())
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in COUNTS and len(parts) > 6 and parts[1].isdigit():
            rows[parts[0]] = parts
    assert "mtbench" not in rows  # a benchmark set (bench.sets), not a dataset: nothing to regenerate
    total = 0.0
    for name, parts in rows.items():
        ds = config["datasets"][name]
        prompts, samples = int(parts[2]), int(parts[3])
        out_tokens, usd = int(parts[4].replace(",", "")), float(parts[5])
        # Only the shards the quota can use are planned: what it admits at the expected length + the reserve,
        # rounded up to whole shards (the chat sets: 2,000 + 25% = 2,500 prompts -> 2 shards of 2,000 of 5,000).
        admitted = ds["max_output_tokens"] // ds["expected_output_tokens"]
        shards = min(math.ceil(COUNTS[name] / ds["shard_size"]), math.ceil(admitted * 1.25 / ds["shard_size"]))
        assert int(parts[1]) == shards and prompts == min(COUNTS[name], shards * ds["shard_size"]), (name, parts)
        want = min(prompts, admitted)
        assert samples == want, (name, samples, want)  # cut at the quota, at the expected length
        assert out_tokens == samples * ds["expected_output_tokens"] <= ds["max_output_tokens"]
        assert usd >= out_tokens * price_out and usd < out_tokens * price_out + samples * 100 * price_in
        assert f"datasets.{name}.expected_output_tokens" in " ".join(parts)
        total += usd
    assert set(rows) == set(COUNTS)
    # The chat sets hit their 7M quota (2,000 of 5,000 prompts at ~3,500 tokens); the others fit.
    assert rows["sharegpt"][3] == "2000" and "quota 7,000,000 reached" in " ".join(rows["sharegpt"])
    assert rows["sharegpt"][1:3] == ["2", "4000"]  # not the 3 shards (5,000 prompts) the file holds
    plan = out[out.index("aerie shard plan") :].splitlines()
    assert plan[0] == "aerie shard plan: 8 training shards (10 would hold every prompt)", plan
    sharegpt = next(x for x in plan if x.split()[0] == "sharegpt")
    assert "2 of 3 shards (4,000 of 5,000 prompts, a seeded sample (datasets.sharegpt.sample_seed 0))" in sharegpt
    assert "admits ~2,000 more samples at 3,500" in sharegpt and "25% reserve" in sharegpt
    produce = re.search(r"will produce ~([\d,]+) more responses \(~([\d,]+) output tokens\) for \$([\d.]+)", out)
    assert produce, out
    assert int(produce.group(1).replace(",", "")) == sum(int(r[3]) for r in rows.values())
    assert abs(float(produce.group(3)) - total) < 0.05 and total < 100
    # Even if every quota is reached, the output stays under the budget: the plan is safe, not just likely.
    quota_usd = sum(config["datasets"][n]["max_output_tokens"] for n in rows) * price_out
    assert quota_usd < config["responses"]["budget_usd"]
    assert re.search(r"spent: \$0\.00 journaled.* = \$0\.00; budget \$100\.00", out), out
    # The disk preview is cut at the same quotas (per dataset) and names the compact layout.
    disk = next(x for x in out.splitlines() if x.startswith("aerie disk preview"))
    assert "compact" in disk and "sharegpt ~" in disk
    per_token = int(re.search(r"x ([\d,]+) bytes/token", disk).group(1).replace(",", ""))
    sharegpt = float(re.search(r"sharegpt ~([\d,.]+)", disk).group(1).replace(",", ""))
    # cut at its quota (2,000 samples, ~4,000 prompts' shards planned) - uncapped, its 5,000 prompts x 3,500 output
    # tokens alone would be ~940 GiB at the 8 captured layers (EAGLE-3's 3 and DFlash's 6 share layer 1)
    assert sharegpt < 0.5 * 5000 * 3500 * per_token / 2**30, disk
    assert "8 aux layers" in disk
