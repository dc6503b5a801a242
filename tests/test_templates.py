"""The tokens stage on the published chat templates of every major family (issue 13).

For each family (tests/template_families.py: the template as published, a real 128k BPE carrying the family's
special tokens, text-only API records), every record the template can express is rebuilt id for id as the
template renders it, and every other record is refused or falls back with the counted reason the family's
template behaviour calls for. The expected ids are computed here from the template's own render with
transformers' `apply_chat_template` + `encode` (not with the stage's code), and the basic record's text is
also checked against the family's documented format.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from template_families import EXPECTED, FAMILIES, Family, family_records, family_tokenizer

from aerie.formats.tokens import TOKENS_FORMAT, FidelityError, read_tokens_shard
from aerie.target_model.markers import check_template_markers
from aerie.target_model.template import ChatTemplateError
from aerie.target_model.turns import TurnRefused, render_turn
from aerie.tokens.settings import TokenSettings
from aerie.tokens.stage import tokenize_shard
from aerie.tools.artifacts import split_packed, write_jsonl

# The token that ends each family's answer turn (its documented format); GLM writes none: the model stops
# on the next turn's opener, <|user|> (or <|observation|> after tool calls).
TURN_END = {
    "Kimi K2-Thinking": "<|im_end|>",
    "Kimi K3": "<|end_of_msg|>",
    "Qwen3": "<|im_end|>",
    "GLM 4.6": "<|user|>",
    "MiniMax M2": "[e~[",
    "gpt-oss": "<|return|>",
    "Llama 3.1 (no reasoning)": "<|eot_id|>",
    "Nemotron Nano v2": "<SPECIAL_12>",
    "Seed-OSS": "<seed:eos>",
    "Gemma 4 (thinking)": "<turn|>",
    "Gemma 4 (non-thinking)": "<turn|>",
}
TOOL_CALL_END = {
    "gpt-oss": "<|call|>",
    "GLM 4.6": "<|observation|>",
    "Gemma 4 (thinking)": "<|tool_response>",
    "Gemma 4 (non-thinking)": "<|tool_response>",
}
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"
# What the model itself writes after its prompt, where the template cannot render the turn as the model wrote it
# (fallback "reasoning_markers"), from DeepSeek's documented formats: V3.1 in thinking mode is prompted up to
# `<｜Assistant｜><think>` and writes `reasoning</think>content<｜end▁of▁sentence｜>` (tool calls in place of the
# content); V3.2 in chat mode is prompted up to `<｜Assistant｜><think></think>` and writes
# `content<｜end▁of▁sentence｜>`.
# DeepSeek-R1-Distill is prompted up to `<｜Assistant｜><think>\n` and writes `reasoning</think>content<eos>` (its model
# card); Gemma 4 writes its thought channel `<|channel>thought\n...<channel|>` before the answer and ends with
# `<turn|>`, or only the answer after a prompt that emptied the channel (its template trims the answer); MiniMax M2's
# `<think>\nR\n</think>\n\nC[e~[` with the prompt holding `<think>\n`; Nemotron Nano v2 closes the prompt's `<think>\n`
# with `</think>` before its `<TOOLCALL>[...]</TOOLCALL>` (its model card).
MODEL_WRITES = {
    "DeepSeek V3.1 (thinking)": lambda rec, calls: f"{rec['reasoning']}</think>{rec['content']}{calls}{DEEPSEEK_EOS}",
    "DeepSeek V3.2 (non-thinking)": lambda rec, calls: f"{rec['content']}{DEEPSEEK_EOS}",
    "DeepSeek R1-Distill": lambda rec, calls: f"{rec['reasoning']}</think>{rec['content']}{DEEPSEEK_EOS}",
    "Gemma 4 (thinking)": lambda rec, calls: (
        f"<|channel>thought\n{rec['reasoning']}\n<channel|>{rec['content'].strip()}<turn|>"
    ),
    "Gemma 4 (non-thinking)": lambda rec, calls: f"{rec['content'].strip()}<turn|>",
    "MiniMax M2": lambda rec, calls: f"{rec['reasoning']}\n</think>\n\n{rec['content']}[e~[",
    "Nemotron Nano v2": lambda rec, calls: (
        f"{rec['reasoning']}</think><TOOLCALL>{nemotron_calls(rec)}</TOOLCALL><SPECIAL_12>"
    ),
}


SETTING_KEYS = set(TokenSettings.__dataclass_fields__)  # tokens.* keys a test passes by name


def nemotron_calls(rec: dict) -> str:
    calls = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in rec.get("tool_calls") or []
    ]
    return json.dumps(calls)


def deepseek_v31_calls(rec: dict) -> str:
    """V3.1's documented tool-call block (its model card): name, then the arguments as the model wrote them."""
    calls = "".join(
        f"<｜tool▁call▁begin｜>{c['function']['name']}<｜tool▁sep｜>{c['function']['arguments']}<｜tool▁call▁end｜>"
        for c in rec.get("tool_calls") or []
    )
    return f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>" if calls else ""


