"""Figures for the Snakemake HTML report (``snakemake --report``), read from the finished artifacts.

Each ``figure_*`` function reads small things only (JSONL records, JSON reports, safetensors metadata
and a few sampled rows of the hidden states, never a whole tensor) and writes one PNG. A figure whose
data is absent says so in the image instead of failing: the in-process demo has no API spend, and the
SGLang serving benchmark only exists once it was run on a GPU host.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.api.money import SpendStory, spend_story
from aerie.artifacts import iter_jsonl

FIGURES = ("spend", "lengths", "quality", "hidden", "training", "benchmark")
HIDDEN_SAMPLE_ROWS = 256  # rows of each hidden shard read for the norm statistics (4 slices of 64)


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # no display on build machines and cluster nodes
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    _plt().close(fig)


def _note(ax, text: str) -> None:
    """An empty panel that says why it is empty."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=11, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _dataset_of(path: Path) -> str:
    # results/{dataset}/{stage}/shard-NNNNN.ext
    return Path(path).parent.parent.name


def load_responses(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every record of the responses shards, reduced to the fields the figures use."""
    rows = []
    for path in paths:
        for _, r in iter_jsonl(path):
            usage = r.get("usage") or {}
            completion = usage.get("completion_tokens")
            if completion is None and r.get("output_token_ids") is not None:
                completion = len(r["output_token_ids"])
            details = usage.get("completion_tokens_details") or {}
            cost = r.get("cost")
            if cost is None:
                cost = usage.get("cost")
            rows.append(
                {
                    "dataset": r.get("dataset") or _dataset_of(Path(path)),
                    "backend": r.get("backend"),
                    "provider": r.get("provider") or r.get("backend") or "unknown",
                    "cost": float(cost) if cost is not None else None,
                    "completion_tokens": completion,
                    "reasoning_chars": len(r["reasoning"]) if r.get("reasoning") else 0,
                    "reasoning_tokens": details.get("reasoning_tokens"),
                    "finish_reason": r.get("finish_reason"),
                    "flags": list(r.get("flags") or []),
                    "has_content": bool(r.get("content")) or bool(r.get("tool_calls")),
                }
            )
    return rows


def load_quotas(paths: Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Per dataset, from the completion records beside API responses shards (aerie.responses-completion/1):
    prompts, samples kept, prompts not requested because the output-token quota was reached, the quota."""
    from aerie.formats.responses import read_completion

    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        rec = read_completion(path)
        if rec is None:
            continue  # in-process shards have none: every prompt was answered
        d = out.setdefault(
            _dataset_of(Path(path)),
            {
                "prompts": 0,
                "samples": 0,
                "not_requested": 0,
                "max_output_tokens": rec.get("max_output_tokens"),
                "quota_reached": False,
            },
        )
        d["prompts"] += rec["prompts"]
        d["samples"] += rec["samples"]
        d["not_requested"] += rec["not_requested"]
        d["quota_reached"] |= rec.get("reason") == "max_output_tokens"
    return out


def figure_spend(
    records: list[dict[str, Any]],
    out: Path,
    quotas: dict[str, dict[str, Any]] | None = None,
    story: SpendStory | None = None,
) -> dict[str, Any]:
    """USD per dataset: journaled, stacked by provider, then what the account billed beyond the journals (billed
    retries, lost to interrupted requests; aerie.api.money.spend_story), so the bars add up to the account; the title
    compares the total with it. Responses per dataset and backend beside it, each bar marked with the share of its
    prompts answered when the dataset's output-token quota cut it. Without a ``story``: the records' costs."""
    from aerie.api.money import LOST, PENDING, RETRIES, UNATTRIBUTED

    plt = _plt()
    counts: dict[str, Counter] = defaultdict(Counter)
    from_records: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        counts[r["dataset"]][r["backend"]] += 1
        if r["cost"] is not None:
            from_records[r["dataset"]][r["provider"]] += r["cost"]
    if story is None:
        story = SpendStory({d: dict(c) for d, c in from_records.items()}, {})
    total = story.total
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    datasets = sorted(set(counts) | set(story.journaled) | set(story.billed))
    if total > 0 or story.pending > 0:
        bars = datasets + (["(no request)"] if story.unattributed > 0 else [])
        providers = sorted({p for c in story.journaled.values() for p in c})
        bottom = [0.0] * len(bars)

        def stack(vals: list[float], **style: Any) -> None:
            nonlocal bottom
            ax.bar(bars, vals, bottom=bottom, **style)
            bottom = [b + v for b, v in zip(bottom, vals)]

        for p in providers:
            stack(
                [story.journaled.get(d, {}).get(p, 0.0) for d in datasets] + [0.0] * (len(bars) - len(datasets)),
                label=p,
            )
        billed = [story.billed.get(d) for d in datasets]
        for field, name, color, hatch in (("retries", RETRIES, "0.75", "//"), ("lost", LOST, "salmon", "xx")):
            vals = [getattr(u, field) if u is not None else 0.0 for u in billed] + [0.0] * (len(bars) - len(datasets))
            if any(vals):
                stack(vals, label=name, color=color, hatch=hatch, edgecolor="0.3")
        if story.unattributed > 0:
            stack(
                [0.0] * len(datasets) + [story.unattributed],
                label=UNATTRIBUTED,
                color="0.9",
                hatch="..",
                edgecolor="0.3",
            )
        for i, b in enumerate(bottom):
            ax.annotate(f"${b:.4g}", (i, b), ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("USD")
        ax.legend(fontsize=7)
        title = f"API spend ${total:.4g}: ${story.journaled_usd:.4g} journaled"
        extra = total - story.journaled_usd
        title += f" + ${extra:.4g} billed beyond the journals" if extra > 0 else ""
        if story.account is not None:
            title += f"\n= the account: ${story.account:.4g} ({story.source})"
        else:
            title += f"\n({story.source})"
        if story.pending > 0:
            title += f"; ${story.pending:.4g} {PENDING}"
        ax.set_title(title, fontsize=9)
    else:
        api = any(r["backend"] not in ("hf", None) for r in records)
        _note(
            ax,
            "no API spend (in-process generation)"
            if not api
            else "no API spend (in-process generation or self-hosted server: cost 0)",
        )
        ax.set_title("API spend per dataset and provider")
    if counts:
        shown = sorted(counts)
        backends = sorted({b for c in counts.values() for b in c}, key=str)
        bottom2 = [0] * len(shown)
        for b in backends:
            vals = [counts[d][b] for d in shown]
            ax2.bar(shown, vals, bottom=bottom2, label=str(b))
            bottom2 = [x + v for x, v in zip(bottom2, vals)]
        for i, d in enumerate(shown):
            q = (quotas or {}).get(d)
            if q and q["quota_reached"]:
                ax2.annotate(
                    f"quota {q['max_output_tokens']:,} tokens:\n{q['samples']:,} of {q['prompts']:,} prompts",
                    (i, bottom2[i]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax2.legend(title="backend", fontsize=8)
        ax2.set_ylabel("responses")
    else:
        _note(ax2, "no responses")
    ax2.set_title("responses per dataset and backend")
    _save(fig, out)
    return {
        "total_usd": total,
        "journaled_usd": story.journaled_usd,
        "billed_retries_usd": sum(u.retries for u in story.billed.values()),
        "lost_usd": sum(u.lost for u in story.billed.values()),
        "unattributed_usd": story.unattributed,
        "pending_usd": story.pending,
        "account_usd": story.account,
        "account_source": story.source,
        "by_dataset": story.journaled,
        "billed_by_dataset": {d: {"billed_retries": u.retries, "lost": u.lost} for d, u in story.billed.items()},
        "quotas": quotas or {},
    }


def figure_lengths(records: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Histograms of response length (tokens) and reasoning length per dataset."""
    plt = _plt()
    datasets = sorted({r["dataset"] for r in records})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = {
        d: [r["completion_tokens"] for r in records if r["dataset"] == d and r["completion_tokens"] is not None]
        for d in datasets
    }
    if any(lengths.values()):
        ax.hist([lengths[d] for d in datasets], bins=30, label=datasets, histtype="barstacked")
        ax.legend(fontsize=8)
        ax.set_xlabel("completion tokens per response")
        ax.set_ylabel("responses")
    else:
        _note(ax, "no response lengths recorded")
    ax.set_title("response length")
    with_reasoning = [r for r in records if r["reasoning_chars"] or r["reasoning_tokens"]]
    use_tokens = bool(with_reasoning) and all(r["reasoning_tokens"] is not None for r in with_reasoning)
    key, unit = ("reasoning_tokens", "tokens") if use_tokens else ("reasoning_chars", "characters")
    reasoning = {d: [r[key] or 0 for r in records if r["dataset"] == d] for d in datasets}
    if with_reasoning:
        ax2.hist([reasoning[d] for d in datasets], bins=30, label=datasets, histtype="barstacked")
        ax2.legend(fontsize=8)
        ax2.set_xlabel(f"reasoning length ({unit}; 0 = none)")
        ax2.set_ylabel("responses")
    else:
        _note(ax2, "no reasoning in any response")
    ax2.set_title("reasoning length")
    _save(fig, out)
    return {"reasoning_unit": unit}


def _rate(num: int, den: int) -> float:
    return num / den if den else float("nan")


def figure_quality(records: list[dict[str, Any]], token_reports: Sequence[str | Path], out: Path) -> dict[str, Any]:
    """Truncation and flag rates per dataset (responses), and tokenization fidelity rates (tokens reports)."""
    plt = _plt()
    import numpy as np

    datasets = sorted({r["dataset"] for r in records} | {_dataset_of(Path(p)) for p in token_reports})
    resp: dict[str, dict[str, float]] = {}
    for d in datasets:
        rs = [r for r in records if r["dataset"] == d]
        n = len(rs)
        resp[d] = {
            "truncated": _rate(sum(r["finish_reason"] == "length" for r in rs), n),
            "empty": _rate(sum("empty" in r["flags"] or not r["has_content"] for r in rs), n),
            "no_reasoning": _rate(sum("no_reasoning" in r["flags"] for r in rs), n),
        }
    from aerie.tokens.fidelity import provider_outliers, provider_stats

    sums: dict[str, Counter] = defaultdict(Counter)
    reports = []
    for p in token_reports:
        rep = json.loads(Path(p).read_text())
        rep.setdefault("dataset", _dataset_of(Path(p)))
        reports.append(rep)
        c = sums[_dataset_of(Path(p))]
        for k in (
            "samples",
            "kept",
            "exact_ids_available",
            "retokenized_equal",
            "usage_length_checked",
            "usage_length_equal",
            "prompt_length_checked",
            "prompt_length_equal",
            "special_token_text",
            "degenerate",
            "empty_reasoning",
            "no_reasoning",
        ):
            c[k] += int(rep.get(k) or 0)
        c["refused"] += int((rep.get("rebuild_paths") or {}).get("refused") or 0)
        c["no_reasoning_dropped"] += int((rep.get("dropped") or {}).get("no_reasoning") or 0)
        c["normalised"] += int((rep.get("mismatch_classes") or {}).get("template_normalised") or 0)
    fid = {
        d: {
            "retokenized equal / exact ids": _rate(sums[d]["retokenized_equal"], sums[d]["exact_ids_available"]),
            "usage length equal / checked": _rate(sums[d]["usage_length_equal"], sums[d]["usage_length_checked"]),
            "prompt length equal / checked": _rate(sums[d]["prompt_length_equal"], sums[d]["prompt_length_checked"]),
            "kept / samples": _rate(sums[d]["kept"], sums[d]["samples"]),
            # every anomaly the tokens stage decided on, as a share of the samples
            "template refused": _rate(sums[d]["refused"], sums[d]["samples"]),
            "text normalised by template": _rate(sums[d]["normalised"], sums[d]["samples"]),
            "special-token text": _rate(sums[d]["special_token_text"], sums[d]["samples"]),
            "degenerate (loop)": _rate(sums[d]["degenerate"], sums[d]["samples"]),
            "empty reasoning": _rate(sums[d]["empty_reasoning"], sums[d]["samples"]),
            "no reasoning": _rate(sums[d]["no_reasoning"], sums[d]["samples"]),
            # requested but missing (null): the provider stripped it; per provider in the panel below
            "no reasoning, dropped": _rate(sums[d]["no_reasoning_dropped"], sums[d]["samples"]),
        }
        for d in datasets
    }
    providers = provider_stats(reports)
    outliers = provider_outliers(providers)

    fig, axes = plt.subplots(2, 2, figsize=(14, 8.4))
    (ax, ax2), (ax3, ax4) = axes
    _figure_providers(ax3, ax4, providers, outliers)
    for axis, table, title in (
        (ax, resp, "truncation and flag rates (responses)"),
        (ax2, fid, "tokenization fidelity and anomalies (tokens reports)"),
    ):
        if not datasets:
            _note(axis, "no data")
            axis.set_title(title)
            continue
        names = list(next(iter(table.values())).keys())
        x = np.arange(len(datasets))
        w = 0.8 / len(names)
        for j, name in enumerate(names):
            vals = [table[d][name] for d in datasets]
            bars = axis.bar(x + (j - (len(names) - 1) / 2) * w, [0 if v != v else v for v in vals], w, label=name)
            for b, v in zip(bars, vals):
                axis.annotate(
                    "n/a" if v != v else f"{v:.0%}",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        axis.set_xticks(x, datasets)
        axis.set_ylim(0, 1.15)
        axis.set_ylabel("fraction of samples")
        axis.legend(fontsize=7, loc="upper left")
        axis.set_title(title)
    _save(fig, out)
    summary_providers = {
        f"{d}/{p}": {k: v for k, v in s.items() if k != "generated_tokens"} for (d, p), s in providers.items()
    }
    return {"responses": resp, "fidelity": fid, "providers": summary_providers, "provider_outliers": outliers}


def _figure_providers(
    ax, ax2, providers: dict[tuple[str, str], dict[str, Any]], outliers: list[dict[str, Any]]
) -> None:
    """Per dataset and provider: the tokens reports' rates, and generated-length percentiles (issue 12 item 7)."""
    import numpy as np

    from aerie.tokens.fidelity import PROVIDER_RATES

    keys = sorted(providers)
    title = "per provider (tokens reports)"
    if not keys:
        for a in (ax, ax2):
            _note(a, "no provider figures in the tokens reports")
        ax.set_title(title)
        return
    named = {(o["dataset"], o["provider"]) for o in outliers}
    # missing reasoning dropped (requested, returned null: the provider stripped it), counted under each provider
    stripped = {k: (providers[k].get("dropped_reasons") or {}).get("no_reasoning", 0) for k in keys}
    labels = [
        f"{d}/{p}"
        + (" (outlier)" if (d, p) in named else "")
        + (f"\n{stripped[(d, p)]} dropped: no reasoning" if stripped[(d, p)] else "")
        for d, p in keys
    ]
    x = np.arange(len(keys))
    w = 0.8 / len(PROVIDER_RATES)
    for j, k in enumerate(PROVIDER_RATES):
        vals = [providers[key][k] for key in keys]
        ax.bar(
            x + (j - (len(PROVIDER_RATES) - 1) / 2) * w,
            [v or 0 for v in vals],
            w,
            label=k.removesuffix("_rate").replace("_", " "),
        )
    ax.set_xticks(x, labels, rotation=20, fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("fraction of the provider's samples")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title + (f"; outliers: {', '.join(sorted(p for _, p in named))}" if named else ""))
    data = [providers[key]["generated_tokens"] or [0] for key in keys]
    ax2.boxplot(data, whis=(1, 99), showfliers=False)
    ax2.plot(x + 1, [providers[key]["generated_tokens_mean"] or 0 for key in keys], "D", color="tab:red", label="mean")
    ax2.set_xticks(x + 1, labels, rotation=20, fontsize=8)
    ax2.set_ylabel("generated tokens per kept sample (p1..p99)")
    ax2.legend(fontsize=7)
    ax2.set_title("generated length per provider")


def hidden_shard_stats(path: str | Path, sample_rows: int = HIDDEN_SAMPLE_ROWS) -> dict[str, Any]:
    """Metadata and per-layer RMS norms of a few sampled rows of one hidden shard (never the whole tensor)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
        meta = {}
        for k, v in raw.items():
            try:
                meta[k] = json.loads(v)
            except json.JSONDecodeError:
                meta[k] = v
        names = set(f.keys())
        aux_s = f.get_slice("aux_hidden_states")
        fin_s = f.get_slice("final_hidden_states") if "final_hidden_states" in names else None  # compact: none
        rows = aux_s.get_shape()[0]
        hidden = int(meta.get("hidden_size") or fin_s.get_shape()[1])
        chunk = max(1, sample_rows // 4)
        starts = sorted({min(max(rows - chunk, 0), int(rows * q)) for q in (0.0, 0.25, 0.5, 0.75)}) if rows else []
        if "aux_scales" in names:  # compact layout: float8 values times their per-(token, layer) scale
            from aerie.formats.hidden import dequantize_aux

            sc_s = f.get_slice("aux_scales")
            aux = [dequantize_aux(aux_s[s : s + chunk], sc_s[s : s + chunk]) for s in starts]
        else:
            aux = [aux_s[s : s + chunk] for s in starts]
        fin = [fin_s[s : s + chunk] for s in starts] if fin_s is not None else []
        seqs = f.get_slice("seq_offsets").get_shape()[0] - 1
    layer_ids = list(meta.get("aux_layer_ids") or [])
    norms: dict[str, list[float]] = {}
    if aux:
        a = torch.cat(aux).float().reshape(-1, len(layer_ids) or 1, hidden)
        for j, lid in enumerate(layer_ids or [0]):
            norms[f"aux layer {lid}"] = a[:, j].pow(2).mean(-1).sqrt().tolist()
        if fin:
            norms["final (normed)"] = torch.cat(fin).float().pow(2).mean(-1).sqrt().tolist()
    agreement = meta.get("next_token_agreement")
    return {
        "tokens": rows,
        "sequences": seqs,
        "hidden_size": hidden,
        "aux_layer_ids": layer_ids,
        "next_token_agreement": float(agreement) if agreement is not None else None,
        "rms": norms,
    }


def figure_hidden(hidden_shards: Sequence[str | Path], out: Path) -> dict[str, Any]:
    """Per shard: tokens and the final state's next-token agreement; per layer: RMS of sampled rows."""
    plt = _plt()
    stats = [(Path(p), hidden_shard_stats(p)) for p in hidden_shards]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    if not stats:
        _note(ax, "no hidden shards")
        _note(ax2, "no hidden shards")
        _save(fig, out)
        return {}
    labels = [f"{_dataset_of(p)}/{p.stem.replace('shard-', '')}" for p, _ in stats]
    agree = [s["next_token_agreement"] if s["next_token_agreement"] is not None else float("nan") for _, s in stats]
    bars = ax.bar(labels, [0 if a != a else a for a in agree], color="tab:green")
    for b, (_, s), a in zip(bars, stats, agree):
        ax.annotate(
            ("n/a" if a != a else f"{a:.1%}") + f"\n{s['tokens']} tok",
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("next-token agreement")
    ax.set_title("lm_head(final state) reproduces the recorded next token")
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    pooled: dict[str, list[float]] = defaultdict(list)
    for _, s in stats:
        for k, v in s["rms"].items():
            pooled[k].extend(v)
    names = list(pooled)
    ax2.boxplot([pooled[k] for k in names], showfliers=False)
    ax2.set_xticks(range(1, len(names) + 1), names, fontsize=8)
    ax2.set_yscale("log")
    ax2.set_ylabel("RMS of the hidden vector")
    ax2.set_title(f"per-layer RMS ({sum(len(v) for v in pooled.values()) // max(len(names), 1)} sampled tokens)")
    _save(fig, out)
    return {"shards": len(stats), "tokens": sum(s["tokens"] for _, s in stats)}


def figure_training(drafter_dir: str | Path, out: Path) -> dict[str, Any]:
    """Training loss per optimizer step (held-out loss per evaluation), and acceptance per draft position."""
    plt = _plt()
    drafter_dir = Path(drafter_dir)
    steps, losses, evals = [], [], []
    log_path = drafter_dir / "train_log.jsonl"
    if log_path.exists():
        for _, e in iter_jsonl(log_path):
            if e.get("event") == "eval" or ("heldout_loss" in e and "loss" not in e):
                evals.append(e)
            elif "step" in e and "loss" in e:
                steps.append(e["step"])
                losses.append(e["loss"])
    ev = json.loads((drafter_dir / "eval.json").read_text()) if (drafter_dir / "eval.json").exists() else {}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    if steps:
        ax.plot(steps, losses, lw=1, label="training loss (sum over TTT steps)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.set_title("drafter training loss")
        if evals:
            # Held-out losses on the same axis, at each epoch's last step (epoch 0: before training).
            per_epoch = max(steps) / max(1, max(int(e.get("epoch", 0)) for e in evals))
            ax.plot(
                [int(e.get("epoch", 0)) * per_epoch for e in evals],
                [e["heldout_loss"] for e in evals],
                "o--",
                color="tab:red",
                label="held-out loss (per epoch; 0 = untrained)",
            )
        ax.legend(fontsize=8)
    else:
        _note(ax, "no train_log.jsonl steps")
        ax.set_title("drafter training loss")
    acc = ev.get("acceptance_per_position") or []
    if acc:
        pos = list(range(1, len(acc) + 1))
        ax2.plot(
            pos,
            acc,
            "o-",
            label=f"trained (simulated acceptance length {ev.get('simulated_acceptance_length', 0):.2f})",
        )
        un = (ev.get("untrained") or {}).get("acceptance_per_position")
        if un:
            ax2.plot(pos[: len(un)], un, "x--", color="gray", label="untrained")
        ax2.set_xticks(pos)
        ax2.set_ylim(0, 1.05)
        ax2.set_xlabel("draft position")
        ax2.set_ylabel("fraction accepted (held out)")
        ax2.legend(fontsize=8)
    else:
        _note(ax2, "no eval.json acceptance")
    ax2.set_title("acceptance per position (held-out, greedy verification)")
    _save(fig, out)
    return {"steps": len(steps), "acceptance_per_position": acc}


def figure_benchmark(bench_json: str | Path, out: Path, sglang_json: str | Path | None = None) -> dict[str, Any]:
    """In-process tok/s per method with speedups (batch 1); SGLang tok/s and speedup per concurrency."""
    plt = _plt()
    bench = json.loads(Path(bench_json).read_text())
    methods = bench.get("methods") or {"eagle3": {**bench["speculative"], "speedup": bench["speedup"]}}
    names = ["baseline", *methods]
    tps = [bench["baseline"]["tokens_per_s"], *(m["tokens_per_s"] for m in methods.values())]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    bars = ax.bar(names, tps, color=["gray"] + ["tab:blue"] * len(methods))
    for b, name in zip(bars, names):
        label = "1.00x" if name == "baseline" else f"{methods[name]['speedup']:.2f}x"
        ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tokens/s")
    # bench.backend sglang: the figures of the concurrency level where the drafter does worst (aerie.bench.serving)
    where = (
        f"SGLang serving at concurrency {bench['concurrency']}"
        if bench.get("backend") == "sglang"
        else "in-process benchmark: concurrency 1, batch 1"
    )
    ax.set_title(f"{where} ({bench.get('prompts')} prompts, {bench.get('device', '?')})", fontsize=10)
    summary: dict[str, Any] = {"speedup": bench.get("speedup")}
    sg = json.loads(Path(sglang_json).read_text()) if sglang_json and Path(sglang_json).exists() else None
    # The SGLang backend keeps the serving summary in the bench report itself.
    rows = ((sg or {}).get("summary") or bench.get("serving_summary") or {}).get("by_concurrency") or []
    if rows:
        conc = [r["concurrency"] for r in rows]
        ax2.plot(conc, [r["baseline_output_tokens_per_s"] or 0 for r in rows], "o-", color="gray", label="baseline")
        ax2.plot(conc, [r["eagle3_output_tokens_per_s"] or 0 for r in rows], "o-", color="tab:blue", label="EAGLE-3")
        for c, r in zip(conc, rows):
            if r.get("speedup"):
                ax2.annotate(
                    f"{r['speedup']:.2f}x",
                    (c, r["eagle3_output_tokens_per_s"]),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(conc, [str(c) for c in conc])
        ax2.set_xlabel("concurrent requests")
        ax2.set_ylabel("output tokens/s (server)")
        ax2.legend(fontsize=8)
        summary["sglang_speedup"] = {r["concurrency"]: r.get("speedup") for r in rows}
    else:
        _note(
            ax2,
            "no SGLang serving benchmark\n(results/bench/{run}.sglang.json,\n"
            "written by aerie.bench.sglang_harness on a GPU host)",
        )
    ax2.set_title("SGLang serving: tok/s and speedup per concurrency", fontsize=10)
    _save(fig, out)
    return summary


def write_figures(
    outputs: dict[str, str | Path],
    *,
    responses: Sequence[str | Path],
    token_reports: Sequence[str | Path],
    hidden: Sequence[str | Path],
    drafter: str | Path,
    bench: str | Path,
    sglang: str | Path | None = None,
) -> dict[str, Any]:
    """Write every figure in :data:`FIGURES` to ``outputs[name]``; return the figures' summaries."""
    missing = set(FIGURES) - set(outputs)
    if missing:
        raise ValueError(f"no output path for figures {sorted(missing)}")
    records = load_responses(responses)
    return {
        "spend": figure_spend(records, Path(outputs["spend"]), load_quotas(responses), spend_story(list(responses))),
        "lengths": figure_lengths(records, Path(outputs["lengths"])),
        "quality": figure_quality(records, token_reports, Path(outputs["quality"])),
        "hidden": figure_hidden(hidden, Path(outputs["hidden"])),
        "training": figure_training(drafter, Path(outputs["training"])),
        "benchmark": figure_benchmark(bench, Path(outputs["benchmark"]), sglang),
    }
