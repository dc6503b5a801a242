"""Prices, spend and the cost preview of API regeneration.

Spend is what the journals say was charged (``usage.cost`` of every journaled response, including
responses journaled under older parameters: that money is gone too). Prices come from OpenRouter's
models/endpoints API when it answers, else from the config. The preview estimates what the pending
work will cost before a cent is spent; ``snakemake -n`` prints it and a real run refuses to start
when it exceeds the remaining budget (unless ``--config allow_over_budget=True``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.api.journal import dataset_journal_totals, journal_path, read_journal


@dataclass(frozen=True)
class Prices:
    """USD per token."""

    input: float
    output: float
    source: str  # "config", "live: <provider>", or "free (self-hosted)"


def config_prices(responses: dict[str, Any]) -> Prices | None:
    if responses["backend"] in ("openai", "sglang") and "price_per_million_output_usd" not in responses:
        return Prices(0.0, 0.0, "free (self-hosted)")
    if "price_per_million_output_usd" not in responses:
        return None
    return Prices(responses.get("price_per_million_input_usd", 0.0) / 1e6,
                  responses["price_per_million_output_usd"] / 1e6, "config")


def _endpoint_allowed(ep: dict[str, Any], provider: dict[str, Any]) -> bool:
    name = str(ep.get("provider_name") or ep.get("tag") or "").lower()
    tag = str(ep.get("tag") or name).lower()
    slugs = {name, tag, tag.split("/")[0]}
    if provider.get("only") and not slugs & {s.lower() for s in provider["only"]}:
        return False
    if provider.get("ignore") and slugs & {s.lower() for s in provider["ignore"]}:
        return False
    quants = provider.get("quantizations")
    if quants and str(ep.get("quantization") or "").lower() not in {q.lower() for q in quants}:
        return False
    return True


def live_prices(responses: dict[str, Any], api_key: str | None, timeout: float = 10.0) -> Prices | None:
    """Price of the endpoint OpenRouter's routing would pick, from its endpoints API; None if unreachable.

    With ``sort: price`` the cheapest allowed endpoint; otherwise the most expensive allowed one, since
    OpenRouter may route to any of them (an estimate should not be optimistic).
    """
    if responses["backend"] != "openrouter" or "/" not in responses.get("model", ""):
        return None
    import requests

    author, slug = responses["model"].split("/", 1)
    url = f"{responses['base_url'].rstrip('/')}/models/{author}/{slug}/endpoints"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = requests.get(url, headers=headers, timeout=timeout)
        resp.raise_for_status()
        endpoints = resp.json()["data"]["endpoints"]
    except Exception:  # noqa: BLE001 - any failure means "no live price", the config price is used
        return None
    provider = responses.get("provider") or {}
    allowed = [ep for ep in endpoints if _endpoint_allowed(ep, provider)]
    if not allowed:
        return None
    priced = [(float(ep["pricing"]["completion"]), float(ep["pricing"].get("prompt", 0)), ep) for ep in allowed]
    pick = min(priced, key=lambda x: x[:2]) if provider.get("sort") == "price" else max(priced, key=lambda x: x[:2])
    return Prices(pick[1], pick[0], f"live: {pick[2].get('provider_name') or pick[2].get('tag')}")


def resolve_prices(responses: dict[str, Any], api_key: str | None = None, live: bool = True) -> Prices:
    prices = live_prices(responses, api_key) if live else None
    prices = prices or config_prices(responses)
    if prices is None:
        raise ValueError("responses.price_per_million_output_usd: no price in the config and the "
                         "endpoints API did not answer; set the price to preview and cap spending")
    return prices


def run_spend(results_dir: Path, datasets: list[str]) -> dict[str, dict[str, float]]:
    """Per dataset: dollars charged, output tokens and samples according to its journals."""
    return {name: dataset_journal_totals(results_dir / name / "responses") for name in datasets}


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """About 4 characters per token: good enough for a preview; usage gives the truth afterwards."""
    return max(1, len(json.dumps(messages, ensure_ascii=False)) // 4)


@dataclass
class ShardEstimate:
    dataset: str
    shard: str
    pending_prompts: int
    prompt_tokens: int
    output_tokens: int
    dollars: float


def estimate_shard(dataset: str, shard: str, prompts: list[dict[str, Any]], output_path: Path,
                   params_hash: str, mean_output_tokens: float, prices: Prices) -> ShardEstimate:
    """Cost of what is still to be requested for one shard (journaled samples are free)."""
    from aerie.api.journal import messages_key

    keys = {p["id"]: messages_key(p["messages"], p.get("tools")) for p in prompts}
    done = read_journal(journal_path(output_path), params_hash, keys).finished
    pending = [p for p in prompts if p["id"] not in done]
    prompt_tokens = sum(estimate_prompt_tokens(p["messages"]) for p in pending)
    output_tokens = int(round(mean_output_tokens * len(pending)))
    dollars = prompt_tokens * prices.input + output_tokens * prices.output
    return ShardEstimate(dataset, shard, len(pending), prompt_tokens, output_tokens, dollars)


def mean_output_tokens(responses: dict[str, Any], spent: dict[str, float]) -> tuple[float, str]:
    """Expected output tokens per sample: measured when responses exist, else configured, else the cap."""
    if spent["samples"] >= 20:
        return spent["completion_tokens"] / spent["samples"], f"mean of {int(spent['samples'])} finished"
    if responses.get("expected_output_tokens"):
        return float(responses["expected_output_tokens"]), "responses.expected_output_tokens"
    return float(responses["max_new_tokens"]), "max_new_tokens (upper bound; set responses.expected_output_tokens)"


def format_preview(rows: list[ShardEstimate], per_dataset: dict[str, dict[str, Any]], spent_total: float,
                   budget: float | None, prices: Prices) -> str:
    lines = [f"aerie cost preview (price {prices.input * 1e6:.3f}/{prices.output * 1e6:.3f} USD per M in/out "
             f"tokens, {prices.source}):"]
    lines.append(f"  {'dataset':<16}{'shards':>7}{'prompts':>9}{'out tokens':>13}{'USD':>10}  estimate from")
    total = 0.0
    for name, info in per_dataset.items():
        mine = [r for r in rows if r.dataset == name]
        usd = sum(r.dollars for r in mine)
        total += usd
        lines.append(f"  {name:<16}{len(mine):>7}{sum(r.pending_prompts for r in mine):>9}"
                     f"{sum(r.output_tokens for r in mine):>13,}{usd:>10.2f}  {info['basis']}")
    lines.append(f"  pending total: ${total:.2f}; already spent: ${spent_total:.2f}"
                 + (f"; budget ${budget:.2f}, remaining ${budget - spent_total:.2f}" if budget is not None else ""))
    if budget is not None and total > budget - spent_total:
        lines.append(f"  OVER BUDGET by ${total - (budget - spent_total):.2f}: a real run refuses to start "
                     "(--config allow_over_budget=True runs until the budget stops it)")
    return "\n".join(lines)


def api_key_from_env(responses: dict[str, Any]) -> str | None:
    return os.environ.get(responses.get("api_key_env") or "OPENROUTER_API_KEY")
