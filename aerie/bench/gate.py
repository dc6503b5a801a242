"""The benchmark's verdict, one gate for both backends (``bench.backend`` inprocess or sglang): does the drafter ship?

:func:`apply_gate` judges a report (``aerie.bench/3``, docs/formats.md) by config ``bench.gate``, writes the verdict
into it (``gate``: passed, every failure, and which drafter to serve: :func:`serve_recommendation`). A drafter that
fails fails the job; the evidence is kept first under names Snakemake does not own (``{run}.gate-failed.json`` /
``.png``), since it deletes a failed job's outputs.

What the gate reads is the same in both reports:
- speed: the lower of ``speedup`` (pooled) and ``speedup_median_paired`` must reach ``min_speedup``; a report without
  either figure fails (nothing was measured);
- references, per set (``sets``; the whole run for a report without them): the trained drafter must be strictly
  above every reference on each figure of ``beat_references_on``: ``acceptance_length`` (only against references
  that draft at its width: NGRAM at SGLang's own 12 tokens is compared on speed) and ``speedup`` (the lower of the
  two speedups, as above). A loss names the set, the reference and the figures;
- failed requests: every request of every method (the baseline's too) must have been answered;
- lossless: at temperature 0 every speculative output must be the baseline's own. ``divergences`` lists each output
  that differs (the references' too), with the target's top-1/top-2 logit gap at the first differing token; a
  divergence at a near-tie (gap <= ``lossless_max_gap``: a multi-token verify forward, or another batch shape on a
  server, may round either way) is numerics, any other one (or one whose gap is unknown) is a loss;
- optionally, measured and training-simulated acceptance within ``max_simulated_gap``.

Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# /3: one table per benchmark set (sets), reference drafter folders, failed requests per method, spec_accept_length
# (SGLang's acceptance definition) beside acceptance_length (aerie's), the gate's verdict
BENCH_FORMAT = "aerie.bench/3"  # the report both backends write (docs/formats.md)


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
    beat_references_on: tuple[str, ...] = ("acceptance_length", "speedup")  # what must_beat_references compares


def lossy_divergences(report: dict[str, Any], max_gap: float) -> list[dict[str, Any]]:
    """The report's divergences that are not numerical near-ties (gap unknown, or above ``max_gap``)."""
    return [d for d in report.get("divergences") or [] if d.get("logit_gap") is None or d["logit_gap"] > max_gap]


def _divergence_text(d: dict[str, Any]) -> str:
    where = f" at concurrency {d['concurrency']}" if d.get("concurrency") is not None else ""
    gap = "unknown" if d.get("logit_gap") is None else f"{d['logit_gap']:.3g}"
    return f"{d['method']} on {d['id']}{where} from token {d['first_diff']} (target's top-2 logit gap there {gap})"


def gate_speedup(figures: dict[str, Any]) -> float | None:
    """The speed the gate judges: the lower of the pooled and the median paired speedup (None: neither measured).

    A neighbour's load burst during the baseline runs inflates the pooled figure; a noisy machine must not let a
    drafter pass."""
    measured = [x for x in (figures.get("speedup"), figures.get("speedup_median_paired")) if x is not None]
    return min(measured) if measured else None


def _speed_failure(report: dict[str, Any], gate: Gate) -> list[str]:
    speedup = gate_speedup(report)
    if speedup is not None and speedup >= gate.min_speedup:
        return []
    base = (report.get("baseline") or {}).get("tokens_per_s")
    spec = (report.get("speculative") or {}).get("tokens_per_s")
    where = f" at concurrency {report['concurrency']}" if report.get("concurrency") is not None else ""
    if speedup is None:
        return [f"no speedup was measured (neither speedup nor speedup_median_paired in the report{where})"]
    return [
        f"speedup {speedup:.3f}x is below bench.gate.min_speedup {gate.min_speedup:g} "
        f"({spec or 0:.1f} tok/s with the drafter vs {base or 0:.1f} without{where}, same run; "
        f"pooled {report.get('speedup') or 0:.3f}x, median paired "
        f"{report.get('speedup_median_paired') or 0:.3f}x)"
    ]


def _lossless_failure(report: dict[str, Any], gate: Gate) -> list[str]:
    if "divergences" not in report:  # a report without divergences (format 2 before them): strict
        return [] if report.get("lossless") else ["speculative output differs from greedy decoding (see per_prompt)"]
    lossy = lossy_divergences(report, gate.lossless_max_gap)
    if not lossy:
        return []
    return [
        f"{len(lossy)} speculative output(s) differ from the baseline's greedy output, not at a near-tie "
        f"(bench.gate.lossless_max_gap {gate.lossless_max_gap:g}): "
        + "; ".join(_divergence_text(d) for d in lossy[:3])
        + ("; ..." if len(lossy) > 3 else "")
    ]


def _failed_requests_failure(report: dict[str, Any]) -> list[str]:
    failed = report.get("failed_requests") or {}
    if not any(failed.values()):
        return []
    return [
        f"{sum(failed.values())} request(s) got no answer ("
        + ", ".join(f"{m} {n}" for m, n in failed.items())
        + "): the figures would be of partial data; see the servers' logs"
    ]


