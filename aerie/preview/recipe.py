"""The dry run's lines on a warm start's recipe (issue 37): the draft vocabulary's rule and coverage, replay, and
the traffic mix the best epoch is chosen on with the held-out split's floor - one paragraph, torch-free."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aerie.drafter.replay import replay_preview_line
from aerie.drafter.traffic import SEPARATION, Z95, heldout_weights
from aerie.plan.drafters import PlannedDrafter
from aerie.vocab.settings import VocabSettings, read_vocab_meta, vocab_preview_line


def planned_halfwidth(heldout_tokens: Mapping[str, float], weights: Mapping[str, float], draft_steps: int) -> float:
    """The 95 % half-width of the weighted held-out figure at the planned held-out generated tokens per dataset,
    with each chain length's stdev at its bound draft_steps / 2 (starts taken as independent)."""
    sd = draft_steps / 2.0
    terms = [w * w * sd * sd / heldout_tokens[d] for d, w in weights.items() if heldout_tokens.get(d)]
    missing = [d for d, w in weights.items() if w and not heldout_tokens.get(d)]
    return math.inf if missing or not terms else Z95 * math.sqrt(sum(terms))


def recipe_preview_text(
    config: Mapping[str, Any],
    drafters: Iterable[PlannedDrafter],
    samples: Mapping[str, float],
    tokens_per_sample: Mapping[str, float],
    vocab_file: Path = Path("results/vocab/draft_vocab.safetensors"),
) -> str:
    """``aerie recipe`` lines: per warm-started drafter the vocabulary rule (and the coverage once counted), per
    drafter its replay and the traffic mix its best epoch is chosen on, with the planned held-out floor."""
    settings = VocabSettings.of(config.get("vocab"))
    traffic = (config.get("bench") or {}).get("traffic") or {}
    steps = int((config.get("bench") or {}).get("num_draft_steps", 3))
    lines = ["aerie recipe (warm start, replay, traffic):"]
    for d in drafters:
        train = d.train
        if train.init:
            lines.append(f"  {d.name}: {vocab_preview_line(settings, read_vocab_meta(vocab_file))}")
        lines.append(
            f"  {d.name}: "
            + replay_preview_line(samples, tokens_per_sample, train.replay_dataset, train.replay_share, train.epochs)
        )
        weights = dict(train.heldout_weights)
        if not weights:
            lines.append(f"  {d.name}: best epoch chosen on the pooled held-out split (bench.traffic not set)")
            continue
        mix = heldout_weights(traffic, list(samples), train.replay_dataset) if traffic else None
        lines.append(f"  {d.name}: " + (mix.describe() if mix else f"best epoch chosen on {weights}"))
        held = {n: train.eval_fraction * samples.get(n, 0) * tokens_per_sample.get(n, 0.0) for n in samples}
        h = planned_halfwidth(held, weights, steps)
        ok = h * math.sqrt(2.0) <= SEPARATION
        lines.append(
            f"  {d.name}: held-out split ~{sum(held.values()):,.0f} tokens (eval_fraction {train.eval_fraction}); "
            + (
                f"its figure's 95 % half-width at most +-{h:.3f}: separates drafters {SEPARATION} apart"
                if ok
                else f"WARNING: its figure's 95 % half-width may reach +-{h:.3f}, too wide to separate drafters "
                f"{SEPARATION} apart: raise drafter.eval_fraction (training measures the real spread and warns again)"
            )
        )
    return "\n".join(lines)
