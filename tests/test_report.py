"""The HTML report: figures from the artifacts' formats (fast), and `snakemake --report` on a tiny real run,
opened in headless Chromium (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import snakemake
from test_pipeline_e2e import small_demo_config

from aerie.publish.report import FIGURES, write_figures
from aerie.tools.artifacts import save_packed, write_jsonl

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
]
CATEGORIES = ["1. Data", "2. Hidden states", "3. Drafter", "4. Benchmark", "5. Published drafters"]
CAPTIONS = {
    "spend": "API spend and where the responses came from",
    "lengths": "Response and reasoning lengths",
    "quality": "Truncation, flags and tokenization fidelity",
    "hidden": "Hidden-state checks",
    "training": "Drafter training",
    "benchmark": "Benchmark: tokens per second and speedup",
}


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("chromium is missing, and CI must run every test (apt-get install chromium)")
        pytest.skip("chromium not installed (Debian: apt-get install chromium)")
    return path


def api_record(i: int, dataset: str, provider: str, cost: float, finish: str = "stop") -> dict:
    return {
        "format": "aerie.responses/1",
        "id": f"{dataset}/{i}",
        "dataset": dataset,
        "messages": [],
        "backend": "openrouter",
        "model": "m",
        "params": {},
        "params_hash": "x",
        "reasoning": "r" * (10 * i),
        "content": "answer",
        "finish_reason": finish,
        "latency_s": 1.0,
        "tool_calls": None,
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 20 + i,
            "cost": cost,
            "completion_tokens_details": {"reasoning_tokens": 3 * i},
        },
        "flags": ["truncated"] if finish == "length" else [],
        "cost": cost,
        "provider": provider,
        "attempts": 1,
    }


def write_artifacts(root: Path, *, api: bool) -> dict:
    """Small artifacts in the real formats (docs/formats.md) for two datasets."""
    inputs: dict = {"responses": [], "token_reports": [], "hidden": []}
    for d, dataset in enumerate(("alpha", "beta")):
        shard = root / dataset / "responses" / "shard-00000.jsonl"
        if api:
            recs = [
                api_record(i, dataset, ("p1", "p2")[i % 2], 0.001 * (d + 1), "length" if i == 0 else "stop")
                for i in range(6)
            ]
        else:
            recs = [
                {
                    "format": "aerie.responses/1",
                    "id": f"{dataset}/{i}",
                    "dataset": dataset,
                    "backend": "hf",
                    "reasoning": None,
                    "content": "x",
                    "finish_reason": "stop",
                    "output_token_ids": [1] * (5 + i),
                    "usage": {"prompt_tokens": 3, "completion_tokens": 5 + i},
                }
                for i in range(6)
            ]
        shard.parent.mkdir(parents=True)
        write_jsonl(shard, recs)
        report = root / dataset / "tokens" / "shard-00000.report.json"
        report.parent.mkdir(parents=True)
        report.write_text(
            json.dumps(
                {
                    "format": "aerie.tokens-report/1",
                    "samples": 6,
                    "kept": 5,
                    "dropped": {"empty": 1},
                    "exact_ids_available": 0 if api else 6,
                    "retokenized_equal": 0 if api else 6,
                    "usage_length_checked": 6 if api else 0,
                    "usage_length_equal": 5 if api else 0,
                }
            )
        )
        hidden = root / dataset / "hidden" / "shard-00000.safetensors"
        hidden.parent.mkdir(parents=True)
        t, h = 300, 8
        save_packed(
            hidden,
            {
                "input_ids": torch.zeros(t, dtype=torch.int32),
                "loss_mask": torch.ones(t, dtype=torch.uint8),
                "seq_offsets": torch.tensor([0, 100, t]),
                "aux_hidden_states": torch.randn(t, 3 * h).bfloat16(),
                "final_hidden_states": torch.randn(t, h).bfloat16(),
            },
            {
                "format": "aerie.hidden/1",
                "aux_layer_ids": [1, 3, 4],
                "num_hidden_layers": 8,
                "hidden_size": h,
                "next_token_agreement": 0.99,
            },
        )
        inputs["responses"].append(shard)
        inputs["token_reports"].append(report)
        inputs["hidden"].append(hidden)
    drafters = {}
    for name, kind, steps, positions in (("demo-eagle3", "eagle3", 20, [0.5, 0.1]), ("demo-dflash", "dflash", 12,
                                                                                   [0.6, 0.3, 0.1])):  # fmt: skip
        drafter = root / "drafter" / name
        drafter.mkdir(parents=True)
        write_jsonl(
            drafter / "train_log.jsonl",
            [
                {"event": "eval", "epoch": 0, "heldout_loss": 9.0},
                *(
                    {"event": "train", "epoch": 1, "step": s, "loss": 9.0 - s / 10, "lr": 1e-3}
                    for s in range(1, steps + 1)
                ),
                {"event": "eval", "epoch": 1, "heldout_loss": 7.5},
            ],
        )
        (drafter / "eval.json").write_text(
            json.dumps(
                {
                    "format": "aerie.drafter-eval/1",
                    "kind": kind,
                    "simulated_acceptance_length": 1 + sum(positions),
                    "acceptance_per_position": positions,
                    "untrained": {"acceptance_per_position": [0.0] * len(positions)},
                }
            )
        )
        drafters[name] = drafter
    bench = root / "bench" / "demo.json"
    bench.parent.mkdir(parents=True)

    def method(role: str, kind: str | None, tps: float) -> dict:
        return {"role": role, "kind": kind, "draft_tokens": 3, "tokens_per_s": tps, "speedup": tps / 10.0}

    bench.write_text(
        json.dumps(
            {
                "format": "aerie.bench/4",
                "prompts": 3,
                "device": "cpu",
                "baseline": {"tokens_per_s": 10.0},
                "methods": {
                    "demo-eagle3": method("trained", "eagle3", 12.0),
                    "demo-dflash": method("trained", "dflash", 14.0),
                    "untrained:demo-eagle3": method("untrained", "eagle3", 8.0),
                    "ngram": method("ngram", None, 9.0),
                },
            }
        )
    )
    inputs.update(drafters=drafters, bench=bench)
    return inputs


@pytest.mark.parametrize("api", [True, False], ids=["api", "in-process"])
def test_figures_from_artifacts(tmp_path: Path, api: bool) -> None:
    inputs = write_artifacts(tmp_path / "results", api=api)
    sglang = None
    if api:
        sglang = tmp_path / "results" / "bench" / "demo.sglang.json"
        modes = {"baseline": 100.0, "demo-eagle3": 180.0, "demo-dflash": 220.0, "ngram": 120.0}
        sglang.write_text(
            json.dumps(
                {
                    "format": "aerie.sglang-bench/5",
                    "summary": {
                        "by_concurrency": [
                            {
                                "concurrency": c,
                                "output_tokens_per_s": {m: tps * c for m, tps in modes.items()},
                                "speedup": {m: tps / 100.0 for m, tps in modes.items() if m != "baseline"},
                            }
                            for c in (1, 4, 16)
                        ]
                    },
                }
            )
        )
    outputs = {name: tmp_path / "report" / f"{name}.png" for name in FIGURES}
    summary = write_figures(outputs, sglang=sglang, **inputs)
    for path in outputs.values():
        assert path.stat().st_size > 5_000, path
    if api:
        assert summary["spend"]["total_usd"] == pytest.approx(6 * 0.001 + 6 * 0.002)
        assert set(summary["spend"]["by_dataset"]["alpha"]) == {"p1", "p2"}
        assert summary["lengths"]["reasoning_unit"] == "tokens"
        assert summary["quality"]["responses"]["alpha"]["truncated"] == pytest.approx(1 / 6)
        assert summary["quality"]["fidelity"]["beta"]["usage length equal / checked"] == pytest.approx(5 / 6)
        speedups = {"demo-eagle3": 1.8, "demo-dflash": 2.2, "ngram": 1.2}
        assert summary["benchmark"]["sglang_speedup"] == dict.fromkeys((1, 4, 16), speedups)
    else:
        assert summary["spend"]["total_usd"] == 0  # drawn as "no API spend (in-process generation)"
        assert summary["quality"]["fidelity"]["alpha"]["retokenized equal / exact ids"] == 1.0
    assert summary["hidden"] == {"shards": 2, "tokens": 600}
    assert {n: t["steps"] for n, t in summary["training"].items()} == {"demo-eagle3": 20, "demo-dflash": 12}
    assert summary["benchmark"]["speedup"] == {"demo-eagle3": 1.2, "demo-dflash": 1.4}


def tiny_config() -> dict:
    config = small_demo_config()
    del config["datasets"]["humaneval"]  # no `transformers serve` start-up: the API path is covered above
    config["target"]["demo"].update(train_steps=20, tokenizer_examples=800, eval_prompts=4)
    config["datasets"]["tasks"]["source"]["count"] = 12
    config["datasets"]["tasks"]["shard_size"] = 10
    config["responses"]["max_new_tokens"] = 24
    config["bench"].update({"max_new_tokens": 8, "max_prompts": 2})
    return config


@pytest.mark.slow
def test_html_report_renders_in_chromium(tmp_path: Path) -> None:
    browser = chromium()
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(tiny_config()))
    proc = snakemake(workdir, "--cores", "2", "--configfile", str(configfile), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    for name in FIGURES:
        assert (workdir / "results" / "report" / f"{name}.png").stat().st_size > 5_000, name
    proc = snakemake(workdir, "--report", "report.html", "--configfile", str(configfile))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    html = (workdir / "report.html").read_text()
    for name in FIGURES:  # every figure is embedded, with its caption
        assert f"results/report/{name}.png" in html and CAPTIONS[name] in html, name
    assert "results/bench/demo.png" in html
    # The published drafter's model card is a page of the report, and the training caption links it and the curves.
    assert "results/report/cards/demo.html" in html and "Model card of drafter demo" in html
    assert (workdir / "results" / "drafter" / "demo" / "tensorboard").resolve().as_uri() in html

    profile = tmp_path / "chromium-profile"
    base = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=15000"]
    url = (workdir / "report.html").as_uri()
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-3000:]
    for category in CATEGORIES:  # the report app ran and lists every category in its menu
        assert category in dom.stdout, (category, dom.stdout[-3000:])
    shot = tmp_path / "report.png"
    proc = subprocess.run(
        [*base, f"--screenshot={shot}", "--window-size=1400,1000", url], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-3000:]
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[0] >= 900 and pixels.shape[1] >= 1300
    assert pixels.reshape(-1, pixels.shape[-1]).std(axis=0).max() > 0.05, "the screenshot is blank"
