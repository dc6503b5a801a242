"""Responses that already exist (source.kind: recorded, aerie/sources/recorded.py): the target's own answers from a
ShareGPT dump, an OpenAI messages set or a gateway's request/response log become responses shards at $0, go through
the same token rebuild as an API's answers (exact, or refused with counted reasons), and the dry run counts them as
$0 with their token totals while the API datasets of the same run still go to rule `responses`.

The answers are the target's own: each generated part is what a model sampling canonical tokens emits (one encode
of reasoning + `</think>` + content + `<|im_end|>`, the ids kept in the log as the server's `output_ids`), so the
text rebuild must give them back id for id.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from kimi_tokenizer import KIMI_K2_THINKING_TEMPLATE, kimi_like_tokenizer

from aerie.responses.recorded import write_recorded_shard
from aerie.sources.datasets import plan_dataset, prompts_at, write_prompts
from aerie.sources.recorded import RecordedError, field, recorded_samples
from aerie.sources.tables import PromptSourceError
from aerie.tokens.settings import TokenSettings
from aerie.tokens.stage import tokenize_shard
from aerie.tools.artifacts import iter_jsonl

DATASETS = Path(__file__).parent / "fixtures" / "datasets"
SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."


@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kimi-like")
    kimi_like_tokenizer(KIMI_K2_THINKING_TEMPLATE, folder)
    return folder


@pytest.fixture(scope="module")
def tok(kimi_target):
    from aerie.target_model.model import load_tokenizer

    return load_tokenizer(kimi_target)


def questions(n: int) -> list[tuple[str, str]]:
    """(question, answer) pairs of GSM8K's test split (real text)."""
    out = []
    for _, row in iter_jsonl(DATASETS / "gsm8k_test.jsonl"):
        out.append((row["question"], row["answer"]))
        if len(out) == n:
            break
    return out


def answered(tok, question: str, reasoning: str, content: str) -> dict:
    """The target's answer as its server returns it: the text split at `</think>` and the ids it sampled (this
    template's generation prompt does not open the block: the model samples `<think>` itself)."""
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok.encode(f"<think>{reasoning}</think>{content}<|im_end|>", add_special_tokens=False)
    return {"prompt_ids": tok.encode(prompt, add_special_tokens=False), "output_ids": ids}


def write_sources(tmp: Path, tok) -> dict[str, Path]:
    pairs = questions(9)
    sharegpt, messages, log = [], [], []
    for i, (q, a) in enumerate(pairs[:3]):
        steps, final = a.rsplit("####", 1)
        sharegpt.append(
            {
                "id": f"sg{i}",
                "conversations": [
                    {"from": "system", "value": SYSTEM},
                    {"from": "human", "value": q},
                    {"from": "gpt", "value": f"<think>{steps.strip()}</think>The answer is {final.strip()}."},
                ],
            }
        )
    for q, a in pairs[3:6]:
        steps, final = a.rsplit("####", 1)
        # multi-turn: the history turn keeps its reasoning in the set; the template renders it as history
        messages.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Hello!"},
                    {"role": "assistant", "content": "Hi! How can I help?", "reasoning_content": "greet back"},
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": f"It is {final.strip()}.", "reasoning_content": steps.strip()},
                ]
            }
        )
    for i, (q, a) in enumerate(pairs[6:]):
        steps, final = a.rsplit("####", 1)
        reasoning, content = steps.strip(), f"So {final.strip()}."
        ids = answered(tok, q, reasoning, content)
        log.append(
            {
                "ts": f"2026-12-03T12:0{i}:00Z",
                "req": {
                    "body": {
                        "model": "kimi-k2.5",
                        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                    }
                },
                "resp": {
                    "status": 200,
                    "body": {
                        "id": f"chatcmpl-{i}",
                        "model": "moonshotai/Kimi-K2.5",
                        "choices": [
                            {
                                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning},
                                "finish_reason": "stop",
                            }
                        ],
                        # a gateway log keeps what the request was billed then: never this run's spend
                        "usage": {
                            "prompt_tokens": len(ids["prompt_ids"]),
                            "completion_tokens": len(ids["output_ids"]),
                            "cost": 0.0021,
                        },
                        "output_ids": ids["output_ids"],
                    },
                },
            }
        )
    # A failed request in the same log: readable, no answer - left out with a counted reason.
    log.append({"req": {"body": {"messages": [{"role": "user", "content": "x"}]}}, "resp": {"status": 500, "body": {}}})
    files = {"sharegpt": tmp / "sharegpt.jsonl", "messages": tmp / "messages.jsonl", "log": tmp / "gateway.jsonl"}
    for name, rows in (("sharegpt", sharegpt), ("messages", messages), ("log", log)):
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


