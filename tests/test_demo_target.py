"""The demo target: task language, Kimi-structured tokenizer/template, and a tiny end-to-end build."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from aerie.sources.synthetic import FAMILIES, describe_code_instruction, generate_prompts, make_example
from aerie.targets.demo.build import REPORT_FILE, build_demo_target
from aerie.targets.demo.config import DemoTargetConfig
from aerie.targets.demo.pretrain import repeated_ngram_rate, split_output
from aerie.targets.demo.tokenizer import (
    DEFAULT_SYSTEM_PROMPT,
    SPECIAL_TOKENS,
    completion_text,
    encode_examples,
    example_messages,
    special_token_ids,
    tokenizer_corpus,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(tokenizer_corpus(600, seed=1), vocab_size=600)


TINY = DemoTargetConfig(
    vocab_size=600,
    tokenizer_examples=600,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=1024,
    train_steps=20,
    batch_size=4,
    warmup=5,
    log_every=10,
    eval_prompts=6,
    eval_max_new_tokens=16,
    eval_batch_size=6,
    humaneval_prompts=2,
    latency_steps=4,
)


# --- tasks ------------------------------------------------------------------------------------------


def test_examples_are_deterministic_from_the_rng():
    for family in FAMILIES:
        a = make_example(family, random.Random(7))
        b = make_example(family, random.Random(7))
        assert a == b
        assert a.user and a.reasoning and a.answer and a.family == family


def test_generate_prompts_deterministic_and_seed_dependent():
    p1 = generate_prompts(FAMILIES, 9, seed=3)
    assert p1 == generate_prompts(FAMILIES, 9, seed=3)
    assert [p["family"] for p in p1] == list(FAMILIES) * 3
    assert p1[4]["id"] == f"{p1[4]['family']}-3-4"
    other = generate_prompts(FAMILIES, 9, seed=4)
    assert sum(a["user"] != b["user"] for a, b in zip(p1, other)) >= 8
    assert generate_prompts(["lists"], 2, seed=3)[0]["user"] == generate_prompts(["lists"], 2, seed=3)[0]["user"]
    with pytest.raises(ValueError):
        make_example("poetry", random.Random(0))


def test_arith_reasoning_shows_the_steps():
    for seed in range(50):
        ex = make_example("arith", random.Random(seed))
        steps = ex.reasoning.split(". ")
        last = ex.reasoning.rstrip(".").rsplit(" = ", 1)[1]
        assert ex.answer == f"The answer is {last}."
        assert len(steps) == ex.user.count(" + ") + ex.user.count(" - ") + ex.user.count(" * ")
        # each step is correct arithmetic
        for step in ex.reasoning.rstrip(".").split(". "):
            lhs, rhs = step.split(" = ")
            assert eval(lhs) == int(rhs)  # noqa: S307 - our own generated text


def test_code_examples_look_like_humaneval_and_name_the_function():
    ex = next(e for s in range(100) if "->" in (e := make_example("code", random.Random(s))).user)
    assert ex.user.startswith(describe_code_instruction("x").split("\n")[0])
    assert "def " in ex.user and '"""' in ex.user
    signature = ex.reasoning.split("The signature is ", 1)[1].split(". The name is ", 1)[0]
    assert f"def {signature}:" in ex.user  # copied verbatim from the def line
    name = signature.split("(", 1)[0]
    assert f"The name is {name}." in ex.reasoning and ex.answer.startswith(f"In short: {name}(")


# --- tokenizer and chat template --------------------------------------------------------------------


def test_special_tokens_are_single_ids(tokenizer):
    ids = special_token_ids(tokenizer)
    assert set(ids) == set(SPECIAL_TOKENS) and len(set(ids.values())) == len(SPECIAL_TOKENS)
    assert tokenizer.eos_token_id == ids["<|im_end|>"]
    assert tokenizer.pad_token_id == ids["[PAD]"] and tokenizer.bos_token_id == ids["[BOS]"]


def test_chat_template_kimi_structure(tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning_content": "secret"},
        {"role": "user", "content": "again"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>yo<|im_end|>"  # history reasoning dropped
        "<|im_user|>user<|im_middle|>again<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    # own system message: no default injected; name overrides the role in the header
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "name": "bob", "content": "q"}],
        tokenize=False,
        add_generation_prompt=False,
    )
    assert text == "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>bob<|im_middle|>q<|im_end|>"
    instant = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    assert instant.endswith("<|im_middle|><think></think>")


def test_chat_template_tool_turns(tokenizer):
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need a tool",
            "tool_calls": [
                {"id": "functions.get:0", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get:0", "content": "42"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the current tool-call loop keeps its reasoning
    assert (
        "<|im_assistant|>assistant<|im_middle|><think>need a tool</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    ) in text
    assert text.endswith(
        "<|im_system|>tool<|im_middle|>## Return of functions.get:0\n42<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


def test_training_sequence_is_prompt_plus_completion(tokenizer):
    ex = make_example("lists", random.Random(0))
    [(ids, n_prompt)] = encode_examples(tokenizer, [ex], [example_messages(ex)])
    full = tokenizer.apply_chat_template(example_messages(ex), tokenize=False, add_generation_prompt=True)
    assert tokenizer(full + completion_text(ex), add_special_tokens=False)["input_ids"] == ids
    sp = special_token_ids(tokenizer)
    assert ids[n_prompt - 1] == sp["<think>"] and ids[-1] == sp["<|im_end|>"] and sp["</think>"] in ids[n_prompt:]
    assert tokenizer.decode(ids[n_prompt:], skip_special_tokens=False) == completion_text(ex)


def test_metric_helpers():
    assert repeated_ngram_rate([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(1 / 5)
    assert repeated_ngram_rate([[1, 2, 3]]) == 0.0
    assert split_output("r</think>a<|im_end|>") == ("r", "a")
    assert split_output("no think") == (None, "no think")


# --- end to end -------------------------------------------------------------------------------------


def test_tiny_build_loads_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "target"
    report = build_demo_target(out, TINY, log=lambda _: None)
    assert not (tmp_path / "target.tmp").exists()
    on_disk = json.loads((out / REPORT_FILE).read_text())
    assert on_disk["format"] == report["format"] == "aerie.demo-target/1"
    for key in (
        "heldout_loss",
        "accuracy",
        "end_of_turn_rate",
        "repeated_4gram_rate",
        "mean_generated_tokens",
        "decode_latency_ms",
    ):
        assert key in report["metrics"]
    assert report["config"] == dataclasses.asdict(TINY) and report["train"]["steps"] == 20

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end == tok.eos_token_id
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    text = tok.apply_chat_template(
        [{"role": "user", "content": generate_prompts(["arith"], 1, 0)[0]["user"]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    gen = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > ids.shape[1]

    # rebuilding replaces the folder atomically
    build_demo_target(out, dataclasses.replace(TINY, train_steps=2), log=lambda _: None)
    assert json.loads((out / REPORT_FILE).read_text())["train"]["steps"] == 2
