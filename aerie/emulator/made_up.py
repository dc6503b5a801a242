"""Made-up answers (the mode without ``--upstream``): filler words, token counts, the reasoning/content split.

One word is one "token". Every draw comes from the request's own RNG (seeded from model, seed and messages),
so the same request always gets the same answer.
"""

from __future__ import annotations

import random
from typing import Any

from aerie.emulator.distributions import draw
from aerie.emulator.settings import EmulatorSettings


def _make_words(n: int = 2048) -> tuple[str, ...]:
    """Pronounceable filler words, built once at import (no per-request work)."""
    rng = random.Random(1234)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["the", "and", "of", "qu", "sh", "th"]
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3)))))
    return tuple(sorted(words))


WORDS = _make_words()


def words_in(content: Any) -> int:
    """Word count of a message's content: a string or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):
        return sum(len(str(p.get("text", "")).split()) for p in content if isinstance(p, dict))
    return 0


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The prompt's "tokens": its words, over every message."""
    return sum(words_in(m.get("content")) for m in messages)


def plan_tokens(s: EmulatorSettings, reasoning: Any, rng: random.Random, max_tokens: int) -> tuple[int, int, str]:
    """(reasoning tokens, content tokens, finish_reason) for a request with this ``reasoning`` field."""
    total = max(1, int(round(draw(rng, s.output_tokens_dist, s.output_tokens_mean))))
    empty = rng.random() < s.empty_rate
    frac = s.reasoning_fraction
    cap: int | None = None
    if isinstance(reasoning, dict):
        if reasoning.get("enabled") is False or reasoning.get("effort") == "none":
            frac = 0.0
        else:
            frac *= {"minimal": 0.25, "low": 0.5, "high": 1.5}.get(str(reasoning.get("effort")), 1.0)
            if isinstance(reasoning.get("max_tokens"), int):
                cap = reasoning["max_tokens"]
    frac = min(frac, 0.95)
    r = int(round(total * frac))
    if cap is not None:
        r = min(r, cap)
    c = 0 if empty else max(0, total - r)
    finish = "stop"
    if r + c > max_tokens:  # the model reasons first, so reasoning eats the budget first
        finish = "length"
        r = min(r, max_tokens)
        c = max_tokens - r
    return r, c, finish


def filler(rng: random.Random, n: int) -> str:
    """``n`` filler words drawn from the request's RNG."""
    return " ".join(rng.choices(WORDS, k=n))
