"""Prompt datasets by name or local file (``source.kind: hf``): shapes, turns, filters, dedup, sampling, errors.

Every dataset here is a parquet or JSON file the test writes; no test touches the network (the Hub is
switched off while loading, and HF_HOME points into the test's own folder).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conda_stand_in import CONDA_DEPLOYMENT, conda_on_path
from conftest import REPO, snakemake

import aerie.sources.datasets
import aerie.sources.tables
from aerie.sources.datasets import (
    PromptSourceError,
    iter_prompts,
    plan_dataset,
    prompts_at,
    read_prompts,
    source_files,
    write_prompts,
)
from aerie.sources.tables import normalised_text, prompt_turns


@pytest.fixture(autouse=True)
def private_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the datasets cache of these tests out of the user's home (loads convert files into it)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_home" / "datasets"))


def sharegpt_rows() -> list[dict]:
    conv = lambda *turns: [{"from": f, "value": v} for f, v in turns]  # noqa: E731
    return [
        {"id": "a", "conversations": conv(("human", "What is 2+2?"), ("gpt", "4"))},
        {
            "id": "b",
            "conversations": conv(
                ("system", "Be brief."),
                ("human", "Name a colour."),
                ("gpt", "Red."),
                ("human", "Another?"),
                ("gpt", "Blue."),
            ),
        },
        {"id": "c", "conversations": []},  # empty dumps exist in ShareGPT: skipped
        {"id": "d", "conversations": conv(("gpt", "Hello! How can I help?"))},  # no user turn: skipped
        {"id": "e", "conversations": conv(("human", "  what IS 2+2? "), ("gpt", "four"))},  # duplicate of a
        {"id": "f", "conversations": conv(("human", "Translate 'chat' to English."), ("gpt", "cat"))},
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def hf_dataset(path: Path, **source) -> dict:
    return {"source": {"kind": "hf", "data_files": str(path), **source}, "shard_size": 2, "bench_prompts": 0}


def test_sharegpt_parquet_last_user_turn(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "sharegpt.parquet", sharegpt_rows())
    prompts = list(iter_prompts("chat", hf_dataset(path, id_field="id")))
    assert [p["id"] for p in prompts] == ["chat/a", "chat/b", "chat/f"]  # c, d not conversations; e duplicates a
    assert prompts[0]["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    # Multi-turn: the context up to the last user turn, the dataset's earlier answer kept.
    assert [m["role"] for m in prompts[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert prompts[1]["messages"][-1]["content"] == "Another?"
    assert prompts[0]["source"] == {"kind": "hf", "dataset": str(path), "split": "train", "row": 0}
    assert source_files(hf_dataset(path)["source"]) == [path]


def test_every_assistant_turn_gives_one_prompt_per_turn(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "sharegpt.parquet", sharegpt_rows())
    prompts = list(iter_prompts("chat", hf_dataset(path, id_field="id", turns="every_assistant")))
    assert [p["id"] for p in prompts] == ["chat/a/turn0", "chat/b/turn0", "chat/b/turn1", "chat/f/turn0"]
    assert [m["content"] for m in prompts[1]["messages"]] == ["Be brief.", "Name a colour."]
    assert [m["content"] for m in prompts[2]["messages"]] == ["Be brief.", "Name a colour.", "Red.", "Another?"]
    assert prompts[2]["source"]["turn"] == 1


def test_prompt_turns_rules() -> None:
    u, a, t = ({"role": r, "content": r[0]} for r in ("user", "assistant", "tool"))
    assert prompt_turns([u, a, u], "last_user") == [(0, [u, a, u])]
    assert prompt_turns([u, a, u, a], "last_user") == [(0, [u, a, u])]
    assert prompt_turns([u, a, t, a], "every_assistant") == [(0, [u]), (1, [u, a, t])]
    assert prompt_turns([u, a, u], "every_assistant") == [(0, [u]), (1, [u, a, u])]  # ends on a user turn
    assert prompt_turns([a, u], "every_assistant") == [(0, [a, u])]  # an opening assistant turn has no prompt


def test_openai_messages_json_with_tools_as_json_string(tmp_path: Path) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    rows = [
        {
            "messages": [
                {"role": "user", "content": "What time is it?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
                {"role": "assistant", "content": "It is noon."},
            ],
            "tools": json.dumps([tool]),
        },
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
            ],
            "tools": "",
        },
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "tools": ""},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = list(iter_prompts("tools", hf_dataset(path, turns="every_assistant")))
    assert len(prompts) == 3  # two assistant turns of row 0 + the text-only row 1; the image row is skipped
    assert prompts[0]["messages"] == [{"role": "user", "content": "What time is it?"}]
    assert prompts[0]["tools"] == [tool]
    second = prompts[1]["messages"]
    assert second[1]["tool_calls"][0]["function"]["name"] == "get_time" and second[1]["content"] is None
    assert second[2] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
    assert prompts[2]["messages"] == [{"role": "user", "content": "Hi there"}] and "tools" not in prompts[2]


def test_instruction_and_question_shapes(tmp_path: Path) -> None:
    alpaca = write_parquet(
        tmp_path / "alpaca.parquet",
        [
            {"instruction": "Sort the list.", "input": "3, 1, 2", "output": "1, 2, 3"},
            {"instruction": "Say hi.", "input": "", "output": "hi"},
        ],
    )
    prompts = list(iter_prompts("code", hf_dataset(alpaca)))  # auto: instruction (+ input), output never read
    assert [p["messages"][0]["content"] for p in prompts] == ["Sort the list.\n\n3, 1, 2", "Say hi."]
    magicoder = write_parquet(tmp_path / "oss.parquet", [{"problem": "Write a parser.", "solution": "..."}])
    assert list(iter_prompts("c", hf_dataset(magicoder)))[0]["messages"][0]["content"] == "Write a parser."
    mtbench = write_parquet(tmp_path / "mt.parquet", [{"prompt": ["First turn", "Second turn"], "prompt_id": 81}])
    (p,) = iter_prompts("mt", hf_dataset(mtbench, shape="question", field="prompt", id_field="prompt_id"))
    assert p["id"] == "mt/81" and p["messages"] == [{"role": "user", "content": "First turn"}]


def test_language_and_token_filters(tmp_path: Path) -> None:
    rows = [
        {"question": "short one", "language": "English"},
        {"question": "x" * 400, "language": "English"},
        {"question": "kurz", "language": "German"},
    ]
    path = write_parquet(tmp_path / "q.parquet", rows)
    kept = list(iter_prompts("q", hf_dataset(path, language=["english"], max_prompt_tokens=40)))
    assert [p["messages"][0]["content"] for p in kept] == ["short one"]


def test_dedup_within_and_across_datasets(tmp_path: Path) -> None:
    first = write_parquet(tmp_path / "one.parquet", [{"question": "What is 2+2?"}, {"question": "Unique one"}])
    second = write_parquet(
        tmp_path / "two.parquet",
        [{"question": "what is   2+2?"}, {"question": "Unique two"}, {"question": "UNIQUE TWO"}],
    )
    datasets = {"one": hf_dataset(first), "two": hf_dataset(second)}
    assert plan_dataset("two", datasets["two"]).total == 2  # within the dataset only
    assert plan_dataset("two", datasets["two"], datasets).total == 1  # 2+2 is already in "one"
    assert plan_dataset("one", datasets["one"], datasets).total == 2  # the first dataset keeps everything
    no_dedup = {"one": datasets["one"], "two": hf_dataset(second, dedup=False)}
    assert plan_dataset("two", no_dedup["two"], no_dedup).total == 3
    assert normalised_text([{"role": "system", "content": "S"}, {"role": "user", "content": " A\nb "}]) == "user: a b"


def test_seeded_sampling_is_deterministic(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "q.parquet", [{"question": f"question {i}"} for i in range(50)])

    def ids(**extra) -> list[str]:
        ds = hf_dataset(path, **extra.pop("source", {}))
        return [p["id"] for p in iter_prompts("q", {**ds, **extra})]

    assert ids(max_prompts=5) == [f"q/row{i}" for i in range(5)]  # no seed: the source order
    sample = ids(max_prompts=5, source={"seed": 7})
    assert sample == ids(max_prompts=5, source={"seed": 7}) and sample != ids(max_prompts=5, source={"seed": 8})
    assert sample != [f"q/row{i}" for i in range(5)] and len(set(sample)) == 5
    assert ids(source={"seed": 7})[:5] == sample  # the sample is a prefix of the seeded order: shards stay stable


def test_write_prompts_slices_the_hf_dataset(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "sharegpt.parquet", sharegpt_rows())
    ds = hf_dataset(path, id_field="id")
    out = tmp_path / "shard.jsonl"
    assert write_prompts("chat", ds, 1, 3, out) == 2
    assert [r["id"] for r in read_prompts(out)] == ["chat/b", "chat/f"]


def test_bad_sources_fail_naming_the_setting(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "q.parquet", [{"text": "hello", "lang": "en"}])
    with pytest.raises(PromptSourceError, match=r"datasets\.q: cannot tell the prompt shape from the columns"):
        plan_dataset("q", hf_dataset(path))
    with pytest.raises(PromptSourceError, match=r"column 'conversations' .*not in the dataset.*'text'"):
        plan_dataset("q", hf_dataset(path, shape="sharegpt"))
    with pytest.raises(PromptSourceError, match=r"'language' \(source.language_field\) is not in the dataset"):
        plan_dataset("q", hf_dataset(path, shape="question", field="text", language=["en"]))
    with pytest.raises(PromptSourceError, match=r"column 'uid' \(source.id_field\)"):
        plan_dataset("q", hf_dataset(path, shape="question", field="text", id_field="uid"))
    with pytest.raises(PromptSourceError, match=r"no file matches '.*missing\.parquet'"):
        plan_dataset("q", hf_dataset(tmp_path / "missing.parquet"))
    with pytest.raises(PromptSourceError, match=r"set source.format"):
        plan_dataset("q", hf_dataset(path, data_files=[str(path), __file__]))  # a parquet and a .py file


def test_hub_dataset_is_never_downloaded_at_parse_time() -> None:
    ds = {"source": {"kind": "hf", "name": "aerie-tests/no-such-dataset", "split": "train"}, "shard_size": 2}
    with pytest.raises(
        PromptSourceError,
        match=r"datasets\.gone: dataset 'aerie-tests/no-such-dataset' is not in the "
        r"local Hugging Face datasets cache.*aerie.sources fetch",
    ):
        plan_dataset("gone", ds)


def hf_config(workdir: Path, **source) -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    write_parquet(workdir / "sharegpt.parquet", sharegpt_rows())
    config["datasets"] = {
        "chat": {
            "source": {"kind": "hf", "data_files": "sharegpt.parquet", **source},
            "shard_size": 2,
            "bench_prompts": 1,
        }
    }
    return config


def dry_run(workdir: Path, config: dict, conda: bool = False) -> tuple[int, str]:
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    deploy, env = (CONDA_DEPLOYMENT, conda_on_path(workdir)) if conda else ((), None)  # tests/conda_stand_in.py
    proc = snakemake(workdir, "-n", *deploy, "--configfile", str(configfile), env=env)
    return proc.returncode, proc.stdout + proc.stderr


def test_dry_run_plans_an_hf_dataset_and_names_a_bad_column(workdir: Path) -> None:
    rc, out = dry_run(workdir, hf_config(workdir, id_field="id"))
    assert rc == 0, out
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    assert int(counts["prompts"]) == 1 and int(counts["bench_prompts"]) == 1  # 3 prompts: 2 train + 1 bench
    rc, out = dry_run(workdir, hf_config(workdir, shape="messages"))
    assert rc != 0 and "datasets.chat: column 'messages'" in out, out
    rc, out = dry_run(workdir, hf_config(workdir, turns="every_turn"))
    assert rc != 0 and "every_turn" in out, out


def stand_in_rows(name: str, source: dict, n: int) -> list[dict]:
    """``n`` rows holding the columns an ``hf`` source reads, in its shape."""
    shape, field = source.get("shape", "question"), source.get("field")
    rows = []
    for i in range(n):
        text = f"{name} question {i}"
        if shape == "sharegpt":
            row = {field or "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}
        elif shape == "messages":
            row = {field or "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
        elif shape == "instruction":
            row = {field or "instruction": text}
        else:  # question; a list column (MT-bench) gets two turns
            row = {field or "question": [text, f"{name} follow-up {i}"] if field == "prompt" else text}
        if source.get("id_field"):
            row[source["id_field"]] = f"{name}-{i}"
        rows.append(row)
    return rows


def kimi_stand_in_config(workdir: Path, rows: int = 5) -> dict:
    """config/kimi-k2.5.yaml with each named Hub dataset replaced by a local parquet stand-in of ``rows`` rows
    (same shape, field and id settings), so a dry run plans it offline; jsonl sources get a stand-in file."""
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    for name, ds in config["datasets"].items():
        src = ds["source"]
        if src["kind"] == "hf":
            path = write_parquet(workdir / f"{name}.parquet", stand_in_rows(name, src, rows))
            keep = {k: v for k, v in src.items() if k not in ("name", "config", "split", "revision", "data_files")}
            ds["source"] = {**keep, "data_files": str(path)}
        elif src["kind"] == "jsonl":
            path = workdir / src["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            field = src.get("messages_field") or src.get("text_field", "prompt")
            lines = [
                {
                    field: [{"role": "user", "content": f"{name} question {i}"}]
                    if "messages_field" in src
                    else f"{name} prompt {i}",
                    src.get("id_field", "id"): f"{name}-{i}",
                }
                for i in range(rows)
            ]
            path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return config


def test_kimi_example_names_hub_datasets_and_never_downloads_in_a_dry_run(workdir: Path) -> None:
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    sources = {name: ds["source"] for name, ds in config["datasets"].items() if ds["source"]["kind"] != "recorded"}
    assert len(sources) == 5 and all(s["kind"] == "hf" and s.get("name") for s in sources.values())
    assert sources["math"]["name"] == "openai/gsm8k" and sources["ultrachat"]["split"] == "train_sft"
    # Nothing cached (HF_HOME is this test's own): the dry run stops at the first dataset, naming the fetch step.
    rc, out = dry_run(workdir, config)
    assert rc != 0
    named = re.search(r"datasets\.(\w+): dataset '([^']+)' is not in the local Hugging Face datasets cache", out)
    assert named and sources[named.group(1)]["name"] == named.group(2), out
    assert "python -m aerie.sources fetch --configfile" in out


def test_kimi_example_plans_every_named_dataset_from_local_stand_ins(workdir: Path) -> None:
    config = kimi_stand_in_config(workdir, rows=5)
    for ds in config["datasets"].values():
        ds["shard_size"] = 2
    rc, out = dry_run(workdir, config, conda=True)  # its SGLang rules need conda deployment (profiles/gpu-host)
    assert rc == 0, out
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    # 5 datasets x 3 shards (5 prompts); the published cards' benchmarks are bench sets, one job each
    assert int(counts["prompts"]) == 5 * 3 and int(counts["bench_set"]) == len(config["bench"]["sets"]) == 3, out


# ---- the prompt cache (aerie.sources.cache): converted once, read by every later parse ------------------------


def forget_conversions() -> None:
    """A new process: nothing converted in memory (each Snakemake invocation and SLURM job starts so)."""
    aerie.sources.datasets._CONVERTED.clear()


def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make converting a source an error: what still works is served by the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("the source was converted again")

    monkeypatch.setattr(aerie.sources.tables, "load_table", refuse)
    monkeypatch.setitem(aerie.sources.datasets._SOURCES, "jsonl", refuse)


def test_a_second_parse_reads_the_prompt_cache_and_a_changed_file_converts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "results" / ".cache" / "prompts"
    path = write_parquet(tmp_path / "sharegpt.parquet", sharegpt_rows())
    ds = hf_dataset(path, id_field="id")
    first = plan_dataset("chat", ds, cache_dir=cache)
    records = list(iter_prompts("chat", ds, cache_dir=cache))
    (meta,) = cache.glob("chat.*.json")
    entry = json.loads(meta.read_text())
    assert entry["format"] == "aerie.prompt-cache/1" and entry["count"] == 3
    assert entry["material"]["identity"]["files"][0][:2] == [str(path.resolve()), path.stat().st_size]
    forget_conversions()
    with monkeypatch.context() as m:
        no_conversion(m)
        assert plan_dataset("chat", ds, cache_dir=cache) == first
        assert list(iter_prompts("chat", ds, cache_dir=cache)) == records  # the same records, system prompt too
        ids = [r["id"] for r in prompts_at("chat", ds, [2, 0], cache_dir=cache)]
        assert ids == ["chat/f", "chat/a"]
    # Same bytes, newer file: converted again (identity is path, size and mtime_ns, not a guess at the content).
    forget_conversions()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with monkeypatch.context() as m:
        no_conversion(m)
        with pytest.raises(AssertionError, match="converted again"):
            plan_dataset("chat", ds, cache_dir=cache)
    # A changed setting is a new key too; so is a changed dataset listed before (dedup spans datasets).
    forget_conversions()
    plan_dataset("chat", ds, cache_dir=cache)
    for changed in (hf_dataset(path, id_field="id", max_prompts=2), hf_dataset(path, id_field="id", dedup=False)):
        forget_conversions()
        with monkeypatch.context() as m:
            no_conversion(m)
            with pytest.raises(AssertionError, match="converted again"):
                plan_dataset("chat", changed, cache_dir=cache)


def test_a_changed_max_prompts_is_a_new_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``datasets.<name>.max_prompts`` caps what is converted, so it keys the entry: a changed count converts again
    and plans the new count, never the stale entry's; going back reads the earlier entry without converting."""
    cache = tmp_path / "cache"
    path = write_parquet(tmp_path / "sharegpt.parquet", sharegpt_rows())
    capped = {**hf_dataset(path, id_field="id"), "max_prompts": 2}
    assert plan_dataset("chat", capped, cache_dir=cache).total == 2
    for count, ids in ((1, ["chat/a"]), (None, ["chat/a", "chat/b", "chat/f"])):
        forget_conversions()
        changed = {**capped, "max_prompts": count}
        with monkeypatch.context() as m:
            no_conversion(m)
            with pytest.raises(AssertionError, match="converted again"):
                plan_dataset("chat", changed, cache_dir=cache)
        forget_conversions()
        assert plan_dataset("chat", changed, cache_dir=cache).total == len(ids)
        assert [r["id"] for r in iter_prompts("chat", changed, cache_dir=cache)] == ids
    forget_conversions()
    with monkeypatch.context() as m:
        no_conversion(m)
        assert plan_dataset("chat", capped, cache_dir=cache).total == 2  # the first entry, read back


