"""The benchmark's verdict, one gate for both backends (``bench.backend`` inprocess or sglang): does the drafter ship?

:func:`apply_gate` judges a report (``aerie.bench/2``, docs/formats.md) by config ``bench.gate``. A drafter that fails
fails the job; the evidence is kept first under names Snakemake does not own (``{run}.gate-failed.json`` / ``.png``),
since it deletes a failed job's outputs.

What the gate reads is the same in both reports:
- speed: the lower of ``speedup`` (pooled) and ``speedup_median_paired`` must reach ``min_speedup``;
- references: the trained drafter's ``acceptance_length`` must be strictly above every reference's (``methods``);
- lossless: at temperature 0 every speculative output must be the baseline's own. ``divergences`` lists each output
  that differs, with the target's top-1/top-2 logit gap at the first differing token; a divergence at a near-tie
  (gap <= ``lossless_max_gap``: a multi-token verify forward, or another batch shape on a server, may round either
  way) is numerics, any other one (or one whose gap is unknown) is a loss;
- optionally, measured and training-simulated acceptance within ``max_simulated_gap``.

Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_FORMAT = "aerie.bench/2"  # the report both backends write (docs/formats.md)


def simulated_acceptance(drafter_dir: Path, num_draft_steps: int) -> float | None:
    """The training eval's held-out simulated acceptance length for ``num_draft_steps`` drafts (``eval.json``)."""
    path = Path(drafter_dir) / "eval.json"
    if not path.exists():
        return None
    ev = json.loads(path.read_text())
    by_steps = ev.get("simulated_acceptance_length_by_steps") or []
    if len(by_steps) >= num_draft_steps:
        return float(by_steps[num_draft_steps - 1])
    return ev.get("simulated_acceptance_length")


def beats_references(acceptance_length: float | None, references: dict[str, float | None]) -> bool:
    """Whether the trained drafter's acceptance length is strictly above every reference drafter's.

    A tie is not a win: a drafter that accepts no more than the untrained one or prompt lookup shows nothing
    that training bought. A missing figure counts as 0 (no verify step ran).
    """
    measured = acceptance_length or 0.0
    return all(measured > (a or 0.0) for a in references.values())


def reference_acceptance(report: dict[str, Any]) -> dict[str, float | None]:
    """Acceptance length of every reference drafter measured in the run (all methods but ``eagle3``)."""
    return {m: v["acceptance_length"] for m, v in report["methods"].items() if m != "eagle3"}


@dataclass(frozen=True)
class Gate:
    """What a benchmark must show for the drafter to ship (config ``bench.gate``)."""

    min_speedup: float = 1.0
    must_beat_references: bool = True
    max_simulated_gap: float | None = None  # e.g. 0.10: measured and simulated acceptance within 10%
    lossless_max_gap: float = 0.0  # a divergence at a top-2 logit gap up to this is a numerical near-tie


def lossy_divergences(report: dict[str, Any], max_gap: float) -> list[dict[str, Any]]:
    """The report's divergences that are not numerical near-ties (gap unknown, or above ``max_gap``)."""
    return [d for d in report.get("divergences") or [] if d.get("logit_gap") is None or d["logit_gap"] > max_gap]


def _divergence_text(d: dict[str, Any]) -> str:
    where = f" at concurrency {d['concurrency']}" if d.get("concurrency") is not None else ""
    gap = "unknown" if d.get("logit_gap") is None else f"{d['logit_gap']:.3g}"
    return f"{d['method']} on {d['id']}{where} from token {d['first_diff']} (target's top-2 logit gap there {gap})"


def gate_failures(report: dict[str, Any], gate: Gate) -> list[str]:
    """Reasons the drafter must not ship (empty: it passes)."""
    failures = []
    # The lower of the pooled and the median paired speedup: a neighbour's load burst during the baseline
    # runs inflates the pooled figure, and a noisy machine must not let a drafter pass.
    figures = [x for x in (report.get("speedup"), report.get("speedup_median_paired")) if x is not None]
    speedup = min(figures) if figures else None
    if speedup is None or speedup < gate.min_speedup:
        base, spec = report["baseline"]["tokens_per_s"], report["speculative"]["tokens_per_s"]
        where = f" at concurrency {report['concurrency']}" if report.get("concurrency") is not None else ""
        failures.append(
            f"speedup {speedup or 0:.3f}x is below bench.gate.min_speedup {gate.min_speedup:g} "
            f"({spec or 0:.1f} tok/s with the drafter vs {base or 0:.1f} without{where}, same run; "
            f"pooled {report.get('speedup') or 0:.3f}x, median paired "
            f"{report.get('speedup_median_paired') or 0:.3f}x)"
        )
    if "divergences" in report:
        lossy = lossy_divergences(report, gate.lossless_max_gap)
        if lossy:
            failures.append(
                f"{len(lossy)} speculative output(s) differ from the baseline's greedy output, not at a near-tie "
                f"(bench.gate.lossless_max_gap {gate.lossless_max_gap:g}): "
                + "; ".join(_divergence_text(d) for d in lossy[:3])
                + ("; ..." if len(lossy) > 3 else "")
            )
    elif not report.get("lossless"):  # a report without divergences (format 2 before them): strict
        failures.append("speculative output differs from greedy decoding (see per_prompt first_mismatch)")
    # Decided from the measured figures with the same function that wrote the report's beats_references field.
    refs = reference_acceptance(report)
    if gate.must_beat_references and not beats_references(report["acceptance_length"], refs):
        failures.append(
            f"acceptance length {report['acceptance_length'] or 0:.2f} does not beat the reference "
            f"drafters {', '.join(f'{m} {a or 0:.2f}' for m, a in refs.items())}"
        )
    gap = report.get("simulated_vs_measured")
    if gate.max_simulated_gap is not None and gap is not None and gap > gate.max_simulated_gap:
        failures.append(
            f"measured acceptance {report['acceptance_length']:.2f} and the training eval's simulated "
            f"{report['simulated_acceptance_length']:.2f} differ by {gap:.0%} "
            f"(> bench.gate.max_simulated_gap {gate.max_simulated_gap:.0%})"
        )
    return failures


def apply_gate(report: dict[str, Any], gate: Gate, out_json: Path, out_png: Path, log: Callable[[str], None]) -> None:
    """Pass, or keep the evidence as ``{run}.gate-failed.json`` / ``.png`` and fail the job with the reasons."""
    failures = gate_failures(report, gate)
    if failures:
        kept = out_json.with_name(out_json.stem + ".gate-failed.json")
        os.replace(out_json, kept)
        os.replace(out_png, out_png.with_name(out_png.stem + ".gate-failed.png"))
        message = "the drafter does not pay off: " + "; ".join(failures) + f" (full report: {kept})"
        log(message)
        raise SystemExit(message)
    log(f"gate passed: {gate}")
