"""Is a gap beyond the spread? A paired t-test on per-seed differences, with no scipy.

Two arms trained at the same seed share the held-out split, the initial draw and the batch order, so their
difference at that seed is one paired observation; the test asks whether the mean of those differences is
zero. The two-sided p-value of Student's t with ``df`` degrees of freedom is the regularized incomplete beta
function ``I_x(df/2, 1/2)`` at ``x = df / (df + t^2)``, computed here by its continued fraction (modified
Lentz). The 95 % interval of the mean difference uses the t quantile found by bisection on that function.

With 5 seeds an exact sign-flip permutation test cannot go below p = 2/32 = 0.0625, so it could never call a
gap significant at 0.05; the t-test assumes roughly normal per-seed differences instead. Both are reported, with
the sign count (how many seeds are above, below, tied): a t-test p < 0.05 with seeds on both sides rests on the
normality assumption, not on the seeds agreeing.
"""

from __future__ import annotations

import itertools
import math
import statistics


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (converges fast for x < (a + 1) / (a + b + 2))."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even term
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),  # odd term
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return h


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)`` for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The t value with P(T <= t) = p (0.5 < p < 1), by bisection on ``t_two_sided_p``."""
    tail = 2.0 * (1.0 - p)  # the two-sided p of the wanted t
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > tail:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_two_sided_p(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided sign-flip permutation p of the mean difference (every sign pattern, 2^n of them)."""
    observed = abs(sum(diffs))
    patterns = list(itertools.product((1, -1), repeat=len(diffs)))
    extreme = sum(1 for signs in patterns if abs(sum(s * d for s, d in zip(signs, diffs))) >= observed - 1e-12)
    return extreme / len(patterns)


def sign_count(diffs: list[float], tie: float = 1e-12) -> tuple[int, int, int]:
    """(seeds above, below, tied): how many per-seed differences are > 0, < 0 and 0 (within ``tie``)."""
    above = sum(1 for d in diffs if d > tie)
    below = sum(1 for d in diffs if d < -tie)
    return above, below, len(diffs) - above - below


def paired_test(a: list[float], b: list[float]) -> dict:
    """``a - b`` paired by position (seed): n, mean difference, its stdev, the 95 % interval, the t statistic
    and two-sided p (paired t-test), the exact sign-flip p and the sign count (above, below, tied)."""
    if len(a) != len(b):
        raise ValueError(f"paired test needs the same seeds on both sides, got {len(a)} and {len(b)} values")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else float("nan")
    out = {"n": n, "mean_diff": mean, "sd_diff": float("nan"), "t": float("nan"), "p": float("nan")}
    out.update(ci95=(float("nan"), float("nan")), sign_flip_p=sign_flip_p(diffs) if n else float("nan"))
    out["signs"] = sign_count(diffs)
    if n < 2:
        return out
    sd = statistics.stdev(diffs)
    out["sd_diff"] = sd
    if sd == 0.0:  # every seed moved by exactly the same amount
        out.update(t=0.0 if mean == 0 else math.copysign(math.inf, mean), p=1.0 if mean == 0 else 0.0)
        out["ci95"] = (mean, mean)
        return out
    se = sd / math.sqrt(n)
    t = mean / se
    half = t_quantile(0.975, n - 1) * se
    out.update(t=t, p=t_two_sided_p(t, n - 1), ci95=(mean - half, mean + half))
    return out
