"""The model card (aerie.model_card): Hub metadata, the benchmark table per prompt set (aerie.bench/3) or over
every prompt (aerie.bench/2), training data and spend from the run's files; the published folder links the
drafter's files instead of copying them. The demo's end-to-end run writes both cards (tests/test_pipeline_e2e.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from aerie.model_card import CardFacts, CardSettings, bench_tables, render_card, write_published_folder

DRAFTER = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "num_hidden_layers": 1,
    "hidden_size": 7168,
    "vocab_size": 163840,
    "draft_vocab_size": 32000,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
    "aerie": {"format": "aerie.drafter/2", "train_config": {"epochs": 2, "learning_rate": 1e-4, "ttt_steps": 7}},
}
EVAL = {
    "simulated_acceptance_length": 3.1,
    "acceptance_per_position": [0.8, 0.6, 0.4],
    "best_epoch": 2,
    "epochs": [{}, {}],
    "untrained": {"simulated_acceptance_length": 1.0},
    "tokens_trained": 40_000_000,
    "ttt_steps": 7,
    "optimizer_steps": 1234,
    "train_seconds": 4680.0,
    "device": "cuda:0",
    "processes": 8,
}


def method(acc: float, speedup: float) -> dict:
    return {"acceptance_length": acc, "tokens_per_s": 90 * speedup, "speedup": speedup, "lossless": True}


BENCH_2 = {
    "format": "aerie.bench/2",
    "backend": "sglang",
    "device": "SGLang, tp 8",
    "concurrency": 8,
    "num_draft_steps": 3,
    "max_new_tokens": 512,
    "prompts": 30,
    "baseline": {"tokens_per_s": 90.0},
    "methods": {"eagle3": method(2.9, 1.6), "ngram": method(1.3, 1.05)},
}
BENCH_3 = {
    **BENCH_2,
    "format": "aerie.bench/3",
    "sets": {
        "mtbench": {"prompts": 10, "baseline": {"tokens_per_s": 88.0}, "methods": {"eagle3": method(2.69, 1.5)}},
        "gsm8k": {"prompts": 20, "baseline": {"tokens_per_s": 91.0}, "methods": {"eagle3": method(3.2, 1.8)}},
    },
}


def facts(**k) -> CardFacts:
    return CardFacts(run="kimi-k2.5-eagle3", target="/models/Kimi-K2.5", drafter=DRAFTER, evaluation=EVAL, **k)


def metadata(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_the_card_carries_hub_metadata_and_the_training_facts() -> None:
    settings = CardSettings(base_model="moonshotai/Kimi-K2.5", license="other", license_name="modified-mit")
    card = render_card(facts(training_data={"chat": {"samples": 10, "tokens": 5000, "supervised": 4000}}), settings,
                       published=False)  # fmt: skip
    meta = metadata(card)
    assert meta["base_model"] == "moonshotai/Kimi-K2.5" and meta["library_name"] == "sglang"
    assert meta["pipeline_tag"] == "text-generation" and meta["license"] == "other"
    assert meta["license_name"] == "modified-mit" and {"eagle3", "speculative-decoding"} <= set(meta["tags"])
    assert "held-out simulated acceptance length 3.10 (best epoch 2 of 2; untrained: 1.00)" in card
    assert "| chat | 10 | 5,000 | 4,000 |" in card and "`Eagle3DeepseekV2ForCausalLM`" in card
    assert "## Benchmark" not in card  # the export card: the benchmark comes after it
    assert "--speculative-draft-model-path <your-user>/kimi-k2.5-eagle3" in card
    assert "hf upload <your-user>/kimi-k2.5-eagle3 results/drafter/kimi-k2.5-eagle3 ." in card


def test_the_published_card_has_a_table_per_prompt_set_and_the_spend() -> None:
    settings = CardSettings(repo_id="me/k25-drafter")
    spend = {"total": 61.5, "journaled": 60.0, "billed_beyond_journals": 1.5, "per_dataset": {}, "source": "ledger"}
    responses = {
        "chat": {"samples": 100, "output_tokens": 90_000, "cost": 60.0, "backends": ["openrouter"],
                 "models": ["moonshotai/kimi-k2.5"], "providers": ["Chutes"]},
    }  # fmt: skip
    card = render_card(facts(bench=BENCH_3, responses=responses, spend=spend), settings, published=True)
    assert "base_model" not in metadata(card)  # neither configured nor in the target folder: left out
    assert card.index("**all prompts** (30 prompts") < card.index("**mtbench** (10 prompts") < card.index("**gsm8k**")
    assert "| this drafter | 2.69 | 135.0 | 1.50x | yes |" in card and "| ngram | 1.30 | 94.5 | 1.05x | yes |" in card
    assert "Spend: $61.50 in all ($60.00 journaled" in card and "| chat | 100 | 90,000 | openrouter |" in card
    assert "hf upload me/k25-drafter results/publish/kimi-k2.5-eagle3 ." in card
    assert "--speculative-draft-model-path me/k25-drafter" in card
    # a report without per-set tables (aerie.bench/2): one table over every prompt
    assert list(bench_tables(BENCH_2)) == ["all prompts"]
    assert "**all prompts** (30 prompts" in render_card(facts(bench=BENCH_2), settings, published=True)


def test_base_model_is_read_from_the_target_folder_when_it_names_a_hub_id(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "moonshotai/Kimi-K2.5"}))
    card = render_card(CardFacts("r", str(tmp_path), DRAFTER, EVAL), CardSettings(), published=False)
    assert metadata(card)["base_model"] == "moonshotai/Kimi-K2.5"
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))  # a local path
    assert "base_model" not in metadata(render_card(CardFacts("r", str(tmp_path), DRAFTER, EVAL), CardSettings(),
                                                    published=False))  # fmt: skip


def test_the_published_folder_links_the_drafter_and_adds_the_bench_and_the_card(tmp_path: Path) -> None:
    drafter = tmp_path / "results" / "drafter" / "demo"
    (drafter / "tensorboard").mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps(DRAFTER))
    (drafter / "eval.json").write_text(json.dumps(EVAL))
    (drafter / "model.safetensors").write_bytes(b"weights")
    (drafter / "tensorboard" / "events.out.tfevents.1").write_bytes(b"curves")
    (drafter / "README.md").write_text("the export card\n")
    (drafter / ".snakemake_timestamp").write_text("")  # Snakemake's marker of the directory output: never linked
    bench = tmp_path / "results" / "bench" / "demo.json"
    bench.parent.mkdir(parents=True)
    bench.write_text(json.dumps(BENCH_3))
    out = write_published_folder(tmp_path / "results" / "publish" / "demo", drafter, bench, CardSettings(), "t")
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert names == ["README.md", "benchmark.json", "config.json", "eval.json", "model.safetensors", "tensorboard",
                     "tensorboard/events.out.tfevents.1"]  # fmt: skip
    assert os.stat(out / "model.safetensors").st_ino == os.stat(drafter / "model.safetensors").st_ino  # no copy
    assert "**gsm8k** (20 prompts" in (out / "README.md").read_text()
    assert (drafter / "README.md").read_text() == "the export card\n"  # the drafter's own output is untouched
