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
from dataclasses import dataclass, field
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


def expected_sample_cost(spent: dict[str, float], mean_tokens: float, prices: Prices, prompt_tokens: float) -> float:
    """USD a request of a dataset is expected to cost: the journals' mean once 20 responses exist, else
    ``mean_tokens`` output and ``prompt_tokens`` input tokens at ``prices``. The budget guard reserves it per
    request in flight and prices requests the account does not show yet with it."""
    if spent["samples"] >= 20:
        return spent["cost"] / spent["samples"]
    return mean_tokens * prices.output + prompt_tokens * prices.input


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


# ---- spend no journal holds: the words the logs, the preview and the report share --------------------------
JOURNALED = "journaled"
RETRIES = "billed retries"  # requests that failed after the provider could bill them (timeouts, resets...), retried
LOST = "lost to interrupted requests"  # requests in flight when their process died: billed, never answered here
PENDING = "sent before an interruption, not yet billed"  # priced at the expected cost until the account shows them
UNATTRIBUTED = "billed, no request of this run explains it"  # e.g. another use of the same key


def usd(amount: float) -> str:
    """Dollars for a log line: cents, or four decimals below a cent (a test run's amounts)."""
    return f"${amount:.2f}" if abs(amount) >= 0.01 or amount == 0 else f"${amount:.4f}"


@dataclass
class Unjournaled:
    """What the budget counts beyond the journals, in parts named by the words above."""

    retries: float = 0.0
    lost: float = 0.0
    unattributed: float = 0.0
    pending: float = 0.0

    @property
    def billed(self) -> float:
        """What the account already shows beyond the journals."""
        return self.retries + self.lost + self.unattributed

    @property
    def total(self) -> float:
        return self.billed + self.pending

    def words(self) -> str:
        """``$0.12 billed retries + $0.30 lost to interrupted requests`` (the parts that are not zero; "nothing")."""
        parts = [(self.retries, RETRIES), (self.lost, LOST), (self.unattributed, UNATTRIBUTED), (self.pending, PENDING)]
        return " + ".join(f"{usd(v)} {w}" for v, w in parts if v > 0) or "nothing"


def split_unjournaled(billed: float, retry_weight: float, lost_weight: float, pending: float = 0.0) -> Unjournaled:
    """Name the account's spend beyond the journals: ``billed`` split between billed retries and requests lost to
    interrupted runs in proportion to their weights (each failed-billable or unanswered request at its dataset's
    expected cost); all of it is unattributed when no request of the run can explain it."""
    billed = max(0.0, billed)
    weight = retry_weight + lost_weight
    if billed == 0 or weight <= 0:
        return Unjournaled(unattributed=billed, pending=pending)
    retries = billed * retry_weight / weight
    return Unjournaled(retries=retries, lost=billed - retries, pending=pending)


# An answer we still wait for arrives within responses.read_timeout_s; the account shows its charge within about
# this much more (GET /key lags by seconds).
ACCOUNT_LAG_S = 60.0


@dataclass
class DatasetRequests:
    """A dataset's requests as its intents logs tell them (aerie.api.journal.request_tally), for pricing and naming
    the money the account billed beyond the journals."""

    billable_failures: int  # failed requests the provider may have billed (retried: "billed retries")
    unanswered: list[float]  # send times of requests in flight when a process died
    expected_cost: float  # USD per request: the dataset's expected (or measured) per-sample cost
    settle_s: float  # after this long a request sent has been billed if it ever will be (read timeout + lag)

    def pending(self, now: float) -> list[tuple[float, float]]:
        """(settle time, expected cost) of the unanswered requests that may still be billed after ``now``."""
        return [(t + self.settle_s, self.expected_cost) for t in self.unanswered if t + self.settle_s > now]


def dataset_requests(responses_dir: Path, expected_cost: float, settle_s: float) -> DatasetRequests:
    """``DatasetRequests`` of every shard in a dataset's responses folder."""
    from aerie.api.journal import request_tally

    failures, unanswered = 0, []
    for intents in sorted(Path(responses_dir).glob("shard-*.intents.jsonl")):
        tally = request_tally(intents.with_name(intents.name.replace(".intents.jsonl", ".jsonl")))
        failures += tally.billable_failures
        unanswered += tally.unanswered
    return DatasetRequests(failures, unanswered, expected_cost, settle_s)


@dataclass
class PendingRequests:
    """Requests sent before an interruption that the account may not show yet, each priced at its expected cost
    until its settle time; ``before``: the account's spend beyond the journals at the last reading taken before the
    first of them was sent (so what they add is never counted twice)."""

    before: float
    items: list[tuple[float, float]]  # (settle time unix s, expected cost)

    def cost(self, now: float | None = None) -> float:
        import time

        now = time.time() if now is None else now
        return sum(c for until, c in self.items if until > now)


