"""The gate on the user's traffic mix (``bench.traffic``: a weight per bench set, normalised by the plan) and the
report's "which drafter to serve for this mix": pure functions of per-set figures, torch-free.

A drafter fails when it loses to a reference on any set beyond the spread (each set's 95 % half-width over its
prompts, :func:`acceptance_figure`), or does not beat the best reference on the traffic-weighted mix; the drafter to
serve is the one with the best traffic-weighted figure, its per-set trade-off named.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Z95 = 1.959964  # two-sided 95 %


@dataclass(frozen=True)
class SetFigure:
    """One method's acceptance on one bench set: its value and the spread that counts as a tie (e.g. the paired
    95 % half-width of the difference, or 0 for one exact measurement)."""

    value: float
    spread: float = 0.0


@dataclass(frozen=True)
class TrafficVerdict:
    passed: bool
    weighted: dict[str, float]  # method -> its traffic-weighted acceptance
    failures: list[str]  # each names the set (or the mix), the reference and both figures
    trade_off: list[str]  # per set: the drafter against the best reference there

    def text(self) -> str:
        head = "PASS" if self.passed else "FAIL"
        return "\n".join([f"traffic gate: {head}", *self.failures, *self.trade_off])


def weighted_acceptance(per_set: Mapping[str, Mapping[str, SetFigure]], traffic: Mapping[str, float]) -> dict:
    """Every method measured on every weighted set -> its traffic-weighted acceptance (weights renormalised over
    the sets that were measured; a method missing a weighted set gets no figure)."""
    sets = [s for s in traffic if s in per_set and traffic[s] > 0]
    total = sum(traffic[s] for s in sets)
    methods = set.intersection(*(set(per_set[s]) for s in sets)) if sets else set()
    return {m: sum(traffic[s] * per_set[s][m].value for s in sets) / total for m in sorted(methods)} if total else {}


def traffic_verdict(
    per_set: Mapping[str, Mapping[str, SetFigure]],
    traffic: Mapping[str, float],
    drafter: str,
    references: Sequence[str],
    mix_spread: float = 0.0,
    figure: str = "acceptance",
) -> TrafficVerdict:
    """The gate on the user's traffic: FAIL when ``drafter`` loses to any reference on any set beyond the spread
    (below ``reference - spread``), or does not beat the best reference on the traffic-weighted mix (by more than
    ``mix_spread``). Each failure names the set, the reference and both figures; ``trade_off`` lists every set."""
    failures, trade_off = [], []
    for s, figures in per_set.items():
        if drafter not in figures:
            failures.append(f"{s}: {drafter} was not measured")
            continue
        mine = figures[drafter]
        refs = [r for r in references if r in figures]
        for r in refs:
            gap = mine.value - figures[r].value
            if gap < -max(mine.spread, figures[r].spread):
                failures.append(
                    f"{s}: {drafter}'s {figure} {mine.value:.3f} loses to {r}'s {figures[r].value:.3f} ({gap:+.3f}, "
                    "beyond the "
                    f"spread +-{max(mine.spread, figures[r].spread):.3f})"
                )
        if refs:
            best = max(refs, key=lambda r: figures[r].value)
            trade_off.append(
                f"{s} (traffic {traffic.get(s, 0.0):.2f}): {drafter}'s {figure} {mine.value:.3f}, best reference "
                f"{best} {figures[best].value:.3f} ({mine.value - figures[best].value:+.3f})"
            )
    weighted = weighted_acceptance(per_set, traffic)
    refs = [r for r in references if r in weighted]
    if drafter not in weighted:
        failures.append(f"weighted mix: {drafter} lacks a figure on a weighted set")
    elif refs:
        best = max(refs, key=weighted.__getitem__)
        if weighted[drafter] - weighted[best] <= mix_spread:
            failures.append(
                f"weighted mix: {drafter}'s {figure} {weighted[drafter]:.3f} does not beat the best reference {best}'s "
                f"{weighted[best]:.3f} ({weighted[drafter] - weighted[best]:+.3f}; must exceed +{mix_spread:.3f})"
            )
    return TrafficVerdict(not failures, weighted, failures, trade_off)


def serve_choice(
    per_set: Mapping[str, Mapping[str, SetFigure]], traffic: Mapping[str, float], figure: str = "acceptance"
) -> tuple[str, str]:
    """(the method to serve for the stated mix, one sentence why): the highest traffic-weighted acceptance, with
    the sets where it is not the best named (the trade-off the user accepts)."""
    weighted = weighted_acceptance(per_set, traffic)
    if not weighted:
        raise ValueError("no method was measured on every set the traffic weighs")
    choice = max(weighted, key=weighted.__getitem__)
    losses = [
        f"{s} (best there: {max(f, key=lambda m: f[m].value)} {max(x.value for x in f.values()):.3f} vs "
        f"{f[choice].value:.3f})"
        for s, f in per_set.items()
        if choice in f and max(x.value for x in f.values()) > f[choice].value
    ]
    mix = ", ".join(f"{s} {w:.2f}" for s, w in traffic.items())
    why = f"serve {choice}: traffic-weighted {figure} {weighted[choice]:.3f} on the mix {mix}" + (
        "; it gives up " + "; ".join(losses) if losses else "; best on every set"
    )
    return choice, why


def acceptance_figure(committed: Sequence[float], verify_steps: Sequence[float]) -> SetFigure:
    """One method's acceptance length on one set from its per-prompt counts (tokens committed, verify steps): the
    pooled ratio, and as its spread the 95 % half-width of that ratio over prompts (the ratio estimator's standard
    error, prompts as the units: 1.96 * sqrt(sum (c_i - R s_i)^2 / (n (n - 1))) / mean s)."""
    n = len(committed)
    if n != len(verify_steps) or n == 0 or sum(verify_steps) <= 0:
        raise ValueError(f"acceptance needs per-prompt counts with steps, got {n} and {len(verify_steps)}")
    ratio = sum(committed) / sum(verify_steps)
    if n == 1:
        return SetFigure(ratio, 0.0)
    residual = sum((c - ratio * s) ** 2 for c, s in zip(committed, verify_steps))
    se = math.sqrt(residual / (n * (n - 1))) / (sum(verify_steps) / n)
    return SetFigure(ratio, Z95 * se)


def spread_of(values: Sequence[float]) -> float:
    """The 95 % half-width of a mean over repeats or seeds (normal approximation; 0 for one value)."""
    return Z95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
