"""The benchmark's verdict: degenerate-output flags, the speedup gate, and its figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.bench.degenerate import degenerate_flags, loop_period, repeated_ngram_rate
from aerie.bench.gate import Gate, beats_references, gate_failures


def test_loops_and_repetition_are_flagged_but_ordinary_text_is_not() -> None:
    varied = list(range(100))
    assert degenerate_flags(varied) == []
    two_cycle = list(range(40)) + [7, 8] * 30
    assert loop_period(two_cycle) == 2 and "loop" in degenerate_flags(two_cycle)
    assert repeated_ngram_rate([1, 2, 3, 4] * 20) > 0.9
    assert degenerate_flags([5, 6, 7]) == []  # too short to judge
    assert degenerate_flags([5] * 10) == ["repetitive"]  # too short for a loop check, still repetitive


def report(speedup=1.3, acc=2.9, refs=(1.0, 1.2), lossless=True, sim=2.95, ref_speedups=(0.6, 0.9)) -> dict:
    """The fields of an aerie.bench/3 report the gate reads, two sets with the same figures; the verdict on the
    references is the production function's (beats_references), never re-derived here."""

    def fig(a, s):
        return {"acceptance_length": a, "speedup": s, "speedup_median_paired": s}

    methods = {
        "eagle3": {**fig(acc, speedup), "kind": "trained", "matched_width": True},
        "untrained": {**fig(refs[0], ref_speedups[0]), "kind": "untrained", "matched_width": True},
        "ngram": {**fig(refs[1], ref_speedups[1]), "kind": "ngram", "matched_width": True},
    }
    sets = {
        name: {"prompts": 4, "methods": {m: fig(v["acceptance_length"], v["speedup"]) for m, v in methods.items()}}
        for name in ("mtbench", "gsm8k")
    }
    return {
        "speedup": speedup,
        "speedup_median_paired": speedup,
        "baseline": {"tokens_per_s": 100.0},
        "speculative": {"tokens_per_s": 100.0 * speedup},
        "lossless": lossless,
        "methods": methods,
        "sets": sets,
        "failed_requests": {"baseline": 0, "eagle3": 0, "untrained": 0, "ngram": 0},
        "acceptance_length": acc,
        "beats_references": beats_references(acc, {"untrained": refs[0], "ngram": refs[1]}),
        "simulated_acceptance_length": sim,
        "simulated_vs_measured": abs(sim - acc) / acc,
    }


def test_gate_passes_a_drafter_that_pays_off() -> None:
    assert gate_failures(report(), Gate(min_speedup=1.0, max_simulated_gap=0.1)) == []


def test_gate_refuses_the_82_vs_90_drafter_with_the_measured_figures() -> None:
    (msg,) = gate_failures(report(speedup=82.3 / 90.0), Gate())
    assert "speedup 0.914x is below bench.gate.min_speedup 1" in msg
    assert "91.4 tok/s with the drafter vs 100.0 without" in msg
    served = {**report(speedup=82.3 / 90.0), "concurrency": 32}  # a serving report names its worst level
    assert (
        "91.4 tok/s with the drafter vs 100.0 without at concurrency 32, same run" in gate_failures(served, Gate())[0]
    )


def test_gate_uses_the_lower_of_pooled_and_median_paired_speedup() -> None:
    rep = report(speedup=2.1)
    rep["speedup_median_paired"] = 0.97  # a load burst during the baseline inflated the pooled figure
    (msg,) = gate_failures(rep, Gate())
    assert "speedup 0.970x is below" in msg and "pooled 2.100x, median paired 0.970x" in msg


@pytest.mark.parametrize(
    ("kw", "gate", "needle"),
    [
        (
            {"refs": (1.0, 3.1)},
            Gate(),
            "set gsm8k: the trained drafter's acceptance length 2.900 does not beat reference ngram's 3.100",
        ),
        ({"lossless": False}, Gate(), "differs from greedy"),  # a report without divergences: strict
        ({"sim": 3.5}, Gate(max_simulated_gap=0.1), "differ by 21%"),
    ],
)
def test_gate_names_each_failure(kw, gate, needle) -> None:
    failures = gate_failures(report(**kw), gate)
    assert any(needle in f for f in failures), failures


def divergence(gap, method="eagle3", concurrency=None) -> dict:
    return {"method": method, "id": "p/1", "concurrency": concurrency, "first_diff": 17, "logit_gap": gap}