GATEWAY_PATHS = {
    "messages": "req.body.messages",
    "tools": "req.body.tools",
    "message": "resp.body.choices.0.message",
    "finish_reason": "resp.body.choices.0.finish_reason",
    "usage": "resp.body.usage",
    "model": "resp.body.model",
    "id": "resp.body.id",
    "output_token_ids": "resp.body.output_ids",
}


def dataset(path: Path, shape: str, **source) -> dict:
    return {
        "source": {"kind": "recorded", "data_files": str(path), "shape": shape, **source},
        "shard_size": 100,
        "bench_prompts": 0,
    }


def test_recorded_answers_become_responses_and_rebuild_exactly(tmp_path: Path, kimi_target: Path, tok) -> None:
    files = write_sources(tmp_path, tok)
    datasets = {
        "sg": dataset(files["sharegpt"], "sharegpt", id_field="id", model="moonshotai/kimi-k2.5"),
        "msgs": dataset(files["messages"], "messages"),
        "logs": dataset(files["log"], "log", paths=GATEWAY_PATHS),
    }
    cache = tmp_path / "cache"
    reports = {}
    for name, ds in datasets.items():
        plan = plan_dataset(name, ds, datasets, cache_dir=cache)
        assert plan.train == 3, name  # the failed request is no sample
        prompts = tmp_path / name / "prompts" / "shard-00000.jsonl"
        prompts.parent.mkdir(parents=True)
        write_prompts(name, ds, 0, 3, prompts, datasets, cache_dir=cache)
        shard = tmp_path / name / "responses" / "shard-00000.jsonl"
        shard.parent.mkdir(parents=True)
        summary = write_recorded_shard(name, ds, datasets, [0, 1, 2], prompts, shard, cache, "the-target")
        assert summary["samples"] == 3 and summary["cost_usd"] == 0.0
        records = [r for _, r in iter_jsonl(shard)]
        assert all(r["backend"] == "recorded" and r["cost"] == 0.0 for r in records)
        assert all(
            r["provenance"]["kind"] == "recorded"
            and r["provenance"]["at"].startswith(str(files[ds["source"]["shape"]]))
            for r in records
        )
        # the prompt is everything before the answer: never the answer itself
        assert all(r["messages"][-1]["role"] == "user" for r in records)
        reports[name] = tokenize_shard(
            shard,
            tmp_path / name / "t.safetensors",
            tmp_path / name / "t.report.json",
            str(kimi_target),
            TokenSettings(max_seq_len=4096),
        )
    assert records[0]["model"] == "moonshotai/Kimi-K2.5" and records[0]["generation_id"] == "chatcmpl-0"
    for name, rep in reports.items():
        assert rep["kept"] == 3 and not rep["dropped"], (name, rep["dropped"])
        # Kimi-K2-Thinking renders a finished turn as history (reasoning dropped): the turn is framed as the template
        # frames a tool-call turn (fallback), never rendered without its reasoning
        assert rep["rebuild_paths"]["refused"] == 0 and rep["fallback_reasons"] == {"tool_call_turn_framing": 3}, name
        assert rep["reasoning_present"] == 3, name
    # The log carried the server's sampled ids: the text rebuild gives them back id for id, and the server's counts.
    logs = reports["logs"]
    assert logs["exact_ids_available"] == 3 and logs["retokenized_equal"] == 3
    assert logs["multi_turn"] == 0 and reports["msgs"]["multi_turn"] == 3
    # What the sharegpt sample trains on is its answer as the target generated it.
    expected = answered(tok, *_sharegpt_parts(files["sharegpt"], 0))
    ids, mask, offsets = _tensors(tmp_path / "sg" / "t.safetensors")
    seq = ids[offsets[0] : offsets[1]].tolist()
    assert seq == expected["prompt_ids"] + expected["output_ids"]
    assert mask[offsets[0] : offsets[1]].tolist() == [0] * len(expected["prompt_ids"]) + [1] * len(
        expected["output_ids"]
    )


