"""SGLang serving harness: command lines, recorded response shapes, the benchmark prompt readers, statistics
(acceptance, degenerate outputs), and whole runs against a fake SGLang that the harness launches as a real
subprocess (port, health wait, shutdown) and that keeps SGLang 0.5.23's server-side acceptance counter."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO

from aerie.benchmark import sglang_client as client
from aerie.benchmark import sglang_harness as h
from aerie.benchmark import sglang_server, sglang_stats
from aerie.benchmark.settings import BenchRun
from aerie.sources.datasets import PromptSet, benchmark_prompts, parse_prompt_set

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
BENCHMARKS = Path(__file__).parent / "fixtures" / "benchmarks"  # MT-bench and GSM8K, provenance in README.md
SECRET = "sk-fake-0123456789abcdef"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


# ---- command lines -----------------------------------------------------------------------------------

SG = {
    "tp": 8,
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "mem_fraction_static": 0.85,
    "extra_args": ["--trust-remote-code", "--reasoning-parser", "kimi_k2"],
    "concurrency": [1, 8],
}


def eagle3_folder(folder: Path) -> Path:
    """An EAGLE-3 folder as far as the harness reads it (config.json: its kind and flags)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "vocab_size": 5200,
                "draft_vocab_size": 1000,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True},
            }
        )
    )
    return folder


def dflash_folder(folder: Path, block_size: int = 4, sliding_window: int | None = None) -> Path:
    """A DFlash folder as aerie exports it (config.json + weights), tiny, for a 6-layer target of 5200 tokens."""
    import torch

    from aerie.drafter_kinds.dflash.model import DFlashDrafter
    from aerie.drafter_kinds.dflash.shape import DFlashShape
    from aerie.drafter_kinds.dflash.weights import export_dflash

    target = {
        "vocab_size": 5200,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    shape = DFlashShape.from_target(
        target,
        num_layers=2,
        block_size=block_size,
        mask_token_id=5199,
        target_layer_ids=[1, 3],
        sliding_window=sliding_window,
    )
    torch.manual_seed(0)
    export_dflash(DFlashDrafter(shape), shape, folder, {})
    return folder


def test_baseline_and_drafter_commands_use_sglang_flag_names(tmp_path: Path) -> None:
    base = sglang_server.server_command("/models/K", 41000, SG, python="/envs/sglang/bin/python")
    assert base == [
        "/envs/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/K",
        "--tp-size",
        "8",
        "--host",
        "127.0.0.1",
        "--port",
        "41000",
        "--mem-fraction-static",
        "0.85",
        "--trust-remote-code",
        "--reasoning-parser",
        "kimi_k2",
    ]
    # An EAGLE-3 folder: its kind's flags, the configured steps / topk / draft tokens, naming where it is served from.
    flags = sglang_server.drafter_flags(eagle3_folder(tmp_path / "eagle"), SG, served_as="/d/run")
    eagle = sglang_server.server_command("/models/K", 41001, SG, speculative=flags, python="/envs/sglang/bin/python")
    assert eagle == base[:10] + [
        "41001",
        "--mem-fraction-static",
        "0.85",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/d/run",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        "--trust-remote-code",
        "--reasoning-parser",
        "kimi_k2",
    ]
    # Defaults: this interpreter, tp 1, no --mem-fraction-static unless configured.
    assert sglang_server.server_command("/m", 5, None) == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--tp-size",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "5",
    ]


def spec_flags_of_0523() -> set[str]:
    """SGLang 0.5.23's speculative flags: ``--`` + each field of its arg_groups/fields/spec.py with ``-`` for ``_``
    (recorded from the wheel by record_dflash_weights.py), and the one alias there (``--speculative-draft-model``)."""
    fields = fixture("dflash_weights.json")["sglang_spec_fields"]
    assert fixture("dflash_weights.json")["sglang_version"] == "0.5.23"
    return {"--" + f.replace("_", "-") for f in fields} | {"--speculative-draft-model"}


