"""Figures of a benchmark report: acceptance per draft position and tokens/s per method (or concurrency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display on build machines and cluster nodes
    import matplotlib.pyplot as plt

    return plt


def plot_benchmark(report: dict[str, Any], out_png: Path) -> None:
    """Panels from an ``aerie.bench/3`` report (either backend): acceptance per position, tokens/s per method, and
    (with ``sets``) acceptance length and speedup per set and drafter, side by side."""
    plt = _figure()
    methods = report["methods"]
    k = report["num_draft_steps"]
    sets = report.get("sets") or {}
    fig, axes = plt.subplots(1, 3 if sets else 2, figsize=(16.5 if sets else 11, 4.2))
    ax_acc, ax_tps = axes[0], axes[1]
    if sets:
        plot_sets(axes[2], sets)

    width = 0.8 / max(len(methods), 1)
    positions = list(range(1, k + 1))
    for j, (name, m) in enumerate(methods.items()):
        xs = [p - 0.4 + width * (j + 0.5) for p in positions]
        ax_acc.bar(
            xs,
            [a or 0.0 for a in m["acceptance_per_position"]],
            width=width,
            label=f"{name} (acceptance length {m['acceptance_length'] or 0:.2f})",
        )
    ax_acc.set_xticks(positions)
    ax_acc.set_xlabel("draft position")
    ax_acc.set_ylabel("share of verify steps accepting it")
    ax_acc.set_ylim(0, 1)
    sim = report.get("simulated_acceptance_length")
    title = "Acceptance per draft position"
    if sim:
        title += f"\n(training eval simulated {sim:.2f}, measured {report['acceptance_length'] or 0:.2f})"
    ax_acc.set_title(title, fontsize=10)
    ax_acc.legend(fontsize=8)

    names = ["baseline", *methods]
    tps = [report["baseline"]["tokens_per_s"] or 0.0, *(m["tokens_per_s"] or 0.0 for m in methods.values())]
    bars = ax_tps.bar(names, tps, color=["grey", *[f"C{j}" for j in range(len(methods))]])
    for bar, name in zip(bars[1:], methods):
        sp = methods[name]["speedup"]
        ax_tps.annotate(
            f"{sp or 0:.2f}x",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    # In-process: batch 1; under SGLang: the concurrency level where the drafter does worst (aerie.bench.serving).
    level = report.get("concurrency")
    ax_tps.set_ylabel("tokens / s " + (f"(concurrency {level})" if level is not None else "(batch 1)"))
    ax_tps.set_title(f"Throughput on {report['device']}, {report['prompts']} prompts, same run", fontsize=10)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_sets(ax, sets: dict[str, Any]) -> None:
    """Grouped bars: acceptance length per set (groups) and drafter (bars), each bar labelled with its speedup."""
    names = list(sets)
    methods = list(next(iter(sets.values()))["methods"])
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        vals = [(sets[n]["methods"].get(m) or {}).get("acceptance_length") or 0.0 for n in names]
        bars = ax.bar(xs, vals, width=width, label=m, color=f"C{j}")
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
    """From an ``aerie.sglang-bench/4`` report: output tok/s per concurrency of every server, per set."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sets = sorted({r["set"] for r in report["rows"]})
    for j, name in enumerate(sets):
        rows = sorted((r for r in report["rows"] if r["set"] == name), key=lambda r: r["concurrency"])
        conc = [r["concurrency"] for r in rows]
        for k, mode in enumerate(report.get("modes") or ("baseline", "eagle3")):
            ys = [(r.get(mode) or {}).get("output_tokens_per_s") for r in rows]
            style = "--" if mode == "baseline" else ["-", ":", "-.", (0, (1, 1))][k % 4]
            ax.plot(conc, [y or 0.0 for y in ys], linestyle=style, marker="o", color=f"C{j}", label=f"{name} {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("SGLang: tokens/s per concurrency, without and with each drafter", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