def test_lossless_check_tolerates_near_ties_only() -> None:
    """Both backends list each output that left the baseline's, with the target's top-2 logit gap there: a near-tie
    (gap <= lossless_max_gap) is numerics, anything else - or an unknown gap - fails, naming where."""
    rep = {**report(lossless=False), "divergences": [divergence(0.02), divergence(0.4, "ngram", 8)]}
    (msg,) = gate_failures(rep, Gate())  # default 0: outputs must be identical
    assert msg.startswith("2 speculative output(s) differ from the baseline's greedy output, not at a near-tie")
    assert "eagle3 on p/1 from token 17 (target's top-2 logit gap there 0.02)" in msg
    assert "ngram on p/1 at concurrency 8 from token 17 (target's top-2 logit gap there 0.4)" in msg
    (msg,) = gate_failures(rep, Gate(lossless_max_gap=0.1))
    assert msg.startswith("1 speculative output(s)") and "ngram on p/1" in msg
    assert gate_failures(rep, Gate(lossless_max_gap=0.5)) == []
    unknown = {**rep, "divergences": [divergence(None, "baseline")]}  # baseline not even reproducible
    assert (
        "baseline on p/1 from token 17 (target's top-2 logit gap there unknown)"
        in gate_failures(unknown, Gate(lossless_max_gap=1e9))[0]
    )
    assert gate_failures({**report(), "divergences": []}, Gate()) == []


def test_a_drafter_that_only_ties_a_reference_does_not_beat_it() -> None:
    assert beats_references(2.0, {"untrained": 1.0, "ngram": 1.5}) is True
    assert beats_references(2.0, {"untrained": 1.0, "ngram": 2.0}) is False  # a tie is not a win
    assert beats_references(2.0, {"untrained": 2.0, "ngram": 2.0}) is False
    assert beats_references(1.9, {"untrained": 1.0, "ngram": 2.0}) is False
    assert beats_references(None, {"untrained": 0.0}) is False  # no verify step measured: no win over anything
    assert beats_references(1.2, {"untrained": None}) is True  # a reference that measured nothing counts as 0
    assert beats_references(1.2, {}) is True  # no references configured: nothing to beat


@pytest.mark.parametrize("refs", [(2.9, 1.2), (1.0, 2.9), (2.9, 2.9)])
def test_gate_refuses_a_drafter_that_only_ties_the_references(refs) -> None:
    rep = report(acc=2.9, refs=refs)
    assert rep["beats_references"] is False
    failures = gate_failures(rep, Gate())
    ties = [m for m, a in zip(("untrained", "ngram"), refs) if a == 2.9]
    assert len(failures) == 2 * len(ties)  # one per set and tied reference
    for name in ("mtbench", "gsm8k"):
        for m in ties:
            assert f"set {name}: the trained drafter's acceptance length 2.900 does not beat reference {m}'s 2.900" in (
                failures
            ), failures
    assert gate_failures(rep, Gate(must_beat_references=False)) == []


def test_gate_decides_from_the_measured_figures_not_a_stale_verdict() -> None:
    """A report whose stored verdict disagrees with its figures (edited, or written by an older aerie) is judged
    on the figures."""
    rep = report(acc=2.0, refs=(1.0, 2.0))
    rep["beats_references"] = True
    assert any("does not beat" in f for f in gate_failures(rep, Gate()))


