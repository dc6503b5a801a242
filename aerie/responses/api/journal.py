"""The never-pay-twice journal of a responses shard (lines are `aerie.responses/1` records).

Snakemake deletes a failed job's declared outputs and treats a leftover partial output as finished
(../shared/notes/snakemake.md), so paid work cannot live in the declared output while the job runs.
Each shard instead appends every finished sample to an *undeclared* file next to it,
``shard-NNNNN.journal.jsonl``: one JSON line per sample, written with a single ``write`` as soon as
the response arrives (a ``kill -9`` cannot lose it) and fsynced in batches (a power cut loses at most
the last batch; one fsync per sample would cap throughput far below 2,000 requests in flight).

On restart the journal is read back: a torn last line (the process died inside ``write``) is cut
off, and a sample counts as finished only when its id, request-parameter hash and messages all match
what would be requested now, so changed sampling parameters never reuse old responses. The declared
shard output is written from the journal, atomically, once every sample is in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.tools.artifacts import FormatError

INTENT_FORMAT = "aerie.request-intent/2"
INTENT_FORMATS = ("aerie.request-intent/1", INTENT_FORMAT)
# Failures after which the provider may have generated, and billed, the answer we never read: no answer in time,
# a connection lost after the request left, half a body, an error reported inside HTTP 200, an unreadable body.
# (429, 5xx, 402 and 4xx answers refuse the request before any model works: never billed.)
# A batch entry that errored or expired (aerie.responses.api.batches) is counted the same way: whether a provider bills
# any of it is not published, so the account's figure decides (aerie.responses.api.key_books).
BILLABLE_FAILURES = frozenset(
    {"timeout", "connection", "torn", "200_error", "bad_body", "batch_error", "batch_expired"}
)


def intents_path(shard_output: str | Path) -> Path:
    """``shard-00000.jsonl`` -> ``shard-00000.intents.jsonl``: a line before each request is sent, and one after
    each request that failed."""
    p = Path(shard_output)
    return p.with_name(p.name.removesuffix(".jsonl") + ".intents.jsonl")


def jsonl_objects(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file written by single appends; a torn or foreign line is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().split(b"\n"):
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def unseen_intents(path: Path, state: JournalState) -> set[str]:
    """Sample ids that were sent (an intent line) and have no answer journaled under the current parameters.

    Each was in flight when an earlier process died, or failed every attempt: the provider may have billed it
    although no journal holds it. A torn last line is ignored (its request never left).
    """
    sent = {
        rec["id"] for rec in jsonl_objects(path) if rec.get("id") is not None and rec.get("event", "sent") == "sent"
    }
    return sent - set(state.finished)


@dataclass
class RequestTally:
    """What became of every request one shard sent: its intents log read against its journal.

    A request is the pair (session, attempt) of a sample id: ``session`` names the process that sent it (every
    intent, failure and journal line carries it), ``attempt`` counts its tries there. Answered requests have a
    journal line with the same three; failed ones a ``failed`` line; the rest got neither: they were in flight
    when their process died (the provider bills them all the same, docs/formats.md).
    """

    sent: int = 0
    journaled: int = 0
    failed: Counter = field(default_factory=Counter)  # failure kind -> requests
    unanswered: list[float] = field(default_factory=list)  # send times (unix s) of requests in flight at a death
    billable: list[float] = field(default_factory=list)  # send times of failed requests a provider may have billed

    @property
    def billable_failures(self) -> int:
        """Failed requests the provider may have billed (``BILLABLE_FAILURES``): retries that can cost money."""
        return sum(n for kind, n in self.failed.items() if kind in BILLABLE_FAILURES)


def request_tally(shard_output: str | Path) -> RequestTally:
    """Classify every request of a shard (journaled, failed by kind, unanswered) from its intents and journal.

    Intents of ``aerie.request-intent/1`` (no session, no failure lines) count as answered when their sample id is
    journaled at all, else as unanswered."""
    tally = RequestTally()
    journal = jsonl_objects(journal_path(shard_output))
    answered = {(r.get("session"), r.get("id"), r.get("attempts")) for r in journal if r.get("session")}
    journaled_ids = {r.get("id") for r in journal}
    lines = jsonl_objects(intents_path(shard_output))
    failed = {
        (r.get("session"), r.get("id"), r.get("attempt")): r.get("kind") for r in lines if r.get("event") == "failed"
    }
    for rec in lines:
        if rec.get("event", "sent") != "sent" or rec.get("id") is None:
            continue
        tally.sent += 1
        key = (rec.get("session"), rec["id"], rec.get("attempt"))
        if key[0] is None:
            answered_here = rec["id"] in journaled_ids
        else:
            answered_here = key in answered
        if answered_here:
            tally.journaled += 1
        elif key in failed:
            tally.failed[str(failed[key])] += 1
            if failed[key] in BILLABLE_FAILURES:
                tally.billable.append(float(rec.get("t") or 0.0))
        else:
            tally.unanswered.append(float(rec.get("t") or 0.0))
    return tally


def journal_path(shard_output: str | Path) -> Path:
    """``results/x/responses/shard-00000.jsonl`` -> ``results/x/responses/shard-00000.journal.jsonl``."""
    p = Path(shard_output)
    return p.with_name(p.name.removesuffix(".jsonl") + ".journal.jsonl")


def messages_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """Canonical JSON of a prompt, compared on resume (a prompt edited under the same id is new work)."""
    prompt = {"messages": messages, "tools": tools} if tools else messages
    return json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class JournalState:
    """What a journal holds for the current request parameters."""

    finished: dict[str, dict[str, Any]] = field(default_factory=dict)  # sample id -> record
    lines: dict[str, bytes] = field(default_factory=dict)  # sample id -> its journal line, as written
    stale: int = 0  # lines from other parameters or other prompt text (kept on disk, not reused)
    torn_bytes: int = 0  # bytes of a torn last line that were cut off
    cost: float = 0.0  # dollars of every line, stale ones included: money already spent


def read_journal(
    path: Path, params_hash: str | None = None, prompts: dict[str, str] | None = None, repair: bool = False
) -> JournalState:
    """Read a journal. ``prompts`` maps sample id -> ``messages_key``; ``repair`` cuts a torn tail.

    Only the last line can be torn (appends are single writes and a torn tail is cut before the next
    append), so a malformed line elsewhere is corruption and raises FormatError naming file:line.
    """
    state = JournalState()
    if not path.exists():
        return state
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
    if end < len(data):
        state.torn_bytes = len(data) - end
        if repair:
            with open(path, "r+b") as fh:
                fh.truncate(end)
                os.fsync(fh.fileno())
    for lineno, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise FormatError(
                f"{path}:{lineno}: corrupt journal line ({e.msg}); only a torn last line is "
                "expected - move the file aside to inspect it"
            ) from None
        state.cost += float(rec.get("cost") or 0.0)
        sid = rec.get("id")
        current = params_hash is None or rec.get("params_hash") == params_hash
        same_prompt = prompts is None or prompts.get(sid) == messages_key(rec.get("messages", []), rec.get("tools"))
        if current and same_prompt and sid is not None:
            state.finished[sid] = rec  # a later line for the same sample wins (cannot happen normally)
            state.lines[sid] = line + b"\n"
        else:
            state.stale += 1
    return state


class Journal:
    """Append-only writer; call :meth:`append` per finished sample, :meth:`close` at the end.

    Writes go straight to the file descriptor (no Python buffering: a killed process loses nothing
    it appended). ``fsync`` runs at most every ``sync_interval`` seconds in a worker thread, so the
    event loop never blocks on the disk.
    """

    def __init__(self, path: Path, sync_interval: float = 0.2):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.sync_interval = sync_interval
        self._dirty = False
        self._last_sync = time.monotonic()
        self._sync_task: asyncio.Future | None = None
        self.appended = 0
        self.syncs = 0

    def append(self, record: dict[str, Any]) -> bytes:
        """Write one record as one line; returns the line (the shard output reuses it verbatim)."""
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        written = os.write(self._fd, line)
        while written < len(line):  # regular files take all of it; loop for completeness
            written += os.write(self._fd, line[written:])
        self.appended += 1
        self._dirty = True
        self._maybe_sync()
        return line

    def _maybe_sync(self) -> None:
        if not self._dirty or (self._sync_task is not None and not self._sync_task.done()):
            return
        if time.monotonic() - self._last_sync < self.sync_interval:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.sync()
            return
        self._dirty = False
        self._last_sync = time.monotonic()
        self.syncs += 1
        self._sync_task = loop.run_in_executor(None, os.fsync, self._fd)

    def sync(self) -> None:
        os.fsync(self._fd)
        self._dirty = False
        self._last_sync = time.monotonic()
        self.syncs += 1

    async def aclose(self) -> None:
        if self._sync_task is not None:
            await self._sync_task
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


def dataset_journal_totals(responses_dir: Path) -> dict[str, float]:
    """Spend and output tokens of every journal in a dataset's responses folder (stale lines too)."""
    cost = tokens = samples = 0.0
    for path in sorted(responses_dir.glob("shard-*.journal.jsonl")):
        for rec in jsonl_objects(path):  # a torn tail: the sample is re-requested and counted then
            cost += float(rec.get("cost") or 0.0)
            tokens += int((rec.get("usage") or {}).get("completion_tokens") or 0)
            samples += 1
    return {"cost": cost, "completion_tokens": tokens, "samples": samples}
