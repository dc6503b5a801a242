"""The one definition of a degenerate output (aerie.tools.degenerate), as the tokens stage and the benchmarks
run it: the fast n-gram count must give exactly what the plain definition gives, on every kind of input."""

from __future__ import annotations

import random

import numpy as np
import pytest

from aerie.tools.degenerate import REPEAT_NGRAM, REPEAT_RATE, degenerate_flags, distinct_ngrams, repeated_ngram_rate


def reference_rate(ids: list[int], n: int) -> float:
    """The definition written plainly: the share of n-grams that already occurred earlier in the output."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    seen, repeated = set(), 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams)


def cases() -> list[list[int]]:
    rng = random.Random(13)
    out: list[list[int]] = [[], [0], [1, 2], [1, 2, 3], [1, 2, 3, 4], [7] * 4, [7] * 5, [5] * 10, [0] * 50]
    out += [[(1 << 31) - 1, 0] * 6, [0, (1 << 31) - 1, 0, (1 << 31) - 1, 1]]  # the packing's largest id
    # n-grams that agree on the packed first pair but not the second, and vice versa
    out += [[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 2, 3, 4]]
    for _ in range(300):
        length = rng.choice([rng.randrange(0, 12), rng.randrange(12, 200), rng.randrange(200, 3000)])
        vocab = rng.choice([2, 3, 5, 50, 160_000, 1 << 31])
        seq = [rng.randrange(vocab) for _ in range(length)]
        if seq and rng.random() < 0.4:  # a loop at the end, as a stuck model writes
            period = rng.randrange(1, 9)
            seq += seq[-period:] * rng.randrange(1, 60)
        out.append(seq)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, REPEAT_NGRAM, 5, 7])
def test_fast_ngram_count_equals_the_plain_definition(n: int) -> None:
    for ids in cases():
        want = reference_rate(ids, n)
        assert repeated_ngram_rate(ids, n) == pytest.approx(want, abs=1e-12), (n, ids[:20])
        assert distinct_ngrams(ids, n) == len({tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)})
        # other sequence types the harnesses pass: tuples, numpy arrays
        assert repeated_ngram_rate(tuple(ids), n) == repeated_ngram_rate(np.array(ids, dtype=np.int64), n)


def test_ids_outside_the_packing_range_still_count_exactly() -> None:
    ids = [-1, 1 << 40, -1, 1 << 40, -1, 1 << 40, 3]
    assert repeated_ngram_rate(ids) == pytest.approx(reference_rate(ids, REPEAT_NGRAM))
    with pytest.raises(ValueError, match="at least 1"):
        distinct_ngrams([1, 2], 0)


def test_the_flag_is_the_rate_above_the_threshold() -> None:
    rng = random.Random(5)
    for ids in cases():
        ids = ids + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        assert ("repetitive" in degenerate_flags(ids)) == (reference_rate(ids, REPEAT_NGRAM) > REPEAT_RATE)
