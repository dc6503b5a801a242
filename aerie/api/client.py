"""The async regeneration client: one aiohttp session, thousands of requests in flight, nothing paid twice.

``regenerate`` asks the target (through OpenRouter, any OpenAI-compatible server, or SGLang's ``/generate``) for
a response to every prompt of every shard it is given that the shard's journal does not already hold. It serves
every API dataset of a run at once (rule ``responses`` is one job per run, aerie.api.job), so the run has one
owner of its limits:

- one ``aiohttp.ClientSession``; at most ``concurrency`` requests in flight in all (worker coroutines, no task
  per sample, no semaphore churn), each dataset also within its own ``responses.concurrency``; datasets take
  turns (a pilot's small budget reaches every dataset), the shards of a dataset go in order (its quota cuts the
  last ones);
- connect and read timeouts; the request body serialized once; retries with exponential backoff and full
  jitter on 408/429/5xx, connection resets, torn bodies, timeouts and errors delivered inside HTTP 200;
  ``Retry-After`` honoured; 402 in-flight budget waited out; 400/401/403, credits/key-limit 402 and "no
  endpoints" stop the dataset with the server's message (in-flight requests still land in the journal);
- every finished sample goes to its shard's journal at once (aerie.api.journal); a shard output is published
  atomically only when its journal holds every sample (or its dataset's quota is reached);
- money: the budget and each dataset's output-token quota are checked before each request is admitted,
  counting every request in flight (all datasets) at its dataset's expected per-sample cost, so the overshoot
  is bounded by what is in flight: at most ``concurrency`` x (actual - expected cost per request). The spend
  counted is the journals' plus what the provider's account billed that no journal holds (``RunSpend``:
  billed retries, requests lost to interrupted runs, and requests sent before an interruption that the
  account does not show yet, priced at the expected cost), polled while running (``GET /key``); other runs
  on the same key (another results folder or config) count too: their spend and leases, from the key's ledger
  (aerie.api.key_ledger), and a request is admitted only inside a lease taken under the ledger's lock;
- before each request is sent an intent line goes to ``shard-NNNNN.intents.jsonl`` (and a line after each
  failure), so a restarted run knows which requests may have been billed without an answer;
- the budget is a stop (raise it and rerun); the output-token quota is not: a dataset whose
  ``max_output_tokens`` is reached is complete with the samples that fit, and its shards are published with
  them and a ``shard-NNNNN.completion.json`` that records why the others were not requested.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import ssl
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from aerie.api.backends import (
    BackendSettings,
    FatalError,
    RetryableError,
    classify_http_error,
    parse_chat_completion,
    parse_sglang_generate,
    request_body,
)
from aerie.api.journal import (
    BILLABLE_FAILURES,
    INTENT_FORMAT,
    Journal,
    intents_path,
    journal_path,
    messages_key,
    read_journal,
    unseen_intents,
)
from aerie.api.key_ledger import LEASE_REQUESTS, KeyLedger
from aerie.api.money import JOURNALED, PendingRequests, Unjournaled, split_unjournaled, usd
from aerie.artifacts import atomic_write_bytes
from aerie.formats.responses import COMPLETION_FORMAT, QUOTA_REASON, RESPONSES_FORMAT, write_completion


@dataclass
class ClientLimits:
    concurrency: int = 64
    connect_timeout: float = 30.0
    read_timeout: float = 600.0  # a long reasoning answer is one silent wait: be generous
    max_attempts: int = 8
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    progress_interval: float = 10.0
    # PEM file of the CAs to trust for HTTPS (a private CA, a proxy, a test server's self-signed certificate);
    # None: the system store, which honours SSL_CERT_FILE / SSL_CERT_DIR. Verification is never turned off.
    ca_bundle: str | None = None


def tls_context(ca_bundle: str | None) -> ssl.SSLContext:
    """The client's TLS context: certificate and host name checked against ``ca_bundle`` or the system store
    (loaded once per run, like aiohttp's own default context; it reads SSL_CERT_FILE / SSL_CERT_DIR)."""
    try:
        ctx = ssl.create_default_context(cafile=ca_bundle)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"CA bundle {ca_bundle}: cannot be read as PEM certificates ({e})") from None
    ctx.set_alpn_protocols(["http/1.1"])  # what aiohttp speaks; the same offer as its default context
    return ctx


def new_session_id() -> str:
    """Names this process's requests in intents and journal lines (with the attempt: one request of a sample)."""
    return f"{time.time_ns() // 1_000_000:x}-{os.getpid()}"


@dataclass
class MoneyGuard:
    """One dataset's money checks: the budget it is admitted against, its expected per-sample cost and output
    tokens (until 20 of its samples are measured in this run), its output-token quota and what the dataset used
    of it before. ``spent_before``, ``lost_usd`` and ``account`` are the run's spend for a caller that runs one
    shard alone (``regenerate_shard``); a whole run passes them in a ``RunSpend``."""

    budget_usd: float | None = None
    spent_before: float = 0.0
    expected_cost: float = 0.0
    token_cap: int | None = None  # this dataset's output-token cap
    tokens_before: int = 0  # this dataset's journaled output tokens
    expected_tokens: float = 0.0
    lost_usd: float = 0.0
    account: AccountWatcher | None = None


