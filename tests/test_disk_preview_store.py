"""The disk preview counts what a run adds: pending hidden shards the capture store already holds are
published as hard links to their entries (no new data) and cost nothing; the others cost their tokens.

The store entries are real: a tiny Llama target captures hand-written tokens shards with the capture job's
own function (aerie.hidden.capture_shards), and the published names are then removed, as Snakemake removes
the outputs of a job that failed or was killed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from tiny_world import save_random_llama, write_random_tokens_shard

from aerie.hidden.run import ShardTask, capture_shards
from aerie.hidden.settings import CaptureSettings
from aerie.plan.config_file import ConfigSources
from aerie.plan.resolve import validate_config
from aerie.preview.disk import bytes_per_token, disk_preview
from aerie.sources.datasets import plan_dataset
from aerie.target_model.store import store_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEQ_LEN = 16
SEQS = [3, 5, 4]  # sequences of the three shards: each shard's token count differs


@pytest.fixture()
def run(tmp_path: Path) -> dict:
    target = save_random_llama(tmp_path / "target", max_position_embeddings=64)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"] = {"path": str(target), "device": "cpu", "dtype": "float32"}
    config["hidden"].update(aux_layer_ids=[1, 3, 4], batch_tokens=SEQ_LEN, min_next_token_agreement=0.0)
    config["datasets"] = {
        "tasks": {
            "source": {"kind": "synthetic", "families": ["arith"], "count": 7, "seed": 7},
            "shard_size": 2,
            "bench_prompts": 1,
        }
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    validate_config(config, ConfigSources.read([tmp_path / "config.yaml"]))  # the schema's defaults, as a run has
    plans = {"tasks": plan_dataset("tasks", config["datasets"]["tasks"])}
    assert plans["tasks"].shard_names == ["00000", "00001", "00002"]
    results = tmp_path / "results"
    tokens = [results / "tasks" / "tokens" / f"shard-{s:05d}.safetensors" for s in range(3)]
    for s, path in enumerate(tokens):
        write_random_tokens_shard(path, SEQS[s], SEQ_LEN, seed=s)
    hidden = [results / "tasks" / "hidden" / p.name for p in tokens]
    return {"config": config, "plans": plans, "results": results, "tokens": tokens, "hidden": hidden}


def capture(run: dict, shards: list[int]) -> None:
    """The capture job over these shards, then its published names removed (a failed or killed job's outputs)."""
    cfg, target = run["config"]["hidden"], run["config"]["target"]
    capture_shards(
        [ShardTask(run["tokens"][s], run["hidden"][s]) for s in shards],
        target["path"],
        CaptureSettings(
            aux_layer_ids=cfg["aux_layer_ids"],
            layout=cfg["layout"],
            target_topk=cfg["target_topk"],
            batch_tokens=cfg["batch_tokens"],
            storage_dtype=cfg["storage_dtype"],
            device=target["device"],
            dtype=target["dtype"],
            threads=1,
        ),
        log=lambda _: None,
    )
    for s in shards:
        run["hidden"][s].unlink()
        assert store_path(run["hidden"][s]).exists()


def preview(run: dict) -> str:
    return disk_preview(run["config"], run["plans"], run["results"], {"tasks": 100.0})


def figures(line: str) -> tuple[int, float]:
    tokens = int(re.search(r"~([\d,]+) tokens", line).group(1).replace(",", ""))
    return tokens, float(re.search(r"= ~([\d.]+) GiB", line).group(1))


def test_store_entries_cost_no_new_disk(run) -> None:
    per_token = bytes_per_token(
        64, 3, "bfloat16", run["config"]["hidden"]["layout"], run["config"]["hidden"]["target_topk"]
    )
    line = preview(run)
    assert line.startswith("aerie disk preview: 3 pending hidden shards, ~") and "3 counted" in line, line
    assert figures(line)[0] == sum(SEQS) * SEQ_LEN

    capture(run, [0, 2])  # a run that finished shards 0 and 2, then died
    line = preview(run)
    linked = "in the capture store already (published as hard links: no new data)"
    assert line.startswith(f"aerie disk preview: 3 pending hidden shards, 2 of them {linked}; the other 1: ~"), line
    tokens, gib = figures(line)
    assert tokens == SEQS[1] * SEQ_LEN and "(1 counted" in line, line
    assert gib == pytest.approx(tokens * per_token / 2**30, abs=0.01)

    # An entry captured with other settings is recaptured: it is new disk again (its old bytes are replaced).
    run["config"]["hidden"]["target_topk"] = 8
    assert figures(preview(run))[0] == sum(SEQS) * SEQ_LEN
    run["config"]["hidden"]["target_topk"] = 32

    capture(run, [1])
    assert preview(run) == f"aerie disk preview: 3 pending hidden shards, all {linked}: ~0.00 GiB"


def test_without_the_target_an_entry_counts_when_newer_than_its_tokens(run) -> None:
    """Before the target exists (a pipeline-built one) no capture key can be computed: a complete entry newer
    than its tokens shard is taken as the one the job will reuse, as the capture plan line does."""
    capture(run, [1])
    run["config"]["target"]["path"] = str(run["results"] / "not-built-yet")
    run["config"]["target"]["hidden_size"] = 64
    line = preview(run)
    assert ", 1 of them in the capture store already" in line and figures(line)[0] == (SEQS[0] + SEQS[2]) * SEQ_LEN
    store_path(run["hidden"][1]).write_bytes(store_path(run["hidden"][1]).read_bytes()[:-100])  # cut short
    assert figures(preview(run))[0] == sum(SEQS) * SEQ_LEN


def test_the_store_module_stays_torch_free() -> None:
    """``snakemake -n`` imports aerie.target_model.store for the plan lines and the disk preview."""
    import subprocess
    import sys

    code = (
        "import sys, aerie.target_model.store, aerie.preview.disk\n"
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
