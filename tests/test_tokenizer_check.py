"""The tokenizer as loaded keeps every special marker of its chat template one id, or nothing is paid or trained.

Real tokenizers: the Kimi rehearsal target's tiktoken tokenizer (loaded through its own code, as K2.5's is), the
demo's BPE, and the 128k DeepSeek BPE with Kimi's chat tokens (tests/kimi_tokenizer.py) - each passing as built,
and each made to split `<think>`: not an added token at all, or declared by the files and lost by the loader (what
some transformers 5.x releases are reported to do to K2.5's tokenizer). Rule tokenizer_check runs before every
responses and tokens job: an API job never starts on such a target.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake
from kimi_tokenizer import KIMI_K2_THINKING_TEMPLATE, kimi_like_tokenizer

from aerie.target_model.markers import (
    TokenizerMarkerError,
    check_template_markers,
    package_version,
    write_tokenizer_check,
)
from aerie.target_model.model import load_tokenizer
from aerie.tokens.settings import TokenSettings
from aerie.tokens.stage import tokenize_shard
from aerie.tools.artifacts import write_jsonl

TRANSFORMERS = package_version("transformers")


def without_added_token(folder: Path, out: Path, *tokens: str) -> Path:
    """A copy of a fast tokenizer folder whose tokenizer.json no longer adds ``tokens`` (their entries renamed, so
    no other id moves): the BPE splits them."""
    shutil.copytree(folder, out)
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    for t in data["added_tokens"]:
        if t["content"] in tokens:
            t["content"] = f"<|aerie_unused_{t['id']}|>"
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def kimi_like(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kimi-like") / "target"
    kimi_like_tokenizer(KIMI_K2_THINKING_TEMPLATE, folder)
    return folder


@pytest.fixture(scope="module")
def split_think(kimi_like, tmp_path_factory) -> Path:
    return without_added_token(kimi_like, tmp_path_factory.mktemp("split") / "target", "<think>", "</think>")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> Path:
    """The rehearsal target's tokenizer files, as rule rehearsal_target writes them (a small BPE: seconds)."""
    from aerie.targets.demo.tokenizer import tokenizer_corpus
    from aerie.targets.rehearsal.tokenizer import train_bpe_ranks, write_tokenizer

    folder = tmp_path_factory.mktemp("rehearsal") / "target"
    write_tokenizer(folder, train_bpe_ranks(tokenizer_corpus(200, seed=1), 600), model_max_length=2048)
    return folder


def test_the_built_tokenizers_keep_every_marker_one_id(kimi_like, rehearsal, tmp_path) -> None:
    from aerie.targets.demo.tokenizer import tokenizer_corpus, train_tokenizer

    kimi = check_template_markers(load_tokenizer(kimi_like), kimi_like)
    assert {"<think>", "</think>", "<|im_end|>", "<|tool_call_begin|>", "<|tool_calls_section_begin|>"} <= set(kimi)
    # Kimi's ids, read from the files the way K2.5 ships them (tiktoken + tokenizer_config.json), loaded by its code.
    out = write_tokenizer_check(rehearsal, tmp_path / "check.json", trust_remote_code=True, log=lambda m: None)
    assert json.loads((tmp_path / "check.json").read_text()) == out and out["transformers"] == TRANSFORMERS
    assert out["tokenizer_class"] == "TikTokenTokenizer"
    assert {m: out["markers"][m] for m in ("<think>", "</think>", "<|im_end|>", "<|tool_call_begin|>")} == {
        "<think>": 163606,
        "</think>": 163607,
        "<|im_end|>": 163586,
        "<|tool_call_begin|>": 163597,
    }
    demo = tmp_path / "demo"
    train_tokenizer(tokenizer_corpus(200, seed=1), vocab_size=300).save_pretrained(demo)
    assert "<think>" in check_template_markers(load_tokenizer(demo), demo)


def test_a_tokenizer_that_splits_think_is_refused_naming_the_marker_and_transformers(split_think, tmp_path) -> None:
    tok = load_tokenizer(split_think)
    assert len(tok.encode("<think>", add_special_tokens=False)) > 1  # the tokenizer really splits it
    with pytest.raises(TokenizerMarkerError) as err:
        write_tokenizer_check(split_think, tmp_path / "check.json", log=lambda m: None)
    message = str(err.value)
    assert "'<think>' as " in message and "'</think>' as " in message and "declared by no tokenizer file" in message
    assert f"transformers {TRANSFORMERS}" in message and "<|im_end|>" not in message
    assert not (tmp_path / "check.json").exists()
    # The tokens stage checks the tokenizer it encodes with too: nothing is written.
    msgs = [{"role": "user", "content": "Q"}]
    record = {"format": "aerie.responses/1", "id": "a", "messages": msgs, "reasoning": "r", "content": "c"}
    write_jsonl(tmp_path / "r.jsonl", [{**record, "finish_reason": "stop"}])
    with pytest.raises(TokenizerMarkerError, match="'<think>' as "):
        tokenize_shard(
            tmp_path / "r.jsonl",
            tmp_path / "t.safetensors",
            tmp_path / "t.json",
            str(split_think),
            TokenSettings(max_seq_len=64),
        )
    assert not (tmp_path / "t.safetensors").exists() and not (tmp_path / "t.json").exists()


