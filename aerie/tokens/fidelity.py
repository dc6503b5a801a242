"""The tokens stage's fidelity report: what each shard kept, dropped and found, and providers that differ.

One job: counting. ``ShardReport`` gathers, per shard, the counts, a few examples per drop reason and
mismatch class, and per-provider rates, and writes them as the report (``aerie.tokens-report/4``,
docs/formats.md); ``provider_stats`` pools those rates over shards and ``provider_outliers`` names a
provider far from the others (with the config line that would exclude it).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aerie.formats.tokens import REPORT_FORMAT

MAX_EXAMPLES = 5  # per mismatch class / drop reason

# Why the text rebuild of a sample differs from the ids the model sampled (see classify_mismatch), plus
# ``template_normalised``: the template rendered the API's text changed (stripped, trimmed), so the trained
# text is the template's, not exactly what the provider returned.
MISMATCH_CLASSES = (
    "non_canonical",  # same text, other segmentation: the model sampled e.g. ' learn' + 'ing' for ' learning'
    "special_token_text",  # the model spelled a special token's text with ordinary pieces; re-encoding merges it
    "boundary_whitespace",  # whitespace around </think> lost between the model and the record
    "reasoning_missing",  # the model reasoned, the record has no reasoning
    "replacement_characters",  # U+FFFD in the text: bytes of a split multi-byte character were lost
    "template_normalised",  # the template strips/trims the API's text: the trained text is the template's
    "other",  # none of the above: a bug to look at (aerie's own code must never cause one)
)


def _percentile(sorted_values: list[int], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[k])


class _ProviderStats:
    """Per provider: what it returned, as rates the report and the outlier check compare."""

    def __init__(self) -> None:
        self.samples = 0
        self.kept = 0
        self.dropped = 0
        self.dropped_reasons: Counter[str] = Counter()
        self.no_reasoning = 0  # reasoning missing (null): stripped by the provider when it was requested
        self.reasoning_present = 0
        self.truncated = 0
        self.degenerate = 0
        self.mismatched = 0
        self.checked = 0
        self.lengths: list[int] = []

    def summary(self) -> dict[str, Any]:
        n, lengths = self.samples, sorted(self.lengths)
        rate = lambda k: round(k / n, 6) if n else None  # noqa: E731
        return {
            "samples": n,
            "kept": self.kept,
            "dropped": self.dropped,
            "dropped_reasons": dict(sorted(self.dropped_reasons.items())),
            "no_reasoning": self.no_reasoning,
            "generated_tokens_mean": round(statistics.fmean(lengths), 2) if lengths else None,
            "generated_tokens_p50": _percentile(lengths, 0.5),
            "generated_tokens_p90": _percentile(lengths, 0.9),
            "generated_tokens_p99": _percentile(lengths, 0.99),
            "reasoning_present_rate": rate(self.reasoning_present),
            "no_reasoning_rate": rate(self.no_reasoning),
            "truncation_rate": rate(self.truncated),
            "loop_rate": round(self.degenerate / self.checked, 6) if self.checked else None,
            "mismatch_rate": round(self.mismatched / self.checked, 6) if self.checked else None,
            "drop_rate": rate(self.dropped),
            "generated_tokens": lengths,
        }


class ShardReport:
    """Counts and a few examples per class, written as the shard's fidelity report."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.drop_examples: dict[str, list[str]] = defaultdict(list)
        self.refusal_messages: dict[str, str] = {}
        self.mismatch_classes: Counter[str] = Counter()
        self.mismatches: list[dict[str, Any]] = []
        self.usage_deltas: Counter[int] = Counter()
        self.prompt_mismatches: list[dict[str, Any]] = []
        self.usage_mismatches: list[dict[str, Any]] = []
        self.paths: Counter[str] = Counter()
        self.fallback_reasons: Counter[str] = Counter()  # why each path "fallback" record was framed that way
        # The stop token a finished turn got where the template writes none after it (aerie.tokens.rebuild.ADDED_*)
        self.added_turn_ends: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.special_text_examples: list[dict[str, Any]] = []
        self.providers: dict[str, _ProviderStats] = defaultdict(_ProviderStats)

    def drop(self, reason: str, sample_id: str, provider: str, message: str = "") -> None:
        self.dropped[reason] += 1
        self.providers[provider].dropped += 1
        self.providers[provider].dropped_reasons[reason] += 1
        if len(self.drop_examples[reason]) < MAX_EXAMPLES:
            self.drop_examples[reason].append(sample_id)
        if message and reason not in self.refusal_messages:
            self.refusal_messages[reason] = message

    def mismatch(self, cls: str, example: dict[str, Any]) -> None:
        self.mismatch_classes[cls] += 1
        if sum(m["class"] == cls for m in self.mismatches) < MAX_EXAMPLES:
            self.mismatches.append({"class": cls, **example})

    def as_dict(
        self, dataset: str, *, samples: int, kept: int, special_token_text_policy: str, missing_reasoning_policy: str
    ) -> dict[str, Any]:
        """The report as written next to the shard."""
        c = self.counts
        return {
            "format": REPORT_FORMAT,
            "dataset": dataset,
            "samples": samples,
            "kept": kept,
            "dropped": dict(self.dropped),
            "drop_examples": dict(self.drop_examples),
            "refusal_messages": self.refusal_messages,
            "rebuild_paths": {k: self.paths[k] for k in ("exact", "fallback", "refused")},
            "fallback_reasons": dict(self.fallback_reasons),
            "added_turn_ends": dict(self.added_turn_ends),
            "finish_reasons": dict(self.finish_reasons),
            "reasoning_present": c["reasoning_present"],
            "empty_reasoning": c["empty_reasoning"],
            "no_reasoning": c["no_reasoning"],
            "reasoning_requested": c["reasoning_requested"],
            "missing_reasoning_policy": missing_reasoning_policy,
            "special_token_text_policy": special_token_text_policy,
            "special_token_text": c["special_token_text"],
            "special_token_text_examples": self.special_text_examples,
            "degenerate": c["degenerate"],
            "tool_arguments_as_string": c["tool_arguments_as_string"],
            "truncated_to_max_seq_len": c["truncated_to_max_seq_len"],
            "multi_turn": c["multi_turn"],
            "tool_calls": c["tool_calls"],
            "exact_ids_available": c["exact_ids_available"],
            "retokenized_equal": c["retokenized_equal"],
            "mismatch_classes": {k: self.mismatch_classes[k] for k in MISMATCH_CLASSES},
            "mismatches": self.mismatches,
            "usage_length_checked": c["usage_length_checked"],
            "usage_length_equal": c["usage_length_equal"],
            "usage_length_deltas": {str(k): v for k, v in sorted(self.usage_deltas.items())},
            "usage_length_mismatches": self.usage_mismatches,
            "prompt_length_checked": c["prompt_length_checked"],
            "prompt_length_equal": c["prompt_length_equal"],
            "prompt_length_mismatches": self.prompt_mismatches,
            "prompt_tokens": c["prompt_tokens"],
            "generated_tokens": c["generated_tokens"],
            "providers": {p: s.summary() for p, s in sorted(self.providers.items())},
        }

    def log_summary(self, report: dict[str, Any], name: str, report_path: Path, log: Callable[[str], None]) -> None:
        """One line of what the shard kept and how exact its rebuild was, then a warning per anomaly."""
        c = self.counts
        classes = ", ".join(f"{k} {v}" for k, v in report["mismatch_classes"].items() if v) or "none"
        paths = report["rebuild_paths"]
        log(
            f"{name}: kept {report['kept']}/{report['samples']}, {c['generated_tokens']} generated tokens; "
            f"template rebuild exact {paths['exact']}, fallback {paths['fallback']}, refused {paths['refused']}; "
            f"text rebuild exact for {c['retokenized_equal']}/{c['exact_ids_available']} samples with exact ids "
            f"(mismatches: {classes}); rebuilt length = server's count for {c['usage_length_equal']}/"
            f"{c['usage_length_checked']}, prompt length for {c['prompt_length_equal']}/{c['prompt_length_checked']}"
        )
        if self.dropped:
            log(f"{name}: dropped " + ", ".join(f"{k} {v}" for k, v in self.dropped.most_common()))
        for o in provider_outliers(provider_stats([report])):
            log(
                f"WARNING {name}: provider {o['provider']} differs from the others ({'; '.join(o['reasons'])}); "
                f"to exclude it: {o['ignore']}"
            )
        if self.added_turn_ends["turn_end"]:
            log(
                f"NOTE {name}: the template writes no end after {self.added_turn_ends['turn_end']} finished turns "
                f"(e.g. reasoning with no answer): each ends with the template's turn end, a token the model stops on"
            )
        if self.mismatch_classes["other"]:
            log(
                f"WARNING {name}: {self.mismatch_classes['other']} unexplained rebuild mismatches (class 'other'); "
                f"see {report_path}"
            )
        if c["prompt_length_checked"] and c["prompt_length_equal"] < c["prompt_length_checked"]:
            log(
                f"WARNING {name}: the server counted a different prompt length for "
                f"{c['prompt_length_checked'] - c['prompt_length_equal']} samples: its system prompt or chat template "
                f"differs from the target's (examples in {report_path})"
            )


