"""The bench rule with ``bench.backend: sglang``: its script function (aerie.bench.job.gated_benchmark) drives the
serving harness against the stand-in SGLang (tests/fixtures/sglang/fake_launch_server.py: SGLang 0.5.23's flags and
recorded HTTP shapes) started as a real subprocess with this interpreter, as the job starts SGLang with its env's
Python: the baseline, the trained drafter with the config's EAGLE-3 flags and SGLang's NGRAM reference; it writes the
in-process benchmark's report and plot, and the shared gate passes or fails the job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from tiny_world import char_chat_tokenizer, write_prompts

from aerie.bench import sglang_server
from aerie.bench.job import gated_benchmark
from aerie.drafter.model import Eagle3Drafter
from aerie.drafter.shape import DrafterConfig

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
SPECIALS = ["<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SGLANG = {"tp": 1, "concurrency": [1, 2], "extra_args": ["--trust-remote-code"]}


@pytest.fixture()
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A target folder (a character tokenizer with a chat template: what the job renders prompts with), a drafter
    folder, two datasets' bench prompts, and the stand-in importable as ``sglang`` by this interpreter."""
    tok, vocab = char_chat_tokenizer(SPECIALS)
    target = tmp_path / "target"
    tok.save_pretrained(target)
    drafter = tmp_path / "results" / "drafter" / "run"
    drafter.mkdir(parents=True)
    # A real drafter folder (config.json + weights, as aerie exports it): references are checked tensor for tensor.
    shape = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=len(vocab),
        draft_vocab_size=64,
        aux_layer_ids=[1, 2, 3],
    )
    torch.manual_seed(0)
    Eagle3Drafter(shape).save_pretrained(drafter)
    (drafter / "eval.json").write_text(json.dumps({"simulated_acceptance_length_by_steps": [1.9, 2.6, 2.9]}))
    prompt_files = []
    for name, texts in (
        ("chat", ["hello there, how are you", "TIE breaks here", "LOOP forever and ever"]),
        ("math", ["what is 12+30?", "sort 3 1 2 please"]),
    ):
        path = tmp_path / "results" / name / "prompts" / "bench.jsonl"
        path.parent.mkdir(parents=True)
        write_prompts(path, texts, dataset=name)
        prompt_files.append(path)
    pkg = tmp_path / "fakepkg" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text((FIXTURES / "fake_launch_server.py").read_text())
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(pkg.parent), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FAKE_SGLANG_FIXTURES", str(FIXTURES))
    monkeypatch.setenv("FAKE_SGLANG_STATE", str(state))
    monkeypatch.setenv("FAKE_SGLANG_WORKER_STOPS", "1")  # the harness test covers killing one that does not
    # The stand-in's triggers in this tokenizer's ids (its default is character codes).
    triggers = {word: [vocab[c] for c in word] for word in ("DIVERGE", "TIE", "LOOP")}
    monkeypatch.setenv("FAKE_SGLANG_TRIGGERS", json.dumps(triggers))
    yield {"target": target, "drafter": drafter, "prompts": prompt_files, "state": state, "out": tmp_path / "bench"}
    for f in state.glob("*.json"):  # never leave a stand-in behind, even when a test failed
        s = json.loads(f.read_text())
        for pid in (s["pid"], s["child_pid"]):
            if sglang_server.process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def bench_settings(**gate) -> dict:
    """config bench: as the schema fills it, with bench.backend sglang."""
    return {
        "backend": "sglang",
        "max_new_tokens": 24,
        "num_draft_steps": 3,
        "repeats": 1,
        "warmup": 1,
        "gate": {"min_speedup": 1.0, "must_beat_references": True, "max_simulated_gap": None, **gate},
    }


def run(world: dict, bench: dict, logs: list[str]) -> dict:
    out = world["out"] / "run.json"
    return gated_benchmark(
        {"path": str(world["target"]), "trust_remote_code": False},
        world["drafter"],
        world["prompts"],
        out,
        out.with_suffix(".png"),
        bench,
        sglang=SGLANG,
        threads=1,
        log=logs.append,
    )


