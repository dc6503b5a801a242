"""The async regeneration client: one aiohttp session, thousands of requests in flight, nothing paid twice.

``regenerate`` asks the target (through OpenRouter, any OpenAI-compatible server, or SGLang's ``/generate``) for
a response to every prompt of every shard it is given that the shard's journal does not already hold. It serves
every API dataset of a run at once (rule ``responses`` is one job per run, aerie.responses.api.job), so the run has one
owner of its limits:

- one ``aiohttp.ClientSession``; at most ``concurrency`` requests in flight in all (worker coroutines, no task
  per sample, no semaphore churn), each dataset also within its own ``responses.concurrency``; datasets take
  turns (a pilot's small budget reaches every dataset), the shards of a dataset go in order (its quota cuts the
  last ones); a dataset in ``responses.mode: batch`` sends its requests as batches instead
  (aerie.responses.api.batches), under the same budget, quota and key ledger;
- connect and read timeouts; the request body serialized once; retries with exponential backoff and full
  jitter on 408/429/5xx, connection resets, torn bodies, timeouts and errors delivered inside HTTP 200;
  ``Retry-After`` honoured; 402 in-flight budget waited out; 400/401/403, credits/key-limit 402 and "no
  endpoints" stop the dataset with the server's message (in-flight requests still land in the journal);
- every finished sample goes to its shard's journal at once (aerie.responses.api.journal); a shard output is published
  atomically only when its journal holds every sample (or its dataset's quota is reached);
- money: the budget and each dataset's output-token quota are checked before each request (or batch) is admitted,
  counting every request in flight (all datasets) at its dataset's expected per-sample cost and every batch in
  flight at its maximum cost, so the overshoot is bounded by what is in flight: at most ``concurrency`` x (actual
  - expected cost per request). The spend counted is the journals' plus this folder's share of what the account
  billed beyond every journal on the key (aerie.responses.api.spend, aerie.responses.api.key_books), polled while
  running; other runs on the same key count too: their spend and leases, from the key's ledger
  (aerie.responses.api.key_ledger), and a request is admitted only inside a lease taken under the ledger's lock;
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
import ssl
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from aerie.formats.responses import COMPLETION_FORMAT, QUOTA_REASON, RESPONSES_FORMAT, write_completion
from aerie.responses.api.backends import Answer, BackendSettings, request_body
from aerie.responses.api.batches import BatchLaneState, OpenBatch, open_batches, run_batch_lane
from aerie.responses.api.journal import (
    BILLABLE_FAILURES,
    INTENT_FORMAT,
    Journal,
    intents_path,
    journal_path,
    messages_key,
    read_journal,
    unseen_intents,
)
from aerie.responses.api.key_ledger import LEASE_REQUESTS
from aerie.responses.api.money import usd
from aerie.responses.api.settings import ClientLimits, backoff_seconds
from aerie.responses.api.spend import MoneyGuard, RunSpend
from aerie.responses.api.wire import FatalError, RetryableError, classify_http_error
from aerie.tools.artifacts import atomic_write_bytes


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
class ShardStats:
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


class RegenerationStopped(RuntimeError):
    """A shard is incomplete (budget, fatal error or failures); the journal keeps what finished."""


# SGLang's /generate takes token ids: the chat template renders the prompt, and the answer's ids are split
# into reasoning and content by the template's markers.
RenderIds = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]
SplitIds = Callable[[list[int]], dict[str, Any]]


class Progress(Protocol):
    """What the client moves of the job's one progress printer (aerie.tools.progress.JobProgress)."""

    def postfix(self, **values: Any) -> None: ...


@dataclass
class ShardWork:
    """One shard of a run: its prompts, its published path (the journal and intents log lie beside it), its log."""

    prompts: list[dict[str, Any]]
    out_path: Path
    log: Callable[[str], None] | None = None  # the shard's own log file (its lines go to the run's log as well)