def _tensors(path: Path):
    from aerie.formats.tokens import TOKENS_FORMAT
    from aerie.tools.artifacts import load_packed

    t, _ = load_packed(path, TOKENS_FORMAT)
    return t["input_ids"], t["loss_mask"], t["seq_offsets"]


def _sharegpt_parts(path: Path, k: int) -> tuple[str, str, str]:
    row = [r for _, r in iter_jsonl(path)][k]
    q = row["conversations"][1]["value"]
    reasoning, content = row["conversations"][2]["value"].removeprefix("<think>").split("</think>")
    return q, reasoning, content


def test_every_assistant_turn_and_the_history_trap(tmp_path: Path, kimi_target: Path) -> None:
    """turns: every gives one sample per assistant turn; the earlier turn inside the later prompt is history (the
    template drops its reasoning, as the served model saw it), while each sample's own reasoning is trained on."""
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "What is 2 + 2?"},
                    {"role": "assistant", "content": "4.", "reasoning_content": "two and two"},
                    {"role": "user", "content": "And times 3?"},
                    {"role": "assistant", "content": "12.", "reasoning_content": "four times three"},
                ]
            }
        )
        + "\n"
    )
    samples = [r for r, _ in recorded_samples("m", {"kind": "recorded", "data_files": str(path), "turns": "every"})]
    assert [s["id"] for s in samples] == ["row0/turn1", "row0/turn3"]
    assert [s["recorded"]["reasoning"] for s in samples] == ["two and two", "four times three"]
    assert samples[1]["messages"][1] == {"role": "assistant", "content": "4.", "reasoning_content": "two and two"}
    last = [r for r, _ in recorded_samples("m", {"kind": "recorded", "data_files": str(path)})]
    assert [s["id"] for s in last] == ["row0"] and last[0]["recorded"]["content"] == "12."

    ds = {
        "source": {"kind": "recorded", "data_files": str(path), "turns": "every"},
        "shard_size": 10,
        "bench_prompts": 0,
    }
    datasets = {"m": ds}
    plan_dataset("m", ds, datasets)
    prompts = tmp_path / "p.jsonl"
    write_prompts("m", ds, 0, 2, prompts, datasets)
    shard = tmp_path / "r.jsonl"
    write_recorded_shard("m", ds, datasets, [0, 1], prompts, shard, None, "t")
    rep = tokenize_shard(
        shard, tmp_path / "t.safetensors", tmp_path / "t.json", str(kimi_target), TokenSettings(max_seq_len=4096)
    )
    assert rep["kept"] == 2 and rep["rebuild_paths"]["refused"] == 0
    ids, _, offsets = _tensors(tmp_path / "t.safetensors")
    from aerie.target_model.model import load_tokenizer

    text = load_tokenizer(kimi_target).decode(ids[offsets[1] : offsets[2]].tolist(), skip_special_tokens=False)
    assert "two and two" not in text and "four times three" in text  # history reasoning dropped, its own kept


