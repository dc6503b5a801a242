"""The benchmark's verdict, one gate for both backends (``bench.backend`` inprocess or sglang): which trained drafter
ships?

:func:`apply_gate` judges a report (``aerie.bench/4``, docs/formats.md) by config ``bench.gate``: each trained drafter
of the run on its own, against the no-drafter baseline and the references - never against its sibling trained
drafters (nor their untrained twins). It writes the verdict into the report (``gate``: each drafter's verdict, its
failures and its figures per set, and which drafter to serve: :func:`serve_recommendation`). The job fails only when
no trained drafter passes; the evidence is kept first under names Snakemake does not own
(``{run}.gate-failed.json`` / ``.png``), since it deletes a failed job's outputs.

What the gate reads of one trained drafter is the same in both reports:
- speed: the lower of its ``speedup`` (pooled) and ``speedup_median_paired`` must reach ``min_speedup``, at every
  concurrency level the report measured (``by_concurrency``; in-process: batch 1); a drafter without either figure
  fails (nothing was measured);
- references, per set (``sets``; the whole run for a report without them): it must be strictly above each of its
  references on each figure of ``beat_references_on``: ``acceptance_length`` (only against references that draft
  as many tokens per verify step: ``draft_tokens``; NGRAM at SGLang's own 12 tokens, or an EAGLE-3 chain beside a
  DFlash block, is compared on speed) and ``speedup`` (the lower of the two speedups, as above). A loss names the
  set, the reference and the figures. Its references: every method but the trained drafters and the other drafters'
  untrained twins (aerie.benchmark.methods.references_of);
- failed requests: every request of the baseline, the drafter and its references must have been answered;
- lossless: at temperature 0 every output of the drafter and of its references must be the baseline's own.
  ``divergences`` lists each output that differs, with the target's top-1/top-2 logit gap at the first differing
  token; a divergence at a near-tie (gap <= ``lossless_max_gap``: a multi-token verify forward, or another batch
  shape on a server, may round either way) is numerics, any other one (or one whose gap is unknown) is a loss;
- optionally, its measured acceptance and its own training eval's simulated acceptance within ``max_simulated_gap``.

The verdict per set (``gate.drafters.{name}.sets``) keeps each set's figures, so that a choice weighted by the
traffic of each set can be made from the report.

Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aerie.benchmark.methods import BASELINE, UNTRAINED, references_of, trained_drafters
from aerie.benchmark.traffic import SetFigure, acceptance_figure, serve_choice, spread_of, traffic_verdict
from aerie.tools.artifacts import atomic_write_json

# /3: one table per benchmark set (sets), reference drafter folders, failed requests per method, spec_accept_length
# (SGLang's acceptance definition) beside acceptance_length (aerie's), the gate's verdict; /4: any number of trained
# drafters of any kind (drafters; each method's role, kind and draft width), no top-level figures of one drafter,
# the gate's verdict per drafter
BENCH_FORMAT = "aerie.bench/4"  # the report both backends write (docs/formats.md)
FIGURE_NAMES = {"acceptance_length": "acceptance length", "speedup": "speedup"}


def simulated_acceptance(drafter_dir: Path, draft_tokens: int) -> float | None:
    """The training eval's held-out simulated acceptance length for ``draft_tokens`` drafts (``eval.json``)."""
    path = Path(drafter_dir) / "eval.json"
    if not path.exists():
        return None
    ev = json.loads(path.read_text())
    by_steps = ev.get("simulated_acceptance_length_by_steps") or []
    if len(by_steps) >= draft_tokens:
        return float(by_steps[draft_tokens - 1])
    return ev.get("simulated_acceptance_length")


def simulated_facts(drafter_dir: Path, draft_tokens: int, measured: float | None) -> dict[str, float | None]:
    """A trained drafter's training-eval acceptance at its width beside the measured one: ``{simulated_acceptance_
    length, simulated_vs_measured}`` (their relative gap, None when either is missing)."""
    simulated = simulated_acceptance(drafter_dir, draft_tokens)
    gap = abs(simulated - measured) / measured if simulated and measured else None
    return {"simulated_acceptance_length": simulated, "simulated_vs_measured": gap}