def reference_losses(report: dict[str, Any], gate: Gate) -> list[dict[str, Any]]:
    """Every (set, reference, figure) where the trained drafter is not strictly above the reference."""
    tables = report.get("sets") or {"all prompts": {"methods": report["methods"]}}
    losses = []
    for set_name, table in tables.items():
        methods = table["methods"]
        mine = methods["eagle3"]
        for ref, theirs in methods.items():
            if ref == "eagle3" or ref not in report["methods"]:
                continue
            matched = report["methods"][ref].get("matched_width", True)
            for figure in gate.beat_references_on:
                if figure == "acceptance_length" and not matched:
                    continue
                get = gate_speedup if figure == "speedup" else (lambda t: t.get("acceptance_length"))
                a, b = get(mine), get(theirs)
                if not (a or 0.0) > (b or 0.0):  # a tie is no win; a missing figure counts as 0
                    losses.append(
                        {"set": set_name, "reference": ref, "figure": figure, "drafter": a, "reference_value": b}
                    )
    return losses


def _reference_failures(report: dict[str, Any], gate: Gate) -> list[str]:
    if not gate.must_beat_references:
        return []
    names = {"acceptance_length": "acceptance length", "speedup": "speedup"}
    return [
        f"set {x['set']}: the trained drafter's {names[x['figure']]} {x['drafter'] or 0:.3f} does not beat reference "
        f"{x['reference']}'s {x['reference_value'] or 0:.3f}"
        for x in reference_losses(report, gate)
    ]


def gate_failures(report: dict[str, Any], gate: Gate) -> list[str]:
    """Reasons the drafter must not ship (empty: it passes)."""
    failures = _speed_failure(report, gate) + _lossless_failure(report, gate) + _failed_requests_failure(report)
    failures += _reference_failures(report, gate)
    gap = report.get("simulated_vs_measured")
    if gate.max_simulated_gap is not None and gap is not None and gap > gate.max_simulated_gap:
        failures.append(
            f"measured acceptance {report['acceptance_length']:.2f} and the training eval's simulated "
            f"{report['simulated_acceptance_length']:.2f} differ by {gap:.0%} "
            f"(> bench.gate.max_simulated_gap {gate.max_simulated_gap:.0%})"
        )
    return failures


def serve_recommendation(report: dict[str, Any], gate: Gate, failures: list[str]) -> dict[str, Any]:
    """Which drafter to serve: the trained one when it passes; else the servable method (a reference folder, NGRAM,
    or the trained drafter) that was lossless, answered every request and is fastest (the gate's speedup), if that
    beats no drafter; else none."""
    if not failures:
        return {"serve": "eagle3", "speedup": gate_speedup(report["methods"]["eagle3"]), "why": "it passed the gate"}
    failed = report.get("failed_requests") or {}
    lossy = {d["method"] for d in lossy_divergences(report, gate.lossless_max_gap)}
    candidates = {
        m: gate_speedup(v)
        for m, v in report["methods"].items()
        if v.get("kind") != "untrained" and m != "untrained" and not failed.get(m) and m not in lossy
    }
    candidates = {m: s for m, s in candidates.items() if s is not None}
    best = max(candidates, key=candidates.get, default=None)
    if best is None or candidates[best] <= 1.0:
        return {"serve": None, "speedup": None, "why": "no drafter measured here is faster than none"}
    why = "the fastest lossless method of this run" + (
        f" ({candidates[best]:.3f}x vs the trained drafter's {candidates.get('eagle3') or 0:.3f}x)"
        if best != "eagle3"
        else ""
    )
    return {"serve": best, "speedup": candidates[best], "why": why}


def apply_gate(report: dict[str, Any], gate: Gate, out_json: Path, out_png: Path, log: Callable[[str], None]) -> None:
    """Write the verdict into the report (``gate``); pass, or keep the evidence as ``{run}.gate-failed.json`` /
    ``.png`` and fail the job with the reasons and the drafter to serve instead."""
    from aerie.artifacts import atomic_write_json

    failures = gate_failures(report, gate)
    serve = serve_recommendation(report, gate, failures)
    report["gate"] = {
        "passed": not failures,
        "failures": failures,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(gate).items()},
        **serve,
    }
    atomic_write_json(out_json, report)
    if failures:
        kept = out_json.with_name(out_json.stem + ".gate-failed.json")
        os.replace(out_json, kept)
        os.replace(out_png, out_png.with_name(out_png.stem + ".gate-failed.png"))
        instead = (
            f"serve {serve['serve']} instead: {serve['why']}"
            if serve["serve"] and serve["serve"] != "eagle3"
            else f"serve: {serve['serve'] or 'no drafter'} ({serve['why']})"
        )
        message = "the drafter does not pay off: " + "; ".join(failures) + f"; {instead} (full report: {kept})"
        log(message)
        raise SystemExit(message)
    log(f"gate passed: {gate}")