# Git blob ids of the published files the fixtures are copied from (tests/fixtures/templates/README.md names the
# repository, commit and path of each): a fixture that an editor re-saved (a trailing newline, CRLF) or that
# someone retyped no longer matches, and no longer proves anything about the published template.
UPSTREAM_BLOBS = {
    "DeepSeek-V3.2.jinja": "98d56589f0ede0b6e925007f9c68264bae9cff27",
    "GLM-4.6.jinja": "4a09db53c8ade84034d943e4ca36d89f16f938e8",
    "NVIDIA-Nemotron-Nano-v2.jinja": "c8ab5848300b99891fec60877fefabd071b562c0",
    "Kimi-K3.jinja": "48de47fc9029bf1d2bd611de8613c79f4a3b80ea",
    "MiniMax-M2.jinja": "9302ccedb217e95fcdbf55b6cfda952420d82875",
    "Qwen-Qwen3-0.6B.jinja": "699ff8df401fe4788525e9c1f9b86a99eadd6230",
    "deepseek-ai-DeepSeek-V3.1.jinja": "e5656196a3f0f379499b2a3aee8805332cd297ea",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "33089ace1be88f22a10fe861ad49718d5d886090",
    "openai-gpt-oss-120b.jinja": "dc7bb11927d29f653ba2740f2db2c688fd77592f",
    "ByteDance-Seed-OSS.jinja": "903ebaaba77ed311bab4892f6a14324283852427",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "c2066bd7391c270626e39c9d7124f00360126412",
    "google-gemma-4-31B-it.jinja": "98da08eb6be6f7a353d390456a6c4cacf811c9ed",
    # ggml-org/llama.cpp's text, not checked against a git object (see the README); pinned against drift
    "moonshotai-Kimi-K2-Thinking.jinja": "26f99b7d19f7453ab3840fea8b9bb7177a53bc35",
}


