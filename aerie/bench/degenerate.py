"""Degenerate-output detection: repetition loops make speculative decoding look better than it is.

A target stuck in a loop ("the the the", a two-token cycle) is trivially predictable, so acceptance
length on such prompts says nothing about the drafter. The benchmarks flag those prompts and report
acceptance with and without them.

The one definition of a degenerate output in aerie: the in-process benchmark (:mod:`aerie.bench.run`) and the
SGLang serving harness (:mod:`aerie.bench.sglang_stats`) both call :func:`degenerate_flags`; keep its name and
the constants' names stable (other stages report loop rates with them).
"""

from __future__ import annotations

from collections.abc import Sequence

LOOP_WINDOW = 32  # tokens at the end of an output checked for a cycle
LOOP_MAX_PERIOD = 8  # longest cycle searched for
REPEAT_NGRAM = 4
REPEAT_RATE = 0.5  # share of repeated 4-grams above which an output counts as repetitive


def loop_period(ids: Sequence[int] | None, window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """Shortest period p <= max_period with which the last ``window`` ids repeat, else None."""
    if not ids or len(ids) < window + max_period:
        return None
    tail = list(ids[-(window + max_period) :])
    for p in range(1, max_period + 1):
        seg = tail[-(window + p) :]
        if all(seg[i] == seg[i + p] for i in range(len(seg) - p)):
            return p
    return None


def repeated_ngram_rate(ids: Sequence[int], n: int = REPEAT_NGRAM) -> float:
    """Share of the output's n-grams that already occurred earlier in it (0 for short outputs)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def degenerate_flags(ids: Sequence[int]) -> list[str]:
    """``loop`` (the output ends in a short cycle) and/or ``repetitive`` (mostly repeated 4-grams)."""
    flags = []
    if loop_period(ids) is not None:
        flags.append("loop")
    if repeated_ngram_rate(ids) > REPEAT_RATE:
        flags.append("repetitive")
    return flags
