"""The user's traffic mix (aerie.drafter.traffic, aerie.benchmark.traffic) and replay counts
(aerie.drafter.replay): pure functions the training loop, the previews, the gate and the report use."""

from __future__ import annotations

import math

import pytest

from aerie.benchmark.traffic import SetFigure, serve_choice, traffic_verdict, weighted_acceptance
from aerie.drafter.replay import replay_count, replay_preview_line, samples_per_epoch
from aerie.drafter.traffic import (
    chain_length_variance,
    check_traffic,
    combine_heldout,
    dataset_of_shard,
    floor_message,
    heldout_halfwidth,
    heldout_weights,
    separates,
)


def test_traffic_is_checked_by_name_and_normalised() -> None:
    assert check_traffic({"own": 3, "mt_bench": 1}, ["own", "mt_bench"]) == {"own": 0.75, "mt_bench": 0.25}
    with pytest.raises(ValueError, match=r"bench.traffic.gsm8k: not a benchmark set of this run \(its sets: own\)"):
        check_traffic({"gsm8k": 1}, ["own"])
    with pytest.raises(ValueError, match="bench.traffic.own: a weight is a number >= 0"):
        check_traffic({"own": -1}, ["own"])
    with pytest.raises(ValueError, match="every weight is 0"):
        check_traffic({"own": 0}, ["own"])


def test_sets_without_held_out_data_are_judged_on_the_replay_split_or_named() -> None:
    mix = heldout_weights({"own": 0.6, "mt_bench": 0.3, "gsm8k": 0.1}, ["own", "kimi_mtp"], "kimi_mtp")
    assert mix.weights == pytest.approx({"own": 0.6, "kimi_mtp": 0.4})
    assert mix.stand_ins == {"mt_bench": "kimi_mtp", "gsm8k": "kimi_mtp"} and not mix.left_out
    alone = heldout_weights({"own": 0.6, "mt_bench": 0.4}, ["own"], "")
    assert alone.weights == {"own": 1.0} and alone.left_out == ["mt_bench"]
    assert "not in the choice (no held-out data stands for them): mt_bench" in alone.describe()
    assert dataset_of_shard("results/kimi_mtp/hidden/shard-00003.safetensors") == "kimi_mtp"
    with pytest.raises(ValueError, match="not a pipeline shard path"):
        dataset_of_shard("somewhere/file.safetensors")


def test_combined_heldout_is_the_weighted_mean_of_each_figure() -> None:
    a = {"simulated_acceptance_length": 3.0, "acceptance_per_position": [0.9, 0.7, 0.4], "heldout_loss": 1.0,
         "heldout_start_positions": 100}  # fmt: skip
    b = {"simulated_acceptance_length": 2.0, "acceptance_per_position": [0.6, 0.3, 0.1], "heldout_loss": 2.0,
         "heldout_start_positions": 300}  # fmt: skip
    empty = {"simulated_acceptance_length": None, "heldout_start_positions": 0}
    out = combine_heldout(
        {"own": a, "general": b, "bench_only": empty}, {"own": 0.7, "general": 0.2, "bench_only": 0.1}
    )
    w = {"own": 0.7 / 0.9, "general": 0.2 / 0.9}  # renormalised over the datasets that held something out
    assert out["simulated_acceptance_length"] == pytest.approx(3.0 * w["own"] + 2.0 * w["general"])
    assert out["acceptance_per_position"][0] == pytest.approx(0.9 * w["own"] + 0.6 * w["general"])
    assert out["heldout_start_positions"] == 400 and out["weights"] == pytest.approx(w)
    assert set(out["by_dataset"]) == {"own", "general", "bench_only"}