def test_fixtures_are_the_published_bytes() -> None:
    folder = Path(__file__).parent / "fixtures" / "templates"
    assert {f.template for f in FAMILIES} <= set(UPSTREAM_BLOBS)
    for name, blob in UPSTREAM_BLOBS.items():
        data = (folder / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for fam in FAMILIES:
        out[fam.name] = root / fam.name.replace(" ", "_").replace("(", "").replace(")", "")
        family_tokenizer(fam, out[fam.name])
    return out


@pytest.fixture(scope="module")
def loaded(targets):
    """name -> the family's tokenizer, loaded from its target folder once per module (a 10 MB tokenizer.json)."""
    from aerie.target_model.model import load_tokenizer

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_tokenizer(targets[name])
        return cache[name]

    return get


def _dict_args(calls):
    return [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in calls]


def expected_generated(tok, fam: Family, rec: dict) -> list[int]:
    """The ids the template renders for the record's turn after its prompt, cut after the turn's end."""
    messages = [{**m, "tool_calls": _dict_args(m["tool_calls"])} if m.get("tool_calls") else m for m in rec["messages"]]
    kw = {**fam.kwargs, **({"tools": rec["tools"]} if rec.get("tools") else {})}
    turn = {"role": "assistant", "content": rec["content"]}
    if rec["reasoning"] is not None:
        turn["reasoning_content"] = turn["thinking"] = rec["reasoning"]
    if rec.get("tool_calls"):
        turn["tool_calls"] = _dict_args(rec["tool_calls"])
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    full = tok.apply_chat_template(messages + [turn], tokenize=False, add_generation_prompt=False, **kw)
    assert full.startswith(prompt), "the template's render of the turn does not begin with its prompt"
    # Encoded apart from the prompt, as a server does: MiniMax's prompt ends '<think>\n', and a reasoning that
    # starts with '\n' would merge with it into one '\n\n' token in a single encode of the whole text.
    gen = tok.encode(full[len(prompt) :], add_special_tokens=False)
    end = TOOL_CALL_END.get(fam.name) if rec.get("tool_calls") else None
    end_id = tok.convert_tokens_to_ids(end or TURN_END.get(fam.name, DEEPSEEK_EOS))
    if end_id in gen:
        return gen[: len(gen) - gen[::-1].index(end_id)]
    # GLM writes no end (the model stops on the next turn's opener); Seed-OSS writes its end only after content.
    assert fam.name == "GLM 4.6" or rec["id"] in EXPECTED[fam.name].get("added_turn_end", []), fam.name
    return gen + [end_id]


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_rebuild_is_the_templates_own_rendering(fam: Family, targets, loaded, tmp_path) -> None:
    tok = loaded(fam.name)
    records = family_records(fam)
    expected = EXPECTED[fam.name]
    refused_as = {rid: reason for reason, ids in expected.get("refused", {}).items() for rid in ids}
    fallback = set(expected.get("fallback", []))
    # Record by record: the path render_turn takes is the one the family's template behaviour calls for.
    for rec in records:
        kwargs = (rec.get("params") or {}).get("chat_template_kwargs") or {}
        try:
            turn = render_turn(
                tok, rec["messages"], rec["reasoning"], rec["content"], rec.get("tool_calls"), rec.get("tools"), kwargs
            )
            path = turn.path
        except TurnRefused as refused:
            path = f"refused:{refused.reason}"
            assert len(str(refused)) > 60  # the message names the template behaviour
        want = (
            f"refused:{refused_as[rec['id']]}"
            if rec["id"] in refused_as
            else ("fallback" if rec["id"] in fallback else "exact")
        )
        assert path == want, rec["id"]

    write_jsonl(tmp_path / "r.jsonl", records)
    try:
        report = tokenize_shard(
            tmp_path / "r.jsonl",
            tmp_path / "t.safetensors",
            tmp_path / "t.json",
            str(targets[fam.name]),
            TokenSettings(max_seq_len=1 << 20, max_dropped_fraction=1.0),
            reasoning_requested=False,
            log=lambda m: None,
            tokenizer=tok,
        )
    except FidelityError as err:  # every record refused: the shard is refused, with the counts
        assert not set(r["id"] for r in records) - set(refused_as), "a record the template expresses was lost"
        report = err.report
        assert "the chat template cannot express these turns" in str(err)
    n_refused = len(refused_as)
    assert report["rebuild_paths"] == {
        "exact": len(records) - n_refused - len(fallback),
        "fallback": len(fallback),
        "refused": n_refused,
    }
    assert report["dropped"] == {r: len(ids) for r, ids in expected.get("refused", {}).items()}
    if n_refused == len(records):
        return
    assert report["mismatch_classes"]["template_normalised"] == len(expected.get("normalised", []))
    assert [m["id"] for m in report["mismatches"]] == expected.get("normalised", [])
    tensors, meta = read_tokens_shard(tmp_path / "t.safetensors")  # the per-record mask facts check out
    by_id = {rec["id"]: rec for rec in records}
    for sid, ids, prompt_len in zip(
        meta["sample_ids"], split_packed(tensors["input_ids"], tensors["seq_offsets"]), meta["prompt_lengths"]
    ):
        generated = ids.tolist()[prompt_len:]
        if sid not in fallback:
            assert generated == expected_generated(tok, fam, by_id[sid]), sid
        elif fam.name in MODEL_WRITES:  # the reasoning-markers fallback: exactly what the model writes
            text = MODEL_WRITES[fam.name](by_id[sid], deepseek_v31_calls(by_id[sid]))
            assert generated == tok.encode(text, add_special_tokens=False), (sid, text)
        if sid == "basic" and fam.basic is not None:
            assert tok.decode(generated, skip_special_tokens=False) == fam.basic
    if fallback:
        default = "reasoning_markers" if fam.name in MODEL_WRITES else "tool_call_turn_framing"
        assert report["fallback_reasons"] == {expected.get("fallback_reason", default): len(fallback)}
    # A stop token the template does not write after the turn is added only where the model stops on it, counted.
    added = {"turn_end": len(expected["added_turn_end"])} if expected.get("added_turn_end") else {}
    assert report["added_turn_ends"] == ({"next_turn_opener": report["kept"]} if fam.name == "GLM 4.6" else added)


def test_each_record_has_its_own_generation_prompt(targets, tmp_path) -> None:
    """DeepSeek V3.1 adds no generation prompt after a tool result; a shard mixing such records with others
    is written, each sequence checked against its own prompt (one shard-wide prompt refused it before)."""
    fam = next(f for f in FAMILIES if f.name == "DeepSeek V3.1 (non-thinking)")
    recs = {r["id"]: r for r in family_records(fam)}
    after_tool = {**recs["after_tool"], "reasoning": None}
    write_jsonl(tmp_path / "r.jsonl", [recs["missing_reasoning"], after_tool])
    report = tokenize_shard(
        tmp_path / "r.jsonl",
        tmp_path / "t.safetensors",
        tmp_path / "t.json",
        str(targets[fam.name]),
        TokenSettings(max_seq_len=1 << 20),
        log=lambda m: None,
    )
    _, meta = read_tokens_shard(tmp_path / "t.safetensors")
    assert meta["format"] == TOKENS_FORMAT and report["kept"] == 2
    prompts = [meta["generation_prompts"][k] for k in meta["generation_prompt_index"]]
    assert len(prompts[0]) == 2 and prompts[1] == []  # <｜Assistant｜></think>, then none after the tool result
    assert meta["generation_prompt_ids"] == []  # no shard-wide prompt for /2 readers to check


def test_template_errors_name_the_feature_the_file_and_what_to_do(tmp_path) -> None:
    fam = next(f for f in FAMILIES if f.name == "Qwen3")
    tok = family_tokenizer(fam, tmp_path / "t")
    msgs = [{"role": "user", "content": "hi"}]
    tok.chat_template = "{% set ns = namespace(x=[]) %}{% set _ = ns.x.append(1) %}{{ messages[0].content }}"
    with pytest.raises(ChatTemplateError, match=r"uses `list.append`.*sandboxed.*\{% set ns.items = ns.items"):
        render_turn(tok, msgs, None, "yo")
    tok.chat_template = "{{ messages[0].content | fromjson }}"
    with pytest.raises(ChatTemplateError, match=r"filter `fromjson`.*Replace it with plain Jinja"):
        render_turn(tok, msgs, None, "yo")
    with pytest.raises(ChatTemplateError, match=r"chat_template.jinja or tokenizer_config.json"):
        render_turn(tok, msgs, None, "yo")


def test_shard_does_not_depend_on_how_records_are_chunked(targets, tmp_path, monkeypatch) -> None:
    """The stage renders one chunk of records while a worker thread encodes the previous one: every chunking
    (one record a chunk, a few, the whole shard) writes the same bytes and report, and the batch encode is
    what the rebuild uses (each kept record's prompt and turn go through it)."""
    from aerie.target_model.text_encoder import TextEncoder

    real_many, real_encode = TextEncoder.encode_many, TextEncoder.encode
    batches: list[list[str]] = []
    missed: list[str] = []  # batch-encoded texts the rebuild encoded again instead of taking the batch's ids

    def counted(self, texts):
        batches.append(list(texts))
        return real_many(self, batches[-1])

    def encode(self, text):
        if text not in self._known and any(text in b for b in batches):
            missed.append(text)
        return real_encode(self, text)

    monkeypatch.setattr(TextEncoder, "encode_many", counted)
    monkeypatch.setattr(TextEncoder, "encode", encode)
    for name in ("Kimi K2-Thinking", "DeepSeek V3.1 (thinking)", "GLM 4.6", "gpt-oss"):
        fam = next(f for f in FAMILIES if f.name == name)
        records = family_records(fam)
        # Dropped before rendering, in the middle: no render, no encode, same counts.
        records.insert(2, {**records[0], "id": "cut", "finish_reason": "length"})
        outputs = []
        for chunk_chars in (1, 200, 1 << 20):
            batches.clear()
            out = tmp_path / f"{name.replace(' ', '_')}-{chunk_chars}"
            out.mkdir()
            write_jsonl(out / "r.jsonl", records)
            report = tokenize_shard(
                out / "r.jsonl",
                out / "t.safetensors",
                out / "t.json",
                str(targets[name]),
                TokenSettings(max_seq_len=1 << 20, max_dropped_fraction=1.0),
                log=lambda m: None,
                chunk_chars=chunk_chars,
            )
            outputs.append(((out / "t.safetensors").read_bytes(), (out / "t.json").read_text()))
            encoded = {t for b in batches for t in b}
            assert report["kept"] > 0 and len(encoded) >= report["kept"], (name, chunk_chars)
            assert not missed, (name, chunk_chars, missed[:1])
            if chunk_chars == 1:
                assert len(batches) == len(records), name  # one chunk a record
            elif chunk_chars == 1 << 20:
                assert len(batches) == 1, name
        assert all(o == outputs[0] for o in outputs[1:]), name


def run_family(target: Path, records: list[dict], tmp_path: Path, **kw) -> tuple[dict, dict]:
    """(report, {sample id: generated ids}) of the tokens stage on ``records``."""
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
    tensors, meta = read_tokens_shard(tmp_path / "t.safetensors")
    seqs = split_packed(tensors["input_ids"], tensors["seq_offsets"])
    return report, {sid: s.tolist()[n:] for sid, s, n in zip(meta["sample_ids"], seqs, meta["prompt_lengths"])}


@pytest.mark.parametrize("name", ["Kimi K2-Thinking", "Kimi K3", "Qwen3", "DeepSeek V3.2 (thinking)"])
def test_missing_reasoning_is_dropped_per_provider_where_the_template_trains_it_as_empty(
    name: str, targets, loaded, tmp_path
) -> None:
    """On these templates a turn without reasoning renders the same whether the reasoning is empty or missing, so
    a provider that strips the trace would train "the model did not think": with reasoning requested (the
    default) the missing one is dropped and counted for its provider; the empty one is what the model wrote."""
    fam = next(f for f in FAMILIES if f.name == name)
    tok = loaded(name)
    recs = {r["id"]: r for r in family_records(fam)}
    records = [
        {**recs["basic"], "provider": "A"},
        {**recs["empty_reasoning"], "provider": "A"},
        {**recs["missing_reasoning"], "provider": "B"},
    ]
    report, generated = run_family(targets[name], records, tmp_path, max_dropped_fraction=0.5, tokenizer=tok)
    assert report["dropped"] == {"no_reasoning": 1} and report["drop_examples"] == {
        "no_reasoning": ["missing_reasoning"]
    }
    assert report["providers"]["B"]["dropped_reasons"] == {"no_reasoning": 1}
    assert report["providers"]["B"]["no_reasoning_rate"] == 1.0 and report["providers"]["A"]["no_reasoning_rate"] == 0
    assert generated["empty_reasoning"] == expected_generated(tok, fam, recs["empty_reasoning"])
    # Kept on request, it trains what the template renders: the same ids as the empty one (why it is dropped).
    kept, generated = run_family(targets[name], records, tmp_path, keep_missing_reasoning=True, tokenizer=tok)
    assert kept["dropped"] == {} and generated["missing_reasoning"] == generated["empty_reasoning"]


def test_a_finished_turn_inside_the_open_reasoning_block_is_refused(targets, loaded, tmp_path) -> None:
    """NVIDIA Nemotron Nano v2: the generation prompt ends `<think>\\n` and the finished turn repeats it with the
    answer after it and no `</think>`. No fallback or prefix check sees it (the finished turn does begin with the
    prompt); the reasoning-block check on the template's own text does. With thinking off (`/no_think`: the
    prompt closes the block) the same record is what the model writes and is rebuilt as the template renders it."""
    fam = next(f for f in FAMILIES if f.name == "Nemotron Nano v2")
    tok = loaded(fam.name)
    recs = {r["id"]: r for r in family_records(fam)}
    no_think = {
        **recs["missing_reasoning"],
        "id": "no_think",
        "messages": [{"role": "system", "content": "/no_think"}, *recs["missing_reasoning"]["messages"]],
    }
    records = [recs["empty_reasoning"], recs["missing_reasoning"], no_think]
    report, generated = run_family(
        targets[fam.name], records, tmp_path, reasoning_requested=False, max_dropped_fraction=1.0, tokenizer=tok
    )
    assert report["dropped"] == {"reasoning_block_unclosed": 2} and report["rebuild_paths"]["refused"] == 2
    assert "repeats the open block" in report["refusal_messages"]["reasoning_block_unclosed"]
    assert list(generated) == ["no_think"] and generated["no_think"] == expected_generated(tok, fam, no_think)
    assert tok.decode(generated["no_think"], skip_special_tokens=False) == "Paris.\n<SPECIAL_12>"
    turn = render_turn(tok, no_think["messages"], None, "Paris.")
    assert turn.generation_prompt.endswith("<think></think>")


def test_no_kept_record_trains_a_stop_token_before_its_end(targets, loaded, tmp_path) -> None:
    """An R1-Distill-shaped template that renders an assistant turn's tool calls, closed with the end of the sentence,
    and then its text as a second assistant segment: ``...<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜Assistant｜>Let me
    check.<｜end▁of▁sentence｜>``. The model stops at its first end of sentence; that turn is refused and counted
    (``stop_token_in_framing``), never trained with a stop token mid-sequence (issue 39); a plain answer of the same
    template is kept, its only end of sentence last."""
    import shutil

    from template_families import TOOLS, call, record

    fam = next(f for f in FAMILIES if f.name == "DeepSeek R1-Distill")
    target = tmp_path / "r1-shaped"
    shutil.copytree(targets[fam.name], target)
    template = (target / "chat_template.jinja").read_text(encoding="utf-8")
    calls_when = "{%- if message['role'] == 'assistant' and message['content'] is none %}"
    assert template.count(calls_when) == 1
    shaped = template.replace(
        calls_when, "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    )
    (target / "chat_template.jinja").write_text(shaped, encoding="utf-8")
    ask = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
    text_then_calls = record(
        "text_then_calls",
        ask,
        "Two cities: two calls.",
        "Let me check.",
        tool_calls=[call("Paris"), call("Lyon")],
        tools=TOOLS,
        finish_reason="tool_calls",
    )
    plain = [record(f"plain{i}", [{"role": "user", "content": f"Capital {i}?"}], "Easy.", "Paris.") for i in range(3)]
    report, generated = run_family(target, [*plain, text_then_calls], tmp_path, max_dropped_fraction=1.0)
    assert report["dropped"] == {"stop_token_in_framing": 1}, report["dropped"]
    assert report["drop_examples"]["stop_token_in_framing"] == ["text_then_calls"]
    eos = loaded(fam.name).convert_tokens_to_ids(DEEPSEEK_EOS)
    assert sorted(generated) == ["plain0", "plain1", "plain2"]
    assert all(ids.count(eos) == 1 and ids[-1] == eos for ids in generated.values())


def test_every_family_tokenizer_keeps_its_template_markers_one_id(targets, loaded) -> None:
    for fam in FAMILIES:
        tok = loaded(fam.name)
        markers = check_template_markers(tok, targets[fam.name])
        end = TURN_END.get(fam.name, DEEPSEEK_EOS)
        assert markers[end] == tok.convert_tokens_to_ids(end), fam.name
        writes_think = "<think>" in tok.chat_template
        assert ("<think>" in markers) == writes_think and ("</think>" in markers) == writes_think, fam.name


def test_a_turn_the_template_leaves_unended_ends_with_a_token_the_model_stops_on(targets, loaded, tmp_path) -> None:
    """Seed-OSS writes `<seed:eos>` only after non-empty content: a finished turn of reasoning alone renders no end.
    The token that opens the next turn (`<seed:bos>`) is not one the model stops on, so the turn ends with the
    template's turn end, a declared stop, counted; the shard's stop ids stay the model's. GLM writes no end at all
    and stops on the next turn's opener only because its generation_config.json says so: without that entry the
    opener is never appended, the eos is, and every such turn is counted."""
    fam = next(f for f in FAMILIES if f.name == "Seed-OSS")
    tok = loaded(fam.name)
    recs = {r["id"]: r for r in family_records(fam)}
    report, generated = run_family(targets[fam.name], [recs["basic"], recs["reasoning_only"]], tmp_path, tokenizer=tok)
    eos, bos = tok.convert_tokens_to_ids("<seed:eos>"), tok.convert_tokens_to_ids("<seed:bos>")
    assert tok.decode(generated["reasoning_only"], skip_special_tokens=False) == (
        "<seed:think>Nothing to add.</seed:think><seed:eos>"
    )
    assert report["added_turn_ends"] == {"turn_end": 1}
    _, meta = read_tokens_shard(tmp_path / "t.safetensors")
    assert eos in meta["stop_ids"] and bos not in meta["stop_ids"]

    glm = next(f for f in FAMILIES if f.name == "GLM 4.6")
    folder = tmp_path / "glm"
    tok = family_tokenizer(glm, folder)
    endoftext, user = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|user|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [endoftext]}))
    recs = {r["id"]: r for r in family_records(glm)}
    work = tmp_path / "glm-run"
    work.mkdir()
    report, generated = run_family(folder, [recs["basic"], recs["system"]], work)
    assert report["added_turn_ends"] == {"turn_end": 2}
    assert all(g[-1] == endoftext and user not in g for g in generated.values())
    _, meta = read_tokens_shard(work / "t.safetensors")
    assert user not in meta["stop_ids"]