@dataclass(frozen=True)
class Gate:
    """What a benchmark must show for a trained drafter to ship (config ``bench.gate``)."""

    min_speedup: float = 1.0
    must_beat_references: bool = True
    max_simulated_gap: float | None = None  # e.g. 0.10: measured and simulated acceptance within 10%
    lossless_max_gap: float = 0.0  # a divergence at a top-2 logit gap up to this is a numerical near-tie
    beat_references_on: tuple[str, ...] = ("acceptance_length", "speedup")  # what must_beat_references compares
    # bench.traffic: the user's share of each bench set; set, the references are judged on the traffic (no loss on
    # any set beyond its spread, a win on the weighted mix) and the drafter to serve is chosen on it
    traffic: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        total = sum(self.traffic.values())
        if total > 0:
            object.__setattr__(self, "traffic", {k: float(v) / total for k, v in self.traffic.items()})


def lossy_divergences(
    report: Mapping[str, Any], max_gap: float, methods: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """The report's divergences (of ``methods``, or all) that are not numerical near-ties (gap unknown, or above
    ``max_gap``)."""
    return [
        d
        for d in report.get("divergences") or []
        if (methods is None or d["method"] in methods) and (d.get("logit_gap") is None or d["logit_gap"] > max_gap)
    ]


def _divergence_text(d: Mapping[str, Any]) -> str:
    where = f" at concurrency {d['concurrency']}" if d.get("concurrency") is not None else ""
    gap = "unknown" if d.get("logit_gap") is None else f"{d['logit_gap']:.3g}"
    return f"{d['method']} on {d['id']}{where} from token {d['first_diff']} (target's top-2 logit gap there {gap})"


def gate_speedup(figures: Mapping[str, Any]) -> float | None:
    """The speed the gate judges: the lower of the pooled and the median paired speedup (None: neither measured).

    A neighbour's load burst during the baseline runs inflates the pooled figure; a noisy machine must not let a
    drafter pass."""
    measured = [x for x in (figures.get("speedup"), figures.get("speedup_median_paired")) if x is not None]
    return min(measured) if measured else None


def speed_figures(report: Mapping[str, Any], method: str) -> dict[str, Any]:
    """A method's speed where it does worst: ``{speedup (the gate's), pooled, median_paired, tokens_per_s,
    baseline_tokens_per_s, concurrency}``, over every concurrency level of ``by_concurrency`` (SGLang), else the
    report's own figures (in-process: batch 1)."""
    levels = [
        {
            "concurrency": lv["concurrency"],
            "baseline_tokens_per_s": lv.get("baseline_tokens_per_s"),
            **lv["methods"][method],
        }
        for lv in report.get("by_concurrency") or []
        if method in lv.get("methods", {})
    ]
    if not levels:
        m = report["methods"][method]
        base = (report.get("baseline") or {}).get("tokens_per_s")
        levels = [{**m, "concurrency": report.get("concurrency"), "baseline_tokens_per_s": base}]
    worst = min(levels, key=lambda lv: gate_speedup(lv) if gate_speedup(lv) is not None else float("-inf"))
    return {
        "speedup": gate_speedup(worst),
        "pooled": worst.get("speedup"),
        "median_paired": worst.get("speedup_median_paired"),
        "tokens_per_s": worst.get("tokens_per_s"),
        "baseline_tokens_per_s": worst.get("baseline_tokens_per_s"),
        "concurrency": worst.get("concurrency"),
    }


def _speed_failure(report: Mapping[str, Any], name: str, gate: Gate) -> list[str]:
    s = speed_figures(report, name)
    if s["speedup"] is not None and s["speedup"] >= gate.min_speedup:
        return []
    where = f" at concurrency {s['concurrency']}" if s["concurrency"] is not None else ""
    if s["speedup"] is None:
        return [f"no speedup was measured (neither speedup nor speedup_median_paired in the report{where})"]
    return [
        f"speedup {s['speedup']:.3f}x is below bench.gate.min_speedup {gate.min_speedup:g} "
        f"({s['tokens_per_s'] or 0:.1f} tok/s with the drafter vs {s['baseline_tokens_per_s'] or 0:.1f} without"
        f"{where}, same run; pooled {s['pooled'] or 0:.3f}x, median paired {s['median_paired'] or 0:.3f}x)"
    ]


def _lossless_failure(report: Mapping[str, Any], judged: Sequence[str], gate: Gate) -> list[str]:
    lossy = lossy_divergences(report, gate.lossless_max_gap, judged)
    if not lossy:
        return []
    return [
        f"{len(lossy)} speculative output(s) differ from the baseline's greedy output, not at a near-tie "
        f"(bench.gate.lossless_max_gap {gate.lossless_max_gap:g}): "
        + "; ".join(_divergence_text(d) for d in lossy[:3])
        + ("; ..." if len(lossy) > 3 else "")
    ]


def _failed_requests_failure(report: Mapping[str, Any], judged: Sequence[str]) -> list[str]:
    failed = {m: n for m, n in (report.get("failed_requests") or {}).items() if m in judged}
    if not any(failed.values()):
        return []
    return [
        f"{sum(failed.values())} request(s) got no answer ("
        + ", ".join(f"{m} {n}" for m, n in failed.items())
        + "): the figures would be of partial data; see the servers' logs"
    ]


def _tables(report: Mapping[str, Any]) -> dict[str, Any]:
    return report.get("sets") or {"all prompts": {"methods": report["methods"]}}


def reference_losses(report: Mapping[str, Any], name: str, gate: Gate) -> list[dict[str, Any]]:
    """Every (set, reference, figure) where trained drafter ``name`` is not strictly above the reference."""
    methods = report["methods"]
    width = methods[name].get("draft_tokens")
    losses = []
    for set_name, table in _tables(report).items():
        mine = table["methods"][name]
        for ref in references_of(methods, name):
            theirs = table["methods"].get(ref)
            if theirs is None:
                continue
            for figure in gate.beat_references_on:
                if figure == "acceptance_length" and methods[ref].get("draft_tokens") != width:
                    continue  # another draft width: acceptance is not comparable, speed is
                get = gate_speedup if figure == "speedup" else (lambda t: t.get("acceptance_length"))
                a, b = get(mine), get(theirs)
                if not (a or 0.0) > (b or 0.0):  # a tie is no win; a missing figure counts as 0
                    losses.append(
                        {"set": set_name, "reference": ref, "figure": figure, "drafter": a, "reference_value": b}
                    )
    return losses


def _figure_of(table_entry: Mapping[str, Any], prompts: Sequence[Mapping[str, Any]], figure: str) -> SetFigure | None:
    """One method's figure on one set with its 95 % spread over the set's prompts (0 when the report lacks the
    per-prompt counts): acceptance from each prompt's committed tokens and verify steps, speed from each prompt's
    speedup."""
    if figure == "acceptance_length":
        value = table_entry.get("acceptance_length")
        counts = [
            (p["acceptance_length"] * p["verify_steps"], p["verify_steps"]) for p in prompts if p.get("verify_steps")
        ]
        if value is None:
            return None
        spread = acceptance_figure(*zip(*counts)).spread if counts and len(counts) == len(prompts) else 0.0
        return SetFigure(float(value), spread)
    value = gate_speedup(table_entry)
    speeds = [float(p["speedup"]) for p in prompts if isinstance(p.get("speedup"), int | float)]
    return None if value is None else SetFigure(value, spread_of(speeds) if len(speeds) > 1 else 0.0)


def set_figures(report: Mapping[str, Any], figure: str) -> dict[str, dict[str, SetFigure]]:
    """Per set, every method's ``figure`` (``acceptance_length`` or ``speedup``, the gate's) with its spread."""
    per_prompt = report.get("per_prompt") or []
    out = {}
    for set_name, table in _tables(report).items():
        prompts = [p for p in per_prompt if not report.get("sets") or p.get("set") == set_name]
        figures = {}
        for method, entry in table["methods"].items():
            rows = [p["methods"][method] for p in prompts if method in (p.get("methods") or {})]
            if (f := _figure_of(entry, rows, figure)) is not None:
                figures[method] = f
        out[set_name] = figures
    return out


def traffic_verdicts(report: Mapping[str, Any], name: str, gate: Gate) -> dict[str, Any]:
    """Trained drafter ``name`` on the user's traffic (``gate.traffic``), per figure of ``beat_references_on``:
    ``{figure: TrafficVerdict}`` against its references (acceptance: those of its draft width only)."""
    methods = report["methods"]
    width = methods[name].get("draft_tokens")
    out = {}
    for figure in gate.beat_references_on:
        refs = [
            r
            for r in references_of(methods, name)
            if figure != "acceptance_length" or methods[r].get("draft_tokens") == width
        ]
        if refs:
            out[figure] = traffic_verdict(
                set_figures(report, figure), gate.traffic, name, refs, figure=FIGURE_NAMES[figure]
            )
    return out


def _reference_failures(report: Mapping[str, Any], name: str, gate: Gate) -> list[str]:
    if not gate.must_beat_references:
        return []
    if gate.traffic:
        return [f"traffic: {f}" for v in traffic_verdicts(report, name, gate).values() for f in v.failures]
    return [
        f"set {x['set']}: {name}'s {FIGURE_NAMES[x['figure']]} {x['drafter'] or 0:.3f} does not beat reference "
        f"{x['reference']}'s {x['reference_value'] or 0:.3f}"
        for x in reference_losses(report, name, gate)
    ]


def _simulated_failure(report: Mapping[str, Any], name: str, gate: Gate) -> list[str]:
    facts = (report.get("drafters") or {}).get(name) or {}
    gap = facts.get("simulated_vs_measured")
    if gate.max_simulated_gap is None or gap is None or gap <= gate.max_simulated_gap:
        return []
    return [
        f"measured acceptance {report['methods'][name]['acceptance_length']:.2f} and the training eval's simulated "
        f"{facts['simulated_acceptance_length']:.2f} differ by {gap:.0%} "
        f"(> bench.gate.max_simulated_gap {gate.max_simulated_gap:.0%})"
    ]


def drafter_failures(report: Mapping[str, Any], name: str, gate: Gate) -> list[str]:
    """Reasons trained drafter ``name`` must not ship (empty: it passes)."""
    judged = [BASELINE, name, *references_of(report["methods"], name)]
    return (
        _speed_failure(report, name, gate)
        + _lossless_failure(report, judged, gate)
        + _failed_requests_failure(report, judged)
        + _reference_failures(report, name, gate)
        + _simulated_failure(report, name, gate)
    )


def set_verdicts(report: Mapping[str, Any], name: str, gate: Gate) -> dict[str, dict[str, Any]]:
    """Per set: the drafter's figures there and its losses to references there (whatever must_beat_references)."""
    losses = reference_losses(report, name, gate)
    out = {}
    for set_name, table in _tables(report).items():
        mine = table["methods"][name]
        lost = [{k: v for k, v in x.items() if k != "set"} for x in losses if x["set"] == set_name]
        out[set_name] = {
            "prompts": table.get("prompts"),
            "speedup": gate_speedup(mine),
            "acceptance_length": mine.get("acceptance_length"),
            "beats_references": not lost,
            "losses": lost,
        }
    return out


def gate_failures(report: Mapping[str, Any], gate: Gate) -> dict[str, list[str]]:
    """``{trained drafter: reasons it must not ship}`` (an empty list: it passes)."""
    return {name: drafter_failures(report, name, gate) for name in trained_drafters(report["methods"])}


def serve_recommendation(report: Mapping[str, Any], gate: Gate, failures: Mapping[str, list[str]]) -> dict[str, Any]:
    """Which drafter to serve: the fastest trained drafter that passed (its speed where it does worst); else the
    servable method (a reference folder, NGRAM, or a trained drafter) that was lossless, answered every request and
    is fastest (the gate's speedup), if that beats no drafter; else none."""
    passed = [n for n, f in failures.items() if not f]
    if passed and gate.traffic:
        speeds = set_figures(report, "speedup")
        choice, why = serve_choice(
            {s: {n: f[n] for n in passed if n in f} for s, f in speeds.items()}, gate.traffic, "speedup"
        )
        return {
            "serve": choice,
            "speedup": speed_figures(report, choice)["speedup"],
            "why": f"it passed the gate; {why}",
        }
    if passed:
        speeds = {n: speed_figures(report, n)["speedup"] or 0.0 for n in passed}
        best = max(passed, key=speeds.__getitem__)
        why = "it passed the gate" + (
            f", the fastest of the {len(passed)} trained drafters that did ("
            + ", ".join(f"{n} {s:.3f}x" for n, s in speeds.items())
            + ")"
            if len(passed) > 1
            else ""
        )
        return {"serve": best, "speedup": speeds[best], "why": why}
    failed = report.get("failed_requests") or {}
    lossy = {d["method"] for d in lossy_divergences(report, gate.lossless_max_gap)}
    candidates = {
        m: gate_speedup(v)
        for m, v in report["methods"].items()
        if v.get("role") != UNTRAINED and not failed.get(m) and m not in lossy
    }
    candidates = {m: s for m, s in candidates.items() if s is not None}
    best = max(candidates, key=candidates.__getitem__, default=None)
    if best is None or candidates[best] <= 1.0:
        return {"serve": None, "speedup": None, "why": "no drafter measured here is faster than none"}
    trained = [n for n in failures if n != best]
    why = "the fastest lossless method of this run" + (
        " (" + f"{candidates[best]:.3f}x vs " + ", ".join(f"{n}'s {candidates.get(n) or 0:.3f}x" for n in trained) + ")"
        if trained
        else ""
    )
    return {"serve": best, "speedup": candidates[best], "why": why}


def judge(report: Mapping[str, Any], gate: Gate) -> dict[str, Any]:
    """The report's ``gate`` section: each trained drafter's verdict (passed, failures, per set), which to serve."""
    failures = gate_failures(report, gate)
    drafters = {n: {"passed": not f, "failures": f, "sets": set_verdicts(report, n, gate)} for n, f in failures.items()}
    for n, v in drafters.items():
        if gate.traffic:  # the weighted figures and the per-set trade-off the report and the card show
            v["traffic"] = {
                figure: {"weighted": t.weighted, "trade_off": t.trade_off}
                for figure, t in traffic_verdicts(report, n, gate).items()
            }
    return {
        "passed": any(not f for f in failures.values()),
        "drafters": drafters,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(gate).items()},
        **serve_recommendation(report, gate, failures),
    }


