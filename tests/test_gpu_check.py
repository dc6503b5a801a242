"""bench/gpu_check.py, the device script of issue 29 item 6, runs end to end on the CPU at toy sizes: both
kernels per kind, their agreement, the loader's tokens/s, a JSON bench/tables.py renders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_gpu_check_runs_at_toy_size_and_renders(tmp_path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        str(REPO / "bench" / "gpu_check.py"),
        "--toy",
        "--lengths",
        "40",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["format"] == "aerie.bench.gpu-check/1" and data["toy"]
    assert [(p["kind"], p["T"]) for p in data["points"]] == [("llama", 40), ("mla", 40), ("dflash", 40)]
    for p in data["points"]:
        cpu_path = "reference" if p["kind"] == "dflash" else "chunked"
        assert set(p["kernels"]) == {cpu_path, "flex"} and all("step_seconds" in k for k in p["kernels"].values())
        assert p["agreement"]["loss_rel"] < 1e-5  # flex (forward, eager) gives the CPU path's loss
    assert data["loader"]["tokens"] > 0 and data["loader"]["tokens_per_s"] > 0
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    table = gpu_check.table(out)
    assert "| mla | 40 |" in table and "| dflash | 40 |" in table and "Loader" in table
