"""Benchmark: greedy vs. speculative decoding with a drafter, measured interleaved on the same machine."""

from aerie.bench.speculative import (
    EagleProposer,
    NgramProposer,
    Proposer,
    SpecResult,
    greedy_generate,
    speculative_generate,
)

__all__ = [
    "EagleProposer",
    "NgramProposer",
    "Proposer",
    "SpecResult",
    "greedy_generate",
    "speculative_generate",
]