def test_the_floor_says_when_the_split_cannot_tell_drafters_apart() -> None:
    # chain length 1 or 4 with equal odds: variance 2.25
    assert chain_length_variance([0.5, 0.5, 0.5]) == pytest.approx(2.25)
    assert chain_length_variance([0.0, 0.0, 0.0], starts=10) > 0  # a small split showing no spread is not precise
    small = {"own": {"acceptance_per_position": [0.5, 0.5, 0.5], "heldout_start_positions": 100}}
    h = heldout_halfwidth(small, {"own": 1.0})
    assert h == pytest.approx(1.959964 * math.sqrt(chain_length_variance([0.5] * 3, 100) / 100))
    assert not separates(h) and "about" in floor_message(h, 100)
    big = {"own": {"acceptance_per_position": [0.5, 0.5, 0.5], "heldout_start_positions": 20_000}}
    assert (
        separates(heldout_halfwidth(big, {"own": 1.0})) and floor_message(heldout_halfwidth(big, {"own": 1}), 1) is None
    )


def test_the_gate_fails_a_drafter_that_loses_any_set_or_the_mix_naming_the_figures() -> None:
    per_set = {
        "own": {"trained": SetFigure(3.0, 0.02), "published": SetFigure(2.5, 0.02)},
        "mt_bench": {"trained": SetFigure(2.60, 0.02), "published": SetFigure(2.69, 0.02)},
    }
    verdict = traffic_verdict(per_set, {"own": 0.8, "mt_bench": 0.2}, "trained", ["published"])
    assert not verdict.passed
    assert verdict.failures == [
        "mt_bench: trained's acceptance 2.600 loses to published's 2.690 (-0.090, beyond the spread +-0.020)"
    ]
    assert verdict.weighted["trained"] == pytest.approx(0.8 * 3.0 + 0.2 * 2.6)
    # within the spread on the general set, ahead on the mix: passes
    per_set["mt_bench"]["trained"] = SetFigure(2.68, 0.02)
    assert traffic_verdict(per_set, {"own": 0.8, "mt_bench": 0.2}, "trained", ["published"]).passed
    # ahead nowhere by enough on the mix: fails naming the mix
    tie = {"own": {"trained": SetFigure(2.5), "published": SetFigure(2.5)}}
    failed = traffic_verdict(tie, {"own": 1.0}, "trained", ["published"], mix_spread=0.01)
    assert failed.failures[0].startswith(
        "weighted mix: trained's acceptance 2.500 does not beat the best reference published's"
    )


def test_a_sets_figure_and_its_spread_from_per_prompt_counts() -> None:
    from aerie.benchmark.traffic import acceptance_figure

    same = acceptance_figure([30, 30, 30], [10, 10, 10])
    assert same.value == 3.0 and same.spread == 0.0  # every prompt at the same rate: no spread
    mixed = acceptance_figure([40, 20, 30, 30], [10, 10, 10, 10])
    assert mixed.value == 3.0
    se = math.sqrt((100 + 100 + 0 + 0) / (4 * 3)) / 10
    assert mixed.spread == pytest.approx(1.959964 * se)
    with pytest.raises(ValueError, match="per-prompt counts"):
        acceptance_figure([1], [])


def test_serve_choice_names_the_drafter_and_its_trade_off() -> None:
    per_set = {
        "own": {"trained": SetFigure(3.0), "published": SetFigure(2.5)},
        "mt_bench": {"trained": SetFigure(2.6), "published": SetFigure(2.7)},
    }
    choice, why = serve_choice(per_set, {"own": 0.8, "mt_bench": 0.2})
    assert choice == "trained" and "mt_bench (best there: published 2.700 vs 2.600)" in why
    choice, _ = serve_choice(per_set, {"own": 0.1, "mt_bench": 0.9})
    assert choice == "published"
    assert weighted_acceptance(per_set, {"own": 1.0, "gsm8k": 1.0}) == {"published": 2.5, "trained": 3.0}


def test_replay_counts_per_epoch() -> None:
    assert replay_count(own=40, share=0.5, pool=100) == 40  # one replay window per own one
    assert replay_count(own=40, share=0.2, pool=100) == 10
    assert replay_count(own=40, share=0.9, pool=100) == 100  # never more than the pool
    assert replay_count(own=40, share=0.0, pool=100) == 0
    per_epoch = samples_per_epoch({"own": 1000, "kimi_mtp": 10_000}, "kimi_mtp", 0.2)
    assert per_epoch == {"own": 1000, "kimi_mtp": 250}
    line = replay_preview_line({"own": 1000, "kimi_mtp": 10_000}, {"own": 800, "kimi_mtp": 1200}, "kimi_mtp", 0.2, 2)
    assert "250 of its 10,000 samples (~0.30M tokens) per epoch" in line and "~0.60M replay tokens over 2" in line
    assert "held out for the epoch choice only" in replay_preview_line({"a": 1}, {}, "a", 0.0, 1)