def test_sglang_backend_writes_the_in_process_report_and_passes_the_gate(world: dict) -> None:
    logs: list[str] = []
    report = run(world, bench_settings(lossless_max_gap=0.5), logs)
    out = world["out"] / "run.json"
    assert json.loads(out.read_text()) == report and (world["out"] / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert any(line.startswith("gate passed") for line in logs), logs

    # The three servers, each with the flags of its mode, through this interpreter (the job's environment).
    for mode in ("baseline", "eagle3", "ngram"):
        st = json.loads((world["state"] / f"{mode}.json").read_text())
        port = int(st["argv"][st["argv"].index("--port") + 1])
        drafter = world["drafter"] if mode == "eagle3" else None
        want = sglang_server.server_command(str(world["target"]), port, SGLANG, drafter_dir=drafter, mode=mode)
        assert [sys.executable, "-m", "sglang.launch_server", *st["argv"]] == want
        assert st["bad_shape"] == 0 and st["flushes"] == 2 * 2  # 2 datasets x 2 concurrency levels

    # The in-process benchmark's schema: every key it writes (format 2), the same meaning.
    inprocess_keys = {
        "format",
        "target",
        "drafter",
        "prompt_files",
        "prompts",
        "num_draft_steps",
        "max_new_tokens",
        "repeats",
        "warmup",
        "timing",
        "baseline",
        "speculative",
        "speedup",
        "speedup_median_paired",
        "acceptance_length",
        "acceptance_length_excluding_degenerate",
        "acceptance_per_position",
        "accepted_per_position",
        "drafted_per_position",
        "lossless",
        "divergences",
        "methods",
        "beats_references",
        "simulated_acceptance_length",
        "simulated_vs_measured",
        "degenerate_prompts",
        "eos_token_ids",
        "aux_layer_ids",
        "device",
        "dtype",
        "versions",
        "per_prompt",
        "backend",
        "sets",
        "failed_requests",
        "spec_accept_length",
        "gate",
    }
    assert inprocess_keys <= set(report), inprocess_keys - set(report)
    assert report["format"] == "aerie.bench/3" and report["backend"] == "sglang"
    assert report["prompts"] == 5 and report["num_draft_steps"] == 3 and set(report["methods"]) == {"eagle3", "ngram"}
    # Speed at the worst concurrency level; every level listed.
    assert report["concurrency"] in (1, 2) and [lv["concurrency"] for lv in report["by_concurrency"]] == [1, 2]
    worst = min(
        min(lv["methods"]["eagle3"]["speedup"], lv["methods"]["eagle3"]["speedup_median_paired"])
        for lv in report["by_concurrency"]
    )
    assert min(report["speedup"], report["speedup_median_paired"]) == pytest.approx(worst)
    assert report["speedup"] == pytest.approx(
        report["speculative"]["tokens_per_s"] / report["baseline"]["tokens_per_s"]
    )
    assert report["speedup"] > 1.3  # stand-in: 5 ms per 3 tokens vs 4 ms per token
    # Acceptance: committed tokens per verify step without the prefill token; per position from SGLang's histogram.
    e = report["methods"]["eagle3"]
    reqs = [p for r in report["per_prompt"] for p in [r["methods"]["eagle3"]]]
    assert e["acceptance_length"] > report["methods"]["ngram"]["acceptance_length"] > 1.0
    assert report["beats_references"] is True
    assert e["acceptance_per_position"] == [1.0, 1.0, 0.0]  # the stand-in accepts 2 drafts every step
    assert all(p["verify_steps"] > 0 for p in reqs)
    tie = next(p for p in report["per_prompt"] if p["id"] == "chat/1")  # the trained drafter's values at the top too
    assert (tie["lossless"], tie["first_mismatch"]) == (False, 12) and tie["speedup"] == tie["methods"]["eagle3"][
        "speedup"
    ]
    assert report["simulated_acceptance_length"] == 2.9  # the drafter's eval for 3 steps
    # Lossless: the TIE prompt's EAGLE3 output left the baseline's, at a near-tie (0.02) that the gate tolerates.
    divs = report["divergences"]
    assert {(d["method"], d["id"], d["concurrency"]) for d in divs} == {
        ("eagle3", "chat/1", 1),
        ("eagle3", "chat/1", 2),
    }
    assert all(d["logit_gap"] == pytest.approx(0.02) and d["first_diff"] == 12 for d in divs)
    assert report["lossless"] is False and report["methods"]["ngram"]["lossless"] is True
    assert report["degenerate_prompts"] == ["chat/2"]
    # The harness's own report beside it, and the report figure reads the bench JSON alone.
    serving = json.loads(Path(report["serving_report"]).read_text())
    assert serving["format"] == "aerie.sglang-bench/4" and serving["modes"] == ["baseline", "eagle3", "ngram"]
    # One table per set (a dataset's held-out prompts), every drafter side by side; SGLang's acceptance beside aerie's.
    assert list(report["sets"]) == ["chat", "math"] and report["sets"]["math"]["prompts"] == 2
    for table in report["sets"].values():
        assert set(table["methods"]) == {"eagle3", "ngram"} and table["methods"]["eagle3"]["failed_requests"] == 0
        assert table["methods"]["eagle3"]["spec_accept_length"] == pytest.approx(3.0)  # completion / verify
        assert table["methods"]["ngram"]["spec_accept_length"] == pytest.approx(2.0)
    assert report["failed_requests"] == {"baseline": 0, "eagle3": 0, "ngram": 0}
    assert report["gate"]["passed"] is True and report["gate"]["serve"] == "eagle3"
    from aerie.report import figure_benchmark

    summary = figure_benchmark(out, world["out"] / "figure.png")
    assert summary["speedup"] == report["speedup"] and set(summary["sglang_speedup"]) == {1, 2}


def test_sglang_backend_fails_the_job_on_the_shared_gate(world: dict) -> None:
    """Outputs identical required (lossless_max_gap 0) and an impossible speed goal: the job fails, naming both, and
    keeps the report under gate-failed names (Snakemake deletes a failed job's outputs)."""
    logs: list[str] = []
    with pytest.raises(SystemExit) as failed:
        run(world, bench_settings(min_speedup=50.0, lossless_max_gap=0.0), logs)
    message = str(failed.value)
    assert message.startswith("the drafter does not pay off: speedup ") and "below bench.gate.min_speedup 50" in message
    assert "at concurrency" in message and "eagle3 on chat/1 at concurrency 1 from token 12" in message
    assert not (world["out"] / "run.json").exists() and not (world["out"] / "run.png").exists()
    kept = json.loads((world["out"] / "run.gate-failed.json").read_text())
    assert kept["backend"] == "sglang" and (world["out"] / "run.gate-failed.png").exists()


def test_kimi_config_benchmarks_under_sglang_against_ngram_and_the_published_drafters(tmp_path: Path) -> None:
    from aerie.bench.settings import bench_references, check_bench_config

    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    assert config["bench"]["backend"] == "sglang" and bench_references(config["bench"]) == [
        "ngram",
        "ngram_default",
        "lightseekorg/kimi-k2.5-eagle3",
        "lightseekorg/kimi-k2.5-eagle3-mla",
    ]
    refs = check_bench_config(config, tmp_path)  # not in this machine's Hub cache: named, not refused
    assert [r.missing is not None for r in refs] == [False, False, True, True]
    assert "lightseekorg/kimi-k2.5-eagle3" in refs[2].missing and refs[2].folder is None
    with pytest.raises(ValueError, match=r"bench.references: untrained cannot run with bench.backend: sglang"):
        check_bench_config({**config, "bench": {**config["bench"], "references": ["untrained", "ngram"]}})
    with pytest.raises(ValueError, match=r"sglang.tp: 8 GPUs per server, but rule bench gets resources.bench_gpus: 4"):
        check_bench_config({**config, "resources": {**config["resources"], "bench_gpus": 4}})


def test_a_reference_folder_that_does_not_fit_the_target_is_refused_at_parse_time_naming_it(tmp_path: Path) -> None:
    """A drafter folder that is here is read with the drafter folder reader against the target's config (the Kimi
    config's described target: vocab 163,840, hidden 7,168): a folder written by SpecForge for a small target is
    refused, naming the folder and each reason; the same folder passes against its own target."""
    import shutil

    from aerie.bench.settings import check_bench_config

    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    shutil.copytree(REPO / "tests" / "fixtures" / "specforge_drafter", tmp_path / "specforge")
    bench = {**config["bench"], "references": ["ngram", "specforge"]}
    with pytest.raises(ValueError) as refused:
        check_bench_config({**config, "bench": bench}, tmp_path)
    text = str(refused.value)
    assert text.startswith(f"bench.references: specforge ({tmp_path / 'specforge'}) does not fit the target: ")
    assert "config.json vocab_size 160 != the target's vocab size 163840" in text, text
    assert "the target has 7168" in text, text
    own = {"path": str(tmp_path / "specforge" / "target")}  # the folder's own target: it fits
    (refs,) = [
        r for r in check_bench_config({**config, "target": own, "bench": bench}, tmp_path) if r.kind == "drafter"
    ]
    assert refs.folder == tmp_path / "specforge"


def test_the_bench_rule_runs_the_sglang_backend_and_fails_on_the_gate(world: dict, tmp_path: Path) -> None:
    """`snakemake results/bench/run.json` with bench.backend sglang: the rule's parse-time checks, its environment
    check (sglang importable by Snakemake's Python: the stand-in), params and script, against the stand-in servers;
    a drafter short of bench.gate.min_speedup fails the job, whose report is kept under the gate-failed name."""
    import subprocess

    work = tmp_path / "work"
    (work / "prompts").mkdir(parents=True)
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question number {i}?"}]} for i in range(6)]
    (work / "prompts" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drafter = work / "results" / "drafter" / "run"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text((world["drafter"] / "config.json").read_text())
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config.update(
        run="run",
        target={"path": str(world["target"]), "device": "cpu", "dtype": "float32", "num_hidden_layers": 8},
        datasets={
            "chat": {
                "source": {
                    "kind": "jsonl",
                    "path": "prompts/chat.jsonl",
                    "messages_field": "messages",
                    "id_field": "id",
                },
                "shard_size": 2,
                "bench_prompts": 3,
            }
        },
        bench={"backend": "sglang", "max_new_tokens": 24, "warmup": 0, "gate": {"min_speedup": 50.0}},
        sglang={"tp": 1, "concurrency": [1]},
        resources={"responses_gpus": 0, "hidden_gpus": 0, "drafter_gpus": 0, "bench_gpus": 1},
    )
    configfile = work / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work)]
    cmd += ["results/bench/run.json", "--cores", "1", "--allowed-rules", "bench", "bench_prompts"]
    proc = subprocess.run([*cmd, "--configfile", str(configfile)], capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out  # the gate failed the job
    log = (work / "results" / "logs" / "bench" / "run.log").read_text()
    assert "the drafter does not pay off: speedup" in log and "below bench.gate.min_speedup 50" in log, log
    kept = json.loads((work / "results" / "bench" / "run.gate-failed.json").read_text())
    assert kept["backend"] == "sglang" and kept["prompts"] == 3 and set(kept["methods"]) == {"eagle3", "ngram"}
    assert kept["speedup"] > 1.3 and kept["lossless"] is True and kept["beats_references"] is True
    assert not (work / "results" / "bench" / "run.json").exists()
    assert json.loads((work / "results" / "bench" / "run.sglang.json").read_text())["complete"] is True


def test_a_published_drafter_folder_is_served_with_the_same_flags_and_a_loss_to_it_fails_per_set(world: dict) -> None:
    """bench.references names a drafter folder (here a path; a Hub id resolves in the offline cache): another EAGLE-3
    server with the trained drafter's flags, on the same prompts. It accepts more (the stand-in: 4 tokens per verify
    step vs 3), so the gate fails on every set, naming it and the figures, and says to serve it instead."""
    published = world["out"].parent / "published"
    shutil.copytree(world["drafter"], published)  # the weights: a reference folder is checked tensor for tensor
    cfg = json.loads((world["drafter"] / "config.json").read_text())
    (published / "config.json").write_text(json.dumps({**cfg, "fake_accept": 4}))
    logs: list[str] = []
    with pytest.raises(SystemExit) as failed:
        run(world, {**bench_settings(lossless_max_gap=0.5), "references": ["ngram", str(published)]}, logs)
    message = str(failed.value)
    for name in ("chat", "math"):
        assert f"set {name}: the trained drafter's acceptance length " in message
        assert f"does not beat reference {published}'s " in message
    assert f"serve {published} instead" in message
    st = json.loads((world["state"] / f"{sglang_server.DRAFTER_MODE}.json").read_text())
    from aerie.bench.sglang_harness import _file_name

    ref = json.loads((world["state"] / f"{_file_name(str(published))}.json").read_text())
    flags = [a for a in st["argv"] if a.startswith("--speculative")]
    assert [a for a in ref["argv"] if a.startswith("--speculative")] == flags  # the same flags, its own folder
    assert ref["argv"][ref["argv"].index("--speculative-draft-model-path") + 1] == str(published)
    kept = json.loads((world["out"] / "run.gate-failed.json").read_text())
    assert kept["methods"][str(published)]["kind"] == "drafter" and kept["gate"]["serve"] == str(published)
    table = kept["sets"]["chat"]["methods"]
    assert table[str(published)]["acceptance_length"] > table["eagle3"]["acceptance_length"]


def test_a_server_that_dies_mid_run_fails_the_gate_with_its_failed_requests(world, monkeypatch) -> None:
    """The NGRAM server crashes after a few answers: every later request fails fast. They are counted per arm (and
    set), never dropped from the figures silently, and the gate fails on them."""
    monkeypatch.setenv("FAKE_SGLANG_DIE_AFTER", "ngram:3")
    logs: list[str] = []
    with pytest.raises(SystemExit) as failed:
        run(world, bench_settings(lossless_max_gap=0.5), logs)
    kept = json.loads((world["out"] / "run.gate-failed.json").read_text())
    failed_ngram = kept["failed_requests"]["ngram"]
    # 5 prompts x 2 levels; 3 answers, the first the warm-up's
    assert failed_ngram == 2 * 5 - (3 - 1) and kept["failed_requests"]["eagle3"] == 0
    assert f"{failed_ngram} request(s) got no answer (baseline 0, eagle3 0, ngram {failed_ngram})" in str(failed.value)
    assert sum(t["methods"]["ngram"]["failed_requests"] for t in kept["sets"].values()) == failed_ngram


def test_a_reference_servers_divergences_are_kept_and_fail_the_gate(world, monkeypatch) -> None:
    """Only the NGRAM server leaves the baseline's output (its DIVERGE prompt, a real loss: gap 3.0): the divergence
    is in the bench report, named by method, and the lossless gate fails on it."""
    monkeypatch.setenv("FAKE_SGLANG_DIVERGING", "ngram")
    write_prompts(world["prompts"][1], ["what is 12+30?", "DIVERGE here, please"], dataset="math")
    logs: list[str] = []
    with pytest.raises(SystemExit) as failed:
        run(world, bench_settings(lossless_max_gap=0.5), logs)
    kept = json.loads((world["out"] / "run.gate-failed.json").read_text())
    # Both levels; the TIE prompt's near-tie (0.02) is listed too, and tolerated.
    divs = {(d["method"], d["id"], d["concurrency"]): d["logit_gap"] for d in kept["divergences"]}
    assert set(divs) == {(m, p, c) for m, p in (("ngram", "math/1"), ("ngram", "chat/1")) for c in (1, 2)}
    assert divs[("ngram", "math/1", 1)] == pytest.approx(3.0) and divs[("ngram", "chat/1", 1)] == pytest.approx(0.02)
    assert kept["methods"]["ngram"]["lossless"] is False and kept["methods"]["eagle3"]["lossless"] is True
    assert "ngram on math/1 at concurrency 1 from token" in str(failed.value)