def test_unreadable_rows_name_their_line_and_other_rows_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    good = {
        "request": {"messages": [{"role": "user", "content": "q"}]},
        "response": {"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]},
    }
    rows = [
        json.dumps(good),
        json.dumps({"request": {"messages": [{"role": "user", "content": "q"}]}, "response": {"error": "boom"}}),
        json.dumps(
            {
                "request": {"messages": [{"role": "user", "content": "q"}]},
                "response": {"choices": [{"message": {"content": ""}, "finish_reason": "stop"}]},
            }
        ),
        json.dumps(
            {
                "request": {"messages": [{"role": "assistant", "content": "hi"}]},
                "response": {"choices": [{"message": {"content": "a"}}]},
            }
        ),
        "{not json",
    ]
    path.write_text("\n".join(rows) + "\n")
    source = {"kind": "recorded", "data_files": str(path), "shape": "log"}
    with pytest.raises(RecordedError, match=rf"{path}:5: not a JSON line"):
        list(recorded_samples("x", source))
    stats: Counter = Counter()
    samples = list(recorded_samples("x", {**source, "on_unreadable": "skip"}, stats))
    assert len(samples) == 1
    assert stats["skipped.no_response"] == 1 and stats["skipped.empty_answer"] == 1
    assert stats["skipped.answers_nothing"] == 1 and stats["skipped.unreadable"] == 1 and stats["rows"] == 5
    # A path that names no field of the log: the line and the missing step are named at parse time.
    bad = {**source, "paths": {"messages": "request.msgs"}}
    with pytest.raises(RecordedError, match=rf"{path}:1: field 'msgs' is missing"):
        plan_dataset("x", {"source": bad, "shard_size": 4, "bench_prompts": 0})
    # ShareGPT rows whose turns are no {from, value} pairs
    sg = tmp_path / "sg.jsonl"
    sg.write_text(json.dumps({"conversations": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(PromptSourceError, match=rf"{sg}:1: the row holds a turn without 'from' and 'value'"):
        list(recorded_samples("s", {"kind": "recorded", "data_files": str(sg), "shape": "sharegpt"}))
    assert field({"a": [{"b": 1}]}, "a.0.b") == 1


def test_a_recorded_prompt_shard_holds_prompts_only(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n"
    )
    ds = {
        "source": {"kind": "recorded", "data_files": str(path)},
        "shard_size": 4,
        "bench_prompts": 0,
        "system_prompt": "S",
    }
    (p,) = prompts_at("m", ds, [0], {"m": ds})
    assert (
        p["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}] and "recorded" not in p
    )


def demo_config_with_recorded(workdir: Path, rows: int) -> Path:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    path = workdir / "answers" / "gateway.jsonl"
    path.parent.mkdir(parents=True)
    with open(path, "w") as fh:
        for i in range(rows):
            fh.write(
                json.dumps(
                    {
                        "request": {"messages": [{"role": "user", "content": f"Add {i} and {i + 1}."}]},
                        "response": {
                            "choices": [
                                {
                                    "message": {"content": f"{2 * i + 1}", "reasoning_content": f"{i} + {i + 1}"},
                                    "finish_reason": "stop",
                                }
                            ],
                            "usage": {"prompt_tokens": 20, "completion_tokens": 8},
                        },
                    }
                )
                + "\n"
            )
    config["datasets"]["served"] = {
        "source": {"kind": "recorded", "data_files": str(path), "shape": "log"},
        "shard_size": 40,
        "max_samples": 80,
    }
    out = workdir / "config.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def test_dry_run_counts_recorded_samples_at_zero_dollars_beside_api_shards(workdir: Path) -> None:
    cfg = demo_config_with_recorded(workdir, 200)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            "-n",
            "--configfile",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(x for x in out.splitlines() if x.strip().startswith("served") and "recorded" in x)
    assert "2 of 5 shards (80 of 200 recorded samples" in line, line
    row = next(x for x in out.splitlines() if x.strip().startswith("served") and "$0.00" in x)
    assert "80 samples in 2 shards (2 pending)" in row and "output tokens" in row, row
    assert "total: 80 recorded samples" in out
    # the recorded shards are their own local rule; the API dataset still goes to rule responses, the rest in-process
    jobs = {
        x.split()[0]: int(x.split()[1])
        for x in out.split("Job stats:")[1].splitlines()[3:]
        if len(x.split()) == 2 and x.split()[1].isdigit()
    }
    assert jobs.get("responses_recorded") == 2 and jobs.get("responses") == 1 and jobs.get("responses_hf") == 1, jobs


def test_the_report_keeps_recorded_samples_apart_from_paid_ones(tmp_path: Path) -> None:
    from aerie.publish.report import figure_spend, load_responses

    def rec(i: int, **extra) -> dict:
        return {
            "format": "aerie.responses/1",
            "id": f"d/{i}",
            "content": "a",
            "finish_reason": "stop",
            "usage": {"completion_tokens": 10},
            **extra,
        }

    paid = tmp_path / "paid" / "responses" / "shard-00000.jsonl"
    free = tmp_path / "free" / "responses" / "shard-00000.jsonl"
    for path, rows in (
        (paid, [rec(i, dataset="paid", backend="openrouter", provider="p", cost=0.01) for i in range(3)]),
        (
            free,
            [
                rec(
                    i,
                    dataset="free",
                    backend="recorded",
                    provider="recorded:x",
                    cost=0.0,
                    provenance={"kind": "recorded", "at": "x:1"},
                )
                for i in range(5)
            ],
        ),
    ):
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = figure_spend(load_responses([paid, free]), tmp_path / "spend.png")
    assert summary["by_source"]["recorded"] == {"free": {"samples": 5, "usd": 0.0, "completion_tokens": 50}}
    assert summary["by_source"]["api:openrouter"]["paid"]["samples"] == 3
    assert summary["by_dataset"] == {"paid": {"p": pytest.approx(0.03)}}  # recorded answers are no API spend


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"max_output_tokens": 1000}, "datasets.served.max_output_tokens"),
        ({"responses": {"backend": "recorded"}, "_on": "tasks"}, "datasets.tasks.responses.backend"),
        ({"max_samples": 10, "_on": "tasks"}, "datasets.tasks.max_samples"),
    ],
)
def test_settings_that_do_not_fit_a_recorded_dataset_are_named(workdir: Path, edit: dict, named: str) -> None:
    from aerie.plan.config_file import ConfigError, ConfigSources
    from aerie.plan.resolve import check_config, validate_config

    cfg = demo_config_with_recorded(workdir, 4)
    config = yaml.safe_load(cfg.read_text())
    edit = dict(edit)
    config["datasets"][edit.pop("_on", "served")].update(edit)
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    sources = ConfigSources.read([str(cfg)])
    validate_config(config, sources)
    with pytest.raises(ConfigError) as err:
        check_config(config)
    assert named in sources.describe(err.value), sources.describe(err.value)


def test_a_parquet_source_gives_the_same_samples_as_its_jsonl(tmp_path: Path) -> None:
    """Files that are not JSONL (and Hub sets) are read through HF datasets, offline: the same samples, rows named by
    index."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"q{i}"},
                {"from": "gpt", "value": f"<think>r{i}</think>a{i}"},
            ],
        }
        for i in range(5)
    ]
    jsonl, parquet = tmp_path / "s.jsonl", tmp_path / "s.parquet"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    got = {}
    for path in (jsonl, parquet):
        source = {"kind": "recorded", "data_files": str(path), "shape": "sharegpt", "id_field": "id"}
        got[path.suffix] = [r for r, _ in recorded_samples("s", source)]
    strip = [[{k: v for k, v in r.items() if k != "source"} for r in got[s]] for s in (".jsonl", ".parquet")]
    assert strip[0] == strip[1] and strip[0][2]["recorded"] == {
        "reasoning": "r2",
        "content": "a2",
        "tool_calls": None,
        "finish_reason": "stop",
    }
    assert got[".parquet"][3]["source"]["at"] == f"{parquet} row 3"