def test_dedup_across_datasets_keys_on_the_earlier_datasets_files(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    first = write_parquet(tmp_path / "one.parquet", [{"question": "What is 2+2?"}])
    second = write_parquet(tmp_path / "two.parquet", [{"question": "what is 2+2?"}, {"question": "Unique"}])
    datasets = {"one": hf_dataset(first), "two": hf_dataset(second)}
    assert plan_dataset("two", datasets["two"], datasets, cache_dir=cache).total == 1
    forget_conversions()
    write_parquet(first, [{"question": "Something else"}])  # the earlier dataset no longer holds 2+2
    assert plan_dataset("two", datasets["two"], datasets, cache_dir=cache).total == 2


def test_a_torn_cache_entry_is_never_read(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = write_parquet(tmp_path / "q.parquet", [{"question": f"q {i}"} for i in range(5)])
    plan_dataset("q", hf_dataset(path), cache_dir=cache)
    (records,) = cache.glob("q.*.jsonl")
    records.write_bytes(records.read_bytes()[:-7])  # a crash mid-write of a later entry, a full disk
    forget_conversions()
    assert [p["id"] for p in iter_prompts("q", hf_dataset(path), cache_dir=cache)] == [f"q/row{i}" for i in range(5)]


def test_a_hub_dataset_is_identified_by_its_copy_in_the_datasets_cache(tmp_path: Path, monkeypatch) -> None:
    from aerie.sources.tables import hub_cache_dir, source_identity

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    source = {"kind": "hf", "name": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"}
    assert hub_cache_dir(source["name"]) == tmp_path / "ds" / "HuggingFaceH4___ultrachat_200k"
    from datasets.naming import camelcase_to_snakecase

    for name in ("openai/GSM8K", "anon8231489123/ShareGPT_Vicuna_unfiltered", "ise-uiuc/Magicoder-OSS-Instruct-75K"):
        owner, repo = name.split("/")  # the folder datasets itself looks in, offline
        assert hub_cache_dir(name).name == f"{owner}___{camelcase_to_snakecase(repo)}"
    assert source_identity(source) is None  # not fetched: no key, and the load names the fetch command
    folder = hub_cache_dir(source["name"]) / "default" / "0.0.0" / "abc123"
    folder.mkdir(parents=True)
    (folder / "ultrachat_200k-train_sft.arrow").write_bytes(b"x" * 10)
    (folder / "dataset_info.json").write_text("{}")
    identity = source_identity(source)
    assert [Path(f[0]).name for f in identity["hub_cache"]] == ["dataset_info.json", "ultrachat_200k-train_sft.arrow"]
    (folder.parent / "abc123_builder.lock").write_text("")  # a load takes a lock: not part of the identity
    assert source_identity(source) == identity


def test_the_dry_run_fills_the_prompt_cache_once(workdir: Path) -> None:
    config = hf_config(workdir, id_field="id")
    rc, out = dry_run(workdir, config)
    assert rc == 0, out
    (meta,) = (workdir / "results" / ".cache" / "prompts").glob("chat.*.json")
    written = meta.stat().st_mtime_ns
    rc, out = dry_run(workdir, config)
    assert rc == 0 and meta.stat().st_mtime_ns == written, out  # the second parse read it, wrote nothing