# ----------------------------------------------------------------------------------------------------------
# provider equivalence across shards (issue 12 item 7)

PROVIDER_RATES = (
    "reasoning_present_rate",
    "no_reasoning_rate",
    "truncation_rate",
    "loop_rate",
    "mismatch_rate",
    "drop_rate",
)
OUTLIER_RATE_GAP = 0.2  # a rate this far (absolute) from the other providers' median names the provider
OUTLIER_LENGTH_FACTOR = 2.0  # mean generated length this many times shorter or longer than the others'
OUTLIER_MIN_SAMPLES = 20  # fewer samples than this say nothing about a provider


def provider_stats(reports: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (dataset, provider): the ``providers`` entries of tokens reports pooled over shards."""
    pooled: dict[tuple[str, str], dict[str, Any]] = {}
    for rep in reports:
        for provider, s in (rep.get("providers") or {}).items():
            p = pooled.setdefault(
                (str(rep.get("dataset") or ""), provider),
                {
                    "samples": 0,
                    "kept": 0,
                    "dropped": 0,
                    "dropped_reasons": Counter(),
                    "no_reasoning": 0,
                    "lengths": [],
                    "weighted": Counter(),
                    "checked": 0,
                },
            )
            n = int(s.get("samples") or 0)
            p["samples"] += n
            p["kept"] += int(s.get("kept") or 0)
            p["dropped"] += int(s.get("dropped") or 0)
            p["dropped_reasons"].update({k: int(v) for k, v in (s.get("dropped_reasons") or {}).items()})
            p["no_reasoning"] += int(s.get("no_reasoning") or 0)
            p["lengths"] += list(s.get("generated_tokens") or [])
            for k in PROVIDER_RATES:  # rates pooled by their shard's sample count
                if s.get(k) is not None:
                    p["weighted"][k] += float(s[k]) * n
                    p["weighted"][k + "_n"] += n
    out = {}
    for key, p in pooled.items():
        lengths = sorted(p["lengths"])
        out[key] = {
            "samples": p["samples"],
            "kept": p["kept"],
            "dropped": p["dropped"],
            "dropped_reasons": dict(sorted(p["dropped_reasons"].items())),
            "no_reasoning": p["no_reasoning"],
            "generated_tokens_mean": round(statistics.fmean(lengths), 2) if lengths else None,
            "generated_tokens_p50": _percentile(lengths, 0.5),
            "generated_tokens_p90": _percentile(lengths, 0.9),
            "generated_tokens_p99": _percentile(lengths, 0.99),
            "generated_tokens": lengths,
            **{
                k: (round(p["weighted"][k] / p["weighted"][k + "_n"], 6) if p["weighted"][k + "_n"] else None)
                for k in PROVIDER_RATES
            },
        }
    return out


def provider_outliers(stats: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Providers whose rates are far from the median over all providers of the same dataset (with two
    providers both are named when they differ: nothing says which is right), with the config line that would
    exclude each (OpenRouter's provider routing, ``responses.provider``)."""
    out = []
    datasets = sorted({d for d, _ in stats})
    for d in datasets:
        rows = {p: s for (dd, p), s in stats.items() if dd == d and s["samples"] >= OUTLIER_MIN_SAMPLES}
        if len(rows) < 2:
            continue
        for p, s in sorted(rows.items()):
            others = list(rows.values())
            why = []
            for k in PROVIDER_RATES:
                vals = [o[k] for o in others if o[k] is not None]
                if s[k] is not None and vals and abs(s[k] - statistics.median(vals)) > OUTLIER_RATE_GAP:
                    name = k.removesuffix("_rate").replace("_", " ")
                    why.append(f"{name} {s[k]:.0%} vs {statistics.median(vals):.0%}")
            means = [o["generated_tokens_mean"] for o in others if o["generated_tokens_mean"]]
            m = s["generated_tokens_mean"]
            if m and means:
                ref = statistics.median(means)
                if m * OUTLIER_LENGTH_FACTOR < ref or m > ref * OUTLIER_LENGTH_FACTOR:
                    why.append(f"mean length {m:.0f} vs {ref:.0f} tokens")
            if why:
                out.append(
                    {"dataset": d, "provider": p, "reasons": why, "ignore": f'responses.provider: {{ignore: ["{p}"]}}'}
                )
    return out