@dataclass
class Lane:
    """One dataset's requests in a run: how they are made and read, their limits and money checks, its shards
    (requested in this order); ``batch``: its batches' state in ``responses.mode: batch`` (None: streaming)."""

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
    batch: BatchLaneState | None = None


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
    stats: ShardStats
    journal: Journal | None = None
    intents: Journal | None = None
    tries: dict[str, int] = field(default_factory=dict)  # sample id -> attempts sent in batches (this job)
    _by_id: dict[str, dict[str, Any]] | None = None

    def prompt(self, sid: str) -> dict[str, Any]:
        """The prompt of a sample id (a batch's results come back by id, thousands at a time)."""
        if self._by_id is None:
            self._by_id = {p["id"]: p for p in self.work.prompts}
        return self._by_id[sid]


Queue = deque[tuple[_Shard, dict[str, Any]]]


class _LaneRun:
    """A dataset while the run goes: its queue (shard, prompt) in shard order, what it has in flight and
    finished, and why it stopped (``quota``: the dataset is complete; ``budget``; ``fatal``). In mode batch the
    queue feeds its batches and ``stream_queue`` takes the failed entries sent through the streaming path."""

    def __init__(self, lane: Lane, shards: list[_Shard], pending: Queue):
        self.lane, self.shards, self.queue = lane, shards, pending
        self.batch = lane.batch
        self.stream_queue: Queue = deque()
        s = lane.settings
        self.headers = {"Content-Type": "application/json", **(s.extra_headers or {})}
        if lane.api_key:
            self.headers["Authorization"] = f"Bearer {lane.api_key}"
        self.ssl = tls_context(lane.limits.ca_bundle)
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=lane.limits.connect_timeout, sock_read=lane.limits.read_timeout
        )
        self.url, self.sampling, self.phash = s.url(), s.sampling(), s.params_hash()
        self.answer = Answer(lane.want_reasoning, lane.split_ids, tuple(lane.eos_ids or ()))
        self.in_flight = self.done = self.tokens = 0
        self.cost = 0.0
        self.stats = ShardStats(
            total=sum(sh.stats.total for sh in shards), already=sum(sh.stats.already for sh in shards)
        )
        self.stop_kind: str | None = None
        self.stop_reason: str | None = None

    @property
    def requests(self) -> Queue:
        """What the streaming workers take from."""
        return self.stream_queue if self.batch is not None else self.queue

    def per_cost(self) -> float:
        """Expected cost of its next request: the mean of this run's answers once 20 are in, else the estimate."""
        return self.cost / self.done if self.done >= 20 else self.lane.guard.expected_cost

    def per_most(self) -> float:
        return self.lane.guard.most_cost

    def per_tokens(self) -> float:
        return self.tokens / self.done if self.done >= 20 else self.lane.guard.expected_tokens

    def batch_reserve(self, n: int) -> float:
        """What a batch of ``n`` requests reserves against the budget: its most cost."""
        return n * self.per_most()

    def entries_in_flight(self) -> int:
        return self.in_flight + (self.batch.entries_in_flight() if self.batch is not None else 0)

    def reserved(self) -> float:
        """What the budget holds for it: requests in flight at the expected cost, batches at their most."""
        return self.in_flight * self.per_cost() + (self.batch.reserved() if self.batch is not None else 0.0)

    def flight(self) -> tuple[float, float]:
        """Its requests in flight (batch entries included) at the expected and the most cost, for the key's books."""
        n = self.entries_in_flight()
        return n * self.per_cost(), n * self.per_most()

    def active(self) -> bool:
        """Whether its batches may still add work for the streaming workers."""
        return self.batch is not None and self.stop_kind is None and bool(self.queue or self.batch.open)


def _open_shard(lane: Lane, work: ShardWork, run_log: Callable[[str], None]) -> tuple[_Shard, list[dict[str, Any]]]:
    """Read a shard's journal back (cutting a torn tail) and say what is left to request; in mode batch its
    batches submitted and not finished are resumed (their requests are not pending)."""
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
    batches: list[OpenBatch] = open_batches(out_path) if lane.batch is not None else []
    in_batches = {sid for b in batches for sid in b.ids}
    pending = [p for p in prompts if p["id"] not in state.finished and p["id"] not in in_batches]
    unseen = unseen_intents(intents_path(out_path), state) - in_batches
    if unseen:
        log(
            f"{name}: {len(unseen)} samples were sent before an interruption and never answered here "
            f"(they may have been billed unseen; the key's books count that money): "
            f"{', '.join(sorted(unseen)[:5])}{' ...' if len(unseen) > 5 else ''}"
        )
    stats = ShardStats(total=len(prompts), already=len(state.finished))
    log(
        f"{name}: {stats.already} of {len(prompts)} samples already journaled, {len(pending)} to request"
        + (f", {len(in_batches)} in {len(batches)} batches submitted before" if batches else "")
        + f" ({settings.backend} {settings.model} at {settings.base_url}, concurrency {lane.limits.concurrency})"
    )
    shard = _Shard(work, name, log, state.lines, stats)
    if pending or batches:
        shard.journal, shard.intents = Journal(jpath), Journal(intents_path(out_path))
    for b in batches:
        b.shard = shard
        lane.batch.open.append(b)
    return shard, pending


