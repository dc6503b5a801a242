"""The bench rule with ``bench.backend: sglang``: its script function (aerie.benchmark.job.gated_benchmark) drives the
serving harness against the stand-in SGLang (tests/fixtures/sglang/fake_launch_server.py: SGLang 0.5.23's flags and
recorded HTTP shapes) started as a real subprocess with this interpreter, as the job starts SGLang with its env's
Python: the baseline, each trained drafter with its kind's flags (EAGLE-3's configured EAGLE3 flags, DFlash's DFLASH
and block) and SGLang's NGRAM reference; it writes the in-process benchmark's report and plot, and the shared gate
judges each trained drafter and passes or fails the job."""

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

from aerie.benchmark import sglang_server
from aerie.benchmark.job import gated_benchmark
from aerie.benchmark.settings import BenchSettings
from aerie.drafter_kinds.dflash.model import DFlashDrafter
from aerie.drafter_kinds.dflash.shape import DFlashShape
from aerie.drafter_kinds.dflash.weights import export_dflash
from aerie.drafter_kinds.eagle3.model import Eagle3Drafter
from aerie.drafter_kinds.eagle3.shape import DrafterConfig

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
SPECIALS = ["<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SGLANG = {"tp": 1, "concurrency": [1, 2], "extra_args": ["--trust-remote-code"]}
# The target's shape as the drafters read it.
TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip


@pytest.fixture()
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A target folder (a character tokenizer with a chat template: what the job renders prompts with), a drafter
    folder, two datasets' bench prompts, and the stand-in importable as ``sglang`` by this interpreter."""
    tok, vocab = char_chat_tokenizer(SPECIALS)
    target = tmp_path / "target"
    tok.save_pretrained(target)
    drafter = tmp_path / "results" / "drafter" / "run"
    drafter.mkdir(parents=True)
    dflash = tmp_path / "results" / "drafter" / "run-dflash"
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
    # A DFlash drafter of block 4 (3 drafts a step) for the same target, its MASK the tokenizer's <unk>.
    dshape = DFlashShape.from_target(
        {**TEXT, "vocab_size": len(vocab)}, num_layers=1, block_size=4, mask_token_id=vocab["<unk>"],
        target_layer_ids=[1, 3],
    )  # fmt: skip
    export_dflash(DFlashDrafter(dshape), dshape, dflash, {})
    (dflash / "eval.json").write_text(json.dumps({"simulated_acceptance_length_by_steps": [1.8, 2.5, 3.1]}))
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
    yield {
        "target": target,
        "drafter": drafter,
        "dflash": dflash,
        "prompts": prompt_files,
        "state": state,
        "out": tmp_path / "bench",
    }
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


def run(world: dict, bench: dict, logs: list[str], drafters: dict | None = None) -> dict:
    out = world["out"] / "run.json"
    return gated_benchmark(
        {"path": str(world["target"]), "trust_remote_code": False},
        drafters or {"run": world["drafter"]},
        world["prompts"],
        out,
        out.with_suffix(".png"),
        BenchSettings.of(bench),
        sglang=SGLANG,
        threads=1,
        log=logs.append,
    )


def test_sglang_backend_writes_the_in_process_report_and_gates_each_drafter(world: dict) -> None:
    """Two trained drafters of two kinds, each served with its kind's flags beside the baseline and NGRAM: the
    in-process benchmark's report (aerie.bench/4), each drafter judged on its own, the faster one recommended."""
    logs: list[str] = []
    drafters = {"run": world["drafter"], "run-dflash": world["dflash"]}
    report = run(world, bench_settings(lossless_max_gap=0.5), logs, drafters)
    out = world["out"] / "run.json"
    assert json.loads(out.read_text()) == report and (world["out"] / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert any(line.startswith("gate passed") for line in logs), logs

    # The four servers, each with the flags of its kind, through this interpreter (the job's environment).
    flags = {
        "baseline": [],
        "run": sglang_server.drafter_flags(world["drafter"], SGLANG),
        "run-dflash": sglang_server.drafter_flags(world["dflash"], SGLANG),
        "ngram": sglang_server.ngram_flags(SGLANG, at_chain_width=True),
    }
    assert flags["run-dflash"] == [
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(world["dflash"]),
        "--speculative-num-draft-tokens", "4",
    ]  # fmt: skip
    for mode, speculative in flags.items():
        st = json.loads((world["state"] / f"{mode}.json").read_text())
        port = int(st["argv"][st["argv"].index("--port") + 1])
        want = sglang_server.server_command(str(world["target"]), port, SGLANG, speculative=speculative)
        assert [sys.executable, "-m", "sglang.launch_server", *st["argv"]] == want
        assert st["bad_shape"] == 0 and st["flushes"] == 2 * 2  # 2 datasets x 2 concurrency levels

    # The in-process benchmark's schema: every key it writes, the same meaning.
    inprocess_keys = {
        "format", "backend", "target", "drafters", "prompt_files", "prompts", "num_draft_steps", "max_new_tokens",
        "repeats", "warmup", "timing", "baseline", "lossless", "divergences", "failed_requests", "methods", "sets",
        "degenerate_prompts", "eos_token_ids", "device", "dtype", "versions", "per_prompt", "gate",
    }  # fmt: skip
    assert inprocess_keys <= set(report), inprocess_keys - set(report)
    assert report["format"] == "aerie.bench/4" and report["backend"] == "sglang"
    assert report["prompts"] == 5 and report["num_draft_steps"] == 3
    assert {m: (v["role"], v["kind"], v["draft_tokens"]) for m, v in report["methods"].items()} == {
        "run": ("trained", "eagle3", 3),
        "run-dflash": ("trained", "dflash", 3),
        "ngram": ("ngram", None, 3),
    }
    assert {n: (d["kind"], d["simulated_acceptance_length"]) for n, d in report["drafters"].items()} == {
        "run": ("eagle3", 2.9),  # each drafter's eval at its width (3 drafts)
        "run-dflash": ("dflash", 3.1),
    }
    # Speed at the level where a trained drafter does worst; every level listed; each drafter judged at its worst.
    assert report["concurrency"] in (1, 2) and [lv["concurrency"] for lv in report["by_concurrency"]] == [1, 2]
    for name in drafters:
        m = report["methods"][name]
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / report["baseline"]["tokens_per_s"])
        assert m["speedup"] > 1.3  # stand-in: 5 ms per 3 (EAGLE3) or 4 (DFLASH) tokens vs 4 ms per token
    # Acceptance: committed tokens per verify step without the prefill token; per position from SGLang's histogram.
    e, d = report["methods"]["run"], report["methods"]["run-dflash"]
    assert d["acceptance_length"] > e["acceptance_length"] > report["methods"]["ngram"]["acceptance_length"] > 1.0
    assert e["acceptance_per_position"] == [1.0, 1.0, 0.0]  # the stand-in accepts 2 drafts every EAGLE3 step
    assert d["acceptance_per_position"] == [1.0, 1.0, 1.0]  # ... and all 3 every DFLASH step
    tie = next(p for p in report["per_prompt"] if p["id"] == "chat/1")
    assert (tie["methods"]["run"]["lossless"], tie["methods"]["run"]["first_mismatch"]) == (False, 12)
    assert not {"speedup", "lossless", "first_mismatch"} & set(tie)  # no drafter's figures at the top
    # Lossless: the TIE prompt's outputs on both drafters' servers left the baseline's, at a near-tie (0.02).
    divs = report["divergences"]
    assert {(d["method"], d["id"], d["concurrency"]) for d in divs} == {
        (m, "chat/1", c) for m in drafters for c in (1, 2)
    }
    assert all(d["logit_gap"] == pytest.approx(0.02) and d["first_diff"] == 12 for d in divs)
    assert report["lossless"] is False and report["methods"]["ngram"]["lossless"] is True
    assert report["degenerate_prompts"] == ["chat/2"]
    # The harness's own report beside it, and the report figure reads the bench JSON alone.
    serving = json.loads(Path(report["serving_report"]).read_text())
    assert serving["format"] == "aerie.sglang-bench/5" and serving["modes"] == ["baseline", *drafters, "ngram"]
    # One table per set (a dataset's held-out prompts), every method side by side; SGLang's acceptance beside aerie's.
    assert list(report["sets"]) == ["chat", "math"] and report["sets"]["math"]["prompts"] == 2
    for table in report["sets"].values():
        assert set(table["methods"]) == {*drafters, "ngram"} and table["methods"]["run"]["failed_requests"] == 0
        assert table["methods"]["run"]["spec_accept_length"] == pytest.approx(3.0)  # completion / verify
        assert table["methods"]["run-dflash"]["spec_accept_length"] == pytest.approx(4.0)
        assert table["methods"]["ngram"]["spec_accept_length"] == pytest.approx(2.0)
    assert report["failed_requests"] == {"baseline": 0, "run": 0, "run-dflash": 0, "ngram": 0}
    # Each drafter on its own passes (the EAGLE-3 one is not judged against its faster sibling); the faster serves.
    gate = report["gate"]
    assert [v["passed"] for v in gate["drafters"].values()] == [True, True] and gate["serve"] == "run-dflash"
    from aerie.publish.report import figure_benchmark

    summary = figure_benchmark(out, world["out"] / "figure.png")
    assert summary["speedup"] == {n: report["methods"][n]["speedup"] for n in drafters}
    assert set(summary["sglang_speedup"]) == {1, 2}


def test_sglang_backend_fails_the_job_on_the_shared_gate(world: dict) -> None:
    """Outputs identical required (lossless_max_gap 0) and an impossible speed goal: the job fails, naming both, and
    keeps the report under gate-failed names (Snakemake deletes a failed job's outputs)."""
    logs: list[str] = []
    with pytest.raises(SystemExit) as failed:
        run(world, bench_settings(min_speedup=50.0, lossless_max_gap=0.0), logs)
    message = str(failed.value)
    assert message.startswith("the trained drafter does not pay off: run (eagle3): speedup ")
    assert "below bench.gate.min_speedup 50" in message
    assert "at concurrency" in message and "run on chat/1 at concurrency 1 from token 12" in message
    assert not (world["out"] / "run.json").exists() and not (world["out"] / "run.png").exists()
    kept = json.loads((world["out"] / "run.gate-failed.json").read_text())
    assert kept["backend"] == "sglang" and (world["out"] / "run.gate-failed.png").exists()


def test_kimi_config_benchmarks_under_sglang_against_ngram_and_the_published_drafters(tmp_path: Path) -> None:
    from aerie.benchmark.settings import bench_references
    from aerie.plan.bench import check_bench_config

    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    assert config["bench"]["backend"] == "sglang" and bench_references(config["bench"]) == [
        "ngram",
        "ngram_default",
        "lightseekorg/kimi-k2.5-eagle3",
        "lightseekorg/kimi-k2.5-eagle3-mla",
        "z-lab/Kimi-K2.5-DFlash",
    ]
    refs = check_bench_config(config, tmp_path)  # not in this machine's Hub cache: named, not refused
    assert [r.missing is not None for r in refs] == [False, False, True, True, True]
    assert "lightseekorg/kimi-k2.5-eagle3" in refs[2].missing and refs[2].folder is None
    with pytest.raises(ValueError, match=r"bench.references: untrained cannot run with bench.backend: sglang"):
        check_bench_config({**config, "bench": {**config["bench"], "references": ["untrained", "ngram"]}})
    with pytest.raises(ValueError, match=r"sglang.tp: 8 GPUs per server, but rule bench gets resources.bench_gpus: 4"):
        check_bench_config({**config, "resources": {**config["resources"], "bench_gpus": 4}})


def test_a_reference_folder_that_does_not_fit_the_target_is_refused_at_parse_time_naming_it(tmp_path: Path) -> None:
    """A drafter folder that is here is read by its kind against the target's config (the Kimi config's described
    target: vocab 163,840, hidden 7,168): an EAGLE-3 folder written by SpecForge or a DFlash folder for a small
    target is refused, naming the folder and each reason; the SpecForge folder passes against its own target."""
    import shutil

    from aerie.plan.bench import check_bench_config

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
        r for r in check_bench_config({**config, "target": own, "bench": bench}, tmp_path) if r.role == "drafter"
    ]
    assert refs.folder == tmp_path / "specforge"
    # A reference or a built-in may not take a drafter's name: the report names each method once.
    with pytest.raises(ValueError, match=r"the drafter name\(s\) \['ngram', 'specforge'\]"):
        check_bench_config({**config, "target": own, "bench": bench}, tmp_path, drafters=["specforge", "ngram"])
    # A DFlash folder is read by its kind (its config.json's DFlashDraftModel): one built for a small target is
    # refused against Kimi's the same way, naming the folder and the reason.
    dshape = DFlashShape.from_target({**TEXT, "vocab_size": 160}, num_layers=1, block_size=4, mask_token_id=159)
    export_dflash(DFlashDrafter(dshape), dshape, tmp_path / "small-dflash", {})
    with pytest.raises(ValueError, match=r"bench.references: small-dflash \(.*\) does not fit the target: .*hidden"):
        check_bench_config({**config, "bench": {**bench, "references": ["ngram", "small-dflash"]}}, tmp_path)


