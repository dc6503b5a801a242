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
    return Prices(
        responses.get("price_per_million_input_usd", 0.0) / 1e6,
        responses["price_per_million_output_usd"] / 1e6,
        "config",
    )


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
        raise ValueError(
            "responses.price_per_million_output_usd: no price in the config and the "
            "endpoints API did not answer; set the price to preview and cap spending"
        )
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
    from aerie.api.journal import messages_key

    keys = {p["id"]: messages_key(p["messages"], p.get("tools")) for p in prompts}
    done = read_journal(journal_path(output_path), params_hash, keys).finished
    pending = [p for p in prompts if p["id"] not in done]
    prompt_tokens = sum(estimate_prompt_tokens(p["messages"]) for p in pending)
    output_tokens = int(round(mean_output_tokens * len(pending)))
    dollars = prompt_tokens * prices.input + output_tokens * prices.output
    return ShardEstimate(dataset, shard, len(pending), prompt_tokens, output_tokens, dollars)


def mean_output_tokens(
    responses: dict[str, Any], spent: dict[str, float], dataset: tuple[str, dict[str, Any]] | None = None
) -> tuple[float, str]:
    """Expected output tokens per sample: the journals' mean once 20 responses exist, else the dataset's
    ``expected_output_tokens``, else ``responses.expected_output_tokens``, else ``max_new_tokens``.

    ``dataset`` is ``(name, datasets.<name> section)``.
    """
    if spent["samples"] >= 20:
        return spent["completion_tokens"] / spent["samples"], f"mean of {int(spent['samples'])} journaled"
    if dataset is not None and dataset[1].get("expected_output_tokens"):
        return float(dataset[1]["expected_output_tokens"]), f"datasets.{dataset[0]}.expected_output_tokens"
    if responses.get("expected_output_tokens"):
        return float(responses["expected_output_tokens"]), "responses.expected_output_tokens"
    return float(responses["max_new_tokens"]), "max_new_tokens (upper bound; set expected_output_tokens)"


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


@dataclass
class AccountState:
    """The provider account against the journals: what was billed that no journal holds."""

    usage: float  # account usage now (or at the last recorded reading)
    baseline_usage: float  # at the run's first start
    journal_spend: float  # journals' total at the same reading
    baseline_journal: float
    source: str  # "live" or "ledger, <time>"

    @property
    def lost(self) -> float:
        """Spend lost to interrupted requests: account growth since the first start minus journal growth."""
        return max(0.0, (self.usage - self.baseline_usage) - (self.journal_spend - self.baseline_journal))


def format_preview(
    estimates: list[DatasetEstimate],
    spent_total: float,
    budget: float | None,
    prices: Prices,
    account: AccountState | None = None,
    account_note: str = "",
) -> str:
    lost = account.lost if account is not None else 0.0
    lines = [
        f"aerie cost preview (price {prices.input * 1e6:.3f}/{prices.output * 1e6:.3f} USD per M in/out "
        f"tokens, {prices.source}):"
    ]
    lines.append(
        f"  {'dataset':<16}{'shards':>7}{'prompts':>9}{'samples':>9}{'out tokens':>13}{'USD':>10}  estimate from"
    )
    for e in estimates:
        if not e.shards and not e.pending_prompts:
            continue  # benchmark-only, or every shard published
        note = f"{e.basis} {e.mean_output_tokens:,.0f}/sample"
        if e.quota is not None:
            note += (
                f"; quota {e.quota:,} reached: {e.expected_samples:,} of {e.pending_prompts:,} prompts"
                if e.quota_reached
                else f"; within quota {e.quota:,}"
            )
        lines.append(
            f"  {e.dataset:<16}{e.shards:>7}{e.pending_prompts:>9}{e.expected_samples:>9}"
            f"{e.output_tokens:>13,}{e.dollars:>10.2f}  {note}"
        )
    total = sum(e.dollars for e in estimates)
    lines.append(
        f"  will produce ~{sum(e.expected_samples for e in estimates):,} more responses "
        f"(~{sum(e.output_tokens for e in estimates):,} output tokens) for ${total:.2f}"
    )
    used = spent_total + lost
    money = f"  spent: ${spent_total:.2f} journaled + ${lost:.2f} lost to interrupted requests = ${used:.2f}"
    if budget is not None:
        money += f"; budget ${budget:.2f}, remaining ${budget - used:.2f}"
    lines.append(money)
    if account is not None:
        lines.append(
            f"  account ({account.source}): usage ${account.usage:.2f}, "
            f"${account.usage - account.baseline_usage:.2f} since the run's first start, "
            f"journals ${account.journal_spend - account.baseline_journal:.2f}"
        )
    elif account_note:
        lines.append(f"  account: {account_note}")
    if budget is not None and total > budget - used:
        lines.append(
            f"  OVER BUDGET by ${total - (budget - used):.2f}: a real run refuses to start "
            "(--config allow_over_budget=True runs until the budget stops it)"
        )
    return "\n".join(lines)


