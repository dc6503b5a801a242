"""bench/peer_training.py and the tables made from its committed results.

SpecForge itself is not installed in the test environment (it stays out of the default test path); what is
checked: the contract its ``OfflineEagle3Dataset.process_data`` reads (``input_ids`` and ``loss_mask`` of
shape [T], the target's final hidden state ``hidden_state`` [1, T, H] and the concatenated aux layers
``aux_hidden_state`` [1, T, A*H], row for row the shard's); that every rung of the SpecForge ladder changes
exactly the one thing it names from SpecForge's defaults; that a finished arm x seed is never recomputed and
never mixed with other data; the paired t-test; and that every table bench/tables.py generates into
bench/RESULTS.md equals what the committed result files give (``python bench/tables.py`` rewrites them).
With ``AERIE_SPECFORGE_SITE`` pointing at ``pip install --no-deps --target DIR specforge==0.2.0``, one more test
builds SpecForge's own drafter for a tiny target and checks its final norm runs before lm_head.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import save_file

sys.path.insert(0, str(REPO / "bench"))

import paired_stats  # noqa: E402
import tables  # noqa: E402
from peer_training import (  # noqa: E402
    ARMS,
    LADDER,
    SPECFORGE_ARMS,
    finished,
    loss_over_supervised_rows,
    specforge_arm_settings,
    specforge_sample,
    write_specforge_samples,
)

from aerie.drafter.config import TrainConfig  # noqa: E402
from aerie.formats.hidden import open_hidden_shards  # noqa: E402

H, A, V = 8, 3, 32  # hidden size, aux layers, vocab: the conversion does not depend on the sizes


def write_shard(path: Path, seqs: int, seq_len: int) -> Path:
    """A ``full``-layout hidden shard of random features (what the hidden rule writes, minus the target)."""
    torch.manual_seed(0)
    T = seqs * seq_len
    save_file(
        {
            "input_ids": torch.randint(0, V, (T,), dtype=torch.int32),
            "loss_mask": (torch.rand(T) > 0.4).to(torch.uint8),
            "seq_offsets": torch.arange(seqs + 1, dtype=torch.int64) * seq_len,
            "aux_hidden_states": torch.randn(T, A * H).to(torch.bfloat16),
            "final_hidden_states": torch.randn(T, H).to(torch.bfloat16),
        },
        str(path),
        metadata={
            "format": "aerie.hidden/1",
            "aux_layer_ids": json.dumps([1, 3, 4]),
            "hidden_size": str(H),
            "vocab_size": str(V),
            "num_hidden_layers": "8",
            "target": "t",
            "sample_ids": json.dumps([f"s/{i}" for i in range(seqs)]),
        },
    )
    return path


def test_each_sequence_becomes_one_specforge_sample(tmp_path: Path) -> None:
    (shard,) = open_hidden_shards([write_shard(tmp_path / "shard-00000.safetensors", seqs=3, seq_len=16)])
    sample = specforge_sample(shard, 1)
    assert sample["input_ids"].shape == (16,) and sample["loss_mask"].shape == (16,)
    assert sample["hidden_state"].shape == (1, 16, H) and sample["aux_hidden_state"].shape == (1, 16, A * H)
    assert torch.equal(sample["input_ids"], shard.input_ids[16:32])
    assert torch.equal(sample["loss_mask"].bool(), shard.loss_mask[16:32])
    assert torch.equal(sample["hidden_state"][0], shard.rows("final_hidden_states", 16, 32).to(torch.bfloat16))
    assert torch.equal(sample["aux_hidden_state"][0], shard.aux_rows(16, 32, torch.bfloat16))

    paths = write_specforge_samples([shard], [(0, 2), (0, 0)], tmp_path / "sf")
    assert [p.name for p in paths] == ["data_00000.ckpt", "data_00001.ckpt"]
    first = torch.load(paths[0], weights_only=False)
    assert torch.equal(first["input_ids"], shard.input_ids[32:48])


def test_mask_on_predicted_token_shifts_the_mask_by_two(tmp_path: Path) -> None:
    """SpecForge's row t learns token t+2: aerie's rule (supervised when the predicted token was generated) is
    the mask of token t+2 stored at t, with the last two rows (predicting past the sequence) never supervised."""
    (shard,) = open_hidden_shards([write_shard(tmp_path / "shard-00000.safetensors", seqs=2, seq_len=10)])
    plain = specforge_sample(shard, 1)
    shifted = specforge_sample(shard, 1, mask_on_predicted_token=True)
    mask = shard.loss_mask[10:20].long()
    assert torch.equal(plain["loss_mask"], mask)
    assert torch.equal(shifted["loss_mask"][:8], mask[2:])
    assert shifted["loss_mask"][8:].tolist() == [0, 0]
    for key in ("input_ids", "hidden_state", "aux_hidden_state"):  # only the mask moves
        assert torch.equal(shifted[key], plain[key])
    (path,) = write_specforge_samples([shard], [(0, 1)], tmp_path / "sf", mask_on_predicted_token=True)
    assert torch.equal(torch.load(path, weights_only=False)["loss_mask"], shifted["loss_mask"])


def test_loss_over_supervised_rows_divides_by_the_supervised_rows_only() -> None:
    """The ``+rows`` rung: the same masked soft cross-entropy as SpecForge's, summed over the supervised rows and
    divided by their number (aerie's normalisation), not by every row of the batch."""
    torch.manual_seed(0)
    B, T, Vd = 2, 5, 7
    logits, target_p = torch.randn(B, T, Vd), torch.softmax(torch.randn(B, T, Vd), -1)
    mask = torch.zeros(B, T, 1)
    mask[0, 1:4] = 1  # 3 supervised rows of 10
    ce = -(target_p * torch.log_softmax(logits, -1)).sum(-1)  # [B, T]
    expected = ce[0, 1:4].sum() / 3
    assert torch.allclose(loss_over_supervised_rows(logits, target_p, mask), expected)
    assert float(loss_over_supervised_rows(logits, target_p, torch.zeros(B, T, 1))) == 0.0  # none: no NaN


# ---- the ladder: SpecForge's defaults, one change per rung ---------------------------------------------------
SPECFORGE_DEFAULTS = {  # SpecForge 0.2.0's, as peer_training.specforge_defaults reads them from its schema
    "learning_rate": 1e-4,
    "warmup_ratio": 0.015,
    "batch_size": 1,
    "ttt_length": 7,
    "num_epochs": 1,
    "max_grad_norm": 0.5,
    "lr_scheduler": "cosine",
    "attention_backend": "flex_attention",
    "lk_loss_type": None,
    "kl_scale": 1.0,
    "kl_decay": 1.0,
    "compact_teacher": False,
    "max_length": 2048,
    "torch_dtype": "bfloat16",
    "weight_decay": 0.0,
    "betas": [0.9, 0.999],
    "cosine_floor": 0.0,
    "ploss_decay": 0.8,
    "seed": 42,
}
RUNG_CHANGES = {  # what each rung may change from the one above it, and nothing else
    "specforge-matched": {"learning_rate", "ttt_length", "batch_size"},
    "+head": {"head_from_target"},
    "+rows": {"loss_over_supervised_rows"},
    "+mask": {"mask_on_predicted_token"},
    "+betas": {"betas"},
    "+schedule": {"warmup_ratio", "cosine_floor"},
}


def test_each_rung_changes_the_one_thing_it_names_from_specforge_defaults() -> None:
    """specforge-default trains at SpecForge's defaults but for the settings every arm shares on purpose (listed
    in the result); each later rung differs from the one above in exactly its own settings, and the last rung
    trains with aerie's values for all of them."""
    cfg = TrainConfig.of(epochs=1, seed=3, ttt_steps=3, batch_size=4, learning_rate=1e-3, max_seq_len=2048)
    arms = list(LADDER)
    assert ARMS[0] == "aerie" and arms[0] == "specforge-default" and len(arms) == 1 + len(RUNG_CHANGES)
    assert list(ARMS[1 : 1 + len(arms)]) == arms  # the ladder in rung order, the diagnostic arms after it
    settings = [specforge_arm_settings(SPECFORGE_DEFAULTS, SPECFORGE_ARMS[a], cfg, "float32") for a in arms]
    first = settings[0]
    assert first["kept_apart_from_defaults"] == ["attention_backend", "seed", "torch_dtype"]
    for key, value in SPECFORGE_DEFAULTS.items():
        if key not in first["kept_apart_from_defaults"]:
            assert first[key] == value, key
    assert not any(first[k] for k in ("head_from_target", "loss_over_supervised_rows", "mask_on_predicted_token"))
    for (rung, allowed), above, here, arm in zip(RUNG_CHANGES.items(), settings, settings[1:], arms[1:]):
        assert arm.endswith(rung)
        changed = {k for k in here if here[k] != above[k]}
        assert changed == allowed, f"{arm} changes {changed}, should change {allowed}"
        assert SPECFORGE_ARMS[arm].changes  # the table's "changes" column names it
    last = settings[-1]
    assert (last["learning_rate"], last["ttt_length"], last["batch_size"]) == (1e-3, 3, 4)
    assert (last["warmup_ratio"], last["cosine_floor"], last["betas"]) == (
        cfg.warmup_ratio,
        cfg.min_lr_ratio,
        [0.9, 0.95],
    )
    assert (last["max_grad_norm"], last["weight_decay"], last["ploss_decay"]) == (
        cfg.grad_clip,
        cfg.weight_decay,
        cfg.step_loss_decay,
    )  # already equal at SpecForge's defaults: no rung needed
    assert last["head_from_target"] and last["loss_over_supervised_rows"] and last["mask_on_predicted_token"]
    assert all(s["norm_before_lm_head"] for s in settings)  # SpecForge's default on every rung
    for name, arm in SPECFORGE_ARMS.items():  # off the ladder: its ladder arm with the final norm off, nothing else
        if name in LADDER:
            continue
        base = specforge_arm_settings(SPECFORGE_DEFAULTS, LADDER[arm.compare_to], cfg, "float32")
        diag = specforge_arm_settings(SPECFORGE_DEFAULTS, arm, cfg, "float32")
        assert {k for k in diag if diag[k] != base[k]} == {"norm_before_lm_head"} and not diag["norm_before_lm_head"]


@pytest.mark.skipif(not os.environ.get("AERIE_SPECFORGE_SITE"), reason="AERIE_SPECFORGE_SITE (SpecForge 0.2.0) not set")
def test_specforge_drafter_is_built_at_its_own_defaults(tmp_path: Path) -> None:
    """SpecForge's own draft config for a tiny target: its final RMSNorm runs before lm_head (``norm_output`` left
    to SpecForge, which defaults it to True) - the setting every SpecForge arm ran without before issue 24."""
    from peer_training import (
        install_specforge,
        smoke_data,
        specforge_defaults,
        specforge_draft_config,
        specforge_drafter,
    )

    sf = install_specforge(Path(os.environ["AERIE_SPECFORGE_SITE"]))
    _, target = smoke_data(tmp_path, seqs=2, seq_len=8)
    config = specforge_draft_config(sf, target, draft_vocab_size=256)
    assert not hasattr(config, "norm_output") or config.norm_output is True
    vocab = argparse.Namespace(
        d2t=torch.zeros(256, dtype=torch.int64), t2d=torch.ones(256, dtype=torch.bool), target_ids=torch.arange(256)
    )
    heads = argparse.Namespace(lm_head=torch.randn(256, config.hidden_size), norm=torch.ones(config.hidden_size))
    for name in LADDER:
        model = specforge_drafter(sf, config, target, vocab, heads, 0, LADDER[name], torch.float32)
        assert model.norm_output is True, name
    with torch.no_grad():
        model.norm.weight.mul_(3.0)
        h = torch.randn(1, 4, config.hidden_size)
        assert torch.allclose(model.compute_logits(h), model.lm_head(model.norm(h)))
    off = SPECFORGE_ARMS["specforge-matched-norm-off"]
    assert specforge_drafter(sf, config, target, vocab, heads, 0, off, torch.float32).norm_output is False
    assert not hasattr(config, "norm_output") or config.norm_output is True  # the shared config is left as it was
    assert specforge_defaults(sf) == SPECFORGE_DEFAULTS


# ---- result files: never recomputed, never mixed -------------------------------------------------------------
def test_a_finished_arm_and_seed_is_skipped_and_other_data_is_refused(tmp_path: Path) -> None:
    args = argparse.Namespace(
        results=tmp_path, run="r", epochs=1, ttt=3, batch_size=4, lr=1e-3, eval_fraction=0.2, max_len=2048,
        threads=1, specforge_dtype="float32", bench_prompts=None,
    )  # fmt: skip
    identity = {"hidden": [{"name": "a", "sha256": "11"}], "target": [{"name": "m", "sha256": "22"}]}
    assert not finished(args, "aerie", 0, identity)
    path = tmp_path / "r" / "aerie" / "seed-0.json"
    path.parent.mkdir(parents=True)
    from peer_training import run_settings

    path.write_text(json.dumps({"data": identity, "run_settings": run_settings(args)}))
    assert finished(args, "aerie", 0, identity)
    other = {**identity, "hidden": [{"name": "a", "sha256": "99"}]}
    with pytest.raises(SystemExit, match="other data or settings"):
        finished(args, "aerie", 0, other)
    args.lr = 1e-4
    with pytest.raises(SystemExit, match="other data or settings"):
        finished(args, "aerie", 0, identity)


# ---- the paired test and the tables ----------------------------------------------------------------------------
def test_t_distribution_matches_printed_tables() -> None:
    """Two-sided p at the textbook 97.5 % quantiles of Student's t is 0.05; df 1 at t = 1 is exactly 0.5 (Cauchy)."""
    for df, t in ((1, 12.7062), (2, 4.302653), (4, 2.776445), (5, 2.570582), (10, 2.228139), (30, 2.042272)):
        assert paired_stats.t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-6)
        assert paired_stats.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)
    assert paired_stats.t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-12)
    assert paired_stats.t_two_sided_p(0.0, 4) == pytest.approx(1.0)


