"""OpenRouter's Batch API, emulated: ``POST /batches``, ``GET /batches``, ``GET /batches/{id}`` and
``GET /batches/{id}/results``, with the faults a client must survive.

A batch is checked like OpenRouter checks one (``endpoint`` ``/v1/chat/completions``, a ``model``, an inline
``requests`` array of unique ``custom_id`` and ``body`` each; ``provider`` takes ``only`` and nothing else), answered
``202`` in status ``validating``, then runs on one provider: the cheapest of ``only`` (else of all) that has a batch
endpoint (``batch_providers``) for a batch-eligible model (``batch_models``). It is ``in_progress`` after
``batch_validate_s``; each entry finishes at a draw within ``2 x batch_latency_mean`` after that and is billed then
(at ``batch_discount`` of the provider's per-token price), whether or not anyone polls: time moves on every call of
the emulator, ``GET /key`` included. A finished batch carries its results inline; ``/results`` gives those finished
so far (while it is still in progress too).

Faults (``settings.batch_faults``, probabilities): ``validating`` (the batch fails validation: status ``failed``,
``error.message``, nothing billed - as a model without a batch endpoint does), ``expire`` (the batch expires
halfway: its unfinished entries end with the error ``batch_expired``, unbilled), ``entry-error`` (per entry: an
error result, unbilled), ``lost-poll`` (per ``GET /batches/{id}``: the connection is reset, no answer), and
``lost-submit`` (per ``POST``: the batch is created, then the connection is reset before the answer).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from aerie.emulator import envelope, made_up
from aerie.emulator.billing import Ledger, price
from aerie.emulator.request_log import RequestLog
from aerie.emulator.routing import route
from aerie.emulator.settings import EmulatorSettings, FakeProvider

CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass
class _Entry:
    custom_id: str
    body: dict[str, Any]
    sha: str
    done_at: float  # unix s
    result: dict[str, Any] | None = None


@dataclass
class _Batch:
    id: str
    model: str
    created_at: float
    runs_at: float  # validated: in_progress from then
    provider: FakeProvider | None
    entries: list[_Entry]
    refusal: str | None = None  # why it fails validation
    expires_at: float | None = None  # expires then (a fault)
    status: str = "validating"
    finalized_at: float | None = None
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})


def _sha(messages: Any) -> str:
    return hashlib.sha256(
        json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()


class BatchStore:
    """Every batch the emulator was given, advanced to the present at each call."""

    def __init__(self, settings: EmulatorSettings, ledger: Ledger, requests: RequestLog):
        self.settings, self.ledger, self.requests = settings, ledger, requests
        self.batches: dict[str, _Batch] = {}
        self._rng = random.Random(settings.fault_seed + 7)

    def fault(self, kind: str) -> bool:
        return self._rng.random() < self.settings.batch_faults.get(kind, 0.0)

    # ---- submission ------------------------------------------------------------------------------------------------

    def check(self, body: Any) -> str | None:
        """Why OpenRouter would refuse this submission with a 400 (None: accepted)."""
        if not isinstance(body, dict):
            return "Request body is not a JSON object"
        if body.get("endpoint") != CHAT_ENDPOINT:
            return f"endpoint must be {CHAT_ENDPOINT} (emulated)"
        if not isinstance(body.get("model"), str) or not body["model"]:
            return "'model' is required"
        provider = body.get("provider") or {}
        if not isinstance(provider, dict) or set(provider) - {"only"}:
            return "Batch provider routing preferences: only provider.only is supported"
        items = body.get("requests")
        if not isinstance(items, list) or not items:
            return "'requests' must be a non-empty array"
        ids = [r.get("custom_id") if isinstance(r, dict) else None for r in items]
        if any(not isinstance(i, str) or not i for i in ids) or len(set(ids)) != len(ids):
            return "every request needs a unique custom_id"
        if any(not isinstance(r.get("body"), dict) or not isinstance(r["body"].get("messages"), list) for r in items):
            return "every request needs a body with messages"
        return None

    def submit(self, body: dict[str, Any]) -> _Batch:
        s = self.settings
        now = time.time()
        model = body["model"]
        only = (body.get("provider") or {}).get("only")
        eligible = [p for p in s.providers if s.batch_providers is None or p.slug in s.batch_providers]
        provider = route(eligible, {"only": only, "sort": "price"} if only else {"sort": "price"}, self._rng)
        refusal = None
        if s.batch_models is not None and model not in s.batch_models:
            refusal = f"{model} has no batch-eligible endpoint (emulated)"
        elif provider is None:
            refusal = "No batch endpoint matches the provider preferences (emulated)"
        elif self.fault("validating"):
            refusal = "Batch validation failed (emulated fault)"
        runs_at = now + s.batch_validate_s
        entries = [
            _Entry(
                r["custom_id"],
                r["body"],
                _sha(r["body"]["messages"]),
                runs_at + self._rng.uniform(0, 2 * s.batch_latency_mean),
            )
            for r in body["requests"]
        ]
        batch_id = f"batch_{len(self.batches) + 1:06d}_{int(now * 1000) % 10**9:09d}"
        batch = _Batch(batch_id, model, now, runs_at, provider, entries, refusal)
        if refusal is None and self.fault("expire"):
            batch.expires_at = runs_at + s.batch_latency_mean  # halfway through the entries' finishing times
        self.batches[batch_id] = batch
        return batch

    # ---- time ----------------------------------------------------------------------------------------------------

    def advance(self) -> None:
        """Bring every batch to now: validation, entries finished (and billed), expiry, the end."""
        now = time.time()
        for b in self.batches.values():
            if b.status in ("completed", "failed", "expired", "cancelled"):
                continue
            if now < b.runs_at:
                continue
            if b.refusal is not None:
                b.status, b.finalized_at = "failed", b.runs_at
                continue
            b.status = "in_progress"
            cutoff = min(now, b.expires_at) if b.expires_at is not None else now
            for e in b.entries:
                if e.result is None and e.done_at <= cutoff:
                    e.result = self._answer(b, e)
            if b.expires_at is not None and now >= b.expires_at:
                for e in b.entries:
                    if e.result is None:
                        e.result = self._error(b, e, "batch_expired", "The batch expired before this request ran")
                b.status, b.finalized_at = "expired", b.expires_at
            elif all(e.result is not None for e in b.entries):
                b.status, b.finalized_at = "completed", max(e.done_at for e in b.entries)

    def _error(self, b: _Batch, e: _Entry, code: str, message: str) -> dict[str, Any]:
        self.requests.add(e.sha, b.model, e.body.get("max_tokens"), f"batch-{code}", 0, 0.0, b.provider.name)
        return {"id": f"{b.id}-{e.custom_id}", "custom_id": e.custom_id, "response": None,
                "error": {"code": code, "message": message}}  # fmt: skip

    def _answer(self, b: _Batch, e: _Entry) -> dict[str, Any]:
        """One entry's chat completion, made up like a chat answer and billed at the batch price."""
        if self.fault("entry-error"):
            return self._error(b, e, "provider_error", "The provider failed this request (emulated)")
        s, p = self.settings, b.provider
        seed_src = f"{b.model}\n{e.body.get('seed')}\n{e.sha}".encode()
        rng = random.Random(int.from_bytes(hashlib.sha256(seed_src).digest()[:8], "big"))
        max_tokens = int(e.body.get("max_tokens") or s.default_max_tokens)
        reasoning_tokens, content_tokens, finish = made_up.plan_tokens(s, e.body.get("reasoning"), rng, max_tokens)
        prompt_tokens = made_up.prompt_tokens(e.body["messages"])
        completion = reasoning_tokens + content_tokens
        discounted = FakeProvider(p.name, p.quantization, p.prompt_price * s.batch_discount,
                                  p.completion_price * s.batch_discount)  # fmt: skip
        bill = price(discounted, prompt_tokens, completion, max_tokens)
        self.ledger.charge(bill.cost)
        self.requests.add(e.sha, b.model, max_tokens, "batch-ok", 200, bill.cost, p.name, completion)
        b.usage["prompt_tokens"] += prompt_tokens
        b.usage["completion_tokens"] += completion
        reasoning = made_up.filler(rng, reasoning_tokens) if reasoning_tokens else None
        message = envelope.assistant_message(made_up.filler(rng, content_tokens), reasoning, None)
        usage = envelope.usage_and_cost(prompt_tokens, completion, reasoning_tokens, bill.cost, bill.prompt_cost,
                                        bill.completion_cost)  # fmt: skip
        native = {"length": "max_tokens"}.get(finish, finish)
        body = envelope.chat_completion(f"gen-{b.id}-{e.custom_id}", b.model, p.name, finish, native, message, usage)
        return {"id": f"{b.id}-{e.custom_id}", "custom_id": e.custom_id,
                "response": {"status_code": 200, "request_id": body["id"], "body": body}, "error": None}  # fmt: skip

    # ---- what a client reads -------------------------------------------------------------------------------------

    def obj(self, b: _Batch, results: bool) -> dict[str, Any]:
        done = [e for e in b.entries if e.result is not None]
        failed = [e for e in done if e.result.get("error")]
        terminal = b.status in ("completed", "failed", "expired", "cancelled")
        return {
            "id": b.id,
            "object": "batch",
            "endpoint": CHAT_ENDPOINT,
            "model": b.model,
            "provider": b.provider.name if b.provider is not None and b.status != "validating" else None,
            "status": b.status,
            "completion_window": "24h",
            "created_at": int(b.created_at),
            "expires_at": int(b.created_at + 24 * 3600),
            "finalized_at": int(b.finalized_at) if b.finalized_at else None,
            "request_counts": {"total": len(b.entries), "completed": len(done) - len(failed), "failed": len(failed)},
            "usage": {**b.usage, "total_tokens": sum(b.usage.values())},
            "error": {"message": b.refusal} if b.status == "failed" else None,
            "results": [e.result for e in b.entries if e.result is not None] if results and terminal else None,
        }

    def results_so_far(self, b: _Batch) -> list[dict[str, Any]]:
        return [e.result for e in b.entries if e.result is not None]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.batches.values():
            out[b.status] = out.get(b.status, 0) + 1
        return out
