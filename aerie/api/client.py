"""The async regeneration client: one aiohttp session, thousands of requests in flight, nothing paid twice.

``regenerate_shard`` asks the target (through OpenRouter, any OpenAI-compatible server, or SGLang's
``/generate``) for a response to every prompt of one shard that its journal does not already hold:

- one ``aiohttp.ClientSession``; ``concurrency`` worker coroutines (no task per sample, no semaphore
  churn); connect and read timeouts; the request body serialized once;
- retries with exponential backoff and full jitter on 408/429/5xx, connection resets, torn bodies,
  timeouts and errors delivered inside HTTP 200; ``Retry-After`` honoured; 402 in-flight budget
  waited out; 400/401/403, credits/key-limit 402 and "no endpoints" stop the run with the server's
  message (in-flight requests still land in the journal: they are paid for);
- every finished sample goes to the journal at once (aerie.api.journal); the declared shard output is
  published atomically only when the journal holds every sample;
- money: a global dollar budget and a per-dataset output-token quota are checked before each request is
  admitted, counting what is in flight at the expected per-sample cost, so the overshoot is bounded
  by the requests already in flight; other shards' journals are followed while running, and so is the
  provider's own account (``GET /key``): spend the journals never saw (answers lost with a killed
  process) counts against the budget too;
- before each request is sent an intent line goes to ``shard-NNNNN.intents.jsonl``, so a crashed run
  knows exactly which samples may have been billed without an answer;
- the budget is a stop (raise it and rerun); the output-token quota is not: a dataset whose
  ``max_output_tokens`` is reached is complete with the samples that fit, and the shard is published
  with them and a ``shard-NNNNN.completion.json`` that records why the others were not requested.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time
from collections import Counter
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
    INTENT_FORMAT,
    Journal,
    intents_path,
    journal_path,
    messages_key,
    read_journal,
    unseen_intents,
)
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
    (loaded once per shard, like aiohttp's own default context; it reads SSL_CERT_FILE / SSL_CERT_DIR)."""
    try:
        ctx = ssl.create_default_context(cafile=ca_bundle)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"CA bundle {ca_bundle}: cannot be read as PEM certificates ({e})") from None
    ctx.set_alpn_protocols(["http/1.1"])  # what aiohttp speaks; the same offer as its default context
    return ctx


@dataclass
class MoneyGuard:
    """Budget and caps, with what was already spent before this process started."""

    budget_usd: float | None = None
    spent_before: float = 0.0  # every journal of the run (this shard's included)
    expected_cost: float = 0.0  # per sample, until this run has measured its own
    token_cap: int | None = None  # this dataset's output-token cap
    tokens_before: int = 0  # this dataset's journaled output tokens
    expected_tokens: float = 0.0
    others: LedgerWatcher | None = None  # other shards' journals, followed live
    lost_usd: float = 0.0  # account spend no journal holds (interrupted requests), from the last reconcile
    account: AccountWatcher | None = None  # the provider's account, polled while running

    def spent(self, shard_cost: float) -> float:
        """What the budget is checked against: every journal's spend plus the spend only the account saw."""
        return self.spent_before + shard_cost + (self.others.cost if self.others else 0.0) + self.lost_usd


