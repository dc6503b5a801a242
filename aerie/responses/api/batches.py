"""``responses.mode: batch``: a dataset's pending requests through OpenRouter's Batch API, never paid twice.

OpenRouter's Batch API (public docs, 2026): ``POST /batches`` with ``endpoint``, ``model``, an inline ``requests``
array (``custom_id`` and ``body`` each) and optionally ``provider.only`` (the only routing a batch takes: one batch
runs on one provider, the cheapest eligible one unless pinned) answers ``202`` with the batch in status
``validating``; ``GET /batches/{id}`` polls it (``validating``, ``in_progress``, then ``completed``, ``failed``,
``expired`` or ``cancelled``; a finished batch carries ``results``: one ``response`` or ``error`` per request);
``GET /batches/{id}/results`` reads results; ``GET /batches`` lists the account's batches. Batches bill "typically
50%" of the per-token price; 24-hour window; median 7 minutes. Not published, and so found out at run time: which
models are batch-eligible (the first batch of a dataset is the check: until it leaves ``validating`` no other is
submitted, and a batch refused or failed at validation costs nothing and stops the dataset naming OpenRouter's
reason), the batch price (measured from billed results: ``usage.cost`` of each against the per-token price),
whether ``/results`` gives results of a batch still in progress (tried; a batch's results are journaled as they
arrive either way), and whether errored or expired entries are billed (the key's books say:
aerie.responses.api.key_books).

Never submitted twice. Each shard's batches are journaled beside it (``shard-NNNNN.batches.jsonl``, format
:data:`BATCH_FORMAT`, docs/formats.md): a line before the ``POST`` (its submit key and sample ids), a line with the
batch id once accepted, and a line when it finished. A killed run resumes polling every batch submitted and not
finished; a submission whose answer never came (killed during the ``POST``) is looked up in ``GET /batches``
(created since, same size and model) and adopted, resubmitted only when the list shows it was never created, and
otherwise left unsubmitted (the shard stays unfinished, saying so) - never guessed.

Money: a batch is admitted against the budget at its *maximum* cost (every request's prompt and ``max_new_tokens``
at the per-token price ceiling) before it is submitted; while in flight that reservation counts, and the key
ledger's lease covers it (other runs on the key see it); its results replace it as they are journaled. Failed and
expired entries are retried in a later batch or through the streaming path (``responses.batch.failed``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from aerie.responses.api.journal import jsonl_objects
from aerie.responses.api.settings import backoff_seconds
from aerie.responses.api.wire import FatalError, RetryableError, classify_http_error, parse_chat_completion

BATCH_FORMAT = "aerie.batch/1"
CHAT_ENDPOINT = "/v1/chat/completions"
TERMINAL = ("completed", "failed", "expired", "cancelled")


def batches_path(shard_output: str | Path) -> Path:
    """``shard-00000.jsonl`` -> ``shard-00000.batches.jsonl``: the shard's batches, submitted and finished."""
    p = Path(shard_output)
    return p.with_name(p.name.removesuffix(".jsonl") + ".batches.jsonl")


# ---- the shard's batch journal -------------------------------------------------------------------------------------


@dataclass
class OpenBatch:
    """One batch of a shard's requests, submitted (or its submission unconfirmed) and not finished."""

    key: str  # the submit key: custom_id of entry i is f"{key}:{i}"
    ids: list[str]  # the samples, in entry order
    session: str  # the process that submitted it (its journal and intents lines carry it)
    attempts: list[int]  # each sample's attempt (its intents and journal lines carry it)
    t: float  # when submission began (unix s)
    reserved: float  # the most it can cost (reserved against the budget while in flight)
    batch_id: str | None = None  # None: the POST's answer never came
    provider: str | None = None
    status: str = "validating"
    done: set[str] = field(default_factory=set)  # custom_ids journaled or failed here
    shard: Any = None  # the client's shard object, at run time

    def entry(self, custom_id: str) -> int | None:
        """The entry a result's ``custom_id`` names, or None when it is not one of this batch's."""
        prefix, _, index = custom_id.rpartition(":")
        if prefix != self.key or not index.isdigit() or int(index) >= len(self.ids):
            return None
        return int(index)


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:  # one write of one line: a kill leaves at most a torn tail
        f.write(json.dumps({"format": BATCH_FORMAT, **record, "t": round(time.time(), 3)}) + "\n")


def known_batch_ids(shard_output: Path) -> set[str]:
    """Every batch id the shard's batch journal names (finished ones too): never adopted for another submission."""
    return {str(r["batch"]) for r in jsonl_objects(batches_path(shard_output)) if r.get("batch")}


