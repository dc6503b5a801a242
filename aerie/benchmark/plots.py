"""Figures of a benchmark report: acceptance per draft position and tokens/s per method (or concurrency), every
trained drafter by name and kind beside the references."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aerie.benchmark.methods import TRAINED


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display on build machines and cluster nodes
    import matplotlib.pyplot as plt

    return plt


def method_label(name: str, method: Mapping[str, Any]) -> str:
    """A method as the figures name it: its name, and its drafter kind when it has one."""
    return f"{name} ({method['kind']})" if method.get("kind") else name


def _simulated_title(report: Mapping[str, Any]) -> str:
    """Each trained drafter's training-eval acceptance beside the measured one (for the figure's title)."""
    parts = [
        f"{name}: simulated {d['simulated_acceptance_length']:.2f}, measured "
        f"{report['methods'][name]['acceptance_length'] or 0:.2f}"
        for name, d in (report.get("drafters") or {}).items()
        if d.get("simulated_acceptance_length")
    ]
    return "\n(" + "; ".join(parts) + ")" if parts else ""


def plot_benchmark(report: dict[str, Any], out_png: Path) -> None:
    """Panels from an ``aerie.bench/4`` report (either backend): acceptance per draft position, tokens/s per method,
    and (with ``sets``) acceptance length and speedup per set and method, side by side; every trained drafter is named
    with its kind."""
    plt = _figure()
    methods = report["methods"]
    sets = report.get("sets") or {}
    fig, axes = plt.subplots(1, 3 if sets else 2, figsize=(16.5 if sets else 11, 4.6))
    ax_acc, ax_tps = axes[0], axes[1]
    if sets:
        plot_sets(axes[2], sets, methods)

    width = 0.8 / max(len(methods), 1)
    k = max((len(m["acceptance_per_position"]) for m in methods.values()), default=0)
    for j, (name, m) in enumerate(methods.items()):
        positions = range(1, len(m["acceptance_per_position"]) + 1)  # each method's own draft width
        ax_acc.bar(
            [p - 0.4 + width * (j + 0.5) for p in positions],
            [a or 0.0 for a in m["acceptance_per_position"]],
            width=width,
            color=f"C{j}",
            label=f"{method_label(name, m)}: acceptance length {m['acceptance_length'] or 0:.2f}",
        )
    ax_acc.set_xticks(range(1, k + 1))
    ax_acc.set_xlabel("draft position")
    ax_acc.set_ylabel("share of verify steps accepting it")
    ax_acc.set_ylim(0, 1)
    ax_acc.set_title("Acceptance per draft position" + _simulated_title(report), fontsize=9)
    ax_acc.legend(fontsize=7)

    names = ["baseline", *(method_label(n, m) for n, m in methods.items())]
    tps = [report["baseline"]["tokens_per_s"] or 0.0, *(m["tokens_per_s"] or 0.0 for m in methods.values())]
    bars = ax_tps.bar(range(len(names)), tps, color=["grey", *[f"C{j}" for j in range(len(methods))]])
    for bar, m in zip(bars[1:], methods.values()):
        bar.set_hatch("" if m.get("role") == TRAINED else "//")  # references hatched, trained drafters plain
        ax_tps.annotate(
            f"{m['speedup'] or 0:.2f}x",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax_tps.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    # In-process: batch 1; under SGLang: the concurrency level where a trained drafter does worst.
    level = report.get("concurrency")
    ax_tps.set_ylabel("tokens / s " + (f"(concurrency {level})" if level is not None else "(batch 1)"))
    ax_tps.set_title(
        f"Throughput on {report['device']}, {report['prompts']} prompts, same run (hatched: references)", fontsize=10
    )
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_sets(ax, sets: Mapping[str, Any], methods: Mapping[str, Any]) -> None:
    """Grouped bars: acceptance length per set (groups) and method (bars), each bar labelled with its speedup."""
    names = list(sets)
    width = 0.8 / max(len(methods), 1)
    for j, (m, info) in enumerate(methods.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        vals = [(sets[n]["methods"].get(m) or {}).get("acceptance_length") or 0.0 for n in names]
        bars = ax.bar(xs, vals, width=width, label=method_label(m, info), color=f"C{j}")
        for bar, n in zip(bars, names):
            sp = (sets[n]["methods"].get(m) or {}).get("speedup")
            ax.annotate(
                f"{sp or 0:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n}\n({sets[n]['prompts']} prompts)" for n in names], fontsize=8)
    ax.set_ylabel("acceptance length (tokens per verify step)")
    ax.set_title("Per set: acceptance length (bars) and speedup (labels)", fontsize=10)
    ax.legend(fontsize=7)


def plot_sglang_benchmark(report: dict[str, Any], out_png: Path) -> None:
    """From an ``aerie.sglang-bench/5`` report: output tok/s per concurrency of every server, per set."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sets = sorted({r["set"] for r in report["rows"]})
    methods = report.get("methods") or {}
    for j, name in enumerate(sets):
        rows = sorted((r for r in report["rows"] if r["set"] == name), key=lambda r: r["concurrency"])
        conc = [r["concurrency"] for r in rows]
        for k, mode in enumerate(report["modes"]):
            ys = [(r.get(mode) or {}).get("output_tokens_per_s") for r in rows]
            style = "--" if mode == "baseline" else ["-", ":", "-.", (0, (1, 1))][k % 4]
            label = f"{name} {method_label(mode, methods.get(mode) or {})}"
            ax.plot(conc, [y or 0.0 for y in ys], linestyle=style, marker="o", color=f"C{j}", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("SGLang: tokens/s per concurrency, without and with each drafter", fontsize=10)
    if report["rows"]:  # a run that measured nothing has no lines to name
        ax.legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
