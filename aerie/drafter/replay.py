"""Replay against forgetting (``drafter.replay_dataset``, ``drafter.replay_share``), torch-free: how many replay
windows (or samples) an epoch takes, for the training loop and the previews alike.

An epoch trains on every window of the other datasets (the user's domain) plus ``replay_share`` of the epoch from
the replay dataset (general data such as ``kimi_mtp``): ``share / (1 - share)`` replay windows per own window, at
most the replay dataset's whole pool; successive epochs take successive slices of one seeded shuffle of the pool.
With share 0 the replay dataset trains nothing: its held-out split still serves the epoch choice.
"""

from __future__ import annotations

from collections.abc import Mapping


def replay_count(own: int, share: float, pool: int) -> int:
    """Replay windows (or samples) in one epoch of ``own`` own ones: share / (1 - share) of them, at most ``pool``."""
    if not pool or share <= 0:
        return 0
    return min(pool, round(share / (1.0 - share) * own))


def samples_per_epoch(samples: Mapping[str, float], replay_dataset: str, share: float) -> dict[str, float]:
    """What one epoch trains on per dataset: every sample of the others, ``replay_count`` of the replay dataset's
    (the previews' tokens and hours per epoch come from this, not from the whole replay set)."""
    if not replay_dataset or replay_dataset not in samples:
        return dict(samples)
    own = sum(n for name, n in samples.items() if name != replay_dataset)
    return {
        name: (replay_count(int(own), share, int(n)) if name == replay_dataset else n) for name, n in samples.items()
    }


def replay_preview_line(samples: Mapping[str, float], tokens_per_sample: Mapping[str, float], dataset: str,
                        share: float, epochs: int) -> str:  # fmt: skip
    """The dry run's line on replay: the replay dataset's samples and tokens trained per epoch and in all."""
    if not dataset:
        return "replay: off (drafter.replay_dataset not set)"
    per_epoch = samples_per_epoch(samples, dataset, share)
    n = per_epoch.get(dataset, 0)
    tokens = n * tokens_per_sample.get(dataset, 0.0)
    if not share:
        return f"replay: {dataset} is held out for the epoch choice only (drafter.replay_share 0): it trains nothing"
    others = sum(v for k, v in per_epoch.items() if k != dataset)
    return (
        f"replay: {dataset} at share {share} - {n:,.0f} of its {samples.get(dataset, 0):,.0f} samples "
        f"(~{tokens / 1e6:,.2f}M tokens) per epoch beside the other datasets' {others:,.0f}, "
        f"~{epochs * tokens / 1e6:,.2f}M replay tokens over {epochs} epochs"
    )
