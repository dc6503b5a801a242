"""The two one-load stages, fast: the target is loaded once per run, and a stored shard is reused only for the
settings it was made with.

Rule ``hidden`` (aerie.hidden.capture_shards) and rule ``responses_hf`` (aerie.responses.in_process.generate_hf_shards)
each
load the target once for every shard of the run (a 554 GB target takes many minutes to load) and keep finished
shards in a store for the next attempt. Here they run in-process on tiny targets, the loads counted where they
happen (transformers' ``from_pretrained``), and ``snakemake -n`` shows one job for each stage however many shards
there are. tests/test_capture_once.py and tests/test_responses_loads.py run the same through Snakemake (slow).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake
from tiny_world import save_random_llama, save_tiny_llama_target, write_random_tokens_shard

from aerie.formats.hidden import HIDDEN_FORMAT
from aerie.hidden.run import ShardTask, capture_shards
from aerie.hidden.settings import CaptureSettings
from aerie.target_model.store import KEY_FIELD, config_key_function, store_path
from aerie.tools.artifacts import load_packed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHARDS = 3
AUX = [1, 3, 4]
BASE = dict(
    aux_layer_ids=AUX,
    layout="compact",
    target_topk=8,
    storage_dtype="bfloat16",
    batch_tokens=64,
    device="cpu",
    dtype="float32",
    threads=1,
)


@pytest.fixture()
def loads(monkeypatch) -> list[str]:
    """Every model load in this process (the target folder each time), however it is reached."""
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained.__func__
    seen: list[str] = []

    def counting(cls, path, *args, **kwargs):
        seen.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    return seen


@pytest.fixture(scope="module")
def capture_target(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("capture") / "target")


def capture_tasks(root: Path, shards: int = SHARDS) -> list[ShardTask]:
    tasks = []
    for s in range(shards):
        tokens = root / "tokens" / f"shard-{s:05d}.safetensors"
        if not tokens.exists():
            write_random_tokens_shard(tokens, seqs=4, seq_len=8, seed=s)
        tasks.append(ShardTask(tokens, root / "hidden" / tokens.name, root / "logs" / f"shard-{s:05d}.log"))
    return tasks


def capture(root: Path, target: Path, **changes) -> dict:
    return capture_shards(capture_tasks(root), str(target), CaptureSettings(**{**BASE, **changes}), log=lambda _: None)


# ---- the capture job ------------------------------------------------------------------------------------------


def test_the_capture_job_loads_the_target_once_for_all_its_shards(capture_target, tmp_path, loads) -> None:
    result = capture(tmp_path, capture_target)
    assert loads == [str(capture_target)]
    assert (result["shards"], result["captured"], result["reused"], result["target_loads"]) == (SHARDS, SHARDS, 0, 1)
    for task in capture_tasks(tmp_path):
        assert os.path.samefile(task.out, store_path(task.out))
    # Another attempt (the job rerun after a crash) reuses every shard and loads nothing.
    loads.clear()
    result = capture(tmp_path, capture_target)
    assert loads == [] and (result["captured"], result["reused"], result["target_loads"]) == (0, SHARDS, 0)


def rewrite_weights(target: Path) -> None:
    """The target's weights replaced by others of the same shapes (a re-downloaded or fine-tuned target)."""
    from safetensors.torch import load_file, save_file

    path = target / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v * 1.01 for k, v in tensors.items()}, path, metadata={"format": "pt"})


CHANGES = {
    "aux_layer_ids": dict(aux_layer_ids=[1, 2, 4]),
    "layout": dict(layout="full"),
    "target_topk": dict(target_topk=4),
    "dtype": dict(dtype="bfloat16"),
    "batch_tokens": dict(batch_tokens=16),
}