def test_a_dflash_folder_is_served_with_0523s_dflash_flags(tmp_path: Path) -> None:
    """DFLASH's command line: the algorithm, the folder, its block as the draft tokens, and the draft window only
    when every layer slides - each flag one of SGLang 0.5.23's (this test fails when one is not); z-lab's card's
    --speculative-dflash-draft-window-size is no 0.5.23 flag, and the stand-in server refuses it."""
    full = dflash_folder(tmp_path / "full", block_size=8)
    sliding = dflash_folder(tmp_path / "sliding", block_size=4, sliding_window=16)
    assert sglang_server.drafter_flags(full, SG) == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(full),
        "--speculative-num-draft-tokens",
        "8",
    ]
    assert sglang_server.drafter_flags(sliding, SG)[-2:] == ["--speculative-draft-window-size", "16"]
    known = spec_flags_of_0523()
    assert "--speculative-dflash-draft-window-size" not in known
    for folder in (full, sliding):
        cmd = sglang_server.server_command("/models/K", 1, SG, speculative=sglang_server.drafter_flags(folder, SG))
        used = {a for a in cmd if a.startswith("--speculative")}
        assert used and used <= known, used - known
    # The stand-in parses what it simulates with 0.5.23's names only, and refuses any other flag.
    fake = {m for m in re.findall(r'"(--speculative[a-z-]*)"', FAKE_LAUNCH_SERVER)}
    assert {"--speculative-dflash-block-size", "--speculative-draft-window-size"} <= fake and fake <= known, (
        fake - known
    )
    env = {**os.environ, "FAKE_SGLANG_FIXTURES": str(FIXTURES), "FAKE_SGLANG_STATE": str(tmp_path)}
    script = tmp_path / "launch_server.py"
    script.write_text(FAKE_LAUNCH_SERVER)
    bad = [
        str(script),
        "--model-path",
        "/m",
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(sliding),
        "--speculative-dflash-draft-window-size",
        "16",
    ]
    refused = subprocess.run([sys.executable, *bad], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "unrecognized arguments: --speculative-dflash-draft-window-size" in (
        refused.stderr
    )


def test_kimi_config_gives_the_published_serving_command(tmp_path: Path) -> None:
    cfg = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    flags = sglang_server.drafter_flags(eagle3_folder(tmp_path / "x"), cfg["sglang"])
    cmd = sglang_server.server_command(cfg["target"]["path"], 30000, cfg["sglang"], speculative=flags, python="py")
    line = " ".join(cmd)
    assert "--tp-size 8 " in line and "--mem-fraction-static 0.85" in line
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in line
    assert line.endswith("--trust-remote-code --tool-call-parser kimi_k2 --reasoning-parser kimi_k2")


def test_settings_defaults_match_the_config_schema_and_bad_values_are_refused() -> None:
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())["properties"]["sglang"]["properties"]
    assert set(schema) == set(sglang_server.SGLANG_DEFAULTS)
    for key, prop in schema.items():
        assert sglang_server.SGLANG_DEFAULTS[key] == prop.get("default"), key
    assert sglang_server.sglang_settings({"tp": 2})["concurrency"] == [1]
    for bad in (
        {"tpp": 1},
        {"tp": 0},
        {"concurrency": []},
        {"concurrency": [0]},
        {"mem_fraction_static": 1.5},
        {"extra_args": "--x"},
        {"extra_args": ["--port=1"]},
        {"extra_args": ["--tp", "2"]},
        {"extra_args": ["--speculative-num-steps", "5"]},
        {"extra_args": ["--speculative-draft-window-size", "64"]},  # a drafter's own setting, not every server's
    ):
        with pytest.raises(ValueError):
            sglang_server.sglang_settings(bad)


def test_secrets_are_redacted_from_recorded_commands() -> None:
    argv = [
        "py",
        "--api-key",
        SECRET,
        "--admin-api-key=adm",
        "--hf-token",
        "hf_x",
        "--speculative-num-draft-tokens",
        "4",
        "--max-total-tokens",
        "10",
        "--tool-call-parser",
        "kimi_k2",
    ]
    assert sglang_server.redact_command(argv) == [
        "py",
        "--api-key",
        "***",
        "--admin-api-key=***",
        "--hf-token",
        "***",
        "--speculative-num-draft-tokens",
        "4",
        "--max-total-tokens",
        "10",
        "--tool-call-parser",
        "kimi_k2",
    ]


# ---- recorded response shapes --------------------------------------------------------------------------


def test_generate_response_of_an_eagle3_server() -> None:
    body = fixture("generate_eagle3.json")
    rec = client.parse_generate_response(body)
    meta = body["meta_info"]
    assert rec["error"] is None
    assert rec["completion_tokens"] == 32 == len(rec["output_ids"])
    assert rec["spec_verify_ct"] == 11
    # completion_tokens / spec_verify_ct is SGLang's own per-request spec_accept_length.
    assert rec["spec_accept_length"] == pytest.approx(meta["spec_accept_length"])
    assert rec["finish_reason"] == "length" and rec["e2e_latency_s"] == meta["e2e_latency"]
    assert rec["prompt_tokens"] == meta["prompt_tokens"] and rec["text"] == body["text"]


def test_generate_response_of_a_baseline_server_and_failures() -> None:
    body = fixture("generate_baseline.json")
    rec = client.parse_generate_response(body)
    assert rec["error"] is None and rec["spec_verify_ct"] is None and rec["spec_accept_length"] is None
    assert rec["finish_reason"] == "stop" and rec["output_ids"][-1] == body["meta_info"]["finish_reason"]["matched"]
    aborted = json.loads(json.dumps(body))
    aborted["meta_info"]["finish_reason"] = {
        "type": "abort",
        "message": "out of memory",
        "status_code": 503,
        "err_type": None,
    }
    assert "out of memory" in client.parse_generate_response(aborted)["error"]
    assert client.parse_generate_response({"text": "x"})["error"] == "response has no meta_info"
    assert client.parse_generate_response({"error": {"message": "bad"}})["error"].startswith("server error")


