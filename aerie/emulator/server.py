"""The emulator's HTTP server: :class:`Emulator`, its routes, and the chat request from body to answer.

The chat handler reads the request in the order a provider would: checks, routing, a fault drawn before any
provider works, the answer (made up or upstream), the money checks, the wait while "generating", then the
answer or the fault that breaks it. The pieces it calls own the rest: routing, billing, faults, made_up,
upstream, envelope, request_log.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from aerie.emulator import envelope, made_up
from aerie.emulator.batches import BatchStore
from aerie.emulator.billing import Ledger, price
from aerie.emulator.envelope import Refusal
from aerie.emulator.faults import FaultInjector, refusal_before_provider, reset_connection, send_torn
from aerie.emulator.request_log import RequestLog
from aerie.emulator.routing import route
from aerie.emulator.settings import EmulatorSettings, check_settings
from aerie.emulator.upstream import Upstream, UpstreamAnswer, UpstreamError

PREFIXES = ("/api/v1", "/v1")  # every path is served under both, so plain OpenAI clients work too
UNAUTHORIZED = "Missing or invalid API key (emulator)"


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(obj).encode(), content_type="application/json")


def _answer(out: dict[str, Any], gen_id: str) -> web.Response:
    """A chat completion (or an error reported inside HTTP 200), with OpenRouter's generation id header."""
    return web.Response(
        body=json.dumps(out).encode(), content_type="application/json", headers={"X-Generation-Id": gen_id}
    )


@dataclass
class _ChatRequest:
    """A chat request as read from its body (any field may be missing or of the wrong type until checked)."""

    body: Any
    model: Any = None
    max_tokens: Any = None
    messages: Any = None
    sha: str | None = None  # of the canonical messages: the request log's key

    @classmethod
    def parse(cls, raw: bytes) -> _ChatRequest:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return cls(body)
        messages = body.get("messages")
        sha = None
        if isinstance(messages, list):
            canon = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            sha = hashlib.sha256(canon.encode()).hexdigest()
        return cls(body, body.get("model"), body.get("max_tokens", body.get("max_completion_tokens")), messages, sha)