def test_the_bench_rule_runs_the_sglang_backend_and_fails_on_the_gate(world: dict, tmp_path: Path) -> None:
    """`snakemake results/bench/run.json` with bench.backend sglang: the rule's parse-time checks, its environment
    check (sglang importable by Snakemake's Python: the stand-in), its input (the run's drafter folders, named in
    params), params and script, against the stand-in servers; a drafter short of bench.gate.min_speedup fails the
    job, whose report is kept under the gate-failed name."""
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
    log_path = work / "results" / "logs" / "bench" / "run.log"
    assert log_path.exists(), out[-3000:]  # the job ran (the parse-time checks passed)
    log = log_path.read_text()
    assert "the trained drafter does not pay off: run (eagle3): speedup" in log, log
    assert "below bench.gate.min_speedup 50" in log, log
    kept = json.loads((work / "results" / "bench" / "run.gate-failed.json").read_text())
    assert kept["backend"] == "sglang" and kept["prompts"] == 3 and list(kept["methods"]) == ["run", "ngram"]
    assert kept["methods"]["run"]["speedup"] > 1.3 and kept["lossless"] is True
    assert kept["gate"]["drafters"]["run"]["sets"]["chat"]["beats_references"] is True
    assert not (work / "results" / "bench" / "run.json").exists()
    assert json.loads((work / "results" / "bench" / "run.sglang.json").read_text())["complete"] is True