def test_server_info_shapes() -> None:
    eagle = client.parse_server_info(fixture("server_info_eagle3.json"))
    assert eagle["avg_spec_accept_length"] == pytest.approx(2.8731884057971016)
    assert eagle["fields"]["version"] == "0.5.23" and eagle["fields"]["speculative_num_draft_tokens"] == 4
    assert "api_key" not in eagle["fields"] and "launch_command" not in eagle["fields"]
    # 0.5.23 sizes decode and prefill CUDA graphs separately; both are kept, and the counter's fold interval.
    assert eagle["fields"]["cuda_graph_max_bs_decode"] == 64 and "cuda_graph_max_bs_prefill" in eagle["fields"]
    assert eagle["fields"]["decode_log_interval"] == 40 and "cuda_graph_max_bs" not in eagle["fields"]
    assert client.parse_server_info({"cuda_graph_max_bs": 32})["fields"] == {"cuda_graph_max_bs": 32}  # older
    # A DFLASH server as 0.5.23 resolves it (provenance.json, dflash): one step, topk 1, the block as draft tokens.
    dflash = client.parse_server_info(fixture("server_info_dflash.json"))
    assert dflash["fields"]["speculative_algorithm"] == "DFLASH" and dflash["avg_spec_accept_length"] == 4.21875
    assert [dflash["fields"][f"speculative_{k}"] for k in ("num_steps", "eagle_topk", "num_draft_tokens")] == [1, 1, 8]
    assert dflash["fields"]["speculative_draft_window_size"] is None and dflash["fields"]["max_running_requests"] == 48
    launch = fixture("server_info_dflash.json")["launch_command"].split()
    assert {a for a in launch if a.startswith("--speculative")} <= spec_flags_of_0523()
    assert client.parse_server_info(fixture("server_info_baseline.json"))["avg_spec_accept_length"] is None
    assert client.parse_server_info(fixture("server_info_legacy.json"))["avg_spec_accept_length"] == 2.61
    two_dp = {"internal_states": [{"avg_spec_accept_length": 2.0}, {"avg_spec_accept_length": 3.0}]}
    assert client.parse_server_info(two_dp)["avg_spec_accept_length"] == 2.5
    assert client.parse_server_info(None)["avg_spec_accept_length"] is None


# ---- statistics -----------------------------------------------------------------------------------------


def _rec(pid, ids, latency=1.0, verify=None, error=None):
    return {
        "id": pid,
        "latency_s": latency,
        "e2e_latency_s": latency,
        "prompt_tokens": 5,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "spec_verify_ct": verify,
        "spec_accept_length": len(ids) / verify if verify else None,
        "finish_reason": "length",
        "output_ids": ids,
        "text": "".join(map(chr, ids)),
        "error": error,
    }


def test_mode_statistics_and_lossless_comparison() -> None:
    recs = [
        _rec("a", [1, 2, 3, 4], 0.5, verify=2),
        _rec("b", [5, 6], 1.0, verify=1),
        {"id": "c", "latency_s": 3.0, "error": "HTTP 500: boom"},
    ]
    s = sglang_stats.mode_stats(recs, wall_s=2.0, server_avg_spec_accept_length=2.2)
    assert (s["requests"], s["ok"], s["failed"], s["output_tokens"]) == (3, 2, 1, 6)
    assert s["output_tokens_per_s"] == 3.0 and s["per_request_tokens_per_s_mean"] == pytest.approx((8 + 2) / 2)
    assert s["spec_accept_length_mean"] == 2.0 and s["spec_accept_length"] == 2.0 and s["spec_verify_ct"] == 3
    assert s["errors"] == ["c: HTTP 500: boom"] and s["finish_reasons"] == {"length": 2}
    assert [p["id"] for p in s["per_request"]] == ["a", "b", "c"]
    assert s["server_avg_spec_accept_length"] == 2.2 and s["cache_flushed"] is None

    cmp = sglang_stats.compare_outputs(
        [_rec("a", [1, 2, 3]), _rec("b", [4, 5])], [_rec("a", [1, 2, 9]), _rec("b", [4, 5])], "kimi-dflash"
    )
    assert cmp["compared_on"] == "output_ids" and (cmp["compared"], cmp["identical"]) == (2, 1)
    assert cmp["first_differing"] == [
        {"id": "a", "first_diff": 2, "baseline_tokens": 3, "kimi-dflash_tokens": 3, "logit_gap": None}
    ]
    assert cmp["divergences"] == [{"id": "a", "first_diff": 2, "logit_gap": None}]
    ngram = sglang_stats.compare_outputs([_rec("a", [1, 2])], [_rec("a", [1, 3])], "ngram", {"a": 0.25})
    assert ngram["first_differing"][0]["ngram_tokens"] == 2 and ngram["divergences"][0]["logit_gap"] == 0.25
    no_ids = [{**_rec("a", [1, 2]), "output_ids": None}]
    assert sglang_stats.compare_outputs(no_ids, [_rec("a", [1, 3])], "d")["compared_on"] == "text"
    assert (
        sglang_stats.compare_outputs([_rec("a", [1])], [_rec("a", [1, 2])], "d")["first_differing"][0]["first_diff"]
        == 1
    )