def gate_message(report: Mapping[str, Any], verdict: Mapping[str, Any]) -> str:
    """Why the run ships nothing: each trained drafter's failures, and what to serve instead."""
    kinds = {n: (report.get("drafters") or {}).get(n, {}).get("kind") for n in verdict["drafters"]}
    reasons = "; ".join(
        f"{n} ({kinds[n]}): " + "; ".join(v["failures"]) for n, v in verdict["drafters"].items() if v["failures"]
    )
    serve = verdict["serve"]
    if serve is None or serve in verdict["drafters"]:  # none, or a trained drafter that failed but beats the rest
        instead = f"serve: {serve or 'no drafter'} ({verdict['why']})"
    else:
        instead = f"serve {serve} instead: {verdict['why']}"
    verdict_text = "the trained drafter does not pay off" if len(kinds) == 1 else "no trained drafter pays off"
    return f"{verdict_text}: {reasons}; {instead}"


def apply_gate(report: dict[str, Any], gate: Gate, out_json: Path, out_png: Path, log: Callable[[str], None]) -> None:
    """Write the verdict into the report (``gate``); pass when a trained drafter passes, or keep the evidence as
    ``{run}.gate-failed.json`` / ``.png`` and fail the job with every drafter's reasons and what to serve instead."""
    verdict = judge(report, gate)
    report["gate"] = verdict
    atomic_write_json(out_json, report)
    if not verdict["passed"]:
        kept = out_json.with_name(out_json.stem + ".gate-failed.json")
        os.replace(out_json, kept)
        os.replace(out_png, out_png.with_name(out_png.stem + ".gate-failed.png"))
        message = gate_message(report, verdict) + f" (full report: {kept})"
        log(message)
        raise SystemExit(message)
    for name, v in verdict["drafters"].items():
        log(f"gate: {name} " + ("passed" if v["passed"] else "failed: " + "; ".join(v["failures"])))
    log(f"gate passed ({gate}); serve {verdict['serve']}: {verdict['why']}")
