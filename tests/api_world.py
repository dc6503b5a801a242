"""The API tests' world: prompts and configs whose datasets are regenerated through 'OpenRouter' (the emulator),
responses jobs in processes of their own (to be run at once, killed, restarted), and what the emulator billed for
each results folder's requests. Used by tests/test_api*.py, tests/test_key_ledger.py and bench/api_limits.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from aerie.emulator import DEFAULT_PROVIDERS
from aerie.responses.api.books import folder_money, read_folder_books, spend_story, where_from_record
from aerie.tools.artifacts import read_jsonl

REPO = Path(__file__).resolve().parents[1]
MODEL = "moonshotai/kimi-k2.5"


def make_prompts(n: int, tag: str = "q") -> list[dict]:
    return [
        {"id": f"d/{i}", "dataset": "d", "messages": [{"role": "user", "content": f"{tag} number {i}"}]}
        for i in range(n)
    ]


# Every prompt of make_prompts has 3 words (3 emulated prompt tokens); with a fixed output length and
# `sort: price` every sample costs exactly this, so the guards can be checked to the sample.
CHUTES = next(p for p in DEFAULT_PROVIDERS if p.name == "Chutes")


def exact_cost(output_tokens: int) -> float:
    return 3 * CHUTES.prompt_price + output_tokens * CHUTES.completion_price


def write_prompt_file(path: Path, prompts: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"format": "aerie.prompts/1", **p, "source": {"kind": "test"}}) + "\n" for p in prompts)
    )
    return path


def job_config(base: str, datasets: dict[str, dict], **responses) -> dict:
    """A pipeline config with every key the responses job reads (schema defaults), datasets on the emulator."""
    return {
        "target": {"path": "unused-by-openrouter"},
        "datasets": {name: {"source": {"kind": "jsonl", "path": "unused"}, **d} for name, d in datasets.items()},
        "responses": {
            "backend": "openrouter",
            "model": MODEL,
            "base_url": base,
            "api_key_env": "OPENROUTER_API_KEY",
            "temperature": 1.0,
            "top_p": 0.95,
            "max_new_tokens": 512,
            "seed": 0,
            "send_seed": False,
            "concurrency": 30,
            "connect_timeout_s": 30,
            "read_timeout_s": 60,
            "max_attempts": 8,
            "backoff_base_s": 0.02,
            "backoff_max_s": 0.2,
            "progress_interval_s": 60,  # no account poll while these short runs go: only the start's figures
            "require_reasoning": True,
            "expected_output_tokens": 100,
            "live_prices": False,
            "price_per_million_input_usd": CHUTES.prompt_price * 1e6,
            "price_per_million_output_usd": CHUTES.completion_price * 1e6,
            "provider": {"sort": "price"},
            "reasoning": {"enabled": True},
            **responses,
        },
    }


def api_pipeline_config(
    workdir: Path, base_url: str, target: Path, datasets: dict[str, dict[str, Any]], **responses: Any
) -> Path:
    """Write ``workdir/config.yaml``: per dataset name ``{"n": prompts, **its datasets section}`` (prompts
    ``"<tag> <i>: what is <i> + <i>?"``, the tag ``Question`` for ``chat``, ``<name> question`` otherwise, one more
    held out for the benchmark), ``responses`` through the emulator at ``base_url`` (overridden by ``responses``)."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"] = {"path": str(target), "device": "cpu", "dtype": "float32"}
    config["hidden"]["aux_layer_ids"] = [1, 2, 4]  # of the tiny target's 6 layers (tiny_world.save_tiny_llama_target)
    config["datasets"] = {}
    for name, spec in datasets.items():
        spec = dict(spec)
        n = spec.pop("n")
        src = workdir / f"prompts-{name}.jsonl"
        tag = "Question" if name == "chat" else f"{name} question"
        src.write_text(
            "".join(
                json.dumps({"id": f"p{i}", "prompt": f"{tag} {i}: what is {i} + {i}?"}) + "\n" for i in range(n + 1)
            )
        )
        config["datasets"][name] = {
            "source": {"kind": "jsonl", "path": str(src), "id_field": "id"},
            "bench_prompts": 1,
            **spec,
        }
    config["responses"] = {
        "backend": "openrouter",
        "model": "moonshotai/kimi-k2.5",
        "base_url": base_url,
        "temperature": 1.0,
        "top_p": 0.95,
        "max_new_tokens": 256,
        "concurrency": 100,
        "provider": {"sort": "price", "quantizations": ["int4"]},
        "reasoning": {"enabled": True},
        "backoff_base_s": 0.05,
        "backoff_max_s": 0.5,
        "progress_interval_s": 1,
        "expected_output_tokens": 100,
        **responses,
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


JOB = (
    "import json, sys, time; from pathlib import Path; "
    "from aerie.responses.api.job import ApiShardTask, regenerate_api_shards; from aerie.plan.resolve import api_run; "
    "c, t, go = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), Path(sys.argv[3]); "
    "tasks = [ApiShardTask(d, Path(p), Path(o)) for d, p, o in t]\n"
    "while not go.exists(): time.sleep(0.01)\n"
    "r = regenerate_api_shards(tasks, api_run(c), log=lambda m: print(m, flush=True)); "
    "print(json.dumps({'unfinished': sum(isinstance(v, str) for v in r.values())}))"
)


def shard_of(folder: Path) -> Path:
    return folder / "results" / "chat" / "responses" / "shard-00000.jsonl"


def start_job(
    folder: Path, base: str, budget: float, go: Path, n: int, env: dict[str, str], **responses
) -> subprocess.Popen:
    """A responses job of its own run (results folder) in a process of its own, started when ``go`` appears; its
    prompts are its own (tagged with the folder's name), so the emulator's request log tells whose a request was."""
    prompts = [{**p, "id": f"{folder.name}/{i}", "dataset": "chat"} for i, p in enumerate(make_prompts(n, folder.name))]
    prompt_file = write_prompt_file(folder / "prompts.jsonl", prompts)
    config = job_config(base, {"chat": {}}, budget_usd=budget, concurrency=20, progress_interval_s=1, **responses)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tasks.json").write_text(json.dumps([["chat", str(prompt_file), str(shard_of(folder))]]))
    return subprocess.Popen(
        [sys.executable, "-c", JOB, str(folder / "config.json"), str(folder / "tasks.json"), str(go)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def billed_per_folder(request_log: Path, folders: list[Path]) -> dict[str, float]:
    """What the emulator billed for each folder's requests: its request log's charged requests, by the hash of
    their messages (answered, timed out and billed, or abandoned by a killed client alike)."""
    whose = {}
    for folder in folders:
        for p in read_jsonl(folder / "prompts.jsonl"):
            canon = json.dumps(p["messages"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            whose[hashlib.sha256(canon.encode()).hexdigest()] = folder.name
    billed = {folder.name: 0.0 for folder in folders}
    for line in read_jsonl(request_log):
        if line["cost"]:
            billed[whose[line["messages_sha256"]]] += line["cost"]
    return billed


def drained(base: str, timeout: float = 30.0) -> dict:
    """The emulator's figures once nothing is in flight (every abandoned generation finished and billed)."""
    deadline = time.monotonic() + timeout
    while (stats := requests.get(f"{base}/emulator/stats", timeout=5).json())["in_flight"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    return stats


def books_of(folder: Path) -> float:
    """What the folder's report says was billed for it (journaled + billed retries + lost; checked equal to what the
    preview counts as spent)."""
    story = spend_story([shard_of(folder)])
    results = folder / "results"
    record = read_folder_books(results / "api_account.jsonl")[-1]
    money = folder_money(results, where_from_record(record), ["chat"])
    assert money.billed == pytest.approx(story.total, abs=1e-12), (money, story)  # the preview's figure
    return story.total