def test_benchmark_plot_is_written(tmp_path: Path) -> None:
    from aerie.bench.plots import plot_benchmark

    rep = {
        "methods": {
            m: {
                "acceptance_per_position": [0.8, 0.6, 0.5],
                "acceptance_length": 2.9,
                "tokens_per_s": 130.0,
                "speedup": 1.3,
            }
            for m in ("eagle3", "ngram")
        },
        "num_draft_steps": 3,
        "baseline": {"tokens_per_s": 100.0},
        "simulated_acceptance_length": 2.9,
        "acceptance_length": 2.9,
        "device": "cpu",
        "prompts": 24,
    }
    plot_benchmark(rep, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_sglang_plot_has_tok_s_per_concurrency(tmp_path: Path) -> None:
    from aerie.bench.plots import plot_sglang_benchmark

    rows = [
        {
            "set": s,
            "concurrency": c,
            "baseline": {"output_tokens_per_s": 90.0 * c},
            "eagle3": {"output_tokens_per_s": 120.0 * c},
        }
        for s in ("mtbench", "gsm8k")
        for c in (1, 8, 32)
    ]
    plot_sglang_benchmark({"rows": rows}, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def published(rep: dict, acc: dict[str, float], speedup: dict[str, float], matched: bool = True) -> dict:
    """``rep`` with a reference drafter folder measured per set (``acc`` / ``speedup`` by set)."""
    name = "lightseekorg/kimi-k2.5-eagle3"
    total = {"acceptance_length": max(acc.values()), "speedup": max(speedup.values())}
    rep["methods"][name] = {
        **total,
        "speedup_median_paired": total["speedup"],
        "kind": "drafter",
        "matched_width": matched,
        "folder": "/hub/snapshot",
    }
    for s, table in rep["sets"].items():
        table["methods"][name] = {
            "acceptance_length": acc[s],
            "speedup": speedup[s],
            "speedup_median_paired": speedup[s],
        }
    rep["failed_requests"][name] = 0
    return rep


def test_a_loss_to_a_published_drafter_on_one_set_fails_that_set_naming_it_and_the_figures() -> None:
    rep = published(report(acc=2.9, speedup=1.3), {"mtbench": 2.69, "gsm8k": 3.20}, {"mtbench": 1.2, "gsm8k": 1.4})
    failures = gate_failures(rep, Gate())
    assert failures == [
        "set gsm8k: the trained drafter's acceptance length 2.900 does not beat reference "
        "lightseekorg/kimi-k2.5-eagle3's 3.200",
        "set gsm8k: the trained drafter's speedup 1.300 does not beat reference lightseekorg/kimi-k2.5-eagle3's 1.400",
    ]
    # Only acceptance compared: the speed loss is not judged; must_beat_references off: nothing is.
    assert len(gate_failures(rep, Gate(beat_references_on=("acceptance_length",)))) == 1
    assert gate_failures(rep, Gate(must_beat_references=False)) == []


def test_a_reference_at_another_draft_width_is_compared_on_speed_only() -> None:
    """SGLang's NGRAM at its own 12 draft tokens accepts more per step than a 4-token chain can: its acceptance is
    not comparable, its speed is."""
    rep = report(acc=2.9, speedup=1.3)
    rep["methods"]["ngram"]["matched_width"] = False
    for table in rep["sets"].values():
        table["methods"]["ngram"]["acceptance_length"] = 4.5
    assert gate_failures(rep, Gate()) == []
    for table in rep["sets"].values():
        table["methods"]["ngram"].update(speedup=1.31, speedup_median_paired=1.31)
    assert [f.split(":")[0] for f in gate_failures(rep, Gate())] == ["set mtbench", "set gsm8k"]


def test_any_failed_request_fails_the_gate() -> None:
    rep = report()
    rep["failed_requests"]["ngram"] = 3
    (msg,) = gate_failures(rep, Gate(must_beat_references=False))
    assert msg.startswith("3 request(s) got no answer (baseline 0, eagle3 0, untrained 0, ngram 3)"), msg


@pytest.mark.parametrize("missing", [("speedup",), ("speedup", "speedup_median_paired")])
def test_a_report_without_a_speedup_figure_does_not_pass(missing) -> None:
    """Nothing measured is no pass: a report with neither speedup figure (absent or null) fails the speed gate."""
    for how in ("absent", "null"):
        rep = report()
        for key in missing:
            if how == "absent":
                del rep[key]
            else:
                rep[key] = None
        failures = gate_failures(rep, Gate(min_speedup=1.0, must_beat_references=False))
        if len(missing) == 2:
            assert failures and "no speedup was measured" in failures[0], failures
        else:  # the median paired figure alone still decides
            assert failures == []
    assert gate_failures({**report(), "speedup": None, "speedup_median_paired": None}, Gate(min_speedup=0.0))


def test_the_gate_writes_its_verdict_and_says_which_drafter_to_serve_instead(tmp_path: Path) -> None:
    import json

    from aerie.bench.gate import apply_gate

    rep = published(report(acc=2.9, speedup=1.3), {"mtbench": 3.0, "gsm8k": 3.2}, {"mtbench": 1.5, "gsm8k": 1.6})
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    out.write_text("{}")
    png.write_bytes(b"png")
    logs: list[str] = []
    with pytest.raises(SystemExit) as failed:
        apply_gate(rep, Gate(), out, png, logs.append)
    assert (
        "serve lightseekorg/kimi-k2.5-eagle3 instead: the fastest lossless method of this run (1.600x vs the "
        "trained drafter's 1.300x)"
    ) in str(failed.value)
    kept = json.loads((tmp_path / "run.gate-failed.json").read_text())
    assert kept["gate"]["passed"] is False and kept["gate"]["serve"] == "lightseekorg/kimi-k2.5-eagle3"
    assert len(kept["gate"]["failures"]) == 4 and not out.exists()
    # The trained drafter passing: it is the one to serve, and the verdict is in the published report.
    out.write_text("{}")
    png.write_bytes(b"png")
    apply_gate(report(), Gate(), out, png, logs.append)
    verdict = json.loads(out.read_text())["gate"]
    assert verdict["passed"] is True and verdict["serve"] == "eagle3" and verdict["failures"] == []
    # Nothing beats no drafter: none to serve.
    slow = report(speedup=0.8)
    with pytest.raises(SystemExit, match="serve: no drafter"):
        apply_gate(slow, Gate(), out, png, logs.append)
