"""A dataset with an output-token quota plans only the shards the quota can use (issue 22 item 6).

Its prompts are a seeded sample of the dataset, as many as the quota admits at the expected length plus
``quota_reserve``, in whole shards; a later parse adds shards from the rest of the sample only when every planned
shard finished below the quota, and a shard once written never changes its prompts. The end-to-end test runs the
API job against the emulator: answers shorter than expected leave the quota unreached, the next run tops up, and
the quota code counts the first run's journals so the run ends at the quota.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from conftest import REPO

from aerie.emulator import EmulatorSettings, serve_in_thread
from aerie.formats.responses import COMPLETION_FORMAT, QUOTA_REASON, write_completion
from aerie.plan.config_file import ConfigError
from aerie.plan.resolve import plan_datasets
from aerie.responses.api.journal import journal_path
from aerie.sources.datasets import read_prompts, sample_order, write_prompts
from aerie.tools.artifacts import read_jsonl


def splitmix64_order(pool: int, seed: int) -> list[int]:
    """The documented order, in plain Python integers: positions sorted by SplitMix64(mix(seed) + position)."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    base = mix(seed)
    return sorted(range(pool), key=lambda i: mix((base + i) & mask))


def test_the_sample_order_is_pinned_a_permutation_and_stable_when_the_source_grows() -> None:
    assert sample_order(10, 0) == [5, 7, 1, 4, 2, 8, 0, 6, 3, 9]  # the same on every machine and numpy
    for pool, seed in ((1000, 0), (1000, 7), (3, 2**40)):
        order = sample_order(pool, seed)
        assert order == splitmix64_order(pool, seed)
        assert sorted(order) == list(range(pool))
    assert sample_order(1000, 0) != sample_order(1000, 1)
    # More prompts only interleave new positions: the old ones keep their relative order.
    grown = [i for i in sample_order(1200, 0) if i < 1000]
    assert grown == sample_order(1000, 0)


def quota_config(folder: Path, pool: int = 1000, **dataset) -> dict:
    """One API dataset of ``pool`` prompts (+1 held out), shards of 50, a quota of 10,000 at 100 tokens expected."""
    src = folder / "prompts.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(pool + 1)))
    return {
        "target": {"path": "unused"},
        "datasets": {
            "chat": {
                "source": {"kind": "jsonl", "path": str(src), "id_field": "id"},
                "shard_size": 50,
                "bench_prompts": 1,
                "max_output_tokens": 10_000,
                "expected_output_tokens": 100,
                **dataset,
            }
        },
        "responses": {"backend": "openrouter", "model": "m/m", "base_url": "http://x", "max_new_tokens": 512},
    }


def write_planned_prompts(config: dict, results: Path) -> dict:
    """What the prompts rule writes for every planned shard."""
    plans = plan_datasets(config, results)
    plan, ds = plans["chat"], config["datasets"]["chat"]
    for shard in plan.shard_names:
        start, stop = plan.shard_range(int(shard))
        out = results / "chat" / "prompts" / f"shard-{shard}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_prompts("chat", ds, start, stop, out, config["datasets"], order=plan.order(), cache_dir=None)
    return plans


def publish(results: Path, shard: str, tokens_each: int, reason: str | None = None, quota: int = 10_000) -> None:
    """A finished API shard: its journal (every sample, ``tokens_each`` output tokens) and the published output."""
    out = results / "chat" / "responses" / f"shard-{shard}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(results / "chat" / "prompts" / f"shard-{shard}.jsonl")
    lines = [
        json.dumps({"id": p["id"], "cost": 0.001, "usage": {"completion_tokens": tokens_each}}) + "\n" for p in prompts
    ]
    journal_path(out).write_text("".join(lines))
    write_completion(
        out,
        {
            "format": COMPLETION_FORMAT,
            "shard": out.name,
            "prompts": len(prompts),
            "samples": len(prompts),
            "not_requested": 0,
            "reason": reason,
            "max_output_tokens": quota,
        },
    )
    out.write_text("".join(lines))


