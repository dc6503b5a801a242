"""The model card (aerie.publish.card): Hub metadata written by a YAML dumper (hostile values read back as given, the
drafter's kind as a tag), the drafter named by name and kind with its gate verdict and the run's recommendation, the
benchmark table per prompt set (aerie.bench/4) with every drafter and reference, training data and spend; the
published folder links the drafter's files (no dotfiles) and the report gets the card as a page linking the curves.
The demo's end-to-end run writes both cards (tests/test_pipeline_e2e.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from aerie.drafter_kinds.dflash.shape import DFlashShape
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter
from aerie.drafter_kinds.eagle3.shape import DrafterConfig
from aerie.publish.card import CardFacts, CardSettings, bench_tables, card_page, render_card, write_published_folder

DRAFTER = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "num_hidden_layers": 1,
    "hidden_size": 7168,
    "vocab_size": 163840,
    "draft_vocab_size": 32000,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
    "aerie": {"format": "aerie.drafter/2", "train_config": {"epochs": 2, "learning_rate": 1e-4, "ttt_steps": 7}},
}
TEXT = {"vocab_size": 5200, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip
DFLASH = DFlashShape.from_target(
    TEXT, num_layers=2, block_size=8, mask_token_id=5199, target_layer_ids=[1, 3]
).to_sglang_config("bfloat16", {})
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


def described(role: str, kind: str | None, width: int, twin_of: str | None = None) -> dict:
    return {"role": role, "kind": kind, "draft_tokens": width, "folder": None, "twin_of": twin_of}


BENCH = {
    "format": "aerie.bench/4",
    "backend": "sglang",
    "device": "SGLang, tp 8",
    "concurrency": 8,
    "num_draft_steps": 3,
    "max_new_tokens": 512,
    "prompts": 30,
    "baseline": {"tokens_per_s": 90.0},
    "drafters": {"kimi-eagle3": {"kind": "eagle3"}, "kimi-dflash": {"kind": "dflash"}},
    "methods": {
        "kimi-eagle3": {**method(2.9, 1.6), **described("trained", "eagle3", 3)},
        "kimi-dflash": {**method(4.4, 2.1), **described("trained", "dflash", 7)},
        "ngram": {**method(1.3, 1.05), **described("ngram", None, 3)},
        "z-lab/Kimi-K2.5-DFlash": {**method(4.1, 1.9), **described("drafter", "dflash", 7)},
    },
    "sets": {
        "mtbench": {"prompts": 10, "baseline": {"tokens_per_s": 88.0}, "methods": {"kimi-eagle3": method(2.69, 1.5)}},
        "gsm8k": {"prompts": 20, "baseline": {"tokens_per_s": 91.0}, "methods": {"kimi-eagle3": method(3.2, 1.8)}},
    },
    "gate": {
        "passed": True,
        "drafters": {
            "kimi-eagle3": {"passed": False, "failures": ["set gsm8k: kimi-eagle3's speedup 1.800 does not beat x"]},
            "kimi-dflash": {"passed": True, "failures": []},
        },
        "serve": "kimi-dflash",
        "speedup": 2.1,
        "why": "it passed the gate",
    },
}


def facts(name: str = "kimi-eagle3", kind: str = "eagle3", **k) -> CardFacts:
    config = DRAFTER if kind == "eagle3" else DFLASH
    return CardFacts(name=name, target="/models/Kimi-K2.5", drafter=config, evaluation=EVAL, kind=kind, **k)


def metadata(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_the_card_carries_hub_metadata_and_the_training_facts() -> None:
    settings = CardSettings(base_model="moonshotai/Kimi-K2.5", license="other", license_name="modified-mit")
    card = render_card(facts(training_data={"chat": {"samples": 10, "tokens": 5000, "supervised": 4000}},
                             shape="Eagle3DeepseekV2ForCausalLM (mla attention), hidden 7168"), settings,
                       published=False)  # fmt: skip
    meta = metadata(card)
    assert meta["base_model"] == "moonshotai/Kimi-K2.5" and meta["library_name"] == "sglang"
    assert meta["pipeline_tag"] == "text-generation" and meta["license"] == "other"
    assert meta["license_name"] == "modified-mit" and meta["tags"][:2] == ["eagle3", "speculative-decoding"]
    assert card.split("---\n")[2].startswith(
        "\n# kimi-eagle3: a speculative-decoding drafter (eagle3) for moonshotai/Kimi-K2.5"
    )
    assert "Drafter kind `eagle3`: EAGLE-3:" in card and "This folder: Eagle3DeepseekV2ForCausalLM (mla" in card
    assert "held-out simulated acceptance length 3.10 (best epoch 2 of 2; untrained: 1.00)" in card
    assert "| chat | 10 | 5,000 | 4,000 |" in card and "- eagle3 settings: `ttt_steps` 7" in card
    assert "## Benchmark" not in card  # the export card: the benchmark comes after it
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path <your-user>/kimi-eagle3" in card
    assert "hf upload <your-user>/kimi-eagle3 results/drafter/kimi-eagle3 ." in card
    assert "- training curves: [`tensorboard/`](tensorboard/)" in card and "Metrics on the Hub model page" in card


def test_hostile_metadata_values_read_back_as_written() -> None:
    """A licence name with ': ', a link with '#', tags starting with '#' or looking like YAML's booleans and nulls:
    the dumper quotes what it must (f-strings broke the first and dropped the second)."""
    hostile = CardSettings(
        base_model="org/model",
        license="other",
        license_name="modified: mit # really",
        license_link="https://example.com/l#section: 2",
        tags=("#speculative", "yes", "null", "a: b", "- dash", "'quoted'", "multi\nline", "ünï"),
    )
    for kind in ("eagle3", "dflash"):
        meta = metadata(render_card(facts(kind=kind), hostile, published=False))
        assert meta["license_name"] == "modified: mit # really"
        assert meta["license_link"] == "https://example.com/l#section: 2"
        assert meta["tags"] == [kind, "speculative-decoding", "draft-model", "aerie", *hostile.tags]


def test_the_published_card_names_the_drafter_its_kind_its_verdict_and_the_recommendation() -> None:
    settings = CardSettings(repo_id="me/k25-dflash")
    spend = {"total": 61.5, "journaled": 60.0, "billed_beyond_journals": 1.5, "per_dataset": {}, "source": "ledger"}
    responses = {
        "chat": {"samples": 100, "output_tokens": 90_000, "cost": 60.0, "backends": ["openrouter"],
                 "models": ["moonshotai/kimi-k2.5"], "providers": ["Chutes"]},
    }  # fmt: skip
    card = render_card(facts(bench=BENCH, responses=responses, spend=spend), settings, published=True)
    assert "base_model" not in metadata(card)  # neither configured nor in the target folder: left out
    assert "**Gate: failed**: set gsm8k: kimi-eagle3's speedup 1.800 does not beat x." in card
    assert "The run recommends serving `kimi-dflash` instead (it passed the gate)." in card
    assert card.index("**all prompts** (30 prompts") < card.index("**mtbench** (10 prompts") < card.index("**gsm8k**")
    assert "| **kimi-eagle3** (this drafter) | 3 | 2.69 | 135.0 | 1.50x | yes |" in card
    assert "| kimi-dflash (trained in this run too, dflash) | 7 | 4.40 | 189.0 | 2.10x | yes |" in card
    assert "| z-lab/Kimi-K2.5-DFlash (drafter, dflash) | 7 | 4.10 |" in card and "| ngram | 3 | 1.30 |" in card
    assert "Spend: $61.50 in all ($60.00 journaled" in card and "| chat | 100 | 90,000 | openrouter |" in card
    assert "hf upload me/k25-dflash results/publish/kimi-eagle3 ." in card
    assert "[on the Hub](https://huggingface.co/me/k25-dflash/tensorboard)" in card
    # The DFlash drafter's card: its kind's tag and serve flags, the run's recommendation is this drafter.
    dflash = render_card(facts("kimi-dflash", "dflash", bench=BENCH), settings, published=True)
    assert metadata(dflash)["tags"][0] == "dflash" and "eagle3" not in metadata(dflash)["tags"]
    assert (
        "**Gate: passed**" in dflash and "**The run recommends serving this drafter** (it passed the gate)." in dflash
    )
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path me/k25-dflash" in dflash
    assert "--speculative-num-draft-tokens 8" in dflash and "--speculative-eagle-topk" not in dflash
    assert list(bench_tables(BENCH)) == ["all prompts", "mtbench", "gsm8k"]


def test_base_model_is_read_from_the_target_folder_when_it_names_a_hub_id(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "moonshotai/Kimi-K2.5"}))
    at = CardFacts("r", str(tmp_path), DRAFTER, EVAL, "eagle3")
    assert metadata(render_card(at, CardSettings(), published=False))["base_model"] == "moonshotai/Kimi-K2.5"
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))  # a local path
    assert "base_model" not in metadata(render_card(at, CardSettings(), published=False))


def test_the_published_folder_links_the_drafter_without_dotfiles_and_the_report_gets_the_card(tmp_path: Path) -> None:
    drafter = tmp_path / "results" / "drafter" / "kimi-eagle3"
    shape = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=100, draft_vocab_size=64, aux_layer_ids=[1, 2, 3])  # fmt: skip
    torch.manual_seed(0)
    Eagle3Drafter(shape).save_pretrained(drafter)  # a real folder: the card reads it by its kind
    (drafter / "tensorboard").mkdir()
    (drafter / "eval.json").write_text(json.dumps(EVAL))
    (drafter / "tensorboard" / "events.out.tfevents.1").write_bytes(b"curves")
    (drafter / "README.md").write_text("the export card\n")
    (drafter / ".snakemake_timestamp").write_text("")  # Snakemake's marker of the directory output
    (drafter / "tensorboard" / ".hidden").write_text("")
    (drafter / ".cache" / "x").mkdir(parents=True)
    bench = tmp_path / "results" / "bench" / "kimi.json"
    bench.parent.mkdir(parents=True)
    bench.write_text(json.dumps(BENCH))
    page = tmp_path / "results" / "report" / "cards" / "kimi-eagle3.html"
    out = write_published_folder(
        tmp_path / "results" / "publish" / "kimi-eagle3", drafter, bench, CardSettings(), "t", page=page
    )
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert names == ["README.md", "benchmark.json", "config.json", "eval.json", "model.safetensors", "tensorboard",
                     "tensorboard/events.out.tfevents.1"]  # fmt: skip
    # A link to the folder that holds the files: Snakemake dates a linked directory output by the link, writing no
    # .snakemake_timestamp into it (hf upload follows the link).
    assert out.is_symlink() and os.readlink(out) == "kimi-eagle3.files" and out.resolve() == out.with_suffix(".files")
    assert os.stat(out / "model.safetensors").st_ino == os.stat(drafter / "model.safetensors").st_ino  # no copy
    card = (out / "README.md").read_text()
    assert "**gsm8k** (20 prompts" in card and "# kimi-eagle3: a speculative-decoding drafter (eagle3) for t" in card
    assert "This folder: LlamaForCausalLMEagle3 (llama attention)" in card
    assert (drafter / "README.md").read_text() == "the export card\n"  # the drafter's own output is untouched
    again = write_published_folder(out, drafter, bench, CardSettings(), "t")  # a rerun replaces folder and link
    assert again.is_symlink() and sorted(str(p.relative_to(out)) for p in out.rglob("*")) == names
    # The report's page: the card as HTML, its curves linked where they are.
    html = page.read_text()
    assert "<table>" in html and "<h1>kimi-eagle3: a speculative-decoding drafter (eagle3) for t</h1>" in html
    assert f'<a href="{(out.resolve() / "tensorboard").as_uri()}"><code>tensorboard/</code></a>' in html
    assert "library_name: sglang" in html


def test_the_card_page_escapes_what_it_shows() -> None:
    page = card_page("---\nlicense_name: '<b>x</b>'\n---\n# t <i>\n", "<title>")
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<title>&lt;title&gt;</title>" in page
    with pytest.raises(ValueError):
        card_page("no metadata", "t")


def test_the_export_card_of_a_dflash_drafter_reads_its_folder_by_its_kind(tmp_path: Path) -> None:
    """The drafter job's card (scripts/drafter.py) for a DFlash export: its kind read from config.json, its shape
    described by its kind, its tag and serve flags its kind's."""
    from aerie.drafter_kinds.dflash.model import DFlashDrafter
    from aerie.drafter_kinds.dflash.weights import export_dflash
    from aerie.publish.card import write_export_card

    shape = DFlashShape.from_target(TEXT, num_layers=2, block_size=4, mask_token_id=5199, target_layer_ids=[1, 3])
    drafter = tmp_path / "results" / "drafter" / "run-dflash"
    torch.manual_seed(0)
    export_dflash(DFlashDrafter(shape), shape, drafter, {"train_config": {"epochs": 1, "block_size": 4}})
    (drafter / "eval.json").write_text(json.dumps(EVAL))
    card = write_export_card(drafter, CardSettings(repo_id="me/d"), "t", [], {"tp": 8}).read_text()
    assert metadata(card)["tags"][0] == "dflash" and "# run-dflash: a speculative-decoding drafter (dflash)" in card
    assert "This folder: DFlashDraftModel (dflash), 2 layers, hidden 32, block 4" in card
    assert "- dflash settings: `block_size` 4" in card
    serve = "--speculative-algorithm DFLASH --speculative-draft-model-path me/d --speculative-num-draft-tokens 4"
    assert f"--tp-size 8 --host 0.0.0.0 --port 30000 {serve}" in card