async def regenerate(
    lanes: list[Lane],
    *,
    concurrency: int,
    spend: RunSpend | None = None,
    progress_interval: float | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] = print,
) -> dict[Path, dict[str, Any] | str]:
    """Finish every shard of ``lanes``: publish each when its journal holds every prompt, or when its dataset's
    output-token quota stopped it (then with the samples that fit). Returns, per shard output path, its summary
    (published) or the reason it is not finished; a shard is never left half-published. ``progress``: the job's
    progress printer, whose figures (dollars, in flight, retries, failures) the client keeps current."""
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
        if any(r.queue or (r.batch is not None and r.batch.open) for r in runs):
            await _run(runs, concurrency, spend, session_id, progress_interval, progress, log)
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
    progress: Progress | None,
    log: Callable[[str], None],
) -> None:
    """Request every pending prompt of every lane, at most ``concurrency`` in flight in all, until all are done
    or stopped."""
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, ttl_dns_cache=300)
    # No cookie jar: an API client has no use for cookies, and the jar costs time on every response.
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), raise_for_status=False
    ) as session:
        await _Dispatch(runs, spend, session, session_id, progress, log).run(concurrency, progress_interval)


# How often a job refreshes its entries in the key ledgers and re-checks a budget another run's leases hold.
KEY_SYNC_S = 0.5