def test_a_quota_plans_a_seeded_sample_of_the_shards_it_can_use(tmp_path: Path) -> None:
    config = quota_config(tmp_path)
    plan = plan_datasets(config, tmp_path / "results")["chat"]
    # 10,000 / 100 = 100 samples + 25% reserve = 125 prompts: 3 shards of 50, not the 20 the pool fills.
    assert (plan.num_shards, plan.pool_shards, plan.train) == (3, 20, 1000)
    assert "3 of 20 shards (150 of 1,000 prompts" in plan.note and "datasets.chat.quota_reserve" in plan.note
    assert plan.positions(0, 150) == sample_order(1000, 0)[:150]
    assert plan.positions(0, 150) != list(range(150))
    # The reserve is a setting; a null sample_seed keeps the source's order.
    assert plan_datasets(quota_config(tmp_path, quota_reserve=1.0), None)["chat"].num_shards == 4
    unsampled = plan_datasets(quota_config(tmp_path, sample_seed=None), None)["chat"]
    assert unsampled.num_shards == 20 and unsampled.positions(0, 3) == [0, 1, 2]
    # Without a quota, or for in-process responses (no quota enforced there), every prompt is planned.
    config["responses"]["backend"] = "hf"
    assert plan_datasets(config, None)["chat"].num_shards == 20


def test_shards_finished_below_the_quota_top_up_from_the_rest_and_keep_their_prompts(tmp_path: Path) -> None:
    config, results = quota_config(tmp_path), tmp_path / "results"
    first = write_planned_prompts(config, results)["chat"]
    written = {s: (results / "chat/prompts" / f"shard-{s}.jsonl").read_bytes() for s in first.shard_names}
    # Answers as long as expected: the planned shards still hold enough unanswered prompts, nothing is added.
    publish(results, "00000", 100)
    assert plan_datasets(config, results)["chat"].num_shards == 3
    # Every planned shard finished; answers were 40 tokens, not 100: 150 x 40 = 6,000 of 10,000 used. The measured
    # mean (>= 20 samples) admits (10,000 - 6,000) / 40 = 100 more + 25% = 125 prompts: 3 more shards.
    for shard in ("00000", "00001", "00002"):
        publish(results, shard, 40)
    again = plan_datasets(config, results)["chat"]
    assert again.num_shards == 6, again.note
    assert "~100 more samples at 40 output tokens (mean of 150 journaled)" in again.note
    # The first shards keep their prompts byte for byte; the new ones continue the same seeded sample.
    for shard, data in written.items():
        out = tmp_path / f"rewritten-{shard}.jsonl"
        start, stop = again.shard_range(int(shard))
        write_prompts("chat", config["datasets"]["chat"], start, stop, out, config["datasets"], order=again.order())
        assert out.read_bytes() == data
    assert again.positions(150, 300) == sample_order(1000, 0)[150:300]
    # A shard that stopped at the quota ends the sampling: no shard is added, whatever the mean says.
    publish(results, "00002", 40, reason=QUOTA_REASON)
    assert plan_datasets(config, results)["chat"].num_shards == 3
    # ... unless the quota was raised since (a higher quota is not reached by a stop at the lower one).
    config["datasets"]["chat"]["max_output_tokens"] = 20_000
    assert plan_datasets(config, results)["chat"].num_shards > 3


def test_a_job_plans_the_shards_its_main_process_wrote(tmp_path: Path) -> None:
    """A SLURM job re-parses while the run goes on: it must see the DAG the main process scheduled, not a plan
    from the journals of the moment (a top-up mid-run would give the drafter job inputs no job makes)."""
    config, results = quota_config(tmp_path), tmp_path / "results"
    write_planned_prompts(config, results)
    for shard in ("00000", "00001", "00002"):
        publish(results, shard, 40)
    assert plan_datasets(config, results)["chat"].num_shards == 6  # a new run would top up ...
    assert plan_datasets(config, results, job=True)["chat"].num_shards == 3  # ... a job of this run does not
    # A job that runs before any prompt shard exists (building the target) plans none and does not fail.
    assert plan_datasets(config, tmp_path / "empty", job=True)["chat"].num_shards == 0


def test_a_setting_that_would_change_a_written_shard_is_refused(tmp_path: Path) -> None:
    config, results = quota_config(tmp_path), tmp_path / "results"
    write_planned_prompts(config, results)
    for key, value in (("shard_size", 40), ("sample_seed", 3), ("sample_seed", None)):
        changed = quota_config(tmp_path, **{key: value})
        with pytest.raises(ConfigError, match=r"shard-0000\d.jsonl begins with prompt 'chat/p\d+', but this plan"):
            plan_datasets(changed, results)
    # A newer source file is Snakemake's to handle (it writes the shards again): not refused here.
    src = Path(config["datasets"]["chat"]["source"]["path"])
    src.write_text(src.read_text() + json.dumps({"id": "new", "prompt": "one more"}) + "\n")
    later = os.stat(src).st_mtime + 10
    os.utime(src, (later, later))
    assert plan_datasets(quota_config(tmp_path, shard_size=40), results)["chat"].num_shards


