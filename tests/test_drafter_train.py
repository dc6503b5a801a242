"""Drafter training machinery: exact resume, best/last checkpoints, reading the target's heads from its
safetensors, rank sharding and the torchrun path (gloo on CPU).

The data is tiny and synthetic but real: a random Llama target's own aux and final hidden states for random
token sequences, written in the aerie.hidden/1 format.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from aerie.drafter.config import TrainConfig
from aerie.drafter.curves import read_curves
from aerie.drafter.data import Window, batches, epoch_batches, pack_rows, padded_tokens, plan_windows
from aerie.drafter.distributed import processes_for, shard_for_rank, torchrun_command
from aerie.drafter.loop import train_drafter
from aerie.drafter.state import train_state_dir
from aerie.drafter_kinds.eagle3.model import DrafterConfig, Eagle3Drafter
from aerie.drafter_kinds.eagle3.training import build
from aerie.formats.hidden import open_hidden_shards
from aerie.formats.vocab import load_draft_vocab
from aerie.target_model.heads import read_target_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]

TARGET = dict(
    vocab_size=160,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    initializer_range=0.1,
)
AUX = [0, 1, 2]
DRAFT_VOCAB = 64
NUM_SEQS, SEQ_LEN, PROMPT_LEN = 40, 20, 6

# 40 sequences, 20% held out -> ~4 batches of 8 per epoch; checkpoint every 3 steps lands mid-epoch
CFG = dict(
    ttt_steps=3,
    epochs=3,
    learning_rate=3e-3,
    warmup_ratio=0.1,
    batch_size=8,
    max_seq_len=16,
    eval_fraction=0.2,
    seed=0,
    threads=1,
    log_every=1,
    checkpoint_every=3,
    grad_clip=1.0,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("drafter_train")
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET)).eval()
    target_dir = root / "target"
    target.save_pretrained(target_dir, max_shard_size="40KB")  # sharded: embed and lm_head in different files
    ids = torch.randint(3, TARGET["vocab_size"], (NUM_SEQS, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1] for i in AUX], dim=-1)  # SGLang's convention: output of layer i
    final = out.last_hidden_state
    mask = torch.zeros(SEQ_LEN, dtype=torch.uint8)
    mask[PROMPT_LEN:] = 1
    shards = []
    for k, rows in enumerate([range(0, NUM_SEQS // 2), range(NUM_SEQS // 2, NUM_SEQS)]):
        rows = list(rows)
        path = root / f"shard-{k:05d}.safetensors"
        save_file(
            {
                "input_ids": ids[rows].flatten().to(torch.int32),
                "loss_mask": mask.repeat(len(rows)),
                "seq_offsets": torch.arange(len(rows) + 1, dtype=torch.int64) * SEQ_LEN,
                "aux_hidden_states": aux[rows].reshape(-1, aux.shape[-1]).to(torch.bfloat16),
                "final_hidden_states": final[rows].reshape(-1, final.shape[-1]).to(torch.bfloat16),
            },
            str(path),
            metadata={
                "format": "aerie.hidden/1",
                "aux_layer_ids": json.dumps(AUX),
                "hidden_size": str(TARGET["hidden_size"]),
                "vocab_size": str(TARGET["vocab_size"]),
                "num_hidden_layers": str(TARGET["num_hidden_layers"]),
                "target": str(target_dir),
                "sample_ids": json.dumps([f"toy/{i}" for i in rows]),
            },
        )
        shards.append(path)
    t2d = torch.zeros(TARGET["vocab_size"], dtype=torch.bool)
    t2d[torch.randperm(TARGET["vocab_size"], generator=torch.Generator().manual_seed(2))[:DRAFT_VOCAB]] = True
    draft_ids = t2d.nonzero().flatten()
    vocab = root / "draft_vocab.safetensors"
    save_file(
        {"d2t": draft_ids - torch.arange(DRAFT_VOCAB), "t2d": t2d},
        str(vocab),
        metadata={"format": "aerie.draft-vocab/1"},
    )
    return {"root": root, "target": target, "target_dir": target_dir, "shards": shards, "vocab": vocab}


def _train(data, out: Path, on_step=None, lines=None, **overrides) -> dict:
    cfg = TrainConfig.of(**{**CFG, **overrides})
    log = lines.append if lines is not None else (lambda _: None)
    return train_drafter(data["shards"], data["vocab"], data["target_dir"], out, cfg, log=log, on_step=on_step)


class Killed(Exception):
    pass


def _kill_after(n: int):
    def on_step(step: int) -> None:
        if step == n:
            raise Killed(step)

    return on_step


def _events(out: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if e["event"] == kind]


@pytest.fixture(scope="module")
def uninterrupted(data) -> dict:
    out = data["root"] / "runs" / "straight"
    return {"out": out, "eval": _train(data, out)}


# ---------------------------------------------------------------------------------------------------------
# exact resume


def test_resume_after_kills_matches_uninterrupted_run(data, uninterrupted):
    out = data["root"] / "runs" / "killed"
    state = train_state_dir(out)
    assert state == out.parent / ".killed.train_state"
    # killed mid-epoch after step 5: the state of step 3 is on disk, steps 4-5 are redone
    with pytest.raises(Killed):
        _train(data, out, on_step=_kill_after(5))
    assert (state / "state.pt").exists() and not out.exists()
    saved = torch.load(state / "state.pt", weights_only=True)
    assert saved["progress"]["step"] == 3 and saved["progress"]["epoch"] == 1 and saved["progress"]["position"] == 3
    assert "embed_tokens.weight" not in saved["model"] and {"torch", "python", "numpy"} <= set(saved["rng"])
    # killed again right after epoch 1's last step, before its evaluation: back to the step-6 checkpoint
    per_epoch = len(_events(uninterrupted["out"], "train")) // CFG["epochs"]
    assert per_epoch == 8
    lines: list[str] = []
    with pytest.raises(Killed):
        _train(data, out, on_step=_kill_after(per_epoch), lines=lines)
    assert any(line.startswith("resuming from") and "step 3/" in line for line in lines)
    lines.clear()
    result = _train(data, out, lines=lines)
    assert any(line.startswith("resuming from") and "epoch 1, batch 6, step 6/24" in line for line in lines)

    a, b = _events(uninterrupted["out"], "train"), _events(out, "train")
    assert [e["step"] for e in b] == [e["step"] for e in a] == list(range(1, len(a) + 1))  # no step twice
    for x, y in zip(a, b):
        assert x["lr"] == y["lr"] and x["epoch"] == y["epoch"]
        assert abs(x["loss"] - y["loss"]) <= 1e-6, (x["step"], x["loss"], y["loss"])
        assert max(abs(u - v) for u, v in zip(x["loss_per_step"], y["loss_per_step"])) <= 1e-6
    assert [e["epoch"] for e in _events(out, "eval")] == [0, 1, 2, 3]  # each evaluation logged once
    assert len(_events(out, "resume")) == 2
    assert (out / "model.safetensors").read_bytes() == (uninterrupted["out"] / "model.safetensors").read_bytes()
    assert result["epochs"] == uninterrupted["eval"]["epochs"]
    assert result["tokens_trained"] == uninterrupted["eval"]["tokens_trained"]
    assert not (state / "state.pt").exists()  # finished: nothing left to resume
    # the curves of the twice-killed run: every step once (what an attempt wrote past its checkpoint purged)
    straight, resumed = read_curves(uninterrupted["out"] / "tensorboard"), read_curves(out / "tensorboard")
    assert [s for s, _ in resumed["train/loss"]] == list(range(1, len(a) + 1))
    assert [v for _, v in resumed["train/loss"]] == pytest.approx([v for _, v in straight["train/loss"]], abs=1e-6)
    assert [s for s, _ in resumed["heldout/acceptance_length"]] == [s for s, _ in straight["heldout/acceptance_length"]]


def test_training_curves_are_tensorboard_events_in_the_drafter_folder(uninterrupted):
    """Loss and accuracy per TTT position per step, held-out acceptance per position per epoch: the same figures
    as train_log.jsonl, readable by TensorBoard's own reader from the drafter folder."""
    out = uninterrupted["out"]
    curves = read_curves(out / "tensorboard")
    train, evals = _events(out, "train"), _events(out, "eval")
    assert [s for s, _ in curves["train/loss"]] == [e["step"] for e in train]
    assert [v for _, v in curves["train/loss"]] == pytest.approx([e["loss"] for e in train], rel=1e-6)
    for k in range(CFG["ttt_steps"]):
        got = [v for _, v in curves[f"train/top1_match_per_position/{k}"]]
        assert got == pytest.approx([e["acc_per_step"][k] for e in train], rel=1e-6)
        assert [v for _, v in curves[f"train/loss_per_position/{k}"]] == pytest.approx(
            [e["loss_per_step"][k] for e in train], rel=1e-6
        )
        held = [v for _, v in curves[f"heldout/acceptance_per_position/{k}"]]
        assert held == pytest.approx([e["acceptance_per_position"][k] for e in evals], rel=1e-6)
    # one point per evaluation (untrained at step 0), at the step its epoch ended
    per_epoch = len(train) // CFG["epochs"]
    assert [s for s, _ in curves["heldout/acceptance_length"]] == [0, per_epoch, 2 * per_epoch, 3 * per_epoch]
    assert [v for _, v in curves["epoch/epoch"]] == [0, 1, 2, 3]
    means = [sum(e["loss"] for e in train if e["epoch"] == n) / per_epoch for n in (1, 2, 3)]
    assert [v for _, v in curves["epoch/train_loss"]] == pytest.approx(means, rel=1e-6)
    assert not (train_state_dir(out) / "tensorboard").exists()  # moved into the folder, not copied twice


