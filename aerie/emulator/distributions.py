"""The distributions an answer's length and a request's latency are drawn from, each with the asked-for mean."""

from __future__ import annotations

import math
import random

LATENCY_DISTS = ("fixed", "exponential", "lognormal", "uniform")
OUTPUT_DISTS = ("fixed", "exponential", "lognormal")


def draw(rng: random.Random, dist: str, mean: float) -> float:
    """One draw from ``dist`` with mean ``mean`` (0 when the mean is not positive, using no randomness)."""
    if mean <= 0:
        return 0.0
    if dist == "fixed":
        return mean
    if dist == "exponential":
        return rng.expovariate(1.0 / mean)
    if dist == "uniform":
        return rng.uniform(0.0, 2.0 * mean)
    sigma = 0.75  # lognormal with the requested mean: mu = ln(mean) - sigma^2 / 2
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