class AccountWatcher:
    """Polls the provider account's usage (``GET /key``) and turns it into ``MoneyGuard.lost_usd``.

    ``baseline_usage`` / ``baseline_journal`` are the account usage and the journals' total at the run's
    first start (aerie.api.money's account ledger); lost = account growth since then - journal growth.
    ``floor`` is the loss reconciled at this job's start, when none of its own requests was in flight;
    a poll while running also counts answers billed but still on their way to the journal (at most the
    requests in flight), so each poll replaces the previous one and never goes below the floor.
    ``record(usage, journal, lost)`` appends the reading to that ledger.
    """

    def __init__(
        self,
        url: str,
        baseline_usage: float,
        baseline_journal: float,
        record: Callable[[float, float, float], None] | None = None,
        floor: float = 0.0,
    ):
        self.url, self.baseline_usage, self.baseline_journal = url, baseline_usage, baseline_journal
        self.floor = floor
        self._record = record
        self.polls = 0
        self.errors = 0

    def lost(self, usage: float, journal_spend: float) -> float:
        return max(0.0, (usage - self.baseline_usage) - (journal_spend - self.baseline_journal))

    async def poll(self, session: aiohttp.ClientSession, guard: MoneyGuard, shard_cost: float) -> None:
        try:
            async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=15)) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            body = None
        usage = ((body or {}).get("data") or {}).get("usage") if isinstance(body, dict) else None
        if usage is None:
            self.errors += 1  # the last known loss stands; the journals still count live
            return
        self.polls += 1
        journal = guard.spent_before + shard_cost + (guard.others.cost if guard.others else 0.0)
        guard.lost_usd = max(self.floor, self.lost(float(usage), journal))
        if self._record is not None:
            self._record(float(usage), journal, guard.lost_usd)


class LedgerWatcher:
    """Follows other journals incrementally (only appended bytes are read) for live spend."""

    def __init__(self, paths_glob: Callable[[], list[Path]], exclude: Path, dataset_dir: Path):
        self._glob, self._exclude, self._dataset_dir = paths_glob, exclude.resolve(), dataset_dir.resolve()
        self._offsets: dict[Path, int] = {}
        self.cost = 0.0  # growth since the watcher started
        self.dataset_tokens = 0

    def prime(self) -> None:
        """Start from the current ends: what is already there is in MoneyGuard.*_before."""
        for p in self._glob():
            self._offsets[p.resolve()] = p.stat().st_size

    def poll(self) -> None:
        for p in self._glob():
            rp = p.resolve()
            if rp == self._exclude:
                continue
            start = self._offsets.get(rp, 0)
            size = p.stat().st_size
            if size <= start:
                continue
            with open(rp, "rb") as fh:
                fh.seek(start)
                chunk = fh.read(size - start)
            end = chunk.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[rp] = start + end
            for line in chunk[:end].split(b"\n"):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.cost += float(rec.get("cost") or 0.0)
                if rp.parent == self._dataset_dir:
                    self.dataset_tokens += int((rec.get("usage") or {}).get("completion_tokens") or 0)


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
    stop_reason: str | None = None
    stop_kind: str | None = None  # "quota" (the dataset is complete), "budget", "fatal"

    def line(self, name: str, guard: MoneyGuard) -> str:
        n = self.already + self.done
        frac = n / self.total if self.total else 1.0
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        elapsed = max(time.monotonic() - self.started, 1e-9)
        spent = guard.spent(self.cost)
        budget = f" of ${guard.budget_usd:.2f}" if guard.budget_usd is not None else ""
        if guard.lost_usd > 0:
            budget += f" ({_usd(guard.lost_usd)} lost to interrupted requests)"
        retries = " ".join(f"{k}:{v}" for k, v in sorted(self.retries.items())) or "0"
        return (
            f"{name} [{bar}] {n}/{self.total} {100 * frac:.0f}% | {self.done / elapsed:.1f} req/s "
            f"{self.completion_tokens / elapsed:.0f} tok/s | ${self.cost:.4f} this shard, run ${spent:.2f}{budget} "
            f"| retries {retries} | failed {self.failed} | in flight {self.in_flight}"
        )


def _usd(amount: float) -> str:
    """Dollars for a log line: cents, or four decimals below a cent (a test run's amounts)."""
    return f"${amount:.2f}" if amount >= 0.01 else f"${amount:.4f}"


class RegenerationStopped(RuntimeError):
    """The shard is incomplete (budget, cap, fatal error or failures); the journal keeps what finished."""


@dataclass
class _Sample:
    prompt: dict[str, Any]
    body: bytes
    prompt_ids: list[int] | None


# SGLang's /generate takes token ids: the chat template renders the prompt, and the answer's ids are split
# into reasoning and content by the template's markers.
RenderIds = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]
SplitIds = Callable[[list[int]], dict[str, Any]]