class AccountWatcher:
    """Polls a provider account's usage (``GET /key``) and keeps the run's figure of the spend no journal holds.

    ``baseline_usage`` / ``baseline_journal`` are the account's usage and its journals' total at the run's first
    start (aerie.api.money's account ledger); what the account billed beyond the journals = account growth since
    then - journal growth. ``floor`` is that figure at this job's start, when none of its own requests was in
    flight; a poll while running also counts answers billed but still on their way to the journal (at most the
    requests in flight), so each poll replaces the previous one and never goes below the floor. ``pending``:
    requests sent before an interruption that the account may not show yet, priced at their expected cost until
    they settle; the figure is never below ``pending.before + pending.cost(now)``. ``weights`` (retry, lost) name
    what the account showed at the start (``split_unjournaled``); what it bills later is named by this job's own
    billable failures (``retried``) and the requests pending at the start. ``record(usage, journal, figure)``
    appends a reading to the ledger.
    """

    def __init__(
        self,
        url: str,
        baseline_usage: float,
        baseline_journal: float,
        record: Callable[[float, float, float], None] | None = None,
        floor: float = 0.0,
        pending: PendingRequests | None = None,
        headers: dict[str, str] | None = None,
        ca_bundle: str | None = None,
        weights: tuple[float, float] = (0.0, 0.0),
    ):
        self.url, self.baseline_usage, self.baseline_journal = url, baseline_usage, baseline_journal
        self.floor, self.pending, self.headers, self.ca_bundle = floor, pending, headers or {}, ca_bundle
        self.weights = weights
        self.retried = 0.0  # expected cost of this job's failed requests the provider may have billed
        # What other runs on the key journaled since this job's first reading of the account (their entries in the
        # key's ledger, aerie.api.key_ledger): their answers are in the account's growth too, and counted already.
        self.others_spent: Callable[[], float] = lambda: 0.0
        self.started = time.time()
        self._record = record
        self.billed = floor  # what the account shows beyond the journals, at the last reading
        self.lost = self.figure(floor)
        # Whether the last reading was taken with nothing of this job in flight (then it holds none of its own
        # answers billed and not journaled yet: what a final budget stop must be decided on).
        self.exact = True
        self.polls = 0
        self.errors = 0

    def unexplained(self, usage: float, journal_spend: float) -> float:
        growth = (usage - self.baseline_usage) - (journal_spend - self.baseline_journal)
        return max(0.0, growth - self.others_spent())

    def figure(self, billed: float) -> float:
        """What the budget counts: the billed figure, or what the pending requests may still add, if more."""
        if self.pending is None:
            return billed
        return max(billed, self.pending.before + self.pending.cost())

    def words(self) -> str:
        """The figure in named parts: what the account showed at the start split by the run's history (the start's
        ``weights``), what it billed since split between this job's billable failures (``retried``) and the requests
        that were pending at the start, and what is still priced as pending."""
        at_start = split_unjournaled(self.floor, *self.weights)
        pending_then = self.pending.cost(self.started) if self.pending is not None else 0.0
        since = split_unjournaled(self.billed - self.floor, self.retried, pending_then)
        parts = Unjournaled(
            at_start.retries + since.retries,
            at_start.lost + since.lost,
            at_start.unattributed + since.unattributed,
            max(0.0, self.lost - self.billed),
        )
        return parts.words()

    async def poll(self, session: aiohttp.ClientSession, journal_spend: float, in_flight: int = 0) -> None:
        """Read the account; ``in_flight``: this job's requests in flight while it is read."""
        try:
            async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=15), headers=self.headers) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            body = None
        usage = ((body or {}).get("data") or {}).get("usage") if isinstance(body, dict) else None
        if usage is None:
            self.errors += 1  # the last known figure stands; the journals still count live
            return
        self.polls += 1
        self.exact = in_flight == 0
        self.billed = max(self.floor, self.unexplained(float(usage), journal_spend))
        self.lost = self.figure(self.billed)
        if self._record is not None:
            self._record(float(usage), journal_spend, self.lost)