@dataclass(frozen=True)
class _Answer:
    """The answer's token counts and finish, and the upstream target's own answer when there is one."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    finish: str
    upstream: UpstreamAnswer | None = None


class Emulator:
    """The server. ``await start(host, port)`` returns the base URL (``.../api/v1``); ``await stop()``."""

    def __init__(self, settings: EmulatorSettings | None = None):
        self.settings = s = settings or EmulatorSettings()
        check_settings(s)
        self.faults = FaultInjector(s)
        self.ledger = Ledger(s)
        # Opened on the first forwarded request, not here: a rehearsal starts the emulator first and points
        # settings.upstream_url at the target's server once that is up (the settings object is shared).
        self._upstream: Upstream | None = None
        self.requests = RequestLog(s.request_log, s.log_flush_interval)
        self.batches = BatchStore(s, self.ledger, self.requests)
        self._boot = f"{int(time.time()):x}{os.getpid() & 0xFFFF:04x}"
        self._n = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # long prompts are fine
        for p in PREFIXES:
            app.router.add_post(f"{p}/chat/completions", self._chat)
            app.router.add_get(f"{p}/key", self._key)
            app.router.add_get(f"{p}/credits", self._credits)
            app.router.add_get(f"{p}/models", self._models)
            app.router.add_get(p + "/models/{author}/{slug}/endpoints", self._endpoints)
            app.router.add_get(f"{p}/health", self._health)
            app.router.add_get(f"{p}/emulator/stats", self._stats)
            app.router.add_post(f"{p}/batches", self._batch_submit)
            app.router.add_get(f"{p}/batches", self._batch_list)
            app.router.add_get(p + "/batches/{id}", self._batch_get)
            app.router.add_get(p + "/batches/{id}/results", self._batch_results)
        app.router.add_get("/health", self._health)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None) -> str:
        """Listen on host:port (0: a free port), over TLS when ``ssl_context`` is given; returns the API root."""
        self.requests.open()
        # No access log: a line per request would cost more than the emulated request itself.
        self._runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=4096, ssl_context=ssl_context)
        await site.start()
        bound_port = self._runner.addresses[0][1]
        url_host = f"[{host}]" if ":" in host else host
        scheme = "https" if ssl_context is not None else "http"
        self.base_url = f"{scheme}://{url_host}:{bound_port}/api/v1"
        return self.base_url

    async def stop(self) -> None:
        # Cancel handlers still sleeping (slow faults, latency) so shutdown is prompt.
        me = asyncio.current_task()
        for task in list(self._tasks):
            if task is not me:
                task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._upstream is not None:
            await self._upstream.close()
        await self.requests.close()

    def stats(self) -> dict[str, Any]:
        self.batches.advance()
        return {
            "batches": self.batches.counts(),
            "requests": sum(self.requests.outcomes.values()),
            "outcomes": dict(self.requests.outcomes),
            "charged_usd": self.ledger.usage,
            "charged_completion_tokens": self.requests.charged_tokens,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,  # the most chat requests in flight at once since the start
            "reserved_usd": self.ledger.reserved,
        }

    # ---- helpers ---------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        want = self.settings.api_key
        if want is None:
            return True
        got = request.headers.get("Authorization", "")
        token = got[7:].strip() if got[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode(), want.encode())

    # ---- chat ------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._chat_inner(request)
        finally:
            self.in_flight -= 1
            if task is not None:
                self._tasks.discard(task)

    async def _chat_inner(self, request: web.Request) -> web.StreamResponse:
        chat = _ChatRequest.parse(await request.read())
        refusal = self._check_request(request, chat)
        if refusal is not None:
            return self._reject(chat, refusal)
        # Everything about the answer comes from one RNG seeded by the request itself.
        seed_src = f"{chat.model}\n{chat.body.get('seed')}\n{chat.sha}".encode()
        rng = random.Random(int.from_bytes(hashlib.sha256(seed_src).digest()[:8], "big"))
        provider = route(self.settings.providers, chat.body.get("provider"), rng)
        if provider is None:
            message = "No endpoints found matching the requested provider preferences (emulated routing)"
            return self._reject(chat, Refusal("no-endpoints", 503, message))
        fault = self.faults.draw_fault()
        refusal = refusal_before_provider(fault, self.settings, provider.name)
        if refusal is not None:
            return self._reject(chat, refusal, provider.name)
        if fault == "reset":
            self._record(chat, fault, 0, 0.0, provider.name)
            reset_connection(request)
            return web.Response(status=500)  # never reaches the client: the socket is gone

        answer = await self._answer_tokens(chat, provider.name, rng)
        if isinstance(answer, Refusal):
            return self._reject(chat, answer, provider.name)
        bill = price(provider, answer.prompt_tokens, answer.completion_tokens, chat.max_tokens)
        refusal = self.ledger.refusal(bill)
        if refusal is not None:
            return self._reject(chat, refusal, provider.name)
        charged = fault in (None, "slow")
        await self._generate(chat, bill, charged, answer.completion_tokens, fault, provider.name)
        return await self._deliver(request, chat, answer, rng, bill, charged, fault, provider.name)

    def _record(
        self, chat: _ChatRequest, outcome: str, status: int, cost: float = 0.0, provider: str | None = None,
        tokens: int = 0,
    ) -> None:  # fmt: skip
        self.requests.add(chat.sha, chat.model, chat.max_tokens, outcome, status, cost, provider, tokens)

    def _reject(self, chat: _ChatRequest, refusal: Refusal, provider: str | None = None) -> web.Response:
        self._record(chat, refusal.outcome, refusal.status, 0.0, provider)
        return web.Response(
            status=refusal.status,
            body=envelope.error_body(refusal.status, refusal.message, refusal.metadata),
            content_type="application/json",
            headers=refusal.headers,
        )

    def _check_request(self, request: web.Request, chat: _ChatRequest) -> Refusal | None:
        """The checks a provider makes before any work: the key, then the body (fills in the default max_tokens)."""
        s = self.settings

        def bad(message: str) -> Refusal:
            return Refusal("400", 400, message)

        if not self._authorized(request):
            return Refusal("401", 401, UNAUTHORIZED)
        if not isinstance(chat.body, dict):
            return bad("Request body is not a JSON object")
        if not isinstance(chat.model, str) or not chat.model:
            return bad("'model' is required")
        messages = chat.messages
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return bad("'messages' must be a non-empty list of message objects")
        if chat.body.get("stream"):
            return bad("streaming not emulated")
        if s.strict_models and chat.model not in s.models:
            return bad(f"{chat.model} is not a valid model ID (emulator knows {', '.join(s.models)})")
        if chat.max_tokens is None:
            chat.max_tokens = s.default_max_tokens
        if isinstance(chat.max_tokens, bool) or not isinstance(chat.max_tokens, int) or chat.max_tokens < 1:
            return bad("'max_tokens' must be a positive integer")
        return None

    async def _answer_tokens(self, chat: _ChatRequest, pname: str, rng: random.Random) -> _Answer | Refusal:
        """The answer's token counts: the upstream target's own answer, or made up from the request's RNG."""
        if self.settings.upstream_url:
            # The target's own answer; faults that never reach a provider were drawn before (no wasted work).
            if self._upstream is None:
                self._upstream = Upstream(self.settings)
            try:
                up = await self._upstream.ask(chat.body, chat.model, chat.max_tokens)
            except UpstreamError as exc:
                return Refusal("upstream-error", 502, f"Upstream server error: {exc}", {"provider_name": pname})
            return _Answer(up.prompt_tokens, up.completion_tokens, up.reasoning_tokens, up.finish, up)
        s = self.settings
        reasoning_tokens, content_tokens, finish = made_up.plan_tokens(
            s, chat.body.get("reasoning"), rng, chat.max_tokens
        )
        return _Answer(
            made_up.prompt_tokens(chat.messages), reasoning_tokens + content_tokens, reasoning_tokens, finish
        )

    async def _generate(
        self, chat: _ChatRequest, bill: Any, charged: bool, completion_tokens: int, fault: str | None, pname: str
    ) -> None:
        """The provider "generates": the money is held while it waits as long as the answer takes."""
        with self.ledger.hold(bill, charged):
            try:
                delay = self.faults.delay(completion_tokens, fault)
                if delay > 0:
                    await asyncio.sleep(delay)
            except asyncio.CancelledError:
                # The handler was cancelled (server shutdown, or aiohttp cancelling on disconnect): the
                # provider's generation had started and is billed in full, as a real provider does.
                if charged:
                    self.ledger.charge(bill.cost)
                    self._record(chat, "client-gone", 0, bill.cost, pname, completion_tokens)
                raise

    async def _deliver(
        self,
        request: web.Request,
        chat: _ChatRequest,
        answer: _Answer,
        rng: random.Random,
        bill: Any,
        charged: bool,
        fault: str | None,
        pname: str,
    ) -> web.StreamResponse:
        """The answer in OpenRouter's envelope, or the fault that breaks it (an error inside HTTP 200, a torn
        body); billed when charged, recorded either way."""
        self._n += 1
        gen_id = f"gen-{self._boot}-{self._n:07d}"
        body, up = chat.body, answer.upstream
        content_tokens = answer.completion_tokens - answer.reasoning_tokens
        if up is not None:
            reasoning_text, content = up.reasoning, up.content
        else:
            reasoning_text = made_up.filler(rng, answer.reasoning_tokens) if answer.reasoning_tokens else None
            content = made_up.filler(rng, content_tokens)
        excluded = isinstance(body.get("reasoning"), dict) and bool(body["reasoning"].get("exclude"))
        if excluded or body.get("include_reasoning") is False:
            reasoning_text = None  # still produced and billed, just not returned
        finish = answer.finish
        native = {"length": "max_tokens"}.get(finish, finish)  # stop, tool_calls (upstream mode)
        if fault == "200-error":
            if self.faults.error200_as_envelope():  # alternate the two ways a started generation fails
                self._record(chat, fault, 200, 0.0, pname)
                return _answer(envelope.mid_generation_error(gen_id, chat.model, pname), gen_id)
            content = " ".join(content.split()[: content_tokens // 2])
            finish = native = "error"
        charged_costs = (bill.cost, bill.prompt_cost, bill.completion_cost) if charged else (0.0, 0.0, 0.0)
        usage_cost = charged_costs[0]
        message = envelope.assistant_message(content, reasoning_text, up.tool_calls if up is not None else None)
        usage = envelope.usage_and_cost(
            answer.prompt_tokens, answer.completion_tokens, answer.reasoning_tokens, *charged_costs
        )
        out = envelope.chat_completion(gen_id, chat.model, pname, finish, native, message, usage)
        if fault == "torn":
            self._record(chat, fault, 200, 0.0, pname)
            return await send_torn(request, json.dumps(out).encode(), gen_id)
        if charged:
            self.ledger.charge(bill.cost)
        tokens = answer.completion_tokens if charged else 0
        if request.transport is None or request.transport.is_closing():
            # The client left while the model was generating: billed, never delivered.
            self._record(chat, "client-gone", 0, usage_cost, pname, tokens)
            return web.Response(status=499)  # nobody reads it; 499 "client closed request" as providers log it
        self._record(chat, fault or "ok", 200, usage_cost, pname, tokens)
        return _answer(out, gen_id)

    # ---- other endpoints -------------------------------------------------------------------
    async def _key(self, request: web.Request) -> web.Response:
        self.batches.advance()  # a batch bills its entries as they finish, whether or not anyone polls
        if not self._authorized(request):
            return _json({"error": {"code": 401, "message": UNAUTHORIZED}}, 401)
        return _json(envelope.key_info(self.settings.key_limit, self.ledger.usage))

    async def _credits(self, request: web.Request) -> web.Response:
        self.batches.advance()
        if not self._authorized(request):
            return _json({"error": {"code": 401, "message": UNAUTHORIZED}}, 401)
        return _json({"data": {"total_credits": self.settings.credits, "total_usage": self.ledger.usage}})

    async def _models(self, request: web.Request) -> web.Response:
        return _json(envelope.models_listing(self.settings))

    async def _endpoints(self, request: web.Request) -> web.Response:
        model = f"{request.match_info['author']}/{request.match_info['slug']}"
        if not (model in self.settings.models or not self.settings.strict_models):
            return _json({"error": {"code": 404, "message": f"No model {model} (emulator)"}}, 404)
        return _json(envelope.endpoints_listing(self.settings, model))

    # ---- the Batch API (aerie.emulator.batches) ------------------------------------------------------------------
    async def _batch_submit(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _json({"error": {"code": 401, "message": UNAUTHORIZED}}, 401)
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        why = self.batches.check(body)
        if why is not None:
            return _json({"error": {"code": 400, "message": why}}, 400)
        batch = self.batches.submit(body)
        if self.batches.fault("lost-submit"):
            reset_connection(request)  # created, and the answer never arrives
            return web.Response(status=500)
        return _json(self.batches.obj(batch, results=False), 202)

    def _batch_of(self, request: web.Request):
        self.batches.advance()
        return self.batches.batches.get(request.match_info["id"])

    async def _batch_get(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _json({"error": {"code": 401, "message": UNAUTHORIZED}}, 401)
        batch = self._batch_of(request)
        if batch is None:
            return _json({"error": {"code": 404, "message": "No such batch (emulator)"}}, 404)
        if self.batches.fault("lost-poll"):
            reset_connection(request)
            return web.Response(status=500)
        return _json(self.batches.obj(batch, results=True))

    async def _batch_results(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _json({"error": {"code": 401, "message": UNAUTHORIZED}}, 401)
        batch = self._batch_of(request)
        if batch is None:
            return _json({"error": {"code": 404, "message": "No such batch (emulator)"}}, 404)
        return _json({"data": self.batches.results_so_far(batch)})

    async def _batch_list(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _json({"error": {"code": 401, "message": UNAUTHORIZED}}, 401)
        self.batches.advance()
        return _json({"data": [self.batches.obj(b, results=False) for b in self.batches.batches.values()]})

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def _stats(self, request: web.Request) -> web.Response:
        return _json(self.stats())