@dataclass
class _ShardRun:
    """What every request of one shard shares: where finished samples go, how requests are made and answers
    read, and the money checks (one object instead of a dozen parameters handed along)."""

    name: str  # shard-NNNNN, for log lines
    log: Callable[[str], None]
    journal: Journal
    intents: Journal
    lines: dict[str, bytes]  # id -> journal line of every finished sample, added to as samples finish
    stats: RunStats
    settings: BackendSettings
    api_key: str | None
    limits: ClientLimits
    guard: MoneyGuard
    want_reasoning: bool
    render_ids: RenderIds | None
    split_ids: SplitIds | None
    eos_ids: list[int] | None


def _backoff(attempt: int, limits: ClientLimits, retry_after: float | None) -> float:
    if retry_after is not None:
        return min(retry_after, limits.backoff_max * 5)  # the server's word, within reason
    return random.uniform(0, min(limits.backoff_max, limits.backoff_base * 2 ** (attempt - 1)))


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
    """Finish one shard; publish ``out_path`` when every prompt has a journaled response, or when the
    dataset's output-token quota stopped it (then with the samples that fit, see ``completion_path``).

    Raises RegenerationStopped (after everything in flight has been journaled) when it cannot finish.
    """
    name = out_path.name.removesuffix(".jsonl")
    jpath = journal_path(out_path)
    phash = settings.params_hash()
    # Prompt texts are compared only against an existing journal (a fresh shard skips the work).
    has_journal = jpath.exists() and jpath.stat().st_size > 0
    keys = {p["id"]: messages_key(p["messages"], p.get("tools")) for p in prompts} if has_journal else {}
    state = read_journal(jpath, phash, keys, repair=True)
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
        f"({settings.backend} {settings.model} at {settings.base_url}, concurrency {limits.concurrency})"
    )

    if pending:
        journal, intents = Journal(jpath), Journal(intents_path(out_path))
        try:
            run = _ShardRun(
                name,
                log,
                journal,
                intents,
                state.lines,
                stats,
                settings,
                api_key,
                limits,
                guard,
                want_reasoning,
                render_ids,
                split_ids,
                eos_ids,
            )
            await _run(pending, run)
        finally:
            await journal.aclose()
            await intents.aclose()

    missing = [p["id"] for p in prompts if p["id"] not in state.lines]
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
    log(f"{name}: {json.dumps(summary)}")
    quota_done = stats.stop_kind == "quota" and not stats.failed
    if missing and not quota_done:
        failures = ", ".join(f"{k}: {v}" for k, v in stats.final_errors.items())
        raise RegenerationStopped(
            stats.stop_reason
            or f"{len(missing)} samples have no response after "
            f"responses.max_attempts attempts ({failures}); rerun to retry only them"
        )
    kept = [p["id"] for p in prompts if p["id"] in state.lines]
    kept_records = [json.loads(state.lines[i]) for i in kept]
    completion = {
        "format": COMPLETION_FORMAT,
        "shard": out_path.name,
        "prompts": len(prompts),
        "samples": len(kept),
        "not_requested": len(missing),
        "reason": QUOTA_REASON if missing else None,
        "max_output_tokens": guard.token_cap,
        "dataset_output_tokens": guard.tokens_before
        + stats.completion_tokens
        + (guard.others.dataset_tokens if guard.others else 0),
        "shard_output_tokens": sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in kept_records),
        "shard_cost_usd": round(sum(float(r.get("cost") or 0.0) for r in kept_records), 6),
    }
    if missing:
        log(
            f"{name}: the dataset's max_output_tokens quota ({guard.token_cap:,}) is reached: the shard is "
            f"complete with {len(kept)} of {len(prompts)} samples; {len(missing)} prompts not requested"
        )
    summary["completion"] = completion
    # The completion record first: a published shard always has it beside it.
    write_completion(out_path, completion)
    # The journal lines verbatim, in prompt order: nothing is serialized twice.
    atomic_write_bytes(out_path, b"".join(state.lines[i] for i in kept))
    return summary


