"""Degenerate-output detection: repetition loops make speculative decoding look better than it is.

A target stuck in a loop ("the the the", a two-token cycle) is trivially predictable, so acceptance
length on such prompts says nothing about the drafter. The benchmarks flag those prompts and report
acceptance with and without them.

The one definition of a degenerate output in aerie: the in-process benchmark (:mod:`aerie.benchmark.run`) and the
SGLang serving harness (:mod:`aerie.benchmark.sglang_stats`) both call :func:`degenerate_flags`; keep its name and
the constants' names stable (other stages report loop rates with them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


def distinct_ngrams(ids: Sequence[int], n: int = REPEAT_NGRAM) -> int:
    """How many different n-grams ``ids`` holds (0 when it is shorter than ``n``).

    Exact, in C: each n-gram is packed into int64 columns (two ids < 2**31 per column, no hashing, so no
    collision can merge two n-grams), the columns are sorted together and the changes between neighbours
    counted. A Python set of tuples gives the same count ~4x slower (2-3 ms on a 3,500-token answer, paid on
    every record of the tokens stage); it is kept for ids outside [0, 2**31).
    """
    if n < 1:
        raise ValueError(f"n-gram length must be at least 1, not {n}")
    total = len(ids) - n + 1
    if total <= 0:
        return 0
    a = np.asarray(ids, dtype=np.int64)
    if a.ndim != 1 or int(a.min()) < 0 or int(a.max()) >= 1 << 31:
        return len(set(zip(*(list(ids[i:]) for i in range(n)))))
    cols = [(a[i : i + total] << 32) | a[i + 1 : i + 1 + total] for i in range(0, n - 1, 2)]
    if n % 2:
        cols.append(a[n - 1 : n - 1 + total])
    order = np.lexsort(cols[::-1])
    changed = np.zeros(total - 1, dtype=bool)
    for col in cols:
        s = col[order]
        changed |= s[1:] != s[:-1]
    return 1 + int(np.count_nonzero(changed))


def repeated_ngram_rate(ids: Sequence[int], n: int = REPEAT_NGRAM) -> float:
    """Share of the output's n-grams that already occurred earlier in it (0 for short outputs):
    1 - distinct n-grams / n-grams."""
    total = len(ids) - n + 1
    if total <= 0:
        return 0.0
    return 1.0 - distinct_ngrams(ids, n) / total


def degenerate_flags(ids: Sequence[int]) -> list[str]:
    """``loop`` (the output ends in a short cycle) and/or ``repetitive`` (mostly repeated 4-grams)."""
    flags = []
    if loop_period(ids) is not None:
        flags.append("loop")
    if repeated_ngram_rate(ids) > REPEAT_RATE:
        flags.append("repetitive")
    return flags