def api_key_from_env(responses: dict[str, Any]) -> str | None:
    return os.environ.get(responses.get("api_key_env") or "OPENROUTER_API_KEY")


# ---- the provider's account ------------------------------------------------------------------------
ACCOUNT_FORMAT = "aerie.api-account/1"


def account_ledger_path(results_dir: Path) -> Path:
    """``results/api_account.jsonl``: account usage read at every start and poll (aerie.api-account/1)."""
    return Path(results_dir) / "api_account.jsonl"


def account_id(responses: dict[str, Any]) -> str | None:
    """Which account a dataset spends from (the key's variable name, never the key); None without one."""
    if responses["backend"] != "openrouter":
        return None
    return f"{responses['base_url'].rstrip('/')} ${responses.get('api_key_env') or 'OPENROUTER_API_KEY'}"


def account_key_url(responses: dict[str, Any]) -> str:
    return f"{responses['base_url'].rstrip('/')}/key"


def read_account_usage(responses: dict[str, Any], api_key: str | None, timeout: float = 15.0) -> dict[str, Any] | None:
    """The account's live usage: ``GET /key`` (usage, limit, limit_remaining), else ``GET /credits``
    (total_usage); None when neither gives a figure. Raises RuntimeError when the server is unreachable
    or refuses the key."""
    import requests

    base = responses["base_url"].rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = requests.get(f"{base}/key", headers=headers, timeout=timeout)
        if resp.status_code == 401:
            raise RuntimeError(f"the API key in ${responses.get('api_key_env')} was refused (HTTP 401)")
        data = (resp.json().get("data") or {}) if resp.status_code == 200 else {}
        if data.get("usage") is not None:
            return {
                "usage": float(data["usage"]),
                "limit": data.get("limit"),
                "limit_remaining": data.get("limit_remaining"),
                "endpoint": "key",
            }
        resp = requests.get(f"{base}/credits", headers=headers, timeout=timeout)
        data = (resp.json().get("data") or {}) if resp.status_code == 200 else {}
        if data.get("total_usage") is not None:
            return {"usage": float(data["total_usage"]), "limit": None, "limit_remaining": None, "endpoint": "credits"}
    except requests.RequestException as e:
        raise RuntimeError(f"responses.base_url {base}: unreachable ({type(e).__name__})") from None
    except ValueError:
        pass
    return None


def read_account_ledger(path: Path, account: str) -> list[dict[str, Any]]:
    """This account's readings, oldest first (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().split(b"\n"):
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("account") == account:
            out.append(rec)
    return out


def append_account_ledger(
    path: Path, account: str, event: str, job: str, usage: float, journal_spend: float, lost: float
) -> None:
    """One reading, appended with a single write (parallel jobs append to the same file)."""
    import time

    path.parent.mkdir(parents=True, exist_ok=True)
    line = (
        json.dumps(
            {
                "format": ACCOUNT_FORMAT,
                "account": account,
                "event": event,
                "job": job,
                "t": round(time.time(), 3),
                "usage": usage,
                "journal_spend": round(journal_spend, 9),
                "lost": round(lost, 9),
            }
        )
        + "\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def account_state(ledger: list[dict[str, Any]], usage: float | None, journal_spend: float) -> AccountState | None:
    """Reconcile: the first reading is the baseline; ``usage`` None -> the last recorded reading."""
    if not ledger and usage is None:
        return None
    first = ledger[0] if ledger else {"usage": usage, "journal_spend": journal_spend}
    if usage is not None:
        return AccountState(usage, float(first["usage"]), journal_spend, float(first["journal_spend"]), "live")
    import time

    last = ledger[-1]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["t"]))
    return AccountState(
        float(last["usage"]),
        float(first["usage"]),
        float(last["journal_spend"]),
        float(first["journal_spend"]),
        f"last reading {when}",
    )