class _Dispatch:
    """One responses run's requests: admission against the budget and quotas, the workers, the batch lanes,
    retries, the account readings and the progress figures. The outline is :meth:`run`; each step has one job.

    Admission counts what is in flight at the expected per-sample figure (a batch at its most cost), so the
    overshoot is at most the difference between the expected and the actual cost of the requests in flight. A
    request that would only fit once some in flight come back (shorter than expected) waits for them; the stop is
    final only when nothing is in flight and one more request still does not fit. (Stopping at the first refusal
    would end a dataset whose quota equals concurrency x expected length after its first wave.) Waiting workers are
    woken one at a time - by a request coming back, a reading of the account - and each that is admitted wakes the
    next, so a wake-up costs what it admits plus one check, not one check per waiting worker (2,000 of them near
    the end of a budget).
    """

    def __init__(
        self,
        runs: list[_LaneRun],
        spend: RunSpend,
        session: aiohttp.ClientSession,
        session_id: str,
        progress: Progress | None,
        log: Callable[[str], None],
    ) -> None:
        self.runs, self.spend, self.session, self.session_id, self.log = runs, spend, session, session_id, log
        self.progress = progress
        self.in_flight = 0  # the run's streaming requests, every lane together
        self.waiters: deque[asyncio.Future] = deque()
        self.refreshing: asyncio.Future | None = None
        self.turn = 0  # the lane a worker looks at first: datasets take turns
        # Each account is read on a connection of its own: with every request slot busy, a poll through the
        # main pool would wait for a free one and see the account only when the run is over.
        self.accounts = {
            name: aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, ssl=tls_context(a.ca_bundle)),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            for name, a in spend.accounts.items()
        }

    # ---- the outline ---------------------------------------------------------------------------------------

    async def run(self, concurrency: int, progress_interval: float | None) -> None:
        runs = self.runs
        interval = progress_interval or min(r.lane.limits.progress_interval for r in runs)
        streamable = sum(
            min(len(r.requests), r.lane.limits.concurrency)
            if r.batch is None or r.batch.settings.failed != "stream"
            else r.lane.limits.concurrency
            for r in runs
        )
        workers = min(concurrency, streamable)
        reporter = asyncio.create_task(self.report_progress(interval))
        sharer = asyncio.create_task(self.share_keys()) if self.spend.keys else None
        try:
            batch_lanes = [run_batch_lane(self, r) for r in runs if r.batch is not None]
            await asyncio.gather(*(self.worker() for _ in range(workers)), *batch_lanes)
            reporter.cancel()
            # A last reading with nothing of this job in flight (what the account shows lags by seconds).
            await self.poll_accounts()
        finally:
            reporter.cancel()
            if sharer is not None:
                sharer.cancel()
            if self.refreshing is not None:
                self.refreshing.cancel()
            for account in self.accounts.values():
                await account.close()
        self.show_progress()

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
            shard, prompt = run.requests.popleft()
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

    def busy(self) -> bool:
        """Whether anything of this job is in flight (requests, batches): room may open when it comes back."""
        return self.in_flight > 0 or any(r.batch is not None and r.batch.open for r in self.runs)

    def pick(self) -> tuple[_LaneRun | None, bool]:
        """The next lane that admits a request (advancing the turn), and whether any lane may admit one later."""
        waiting = any(r.active() and r.batch.settings.failed == "stream" for r in self.runs)
        runs, n = self.runs, len(self.runs)
        spent = self.spend.spent()
        reserved = sum(r.reserved() for r in runs)
        for i in range(n):
            run = runs[(self.turn + i) % n]
            if run.stop_kind is not None or not run.requests:
                continue
            if run.in_flight >= run.lane.limits.concurrency:
                waiting = True
                continue
            verdict = self.admit(run, spent, reserved, run.per_cost(), run.per_tokens())
            if verdict == "go":
                self.turn = (self.turn + i + 1) % n
                return run, True
            waiting |= verdict == "wait"
        return None, waiting

    def admit_batch(self, run: _LaneRun, n: int) -> tuple[str, int]:
        """A batch of up to ``n`` of ``run``'s requests: ("go", how many fit the budget at their most cost and the
        quota at the expected length), or ("wait" / "stop", 0)."""
        guard, spent, reserved = run.lane.guard, self.spend.spent(), sum(r.reserved() for r in self.runs)
        if guard.budget_usd is not None and run.per_most() > 0:
            room = guard.budget_usd - spent - reserved - self.spend.others()
            n = min(n, max(1, int(room // run.per_most())))
        if guard.token_cap is not None and run.per_tokens() > 0:
            used = guard.tokens_before + run.tokens + run.entries_in_flight() * run.per_tokens()
            n = min(n, max(1, int((guard.token_cap - used) // run.per_tokens())))
        verdict = self.admit(run, spent, reserved, run.batch_reserve(n), n * run.per_tokens())
        return verdict, (n if verdict == "go" else 0)

    def admit(self, run: _LaneRun, spent: float, reserved: float, need: float, tokens: float) -> str:
        """ "go", "wait" (room may open when what is in flight comes back) or "stop" (halted); ``spent``: the run's
        spend, ``reserved``: everything in flight, ``need``: what this request (batch) reserves, ``tokens``: its
        expected output tokens."""
        guard = run.lane.guard
        if guard.budget_usd is not None and not self.fits_budget(run, spent, reserved, need):
            if (key := self.spend.keys.get(run.lane.account)) is not None:
                key.give_back(*self.committed(run.lane.account))  # two runs must not wait on each other's headroom
            if self.busy() or self.spend.others_in_flight():
                return "wait"
            if any(not a.exact for a in self.spend.accounts.values()):
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
            if used + run.entries_in_flight() * run.per_tokens() + tokens > guard.token_cap:
                if run.entries_in_flight() > 0:
                    return "wait"
                self.halt(
                    run,
                    f"output-token quota: {used:,} of the dataset's max_output_tokens {guard.token_cap:,} used; "
                    "the dataset is complete with the samples that fit",
                    "quota",
                )
                return "stop"
        return "go"

    def fits_budget(self, run: _LaneRun, spent: float, reserved: float, need: float) -> bool:
        """Whether ``need`` more of ``run`` fits the budget with what the other runs on its key hold; on a key with
        a ledger it must also fit this job's lease, else a new lease is taken under the ledger's lock."""
        budget = run.lane.guard.budget_usd
        key = self.spend.keys.get(run.lane.account)
        if key is None:
            return spent + reserved + self.spend.others() + need <= budget
        if spent + reserved + need > budget:
            return False
        mine, committed = self.committed(run.lane.account)
        if key.covers(committed + need):
            # The lease was granted under the lock with every run's figures, so the others' do not count again
            # (they would also count a lease's own unused headroom against it).
            return True
        return key.take(
            mine,
            committed,
            need,
            lambda: budget - spent - reserved - self.spend.others(),
            run.per_cost() * min(LEASE_REQUESTS, run.lane.limits.concurrency),
        )

    def committed(self, account: str | None) -> tuple[float, float]:
        """This job's spend on ``account`` (journaled since it started), and that plus what it has in flight there:
        what its lease on the key's ledger must cover."""
        mine = self.spend.now.get(account, 0.0)
        return mine, mine + sum(r.reserved() for r in self.runs if r.lane.account == account)

    def flight(self, account: str | None) -> tuple[float, float]:
        """This job's requests in flight on ``account`` (expected USD, at most)."""
        parts = [r.flight() for r in self.runs if r.lane.account == account]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def entries_in_flight(self) -> int:
        return sum(r.entries_in_flight() for r in self.runs)

    async def share_keys(self) -> None:
        """Keep this job's entries in the key ledgers current (spend, requests in flight, heartbeat; an idle lane
        gives back its lease headroom), and wake a waiting worker: another run's spend or leases may have moved."""
        while True:
            await asyncio.sleep(KEY_SYNC_S)
            for account, key in self.spend.keys.items():
                mine, committed = self.committed(account)
                busy = any(
                    (r.queue or r.stream_queue) and r.stop_kind is None for r in self.runs if r.lane.account == account
                )
                key.flight = self.flight(account)
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

    async def poll_accounts(self) -> None:
        for name, account in self.spend.accounts.items():
            await account.poll(
                self.accounts[name], self.spend.journals(name), self.flight(name), self.entries_in_flight()
            )

    async def refresh(self) -> None:
        await self.poll_accounts()
        for account in self.spend.accounts.values():
            account.exact = True  # read again, or unreadable: the figure stands either way
        self.refreshing = None
        self.wake()

    # ---- one request ---------------------------------------------------------------------------------------

    def make_sample(self, run: _LaneRun, p: dict[str, Any]) -> _Sample:
        # Built when a worker takes the prompt, so 20,000 bodies are not serialized before the first request.
        lane = run.lane
        ids = lane.render_ids(p["messages"], p.get("tools")) if lane.settings.api.sends_token_ids else None
        body = request_body(lane.settings, p["messages"], ids, tools=p.get("tools"))
        return _Sample(p, json.dumps(body, ensure_ascii=False).encode(), ids)

    def batch_entry_body(self, run: _LaneRun, p: dict[str, Any]) -> dict[str, Any]:
        """A batch entry's body: the chat request without what the batch sets for all (model, provider)."""
        body = request_body(run.lane.settings, p["messages"], None, tools=p.get("tools"))
        return {k: v for k, v in body.items() if k not in ("model", "provider")}

    async def request(self, run: _LaneRun, shard: _Shard, sample: _Sample) -> dict[str, Any] | None:
        """The sample's record, retrying what may succeed on a retry; None when it failed for good or the run
        stopped (the intents log says how)."""
        limits, sid = run.lane.limits, sample.prompt["id"]
        attempt = shard.tries.get(sid, 0)
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
        return run.lane.settings.api.parse(body, run.answer)

    async def retry_after_failure(
        self, run: _LaneRun, shard: _Shard, sid: str, attempt: int, kind: str, message: str, wait: float | None
    ) -> bool:
        """Count a failed attempt, back off; whether to try again."""
        self.intent(shard, "failed", sid, attempt, kind=kind)
        if kind in BILLABLE_FAILURES:
            # Weighed as the folder's intents log is weighed again later (the dataset's expected cost at the start).
            self.spend.retried(run.lane.account, run.lane.guard.expected_cost, run.per_most())
        shard.stats.retries[kind] += 1
        run.stats.retries[kind] += 1
        if attempt >= run.lane.limits.max_attempts:
            shard.stats.final_errors[kind] += 1
            shard.stats.failed += 1
            run.stats.failed += 1
            shard.log(f"{shard.name}: sample {sid} failed {attempt} times, last: {message}")
            return False
        await asyncio.sleep(backoff_seconds(attempt, run.lane.limits, wait))
        # A fatal or budget stop: do not keep hammering; the sample stays pending for the next run. (A quota stop
        # retries: this request was admitted within the quota, and the shard is published as complete only if
        # every admitted request has its answer.)
        return not (run.stop_kind in ("budget", "fatal") and kind != "402_in_flight")

    def fail_for_good(self, shard: _Shard, sid: str, attempt: int, kind: str) -> None:
        self.intent(shard, "failed", sid, attempt, kind=kind)
        shard.stats.final_errors[kind] += 1

    def intent(self, shard: _Shard, event: str, sid: str, attempt: int, session: str | None = None, **extra: Any):
        """A line of the intents log (docs/formats.md): a request sent, or one that ended without an answer
        (``session``: the process that sent it, when another one tells how it ended: a resumed batch)."""
        shard.intents.append(
            {"format": INTENT_FORMAT, "event": event, "session": session or self.session_id, "id": sid}
            | {"attempt": attempt}
            | extra
            | {"t": round(time.time(), 3)}
        )

    def record(
        self, run: _LaneRun, sample: _Sample, fields: dict[str, Any], attempt: int, latency: float
    ) -> dict[str, Any]:
        """The journal record of an answered sample (docs/formats.md, aerie.responses.in_process)."""
        return self._record(run, sample.prompt, fields, attempt, latency, self.session_id) | (
            {"prompt_token_ids": sample.prompt_ids} if sample.prompt_ids is not None else {}
        )

    def batch_record(
        self, run: _LaneRun, shard: _Shard, entry: int, batch: OpenBatch, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """The journal record of a batch entry's answer: it carries the submitting process and attempt (the intents
        log's key of the request) and the batch's id."""
        sid, attempt = batch.ids[entry], batch.attempts[entry]
        record = self._record(run, shard.prompt(sid), fields, attempt, time.time() - batch.t, batch.session)
        return record | {"batch": batch.batch_id}

    def _record(
        self, run: _LaneRun, prompt: dict[str, Any], fields: dict[str, Any], attempt: int, latency: float, session: str
    ) -> dict[str, Any]:
        lane = run.lane
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
            "latency_s": round(latency, 3),
            "attempts": attempt,
            "session": session,
        }

    # ---- the figures ---------------------------------------------------------------------------------------

    def count_in_flight(self, run: _LaneRun, shard: _Shard, n: int) -> None:
        run.in_flight += n
        self.in_flight += n
        shard.stats.in_flight += n
        run.stats.in_flight += n

    def batch_flight_changed(self, run: _LaneRun) -> None:
        """A batch was submitted or finished: what is reserved moved; waiting workers re-check."""
        self.wake()

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

    def show_progress(self) -> None:
        """The job's progress printer's figures: the run's dollars, requests in flight, retries and failures."""
        if self.progress is None:
            return
        retries = sum((r.stats.retries for r in self.runs), Counter())
        batches = [r.batch for r in self.runs if r.batch is not None]
        self.progress.postfix(
            spent=usd(self.spend.spent()),
            in_flight=self.entries_in_flight(),
            retries=sum(retries.values()),
            failed=sum(r.stats.failed for r in self.runs),
            **({"batches": sum(len(b.open) for b in batches)} if batches else {}),
        )

    async def report_progress(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.poll_accounts()
            self.wake()  # the figures may have moved either way
            self.show_progress()


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
        want_reasoning=want_reasoning,
        render_ids=render_ids,
        split_ids=split_ids,
        eos_ids=eos_ids,
    )
    spend = RunSpend({None: guard.spent_before}, lost_usd=guard.lost_usd)
    result = (await regenerate([lane], concurrency=limits.concurrency, spend=spend, log=log))[out_path]
    if isinstance(result, str):
        raise RegenerationStopped(result)
    return result
