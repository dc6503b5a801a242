"""A dataset cut by its output-token quota publishes empty responses shards: every later stage runs on them.

Stages 3-5 on a tiny random target: an empty responses shard (what a quota-reached shard holds) goes
through tokens, hidden-state capture, the draft vocabulary and the drafter's data loading beside a
non-empty shard, as the pipeline runs them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.drafter.data import make_windows, split_heldout
from aerie.formats.hidden import open_hidden_shards
from aerie.hidden.settings import CaptureSettings
from aerie.hidden.shard import capture_shard
from aerie.responses.in_process import generate_hf
from aerie.responses.sampling import Sampling
from aerie.sources.datasets import write_prompts
from aerie.targets.demo.tokenizer import tokenizer_corpus, train_tokenizer
from aerie.tokens.settings import TokenSettings
from aerie.tokens.stage import tokenize_shard
from aerie.vocab.draft_vocab import build_draft_vocab

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SYNTH = {"source": {"kind": "synthetic", "families": ["arith"], "count": 4, "seed": 3}, "shard_size": 4}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target")
    tok = train_tokenizer(tokenizer_corpus(200, seed=1), vocab_size=300)
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    ).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_an_empty_responses_shard_flows_through_tokens_hidden_vocab_and_drafter_data(tiny_target, tmp_path) -> None:
    quiet = lambda m: None  # noqa: E731
    full, empty = tmp_path / "full", tmp_path / "empty"
    for d in (full, empty):
        d.mkdir()
    write_prompts("tasks", SYNTH, 0, 4, full / "prompts.jsonl")
    generate_hf(
        full / "prompts.jsonl",
        full / "responses.jsonl",
        str(tiny_target),
        Sampling(temperature=0.0, top_p=1.0, max_new_tokens=8, batch_size=4, seed=0),
        threads=1,
        log=quiet,
    )
    (empty / "responses.jsonl").write_bytes(b"")  # a shard whose dataset reached its quota before it began
    for d in (full, empty):
        tokenize_shard(
            d / "responses.jsonl",
            d / "tokens.safetensors",
            d / "report.json",
            str(tiny_target),
            TokenSettings(max_seq_len=256, drop_truncated=False),
            log=quiet,
        )
        capture_shard(
            d / "tokens.safetensors",
            d / "hidden.safetensors",
            str(tiny_target),
            CaptureSettings(
                aux_layer_ids=[1, 3, 4], batch_tokens=64, layout="full", storage_dtype="float32", threads=1
            ),
            log=quiet,
        )
    report = json.loads((empty / "report.json").read_text())
    assert report["samples"] == 0 and report["kept"] == 0
    meta = build_draft_vocab(
        [full / "tokens.safetensors", empty / "tokens.safetensors"],
        tmp_path / "v.safetensors",
        target_vocab_size=300,
        draft_vocab_size=50,
        log=quiet,
    )
    assert 0 < meta["coverage"] <= 1
    shards = open_hidden_shards([full / "hidden.safetensors", empty / "hidden.safetensors"])
    assert shards[1].num_seqs == 0
    split_heldout(shards, 0.25, 0)
    windows = [
        w for si, sh in enumerate(shards) for seq in range(sh.num_seqs) for w in make_windows(si, sh, seq, 256, 3 + 1)
    ]
    assert windows and all(w.shard == 0 for w in windows)