def test_published_drafter_folders_are_served_by_their_kind_and_a_loss_to_one_fails_per_set(world: dict) -> None:
    """bench.references names drafter folders (here paths; a Hub id resolves in the offline cache) of either kind:
    an EAGLE-3 one served with the trained drafter's flags, a DFlash one (z-lab's kind) with DFLASH, on the same
    prompts. The EAGLE-3 reference accepts more (the stand-in: 4 tokens per verify step vs 3), so the gate fails the
    trained drafter on every set, naming it and the figures, and says to serve it instead."""
    published = world["out"].parent / "published"
    shutil.copytree(world["drafter"], published)  # the weights: a reference folder is checked tensor for tensor
    cfg = json.loads((world["drafter"] / "config.json").read_text())
    (published / "config.json").write_text(json.dumps({**cfg, "fake_accept": 4}))
    zlab = world["out"].parent / "z-lab-dflash"
    shutil.copytree(world["dflash"], zlab)
    refs = ["ngram", str(published), str(zlab)]
    logs: list[str] = []
    with pytest.raises(SystemExit) as failed:
        run(world, {**bench_settings(lossless_max_gap=0.5), "references": refs}, logs)
    message = str(failed.value)
    for name in ("chat", "math"):
        assert f"set {name}: run's acceptance length " in message
        assert f"does not beat reference {published}'s " in message
    # The fastest lossless method: one of the two reference folders (both accept 4 tokens a step here, so which is
    # faster is the machine's call), named in the message as the report's own choice.
    served = json.loads((world["out"] / "run.gate-failed.json").read_text())["gate"]["serve"]
    assert served in (str(published), str(zlab)) and f"serve {served} instead" in message
    from aerie.benchmark.sglang_harness import _file_name

    st = json.loads((world["state"] / "run.json").read_text())
    ref = json.loads((world["state"] / f"{_file_name(str(published))}.json").read_text())
    flags = [a for a in st["argv"] if a.startswith("--speculative")]
    assert [a for a in ref["argv"] if a.startswith("--speculative")] == flags  # the same flags, its own folder
    assert ref["argv"][ref["argv"].index("--speculative-draft-model-path") + 1] == str(published)
    z = json.loads((world["state"] / f"{_file_name(str(zlab))}.json").read_text())
    assert z["argv"][z["argv"].index("--speculative-algorithm") + 1] == "DFLASH"
    kept = json.loads((world["out"] / "run.gate-failed.json").read_text())
    assert kept["methods"][str(published)]["role"] == "drafter" and kept["methods"][str(zlab)]["kind"] == "dflash"
    table = kept["sets"]["chat"]["methods"]
    assert table[str(published)]["acceptance_length"] > table["run"]["acceptance_length"]


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
    assert failed_ngram == 2 * 5 - (3 - 1) and kept["failed_requests"]["run"] == 0
    assert f"{failed_ngram} request(s) got no answer (baseline 0, run 0, ngram {failed_ngram})" in str(failed.value)
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
    assert kept["methods"]["ngram"]["lossless"] is False and kept["methods"]["run"]["lossless"] is True
    assert "ngram on math/1 at concurrency 1 from token" in str(failed.value)