class RunSpend:
    """The run's spend as the budget sees it: per account, the journals at the start (``before``) and what this
    process journaled since; plus, per account, what its ``AccountWatcher`` counts beyond the journals, and a
    fixed ``lost_usd`` (a one-shard caller's reconcile). ``keys``: per account, the key's ledger (other runs on the
    same key: what their jobs spent and their leases count against the budget too)."""

    def __init__(
        self,
        before: dict[str | None, float] | None = None,
        watchers: dict[str, AccountWatcher] | None = None,
        lost_usd: float = 0.0,
        keys: dict[str, KeyLedger] | None = None,
    ):
        self.before = dict(before or {})
        self.now: dict[str | None, float] = {}
        self.watchers = dict(watchers or {})
        self.fixed_lost = lost_usd
        self.keys = dict(keys or {})

    def others(self) -> float:
        """What the other runs on this run's keys spent (their open jobs, and those that left since this one
        started), plus what their leases still hold."""
        return sum(k.others.committed for k in self.keys.values())

    def others_in_flight(self) -> bool:
        """Whether a live run on one of the keys holds a lease (its answers come back, or it gives it back)."""
        return any(k.others.live_reserved > 1e-12 for k in self.keys.values())

    def add(self, account: str | None, cost: float) -> None:
        self.now[account] = self.now.get(account, 0.0) + cost

    def retried(self, account: str | None, cost: float) -> None:
        """A request of ``account`` failed after the provider could bill it (aerie.api.journal.BILLABLE_FAILURES)."""
        if account in self.watchers:
            self.watchers[account].retried += cost

    def journals(self, account: str | None) -> float:
        return self.before.get(account, 0.0) + self.now.get(account, 0.0)

    def lost(self) -> float:
        return self.fixed_lost + sum(w.lost for w in self.watchers.values())

    def journaled(self) -> float:
        return sum(self.before.values()) + sum(self.now.values())

    def spent(self) -> float:
        """Every journal's spend plus the spend only the accounts saw (or may still bill)."""
        return self.journaled() + self.lost()

    def words(self) -> str:
        """``$1.23 journaled + $0.40 lost to interrupted requests`` (the parts that are not zero)."""
        parts = [f"{usd(self.journaled())} {JOURNALED}"]
        if self.fixed_lost:
            parts.append(Unjournaled(lost=self.fixed_lost).words())
        parts += [w.words() for w in self.watchers.values() if w.lost >= 5e-5]  # what prints as $0.0000: noise
        return " + ".join(parts)

    def others_words(self) -> str:
        """`` + $0.30 by other runs on the key (1 open; spent + leased)``, or ``""``."""
        runs = sum(k.others.runs for k in self.keys.values())
        if self.others() <= 0 and not runs:
            return ""
        return f" + {usd(self.others())} by other runs on the key ({runs} open; spent + leased)"


@dataclass
class RunStats:
    total: int = 0
    already: int = 0
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    cost: float = 0.0
    completion_tokens: int = 0
    retries: Counter = field(default_factory=Counter)
    final_errors: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def line(self, name: str, spend: RunSpend, budget: float | None) -> str:
        n = self.already + self.done
        frac = n / self.total if self.total else 1.0
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        elapsed = max(time.monotonic() - self.started, 1e-9)
        money = f"run {usd(spend.spent())}" + (f" of ${budget:.2f}" if budget is not None else "")
        if spend.lost() > 0:
            money += f" ({spend.words()})"
        retries = " ".join(f"{k}:{v}" for k, v in sorted(self.retries.items())) or "0"
        return (
            f"{name} [{bar}] {n}/{self.total} {100 * frac:.0f}% | {self.done / elapsed:.1f} req/s "
            f"{self.completion_tokens / elapsed:.0f} tok/s | {usd(self.cost)} now, {money} "
            f"| retries {retries} | failed {self.failed} | in flight {self.in_flight}"
        )


class RegenerationStopped(RuntimeError):
    """A shard is incomplete (budget, fatal error or failures); the journal keeps what finished."""


# SGLang's /generate takes token ids: the chat template renders the prompt, and the answer's ids are split
# into reasoning and content by the template's markers.
RenderIds = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]
SplitIds = Callable[[list[int]], dict[str, Any]]


@dataclass
class ShardWork:
    """One shard of a run: its prompts, its published path (the journal and intents log lie beside it), its log."""

    prompts: list[dict[str, Any]]
    out_path: Path
    log: Callable[[str], None] | None = None  # the shard's own log file (its lines go to the run's log as well)


@dataclass
class Lane:
    """One dataset's requests in a run: how they are made and read, their limits and money checks, its shards
    (requested in this order)."""

    dataset: str
    settings: BackendSettings
    shards: list[ShardWork]
    limits: ClientLimits = field(default_factory=ClientLimits)
    guard: MoneyGuard = field(default_factory=MoneyGuard)
    api_key: str | None = None
    account: str | None = None  # which account of the RunSpend its spend counts for
    want_reasoning: bool = True
    render_ids: RenderIds | None = None
    split_ids: SplitIds | None = None
    eos_ids: list[int] | None = None


@dataclass
class _Sample:
    prompt: dict[str, Any]
    body: bytes
    prompt_ids: list[int] | None


@dataclass
class _Shard:
    """A shard while it runs: its journal and intents log, the journal lines of every finished sample, its
    figures."""

    work: ShardWork
    name: str  # <dataset>/shard-NNNNN, for log lines
    log: Callable[[str], None]
    lines: dict[str, bytes]
    stats: RunStats
    journal: Journal | None = None
    intents: Journal | None = None


