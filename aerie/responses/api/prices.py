"""Per-token prices: a backend's configured price, or the live price of the endpoint OpenRouter would route to.

Parse time imports this (the cost preview): ``requests`` is imported only when a live price is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Prices:
    """USD per token."""

    input: float
    output: float
    source: str  # "config", "live: <provider>", "free (self-hosted)", or a batch price's own words

    def scaled(self, factor: float, source: str) -> Prices:
        """These prices times ``factor`` (a batch price as a share of the per-token price), named ``source``."""
        return Prices(self.input * factor, self.output * factor, source)

    @property
    def per_million(self) -> str:
        return f"{self.input * 1e6:.3f}/{self.output * 1e6:.3f} USD per M in/out"


FREE = Prices(0.0, 0.0, "free (self-hosted)")


def configured_prices(input_per_million: float | None, output_per_million: float | None) -> Prices | None:
    """``responses.price_per_million_{input,output}_usd`` as Prices; None when no output price is set."""
    if output_per_million is None:
        return None
    return Prices((input_per_million or 0.0) / 1e6, output_per_million / 1e6, "config")


def endpoint_slugs(ep: dict[str, Any]) -> set[str]:
    """The names a provider routing filter may use for an endpoint: its provider name, tag and tag's provider."""
    name = str(ep.get("provider_name") or ep.get("tag") or "").lower()
    tag = str(ep.get("tag") or name).lower()
    return {name, tag, tag.split("/")[0]}


def endpoint_allowed(ep: dict[str, Any], provider: dict[str, Any]) -> bool:
    """Whether OpenRouter's routing may pick ``ep`` under ``responses.provider``'s only / ignore / quantizations."""
    slugs = endpoint_slugs(ep)
    if provider.get("only") and not slugs & {s.lower() for s in provider["only"]}:
        return False
    if provider.get("ignore") and slugs & {s.lower() for s in provider["ignore"]}:
        return False
    quants = provider.get("quantizations")
    if quants and str(ep.get("quantization") or "").lower() not in {q.lower() for q in quants}:
        return False
    return True


def fetch_endpoints(base_url: str, model: str, api_key: str | None, timeout: float = 10.0) -> list[dict] | None:
    """``GET /models/{author}/{slug}/endpoints``'s endpoints; None when it does not answer (or no such model)."""
    if "/" not in model:
        return None
    import requests

    author, slug = model.split("/", 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = requests.get(
            f"{base_url.rstrip('/')}/models/{author}/{slug}/endpoints", headers=headers, timeout=timeout
        )
        resp.raise_for_status()
        return list(resp.json()["data"]["endpoints"])
    except Exception:  # noqa: BLE001 - any failure means "no live price", the config price is used
        return None


def routed_price(endpoints: list[dict[str, Any]], provider: dict[str, Any]) -> Prices | None:
    """Price of the endpoint routing would pick: with ``sort: price`` the cheapest allowed endpoint; otherwise the most
    expensive allowed one, since OpenRouter may route to any of them (an estimate should not be optimistic)."""
    allowed = [ep for ep in endpoints if endpoint_allowed(ep, provider)]
    if not allowed:
        return None
    priced = [(float(ep["pricing"]["completion"]), float(ep["pricing"].get("prompt", 0)), ep) for ep in allowed]
    pick = min(priced, key=lambda x: x[:2]) if provider.get("sort") == "price" else max(priced, key=lambda x: x[:2])
    return Prices(pick[1], pick[0], f"live: {pick[2].get('provider_name') or pick[2].get('tag')}")


def ceiling_price(endpoints: list[dict[str, Any]], provider: dict[str, Any]) -> Prices | None:
    """The dearest endpoint routing may pick: what one request can cost at most."""
    allowed = [ep for ep in endpoints if endpoint_allowed(ep, provider)]
    if not allowed:
        return None
    ep = max(allowed, key=lambda e: (float(e["pricing"]["completion"]), float(e["pricing"].get("prompt", 0))))
    return Prices(float(ep["pricing"].get("prompt", 0)), float(ep["pricing"]["completion"]), "ceiling")