def test_the_reasoning_frame_is_learned_from_the_template(loaded) -> None:
    """Where a template writes its reasoning frame only around reasoning, the frame comes from its own renders (no
    marker table); where the frame stays for empty reasoning (Qwen3, Kimi K2) there is none to learn."""
    from aerie.target_model.turns import learn_reasoning_framing

    gemma = learn_reasoning_framing(loaded("Gemma 4 (thinking)"), {"enable_thinking": True})
    assert (gemma.open, gemma.close) == ("<|channel>thought\n", "\n<channel|>") and gemma.after_generation_prompt
    assert gemma.generation_prompt == "<|turn>model\n"
    off = learn_reasoning_framing(loaded("Gemma 4 (non-thinking)"))  # the prompt empties the channel
    assert (off.start, off.end) == ("<|channel>thought", "<channel|>") and not off.after_generation_prompt
    seed = learn_reasoning_framing(loaded("Seed-OSS"))
    assert (seed.open, seed.close) == ("<seed:think>", "</seed:think>\n")
    oss = learn_reasoning_framing(loaded("gpt-oss"))
    assert oss.open == "<|channel|>analysis<|message|>" and oss.start.startswith("<|channel|>")
    assert (
        learn_reasoning_framing(loaded("Qwen3")) is None and learn_reasoning_framing(loaded("Kimi K2-Thinking")) is None
    )


# A template that closes the reasoning block only before an answer (as Seed-OSS writes its end only after one).
CLOSES_ONLY_BEFORE_AN_ANSWER = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}"
    "{% if m.content %}</think>\n\n{{ m.content }}{% endif %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_turn_that_ends_inside_the_open_reasoning_block_is_refused(tmp_path) -> None:
    """No answer sits inside the block, and still the text is not what the model writes: the model closes its
    reasoning before it ends its turn. A template that writes `</think>` only before an answer leaves a turn of
    reasoning alone open at its end; the same template's turn with an answer is its own."""
    tok = family_tokenizer(next(f for f in FAMILIES if f.name == "Qwen3"), tmp_path / "t")
    tok.chat_template = CLOSES_ONLY_BEFORE_AN_ANSWER
    q = [{"role": "user", "content": "What is the capital of France?"}]
    with pytest.raises(TurnRefused, match="leaves the reasoning block open.*at the end of the turn") as refused:
        render_turn(tok, q, "Nothing to add.", "")
    assert refused.value.reason == "reasoning_block_unclosed"
    turn = render_turn(tok, q, "Let me think.", "Paris.")
    assert turn.path == "exact" and turn.generated == "<think>\nLet me think.</think>\n\nParis.<|im_end|>\n"