async def _run(pending: list[dict[str, Any]], run: _ShardRun) -> None:
    """Request every pending prompt with ``limits.concurrency`` workers until all are done or the run stops."""
    settings, limits, guard, stats = run.settings, run.limits, run.guard, run.stats  # what the closures read most
    headers = {"Content-Type": "application/json", **(settings.extra_headers or {})}
    if run.api_key:
        headers["Authorization"] = f"Bearer {run.api_key}"
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for p in pending:
        queue.put_nowait(p)
    sampling, phash = settings.sampling(), settings.params_hash()  # once, not per request

    def make_sample(p: dict[str, Any]) -> _Sample:
        # Built when a worker takes the prompt, so 20,000 bodies are not serialized before the first request.
        ids = run.render_ids(p["messages"], p.get("tools")) if settings.backend == "sglang" else None
        body = request_body(settings, p["messages"], ids, tools=p.get("tools"))
        return _Sample(p, json.dumps(body, ensure_ascii=False).encode(), ids)

    stop = asyncio.Event()

    def halt(reason: str, kind: str = "fatal") -> None:
        if not stop.is_set():
            stats.stop_reason, stats.stop_kind = reason, kind
            stop.set()
            settled[0].set()  # workers waiting for room see the stop at once
            run.log(f"{run.name}: STOPPING: {reason}")

    # Admission counts what is in flight at the expected per-sample figure, so the overshoot is at most the
    # difference between the expected and the actual cost of the requests in flight. A request that would
    # only fit once some in flight come back (shorter than expected) waits for them; the stop is final only
    # when nothing is in flight and one more request still does not fit. (Stopping at the first refusal
    # would end a dataset whose quota equals concurrency x expected length after its first wave.)
    settled = [asyncio.Event()]  # set (and replaced) each time a request in flight comes back

    def signal_settled() -> None:
        settled[0].set()
        settled[0] = asyncio.Event()

    def admit() -> str:
        """ "go", "wait" (room may open when requests in flight come back) or "stop" (halted)."""
        measured = stats.done >= 20
        per_cost = stats.cost / stats.done if measured else guard.expected_cost
        per_tokens = stats.completion_tokens / stats.done if measured else guard.expected_tokens
        others = guard.others
        if guard.budget_usd is not None:
            spent = guard.spent(stats.cost)
            if spent + (stats.in_flight + 1) * per_cost > guard.budget_usd:
                if stats.in_flight > 0:
                    return "wait"
                lost = f", {_usd(guard.lost_usd)} of it lost to interrupted requests" if guard.lost_usd > 0 else ""
                halt(
                    f"budget: ${spent:.2f} spent{lost} of responses.budget_usd ${guard.budget_usd:.2f}; "
                    "finished samples are kept in the journal - raise the budget and rerun to finish the rest",
                    "budget",
                )
                return "stop"
        if guard.token_cap is not None:
            used = guard.tokens_before + stats.completion_tokens + (others.dataset_tokens if others else 0)
            if used + (stats.in_flight + 1) * per_tokens > guard.token_cap:
                if stats.in_flight > 0:
                    return "wait"
                halt(
                    f"output-token quota: {used:,} of the dataset's max_output_tokens {guard.token_cap:,} used; "
                    "the dataset is complete with the samples that fit",
                    "quota",
                )
                return "stop"
        return "go"

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=limits.connect_timeout, sock_read=limits.read_timeout)
    connector = aiohttp.TCPConnector(
        limit=limits.concurrency, limit_per_host=0, ttl_dns_cache=300, ssl=tls_context(limits.ca_bundle)
    )
    url = settings.url()
    # No cookie jar: an API client has no use for cookies, and the jar costs time on every response.
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        headers=headers,
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
    ) as session:

        async def one(sample: _Sample) -> dict[str, Any] | None:
            attempt = 0
            while True:
                attempt += 1
                t0 = time.monotonic()
                # Before the request leaves: if this process dies while it is in flight, the next run
                # knows the sample may have been billed without an answer.
                run.intents.append(
                    {
                        "format": INTENT_FORMAT,
                        "id": sample.prompt["id"],
                        "t": round(time.time(), 3),
                        "params_hash": phash,
                        "attempt": attempt,
                    }
                )
                try:
                    async with session.post(url, data=sample.body) as resp:
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
                    if settings.backend == "sglang":
                        fields = parse_sglang_generate(body, run.split_ids, run.eos_ids or [], run.want_reasoning)
                    else:
                        fields = parse_chat_completion(body, run.want_reasoning)
                except RetryableError as e:
                    kind, message, wait = e.kind, str(e), e.retry_after
                except aiohttp.ClientPayloadError as e:
                    kind, message, wait = "torn", f"torn body: {e}", None
                except aiohttp.ClientConnectorCertificateError as e:
                    # A certificate the client does not trust will not be trusted on a retry either.
                    stats.final_errors["tls_certificate"] += 1
                    halt(
                        f"the server's TLS certificate is not trusted ({e.certificate_error}); if it is yours, "
                        "name its CA file in responses.ca_bundle (or SSL_CERT_FILE); verification is never off"
                    )
                    return None
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionError) as e:
                    kind, message, wait = "connection", f"{type(e).__name__}: {e}", None
                except TimeoutError:
                    kind, message, wait = "timeout", f"no answer within {limits.read_timeout:g}s", None
                except FatalError as e:
                    stats.final_errors[e.kind] += 1
                    halt(str(e))
                    return None
                else:
                    return {
                        "format": RESPONSES_FORMAT,
                        "id": sample.prompt["id"],
                        "dataset": sample.prompt.get("dataset"),
                        "messages": sample.prompt["messages"],
                        **({"tools": sample.prompt["tools"]} if sample.prompt.get("tools") else {}),
                        "backend": settings.backend,
                        "model": settings.model,
                        "params": sampling,
                        "params_hash": phash,
                        **fields,
                        **({"prompt_token_ids": sample.prompt_ids} if sample.prompt_ids is not None else {}),
                        "latency_s": round(time.monotonic() - t0, 3),
                        "attempts": attempt,
                    }
                stats.retries[kind] += 1
                if attempt >= limits.max_attempts:
                    stats.final_errors[kind] += 1
                    stats.failed += 1
                    run.log(f"{run.name}: sample {sample.prompt['id']} failed {attempt} times, last: {message}")
                    return None
                await asyncio.sleep(_backoff(attempt, limits, wait))
                if stop.is_set() and kind != "402_in_flight" and stats.stop_kind != "quota":
                    # A fatal or budget stop: do not keep hammering; the sample stays pending for the next run.
                    # (A quota stop retries: this request was admitted within the quota, and the shard is
                    # published as complete only if every admitted request has its answer.)
                    return None

        async def worker() -> None:
            while not stop.is_set():
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                verdict = admit()
                while verdict == "wait" and not stop.is_set():
                    await settled[0].wait()
                    verdict = admit()
                if verdict != "go":
                    return
                stats.in_flight += 1
                record = None
                try:
                    record = await one(make_sample(prompt))
                finally:
                    stats.in_flight -= 1
                    if record is not None:
                        run.lines[record["id"]] = run.journal.append(record)
                        stats.done += 1
                        stats.cost += record["cost"]
                        stats.completion_tokens += int((record.get("usage") or {}).get("completion_tokens") or 0)
                        for flag in record["flags"]:
                            stats.flags[flag] += 1
                    signal_settled()  # after the figures: a waiting worker re-checks against the actual cost

        # The account is read on a connection of its own: with every request slot busy, a poll through the
        # main pool would wait for a free one and see the account only when the shard is over.
        account_session = (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, ssl=tls_context(limits.ca_bundle)),
                headers=headers,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            if guard.account is not None
            else None
        )

        async def progress() -> None:
            while True:
                await asyncio.sleep(limits.progress_interval)
                if guard.others is not None:
                    guard.others.poll()
                if guard.account is not None and account_session is not None:
                    await guard.account.poll(account_session, guard, stats.cost)
                run.log(stats.line(run.name, guard))

        reporter = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(worker() for _ in range(min(limits.concurrency, len(pending)))))
        finally:
            reporter.cancel()
            if account_session is not None:
                await account_session.close()
        run.log(stats.line(run.name, guard))
