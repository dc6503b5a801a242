"""Prices, expected costs and the cost preview of API regeneration, and the words every money figure is told in.

Spend is what the journals say was charged (``usage.cost`` of every journaled response, including responses
journaled under older parameters: that money is gone too) plus the folder's share of what the account billed
beyond every journal on its key (aerie.responses.api.books). Prices come from the backend's live prices when they
answer, else from the config. The preview estimates what the pending work will cost before a cent is spent;
``snakemake -n`` prints it and a real run refuses to start when it exceeds the remaining budget (unless
``--config allow_over_budget=True``).

Parse time imports this module: no aiohttp, no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.formats.prompts import estimate_prompt_tokens
from aerie.responses.api.journal import dataset_journal_totals, journal_path, jsonl_objects, messages_key, read_journal
from aerie.responses.api.prices import Prices
from aerie.responses.api.settings import ApiDataset, ResponsesSettings

# ---- the words the logs, the preview and the report share ------------------------------------------------------
JOURNALED = "journaled"
RETRIES = "billed retries"  # requests that failed after the provider could bill them (timeouts, resets...), retried
LOST = "lost to interrupted requests"  # requests in flight when their process died: billed, never answered here
PENDING = "sent before an interruption, not yet billed"  # priced at the expected cost until the account shows them
UNATTRIBUTED = "billed on the key, no request of any run explains it"  # e.g. another use of the same key


def usd(amount: float) -> str:
    """Dollars for a log line: cents, or four decimals below a cent (a test run's amounts)."""
    return f"${amount:.2f}" if abs(amount) >= 0.01 or amount == 0 else f"${amount:.4f}"


@dataclass
class Unjournaled:
    """What a folder's books count beyond its journals, in parts named by the words above."""

    retries: float = 0.0
    lost: float = 0.0
    unattributed: float = 0.0
    pending: float = 0.0

    @property
    def billed(self) -> float:
        """What the account billed for the folder's requests beyond its journals."""
        return self.retries + self.lost

    @property
    def total(self) -> float:
        return self.billed + self.unattributed + self.pending

    def words(self) -> str:
        """``$0.12 billed retries + $0.30 lost to interrupted requests`` (the parts that are not zero; "nothing")."""
        parts = [(self.retries, RETRIES), (self.lost, LOST), (self.unattributed, UNATTRIBUTED), (self.pending, PENDING)]
        return " + ".join(f"{usd(v)} {w}" for v, w in parts if v >= 5e-5) or "nothing"


def api_key_from_env(settings: ResponsesSettings) -> str | None:
    return os.environ.get(settings.api_key_env)


# ---- prices ------------------------------------------------------------------------------------------------------


def resolve_prices(settings: ResponsesSettings, api_key: str | None = None, live: bool = True) -> Prices:
    """The live price of the endpoint routing would pick (when the backend offers one and ``live``), else the
    configured one; a backend that bills is refused without either."""
    prices = settings.api.live_prices(settings.request, api_key) if live and settings.live_prices else None
    prices = prices or settings.configured_prices()
    if prices is None:
        raise ValueError(
            "responses.price_per_million_output_usd: no price in the config and the "
            "endpoints API did not answer; set the price to preview and cap spending"
        )
    return prices


def batch_prices(prices: Prices, settings: ResponsesSettings, measured: float | None) -> Prices:
    """The batch price: ``measured`` (billed batch answers over what they cost at ``prices``) once the run has
    batch answers, else ``responses.batch.price_factor`` of ``prices`` (OpenRouter publishes no batch price per
    endpoint: "typically 50%"), each named so."""
    if measured is not None:
        return prices.scaled(measured, f"batch: {measured:.0%} of {prices.source}, measured from billed batches")
    factor = settings.batch.price_factor
    return prices.scaled(factor, f"batch: {factor:.0%} of {prices.source}, assumed (responses.batch.price_factor)")


def measured_batch_factor(responses_dir: Path, prices: Prices) -> float | None:
    """The batch price as a share of ``prices``, measured: the billed ``cost`` of a dataset's journaled batch answers
    over what they cost at ``prices`` (20 answers at least), else None."""
    billed = at_list = 0.0
    n = 0
    for path in sorted(Path(responses_dir).glob("shard-*.journal.jsonl")):
        for r in jsonl_objects(path):
            if r.get("batch") and r.get("cost") is not None:
                usage = r.get("usage") or {}
                billed += float(r["cost"])
                at_list += float(usage.get("prompt_tokens") or 0) * prices.input
                at_list += float(usage.get("completion_tokens") or 0) * prices.output
                n += 1
    return billed / at_list if n >= 20 and at_list > 0 else None


# ---- expected and most costs -------------------------------------------------------------------------------------


def run_spend(results_dir: Path, datasets: list[str]) -> dict[str, dict[str, float]]:
    """Per dataset: dollars charged, output tokens and samples according to its journals."""
    return {name: dataset_journal_totals(results_dir / name / "responses") for name in datasets}


def _expected_tokens(
    spent: Mapping[str, float], max_new_tokens: int, expected: int | None, name: str, dataset_expected: int | None
) -> tuple[float, str]:
    if spent["samples"] >= 20:
        return spent["completion_tokens"] / spent["samples"], f"mean of {int(spent['samples'])} journaled"
    if dataset_expected:
        return float(dataset_expected), f"datasets.{name}.expected_output_tokens"
    if expected:
        return float(expected), "responses.expected_output_tokens"
    return float(max_new_tokens), "max_new_tokens (upper bound; set expected_output_tokens)"


def expected_output_tokens(dataset: ApiDataset, spent: Mapping[str, float]) -> tuple[float, str]:
    """Expected output tokens per sample: the journals' mean once 20 responses exist, else the dataset's
    ``expected_output_tokens``, else ``responses.expected_output_tokens``, else ``max_new_tokens``; and its basis."""
    s = dataset.settings
    return _expected_tokens(
        spent, s.request.max_new_tokens, s.expected_output_tokens, dataset.name, dataset.expected_output_tokens
    )


def mean_output_tokens(
    responses: Mapping[str, Any], spent: Mapping[str, float], dataset: tuple[str, Mapping[str, Any]]
) -> tuple[float, str]:
    """:func:`expected_output_tokens` for the planning layer's quota and disk figures, which read the merged config
    section (``dataset``: ``(name, datasets.<name>)``)."""
    name, section = dataset
    return _expected_tokens(
        spent,
        responses["max_new_tokens"],
        responses.get("expected_output_tokens"),
        name,
        section.get("expected_output_tokens"),
    )


def expected_sample_cost(spent: Mapping[str, float], mean_tokens: float, prices: Prices, prompt_tokens: float) -> float:
    """USD a request of a dataset is expected to cost: the journals' mean once 20 responses exist, else
    ``mean_tokens`` output and ``prompt_tokens`` input tokens at ``prices``. The budget guard reserves it per
    request in flight and prices requests the account does not show yet with it."""
    if spent["samples"] >= 20:
        return spent["cost"] / spent["samples"]
    return mean_tokens * prices.output + prompt_tokens * prices.input


def most_request_cost(prompt_tokens: float, max_new_tokens: int, prices: Prices) -> float:
    """The most one request can cost: its prompt and ``max_new_tokens`` at ``prices``."""
    return prompt_tokens * prices.input + max_new_tokens * prices.output


@dataclass(frozen=True)
class RequestCosts:
    """A dataset's requests: expected cost (USD) and the most one can cost."""

    expected: float
    most: float


# ---- the preview -------------------------------------------------------------------------------------------------


@dataclass
class ShardEstimate:
    dataset: str
    shard: str
    pending_prompts: int
    prompt_tokens: int
    output_tokens: int
    dollars: float


def estimate_shard(
    dataset: str,
    shard: str,
    prompts: list[dict[str, Any]],
    output_path: Path,
    params_hash: str,
    mean_output_tokens: float,
    prices: Prices,
) -> ShardEstimate:
    """Cost of what is still to be requested for one shard (journaled samples are free)."""
    keys = {p["id"]: messages_key(p["messages"], p.get("tools")) for p in prompts}
    done = read_journal(journal_path(output_path), params_hash, keys).finished
    pending = [p for p in prompts if p["id"] not in done]
    prompt_tokens = sum(estimate_prompt_tokens(p["messages"]) for p in pending)
    output_tokens = int(round(mean_output_tokens * len(pending)))
    dollars = prompt_tokens * prices.input + output_tokens * prices.output
    return ShardEstimate(dataset, shard, len(pending), prompt_tokens, output_tokens, dollars)


@dataclass
class DatasetEstimate:
    """One dataset's pending work, cut at its output-token quota (``max_output_tokens``)."""

    dataset: str
    shards: int  # shards not yet published
    pending_prompts: int  # their prompts without a journaled response
    expected_samples: int  # how many of those fit the quota at the expected length
    prompt_tokens: int
    output_tokens: int
    dollars: float
    basis: str  # where the expected length comes from
    mean_output_tokens: float
    quota: int | None = None
    quota_used: int = 0  # output tokens already journaled for this dataset
    # mode batch: the same work at the streaming price (dollars is at the batch price), and the wait to expect
    streaming_dollars: float | None = None
    wait: str = ""

    @property
    def quota_reached(self) -> bool:
        return self.expected_samples < self.pending_prompts


def estimate_dataset(
    dataset: str,
    rows: list[ShardEstimate],
    mean_tokens: float,
    basis: str,
    prices: Prices,
    quota: int | None,
    quota_used: int,
) -> DatasetEstimate:
    """Sum a dataset's shard estimates, then keep only the samples its quota leaves room for.

    The client stops admitting requests once the next one would pass the quota, so at the expected
    length ``floor((quota - used) / mean)`` samples are requested; prompt tokens shrink in proportion.
    """
    pending = sum(r.pending_prompts for r in rows)
    prompt_tokens = sum(r.prompt_tokens for r in rows)
    samples = pending
    if quota is not None and mean_tokens > 0:
        samples = min(pending, max(0, int((quota - quota_used) // mean_tokens)))
    if pending:
        prompt_tokens = int(round(prompt_tokens * samples / pending))
    output_tokens = int(round(samples * mean_tokens))
    dollars = prompt_tokens * prices.input + output_tokens * prices.output
    return DatasetEstimate(
        dataset,
        len(rows),
        pending,
        samples,
        prompt_tokens,
        output_tokens,
        dollars,
        basis,
        mean_tokens,
        quota,
        quota_used,
    )


def _estimate_line(e: DatasetEstimate) -> str:
    note = f"{e.basis} {e.mean_output_tokens:,.0f}/sample"
    if e.quota is not None:
        note += (
            f"; quota {e.quota:,} reached: {e.expected_samples:,} of {e.pending_prompts:,} prompts"
            if e.quota_reached
            else f"; within quota {e.quota:,}"
        )
    if e.streaming_dollars is not None:
        note += f"; batch (streaming: ${e.streaming_dollars:.2f}; {e.wait})"
    return (
        f"  {e.dataset:<16}{e.shards:>7}{e.pending_prompts:>9}{e.expected_samples:>9}"
        f"{e.output_tokens:>13,}{e.dollars:>10.2f}  {note}"
    )


def format_preview(
    estimates: list[DatasetEstimate],
    spent_total: float,
    budget: float | None,
    prices: list[Prices],
    unjournaled: Unjournaled | None = None,
    account_line: str = "",
) -> str:
    """What ``snakemake -n`` prints: per dataset the pending work and its dollars (mode batch: at the batch price,
    with the streaming price and the wait beside it), and this folder's spend against what remains of the budget."""
    unjournaled = unjournaled or Unjournaled()
    seen = list(dict.fromkeys(f"{p.per_million} tokens, {p.source}" for p in prices))
    lines = [f"aerie cost preview (price {'; '.join(seen)}):"]
    lines.append(
        f"  {'dataset':<16}{'shards':>7}{'prompts':>9}{'samples':>9}{'out tokens':>13}{'USD':>10}  estimate from"
    )
    lines += [_estimate_line(e) for e in estimates if e.shards or e.pending_prompts]  # else benchmark-only / done
    total = sum(e.dollars for e in estimates)
    lines.append(
        f"  will produce ~{sum(e.expected_samples for e in estimates):,} more responses "
        f"(~{sum(e.output_tokens for e in estimates):,} output tokens) for ${total:.2f}"
    )
    used = spent_total + unjournaled.total
    money = f"  spent: {usd(spent_total)} {JOURNALED}"
    if unjournaled.total >= 5e-5:
        money += f" + {unjournaled.words()}"
    money += f" = {usd(used)}"
    if budget is not None:
        money += f"; budget ${budget:.2f}, remaining {usd(budget - used)}"
    lines.append(money)
    if account_line:
        lines.append(f"  account: {account_line}")
    if budget is not None and total > budget - used:
        lines.append(
            f"  OVER BUDGET by ${total - (budget - used):.2f}: a real run refuses to start "
            "(--config allow_over_budget=True runs until the budget stops it)"
        )
    return "\n".join(lines)
