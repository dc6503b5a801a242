"""Every user-facing tool starts the way the README says: its installed console script, with --help and, where it
is cheap, one real run (the emulator answers HTTP, gpu slots hands out a device, the SGLang capture check spawns
its worker, the SGLang benchmark measures a fake SGLang end to end). The README names the tools by these scripts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

TESTS = Path(__file__).parent
SCRIPTS = {  # console script -> the module:function pyproject.toml points it at
    "aerie-emulator": "aerie.emulator:main",
    "aerie-gpu-slots": "aerie.tools.gpu_slots:main",
    "aerie-sglang-capture": "aerie.hidden.sglang_check.cli:main",
    "aerie-sglang-bench": "aerie.benchmark.sglang_harness:main",
    "aerie-train-drafter": "aerie.drafter.cli:main",
}
# What each script's --help must mention (its own name as prog, and a flag or subcommand only it has).
HELP_MENTIONS = {
    "aerie-emulator": ["--port-file", "--faults"],
    "aerie-gpu-slots": ["aerie-gpu-slots run N -- CMD"],
    "aerie-sglang-capture": ["aerie-sglang-capture", "make-tiny", "check"],
    "aerie-sglang-bench": ["aerie-sglang-bench", "--sglang-python", "--prompt-set"],
    "aerie-train-drafter": ["aerie-train-drafter", "--hidden", "--vocab"],
}


def script(name: str) -> Path:
    """The installed console script beside this interpreter; skip when aerie is not installed with it."""
    path = Path(sys.executable).parent / name
    # The wrapper pip writes imports the entry point: `from aerie.tools.gpu_slots import main`.
    found = re.search(r"^from (\S+) import (\w+)$", path.read_text(), re.M) if path.is_file() else None
    if found is None or f"{found[1]}:{found[2]}" != SCRIPTS[name]:
        if os.environ.get("CI") == "true":
            raise AssertionError(f"{path} is not installed (pip install -e .), and CI must run every test")
        pytest.skip(
            f"{name} is not installed beside {sys.executable} from this pyproject.toml "
            f"(pip install -e . installs the console scripts)"
        )
    return path


def run(
    args: list[str], *, env: dict[str, str] | None = None, timeout: int = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def test_pyproject_declares_every_tool() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert declared == SCRIPTS


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help(name: str) -> None:
    r = run([str(script(name)), "--help"])
    assert r.returncode == 0, r.stderr
    for text in HELP_MENTIONS[name]:
        assert text in r.stdout, (text, r.stdout)


def test_readme_command_lines_use_the_scripts() -> None:
    """The documentation's command lines (code blocks of README.md and docs/) start the tools by their console
    scripts, and each script is documented; prose may still name the `python -m` form."""
    readme = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))])
    blocks = "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", readme, flags=re.M | re.S))
    modules = [v.split(":")[0].removesuffix(".cli") for v in SCRIPTS.values()]
    old = sorted({m for m in modules if re.search(rf"python -m\s+{re.escape(m)}\b", blocks)})
    assert not old, f"documented command lines start {old} with `python -m`; use the scripts {sorted(SCRIPTS)}"
    missing = [name for name in SCRIPTS if f"`{name}" not in readme and name not in blocks]
    assert not missing, f"README.md and docs/ never document {missing}"
    assert re.search(r"(\s|^)aerie-sglang-capture check --target", blocks, flags=re.M)  # the first GPU step
    assert re.search(r"(/|^)aerie-sglang-bench --config", blocks, flags=re.M)


def test_gpu_slots_hands_out_a_device(tmp_path: Path) -> None:
    exe = str(script("aerie-gpu-slots"))
    env = {"AERIE_GPUS": "2", "AERIE_GPU_LOCK_DIR": str(tmp_path / "locks")}
    status = run([exe], env=env)
    assert status.returncode == 0 and status.stdout.startswith("2 GPU(s) from AERIE_GPUS"), status
    assert run([exe, "--count"], env=env).stdout.strip() == "2"
    held = run([exe, "run", "1", "--", "sh", "-c", 'echo "gpu=$CUDA_VISIBLE_DEVICES"'], env=env)
    assert held.returncode == 0 and held.stdout.strip() in ("gpu=0", "gpu=1"), held
    assert run([exe, "bogus"], env=env).returncode == 2


def test_emulator_serves_until_stopped(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [str(script("aerie-emulator")), "--port", "0", "--port-file", str(port_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert port_file.exists(), proc.communicate(timeout=5)
        port = int(port_file.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/models", timeout=30) as resp:
            models = json.loads(resp.read())
        assert resp.status == 200 and models["data"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"listening on http://127.0.0.1:{port}" in out


def test_sglang_capture_check_starts_its_workers(tmp_path: Path) -> None:
    """`aerie-sglang-capture check` on CPU with the stand-in backend of tests/test_sglang_capture.py: the worker
    process starts, loads, and the check on the loaded model refuses ids SGLang's DeepseekV2 maps one layer early
    (the README's first GPU step; the whole capture-and-compare run is in test_sglang_capture.py)."""
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {"architectures": ["SomeNewForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 6}
        )
    )
    r = run(
        [
            str(script("aerie-sglang-capture")),
            "check",
            "--target",
            str(target),
            "--layers",
            "2",
            "3",
            "4",
            "--expect-refusal",
            "--backend",
            "test_sglang_capture:FakeDeepseekBackend",
        ],
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("PASS: refused as expected") and "layer inputs [2, 3, 4]" in r.stdout


def test_sglang_bench_measures_a_fake_sglang(tmp_path: Path) -> None:
    """`aerie-sglang-bench` as the README runs it (MT-bench and GSM8K files, a tokenizer with a chat template),
    against the fake `sglang.launch_server` of tests/test_sglang_harness.py."""
    from test_sglang_harness import FAKE_LAUNCH_SERVER, FIXTURES

    from aerie.targets.demo.tokenizer import tokenizer_corpus, train_tokenizer

    exe = str(script("aerie-sglang-bench"))
    target = tmp_path / "target"
    train_tokenizer(list(tokenizer_corpus(100, 0)), vocab_size=400).save_pretrained(target)
    pkg = tmp_path / "fakepkg" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    python = tmp_path / "sglang-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{pkg.parent}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "state").mkdir()
    out = tmp_path / "kimi.sglang.json"
    benchmarks = TESTS / "fixtures" / "benchmarks"
    r = run(
        [
            exe,
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--sglang-python",
            str(python),
            "--prompt-set",
            f"mtbench:{benchmarks / 'mt_bench_questions.jsonl'}",
            "--prompt-set",
            f"gsm8k:{benchmarks / 'gsm8k_test.head50.jsonl'}",
            "--prompt-set",
            "humaneval",
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--warmup",
            "1",
            "--stop-grace",
            "0.5",
            "--server-env",
            f"FAKE_SGLANG_FIXTURES={FIXTURES}",
            "--server-env",
            f"FAKE_SGLANG_STATE={tmp_path / 'state'}",
            "--out",
            str(out),
        ],
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and [s["name"] for s in report["prompt_sets"]] == ["mtbench", "gsm8k", "humaneval"]
    (name,) = report["drafters"]  # the one trained drafter, a mode named after it (aerie.sglang-bench/5)
    assert report["modes"] == ["baseline", name] and report["methods"][name]["kind"] == "eagle3"
    assert all(row["baseline"]["ok"] == row[name]["ok"] == 2 for row in report["rows"])
    assert report["summary"]["modes"][name]["spec_accept_length_mean"] == pytest.approx(3.0)
    assert out.with_suffix(".png").stat().st_size > 5_000
