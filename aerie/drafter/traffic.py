"""The user's traffic mix (``bench.traffic``: a weight per bench set) and what follows from it, torch-free:

- which held-out data stands for each set when training chooses its best epoch (``heldout_weights``): a set that
  is a dataset of the run is its own held-out split; a set that is not (MT-Bench, GSM8K: bench sets only) is stood
  in for by the replay dataset (``drafter.replay_dataset``: general data such as ``kimi_mtp``), or left out of the
  choice (and named) when there is none;
- the choice's figure: every held-out evaluation of a dataset combined with those weights (``combine_heldout``);
- whether the held-out split can tell drafters 0.05 apart (``heldout_halfwidth``, ``SEPARATION``);
- (the gate's traffic verdict and the report's "which drafter to serve": aerie.benchmark.traffic).

A shard's dataset is the folder the pipeline writes it under: ``results/{dataset}/hidden/shard-*.safetensors``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Two drafters this far apart in acceptance length must be told apart by the figure the best epoch is chosen on.
SEPARATION = 0.05
Z95 = 1.959964  # two-sided 95 %


def dataset_of_shard(path: str | Path) -> str:
    """The dataset a hidden (or tokens) shard belongs to: ``results/{dataset}/{stage}/shard-N.safetensors``."""
    p = Path(path)
    if not p.name.startswith("shard-") or len(p.parts) < 3:
        raise ValueError(f"{path}: not a pipeline shard path (results/DATASET/STAGE/shard-N.safetensors)")
    return p.parent.parent.name


def check_traffic(traffic: Mapping[str, Any], known_sets: Sequence[str], where: str = "bench.traffic") -> dict:
    """``traffic`` as {set: weight} (weights normalised to sum 1), refused naming the key: an unknown set, a
    negative or non-number weight, or all weights zero."""
    out: dict[str, float] = {}
    for name, weight in traffic.items():
        if name not in known_sets:
            raise ValueError(
                f"{where}.{name}: not a benchmark set of this run (its sets: {', '.join(sorted(known_sets)) or 'none'})"
            )
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{where}.{name}: a weight is a number >= 0, not {weight!r}")
        out[name] = float(weight)
    total = sum(out.values())
    if out and total <= 0:
        raise ValueError(f"{where}: every weight is 0; give the sets the share of the traffic they get")
    return {k: v / total for k, v in out.items()} if out else {}


@dataclass(frozen=True)
class HeldoutMix:
    """The held-out datasets the epoch choice weighs, and what the traffic mix could not be mapped to."""

    weights: dict[str, float]  # dataset -> weight (sum 1)
    stand_ins: dict[str, str] = field(default_factory=dict)  # traffic set -> the dataset standing in for it
    left_out: list[str] = field(default_factory=list)  # traffic sets with no held-out data at all

    def describe(self) -> str:
        parts = [", ".join(f"{d} {w:.2f}" for d, w in self.weights.items()) or "nothing"]
        if self.stand_ins:
            parts.append("; " + ", ".join(f"{s} judged on {d}'s held-out split" for s, d in self.stand_ins.items()))
        if self.left_out:
            parts.append(f"; not in the choice (no held-out data stands for them): {', '.join(self.left_out)}")
        return "best epoch chosen on the held-out mix " + "".join(parts)


def heldout_weights(traffic: Mapping[str, float], datasets: Sequence[str], replay_dataset: str = "") -> HeldoutMix:
    """Map the traffic mix onto the run's held-out splits: a set that is a dataset weighs its own split; any other
    set weighs the replay dataset's (general data standing in for general traffic), or is left out and named."""
    weights: dict[str, float] = {}
    stand_ins: dict[str, str] = {}
    left_out: list[str] = []
    for name, w in traffic.items():
        if name in datasets:
            weights[name] = weights.get(name, 0.0) + w
        elif replay_dataset and replay_dataset in datasets:
            weights[replay_dataset] = weights.get(replay_dataset, 0.0) + w
            stand_ins[name] = replay_dataset
        else:
            left_out.append(name)
    total = sum(weights.values())
    norm = {d: w / total for d, w in weights.items() if w > 0} if total > 0 else {}
    return HeldoutMix(norm, stand_ins, left_out)


def _weighted(values: Sequence[Any], weights: Sequence[float]) -> Any:
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return sum(w * float(v) for v, w in zip(values, weights))
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        return [_weighted(list(col), weights) for col in zip(*values)]
    return None