@dataclass
class AccountMoney:
    """One provider account since the run's first start: the journals, and what it billed that they do not hold."""

    usage: float  # account usage now (or at the last recorded reading)
    baseline_usage: float  # at the run's first start
    journal: float  # USD in the journals of the datasets on this account, at the same reading
    baseline_journal: float
    source: str  # "live" or "last reading <time>"
    unjournaled: Unjournaled
    pending: PendingRequests | None = None
    by_dataset: dict[str, Unjournaled] = field(default_factory=dict)  # the billed parts per dataset
    weights: tuple[float, float] = (0.0, 0.0)  # (retry, lost): how the billed part is named (split_unjournaled)

    @property
    def billed_unjournaled(self) -> float:
        """Account growth since the first start minus journal growth (at least 0)."""
        return max(0.0, (self.usage - self.baseline_usage) - (self.journal - self.baseline_journal))

    @property
    def lost(self) -> float:
        """Everything the budget counts beyond the journals (billed, and priced until billed)."""
        return self.unjournaled.total


def _unexplained(reading: dict[str, Any], first: dict[str, Any]) -> float:
    return (float(reading["usage"]) - float(first["usage"])) - (
        float(reading["journal_spend"]) - float(first["journal_spend"])
    )


def account_money(
    ledger: list[dict[str, Any]],
    usage: float | None,
    journal: float,
    requests: dict[str, DatasetRequests],
    now: float | None = None,
) -> AccountMoney | None:
    """Reconcile one account: the ledger's first reading is the baseline; ``usage`` None -> the last recorded
    reading (and its journals' figure). The account's spend beyond the journals is split into billed retries and
    requests lost to interrupted runs (``split_unjournaled``, weights from ``requests``, per dataset too); requests
    sent before an interruption within their settle time are priced on top until the account shows as much."""
    import time

    if not ledger and usage is None:
        return None
    now = time.time() if now is None else now
    first = ledger[0] if ledger else {"usage": usage, "journal_spend": journal}
    if usage is None:
        last = ledger[-1]
        usage, journal = float(last["usage"]), float(last["journal_spend"])
        source = "last reading " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["t"]))
    else:
        source = "live"
    reading = {"usage": usage, "journal_spend": journal}
    billed = max(0.0, _unexplained(reading, first))
    weights = {
        d: (r.billable_failures * r.expected_cost, len(r.unanswered) * r.expected_cost) for d, r in requests.items()
    }
    retry_w, lost_w = sum(w[0] for w in weights.values()), sum(w[1] for w in weights.values())
    total = split_unjournaled(billed, retry_w, lost_w)
    weight = retry_w + lost_w
    by_dataset = (
        {d: split_unjournaled(billed * (w[0] + w[1]) / weight, *w) for d, w in weights.items()} if weight else {}
    )
    items = [item for r in requests.values() for item in r.pending(now)]
    pending = None
    if items:
        sent_first = min(until - r.settle_s for r in requests.values() for until, _ in r.pending(now))
        earlier = [x for x in ledger if float(x.get("t", 0)) <= sent_first]
        # No reading before them (they predate the ledger): count them on top of everything billed so far.
        before = max(0.0, _unexplained(earlier[-1], first)) if earlier else billed
        pending = PendingRequests(before, items)
        total.pending = max(0.0, pending.before + pending.cost(now) - billed)
    return AccountMoney(
        usage,
        float(first["usage"]),
        journal,
        float(first["journal_spend"]),
        source,
        total,
        pending,
        by_dataset,
        (retry_w, lost_w),
    )


def format_preview(
    estimates: list[DatasetEstimate],
    spent_total: float,
    budget: float | None,
    prices: Prices,
    account: AccountMoney | None = None,
    account_note: str = "",
) -> str:
    unjournaled = account.unjournaled if account is not None else Unjournaled()
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
    used = spent_total + unjournaled.total
    money = f"  spent: {usd(spent_total)} {JOURNALED}"
    if unjournaled.total:
        money += f" + {unjournaled.words()}"
    money += f" = {usd(used)}"
    if budget is not None:
        money += f"; budget ${budget:.2f}, remaining {usd(budget - used)}"
    lines.append(money)
    if account is not None:
        lines.append(
            f"  account ({account.source}): usage {usd(account.usage)}, "
            f"{usd(account.usage - account.baseline_usage)} since the run's first start, "
            f"journals {usd(account.journal - account.baseline_journal)}"
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
    path: Path,
    account: str,
    event: str,
    job: str,
    usage: float,
    journal_spend: float,
    lost: float,
    datasets: list[str] | None = None,
) -> None:
    """One reading, appended with a single write; ``datasets``: those on the account (whose journals it counts)."""
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
                **({"datasets": list(datasets)} if datasets is not None else {}),
            }
        )
        + "\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


# ---- the whole money story of a run (the report's spend figure) ------------------------------------------------


