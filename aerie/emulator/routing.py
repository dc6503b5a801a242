"""Provider routing: which fake provider a chat request goes to, after the request's ``provider`` preferences.

OpenRouter's rules as far as they matter to a client: ``only`` / ``ignore`` / ``quantizations`` / ``max_price``
filter, ``order`` ranks (falling back to the cheapest unless ``allow_fallbacks`` is false), ``sort: price``
picks the cheapest; otherwise price-weighted load balancing (weight 1/price^2), drawn from the request's own
RNG so the same request always lands on the same provider. None: no provider is left (a 503 for the client).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from aerie.emulator.settings import FakeProvider


def _names(p: FakeProvider) -> set[str]:
    return {p.slug, p.tag}


def _price(p: FakeProvider) -> tuple[float, float]:
    return (p.completion_price, p.prompt_price)


def route(providers: Sequence[FakeProvider], prefs: Any, rng: random.Random) -> FakeProvider | None:
    """The provider this request goes to, or None when the preferences leave none."""
    prefs = prefs if isinstance(prefs, dict) else {}
    cands = list(providers)
    if prefs.get("only"):
        only = {str(x).lower() for x in prefs["only"]}
        cands = [p for p in cands if _names(p) & only]
    if prefs.get("ignore"):
        ignore = {str(x).lower() for x in prefs["ignore"]}
        cands = [p for p in cands if not _names(p) & ignore]
    if prefs.get("quantizations"):
        quants = {str(x).lower() for x in prefs["quantizations"]}
        cands = [p for p in cands if p.quantization.lower() in quants]
    max_price = prefs.get("max_price")
    if isinstance(max_price, dict):  # USD per million tokens, as in OpenRouter's request field
        if max_price.get("prompt") is not None:
            cands = [p for p in cands if p.prompt_price * 1e6 <= float(max_price["prompt"]) + 1e-12]
        if max_price.get("completion") is not None:
            cands = [p for p in cands if p.completion_price * 1e6 <= float(max_price["completion"]) + 1e-12]
    if not cands:
        return None

    order = [str(x).lower() for x in prefs.get("order") or []]
    if order:
        ranked = [p for o in order for p in cands if o in _names(p)]
        if ranked:
            return ranked[0]
        if prefs.get("allow_fallbacks") is False:
            return None
    if prefs.get("sort") == "price" or order:
        return min(cands, key=_price)
    if prefs.get("sort") in ("throughput", "latency"):
        return cands[0]  # no speed data: the configured order stands in for it
    # Default load balancing: weight 1/price^2, picked by the request's own RNG (deterministic).
    weights = [1.0 / (p.completion_price + p.prompt_price) ** 2 for p in cands]
    return rng.choices(cands, weights=weights, k=1)[0]