def test_the_cost_preview_reads_the_sampled_shards(tmp_path: Path) -> None:
    """The preview prices what the planned shards still lack: their prompts in the plan's order, matched with
    their journals (source order would count none of these journaled samples as done)."""
    from aerie.plan.config_file import ConfigSources
    from aerie.plan.resolve import api_run, validate_config
    from aerie.preview.money import cost_preview
    from aerie.responses.api.settings import responses_settings

    config, results = quota_config(tmp_path), tmp_path / "results"
    config["responses"] |= {"price_per_million_output_usd": 1.0, "live_prices": False}
    (tmp_path / "c.yaml").write_text(json.dumps(config))
    validate_config(config, ConfigSources.read([str(tmp_path / "c.yaml")]))
    plans = write_planned_prompts(config, results)
    prompts = read_prompts(results / "chat" / "prompts" / "shard-00000.jsonl")
    phash = responses_settings(config["responses"], config["target"]["path"]).request.params_hash()
    journal = journal_path(results / "chat" / "responses" / "shard-00000.jsonl")
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_text(
        "".join(
            json.dumps({"id": p["id"], "params_hash": phash, "messages": p["messages"], "usage": {}, "cost": 0}) + "\n"
            for p in prompts[:20]
        )
    )
    estimate = cost_preview(api_run(config, plans), results, live=False).datasets["chat"]
    assert (estimate.shards, estimate.pending_prompts) == (3, 150 - 20)


@pytest.mark.slow  # four Snakemake runs against the emulator (~1 min on 2 quiet cores)
def test_a_too_short_expectation_tops_up_through_snakemake_and_the_quota_still_holds(
    workdir: Path, tmp_path_factory
) -> None:
    """The emulator answers 50 tokens where 100 are expected: the first run's 3 planned shards (150 prompts) finish
    at 7,500 of the 10,000-token quota; the next dry run plans more shards, the next run asks only the new
    shards' prompts and stops at the quota (its journals count the first run's tokens), and then nothing is left."""
    from api_world import api_pipeline_config
    from tiny_world import save_tiny_llama_target

    target = save_tiny_llama_target(tmp_path_factory.mktemp("target") / "tiny")
    secret = "sk-quota-plan-test"
    env = {**os.environ, "OPENROUTER_API_KEY": secret}
    sm = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    with serve_in_thread(EmulatorSettings(api_key=secret, output_tokens_mean=50, output_tokens_dist="fixed")) as url:
        quota = {"n": 400, "shard_size": 50, "max_output_tokens": 10_000, "expected_output_tokens": 100}
        cfg = api_pipeline_config(workdir, url, target, {"chat": quota}, concurrency=10)

        def run(*args: str) -> str:
            proc = subprocess.run([*sm, *args, "--configfile", str(cfg)], capture_output=True, text=True, env=env)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            return proc.stdout + proc.stderr

        shards = [f"results/chat/responses/shard-{i:05d}.jsonl" for i in range(6)]
        run("--cores", "1", *shards[:3])
        assert sum(len(read_jsonl(workdir / s)) for s in shards[:3]) == 150
        # 7,500 of 10,000 used at a measured 50 a sample: 50 more + 25% = 63 prompts, 2 more shards.
        plan = run("-n", *shards[:5])
        assert "chat            5 of 8 shards (250 of 400 prompts" in plan, plan
        assert "~50 more samples at 50 output tokens (mean of 150 journaled)" in plan
        run("--cores", "1", *shards[:5])
        asked = requests.get(f"{url}/emulator/stats", timeout=5).json()["requests"]
        new = [r for s in shards[3:5] for r in read_jsonl(workdir / s)]
        assert len(new) == 50 and asked == 200  # the quota stopped it at 10,000 tokens: 200 answers, none twice
        completions = [json.loads((workdir / s.replace(".jsonl", ".completion.json")).read_text()) for s in shards[:5]]
        assert [c["reason"] for c in completions[:3]] == [None] * 3
        assert QUOTA_REASON in [c["reason"] for c in completions[3:]]
        assert "chat            5 of 8 shards" in run("-n", *shards[:5])  # reached: nothing more is planned
