"""End to end: the demo pipeline (shrunk to run in a few minutes) through Snakemake, as a user runs it.

Checks the artifacts of every stage, that a second run has nothing to do, that code edits re-run
nothing, and that a removed shard is recomputed alone from what is already on disk.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake

from aerie.tools.artifacts import read_jsonl, write_jsonl

pytestmark = pytest.mark.slow


def small_demo_config() -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"]["demo"] = {
        **(config["target"].get("demo") or {}),
        "train_steps": 40,
        "tokenizer_examples": 1500,
        "eval_prompts": 8,
    }
    config["datasets"]["tasks"]["source"]["count"] = 16
    config["datasets"]["tasks"]["shard_size"] = 9
    config["datasets"]["tasks"]["bench_prompts"] = 2
    config["datasets"]["humaneval"]["max_prompts"] = 10
    config["datasets"]["humaneval"]["shard_size"] = 4
    config["datasets"]["humaneval"]["bench_prompts"] = 2
    # A dataset read with HF `datasets` from a ShareGPT-layout file, one prompt per assistant turn (4 prompts:
    # an empty conversation is skipped, a duplicate dropped); `tasks` gave up 4 prompts so the run takes as long.
    config["datasets"]["chat"] = {
        "source": {
            "kind": "hf",
            "data_files": str(REPO / "tests/fixtures/prompt_sources/sharegpt_tasks.json"),
            "shape": "sharegpt",
            "id_field": "id",
            "turns": "every_assistant",
        },
        "shard_size": 3,
        "bench_prompts": 1,
    }
    config["responses"]["max_new_tokens"] = 48
    config["tokens"]["drop_truncated"] = False  # a barely trained target often runs to the token cap
    config["tokens"]["drop_degenerate"] = False  # ... and loops (the full demo target does not: it keeps the default)
    config["tokens"]["max_dropped_fraction"] = 0.75  # ... or answers nothing (flagged empty): few samples here
    config["hidden"]["min_next_token_agreement"] = 0.9
    config["drafter"] = {**(config.get("drafter") or {}), "epochs": 1}
    # One prompt of each set: the three datasets' held-out prompts and a bench.sets set (rule bench_set).
    config["bench"].update({"max_new_tokens": 16, "max_prompts": 1, "warmup": 0})
    config["bench"]["sets"] = {
        "arith": {"source": {"kind": "synthetic", "families": ["arith"], "count": 4, "seed": 99}}
    }
    # A 40-step target and one epoch cannot pay off: the gate is tested on its own below.
    config["bench"]["gate"] = {"min_speedup": 0.0, "must_beat_references": False}
    return config


def dry_run_counts(workdir: Path, configfile: Path) -> tuple[dict[str, int], str]:
    proc = snakemake(workdir, "-n", "--configfile", str(configfile))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M)}, out


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, Path]:
    workdir = tmp_path_factory.mktemp("demo")
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(small_demo_config()))
    proc = snakemake(workdir, "--cores", "2", "--configfile", str(configfile), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    return workdir, configfile


def test_every_stage_wrote_its_artifacts(demo_run) -> None:
    workdir, _ = demo_run
    results = workdir / "results"
    assert (results / "demo-target" / "config.json").exists()
    assert json.loads((results / "demo-target" / "aerie_demo_target.json").read_text())
    for dataset, shards in (("tasks", 2), ("humaneval", 2)):
        for stage, ext in (
            ("prompts", "jsonl"),
            ("responses", "jsonl"),
            ("tokens", "safetensors"),
            ("tokens", "report.json"),
            ("hidden", "safetensors"),
        ):
            files = sorted((results / dataset / stage).glob(f"shard-?????.{ext}"))
            assert len(files) == shards, (dataset, stage, files)
        assert (results / dataset / "prompts" / "bench.jsonl").exists()
    # humaneval went through `transformers serve` on loopback with the API client (journal kept).
    served = read_jsonl(results / "humaneval" / "responses" / "shard-00000.jsonl")
    assert {r["backend"] for r in served} == {"openai"} and all(r["attempts"] >= 1 for r in served)
    assert (results / "humaneval" / "responses" / "shard-00000.journal.jsonl").exists()
    assert {r["backend"] for r in read_jsonl(results / "tasks" / "responses" / "shard-00000.jsonl")} == {"hf"}
    assert (results / "vocab" / "draft_vocab.safetensors").exists()
    drafter = results / "drafter" / "demo"
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (drafter / "model.safetensors").exists() and (drafter / "eval.json").exists()
    for rule_log in ("demo_target.log", "drafter/demo.log", "bench/demo.log"):
        assert (results / "logs" / rule_log).exists()


def test_the_demo_writes_training_curves_a_model_card_and_progress_lines(demo_run) -> None:
    """TensorBoard events in the drafter folder, its export card, the published folder with the full card, and
    each long job's log with tqdm's rate and ETA lines."""
    from aerie.drafter.curves import read_curves

    workdir, _ = demo_run
    results = workdir / "results"
    drafter, published = results / "drafter" / "demo", results / "publish" / "demo"
    curves = read_curves(drafter / "tensorboard")
    train = [json.loads(x) for x in (drafter / "train_log.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in train if e["event"] == "train"]
    assert [s for s, _ in curves["train/loss"]] == steps and "train/top1_match_per_position/0" in curves
    assert len(curves["heldout/acceptance_length"]) == 2  # untrained + the one epoch
    export_card = (drafter / "README.md").read_text()
    assert export_card.startswith("---\n") and "library_name: sglang" in export_card and "## Training" in export_card
    card = (published / "README.md").read_text()
    bench = json.loads((results / "bench" / "demo.json").read_text())
    assert "**all prompts**" in card and f"{bench['methods']['demo']['acceptance_length']:,.2f}" in card
    assert "# demo: a speculative-decoding drafter (eagle3)" in card and "**Gate: passed**" in card
    assert not [p for p in published.rglob(".*")]  # no dotfile (.snakemake_timestamp) is published
    assert "<table>" in (results / "report" / "cards" / "demo.html").read_text()  # the card as the report's page
    assert "## Training data: where the responses came from" in card and "| humaneval |" in card
    assert os.stat(published / "model.safetensors").st_ino == os.stat(drafter / "model.safetensors").st_ino
    assert json.loads((published / "benchmark.json").read_text()) == bench
    logs = results / "logs"
    for path, pattern in [
        (logs / "drafter" / "demo.log", r"training: 100% (\d+)/\1 \[[\d:]+<00:00, +[\d.]+ ?(step/s|s/step)"),
        (logs / "bench" / "demo.log", r"bench: 100% (\d+)/\1 \[[\d:]+<00:00, +[\d.]+ ?(prompt/s|s/prompt)"),
        (logs / "responses.log", r"responses: 100% (\d+)/\1 \[[\d:]+<00:00, .*spent=\$"),
        (logs / "tasks" / "hidden" / "shard-00000.log", r"capture shard-00000\.safetensors: 100% [\d.]+k?/[\d.]+k?"),
    ]:
        text = path.read_text()
        assert re.search(pattern, text), (path, text[-2000:])


def test_benchmark_json_reports_speed_against_baseline(demo_run) -> None:
    workdir, _ = demo_run
    bench = json.loads((workdir / "results" / "bench" / "demo.json").read_text())
    assert bench["format"] == "aerie.bench/4"
    assert list(bench["methods"]) == ["demo", "untrained", "ngram"]  # the run's one drafter, named by the run
    assert bench["drafters"]["demo"]["kind"] == "eagle3" and bench["gate"]["serve"] == "demo"
    assert (workdir / "results" / "bench" / "demo.png").stat().st_size > 10_000
    assert list(bench["sets"]) == ["chat", "humaneval", "tasks", "arith"] and bench["prompts"] == 4  # datasets sorted
    assert all(t["prompts"] == 1 and set(t["methods"]) == set(bench["methods"]) for t in bench["sets"].values())
    assert (workdir / "results" / "bench" / "sets" / "arith.jsonl").exists()
    mine = bench["methods"]["demo"]
    base, spec = bench["baseline"]["tokens_per_s"], mine["tokens_per_s"]
    assert base > 0 and spec > 0
    assert mine["speedup"] == pytest.approx(spec / base, rel=1e-6)
    assert mine["acceptance_length"] >= 1.0
    assert len(mine["acceptance_per_position"]) == bench["num_draft_steps"] == mine["draft_tokens"]
    assert bench["lossless"] is True


def test_gate_fails_the_benchmark_job_and_keeps_the_evidence(demo_run) -> None:
    """A drafter below bench.gate.min_speedup makes the bench job fail with the measured figures; a reference drafter
    folder (here the trained drafter's own: a tie, which is no win) is served beside it and loses it every set, named;
    the failure says which drafter to serve instead."""
    workdir, configfile = demo_run
    config = yaml.safe_load(configfile.read_text())
    config["bench"]["gate"] = {"min_speedup": 50.0, "beat_references_on": ["acceptance_length"]}
    config["bench"]["references"] = ["untrained", "ngram", "results/drafter/demo"]
    gated = workdir / "gated.yaml"
    gated.write_text(yaml.safe_dump(config))
    proc = snakemake(workdir, "--cores", "2", "--forcerun", "bench", "--configfile", str(gated))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    log = (workdir / "results" / "logs" / "bench" / "demo.log").read_text()
    assert "the trained drafter does not pay off: demo (eagle3): speedup" in log
    assert "below bench.gate.min_speedup 50" in log and "tok/s with the drafter vs" in log
    kept = json.loads((workdir / "results" / "bench" / "demo.gate-failed.json").read_text())
    assert kept["methods"]["demo"]["speedup"] < 50
    assert kept["methods"]["results/drafter/demo"]["role"] == "drafter" and len(kept["sets"]) == 4
    for name, table in kept["sets"].items():  # the same drafter: the same acceptance, a tie on every set
        twin = table["methods"]["results/drafter/demo"]["acceptance_length"]
        assert twin == table["methods"]["demo"]["acceptance_length"]
        assert f"set {name}: demo's acceptance length {twin or 0:.3f} does not beat reference " in log
    assert "serve" in log and kept["gate"]["passed"] is False
    assert not (workdir / "results" / "bench" / "demo.json").exists()  # never published as a pass
    # Restore the passing report for the tests that follow.
    proc = snakemake(workdir, "--cores", "2", "--configfile", str(configfile))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_fit_plan_agrees_with_the_jobs_measured_peaks(demo_run) -> None:
    """aerie.preview.fit's estimate of each job, for the CPU, plus the Python/torch baseline, against its peak RSS
    (tests/fit_check.py says what the comparison means)."""
    from fit_check import assert_estimates_agree

    workdir, configfile = demo_run
    assert_estimates_agree(workdir, configfile, {"responses", "hidden", "drafter", "bench"})


def test_second_run_has_nothing_to_do_and_code_edits_rerun_nothing(demo_run) -> None:
    workdir, configfile = demo_run
    counts, out = dry_run_counts(workdir, configfile)
    assert "Nothing to be done" in out, out
    # Touch every script and library module: code changes must never re-run finished (paid, GPU) work.
    now = time.time() + 5
    for path in [*REPO.glob("scripts/*.py"), *REPO.glob("aerie/**/*.py"), *REPO.glob("rules/*.smk")]:
        os.utime(path, (now, now))
    counts, out = dry_run_counts(workdir, configfile)
    assert "Nothing to be done" in out, out
    # A changed parameter does not re-run finished shards either.
    config = yaml.safe_load(configfile.read_text())
    config["responses"]["batch_size"] = 5
    changed = workdir / "changed.yaml"
    changed.write_text(yaml.safe_dump(config))
    counts, out = dry_run_counts(workdir, changed)
    assert "Nothing to be done" in out, out


def test_removed_shard_is_recomputed_alone(demo_run) -> None:
    workdir, configfile = demo_run
    removed = "results/humaneval/hidden/shard-00001.safetensors"
    (workdir / removed).unlink()
    # Everything downstream is complete, so a plain run leaves the gap alone ...
    counts, out = dry_run_counts(workdir, configfile)
    assert "Nothing to be done" in out, out
    # ... and asking for the shard recomputes exactly it, from the tokens already on disk.
    # The target goes before --configfile, which takes several values.
    proc = snakemake(workdir, removed, "-n", "--configfile", str(configfile))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    counts = {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M)}
    assert counts == {"hidden": 1, "total": 1}, out


# ----------------------------------------------------------------------------------------------------------
# planted failures: each one stops the pipeline at the right job with a message that says what is wrong


def planted_copy(demo_run, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the finished demo (mtimes kept), to plant a failure in without touching the original."""
    import shutil

    workdir, configfile = demo_run
    copy = tmp_path / "planted"
    shutil.copytree(workdir, copy, symlinks=True, ignore=shutil.ignore_patterns("gated.yaml", "changed.yaml"))
    return copy, copy / configfile.name


def run_for(copy: Path, configfile: Path, target: str) -> str:
    proc = snakemake(copy, target, "--cores", "2", "--configfile", str(configfile))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    return out


def test_planted_dropped_reasoning_stops_the_tokens_job(demo_run, tmp_path) -> None:
    copy, configfile = planted_copy(demo_run, tmp_path)
    responses = copy / "results" / "humaneval" / "responses" / "shard-00000.jsonl"
    records = read_jsonl(responses)
    for r in records:  # a provider that counts reasoning tokens but does not return the reasoning
        r["reasoning"] = None
        r["usage"]["completion_tokens_details"] = {"reasoning_tokens": 12}
    write_jsonl(responses, records)
    run_for(copy, configfile, "results/humaneval/tokens/shard-00000.safetensors")
    log = (copy / "results" / "logs" / "humaneval" / "tokens" / "shard-00000.log").read_text()
    assert f"{len(records)} of {len(records)} samples dropped" in log and "reasoning_missing" in log, log
    assert "returned no reasoning" in log
    assert not (copy / "results" / "humaneval" / "tokens" / "shard-00000.safetensors").exists()


def test_planted_shifted_loss_mask_stops_the_hidden_job(demo_run, tmp_path) -> None:
    import torch

    from aerie.formats.tokens import TOKENS_FORMAT
    from aerie.tools.artifacts import load_packed, save_packed

    copy, configfile = planted_copy(demo_run, tmp_path)
    tokens = copy / "results" / "tasks" / "tokens" / "shard-00000.safetensors"
    tensors, meta = load_packed(tokens, TOKENS_FORMAT)
    shifted = tensors["loss_mask"].clone()
    offsets = tensors["seq_offsets"].tolist()
    for a, b in zip(offsets[:-1], offsets[1:]):  # an off-by-one mask: it starts on the last prompt token
        shifted[a:b] = torch.cat([tensors["loss_mask"][a + 1 : b], tensors["loss_mask"][b - 1 : b]])
    save_packed(tokens, {**tensors, "loss_mask": shifted}, meta)
    run_for(copy, configfile, "results/tasks/hidden/shard-00000.safetensors")
    log = (copy / "results" / "logs" / "tasks" / "hidden" / "shard-00000.log").read_text()
    # aerie.tokens/3 shards carry each sequence's prompt length: the mask must start exactly there.
    assert "the loss mask starts at position" in log and "the mask is shifted" in log, log


def test_planted_off_by_one_layer_ids_stop_the_drafter_job(demo_run, tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    copy, configfile = planted_copy(demo_run, tmp_path)
    # Both names of every shard: the declared one and its capture-store entry (a rerun re-links from the store).
    for shard in sorted((copy / "results").glob("*/hidden/**/shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            meta = dict(f.metadata())
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        ids = json.loads(meta["aux_layer_ids"])
        meta["aux_layer_ids"] = json.dumps([i - 1 for i in ids])  # every shard captured one layer too early
        save_file(tensors, str(shard), metadata=meta)
    run_for(copy, configfile, "results/drafter/demo")
    log = (copy / "results" / "logs" / "drafter" / "demo.log").read_text()
    # A shard removed by an earlier test is recaptured at the right ids first: then the shards disagree among
    # themselves; otherwise they disagree with the configured ids. Either way the job names both and stops.
    assert str([i - 1 for i in ids]) in log and str(ids) in log and "recapture" in log, log
    assert f"was captured at layers {[i - 1 for i in ids]}" in log or "hidden shards disagree on aux_layer_ids" in log
    assert f"the drafter reads layers {ids}" in log or "hidden shards disagree on aux_layer_ids" in log