def test_paired_test_on_per_seed_differences() -> None:
    a, b = [2.50, 2.45, 2.55, 2.48, 2.52], [2.40, 2.38, 2.41, 2.43, 2.39]
    out = paired_stats.paired_test(a, b)
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / 5
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4)
    assert out["mean_diff"] == pytest.approx(mean) and out["sd_diff"] == pytest.approx(sd)
    assert out["t"] == pytest.approx(mean / (sd / math.sqrt(5)))
    assert out["p"] < 0.01 and out["ci95"][0] > 0
    assert out["sign_flip_p"] == pytest.approx(2 / 32)  # the floor of a 5-seed permutation test
    noisy = paired_stats.paired_test([2.5, 2.3, 2.6, 2.2, 2.4], [2.4, 2.4, 2.4, 2.4, 2.4])
    assert noisy["p"] > 0.5 and noisy["ci95"][0] < 0 < noisy["ci95"][1]
    with pytest.raises(ValueError, match="same seeds"):
        paired_stats.paired_test([1.0], [1.0, 2.0])


def test_every_paired_cell_prints_the_sign_count_and_the_exact_sign_flip_p() -> None:
    """Issue 37's covered study: one seed of five above, t p 0.048 - the cell shows both, so a t-test verdict that
    rests on normality is visible as such."""
    warm = [2.85, 2.83, 2.86, 2.92, 2.82]
    published = [2.907] * 5
    test = paired_stats.paired_test(warm, published)
    assert test["signs"] == (1, 4, 0)
    # the exact sign-flip p by enumeration, written out: patterns whose |sum| reaches the observed one
    diffs = [w - p for w, p in zip(warm, published)]
    import itertools

    extreme = sum(
        abs(sum(s * d for s, d in zip(signs, diffs))) >= abs(sum(diffs)) - 1e-12
        for signs in itertools.product((1, -1), repeat=5)
    )
    assert test["sign_flip_p"] == pytest.approx(extreme / 32)
    text = tables.gap_text(test)
    assert "1 of 5 above" in text and f"sign-flip p {tables.p_text(test['sign_flip_p'])}" in text and "t p " in text
    assert "1 tied" in tables.gap_text(paired_stats.paired_test([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]))