def test_tensorboard_off_and_wandb_asked_without_the_package(data, tmp_path, monkeypatch):
    out = tmp_path / "quiet"
    _train(data, out, epochs=1, tensorboard=False)
    assert not (out / "tensorboard").exists() and (out / "train_log.jsonl").exists()
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails as when it is not installed
    with pytest.raises(ValueError, match="wandb_project is 'aerie' but the wandb package is not installed"):
        _train(data, tmp_path / "wandb", epochs=1, wandb_project="aerie")


def test_resume_from_epoch_end_and_from_finished_state(data, uninterrupted, tmp_path, monkeypatch):
    import aerie.drafter.loop as loop

    out = tmp_path / "d"
    n = len(_events(uninterrupted["out"], "train")) // CFG["epochs"]
    with pytest.raises(Killed):  # the epoch-1 checkpoint (after its eval) is the one on disk
        _train(data, out, on_step=_kill_after(n + 1), checkpoint_every=0)
    saved = torch.load(train_state_dir(out) / "state.pt", weights_only=True)["progress"]
    assert (saved["epoch"], saved["position"], saved["step"]) == (2, 0, n)

    # then killed while publishing the finished run: the next attempt only publishes
    real_copy = loop.copy_atomic

    def copy_then_die(src, dst):
        if dst.name == "train_log.jsonl":
            raise Killed("publishing")
        real_copy(src, dst)

    monkeypatch.setattr(loop, "copy_atomic", copy_then_die)
    with pytest.raises(Killed):
        _train(data, out, checkpoint_every=0)
    monkeypatch.setattr(loop, "copy_atomic", real_copy)
    lines: list[str] = []
    result = _train(data, out, checkpoint_every=0, lines=lines)
    assert any(f"epoch {CFG['epochs'] + 1}, batch 0, step {3 * n}/{3 * n}" in line for line in lines)
    assert not any(line.startswith("step ") for line in lines)  # nothing trained again
    assert (out / "model.safetensors").read_bytes() == (uninterrupted["out"] / "model.safetensors").read_bytes()
    assert result["epochs"] == uninterrupted["eval"]["epochs"]
    assert [e["step"] for e in _events(out, "train")] == list(range(1, 3 * n + 1))