def open_batches(shard_output: Path) -> list[OpenBatch]:
    """The shard's batches not finished, from its batch journal (a torn last line is skipped)."""
    batches: dict[str, OpenBatch] = {}
    for rec in jsonl_objects(batches_path(shard_output)):
        if rec.get("format") != BATCH_FORMAT or not rec.get("key"):
            continue
        key = rec["key"]
        if rec.get("event") == "submitting":
            batches[key] = OpenBatch(
                key, list(rec["ids"]), rec["session"], list(rec["attempts"]), float(rec["t"]), float(rec["reserved"])
            )
        elif key in batches and rec.get("event") == "submitted":
            batches[key].batch_id, batches[key].provider = rec.get("batch"), rec.get("provider")
        elif rec.get("event") in ("finished", "not_created"):
            batches.pop(key, None)
    return list(batches.values())


# ---- the wire ------------------------------------------------------------------------------------------------------


def submit_body(model: str, entries: list[tuple[str, dict[str, Any]]], only: list[str]) -> bytes:
    """The ``POST /batches`` body: ``endpoint`` and ``model`` before ``requests`` (the API reads it as a stream)."""
    body: dict[str, Any] = {"endpoint": CHAT_ENDPOINT, "model": model}
    if only:
        body["provider"] = {"only": only}
    body["requests"] = [{"custom_id": cid, "body": b} for cid, b in entries]
    return json.dumps(body, ensure_ascii=False).encode()


def batch_object(body: Any) -> dict[str, Any]:
    """The batch object of an answer (bare, or wrapped in ``data``)."""
    if isinstance(body, dict) and isinstance(body.get("data"), dict) and "status" not in body:
        return body["data"]
    if not isinstance(body, dict):
        raise RetryableError("bad_body", f"batch answer is not a JSON object: {str(body)[:200]}")
    return body


def result_fields(result: dict[str, Any], want_reasoning: bool) -> dict[str, Any] | str:
    """A result's record fields, or why the entry failed (its error's code and message)."""
    response, error = result.get("response"), result.get("error")
    if error:
        return f"{error.get('code') or 'error'}: {error.get('message') or error}"
    if not isinstance(response, dict):
        return "no response"
    if int(response.get("status_code") or 200) != 200:
        return f"HTTP {response.get('status_code')}: {json.dumps(response.get('body'))[:200]}"
    try:
        return parse_chat_completion(response.get("body"), want_reasoning)
    except RetryableError as e:
        return f"{e.kind}: {e}"


# ---- a dataset's batches while the run goes --------------------------------------------------------------------------


@dataclass
class BatchLaneState:
    """A batch-mode dataset's batches in this job, and what they taught about the API."""

    settings: Any  # aerie.responses.api.settings.BatchSettings
    only: list[str]  # provider.only sent with each batch
    list_prices: Any  # aerie.responses.api.prices.Prices: the per-token price, for the measured batch price
    open: list[OpenBatch] = field(default_factory=list)
    validated: bool = False  # a batch of the dataset left validating: the model takes batches
    submitted: int = 0
    finished: int = 0
    expired_entries: int = 0
    failed_entries: int = 0
    billed: float = 0.0  # batch answers' usage.cost in this job
    at_list_price: float = 0.0  # the same answers at the per-token price
    durations: list[float] = field(default_factory=list)  # submission to finish, seconds

    def measured_factor(self) -> float | None:
        return self.billed / self.at_list_price if self.at_list_price > 0 else None

    def reserved(self) -> float:
        return sum(b.reserved for b in self.open)

    def entries_in_flight(self) -> int:
        return sum(len(b.ids) - len(b.done) for b in self.open)


async def _request(
    session: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str], ssl: Any, data: bytes | None = None
) -> Any:
    """One call of the Batch API: its JSON answer, or the classified error (a lost answer is retryable)."""
    try:
        async with session.request(
            method, url, data=data, headers=headers, ssl=ssl, timeout=aiohttp.ClientTimeout(total=120)
        ) as resp:
            raw, status, retry_after = await resp.read(), resp.status, resp.headers.get("Retry-After")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise RetryableError("connection", f"{type(e).__name__}: {e}") from None
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        if status in (200, 202):
            raise RetryableError("torn", f"unparseable batch answer ({len(raw)} bytes)") from None
        body = None
    if status not in (200, 201, 202):
        raise classify_http_error(status, body, raw[:300].decode("utf-8", "replace"), retry_after)
    return body