class _LaneRun:
    """A dataset while the run goes: its queue (shard, prompt) in shard order, what it has in flight and
    finished, and why it stopped (``quota``: the dataset is complete; ``budget``; ``fatal``)."""

    def __init__(self, lane: Lane, shards: list[_Shard], pending: deque[tuple[_Shard, dict[str, Any]]]):
        self.lane, self.shards, self.queue = lane, shards, pending
        s = lane.settings
        self.headers = {"Content-Type": "application/json", **(s.extra_headers or {})}
        if lane.api_key:
            self.headers["Authorization"] = f"Bearer {lane.api_key}"
        self.ssl = tls_context(lane.limits.ca_bundle)
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=lane.limits.connect_timeout, sock_read=lane.limits.read_timeout
        )
        self.url, self.sampling, self.phash = s.url(), s.sampling(), s.params_hash()
        self.in_flight = self.done = self.tokens = 0
        self.cost = 0.0
        self.stats = RunStats(
            total=sum(sh.stats.total for sh in shards), already=sum(sh.stats.already for sh in shards)
        )
        self.stop_kind: str | None = None
        self.stop_reason: str | None = None

    def per_cost(self) -> float:
        """Expected cost of its next request: the mean of this run's answers once 20 are in, else the estimate."""
        return self.cost / self.done if self.done >= 20 else self.lane.guard.expected_cost

    def per_tokens(self) -> float:
        return self.tokens / self.done if self.done >= 20 else self.lane.guard.expected_tokens


def _backoff(attempt: int, limits: ClientLimits, retry_after: float | None) -> float:
    if retry_after is not None:
        return min(retry_after, limits.backoff_max * 5)  # the server's word, within reason
    return random.uniform(0, min(limits.backoff_max, limits.backoff_base * 2 ** (attempt - 1)))


def _open_shard(lane: Lane, work: ShardWork, run_log: Callable[[str], None]) -> tuple[_Shard, list[dict[str, Any]]]:
    """Read a shard's journal back (cutting a torn tail) and say what is left to request."""
    name = f"{lane.dataset}/{work.out_path.name.removesuffix('.jsonl')}"
    own = work.log

    def log(msg: str) -> None:
        run_log(msg)
        if own is not None:
            own(msg)

    prompts, out_path, settings = work.prompts, work.out_path, lane.settings
    jpath = journal_path(out_path)
    # Prompt texts are compared only against an existing journal (a fresh shard skips the work).
    has_journal = jpath.exists() and jpath.stat().st_size > 0
    keys = {p["id"]: messages_key(p["messages"], p.get("tools")) for p in prompts} if has_journal else {}
    state = read_journal(jpath, settings.params_hash(), keys, repair=True)
    if state.torn_bytes:
        log(f"{name}: cut a torn last journal line ({state.torn_bytes} bytes): that sample is requested again")
    if state.stale:
        log(f"{name}: {state.stale} journaled responses are for other parameters or prompt text: not reused")
    pending = [p for p in prompts if p["id"] not in state.finished]
    unseen = unseen_intents(intents_path(out_path), state)
    if unseen:
        log(
            f"{name}: {len(unseen)} samples were sent before an interruption and never answered here "
            f"(they may have been billed unseen; the account reconcile counts that money): "
            f"{', '.join(sorted(unseen)[:5])}{' ...' if len(unseen) > 5 else ''}"
        )
    stats = RunStats(total=len(prompts), already=len(prompts) - len(pending))
    log(
        f"{name}: {stats.already} of {len(prompts)} samples already journaled, {len(pending)} to request "
        f"({settings.backend} {settings.model} at {settings.base_url}, concurrency {lane.limits.concurrency})"
    )
    shard = _Shard(work, name, log, state.lines, stats)
    if pending:
        shard.journal, shard.intents = Journal(jpath), Journal(intents_path(out_path))
    return shard, pending


