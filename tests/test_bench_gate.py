"""The benchmark's verdict: degenerate-output flags, the gate per trained drafter (speed, references per set at the
same draft width, lossless, failed requests, simulated gap; on a traffic mix: losses beyond the spread and the
weighted mix), which drafter to serve, and the benchmark figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aerie.benchmark.gate import Gate, apply_gate, gate_failures, judge
from aerie.tools.degenerate import degenerate_flags, loop_period, repeated_ngram_rate


def test_loops_and_repetition_are_flagged_but_ordinary_text_is_not() -> None:
    varied = list(range(100))
    assert degenerate_flags(varied) == []
    two_cycle = list(range(40)) + [7, 8] * 30
    assert loop_period(two_cycle) == 2 and "loop" in degenerate_flags(two_cycle)
    assert repeated_ngram_rate([1, 2, 3, 4] * 20) > 0.9
    assert degenerate_flags([5, 6, 7]) == []  # too short to judge
    assert degenerate_flags([5] * 10) == ["repetitive"]  # too short for a loop check, still repetitive


def fig(acc, speedup) -> dict:
    return {
        "acceptance_length": acc,
        "speedup": speedup,
        "speedup_median_paired": speedup,
        "tokens_per_s": 100 * speedup,
    }


def method(role: str, acc, speedup, kind=None, width=3, twin_of=None) -> dict:
    return {**fig(acc, speedup), "role": role, "kind": kind, "draft_tokens": width, "folder": None, "twin_of": twin_of}


def report(speedup=1.3, acc=2.9, refs=(1.0, 1.2), sim=2.95, ref_speedups=(0.6, 0.9)) -> dict:
    """The fields of an aerie.bench/4 report the gate reads: one trained EAGLE-3 drafter (``demo``, the run's name)
    and the in-process references, two sets with the same figures."""
    methods = {
        "demo": method("trained", acc, speedup, "eagle3"),
        "untrained": method("untrained", refs[0], ref_speedups[0], "eagle3", twin_of="demo"),
        "ngram": method("ngram", refs[1], ref_speedups[1]),
    }
    return {
        "format": "aerie.bench/4",
        "baseline": {"tokens_per_s": 100.0},
        "drafters": {
            "demo": {
                "kind": "eagle3",
                "simulated_acceptance_length": sim,
                "simulated_vs_measured": abs(sim - acc) / acc,
            }
        },
        "methods": methods,
        "sets": {
            s: {"prompts": 4, "methods": {m: fig(v["acceptance_length"], v["speedup"]) for m, v in methods.items()}}
            for s in ("mtbench", "gsm8k")
        },
        "divergences": [],
        "failed_requests": {"baseline": 0, **dict.fromkeys(methods, 0)},
    }


def add_method(rep: dict, name: str, info: dict, per_set: dict[str, tuple[float, float]] | None = None) -> dict:
    """``rep`` with one more method, measured per set (``per_set``: set -> (acceptance, speedup)) or as a whole."""
    rep["methods"][name] = info
    for s, table in rep["sets"].items():
        acc, sp = per_set[s] if per_set else (info["acceptance_length"], info["speedup"])
        table["methods"][name] = fig(acc, sp)
    rep["failed_requests"][name] = 0
    return rep


def published(rep: dict, acc: dict[str, float], speedup: dict[str, float], width: int = 3) -> dict:
    """``rep`` with a reference drafter folder measured per set (``acc`` / ``speedup`` by set)."""
    info = method("drafter", max(acc.values()), max(speedup.values()), "eagle3", width)
    return add_method(rep, "lightseekorg/kimi-k2.5-eagle3", info, {s: (acc[s], speedup[s]) for s in acc})


def test_gate_passes_a_drafter_that_pays_off() -> None:
    assert gate_failures(report(), Gate(min_speedup=1.0, max_simulated_gap=0.1)) == {"demo": []}


def test_gate_refuses_the_82_vs_90_drafter_with_the_measured_figures() -> None:
    (msg,) = gate_failures(report(speedup=82.3 / 90.0), Gate())["demo"]
    assert "speedup 0.914x is below bench.gate.min_speedup 1" in msg
    assert "91.4 tok/s with the drafter vs 100.0 without" in msg
    served = {**report(speedup=82.3 / 90.0), "concurrency": 32}  # a serving report names its worst level
    assert (
        "91.4 tok/s with the drafter vs 100.0 without at concurrency 32, same run"
        in (gate_failures(served, Gate())["demo"][0])
    )


def test_gate_uses_the_lower_of_pooled_and_median_paired_speedup_at_the_worst_level() -> None:
    rep = report(speedup=2.1)
    rep["methods"]["demo"]["speedup_median_paired"] = 0.97  # a load burst during the baseline inflated the pooled one
    (msg,) = gate_failures(rep, Gate())["demo"]
    assert "speedup 0.970x is below" in msg and "pooled 2.100x, median paired 0.970x" in msg
    # Served at several levels: judged where it does worst, whatever level the report's tables show.
    rep = report(speedup=1.3)
    rep["by_concurrency"] = [
        {
            "concurrency": c,
            "baseline_tokens_per_s": 100.0,
            "methods": {"demo": fig(None, s) | {"tokens_per_s": 100 * s}},
        }
        for c, s in ((1, 1.3), (32, 0.95))
    ]
    (msg,) = gate_failures(rep, Gate(must_beat_references=False))["demo"]
    assert "speedup 0.950x" in msg and "95.0 tok/s with the drafter vs 100.0 without at concurrency 32" in msg


@pytest.mark.parametrize(
    ("kw", "gate", "needle"),
    [
        (
            {"refs": (1.0, 3.1)},
            Gate(),
            "set gsm8k: demo's acceptance length 2.900 does not beat reference ngram's 3.100",
        ),
        ({"sim": 3.5}, Gate(max_simulated_gap=0.1), "differ by 21%"),
    ],
)
def test_gate_names_each_failure(kw, gate, needle) -> None:
    failures = gate_failures(report(**kw), gate)["demo"]
    assert any(needle in f for f in failures), failures


def divergence(gap, method="demo", concurrency=None) -> dict:
    return {"method": method, "id": "p/1", "concurrency": concurrency, "first_diff": 17, "logit_gap": gap}


def test_lossless_check_tolerates_near_ties_only() -> None:
    """Both backends list each output that left the baseline's, with the target's top-2 logit gap there: a near-tie
    (gap <= lossless_max_gap) is numerics, anything else - or an unknown gap - fails, naming where."""
    rep = {**report(), "divergences": [divergence(0.02), divergence(0.4, "ngram", 8)]}
    (msg,) = gate_failures(rep, Gate())["demo"]  # default 0: outputs must be identical
    assert msg.startswith("2 speculative output(s) differ from the baseline's greedy output, not at a near-tie")
    assert "demo on p/1 from token 17 (target's top-2 logit gap there 0.02)" in msg
    assert "ngram on p/1 at concurrency 8 from token 17 (target's top-2 logit gap there 0.4)" in msg
    (msg,) = gate_failures(rep, Gate(lossless_max_gap=0.1))["demo"]
    assert msg.startswith("1 speculative output(s)") and "ngram on p/1" in msg
    assert gate_failures(rep, Gate(lossless_max_gap=0.5)) == {"demo": []}
    unknown = {**rep, "divergences": [divergence(None, "baseline")]}  # baseline not even reproducible
    assert (
        "baseline on p/1 from token 17 (target's top-2 logit gap there unknown)"
        in gate_failures(unknown, Gate(lossless_max_gap=1e9))["demo"][0]
    )


@pytest.mark.parametrize("refs", [(2.9, 1.2), (1.0, 2.9), (2.9, 2.9)])
def test_gate_refuses_a_drafter_that_only_ties_the_references(refs) -> None:
    """A tie is no win: a drafter that accepts no more than its untrained twin or prompt lookup shows nothing that
    training bought."""
    rep = report(acc=2.9, refs=refs)
    failures = gate_failures(rep, Gate())["demo"]
    ties = [m for m, a in zip(("untrained", "ngram"), refs) if a == 2.9]
    assert len(failures) == 2 * len(ties)  # one per set and tied reference
    for name in ("mtbench", "gsm8k"):
        for m in ties:
            assert f"set {name}: demo's acceptance length 2.900 does not beat reference {m}'s 2.900" in failures
    assert gate_failures(rep, Gate(must_beat_references=False)) == {"demo": []}
    # The verdict per set keeps the losses, for a choice weighted by each set's traffic.
    sets = judge(rep, Gate())["drafters"]["demo"]["sets"]
    assert [x["reference"] for x in sets["gsm8k"]["losses"]] == ties and sets["gsm8k"]["beats_references"] is False


def test_a_loss_to_a_published_drafter_on_one_set_fails_that_set_naming_it_and_the_figures() -> None:
    rep = published(report(acc=2.9, speedup=1.3), {"mtbench": 2.69, "gsm8k": 3.20}, {"mtbench": 1.2, "gsm8k": 1.4})
    assert gate_failures(rep, Gate())["demo"] == [
        "set gsm8k: demo's acceptance length 2.900 does not beat reference lightseekorg/kimi-k2.5-eagle3's 3.200",
        "set gsm8k: demo's speedup 1.300 does not beat reference lightseekorg/kimi-k2.5-eagle3's 1.400",
    ]
    # Only acceptance compared: the speed loss is not judged; must_beat_references off: nothing is.
    assert len(gate_failures(rep, Gate(beat_references_on=("acceptance_length",)))["demo"]) == 1
    assert gate_failures(rep, Gate(must_beat_references=False)) == {"demo": []}
    sets = judge(rep, Gate())["drafters"]["demo"]["sets"]
    assert sets["mtbench"] == {
        "prompts": 4,
        "speedup": 1.3,
        "acceptance_length": 2.9,
        "beats_references": True,
        "losses": [],
    }


def test_a_reference_at_another_draft_width_is_compared_on_speed_only() -> None:
    """SGLang's NGRAM at its own 12 draft tokens, or a DFlash block of 7 drafts beside a 3-step chain, accepts more per
    step than the chain can: its acceptance is not comparable, its speed is."""
    rep = report(acc=2.9, speedup=1.3)
    rep["methods"]["ngram"]["draft_tokens"] = 11
    for table in rep["sets"].values():
        table["methods"]["ngram"]["acceptance_length"] = 4.5
    assert gate_failures(rep, Gate()) == {"demo": []}
    for table in rep["sets"].values():
        table["methods"]["ngram"].update(speedup=1.31, speedup_median_paired=1.31)
    assert [f.split(":")[0] for f in gate_failures(rep, Gate())["demo"]] == ["set mtbench", "set gsm8k"]


def test_any_failed_request_of_the_drafter_or_its_references_fails_it() -> None:
    rep = report()
    rep["failed_requests"]["ngram"] = 3
    (msg,) = gate_failures(rep, Gate(must_beat_references=False))["demo"]
    assert msg.startswith("3 request(s) got no answer (baseline 0, demo 0, untrained 0, ngram 3)"), msg


def test_a_drafter_without_a_speedup_figure_does_not_pass() -> None:
    """Nothing measured is no pass: neither speedup figure (absent or null) fails the speed gate; the median paired
    figure alone still decides."""
    for how in ("absent", "null"):
        for missing in (("speedup",), ("speedup", "speedup_median_paired")):
            rep = report()
            for key in missing:
                rep["methods"]["demo"].pop(key) if how == "absent" else rep["methods"]["demo"].update({key: None})
            failures = gate_failures(rep, Gate(min_speedup=1.0, must_beat_references=False))["demo"]
            if len(missing) == 2:
                assert failures and "no speedup was measured" in failures[0], failures
            else:
                assert failures == []


def two_drafters(eagle_speed=1.3, dflash_speed=1.6, dflash_acc=4.1) -> dict:
    """A run that trained an EAGLE-3 (``kimi-eagle3``, 3 drafts a step) and a DFlash drafter (``kimi-dflash``, 7),
    each with its untrained twin, against ngram and a published DFlash folder (7 drafts)."""
    rep = report(speedup=eagle_speed)
    rep["methods"] = {"kimi-eagle3": {**rep["methods"].pop("demo")}, **rep["methods"]}
    rep["methods"]["untrained:kimi-eagle3"] = {**rep["methods"].pop("untrained"), "twin_of": "kimi-eagle3"}
    rep["drafters"] = {"kimi-eagle3": rep["drafters"].pop("demo"), "kimi-dflash": {"kind": "dflash"}}
    for table in rep["sets"].values():
        table["methods"]["kimi-eagle3"] = table["methods"].pop("demo")
        table["methods"]["untrained:kimi-eagle3"] = table["methods"].pop("untrained")
    rep["failed_requests"] = {"baseline": 0, **dict.fromkeys(rep["methods"], 0)}
    add_method(rep, "kimi-dflash", method("trained", dflash_acc, dflash_speed, "dflash", 7))
    add_method(rep, "untrained:kimi-dflash", method("untrained", 1.0, 0.5, "dflash", 7, "kimi-dflash"))
    return add_method(rep, "z-lab/Kimi-K2.5-DFlash", method("drafter", 3.9, 1.5, "dflash", 7))


def test_each_trained_drafter_is_judged_on_its_own_and_the_fastest_that_passes_is_served() -> None:
    """Two trained drafters: each against the baseline and the references, never against its sibling (the EAGLE-3
    chain is slower than the DFlash drafter and still passes) nor its sibling's untrained twin; acceptance only
    against references of its width (the EAGLE-3 chain is not held to the DFlash reference's 3.9)."""
    rep = two_drafters()
    rep["methods"]["untrained:kimi-dflash"].update(speedup=1.35, speedup_median_paired=1.35)  # faster than the chain
    for table in rep["sets"].values():
        table["methods"]["untrained:kimi-dflash"].update(speedup=1.35, speedup_median_paired=1.35)
    verdict = judge(rep, Gate())
    assert verdict["drafters"]["kimi-dflash"]["failures"] == []
    assert verdict["drafters"]["kimi-eagle3"]["failures"] == [  # not untrained:kimi-dflash's 1.35x: not its reference
        f"set {s}: kimi-eagle3's speedup 1.300 does not beat reference z-lab/Kimi-K2.5-DFlash's 1.500"
        for s in ("mtbench", "gsm8k")
    ]
    assert verdict["passed"] is True and verdict["serve"] == "kimi-dflash" and verdict["speedup"] == 1.6
    # Both pass: the faster is served, and the verdict says so.
    verdict = judge(two_drafters(eagle_speed=1.55), Gate())
    assert [v["passed"] for v in verdict["drafters"].values()] == [True, True]
    assert verdict["serve"] == "kimi-dflash"
    assert verdict["why"] == (
        "it passed the gate, the fastest of the 2 trained drafters that did (kimi-eagle3 1.550x, kimi-dflash 1.600x)"
    )
    # The DFlash drafter loses to the published one on acceptance (same width): it fails, the chain is served.
    verdict = judge(two_drafters(eagle_speed=1.55, dflash_acc=3.8), Gate())
    assert verdict["serve"] == "kimi-eagle3" and verdict["drafters"]["kimi-dflash"]["passed"] is False


def with_prompts(rep: dict, per_set_prompts: dict[str, dict[str, list[tuple[float, int, float]]]]) -> dict:
    """``rep`` with per-prompt counts: set -> method -> [(acceptance, verify steps, speedup)] per prompt."""
    rows: dict[tuple[str, int], dict] = {}
    for s, by_method in per_set_prompts.items():
        for m, prompts in by_method.items():
            for i, (acc, steps, sp) in enumerate(prompts):
                row = rows.setdefault((s, i), {"id": f"{s}-{i}", "set": s, "methods": {}})
                row["methods"][m] = {"acceptance_length": acc, "verify_steps": steps, "speedup": sp}
    rep["per_prompt"] = list(rows.values())
    return rep


def test_on_the_traffic_mix_a_loss_within_the_spread_passes_and_one_beyond_it_fails() -> None:
    """bench.traffic: the drafter may trail a reference on a set within that set's spread over its prompts, but
    must not lose beyond it on any set, and must beat the best reference on the traffic-weighted mix."""
    rep = published(
        report(acc=2.9, speedup=1.3),
        {"mtbench": 2.95, "gsm8k": 2.5},
        {"mtbench": 1.2, "gsm8k": 1.1},
    )
    rep["sets"]["mtbench"]["methods"]["demo"]["acceptance_length"] = 2.9
    noisy = {  # mtbench: per-prompt acceptance that spreads widely; the means are the tables' own figures
        "demo": [(1.9, 50, 1.3), (3.9, 50, 1.3)],
        "lightseekorg/kimi-k2.5-eagle3": [(2.0, 50, 1.2), (3.9, 50, 1.2)],
        "untrained": [(1.0, 50, 0.6), (1.0, 50, 0.6)],
        "ngram": [(1.2, 50, 0.9), (1.2, 50, 0.9)],
    }
    with_prompts(rep, {"mtbench": noisy})
    strict = gate_failures(rep, Gate())["demo"]
    assert strict == [
        "set mtbench: demo's acceptance length 2.900 does not beat reference lightseekorg/kimi-k2.5-eagle3's 2.950"
    ]
    mix = {"mtbench": 0.2, "gsm8k": 0.8}
    verdict = judge(rep, Gate(traffic=mix))
    assert verdict["drafters"]["demo"]["failures"] == []
    weighted = verdict["drafters"]["demo"]["traffic"]["acceptance_length"]["weighted"]
    assert weighted["demo"] == pytest.approx(0.2 * 2.9 + 0.8 * 2.9)
    assert weighted["lightseekorg/kimi-k2.5-eagle3"] == pytest.approx(0.2 * 2.95 + 0.8 * 2.5)
    assert verdict["serve"] == "demo" and "traffic-weighted speedup" in verdict["why"]
    # The same trailing on a set whose prompts agree is beyond the spread: it fails, naming the set and figures.
    tight = {m: [(v, 50, sp)] * 2 for m, v, sp in [
        ("demo", 2.9, 1.3), ("lightseekorg/kimi-k2.5-eagle3", 2.95, 1.2), ("untrained", 1.0, 0.6), ("ngram", 1.2, 0.9)
    ]}  # fmt: skip
    (failure,) = gate_failures(with_prompts(rep, {"mtbench": tight}), Gate(traffic=mix))["demo"]
    assert failure.startswith(
        "traffic: mtbench: demo's acceptance length 2.900 loses to lightseekorg/kimi-k2.5-eagle3's"
    )
    # Weights that put the traffic on the set where the published drafter is ahead: the weighted mix fails.
    rep["sets"]["gsm8k"]["methods"]["lightseekorg/kimi-k2.5-eagle3"]["acceptance_length"] = 2.9
    failures = gate_failures(with_prompts(rep, {"mtbench": noisy}), Gate(traffic={"mtbench": 3, "gsm8k": 1}))["demo"]
    assert failures == [
        "traffic: weighted mix: demo's acceptance length 2.900 does not beat the best reference "
        "lightseekorg/kimi-k2.5-eagle3's 2.938 (-0.038; must exceed +0.000)"
    ]


def test_the_drafter_served_for_a_traffic_mix_is_the_best_on_that_mix() -> None:
    """Two drafters that both pass: the one served is the best on the traffic-weighted speed, not the fastest
    overall, and the why names the set it gives up."""
    rep = two_drafters(eagle_speed=1.55)
    for table, (e, d) in zip(rep["sets"].values(), [(1.9, 1.6), (1.56, 1.7)]):
        table["methods"]["kimi-eagle3"].update(speedup=e, speedup_median_paired=e)
        table["methods"]["kimi-dflash"].update(speedup=d, speedup_median_paired=d)
    assert judge(rep, Gate(traffic={"mtbench": 1, "gsm8k": 0}))["serve"] == "kimi-eagle3"
    verdict = judge(rep, Gate(traffic={"mtbench": 0.1, "gsm8k": 0.9}))
    assert verdict["serve"] == "kimi-dflash"
    assert "gives up mtbench (best there: kimi-eagle3 1.900 vs 1.600)" in verdict["why"]


def test_the_gate_writes_its_verdict_and_fails_only_when_no_trained_drafter_passes(tmp_path: Path) -> None:
    out, png = tmp_path / "run.json", tmp_path / "run.png"

    def fresh() -> None:
        out.write_text("{}")
        png.write_bytes(b"png")

    fresh()
    rep = published(report(acc=2.9, speedup=1.3), {"mtbench": 3.0, "gsm8k": 3.2}, {"mtbench": 1.5, "gsm8k": 1.6})
    with pytest.raises(SystemExit) as failed:
        apply_gate(rep, Gate(), out, png, lambda _: None)
    assert str(failed.value).startswith("the trained drafter does not pay off: demo (eagle3): set mtbench: ")
    assert (
        "serve lightseekorg/kimi-k2.5-eagle3 instead: the fastest lossless method of this run (1.600x vs demo's 1.300x)"
    ) in str(failed.value)
    kept = json.loads((tmp_path / "run.gate-failed.json").read_text())
    assert kept["gate"]["passed"] is False and kept["gate"]["serve"] == "lightseekorg/kimi-k2.5-eagle3"
    assert len(kept["gate"]["drafters"]["demo"]["failures"]) == 4 and not out.exists()
    assert (tmp_path / "run.gate-failed.png").exists()
    # One of two trained drafters passes: the job passes, serving it; the other's failures are in the report.
    fresh()
    logs: list[str] = []
    apply_gate(two_drafters(), Gate(), out, png, logs.append)
    verdict = json.loads(out.read_text())["gate"]
    assert verdict["passed"] is True and verdict["serve"] == "kimi-dflash"
    assert not verdict["drafters"]["kimi-eagle3"]["passed"] and verdict["drafters"]["kimi-dflash"]["failures"] == []
    assert any(line.startswith("gate: kimi-eagle3 failed: set mtbench") for line in logs), logs
    # Neither passes: each one's failures are named, and the fastest lossless method is the one to serve.
    fresh()
    with pytest.raises(SystemExit) as failed:
        apply_gate(two_drafters(eagle_speed=0.8, dflash_speed=0.9), Gate(), out, png, lambda _: None)
    message = str(failed.value)
    assert message.startswith("no trained drafter pays off: kimi-eagle3 (eagle3): speedup 0.800x")
    assert "; kimi-dflash (dflash): speedup 0.900x" in message
    assert (
        "serve z-lab/Kimi-K2.5-DFlash instead: the fastest lossless method of this run (1.500x vs kimi-eagle3's "
        "0.800x, kimi-dflash's 0.900x)"
    ) in message
    fresh()
    with pytest.raises(SystemExit, match="serve: no drafter"):  # nothing beats no drafter: none to serve
        apply_gate(report(speedup=0.8), Gate(), out, png, lambda _: None)


def test_benchmark_plot_names_every_drafter_with_its_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aerie.benchmark import plots

    rep = two_drafters()
    for m in rep["methods"].values():
        m["acceptance_per_position"] = [0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1][: m["draft_tokens"]]
    rep.update(device="cpu", prompts=24)
    rep["drafters"]["kimi-eagle3"]["simulated_acceptance_length"] = 2.95
    labels: list[str] = []
    real_legend = plots.plot_sets

    def record(ax, sets, methods) -> None:
        real_legend(ax, sets, methods)
        labels.extend(t.get_text() for t in ax.get_legend().get_texts())

    monkeypatch.setattr(plots, "plot_sets", record)
    plots.plot_benchmark(rep, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert {"kimi-eagle3 (eagle3)", "kimi-dflash (dflash)", "z-lab/Kimi-K2.5-DFlash (dflash)", "ngram"} <= set(labels)


def test_sglang_plot_has_tok_s_per_concurrency(tmp_path: Path) -> None:
    from aerie.benchmark.plots import plot_sglang_benchmark

    rows = [
        {
            "set": s,
            "concurrency": c,
            "baseline": {"output_tokens_per_s": 90.0 * c},
            "kimi-eagle3": {"output_tokens_per_s": 120.0 * c},
        }
        for s in ("mtbench", "gsm8k")
        for c in (1, 8, 32)
    ]
    report = {"rows": rows, "modes": ["baseline", "kimi-eagle3"], "methods": {"kimi-eagle3": {"kind": "eagle3"}}}
    plot_sglang_benchmark(report, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