def combine_heldout(evals: Mapping[str, Mapping[str, Any]], weights: Mapping[str, float]) -> dict[str, Any]:
    """One held-out evaluation from each dataset's: every figure (numbers, lists of numbers) the weighted mean over
    the datasets that held something out (weights renormalised over them), ``heldout_start_positions`` summed, and
    each dataset's own evaluation under ``by_dataset``. Nothing held out anywhere: the empty evaluation."""
    present = {d: e for d, e in evals.items() if e.get("heldout_start_positions") and weights.get(d, 0) > 0}
    if not present:
        first = next(iter(evals.values()), {})
        return {**first, "by_dataset": {d: dict(e) for d, e in evals.items()}, "weights": {}}
    total = sum(weights[d] for d in present)
    ws = [weights[d] / total for d in present]
    keys = [k for k in next(iter(present.values())) if all(k in e for e in present.values())]
    out: dict[str, Any] = {}
    for k in keys:
        if k == "heldout_start_positions":
            out[k] = sum(int(e[k]) for e in present.values())
        else:
            out[k] = _weighted([e[k] for e in present.values()], ws)
    out["by_dataset"] = {d: dict(e) for d, e in evals.items()}
    out["weights"] = {d: w for d, w in zip(present, ws)}
    return out


def chain_length_variance(acceptance_per_position: Sequence[float], starts: int = 0) -> float:
    """Variance of the accepted chain length L (1 + accepted draft steps) over held-out starts, from the share of
    starts whose chain reached each step (P(L >= 2 + k) = acceptance_per_position[k]). With ``starts``, each share
    is taken half a start toward 1/2 ((p n + 1/2) / (n + 1)), so a small split that happens to show no spread
    (every chain rejected at once) is not taken for a precise one."""
    shares = [(p * starts + 0.5) / (starts + 1) if starts else p for p in acceptance_per_position]
    shares = [min(p, prev) for p, prev in zip(shares, [1.0, *shares])]  # a chain reaches step k+1 only via k
    reach = [1.0, *shares, 0.0]
    mean = square = 0.0
    for k in range(len(reach) - 1):
        p_exact = max(reach[k] - reach[k + 1], 0.0)  # P(L = 1 + k)
        mean += (1 + k) * p_exact
        square += (1 + k) ** 2 * p_exact
    return max(square - mean * mean, 0.0)


def heldout_halfwidth(by_dataset: Mapping[str, Mapping[str, Any]], weights: Mapping[str, float]) -> float | None:
    """The 95 % half-width of the weighted held-out acceptance figure: 1.96 * sqrt(sum w_d^2 var_d / n_d), each
    dataset's chain-length variance over its n_d held-out starts. Starts are taken as independent, which they are
    not within a sequence, so this is the least the split needs (a floor), not a guarantee. None: nothing held out."""
    terms = []
    for d, w in weights.items():
        e = by_dataset.get(d) or {}
        n = int(e.get("heldout_start_positions") or 0)
        if n == 0 or not w:
            continue
        terms.append(w * w * chain_length_variance(e.get("acceptance_per_position") or [], n) / n)
    return Z95 * math.sqrt(sum(terms)) if terms else None


def separates(halfwidth: float | None, separation: float = SEPARATION) -> bool:
    """Whether two drafters ``separation`` apart differ beyond both figures' 95 % intervals (h * sqrt 2 < gap)."""
    return halfwidth is not None and halfwidth * math.sqrt(2.0) <= separation


def floor_message(halfwidth: float | None, starts: int, separation: float = SEPARATION) -> str | None:
    """None when the held-out split separates drafters ``separation`` apart, else a warning naming the figures and
    roughly how many held-out starts would (the half-width falls as 1 / sqrt(starts))."""
    if separates(halfwidth, separation):
        return None
    if halfwidth is None or starts == 0:
        return "nothing is held out: the best epoch cannot be chosen on held-out data (raise drafter.eval_fraction)"
    need = math.ceil(starts * (halfwidth * math.sqrt(2.0) / separation) ** 2)
    return (
        f"the held-out split ({starts} draft starts) gives the choice's figure a 95 % half-width of "
        f"+-{halfwidth:.3f}, too wide to tell drafters {separation} apart (needs <= +-{separation / math.sqrt(2):.3f}, "
        f"about {need:,} starts): raise drafter.eval_fraction or hold out more of the user's data"
    )