@pytest.mark.parametrize("change", [*CHANGES, "storage_dtype", "weights"])
def test_a_stored_shard_is_recaptured_when_what_made_it_changed(capture_target, tmp_path, change) -> None:
    """Every setting that decides a shard's bytes, and the target's weights, are in the store key: a store entry
    made otherwise is captured again, never published as this run's."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(capture_target, target)
    base = dict(layout="full") if change == "storage_dtype" else {}
    capture(tmp_path, target, **base)
    if change == "weights":
        rewrite_weights(target)
        changed = base
    elif change == "storage_dtype":
        changed = dict(layout="full", storage_dtype="float32")
    else:
        changed = CHANGES[change]
    result = capture(tmp_path, target, **changed)
    assert (result["captured"], result["reused"]) == (SHARDS, 0), change
    _, meta = load_packed(capture_tasks(tmp_path)[0].out, HIDDEN_FORMAT)
    settings = {**BASE, **changed}
    assert meta["aux_layer_ids"] == settings["aux_layer_ids"] and meta["layout"] == settings["layout"]
    if settings["layout"] == "compact":
        assert meta["target_topk"] == settings["target_topk"]
    else:
        assert meta["storage_dtype"] == settings["storage_dtype"]


def test_thresholds_do_not_invalidate_a_stored_shard(capture_target, tmp_path) -> None:
    """The agreement thresholds only accept or refuse a shard: a stored one is checked again, not recaptured."""
    capture(tmp_path, capture_target)
    result = capture(tmp_path, capture_target, min_next_token_agreement=0.0, min_next_token_in_topk=0.0, threads=2)
    assert (result["captured"], result["reused"]) == (0, SHARDS)
    with pytest.raises(ValueError, match="min_next_token_agreement"):  # random ids: the argmax rarely agrees
        capture(tmp_path, capture_target, min_next_token_agreement=0.99)


def test_the_dry_run_computes_the_capture_jobs_own_key(capture_target, tmp_path) -> None:
    """``snakemake -n`` says which shards the store serves from the key the capture job writes: they must agree."""
    for ids in (AUX, [1, 2, 4]):
        root = tmp_path / str(ids)
        capture(root, capture_target, aux_layer_ids=ids)
        config = {
            "target": {"path": str(capture_target), "device": BASE["device"], "dtype": BASE["dtype"]},
            "hidden": {
                **{k: BASE[k] for k in ("layout", "target_topk", "storage_dtype", "batch_tokens")},
                "aux_layer_ids": ids,
                "backend": "hf",
            },  # fmt: skip
        }
        key_of = config_key_function(config)
        for task in capture_tasks(root):
            _, meta = load_packed(store_path(task.out), HIDDEN_FORMAT)
            assert key_of(task.tokens) == meta[KEY_FIELD]
        other = config_key_function({**config, "hidden": {**config["hidden"], "aux_layer_ids": [0, 2, 4]}})
        assert other(task.tokens) != meta[KEY_FIELD]


# ---- the in-process responses job ------------------------------------------------------------------------------


def test_the_responses_job_loads_the_target_once_for_all_its_shards(tmp_path, loads) -> None:
    from aerie.responses.in_process import ResponsesTask, generate_hf_shards
    from aerie.responses.sampling import Sampling
    from aerie.sources.datasets import write_prompts

    target = save_tiny_llama_target(tmp_path / "target")
    datasets = {
        "greedy": {"temperature": 0.0, "seed": 0},
        "sampled": {"temperature": 0.9, "seed": 11},
    }
    tasks = []
    for n, (name, sampling) in enumerate(datasets.items()):
        source = {"source": {"kind": "synthetic", "families": ["arith"], "count": 4, "seed": 3 + n}}
        for s in range(2):
            prompts = tmp_path / name / "prompts" / f"shard-{s:05d}.jsonl"
            write_prompts(name, source, 2 * s, 2 * s + 2, prompts)
            settings = Sampling(**{"top_p": 1.0, "max_new_tokens": 4, "batch_size": 2, **sampling})
            tasks.append(ResponsesTask(prompts, tmp_path / name / "responses" / prompts.name, settings))
    loads.clear()
    result = generate_hf_shards(tasks, str(target), device="cpu", dtype="float32", threads=1, log=lambda _: None)
    assert loads == [str(target)]
    assert (result["shards"], result["generated"], result["target_loads"]) == (4, 4, 1)
    assert all(t.out.exists() for t in tasks)
    loads.clear()
    result = generate_hf_shards(tasks, str(target), device="cpu", dtype="float32", threads=1, log=lambda _: None)
    assert loads == [] and (result["generated"], result["reused"], result["target_loads"]) == (0, 4, 0)


# ---- the plan -------------------------------------------------------------------------------------------------


def test_the_plan_has_one_job_for_each_one_load_stage(workdir) -> None:
    """However many shards: one ``hidden`` job and one ``responses_hf`` job (the demo config), each one target
    load."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    (workdir / "c.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(workdir, "-n", "--configfile", str(workdir / "c.yaml"), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    counts = {job: int(n) for job, n in re.findall(r"^(\w+)\s+(\d+)$", out.split("job ", 1)[1], flags=re.M)}
    shards = counts["tokens"]
    assert shards >= 2 and counts["hidden"] == 1, counts
    assert counts["responses_hf"] == 1, counts  # the served humaneval shards keep a job each (rule responses)
    assert (
        f"aerie capture plan: rule hidden (one job for all {shards} shards) publishes {shards} pending: 1 target" in out
    )