def test_degenerate_outputs_use_the_in_process_benchmarks_definition() -> None:
    """One definition (aerie.tools.degenerate) for both benchmarks: flagged per request, counted, and left out of
    the acceptance figure given without them (a loop is trivially predictable)."""
    from aerie.tools.degenerate import degenerate_flags

    looping = list(range(100, 140)) + [7, 8] * 30  # ends in a two-token cycle
    repetitive = [5, 6, 7, 9] * 5  # too short for the loop check, mostly repeated 4-grams
    varied = list(range(200, 260))
    assert degenerate_flags(looping) == ["loop", "repetitive"] and degenerate_flags(repetitive) == ["repetitive"]
    recs = [
        _rec("loop", looping, verify=10),
        _rec("rep", repetitive, verify=10),
        _rec("ok", varied, verify=30),
        {**_rec("no-ids", varied, verify=20), "output_ids": None},
    ]
    s = sglang_stats.mode_stats(recs, wall_s=1.0, cache_flushed=True)
    assert [p["degenerate"] for p in s["per_request"]] == [["loop", "repetitive"], ["repetitive"], [], None]
    assert s["degenerate_requests"] == 2 and s["cache_flushed"] is True
    assert s["spec_accept_length_mean"] == pytest.approx((10 + 2 + 2 + 3) / 4)
    assert s["spec_accept_length_mean_excluding_degenerate"] == pytest.approx((2 + 3) / 2)


def test_report_json_keeps_id_lists_on_one_line_and_text_untouched() -> None:
    obj = {
        "ids": [1, 22, 333],
        "nested": [[1, 2], [3]],
        "floats": [1.5, 2],
        "flags": [True],
        "empty": [],
        "text": '"[1, 2]" and [3,\n 4]',
        "rows": [{"output_ids": [5, 6]}],
    }
    text = h._dumps(obj)
    assert json.loads(text) == obj
    assert '"ids": [1,22,333]' in text and '"output_ids": [5,6]' in text and text.endswith("}\n")


# ---- prompt sets ------------------------------------------------------------------------------------------