@dataclass
class SpendStory:
    """Where every dollar of a run's API spend went, in parts that add up to the account.

    ``journaled``: per dataset and provider, the ``cost`` of every journal line (the published shard's records
    where a shard has no journal). ``billed``: per dataset, what the account billed beyond the journals, named
    (billed retries, lost to interrupted requests; aerie.api.money.account_money splits it by the requests of
    each dataset); ``unattributed``: billed, traced to no request; ``pending``: sent before an interruption and not
    billed yet (the budget prices it; not in the account). ``account``: the account's figure the parts add up to -
    its growth since the run's first start plus the journals at that start - or None without a reading."""

    journaled: dict[str, dict[str, float]]
    billed: dict[str, Unjournaled]
    unattributed: float = 0.0
    pending: float = 0.0
    account: float | None = None
    source: str = "no account reading (journals only)"

    @property
    def journaled_usd(self) -> float:
        return sum(sum(p.values()) for p in self.journaled.values())

    @property
    def total(self) -> float:
        """Journaled + billed retries + lost to interrupted requests + unattributed: the account's figure."""
        return self.journaled_usd + sum(u.retries + u.lost for u in self.billed.values()) + self.unattributed

    def words(self) -> str:
        parts = Unjournaled(
            retries=sum(u.retries for u in self.billed.values()),
            lost=sum(u.lost for u in self.billed.values()),
            unattributed=self.unattributed,
            pending=self.pending,
        )
        text = f"{usd(self.journaled_usd)} {JOURNALED}"
        return text + (f" + {parts.words()}" if parts.total else "")


def spend_story(shard_paths: list[Path], live: bool = True, settle_s: float = 900.0 + ACCOUNT_LAG_S) -> SpendStory:
    """The money story of the API shards among ``shard_paths`` (``<results>/<dataset>/responses/shard-*.jsonl``),
    read from their journals and intents logs and the account ledger (``<results>/api_account.jsonl``); the account
    is read live (``GET /key``, the key from the variable the ledger names) when ``live`` and the key is set, else
    its last recorded reading is used."""
    import time
    from collections import defaultdict

    from aerie.api.journal import journal_path, jsonl_objects

    journaled: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    samples: dict[str, int] = defaultdict(int)
    results_dirs = set()
    for path in map(Path, shard_paths):
        journal = journal_path(path)
        records = jsonl_objects(journal) if journal.exists() else jsonl_objects(path)
        api = [r for r in records if r.get("backend") not in (None, "hf") and r.get("cost") is not None]
        if not api and not journal.exists():
            continue
        dataset = path.parent.parent.name
        results_dirs.add(path.parent.parent.parent)
        for r in api:
            journaled[dataset][r.get("provider") or r.get("backend") or "unknown"] += float(r["cost"])
            samples[dataset] += 1
    story = SpendStory({d: dict(p) for d, p in journaled.items()}, {})
    if len(results_dirs) != 1:
        return story
    results_dir = results_dirs.pop()
    ledger_all = [r for r in jsonl_objects(account_ledger_path(results_dir)) if r.get("format") == ACCOUNT_FORMAT]
    accounts = sorted({r["account"] for r in ledger_all if r.get("account")})
    if not accounts:
        return story
    figures, sources = [], []
    mean = {d: sum(p.values()) / samples[d] if samples[d] else 0.0 for d, p in journaled.items()}
    overall = sum(sum(p.values()) for p in journaled.values()) / max(1, sum(samples.values()))
    for account in accounts:
        ledger = [r for r in ledger_all if r["account"] == account]
        named = next((r["datasets"] for r in reversed(ledger) if r.get("datasets") is not None), None)
        datasets = [d for d in (named if named is not None else journaled) if (results_dir / d).is_dir()]
        usage = _live_usage(account) if live else None
        journal = sum(
            float(r.get("cost") or 0.0)
            for d in datasets
            for j in sorted((results_dir / d / "responses").glob("shard-*.journal.jsonl"))
            for r in jsonl_objects(j)
        )
        requests = {
            d: dataset_requests(results_dir / d / "responses", mean.get(d) or overall or 1.0, settle_s)
            for d in datasets
        }
        money = account_money(ledger, usage, journal, requests)
        if money is None:
            continue
        for d, parts in money.by_dataset.items():
            story.billed[d] = parts
        story.unattributed += money.unjournaled.unattributed
        story.pending += money.unjournaled.pending
        figures.append(money.usage - money.baseline_usage + money.baseline_journal + (journal - money.journal))
        sources.append(money.source)
    if figures:
        story.account = sum(figures)
        story.source = ", ".join(sorted(set(sources))) + f" ({time.strftime('%Y-%m-%d %H:%M')})"
    return story


def _live_usage(account: str) -> float | None:
    """The account's usage now, from its id (``<base_url> $<KEY_VARIABLE>``); None without the key or an answer."""
    base, _, variable = account.rpartition(" $")
    key = os.environ.get(variable)
    if not base or not key:
        return None
    try:
        reading = read_account_usage({"base_url": base, "api_key_env": variable}, key, timeout=10)
    except RuntimeError:
        return None
    return reading["usage"] if reading else None