async def regenerate(
    lanes: list[Lane],
    *,
    concurrency: int,
    spend: RunSpend | None = None,
    progress_interval: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[Path, dict[str, Any] | str]:
    """Finish every shard of ``lanes``: publish each when its journal holds every prompt, or when its dataset's
    output-token quota stopped it (then with the samples that fit). Returns, per shard output path, its summary
    (published) or the reason it is not finished; a shard is never left half-published."""
    spend = spend or RunSpend()
    session_id = new_session_id()
    runs: list[_LaneRun] = []
    try:
        for lane in lanes:
            shards, queue = [], deque()
            for work in lane.shards:
                shard, pending = _open_shard(lane, work, log)
                shards.append(shard)
                queue.extend((shard, p) for p in pending)
            runs.append(_LaneRun(lane, shards, queue))
        if any(r.queue for r in runs):
            await _run(runs, concurrency, spend, session_id, progress_interval, log)
    finally:
        for r in runs:
            for shard in r.shards:
                for j in (shard.journal, shard.intents):
                    if j is not None:
                        await j.aclose()
    return {shard.work.out_path: _finish_shard(r, shard) for r in runs for shard in r.shards}


def _finish_shard(run: _LaneRun, shard: _Shard) -> dict[str, Any] | str:
    """Publish a shard whose journal holds every prompt (or every prompt its dataset's quota admitted), with its
    completion record first; else say why it is not finished."""
    prompts, out_path, guard, stats = shard.work.prompts, shard.work.out_path, run.lane.guard, shard.stats
    missing = [p["id"] for p in prompts if p["id"] not in shard.lines]
    summary = {
        "samples": len(prompts),
        "already_journaled": stats.already,
        "requested_now": stats.done,
        "missing": len(missing),
        "cost_usd_now": round(stats.cost, 6),
        "completion_tokens_now": stats.completion_tokens,
        "retries": dict(stats.retries),
        "final_errors": dict(stats.final_errors),
        "flags_now": dict(stats.flags),
        "seconds": round(time.monotonic() - stats.started, 2),
    }
    shard.log(f"{shard.name}: {json.dumps(summary)}")
    quota_done = run.stop_kind == "quota" and not stats.failed
    if missing and not quota_done:
        failures = ", ".join(f"{k}: {v}" for k, v in stats.final_errors.items())
        return (
            run.stop_reason
            or f"{len(missing)} samples have no response after "
            f"responses.max_attempts attempts ({failures}); rerun to retry only them"
        )
    kept = [p["id"] for p in prompts if p["id"] in shard.lines]
    kept_records = [json.loads(shard.lines[i]) for i in kept]
    completion = {
        "format": COMPLETION_FORMAT,
        "shard": out_path.name,
        "prompts": len(prompts),
        "samples": len(kept),
        "not_requested": len(missing),
        "reason": QUOTA_REASON if missing else None,
        "max_output_tokens": guard.token_cap,
        "dataset_output_tokens": guard.tokens_before + run.tokens,
        "shard_output_tokens": sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in kept_records),
        "shard_cost_usd": round(sum(float(r.get("cost") or 0.0) for r in kept_records), 6),
    }
    if missing:
        shard.log(
            f"{shard.name}: the dataset's max_output_tokens quota ({guard.token_cap:,}) is reached: the shard is "
            f"complete with {len(kept)} of {len(prompts)} samples; {len(missing)} prompts not requested"
        )
    summary["completion"] = completion
    # The completion record first: a published shard always has it beside it.
    write_completion(out_path, completion)
    # The journal lines verbatim, in prompt order: nothing is serialized twice.
    atomic_write_bytes(out_path, b"".join(shard.lines[i] for i in kept))
    return summary


async def _run(
    runs: list[_LaneRun],
    concurrency: int,
    spend: RunSpend,
    session_id: str,
    progress_interval: float | None,
    log: Callable[[str], None],
) -> None:
    """Request every pending prompt of every lane, at most ``concurrency`` in flight in all, until all are done
    or stopped."""
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, ttl_dns_cache=300)
    # No cookie jar: an API client has no use for cookies, and the jar costs time on every response.
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), raise_for_status=False
    ) as session:
        await _Dispatch(runs, spend, session, session_id, log).run(concurrency, progress_interval)


# How often a job refreshes its entries in the key ledgers and re-checks a budget another run's leases hold.
KEY_SYNC_S = 0.5