def write_result(run: Path, arm: str, seed: int, sim: float, rung: int) -> None:
    path = run / arm / f"seed-{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    load = {"loadavg": [1.0, 1.0, 1.0]}
    path.write_text(
        json.dumps(
            {
                "arm": arm,
                "seed": seed,
                "rung": rung,
                "changes": "x",
                "figures": {
                    "simulated_acceptance_length": sim,
                    "acceptance_per_position": [sim - 1],
                    "tokens_per_s": 1,
                },
                "data": {"sequences": 3, "tokens": 30, "supervised_tokens": 9, "hidden": [{"sha256": "ab" * 32}]},
                "run_settings": {"lr": 0.001},
                "code": {"commit": "c" * 40, "dirty": []},
                "load_before": load,
                "load_after": load,
                "machine": {"cpus": 2},
                "started_at": f"2026-01-0{seed + 1}",
            }
        )
    )


def test_peer_table_reports_spread_and_paired_gaps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for seed, (a, b) in enumerate([(2.5, 2.4), (2.45, 2.38), (2.55, 2.41)]):
        write_result(run, "aerie", seed, a, 0)
        write_result(run, "specforge-default", seed, b, 1)
    text = tables.peer_training_table(run)
    assert "| `aerie` | x | 0, 1, 2 | 2.500 ± 0.050 |" in text
    gap = paired_stats.paired_test([2.4, 2.38, 2.41], [2.5, 2.45, 2.55])
    assert f"{gap['mean_diff']:+.3f} [{gap['ci95'][0]:+.3f}, {gap['ci95'][1]:+.3f}]" in text
    assert ("beyond the spread" in text) == (gap["p"] < 0.05)


def test_committed_tables_equal_what_the_committed_results_give() -> None:
    """Every generated block of bench/RESULTS.md is what bench/tables.py renders from bench/results/ now: a table
    copied by hand, or data committed without regenerating, fails here (fix: python bench/tables.py)."""
    text = tables.RESULTS_MD.read_text()
    gens = tables.generators()
    regenerated, unplaced = tables.regenerate(text, gens)
    assert regenerated == text, "bench/RESULTS.md is stale: run .venv/bin/python bench/tables.py"
    assert not unplaced, f"committed results with no block in bench/RESULTS.md: {unplaced}"