def test_a_marker_the_files_declare_but_the_loader_loses_is_refused(rehearsal, tmp_path) -> None:
    """Kimi's tokenizer_config.json declares <think> at 163606; a loader that drops it (here: its own code,
    edited) splits it into BPE pieces - the reported transformers 5.x failure on K2.5."""
    lossy = tmp_path / "lossy"
    shutil.copytree(rehearsal, lossy)
    code = lossy / "tokenization_kimi.py"
    line = "        specials = {str(tok): int(i) for i, tok in (added_tokens_decoder or {}).items()}\n"
    lose = "        added_tokens_decoder = {i: t for i, t in added_tokens_decoder.items() if str(t) != '<think>'}\n"
    assert line in code.read_text()
    code.write_text(code.read_text().replace(line, lose + line))
    tok = load_tokenizer(lossy, trust_remote_code=True)
    assert tok.encode("<think>", add_special_tokens=False) != [163606]
    with pytest.raises(TokenizerMarkerError, match=r"'<think>' as \d+ ids .*\(declared as id 163606\)") as err:
        check_template_markers(tok, lossy)
    assert "'</think>'" not in str(err.value)


def test_a_marker_the_loader_numbers_otherwise_than_its_files_is_refused(kimi_like, tmp_path) -> None:
    """One id is not enough: it must be the id the files declare (the id the model was trained on). Here
    tokenizer_config.json declares <|im_end|> at 129999 while tokenizer.json, which the loader reads, keeps it at
    its own id: every turn end would be trained on the wrong row."""
    folder = tmp_path / "renumbered"
    shutil.copytree(kimi_like, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    entry = {"content": "<|im_end|>", "special": True, "lstrip": False, "rstrip": False, "normalized": False}
    config["added_tokens_decoder"] = {"129999": {**entry, "single_word": False}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = load_tokenizer(folder)
    loaded = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(loaded) == 1 and loaded != [129999]
    with pytest.raises(
        TokenizerMarkerError, match=rf"'<\|im_end\|>' as id {loaded[0]} \(declared as id 129999\)"
    ) as err:
        check_template_markers(tok, folder)
    assert "'<think>'" not in str(err.value)


def test_a_marker_split_only_by_tokenizer_encode_is_refused(kimi_like, tmp_path) -> None:
    """A tokenizer saved with ``split_special_tokens: true`` keeps every marker one id for the tokens stage's own
    encoder but splits it under ``tokenizer.encode``, the way a server encodes text: refused by rule
    tokenizer_check (the tokens stage, which only checks its own encoder, would not see it)."""
    folder = tmp_path / "split-on-encode"
    shutil.copytree(kimi_like, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}), "utf-8")
    tok = load_tokenizer(folder)
    assert len(tok.encode("<|im_end|>", add_special_tokens=False)) > 1
    assert check_template_markers(tok, folder, as_server=False)["<|im_end|>"] == tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(
        TokenizerMarkerError, match=r"'<\|im_end\|>' as \[[0-9, ]+\] by tokenizer.encode and \[\d+\] by"
    ):
        write_tokenizer_check(folder, tmp_path / "check.json", log=lambda m: None)
    assert not (tmp_path / "check.json").exists()


def api_config(workdir: Path, target: Path, base_url: str) -> Path:
    """A real (existing) target and one dataset regenerated through 'OpenRouter' (the emulator)."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"] = {"path": str(target)}
    src = workdir / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} + {i}?"}) + "\n" for i in range(5)))
    config["datasets"] = {
        "chat": {"source": {"kind": "jsonl", "path": str(src), "id_field": "id"}, "bench_prompts": 1, "shard_size": 4}
    }
    config["responses"] = {
        "backend": "openrouter",
        "model": "moonshotai/kimi-k2.5",
        "base_url": base_url,
        "max_new_tokens": 64,
        "expected_output_tokens": 50,
        "budget_usd": 5,
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_no_api_request_is_paid_on_a_target_whose_tokenizer_splits_a_marker(split_think, workdir) -> None:
    """Snakemake with --keep-going: the check fails first and the responses job never starts (the emulator sees no
    request); the plan shows the check file as an input of the paid job and of the tokens job."""
    import os

    from aerie.emulator import EmulatorSettings, serve_in_thread

    requests_log = workdir.parent / "requests.jsonl"
    emu = EmulatorSettings(api_key="sk-test", request_log=str(requests_log), latency_mean=0.0)
    env = {**os.environ, "OPENROUTER_API_KEY": "sk-test"}
    with serve_in_thread(emu) as base_url:
        cfg = api_config(workdir, split_think, base_url)
        shard = "results/chat/responses/shard-00000.jsonl"
        run = snakemake(workdir, "--cores", "1", "--keep-going", shard, "--configfile", str(cfg), env=env)
        assert run.returncode != 0
        log = (workdir / "results/logs/tokenizer_check.log").read_text()
        assert "'<think>' as " in log and f"transformers {TRANSFORMERS}" in log, log
        assert not (workdir / shard).exists() and not list((workdir / "results/chat").glob("responses/*journal*"))
        assert not requests_log.exists() or not requests_log.read_text().strip()
        dry = snakemake(workdir, "-n", "--configfile", str(cfg), env=env)
        assert dry.returncode == 0, dry.stderr
        plan = dry.stdout + dry.stderr
        jobs = plan.split("\nrule ")
        check_job = next(j for j in jobs if j.startswith("tokenizer_check:"))
        assert "output: results/target/tokenizer_check.json" in check_job
        for rule in ("responses:", "tokens:"):
            job = next(j for j in jobs if j.startswith(rule))
            assert "results/target/tokenizer_check.json" in job.split("output:")[0], rule