def test_mtbench_and_gsm8k_loaders_on_the_real_files() -> None:
    """The published files (byte-exact copies in tests/fixtures/benchmarks), read by aerie.sources.datasets."""
    mt = benchmark_prompts("mtbench", BENCHMARKS / "mt_bench_questions.jsonl")
    assert len(mt) == 80 and mt[0]["id"] == "mtbench/81" and mt[-1]["id"] == "mtbench/160"
    assert mt[0]["messages"] == [{"role": "user", "content": mt[0]["messages"][0]["content"]}]
    assert mt[0]["messages"][0]["content"].startswith("Compose an engaging travel blog post about a recent trip to")
    first_turns = [json.loads(line)["turns"][0] for line in (BENCHMARKS / "mt_bench_questions.jsonl").open()]
    assert [p["messages"][0]["content"] for p in mt] == first_turns
    gsm = benchmark_prompts("gsm8k", BENCHMARKS / "gsm8k_test.head50.jsonl", max_prompts=5)
    assert [p["id"] for p in gsm] == [f"gsm8k/{i}" for i in range(5)]
    assert gsm[0]["messages"][0]["content"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert len(benchmark_prompts("gsm8k", BENCHMARKS / "gsm8k_test.head50.jsonl")) == 50


def test_humaneval_aerie_and_spec_parsing(tmp_path: Path) -> None:
    he = benchmark_prompts("humaneval")
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0"
    assert "def has_close_elements(" in he[0]["messages"][0]["content"]

    f = tmp_path / "bench.jsonl"
    f.write_text(
        "".join(
            json.dumps(
                {
                    "format": "aerie.prompts/1",
                    "id": f"demo/{i}",
                    "dataset": "demo",
                    "messages": [{"role": "user", "content": f"q{i}"}],
                    "source": {},
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    ps = parse_prompt_set(f"demo=aerie:{f}", max_prompts=2)
    assert (ps.name, ps.kind, ps.source) == ("demo", "aerie", str(f))
    assert ps.prompts == [{"id": f"demo/{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(2)]
    assert parse_prompt_set(f"aerie:{f}").name == "bench" and parse_prompt_set("humaneval").name == "humaneval"

    bad = tmp_path / "mt.jsonl"
    bad.write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(ValueError, match="mt.jsonl:1"):
        benchmark_prompts("mtbench", bad)
    with pytest.raises(ValueError, match="unknown prompt set kind"):
        benchmark_prompts("sharegpt", bad)
    with pytest.raises(ValueError, match="needs a file path"):
        benchmark_prompts("gsm8k")


# ---- command line -------------------------------------------------------------------------------------


def test_cli_help_and_config_defaults(monkeypatch, capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        h.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--sglang-python", "--prompt-set", "--concurrency", "--config", "--drafter", "--out"):
        assert flag in text

    seen = {}
    monkeypatch.setattr(h, "tokenizer_render", lambda path, **kw: seen.setdefault("render", (path, kw)))
    monkeypatch.setattr(
        h, "run_sglang_benchmark", lambda *a, **kw: seen.update(args=a, kw=kw) or {"rows": [], "modes": []}
    )
    h.main(
        [
            "--config",
            str(REPO / "config" / "kimi-k2.5.yaml"),
            "--drafter",
            "d",
            "--drafter",
            "kimi-dflash=results/drafter/x",
            "--out",
            str(tmp_path / "o.json"),
            "--prompt-set",
            "humaneval",
            "--max-prompts",
            "2",
            "--concurrency",
            "1",
            "4",
            "--sglang-python",
            "/envs/sglang/bin/python",
            "--server-env",
            "SGLANG_X=1",
            "--extra-args=--trust-remote-code --api-key k",
            "--reference",
            "ngram",
        ]
    )
    target, drafters, sets, out, run = seen["args"]
    assert (target, out) == ("/models/Kimi-K2.5", tmp_path / "o.json")
    assert drafters == {"d": Path("d"), "kimi-dflash": Path("results/drafter/x")}
    assert [(s.name, len(s.prompts)) for s in sets] == [("humaneval", 2)]
    kw = seen["kw"]
    assert kw["sglang"]["tp"] == 8 and kw["sglang"]["concurrency"] == [1, 4]
    assert kw["sglang"]["extra_args"] == ["--trust-remote-code", "--api-key", "k"]
    assert run.max_new_tokens == 1024 and run.warmup == 2 and run.references == ("ngram",)
    assert kw["control"].sglang_python == "/envs/sglang/bin/python"
    assert kw["control"].server_env == {"SGLANG_X": "1"} and kw["control"].flush_cache
    assert seen["render"] == (
        "/models/Kimi-K2.5",
        {"as_text": False, "trust_remote_code": True, "chat_template_kwargs": {"thinking": True}},
    )


# ---- whole runs against a fake SGLang server ---------------------------------------------------------------

# Launched by the harness as `<sglang python> -m sglang.launch_server ...` (the wrapper puts this package first on
# PYTHONPATH): tests/fixtures/sglang/fake_launch_server.py, SGLang 0.5.23's flags and recorded HTTP shapes (its
# docstring says how it answers).
FAKE_LAUNCH_SERVER = (FIXTURES / "fake_launch_server.py").read_text()


@pytest.fixture()
def fake_sglang(tmp_path: Path):
    pkg = tmp_path / "fakepkg" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    python = tmp_path / "bin" / "sglang-python"
    python.parent.mkdir()
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH="{pkg.parent}${{PYTHONPATH:+:$PYTHONPATH}}"\nexport PYTHONPATH\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    drafter = eagle3_folder(tmp_path / "drafter")
    fake = SimpleNamespace(
        python=str(python),
        state=state,
        drafter=drafter,
        env={"FAKE_SGLANG_FIXTURES": str(FIXTURES), "FAKE_SGLANG_STATE": str(state)},
    )
    yield fake
    for f in state.glob("*.json"):  # never leave a fake behind, even when a test failed
        s = json.loads(f.read_text())
        for pid in (s["pid"], s["child_pid"]):
            if sglang_server.process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def render(messages: list[dict]) -> list[int]:
    return [ord(c) for c in messages[-1]["content"]]


def test_full_run_against_a_fake_sglang_server(fake_sglang, tmp_path: Path) -> None:
    """Two trained drafters of two kinds and three references, each on its own server over the same prompts: the
    EAGLE-3 folder with the configured EAGLE3 flags, the DFlash folder with DFLASH and its block, SGLang's NGRAM at the
    chain's width and at its own, a published EAGLE-3 folder with its kind's flags."""
    chat = PromptSet(
        "chat",
        [
            {"id": "chat/0", "messages": _user("hello there")},
            {"id": "chat/1", "messages": _user("DIVERGE here")},
            {"id": "chat/2", "messages": _user("odd!")},
            {"id": "chat/3", "messages": _user("LOOP odd one")},
        ],
    )
    maths = PromptSet("math", [{"id": f"math/{i}", "messages": _user("2+2=?" + "x" * i)} for i in range(3)])
    sglang = {
        "tp": 2,
        "mem_fraction_static": 0.5,
        "concurrency": [1, 3],
        "extra_args": ["--trust-remote-code", "--api-key", SECRET, "--context-length", "4096"],
    }
    out = tmp_path / "bench" / "run.json"
    logs: list[str] = []
    published = tmp_path / "published"  # a reference drafter folder: another EAGLE-3 server, its kind's flags
    published.mkdir()
    (published / "config.json").write_text(
        json.dumps({**json.loads((fake_sglang.drafter / "config.json").read_text()), "fake_accept": 4})
    )
    dflash = dflash_folder(tmp_path / "results" / "drafter" / "run-dflash", block_size=4)
    drafters = {"run": fake_sglang.drafter, "run-dflash": dflash}
    report = h.run_sglang_benchmark(
        "/models/target",
        drafters,
        [chat, maths],
        out,
        BenchRun(max_new_tokens=24, warmup=1, references=("ngram", "ngram_default", "org/published")),
        sglang=sglang,
        control=h.ServerControl(sglang_python=fake_sglang.python, server_env=fake_sglang.env, stop_grace_s=0.5),
        render=render,
        reference_drafters={"org/published": published},
        log=logs.append,
    )

    assert json.loads(out.read_text()) == report
    assert report["format"] == "aerie.sglang-bench/5" and report["complete"] and report["error"] is None
    modes = ["baseline", "run", "run-dflash", "ngram", "ngram_default", "org/published"]
    assert report["modes"] == modes
    assert {m: (v["role"], v["kind"], v["draft_tokens"]) for m, v in report["methods"].items()} == {
        "run": ("trained", "eagle3", 3),
        "run-dflash": ("trained", "dflash", 3),  # block 4: 3 drafts a step
        "ngram": ("ngram", None, 3),
        "ngram_default": ("ngram_default", None, 11),
        "org/published": ("drafter", "eagle3", 3),
    }
    assert {m: (d["kind"], d["folder"]) for m, d in report["drafters"].items()} == {
        "run": ("eagle3", str(fake_sglang.drafter)),
        "run-dflash": ("dflash", str(dflash)),
    }
    assert report["drafters"]["run-dflash"]["config"]["architectures"] == ["DFlashDraftModel"]
    assert report["reference_drafters"]["org/published"]["folder"] == str(published)
    assert "flush_cache" in report["notes"]["acceptance"] and "prefill" in report["notes"]["acceptance"]
    assert SECRET not in out.read_text()
    assert report["input"] == "input_ids" and report["sampling"] == {
        "temperature": 0.0,
        "max_new_tokens": 24,
        "skip_special_tokens": False,
    }

    # What each server process was really started with: the harness's command line, through the sglang python.
    flags = {
        "baseline": [],
        "run": sglang_server.drafter_flags(fake_sglang.drafter, sglang),
        "run-dflash": sglang_server.drafter_flags(dflash, sglang),
        "ngram": sglang_server.ngram_flags(sglang, at_chain_width=True),
        "ngram_default": sglang_server.ngram_flags(sglang, at_chain_width=False),
        "org/published": sglang_server.drafter_flags(published, sglang),
    }
    assert flags["run-dflash"][:2] == ["--speculative-algorithm", "DFLASH"] and flags["run"][1] == "EAGLE3"
    drafter_servers = ("run", "run-dflash", "org/published")
    for mode in modes:
        st = json.loads((fake_sglang.state / f"{h._file_name(mode)}.json").read_text())
        port = int(st["argv"][st["argv"].index("--port") + 1])
        cmd = sglang_server.server_command("/models/target", port, sglang, speculative=flags[mode])
        assert report["servers"][mode]["log"].endswith(f"run.{h._file_name(mode)}.server.log")
        assert st["argv"] == cmd[3:]
        server = report["servers"][mode]
        assert server["command"][0] == fake_sglang.python and "***" in server["command"]
        assert server["command"][3:] == sglang_server.redact_command(st["argv"])
        assert server["ready_s"] > 0.3 and server["error"] is None
        assert server["server_info_endpoint"] == "/get_server_info"  # /server_info is absent: fallback taken
        assert server["server_info"]["version"] == "0.5.23" and "api_key" not in server["server_info"]
        # Warm-up + every prompt at every concurrency, authenticated, greedy, ids, special tokens kept.
        probes = len(st["probes"])
        assert st["requests"] == 1 + 2 * (4 + 3) + probes and st["unauthorized"] == 0 and st["bad_shape"] == 0
        # The outputs that left the baseline's (chat/1 on each drafter's server, at both concurrency levels) were
        # probed, untimed, at the first differing token: prompt + the baseline's 12 tokens before it.
        want = [{"prompt_tokens": len("DIVERGE here") + 12, "position": 12}] * 2 if mode in drafter_servers else []
        assert st["probes"] == want
        assert st["flushes"] == 4
        assert all(
            b["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 24, "skip_special_tokens": False}
            and set(b) == {"input_ids", "sampling_params"}
            for b in st["bodies"]
        )
        # Stopped: the server and its SIGTERM-ignoring worker are gone; the worker had to be killed.
        assert {st["pid"], st["child_pid"]} <= set(server["pids"])
        assert not sglang_server.process_alive(st["pid"]) and not sglang_server.process_alive(st["child_pid"])
        assert server["leftover_pids_killed"] == [st["child_pid"]]
        assert (server["role"], server["kind"]) == (
            ("baseline", None)
            if mode == "baseline"
            else (report["methods"][mode]["role"], report["methods"][mode]["kind"])
        )
    assert report["servers"]["run"]["server_info"]["speculative_num_steps"] == 3
    # DFLASH as 0.5.23 resolves it (_handle_dflash): one step, topk 1, the block as the draft tokens, 48 requests.
    dinfo = report["servers"]["run-dflash"]["server_info"]
    assert dinfo["speculative_algorithm"] == "DFLASH" and dinfo["speculative_draft_model_path"] == str(dflash)
    assert (dinfo["speculative_num_steps"], dinfo["speculative_eagle_topk"]) == (1, 1)
    assert dinfo["speculative_num_draft_tokens"] == 4 and dinfo["max_running_requests"] == 48
    assert dinfo["speculative_draft_window_size"] is None and dinfo["speculative_draft_attention_backend"] == "fa3"
    # NGRAM at the EAGLE-3 server's width (4 draft tokens in one chain), and at SGLang's own defaults (_handle_ngram):
    # a breadth-10 tree of 12 draft tokens.
    ngram_info = report["servers"]["ngram"]["server_info"]
    assert ngram_info["speculative_algorithm"] == "NGRAM" and ngram_info["speculative_num_draft_tokens"] == 4
    assert ngram_info["speculative_eagle_topk"] == 1
    wide = report["servers"]["ngram_default"]["server_info"]
    assert wide["speculative_algorithm"] == "NGRAM" and wide["speculative_num_draft_tokens"] == 12
    assert wide["speculative_eagle_topk"] == 10 and wide["max_running_requests"] == 48
    assert report["servers"]["org/published"]["server_info"]["speculative_draft_model_path"] == str(published)

    # The fake keeps SGLang 0.5.23's counter: reset by /flush_cache, decode-step tokens only. Its value is reported
    # as read; the acceptance figure is the per-request mean of completion_tokens / spec_verify_ct.
    def server_counter(ps: PromptSet, accept: int = 3) -> float:
        ns = [24 if len(p["messages"][0]["content"]) % 2 == 0 else 12 for p in ps.prompts]
        return sum(n - 1 for n in ns) / sum(-(-n // accept) for n in ns)

    assert report["servers"]["run"]["server_info"]["avg_spec_accept_length"] == pytest.approx(server_counter(maths))
    assert report["servers"]["baseline"]["server_info"]["avg_spec_accept_length"] is None
    assert report["versions"]["sglang"] == "0.5.23"

    rows = report["rows"]
    assert [(r["set"], r["concurrency"], r["prompts"]) for r in rows] == [
        ("chat", 1, 4),
        ("chat", 3, 4),
        ("math", 1, 3),
        ("math", 3, 3),
    ]
    # The fake answers max_new_tokens for an even prompt length, half of it for an odd one.
    expected_tokens = {
        ps.name: sum(24 if len(p["messages"][0]["content"]) % 2 == 0 else 12 for p in ps.prompts)
        for ps in (chat, maths)
    }
    for r in rows:
        b, e, d = r["baseline"], r["run"], r["run-dflash"]
        for s in (b, e, d):
            assert s["ok"] == r["prompts"] and s["failed"] == 0
            assert s["output_tokens"] == expected_tokens[r["set"]]
            assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
            assert s["per_request_tokens_per_s_mean"] > 0 and s["cache_flushed"] is True
            assert s["degenerate_requests"] == (1 if r["set"] == "chat" else 0)
            assert [p["degenerate"] != [] for p in s["per_request"]] == [p["id"] == "chat/3" for p in s["per_request"]]
        assert b["spec_accept_length_mean"] is None and b["server_avg_spec_accept_length"] is None
        assert all(p["spec_verify_ct"] is None for p in b["per_request"])
        assert e["spec_accept_length_mean"] == 3.0 and e["spec_accept_length"] == 3.0
        assert e["spec_accept_length_mean_excluding_degenerate"] == 3.0
        counter = server_counter(chat if r["set"] == "chat" else maths)  # this run's requests only: flushed before
        assert e["server_avg_spec_accept_length"] == pytest.approx(counter) and counter < 3.0
        assert [p["spec_verify_ct"] for p in e["per_request"]] == [
            c // 3 for c in (p["completion_tokens"] for p in e["per_request"])
        ]
        # The DFLASH server answers in EAGLE3's meta_info shape: 4 tokens a verify step, all 3 drafts accepted.
        assert d["spec_accept_length"] == 4.0 and d["correct_drafts_histogram"] == [0, 0, 0, d["spec_verify_ct"]]
        versus = r["versus"]
        assert set(versus) == set(modes[1:])
        assert versus["run"]["speedup"] == pytest.approx(e["output_tokens_per_s"] / b["output_tokens_per_s"])
        assert versus["run"]["speedup"] > 1.3  # simulated: 4 ms per token vs 5 ms per 3 tokens
        lossless = versus["run"]["lossless"]
        if r["set"] == "chat":
            assert (lossless["compared"], lossless["identical"], lossless["differing"]) == (4, 3, 1)
            assert lossless["first_differing"] == [
                {"id": "chat/1", "first_diff": 12, "baseline_tokens": 24, "run_tokens": 24, "logit_gap": 3.0}
            ]
        else:
            assert (lossless["compared"], lossless["identical"]) == (3, 3)

        # SGLang's NGRAM reference: its own acceptance (2 tokens per verify step here), the same outputs.
        ng, ref = r["ngram"], versus["ngram"]
        assert ng["spec_accept_length_mean"] == 2.0 and ng["correct_drafts_histogram"] == [
            0,
            sum(p["spec_verify_ct"] for p in ng["per_request"]),
        ]
        assert ref["lossless"]["identical"] == r["prompts"] and ref["speedup"] > 1.0
        assert e["correct_drafts_histogram"] == [0, 0, e["spec_verify_ct"]]

    s = report["summary"]
    run = s["modes"]["run"]
    assert run["lossless"] == {"compared": 14, "identical": 12, "differing": 2, "all_identical": False}
    assert (
        s["modes"]["run-dflash"]["lossless"]["differing"] == 2 and s["modes"]["run-dflash"]["spec_accept_length"] == 4.0
    )
    assert s["modes"]["ngram"]["spec_accept_length_mean"] == 2.0
    assert s["modes"]["ngram"]["lossless"]["all_identical"] is True
    assert all(c["speedup"]["ngram"] > 1.0 for c in s["by_concurrency"])
    assert s["baseline_cross_concurrency"] == {"compared": 7, "identical": 7}
    assert run["spec_accept_length_mean"] == 3.0 and run["spec_accept_length_mean_excluding_degenerate"] == 3.0
    assert run["server_avg_spec_accept_length"] == pytest.approx(server_counter(maths))  # the last reading
    assert s["degenerate_requests"] == dict.fromkeys(modes, 2)
    pub = s["modes"]["org/published"]
    assert pub["spec_accept_length_mean"] == 4.0 and pub["lossless"]["differing"] == 2  # its DIVERGE outputs
    # One name per acceptance definition: aerie's leaves the prefill token out, SGLang's counts it.
    assert run["spec_accept_length"] == 3.0 and run["acceptance_length"] == pytest.approx(
        (sum(p["completion_tokens"] - 1 for r in rows for p in r["run"]["per_request"]))
        / sum(p["spec_verify_ct"] for r in rows for p in r["run"]["per_request"])
    )
    assert [c["concurrency"] for c in s["by_concurrency"]] == [1, 3]
    assert all(c["speedup"]["run"] > 1.3 and set(c["output_tokens_per_s"]) == set(modes) for c in s["by_concurrency"])
    assert run["speedup_min"] <= run["speedup_geomean"] <= run["speedup_max"]
    assert s["failed_requests"] == dict.fromkeys(modes, 0)
    assert any("killed processes left by the server" in m for m in logs)


def test_a_server_that_fails_to_start_leaves_a_partial_report_and_nothing_running(fake_sglang, tmp_path) -> None:
    prompts = PromptSet("p", [{"id": "p/0", "messages": _user("ab")}, {"id": "p/1", "messages": _user("abc")}])
    out = tmp_path / "run.json"
    with pytest.raises(RuntimeError, match="exited with code 1") as e:
        h.run_sglang_benchmark(
            "/models/target",
            {"run": fake_sglang.drafter},
            [prompts],
            out,
            BenchRun(max_new_tokens=6, warmup=0, references=()),
            sglang={"concurrency": [2]},
            control=h.ServerControl(
                sglang_python=fake_sglang.python,
                server_env={**fake_sglang.env, "FAKE_SGLANG_FAIL_EAGLE3": "1"},
                stop_grace_s=0.5,
                record_outputs=False,
            ),
            render=render,
            log=lambda m: None,
        )
    assert "draft model vocab does not match" in str(e.value)  # the server log's tail is in the message
    report = json.loads(out.read_text())
    assert not report["complete"] and report["error"].startswith("run: RuntimeError")
    row = report["rows"][0]
    assert row["baseline"]["ok"] == 2 and row["run"] is None
    assert row["versus"]["run"] == {"speedup": None, "speedup_per_request": None, "lossless": None}
    assert [p["completion_tokens"] for p in row["baseline"]["per_request"]] == [6, 3]
    assert all(p["output_ids"] is None and p["text"] is None for p in row["baseline"]["per_request"])  # no outputs
    assert report["servers"]["run"]["command"][3:7] == ["--model-path", "/models/target", "--tp-size", "1"]
    base = json.loads((fake_sglang.state / "baseline.json").read_text())
    assert not sglang_server.process_alive(base["pid"]) and not sglang_server.process_alive(base["child_pid"])
    assert not (fake_sglang.state / "run.json").exists()