class _Dispatch:
    """One responses run's requests: admission against the budget and quotas, the workers, retries, the account
    readings and the progress lines. The outline is :meth:`run`; each step below has one job.

    Admission counts what is in flight at the expected per-sample figure, so the overshoot is at most the
    difference between the expected and the actual cost of the requests in flight. A request that would only fit
    once some in flight come back (shorter than expected) waits for them; the stop is final only when nothing is in
    flight and one more request still does not fit. (Stopping at the first refusal would end a dataset whose quota
    equals concurrency x expected length after its first wave.) Waiting workers are woken one at a time - by a
    request coming back, a reading of the account - and each that is admitted wakes the next, so a wake-up costs
    what it admits plus one check, not one check per waiting worker (2,000 of them near the end of a budget).
    """

    def __init__(
        self,
        runs: list[_LaneRun],
        spend: RunSpend,
        session: aiohttp.ClientSession,
        session_id: str,
        log: Callable[[str], None],
    ) -> None:
        self.runs, self.spend, self.session, self.session_id, self.log = runs, spend, session, session_id, log
        self.in_flight = 0  # the run's, every lane together
        self.waiters: deque[asyncio.Future] = deque()
        self.refreshing: asyncio.Future | None = None
        self.turn = 0  # the lane a worker looks at first: datasets take turns
        # Each account is read on a connection of its own: with every request slot busy, a poll through the
        # main pool would wait for a free one and see the account only when the run is over.
        self.accounts = {
            name: aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, ssl=tls_context(w.ca_bundle)),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            for name, w in spend.watchers.items()
        }

    # ---- the outline ---------------------------------------------------------------------------------------

    async def run(self, concurrency: int, progress_interval: float | None) -> None:
        runs = self.runs
        interval = progress_interval or min(r.lane.limits.progress_interval for r in runs)
        workers = min(concurrency, sum(min(len(r.queue), r.lane.limits.concurrency) for r in runs))
        reporter = asyncio.create_task(self.report_progress(interval))
        sharer = asyncio.create_task(self.share_keys()) if self.spend.keys else None
        try:
            await asyncio.gather(*(self.worker() for _ in range(workers)))
            reporter.cancel()
            # A last reading with nothing of this job in flight (what the account shows lags by seconds).
            for name, watcher in self.spend.watchers.items():
                await watcher.poll(self.accounts[name], self.spend.journals(name))
        finally:
            reporter.cancel()
            if sharer is not None:
                sharer.cancel()
            if self.refreshing is not None:
                self.refreshing.cancel()
            for account in self.accounts.values():
                await account.close()
        self.progress_lines()

    async def worker(self) -> None:
        while True:
            run, waiting = self.pick()
            if run is None:
                if not waiting:
                    self.wake(len(self.waiters))  # nothing left for anyone: the others see it too
                    return
                await self.wait_for_room()
                continue
            self.wake()  # admitted: there may be room for the next waiting worker as well
            shard, prompt = run.queue.popleft()
            self.count_in_flight(run, shard, +1)
            record = None
            try:
                record = await self.request(run, shard, self.make_sample(run, prompt))
            finally:
                self.count_in_flight(run, shard, -1)
                if record is not None:
                    self.keep(run, shard, record)
                self.wake()  # after the figures: a waiting worker re-checks against the actual cost

    # ---- admission -----------------------------------------------------------------------------------------

    def pick(self) -> tuple[_LaneRun | None, bool]:
        """The next lane that admits a request (advancing the turn), and whether any lane may admit one later."""
        waiting = False
        runs, n = self.runs, len(self.runs)
        spent = self.spend.spent()
        reserved = sum(r.in_flight * r.per_cost() for r in runs)
        for i in range(n):
            run = runs[(self.turn + i) % n]
            if run.stop_kind is not None or not run.queue:
                continue
            if run.in_flight >= run.lane.limits.concurrency:
                waiting = True
                continue
            verdict = self.admit(run, spent, reserved)
            if verdict == "go":
                self.turn = (self.turn + i + 1) % n
                return run, True
            waiting |= verdict == "wait"
        return None, waiting

    def admit(self, run: _LaneRun, spent: float, reserved: float) -> str:
        """ "go", "wait" (room may open when requests in flight come back) or "stop" (halted); ``spent``: the run's
        spend, ``reserved``: every request in flight at its dataset's expected cost."""
        guard = run.lane.guard
        if guard.budget_usd is not None and not self.fits_budget(run, spent, reserved):
            if (key := self.spend.keys.get(run.lane.account)) is not None:
                key.give_back(*self.committed(run.lane.account))  # two runs must not wait on each other's headroom
            if self.in_flight > 0 or self.spend.others_in_flight():
                return "wait"
            if any(not w.exact for w in self.spend.watchers.values()):
                # The account was last read with requests in flight: it may count some of their answers twice
                # (billed, not yet journaled). Read it again before a final stop.
                if self.refreshing is None:
                    self.refreshing = asyncio.ensure_future(self.refresh())
                return "wait"
            self.halt(
                run,
                f"budget: {usd(spent)} spent ({self.spend.words()}){self.spend.others_words()} of responses.budget_usd "
                f"${guard.budget_usd:.2f}; finished samples are kept in the journal - raise the budget and rerun to "
                "finish the rest",
                "budget",
            )
            return "stop"
        if guard.token_cap is not None:
            used = guard.tokens_before + run.tokens
            if used + (run.in_flight + 1) * run.per_tokens() > guard.token_cap:
                if run.in_flight > 0:
                    return "wait"
                self.halt(
                    run,
                    f"output-token quota: {used:,} of the dataset's max_output_tokens {guard.token_cap:,} used; "
                    "the dataset is complete with the samples that fit",
                    "quota",
                )
                return "stop"
        return "go"

    def fits_budget(self, run: _LaneRun, spent: float, reserved: float) -> bool:
        """Whether the next request of ``run`` fits the budget with what the other runs on its key hold; on a key
        with a ledger it must also fit this job's lease, else a new lease is taken under the ledger's lock."""
        budget, per = run.lane.guard.budget_usd, run.per_cost()
        key = self.spend.keys.get(run.lane.account)
        if key is None:
            return spent + reserved + self.spend.others() + per <= budget
        if spent + reserved + per > budget:
            return False
        mine, committed = self.committed(run.lane.account)
        if key.covers(committed + per):
            # The lease was granted under the lock with every run's figures, so the others' do not count again
            # (they would also count a lease's own unused headroom against it).
            return True
        return key.take(
            mine,
            committed,
            per,
            lambda: budget - spent - reserved - self.spend.others(),
            per * min(LEASE_REQUESTS, run.lane.limits.concurrency),
        )

    def committed(self, account: str | None) -> tuple[float, float]:
        """This job's spend on ``account`` (journaled since it started), and that plus its requests in flight there
        at the expected cost: what its lease on the key's ledger must cover."""
        mine = self.spend.now.get(account, 0.0)
        return mine, mine + sum(r.in_flight * r.per_cost() for r in self.runs if r.lane.account == account)

    async def share_keys(self) -> None:
        """Keep this job's entries in the key ledgers current (spend, heartbeat; an idle lane gives back its lease
        headroom), and wake a waiting worker: another run's spend or leases may have moved."""
        while True:
            await asyncio.sleep(KEY_SYNC_S)
            for account, key in self.spend.keys.items():
                mine, committed = self.committed(account)
                busy = any(r.queue and r.stop_kind is None for r in self.runs if r.lane.account == account)
                key.sync(mine, committed, busy)
            self.wake()

    def halt(self, run: _LaneRun, reason: str, kind: str = "fatal") -> None:
        if run.stop_kind is None:
            run.stop_reason, run.stop_kind = reason, kind
            self.log(f"{run.lane.dataset}: STOPPING: {reason}")
            for shard in run.shards:
                if shard.work.log is not None:
                    shard.work.log(f"{shard.name}: STOPPING: {reason}")
        self.wake(len(self.waiters))  # workers waiting for room see the stop at once

    def wake(self, n: int = 1) -> None:
        while n > 0 and self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                n -= 1

    async def wait_for_room(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        await waiter

    async def refresh(self) -> None:
        for name, watcher in self.spend.watchers.items():
            await watcher.poll(self.accounts[name], self.spend.journals(name), self.in_flight)
            watcher.exact = True  # read again, or unreadable: the figure stands either way
        self.refreshing = None
        self.wake()

    # ---- one request ---------------------------------------------------------------------------------------

    def make_sample(self, run: _LaneRun, p: dict[str, Any]) -> _Sample:
        # Built when a worker takes the prompt, so 20,000 bodies are not serialized before the first request.
        lane = run.lane
        ids = lane.render_ids(p["messages"], p.get("tools")) if lane.settings.backend == "sglang" else None
        body = request_body(lane.settings, p["messages"], ids, tools=p.get("tools"))
        return _Sample(p, json.dumps(body, ensure_ascii=False).encode(), ids)

    async def request(self, run: _LaneRun, shard: _Shard, sample: _Sample) -> dict[str, Any] | None:
        """The sample's record, retrying what may succeed on a retry; None when it failed for good or the run
        stopped (the intents log says how)."""
        limits, sid = run.lane.limits, sample.prompt["id"]
        attempt = 0
        while True:
            attempt += 1
            t0 = time.monotonic()
            # Before the request leaves: if this process dies while it is in flight, the next run knows the
            # sample may have been billed without an answer.
            self.intent(shard, "sent", sid, attempt, params_hash=run.phash)
            try:
                fields = await self.send(run, sample)
            except RetryableError as e:
                kind, message, wait = e.kind, str(e), e.retry_after
            except aiohttp.ClientPayloadError as e:
                kind, message, wait = "torn", f"torn body: {e}", None
            except aiohttp.ClientConnectorCertificateError as e:
                # A certificate the client does not trust will not be trusted on a retry either.
                self.fail_for_good(shard, sid, attempt, "tls_certificate")
                self.halt(
                    run,
                    f"the server's TLS certificate is not trusted ({e.certificate_error}); if it is yours, "
                    "name its CA file in responses.ca_bundle (or SSL_CERT_FILE); verification is never off",
                )
                return None
            except TimeoutError:  # before the connection errors: aiohttp's read timeout is one of them too
                kind, message, wait = "timeout", f"no answer within {limits.read_timeout:g}s", None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionError) as e:
                kind, message, wait = "connection", f"{type(e).__name__}: {e}", None
            except FatalError as e:
                self.fail_for_good(shard, sid, attempt, e.kind)
                self.halt(run, str(e))
                return None
            else:
                return self.record(run, sample, fields, attempt, time.monotonic() - t0)
            if not await self.retry_after_failure(run, shard, sid, attempt, kind, message, wait):
                return None

    async def send(self, run: _LaneRun, sample: _Sample) -> dict[str, Any]:
        """One HTTP request: the answer's fields, or the error that classifies the failure."""
        lane = run.lane
        async with self.session.post(
            run.url, data=sample.body, headers=run.headers, timeout=run.timeout, ssl=run.ssl
        ) as resp:
            raw = await resp.read()
            status, retry_after = resp.status, resp.headers.get("Retry-After")
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            if status == 200:
                raise RetryableError("torn", f"unparseable 200 body ({len(raw)} bytes)") from None
            body = None
        if status != 200:
            raise classify_http_error(status, body, raw[:300].decode("utf-8", "replace"), retry_after)
        if lane.settings.backend == "sglang":
            return parse_sglang_generate(body, lane.split_ids, lane.eos_ids or [], lane.want_reasoning)
        return parse_chat_completion(body, lane.want_reasoning)

    async def retry_after_failure(
        self, run: _LaneRun, shard: _Shard, sid: str, attempt: int, kind: str, message: str, wait: float | None
    ) -> bool:
        """Count a failed attempt, back off; whether to try again."""
        self.intent(shard, "failed", sid, attempt, kind=kind)
        if kind in BILLABLE_FAILURES:
            self.spend.retried(run.lane.account, run.per_cost())
        shard.stats.retries[kind] += 1
        run.stats.retries[kind] += 1
        if attempt >= run.lane.limits.max_attempts:
            shard.stats.final_errors[kind] += 1
            shard.stats.failed += 1
            run.stats.failed += 1
            shard.log(f"{shard.name}: sample {sid} failed {attempt} times, last: {message}")
            return False
        await asyncio.sleep(_backoff(attempt, run.lane.limits, wait))
        # A fatal or budget stop: do not keep hammering; the sample stays pending for the next run. (A quota stop
        # retries: this request was admitted within the quota, and the shard is published as complete only if
        # every admitted request has its answer.)
        return not (run.stop_kind in ("budget", "fatal") and kind != "402_in_flight")

    def fail_for_good(self, shard: _Shard, sid: str, attempt: int, kind: str) -> None:
        self.intent(shard, "failed", sid, attempt, kind=kind)
        shard.stats.final_errors[kind] += 1

    def intent(self, shard: _Shard, event: str, sid: str, attempt: int, **extra: Any) -> None:
        """A line of the intents log (docs/formats.md): a request sent, or one that ended without an answer."""
        shard.intents.append(
            {"format": INTENT_FORMAT, "event": event, "session": self.session_id, "id": sid, "attempt": attempt}
            | extra
            | {"t": round(time.time(), 3)}
        )

    def record(
        self, run: _LaneRun, sample: _Sample, fields: dict[str, Any], attempt: int, latency: float
    ) -> dict[str, Any]:
        """The journal record of an answered sample (docs/formats.md, aerie.responses)."""
        lane, prompt = run.lane, sample.prompt
        return {
            "format": RESPONSES_FORMAT,
            "id": prompt["id"],
            "dataset": prompt.get("dataset"),
            "messages": prompt["messages"],
            **({"tools": prompt["tools"]} if prompt.get("tools") else {}),
            "backend": lane.settings.backend,
            "model": lane.settings.model,
            "params": run.sampling,
            "params_hash": run.phash,
            **fields,
            **({"prompt_token_ids": sample.prompt_ids} if sample.prompt_ids is not None else {}),
            "latency_s": round(latency, 3),
            "attempts": attempt,
            "session": self.session_id,
        }

    # ---- the figures ---------------------------------------------------------------------------------------

    def count_in_flight(self, run: _LaneRun, shard: _Shard, n: int) -> None:
        run.in_flight += n
        self.in_flight += n
        shard.stats.in_flight += n
        run.stats.in_flight += n

    def keep(self, run: _LaneRun, shard: _Shard, record: dict[str, Any]) -> None:
        """Journal an answer and add it to the shard's, the lane's and the run's figures."""
        shard.lines[record["id"]] = shard.journal.append(record)
        tokens = int((record.get("usage") or {}).get("completion_tokens") or 0)
        for stats in (shard.stats, run.stats):
            stats.done += 1
            stats.cost += record["cost"]
            stats.completion_tokens += tokens
        for flag in record["flags"]:
            shard.stats.flags[flag] += 1
        run.done += 1
        run.cost += record["cost"]
        run.tokens += tokens
        self.spend.add(run.lane.account, record["cost"])

    def progress_lines(self) -> None:
        for run in self.runs:
            if run.queue or run.in_flight or run.stats.done:
                self.log(run.stats.line(run.lane.dataset, self.spend, run.lane.guard.budget_usd))

    async def report_progress(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for name, watcher in self.spend.watchers.items():
                await watcher.poll(self.accounts[name], self.spend.journals(name), self.in_flight)
            self.wake()  # the figures may have moved either way
            self.progress_lines()


async def regenerate_shard(
    prompts: list[dict[str, Any]],
    out_path: Path,
    settings: BackendSettings,
    *,
    api_key: str | None,
    limits: ClientLimits,
    guard: MoneyGuard,
    want_reasoning: bool = True,
    render_ids: RenderIds | None = None,
    split_ids: SplitIds | None = None,
    eos_ids: list[int] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One shard alone (``regenerate`` with one lane): publish ``out_path`` when every prompt has a journaled
    response, or when the output-token quota stopped it (then with the samples that fit).

    Raises RegenerationStopped (after everything in flight has been journaled) when it cannot finish.
    """
    lane = Lane(
        dataset=out_path.parent.parent.name or "shard",
        settings=settings,
        shards=[ShardWork(prompts, out_path)],
        limits=limits,
        guard=guard,
        api_key=api_key,
        account="account" if guard.account is not None else None,
        want_reasoning=want_reasoning,
        render_ids=render_ids,
        split_ids=split_ids,
        eos_ids=eos_ids,
    )
    spend = RunSpend(
        {lane.account: guard.spent_before},
        {"account": guard.account} if guard.account is not None else None,
        lost_usd=guard.lost_usd,
    )
    result = (await regenerate([lane], concurrency=limits.concurrency, spend=spend, log=log))[out_path]
    if isinstance(result, str):
        raise RegenerationStopped(result)
    return result