class BatchCalls:
    """The Batch API of one dataset: retried as the streaming path retries (backoff, ``Retry-After``)."""

    def __init__(self, dispatch: Any, run: Any):
        self.dispatch, self.run = dispatch, run
        lane = run.lane
        self.base = lane.settings.base_url.rstrip("/")
        self.headers = dict(run.headers)
        self.ssl = run.ssl

    async def call(self, method: str, path: str, data: bytes | None = None, what: str = "") -> Any:
        """A read is retried; a submission is not (its answer lost, it may exist: the caller looks it up)."""
        limits = self.run.lane.limits
        tries = 1 if method == "POST" else limits.max_attempts
        for attempt in range(1, tries + 1):
            try:
                return await _request(self.dispatch.session, method, self.base + path, self.headers, self.ssl, data)
            except RetryableError as e:
                self.run.stats.retries[f"batch_{e.kind}"] += 1
                if attempt == tries:
                    raise
                await asyncio.sleep(backoff_seconds(attempt, limits, e.retry_after))
        raise AssertionError("unreachable")

    async def poll(self, batch: OpenBatch) -> dict[str, Any]:
        return batch_object(await self.call("GET", f"/batches/{batch.batch_id}", what="poll"))

    async def results(self, batch: OpenBatch, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """The batch's results so far: inline in a finished batch, else from ``/results`` (if it answers)."""
        if isinstance(obj.get("results"), list):
            return obj["results"]
        try:
            body = await self.call("GET", f"/batches/{batch.batch_id}/results", what="results")
        except (RetryableError, FatalError):
            return []
        items = body.get("results", body.get("data")) if isinstance(body, dict) else body
        return items if isinstance(items, list) else []

    async def find_unconfirmed(self, batch: OpenBatch, model: str) -> str | None | bool:
        """The id of a batch whose ``POST`` answer never came, from ``GET /batches``: False when the list shows no
        such batch (it was never created), None when the list cannot tell."""
        try:
            body = await self.call("GET", "/batches", what="list")
        except (RetryableError, FatalError):
            return None
        items = body.get("data") if isinstance(body, dict) else body
        if not isinstance(items, list):
            return None
        known = {b.batch_id for b in self.run.batch.open if b.batch_id}
        for shard in self.run.shards:
            known |= known_batch_ids(shard.work.out_path)
        found = [
            o
            for o in items
            if isinstance(o, dict)
            and o.get("id") not in known
            and o.get("model") == model
            and int((o.get("request_counts") or {}).get("total") or -1) == len(batch.ids)
            and float(o.get("created_at") or 0) >= batch.t - 5
        ]
        if not found:
            return False
        if len(found) > 1:
            return None  # more than one could be it: adopting the wrong one could pay for requests twice
        return str(found[0]["id"])


async def run_batch_lane(dispatch: Any, run: Any) -> None:
    """Submit, poll and journal one dataset's batches until its queue is empty and nothing is in flight, or it
    stops (budget, a fatal error, a model that takes no batches)."""
    calls = BatchCalls(dispatch, run)
    state: BatchLaneState = run.batch
    for batch in list(state.open):  # a killed run's batches: resume them
        if batch.batch_id is None:
            await _settle_unconfirmed(dispatch, run, calls, batch)
    polls: dict[str, asyncio.Task] = {}
    while True:
        while run.stop_kind is None and (room := _may_submit(state)) and run.queue:
            verdict, n = dispatch.admit_batch(run, min(room, len(run.queue)))
            if verdict != "go":
                break
            await _submit(dispatch, run, calls, [run.queue.popleft() for _ in range(n)])
        for batch in state.open:
            if batch.batch_id and batch.key not in polls:
                polls[batch.key] = asyncio.create_task(_follow(dispatch, run, calls, batch))
        if not polls:
            if not run.queue or run.stop_kind is not None:
                return
            await dispatch.wait_for_room()  # a budget or quota room: another lane's answers may open it
            continue
        done, _ = await asyncio.wait(polls.values(), return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
        for key in [k for k, t in polls.items() if t in done]:
            polls.pop(key).result()


def _may_submit(state: BatchLaneState) -> int:
    """How many requests the next batch may take: none while the first batch is still being validated (the
    model's batch support is not known yet) or the batches in flight are at their cap."""
    if not state.validated and state.open:
        return 0
    if len(state.open) >= state.settings.max_batches_in_flight:
        return 0
    return state.settings.size


async def _submit(dispatch: Any, run: Any, calls: BatchCalls, taken: list[tuple[Any, dict[str, Any]]]) -> None:
    """Journal the submission, ``POST`` it, journal its id; the requests' intents say they were sent."""
    state: BatchLaneState = run.batch
    by_shard: dict[int, list[tuple[Any, dict[str, Any]]]] = {}
    for shard, prompt in taken:
        by_shard.setdefault(id(shard), []).append((shard, prompt))
    for group in by_shard.values():  # one batch per shard: its journal lies beside the shard
        shard = group[0][0]
        key = uuid.uuid4().hex[:16]
        ids = [p["id"] for _, p in group]
        attempts = [1 + shard.tries.get(sid, 0) for sid in ids]
        reserve = run.batch_reserve(len(ids))
        batch = OpenBatch(key, ids, dispatch.session_id, attempts, time.time(), reserve, shard=shard)
        entries = [(f"{key}:{i}", dispatch.batch_entry_body(run, p)) for i, (_, p) in enumerate(group)]
        _append(batches_path(shard.work.out_path), {
            "event": "submitting", "key": key, "ids": ids, "session": batch.session, "attempts": attempts,
            "reserved": round(batch.reserved, 9),
        })  # fmt: skip
        for sid, attempt in zip(ids, attempts, strict=True):
            shard.tries[sid] = attempt
            dispatch.intent(shard, "sent", sid, attempt, params_hash=run.phash, batch=key)
        state.open.append(batch)
        dispatch.batch_flight_changed(run)
        try:
            obj = batch_object(
                await calls.call("POST", "/batches", submit_body(run.lane.settings.model, entries, state.only))
            )
        except FatalError as e:
            _forget(dispatch, run, batch, "not_created", f"refused: {e}")
            dispatch.halt(run, f"the Batch API refused a batch of {run.lane.settings.model}: {e}; use mode stream")
            return
        except RetryableError as e:
            # No answer: it may exist. Left unconfirmed; looked up in GET /batches before anything else is done.
            shard.log(f"{shard.name}: batch {key}: the submission's answer never came ({e}); looking it up")
            await _settle_unconfirmed(dispatch, run, calls, batch)
            continue
        _confirm(run, batch, obj)
        state.submitted += 1


def _confirm(run: Any, batch: OpenBatch, obj: dict[str, Any]) -> None:
    batch.batch_id, batch.provider = str(obj.get("id")), obj.get("provider")
    batch.status = str(obj.get("status") or "validating")
    _append(batches_path(batch.shard.work.out_path), {
        "event": "submitted", "key": batch.key, "batch": batch.batch_id, "provider": batch.provider,
    })  # fmt: skip
    batch.shard.log(f"{batch.shard.name}: batch {batch.batch_id}: {len(batch.ids)} requests submitted ({batch.status})")


def _forget(dispatch: Any, run: Any, batch: OpenBatch, event: str, why: str) -> None:
    """A batch that was never created (refused, or not in the account's list): its requests are pending again."""
    _append(batches_path(batch.shard.work.out_path), {"event": event, "key": batch.key, "why": why})
    for sid, attempt in zip(batch.ids, batch.attempts, strict=True):
        dispatch.intent(batch.shard, "failed", sid, attempt, session=batch.session, kind="batch_refused")
    run.batch.open.remove(batch)
    dispatch.batch_flight_changed(run)


async def _settle_unconfirmed(dispatch: Any, run: Any, calls: BatchCalls, batch: OpenBatch) -> None:
    found = await calls.find_unconfirmed(batch, run.lane.settings.model)
    shard = batch.shard
    if found is False:
        shard.log(f"{shard.name}: batch {batch.key} was never created (GET /batches): its requests go again")
        _forget(dispatch, run, batch, "not_created", "not in GET /batches")
        run.queue.extendleft((shard, shard.prompt(sid)) for sid in reversed(batch.ids))
    elif found is None:
        dispatch.halt(
            run,
            f"batch {batch.key} of {shard.name}: its submission was never confirmed and GET /batches cannot tell "
            "whether it exists; its requests are not submitted again (never paid twice): rerun later to look again",
        )
        run.batch.open.remove(batch)
        dispatch.batch_flight_changed(run)
    else:
        shard.log(f"{shard.name}: batch {batch.key} found in GET /batches as {found}: resumed")
        _confirm(run, batch, {"id": found})


async def _follow(dispatch: Any, run: Any, calls: BatchCalls, batch: OpenBatch) -> None:
    """Poll one batch until it finishes, journaling its results as they arrive."""
    state: BatchLaneState = run.batch
    interval = state.settings.poll_interval_s
    while True:
        try:
            obj = await calls.poll(batch)
        except RetryableError as e:
            batch.shard.log(f"{batch.shard.name}: batch {batch.batch_id}: poll failed ({e}); polling again")
            await asyncio.sleep(interval)
            continue
        except FatalError as e:
            dispatch.halt(run, f"batch {batch.batch_id}: {e}")
            return
        batch.status = str(obj.get("status") or batch.status)
        if batch.status != "validating":
            if batch.status == "failed" and not batch.done and not state.validated:
                why = (obj.get("error") or {}).get("message") or "no reason given"
                _forget(dispatch, run, batch, "finished", f"failed at validation: {why}")
                dispatch.halt(
                    run,
                    f"OpenRouter failed the first batch of {run.lane.settings.model} at validation: {why} (whether a "
                    "model takes batches is not published; this is its answer, nothing was billed): use mode stream",
                )
                return
            state.validated = True
        counts = obj.get("request_counts") or {}
        if batch.status in TERMINAL or int(counts.get("completed") or 0) > len(batch.done):
            for result in await calls.results(batch, obj):
                _take_result(dispatch, run, batch, result)
        if batch.status in TERMINAL:
            _finish(dispatch, run, batch, obj, obj.get("results") or [])
            return
        dispatch.wake()
        await asyncio.sleep(interval)


def _take_result(dispatch: Any, run: Any, batch: OpenBatch, result: dict[str, Any]) -> None:
    cid = str(result.get("custom_id") or "")
    entry = batch.entry(cid)
    if entry is None or cid in batch.done:
        return
    shard, sid = batch.shard, batch.ids[entry]
    fields = result_fields(result, run.lane.want_reasoning)
    if isinstance(fields, str):
        return  # an error: counted and retried when the batch finishes (it may still be answered here)
    batch.done.add(cid)
    if sid in shard.lines:
        return  # journaled already (a result seen before a kill)
    record = dispatch.batch_record(run, shard, entry, batch, fields)
    run.batch.billed += record["cost"]
    run.batch.at_list_price += _list_cost(run, record)
    dispatch.keep(run, shard, record)


def _list_cost(run: Any, record: dict[str, Any]) -> float:
    usage = record.get("usage") or {}
    prices = run.batch.list_prices
    return (
        float(usage.get("prompt_tokens") or 0) * prices.input
        + float(usage.get("completion_tokens") or 0) * prices.output
    )


def _finish(dispatch: Any, run: Any, batch: OpenBatch, obj: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """A finished batch: its entries without an answer are failed (expired, errored) and go to a later batch or the
    streaming path; its reservation is released."""
    state: BatchLaneState = run.batch
    shard = batch.shard
    errors = {str(r.get("custom_id")): result_fields(r, run.lane.want_reasoning) for r in results}
    kind = "batch_expired" if batch.status == "expired" else "batch_error"
    again = []
    for i, sid in enumerate(batch.ids):
        cid = f"{batch.key}:{i}"
        if cid in batch.done or sid in shard.lines:
            continue
        why = errors.get(cid)
        entry_kind = kind if not isinstance(why, str) or batch.status == "expired" else "batch_error"
        dispatch.intent(shard, "failed", sid, batch.attempts[i], session=batch.session, kind=entry_kind)
        dispatch.spend.retried(run.lane.account, run.lane.guard.expected_cost, run.per_most())
        if entry_kind == "batch_expired":
            state.expired_entries += 1
        else:
            state.failed_entries += 1
        run.stats.retries[entry_kind] += 1
        if batch.attempts[i] >= run.lane.limits.max_attempts:
            run.stats.final_errors[entry_kind] += 1
            run.stats.failed += 1
            shard.stats.final_errors[entry_kind] += 1
            shard.stats.failed += 1
            continue
        again.append((shard, shard.prompt(sid)))
    _append(batches_path(shard.work.out_path), {
        "event": "finished", "key": batch.key, "batch": batch.batch_id, "status": batch.status,
        "counts": obj.get("request_counts"), "provider": obj.get("provider") or batch.provider,
        "retried": len(again), "seconds": round(time.time() - batch.t, 1),
    })  # fmt: skip
    state.finished += 1
    state.durations.append(time.time() - batch.t)
    state.open.remove(batch)
    shard.log(
        f"{shard.name}: batch {batch.batch_id} {batch.status} after {time.time() - batch.t:.0f}s: "
        f"{len(batch.done)} answered, {len(again)} to retry "
        f"({'streaming' if state.settings.failed == 'stream' else 'next batch'})"
    )
    if state.settings.failed == "stream":
        run.stream_queue.extend(again)
    else:
        run.queue.extendleft(reversed(again))
    dispatch.batch_flight_changed(run)