def _demo_config() -> dict:
    import yaml
    from conftest import REPO

    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def test_the_plan_maps_bench_traffic_onto_each_drafters_choice_and_checks_the_names(tmp_path, monkeypatch) -> None:
    from aerie.plan.config_file import ConfigError
    from aerie.plan.drafters import planned_drafters
    from aerie.plan.resolve import check_recipe

    monkeypatch.chdir(tmp_path)
    config = _demo_config()
    config["bench"]["traffic"] = {"humaneval": 0.7, "tasks": 0.3}
    config["drafter"].update(replay_dataset="tasks", replay_share=0.25)
    [drafter] = planned_drafters(config)
    assert dict(drafter.train.heldout_weights) == pytest.approx({"humaneval": 0.7, "tasks": 0.3})
    assert drafter.section["heldout_weights"] == pytest.approx({"humaneval": 0.7, "tasks": 0.3})  # rule drafter's
    check_recipe(config, [drafter])
    config["bench"]["traffic"] = {"mt_bench": 1.0}
    with pytest.raises(ConfigError, match="mt_bench: not a benchmark set of this run") as e:
        check_recipe(config, planned_drafters(config))
    assert e.value.path == ("bench", "traffic")
    del config["bench"]["traffic"]
    config["drafter"]["replay_dataset"] = "kimi_mtp"
    with pytest.raises(ConfigError, match=r"'kimi_mtp' is not a dataset of this config") as e:
        check_recipe(config, planned_drafters(config))
    assert e.value.path == ("drafter", "replay_dataset")
    config["drafter"]["replay_dataset"] = ""
    config["drafter"]["replay_share"] = 0.0
    config["vocab"]["warm_start"] = "on"
    with pytest.raises(ConfigError, match="vocab.warm_start must be one of keep, follow, auto"):
        check_recipe(config, planned_drafters(config))


def test_the_dry_run_says_the_vocab_rule_the_replay_and_the_traffic_floor(tmp_path, monkeypatch) -> None:
    import torch

    from aerie.formats.vocab import FOLLOWED_SOURCE, write_draft_vocab
    from aerie.plan.drafters import planned_drafters
    from aerie.preview.recipe import recipe_preview_text

    monkeypatch.chdir(tmp_path)
    config = _demo_config()
    config["vocab"].update(warm_start="auto", follow_below=0.95)
    config["bench"]["traffic"] = {"humaneval": 0.7, "tasks": 0.3}
    config["drafter"].update(replay_dataset="tasks", replay_share=0.5, init="some/folder")
    samples, per_sample = {"tasks": 192, "humaneval": 156}, {"tasks": 300.0, "humaneval": 400.0}
    vocab = tmp_path / "draft_vocab.safetensors"
    text = recipe_preview_text(config, planned_drafters(config), samples, per_sample, vocab)
    assert "follows the data when its coverage of the data is below 0.95" in text and "once the draft_vocab" in text
    assert "replay: tasks at share 0.5 - 156 of its 192 samples (~0.05M tokens) per epoch" in text
    assert "best epoch chosen on the held-out mix humaneval 0.70, tasks 0.30" in text
    assert "WARNING: its figure's 95 % half-width may reach" in text  # 5 % of a few hundred answers
    meta = {"source": FOLLOWED_SOURCE, "coverage_before": 0.906, "coverage": 0.999, "replaced": 31,
            "coverage_if_counted": 1.0}  # fmt: skip
    write_draft_vocab(vocab, torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.bool), torch.zeros(4), meta)
    text = recipe_preview_text(config, planned_drafters(config), samples, per_sample, vocab)
    assert "last counted: coverage 0.9060 -> 0.9990 (31 ids replaced" in text