def test_resume_refuses_other_data_or_settings(data, tmp_path):
    out = tmp_path / "d"
    with pytest.raises(Killed):
        _train(data, out, on_step=_kill_after(4))
    with pytest.raises(ValueError, match=r"drafter\.learning_rate was 0\.003, is 0\.001.*delete .*\.d\.train_state"):
        _train(data, out, learning_rate=1e-3)
    cfg = TrainConfig.of(**CFG)
    with pytest.raises(ValueError, match="hidden_shards differ"):
        train_drafter(data["shards"][:1], data["vocab"], data["target_dir"], out, cfg, log=lambda _: None)
    # settings that do not change the computation may differ on resume
    with pytest.raises(Killed):
        _train(data, out, on_step=_kill_after(5), log_every=2, checkpoint_every=0)
    # resume: false starts over (and overwrites the old state)
    lines: list[str] = []
    _train(data, out, resume=False, lines=lines)
    assert not any("resuming" in line for line in lines)
    assert [e["step"] for e in _events(out, "train")][:2] == [1, 2]


def test_killed_process_resumes(data, uninterrupted, tmp_path):
    """A real SIGKILL of the command-line trainer after its first checkpoint, then an in-process resume."""
    out = tmp_path / "d"
    state = train_state_dir(out) / "state.pt"
    cfg = TrainConfig.of(**{**CFG, "checkpoint_every": 1})
    cmd = [
        sys.executable,
        "-m",
        "aerie.drafter.cli",
        "--hidden",
        *map(str, data["shards"]),
        "--vocab",
        str(data["vocab"]),
        "--target",
        str(data["target_dir"]),
        "--out",
        str(out),
        "--config",
        json.dumps({**CFG, "checkpoint_every": 1}),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 60
        while not state.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read().decode()[-2000:]
    lines: list[str] = []
    train_drafter(data["shards"], data["vocab"], data["target_dir"], out, cfg, log=lines.append)
    assert any(line.startswith("resuming from") for line in lines)
    a, b = _events(uninterrupted["out"], "train"), _events(out, "train")
    assert [e["step"] for e in a] == [e["step"] for e in b]
    assert [e["loss"] for e in b] == pytest.approx([e["loss"] for e in a], abs=1e-6)
    assert (out / "model.safetensors").read_bytes() == (uninterrupted["out"] / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------------------
# best and last checkpoints


def test_best_and_last_checkpoints(uninterrupted):
    out, result = uninterrupted["out"], uninterrupted["eval"]
    state = train_state_dir(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "eval.json",
        "model.safetensors",
        "tensorboard",
        "train_log.jsonl",
    ]
    assert sorted(p.name for p in state.iterdir()) == ["best", "last"]  # state.pt and the partial log are gone
    on_disk = json.loads((out / "eval.json").read_text())
    epochs = on_disk["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3] and len(on_disk["per_epoch"]) == 3
    accs = [e["simulated_acceptance_length"] for e in epochs]
    assert on_disk["best_epoch"] == 1 + accs.index(max(accs))  # first epoch reaching the maximum
    best = epochs[on_disk["best_epoch"] - 1]
    assert (
        on_disk["simulated_acceptance_length"]
        == best["simulated_acceptance_length"]
        == result["simulated_acceptance_length"]
    )
    assert on_disk["acceptance_per_position"] == best["acceptance_per_position"]
    for key in ("untrained", "heldout_loss", "tokens_trained", "tokens_per_s", "optimizer_steps", "per_epoch"):
        assert key in on_disk
    # the declared output holds the best epoch's drafter; last/ the final epoch's
    assert (out / "model.safetensors").read_bytes() == (state / "best" / "model.safetensors").read_bytes()
    assert json.loads((state / "best" / "config.json").read_text())["aerie"]["epoch"] == on_disk["best_epoch"]
    assert json.loads((state / "last" / "config.json").read_text())["aerie"]["epoch"] == 3
    Eagle3Drafter.from_pretrained(out)
    Eagle3Drafter.from_pretrained(state / "last")


def test_best_is_the_epoch_with_highest_heldout_acceptance(data, tmp_path, monkeypatch):
    """A scripted evaluation (acceptance 1.2, 1.5, 1.4): the output is epoch 2's drafter, last/ is epoch 3's."""
    import aerie.drafter_kinds.eagle3.training as side

    scripted = iter([1.0, 1.2, 1.5, 1.4])

    def fake_evaluate(*args, **kwargs):
        return {
            **side.EMPTY_EVAL,
            "simulated_acceptance_length": next(scripted),
            "heldout_loss": 1.0,
            "heldout_start_positions": 1,
        }

    monkeypatch.setattr(side, "evaluate", fake_evaluate)
    result = _train(data, tmp_path / "d")
    state = train_state_dir(tmp_path / "d")
    assert result["best_epoch"] == 2 and result["simulated_acceptance_length"] == 1.5
    assert json.loads((tmp_path / "d" / "config.json").read_text())["aerie"]["epoch"] == 2
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == (state / "best" / "model.safetensors").read_bytes()
    assert (state / "best" / "model.safetensors").read_bytes() != (state / "last" / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------------------
# the target's heads straight from its safetensors


def _save_wrapped(model: LlamaForCausalLM, folder: Path) -> None:
    """A Kimi-K2.5-like layout: a multimodal wrapper's text_config, tensors under language_model.*, sharded."""
    model.save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for i, file in enumerate(sorted(set(index["weight_map"].values()))):
        tensors = {f"language_model.{k}": v for k, v in load_file(folder / file).items()}
        if i == 0:
            tensors["vision_tower.patch_embed.weight"] = torch.ones(3)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    weight_map = {f"language_model.{k}": v for k, v in index["weight_map"].items()}
    weight_map["vision_tower.patch_embed.weight"] = sorted(set(index["weight_map"].values()))[0]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(
            {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
        )
    )


@pytest.mark.parametrize("layout", ["untied", "tied", "wrapped", "single-file"])
def test_target_heads_read_only_what_they_need(layout, tmp_path, monkeypatch):
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**{**TARGET, "tie_word_embeddings": layout == "tied"})).eval()
    folder = tmp_path / "target"
    if layout == "wrapped":
        _save_wrapped(model, folder)
    elif layout == "single-file":
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size="40KB")
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1 if layout == "single-file" else len(files) > 3

    import aerie.target_model.heads as heads_module

    opened = []
    real_safe_open = heads_module.safe_open
    monkeypatch.setattr(
        heads_module, "safe_open", lambda path, **kw: opened.append(Path(path).name) or real_safe_open(path, **kw)
    )
    heads = read_target_heads(folder)
    prefix = "language_model." if layout == "wrapped" else ""
    assert (
        heads.names["embed"] == f"{prefix}model.embed_tokens.weight"
        and heads.names["norm"] == f"{prefix}model.norm.weight"
    )
    assert heads.tied == (layout == "tied")
    assert heads.names["lm_head"] == (
        f"{prefix}model.embed_tokens.weight" if layout == "tied" else f"{prefix}lm_head.weight"
    )
    if layout != "single-file":  # only the shards holding those tensors were opened
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(opened) == sorted({index[n] for n in heads.names.values()})

    assert torch.equal(heads.embed, model.get_input_embeddings().weight)
    assert torch.equal(heads.lm_head, model.get_output_embeddings().weight)
    assert torch.equal(heads.norm, model.model.norm.weight)
    if layout != "wrapped":  # and what a full load gives
        full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert torch.equal(heads.embed, full.get_input_embeddings().weight)
        assert torch.equal(heads.lm_head, full.get_output_embeddings().weight)


def test_drafter_from_heads_equals_from_loaded_target(data):
    """The drafter built from the heads alone is the one Eagle3Drafter.from_target builds from the full model."""
    vocab = load_draft_vocab(data["vocab"])
    cfg = TrainConfig.of(**CFG)
    model, dcfg, head = build(data["target_dir"], vocab, AUX, cfg, "full", torch.device("cpu"))
    full = AutoModelForCausalLM.from_pretrained(data["target_dir"], dtype=torch.float32)
    assert dcfg == DrafterConfig.from_target(full.config, DRAFT_VOCAB, AUX)
    torch.manual_seed(cfg.seed)
    ref = Eagle3Drafter.from_target(full, dcfg, vocab.d2t, vocab.t2d)
    a, b = model.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(head.full, full.lm_head.weight)


# ---------------------------------------------------------------------------------------------------------
# several processes


# ---------------------------------------------------------------------------------------------------------
# windows and the token budget


def test_long_sequences_are_cut_into_windows_and_counted(uninterrupted):
    """Every sequence (20 rows) is longer than max_seq_len (16): each becomes two windows, every row trains or is
    held out, and eval.json and the train log say so; the memory estimate is recorded beside them."""
    w = uninterrupted["eval"]["windows"]
    assert w["sequences"] == NUM_SEQS and w["longest_sequence"] == SEQ_LEN and w["max_seq_len"] == 16
    assert w["sequences_cut_into_windows"] == NUM_SEQS
    assert w["windows"] == w["train_windows"] + w["heldout_windows"] == 2 * NUM_SEQS
    assert w["window_rows"] == NUM_SEQS * SEQ_LEN and w["windows_without_supervision_skipped"] == 0
    assert w["largest_batch_tokens"] <= w["batch_token_limit"] == CFG["batch_size"] * CFG["max_seq_len"]
    assert _events(uninterrupted["out"], "data")[0]["windows"] == w
    memory = uninterrupted["eval"]["memory"]
    assert memory["estimated_peak_bytes"] == sum(memory["estimated_parts"].values()) > 0
    assert memory["measured_peak_bytes"] is None  # CPU


def test_windows_without_supervision_are_counted(data):
    """One-row windows: the first two of each sequence predict only prompt tokens (loss mask 0) within their
    look-ahead, the last two have no token left to predict, so they are left out - and counted."""
    shards = open_hidden_shards(data["shards"])
    plan = plan_windows(shards, set(), max_len=1, lookahead=3 + 1)
    assert plan.stats["windows_without_supervision_skipped"] == 4 * NUM_SEQS
    assert plan.stats["windows"] == len(plan.train) == (SEQ_LEN - 4) * NUM_SEQS
    assert [w.start for w in plan.train[: SEQ_LEN - 4]] == list(range(2, SEQ_LEN - 2))


def test_batches_keep_to_the_token_budget():
    """Windows go into batches in order; a batch holds at most batch_size windows and its padded size (windows x
    the longest) stays within max_batch_tokens."""
    lengths = [10, 3, 7, 10, 2, 2, 2, 2, 9, 4]
    windows = [Window(0, 100 * i, 100 * i + n, 100 * i + n, 0) for i, n in enumerate(lengths)]
    cfg = TrainConfig.of(batch_size=3, max_seq_len=10, max_batch_tokens=20, packing=False)
    groups = batches(windows, cfg, None)
    assert [w for g in groups for w in g] == windows
    assert all(len(g) <= 3 and padded_tokens(g) <= 20 for g in groups)
    assert [len(g) for g in groups] == [2, 2, 3, 2, 1]  # closed by the budget, the budget, batch_size, ...
    unbudgeted = TrainConfig.of(batch_size=3, max_seq_len=10, packing=False)
    assert max(padded_tokens(g) for g in batches(windows, unbudgeted, None)) == 30
    assert cfg.largest_batch_tokens == 20 and unbudgeted.largest_batch_tokens == 30


def test_packed_batches_fill_rows_within_the_budget():
    """Packed: windows share rows of max_seq_len (a later window of the order fills a gap), at most batch_size
    windows and max_batch_tokens // max_seq_len rows per batch; every window once; far less padding."""
    lengths = [10, 3, 7, 10, 2, 2, 2, 2, 9, 4, 6, 1]
    windows = [Window(0, 100 * i, 100 * i + n, 100 * i + n, 0) for i, n in enumerate(lengths)]
    cfg = TrainConfig.of(batch_size=4, max_seq_len=10, max_batch_tokens=20)
    groups = batches(windows, cfg, None)
    assert sorted(w.start for g in groups for w in g) == [w.start for w in windows]
    assert all(len(g) <= 4 and padded_tokens(g, 10) <= 20 for g in groups)
    assert [[w.end - w.start for w in g] for g in groups] == [[10, 3, 7], [10, 2, 2, 2], [2, 9, 4, 1], [6]]
    padded = batches(windows, TrainConfig.of(batch_size=4, max_seq_len=10, max_batch_tokens=20, packing=False), None)
    real = sum(lengths)
    assert sum(padded_tokens(g, 10) for g in groups) / real < sum(padded_tokens(g) for g in padded) / real
    # a cut window's look-ahead rows stay reserved: the next window starts after them
    cut = [Window(0, 0, 6, 9, 0), Window(0, 50, 53, 53, 0)]
    assert pack_rows(cut, 10) == [[0], [1]] and pack_rows(cut, 12) == [[0, 1]]


def test_a_budget_below_one_window_is_refused():
    with pytest.raises(ValueError, match=r"max_batch_tokens \(1000\) is below drafter.max_seq_len \(2048\)"):
        TrainConfig.of(max_seq_len=2048, max_batch_tokens=1000)


def test_shard_for_rank_is_a_padded_partition():
    groups = list(range(10))
    shares = [shard_for_rank(groups, r, 4) for r in range(4)]
    assert [len(s) for s in shares] == [3, 3, 3, 3]  # equal: DDP ranks step together
    assert sorted(sum(shares, [])) == sorted(groups + [0, 1])  # everything once, padded by wrapping around
    assert shares[1] == [1, 5, 9]
    assert shard_for_rank(groups, 0, 1) == groups
    assert [shard_for_rank([7], r, 3) for r in range(3)] == [[7], [7], [7]]
    cfg, windows = TrainConfig.of(batch_size=2), [Window(0, i, i + 1, i + 1, 0) for i in range(9)]
    assert epoch_batches(windows, cfg, 1) == epoch_batches(windows, cfg, 1)  # rebuilt exactly on resume
    assert epoch_batches(windows, cfg, 1) != epoch_batches(windows, cfg, 2)  # reshuffled per epoch


def test_torchrun_command_and_process_count():
    cfg = TrainConfig.of(epochs=1, threads=2)
    cmd = torchrun_command(
        8,
        [Path("a.safetensors"), Path("b.safetensors")],
        Path("v"),
        Path("/models/K"),
        Path("results/drafter/x"),
        cfg,
        python="py",
    )
    assert cmd[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert cmd[5:7] == ["-m", "aerie.drafter.cli"]
    assert cmd[cmd.index("--hidden") + 1 : cmd.index("--vocab")] == ["a.safetensors", "b.safetensors"]
    assert cmd[cmd.index("--out") + 1] == "results/drafter/x" and cmd[cmd.index("--target") + 1] == "/models/K"
    assert TrainConfig.of(**json.loads(cmd[cmd.index("--config") + 1])) == cfg
    assert processes_for(1, cfg) == 1 and processes_for(0, cfg) == 1
    assert processes_for(8, TrainConfig.of(device="cpu")) == 1
    if not torch.cuda.is_available():
        assert processes_for(8, cfg) == 1


DRIVER = """
import json, runpy, sys
from types import SimpleNamespace as NS
import aerie.drafter.distributed as distributed
distributed.processes_for = lambda gpus, cfg: gpus  # pretend CUDA shows the granted GPUs: torchrun runs on CPU (gloo)
a = json.loads(sys.argv[1])
snakemake = NS(input=NS(hidden=a["hidden"], vocab=a["vocab"]),
               params=NS(target=a["target"], drafter=a["drafter"], aux_layer_ids=a["aux_layer_ids"], card={},
                         sglang={}),
               output=[a["out"]], log=[a["log"]], threads=2, resources=NS(gpu=2))
runpy.run_path(a["script"], init_globals={"snakemake": snakemake})
"""


def test_rule_script_runs_two_torchrun_processes_on_cpu(data, uninterrupted, tmp_path):
    """scripts/drafter.py with resources.gpu=2 launches torchrun --nproc_per_node=2 (gloo on CPU here): one
    drafter, rank 0 alone logs and writes, and the all-reduced untrained evaluation equals the single-process
    one (same initial weights, held-out set split over the ranks)."""
    out, rule_log = tmp_path / "d", tmp_path / "drafter.log"
    args = {
        "hidden": [str(x) for x in data["shards"]],
        "vocab": str(data["vocab"]),
        "target": str(data["target_dir"]),
        "drafter": {**CFG, "epochs": 1},
        "out": str(out),
        "log": str(rule_log),
        "script": str(REPO / "scripts" / "drafter.py"),
        "aux_layer_ids": AUX,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(args)], capture_output=True, text=True, timeout=600, env=env
    )
    text = rule_log.read_text() if rule_log.exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + text[-3000:]
    assert "torch.distributed.run --standalone --nproc_per_node=2 -m aerie.drafter.cli" in text
    assert "--layer-ids '[0, 1, 2]'" in text  # the resolved layers reach every process
    assert "2 processes" in text and text.count("written to") == 1  # rank 0 speaks for the job
    result = json.loads((out / "eval.json").read_text())
    assert result["processes"] == 2
    single = uninterrupted["eval"]["untrained"]
    assert result["untrained"]["acceptance_per_position"] == pytest.approx(single["acceptance_per_position"], abs=1e-12)
    assert result["untrained"]["heldout_loss"] == pytest.approx(single["heldout_loss"], rel=1e-9)
    n_single = len(_events(uninterrupted["out"], "train")) // CFG["epochs"]
    assert len(_events(out, "train")) == (n_single + 1) // 2  # each rank takes every other batch
    Eagle3Drafter.from_pretrained(out)


# ---------------------------------------------------------------------------------------------------------
# the DFlash kind through the same loop

DFLASH = dict(
    kind="dflash",
    num_layers=2,
    block_size=4,
    num_anchors=6,
    mask_token_id=2,  # the world's sequences draw ids from 3 up: 0..2 never occur
    target_layer_ids=[0, 2],
    epochs=3,
    learning_rate=3e-3,
    warmup_ratio=0.1,
    batch_size=8,
    max_seq_len=16,
    eval_fraction=0.2,
    seed=0,
    threads=1,
    log_every=1,
    checkpoint_every=3,
    grad_clip=1.0,
)


def _train_dflash(data, out: Path, on_step=None, **overrides) -> dict:
    cfg = TrainConfig.of(**{**DFLASH, **overrides})
    return train_drafter(data["shards"], None, data["target_dir"], out, cfg, log=lambda _: None, on_step=on_step)


def test_dflash_trains_resumes_exactly_and_exports_what_sglang_loads(data, tmp_path):
    """The generic loop trains a DFlash drafter from the shards' layers [0, 2] (columns of the captured [0, 1, 2]);
    a run killed mid-epoch resumes to the same bytes (the anchors of each step are seeded by the step); the folder
    is SGLang's DFlashDraftModel layout, reads back with its target layers and MASK id, and loads for drafting."""
    from aerie.drafter_kinds.dflash.folder import read_dflash_folder
    from aerie.drafter_kinds.dflash.weights import load_dflash

    straight = tmp_path / "straight"
    result = _train_dflash(data, straight)
    assert result["kind"] == "dflash" and result["block_size"] == 4 and result["heldout_start_positions"] > 0
    assert result["simulated_acceptance_length"] >= 1.0 and len(result["acceptance_per_position"]) == 3
    assert not (straight / "draft_vocab.safetensors").exists()
    shape, tensors = read_dflash_folder(straight)
    assert list(shape.target_layer_ids) == [0, 2] and shape.mask_token_id == 2 and shape.block_size == 4
    assert "fc.weight" in tensors and tensors["fc.weight"].shape == (32, 64)
    config = json.loads((straight / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["aerie"]["epoch"] == result["best_epoch"]
    assert load_dflash(straight, json.loads((data["target_dir"] / "config.json").read_text())) is not None

    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        _train_dflash(data, killed, on_step=_kill_after(4))
    _train_dflash(data, killed)
    assert (killed / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()


def test_dflash_warm_start_is_the_folder_and_a_mismatched_one_is_refused(data, tmp_path):
    """drafter.init of a DFlash folder: before any step the export is the folder again; a folder whose layers or
    block differ from what the run asks is refused naming the setting."""
    from aerie.drafter_kinds.folders import DrafterFolderError

    start = tmp_path / "start"
    _train_dflash(data, start, epochs=1)
    again = tmp_path / "again"
    result = _train_dflash(data, again, epochs=1, learning_rate=1e-12, init=str(start), num_layers=0, block_size=0)
    assert result["best_epoch"] in (0, 1)
    a, b = load_file(start / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(DrafterFolderError, match="block_size"):
        _train_dflash(data, tmp_path / "bad", epochs=1, init=str(start), block_size=3)
    with pytest.raises(DrafterFolderError, match="target layers"):
        _train_dflash(data, tmp_path / "bad2", epochs=1, init=str(start), target_layer_ids=[1, 2])


def test_dflash_refuses_a_mask_id_that_occurs_in_the_data(data, tmp_path):
    with pytest.raises(ValueError, match="MASK id"):
        _train_dflash(data, tmp_path / "d", mask_token_id=5)
