"""Stages 1-5a on a tiny random target: prompts, responses, tokens + loss masks, hidden states, vocab."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_world import save_tiny_llama_target
from transformers import AutoModelForCausalLM

from aerie.formats.hidden import HIDDEN_FORMAT
from aerie.formats.tokens import TOKENS_FORMAT
from aerie.formats.vocab import load_draft_vocab
from aerie.hidden.checks import HiddenStateError, check_captured
from aerie.hidden.settings import CaptureSettings
from aerie.hidden.shard import capture_shard
from aerie.responses.in_process import generate_hf
from aerie.responses.sampling import Sampling
from aerie.sources.datasets import PromptSourceError, plan_dataset, read_prompts, write_prompts
from aerie.target_model.chat import read_chat_format, special_token_id, split_generated
from aerie.target_model.config import default_aux_layer_ids, resolve_aux_layer_ids
from aerie.tokens.rebuild import rebuild_output_ids
from aerie.tokens.settings import TokenSettings
from aerie.tokens.stage import tokenize_shard
from aerie.tools.artifacts import FormatError, load_packed, read_jsonl, split_packed, write_jsonl
from aerie.vocab.draft_vocab import build_draft_vocab, select_draft_vocab


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A random 6-layer Llama + a Kimi-style tokenizer, saved like a real target."""
    return save_tiny_llama_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def tok(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


SYNTH = {
    "source": {"kind": "synthetic", "families": ["arith", "lists"], "count": 9, "seed": 3},
    "shard_size": 4,
    "bench_prompts": 2,
}


def test_plan_and_write_prompts(tmp_path: Path) -> None:
    plan = plan_dataset("tasks", SYNTH)
    assert (plan.total, plan.train, plan.bench, plan.num_shards) == (9, 7, 2, 2)
    assert plan.shard_range(1) == (4, 7) and plan.bench_range() == (7, 9)
    out = tmp_path / "shard-00001.jsonl"
    assert write_prompts("tasks", SYNTH, 4, 7, out) == 3
    recs = read_prompts(out)
    assert [r["id"].split("/")[0] for r in recs] == ["tasks"] * 3
    bench = tmp_path / "bench.jsonl"
    write_prompts("tasks", SYNTH, 7, 9, bench)
    # Benchmark prompts never overlap training shards; generation is deterministic from the seed.
    assert not {r["id"] for r in recs} & {r["id"] for r in read_prompts(bench)}
    write_prompts("tasks", SYNTH, 4, 7, tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()


def test_jsonl_source_system_prompt_and_duplicates(tmp_path: Path) -> None:
    src = tmp_path / "p.jsonl"
    src.write_text('{"id": 1, "turns": ["first", "second"]}\n\n{"id": 2, "turns": ["again"]}\n')
    ds = {
        "source": {"kind": "jsonl", "path": str(src), "text_field": "turns", "id_field": "id"},
        "shard_size": 10,
        "bench_prompts": 0,
        "system_prompt": "Be brief.",
    }
    write_prompts("mt", ds, 0, 2, tmp_path / "out.jsonl")
    recs = read_prompts(tmp_path / "out.jsonl")
    assert recs[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"}]
    assert recs[1]["source"]["line"] == 3
    src.write_text('{"id": 1, "turns": ["a"]}\n{"id": 1, "turns": ["b"]}\n')
    with pytest.raises(PromptSourceError, match="duplicate prompt id '1'"):
        plan_dataset("mt", ds)


def test_read_prompts_refuses_other_formats(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"format": "aerie.responses/1", "id": "a"}\n')
    with pytest.raises(FormatError, match="x.jsonl:1"):
        read_prompts(p)


def test_split_generated(tok) -> None:
    fmt = read_chat_format(tok)
    think_end = special_token_id(tok, "</think>")
    eot = special_token_id(tok, "<|im_end|>")
    assert (fmt.think_end_id, fmt.turn_end_id) == (think_end, eot)
    ids = tok.encode("a b", add_special_tokens=False) + [think_end] + tok.encode("c", add_special_tokens=False) + [eot]
    r = split_generated(tok, ids, fmt)
    assert r == {"reasoning": "a b", "content": "c", "finish_reason": "stop"}
    r = split_generated(tok, ids[:-1], fmt)
    assert r["finish_reason"] == "length"
    r = split_generated(tok, tok.encode("no think", add_special_tokens=False) + [eot], fmt)
    assert r["reasoning"] is None and r["content"] == "no think"


def test_rebuild_turns_tool_markers_into_special_ids(tok) -> None:
    fmt = read_chat_format(tok)
    think_end = special_token_id(tok, "</think>")
    eot = special_token_id(tok, "<|im_end|>")
    content = (
        "ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    prompt = [special_token_id(tok, "<think>")]  # the demo template's generation prompt opens the think block
    ids = rebuild_output_ids(tok, fmt, prompt, "think", content)
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>"):
        assert special_token_id(tok, marker) in ids
    assert ids[-1] == eot and think_end in ids
    assert tok.decode(ids, skip_special_tokens=False) == "think</think>" + content + "<|im_end|>"


@pytest.fixture(scope="module")
def pipeline_dir(tiny_target, tmp_path_factory) -> dict[str, Path]:
    """Prompts -> responses -> tokens -> hidden on the tiny target (shared by the tests below)."""
    d = tmp_path_factory.mktemp("pipe")
    paths = {
        k: d / f"{k}.{ext}"
        for k, ext in [
            ("prompts", "jsonl"),
            ("responses", "jsonl"),
            ("tokens", "safetensors"),
            ("report", "json"),
            ("hidden", "safetensors"),
        ]
    }
    write_prompts("tasks", SYNTH, 0, 4, paths["prompts"])
    summary = generate_hf(
        paths["prompts"],
        paths["responses"],
        str(tiny_target),
        Sampling(temperature=0.0, top_p=1.0, max_new_tokens=12, batch_size=3, seed=0),
        threads=1,
        log=lambda m: None,
    )
    assert summary["samples"] == 4
    tokenize_shard(
        paths["responses"],
        paths["tokens"],
        paths["report"],
        str(tiny_target),
        TokenSettings(max_seq_len=4096, drop_truncated=False),
        log=lambda m: None,
    )
    capture_shard(
        paths["tokens"],
        paths["hidden"],
        str(tiny_target),
        CaptureSettings(
            aux_layer_ids=[1, 3, 4],
            batch_tokens=64,
            layout="full",
            storage_dtype="float32",
            threads=1,
            min_next_token_agreement=0.99,
        ),
        log=lambda m: None,
    )
    return paths


def test_responses_keep_exact_ids_matching_unbatched_greedy(pipeline_dir, tiny_target, tok) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    for r in read_jsonl(pipeline_dir["responses"]):
        prompt = torch.tensor([r["prompt_token_ids"]])
        with torch.no_grad():
            ref = model.generate(
                prompt, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
            )[0, prompt.shape[1] :].tolist()
        # Left-padded batched greedy decoding reproduces the unbatched sequence.
        assert r["output_token_ids"] == ref[: len(r["output_token_ids"])]
        assert r["params_hash"] and r["usage"]["completion_tokens"] == len(r["output_token_ids"])


def test_tokens_loss_mask_is_exactly_the_generated_part(pipeline_dir, tok) -> None:
    t, meta = load_packed(pipeline_dir["tokens"], TOKENS_FORMAT)
    responses = read_jsonl(pipeline_dir["responses"])
    assert meta["sample_ids"] == [r["id"] for r in responses]
    seqs = split_packed(t["input_ids"], t["seq_offsets"])
    masks = split_packed(t["loss_mask"], t["seq_offsets"])
    for r, ids, mask in zip(responses, seqs, masks):
        assert ids.tolist() == r["prompt_token_ids"] + r["output_token_ids"]
        assert mask.tolist() == [0] * len(r["prompt_token_ids"]) + [1] * len(r["output_token_ids"])
        # The prompt ends with the generation prompt's <think>, which belongs to the prompt.
        assert r["prompt_token_ids"][-1] == special_token_id(tok, "<think>")
    report = json.loads(pipeline_dir["report"].read_text())
    assert report["kept"] == 4 and report["exact_ids_available"] == 4
    assert report["generated_tokens"] == int(t["loss_mask"].sum())


def test_tokens_refuse_changed_template_and_missing_fields(pipeline_dir, tiny_target, tmp_path) -> None:
    recs = read_jsonl(pipeline_dir["responses"])
    recs[1]["prompt_token_ids"] = recs[1]["prompt_token_ids"][1:]
    write_jsonl(tmp_path / "r.jsonl", recs)
    with pytest.raises(FormatError, match=r"r.jsonl:2: prompt ids recorded"):
        tokenize_shard(
            tmp_path / "r.jsonl",
            tmp_path / "t.safetensors",
            tmp_path / "t.json",
            str(tiny_target),
            TokenSettings(max_seq_len=4096, drop_truncated=False),
            log=lambda m: None,
        )
    recs = read_jsonl(pipeline_dir["responses"])
    del recs[2]["content"]
    write_jsonl(tmp_path / "r.jsonl", recs)
    with pytest.raises(FormatError, match=r"r.jsonl:3: missing field 'content'"):
        tokenize_shard(
            tmp_path / "r.jsonl",
            tmp_path / "t.safetensors",
            tmp_path / "t.json",
            str(tiny_target),
            TokenSettings(max_seq_len=4096, drop_truncated=False),
            log=lambda m: None,
        )
    assert not (tmp_path / "t.safetensors").exists()


def test_tokens_drop_truncated_and_overlong(pipeline_dir, tiny_target, tok, tmp_path) -> None:
    recs = read_jsonl(pipeline_dir["responses"])
    eot = special_token_id(tok, "<|im_end|>")
    for i, r in enumerate(recs):  # make samples 1..3 finished turns of different lengths
        if i:
            r["output_token_ids"] = r["output_token_ids"][: 2 + 2 * i] + [eot]
            r["finish_reason"] = "stop"
        else:
            r["finish_reason"] = "length"
    write_jsonl(tmp_path / "r.jsonl", recs)
    shortest = min(len(r["prompt_token_ids"]) + len(r["output_token_ids"]) for r in recs[1:])
    report = tokenize_shard(
        tmp_path / "r.jsonl",
        tmp_path / "t.safetensors",
        tmp_path / "t.json",
        str(tiny_target),
        TokenSettings(max_seq_len=shortest, overlong="drop", drop_truncated=True, max_dropped_fraction=1.0),
        log=lambda m: None,
    )
    assert report["dropped"]["truncated_response"] == 1
    assert report["dropped"]["over_max_seq_len"] == 2 and report["kept"] == 1


def test_hidden_states_follow_sglang_layer_convention(pipeline_dir, tiny_target) -> None:
    t, meta = load_packed(pipeline_dir["hidden"], HIDDEN_FORMAT)
    assert meta["aux_layer_ids"] == [1, 3, 4]
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    for ids, aux, final in zip(
        split_packed(t["input_ids"], t["seq_offsets"]),
        split_packed(t["aux_hidden_states"], t["seq_offsets"]),
        split_packed(t["final_hidden_states"], t["seq_offsets"]),
    ):
        with torch.no_grad():
            out = model(ids[None].long(), output_hidden_states=True)
        ref = torch.cat([out.hidden_states[i + 1][0] for i in meta["aux_layer_ids"]], dim=-1)
        torch.testing.assert_close(aux, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, out.hidden_states[-1][0], atol=1e-5, rtol=1e-5)
    assert meta["next_token_agreement"] >= 0.99


def test_default_aux_layers_match_sglang() -> None:
    assert default_aux_layer_ids(61) == [1, 29, 57]  # Kimi K2.5: layer inputs 2, 30, 58 in SGLang
    assert default_aux_layer_ids(8) == [1, 3, 4]
    with pytest.raises(ValueError, match="duplicates"):
        resolve_aux_layer_ids(None, 6)  # SGLang's default collapses for shallow targets: must be set


def test_planted_capture_failures_are_refused() -> None:
    torch.manual_seed(0)
    aux, final = torch.randn(10, 3 * 8), torch.randn(10, 8)
    check_captured(aux, final, [1, 2, 3], "ok")
    zeros = aux.clone()
    zeros[:, 8:16] = 0
    with pytest.raises(HiddenStateError, match="aux layer 2 is all zeros"):
        check_captured(zeros, final, [1, 2, 3], "s")
    same = aux.clone()
    same[:, 16:24] = same[:, 0:8]
    with pytest.raises(HiddenStateError, match="aux layers 1 and 3 are identical"):
        check_captured(same, final, [1, 2, 3], "s")
    const = aux.clone()
    const[:, 0:8] = 1.5
    with pytest.raises(HiddenStateError, match="aux layer 1 is constant"):
        check_captured(const, final, [1, 2, 3], "s")
    nan = final.clone()
    nan[3, 2] = float("nan")
    with pytest.raises(HiddenStateError, match="final_hidden_states contain NaN or inf"):
        check_captured(aux, nan, [1, 2, 3], "s")
    for bad in (float("nan"), float("inf"), -float("inf")):
        planted = aux.clone()
        planted[4, 8 + 3] = bad  # aux layer 2, one channel of one token
        with pytest.raises(HiddenStateError, match=r"aux layer 2 contain NaN or inf .*first at position 4"):
            check_captured(planted, final, [1, 2, 3], "s")


def test_states_from_another_target_fail_the_agreement_check(pipeline_dir, tiny_target, tok, tmp_path) -> None:
    """Tokens generated by one model, states captured from another: lm_head no longer predicts the tokens."""
    other = tmp_path / "other-target"
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(HiddenStateError, match="reproduces only"):
        capture_shard(
            pipeline_dir["tokens"],
            tmp_path / "h.safetensors",
            str(other),
            CaptureSettings(aux_layer_ids=[1, 3, 4], threads=1, min_next_token_agreement=0.9),
            log=lambda m: None,
        )
    assert not (tmp_path / "h.safetensors").exists()


def test_draft_vocab_semantics(pipeline_dir, tmp_path) -> None:
    counts = torch.tensor([0, 5, 1, 5, 0, 9, 2, 0])
    chosen, d2t, t2d = select_draft_vocab(counts, 4)
    assert chosen.tolist() == [1, 3, 5, 6]  # top counts, ties by lower id, ordered by id
    assert (torch.arange(4) + d2t).tolist() == chosen.tolist()  # SGLang: target = draft + d2t[draft]
    assert t2d.nonzero().flatten().tolist() == chosen.tolist()
    chosen, d2t, t2d = select_draft_vocab(counts, 100)  # capped at the target vocabulary
    assert chosen.numel() == 8 and bool(t2d.all())
    meta = build_draft_vocab(
        [pipeline_dir["tokens"]],
        tmp_path / "v.safetensors",
        target_vocab_size=400,
        draft_vocab_size=50,
        log=lambda m: None,
    )
    vocab = load_draft_vocab(tmp_path / "v.safetensors")
    d2t, t2d = vocab.d2t, vocab.t2d
    assert vocab.meta["draft_vocab_size"] == d2t.numel() == 50 and int(t2d.sum()) == 50
    assert 0 < meta["coverage"] <= 1
