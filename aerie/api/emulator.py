"""A local stand-in for the OpenRouter chat API, for tests, benchmarks and dry runs of a config.

What is emulated (see shared/notes/openrouter.md for the real API's behaviour):

- ``POST /chat/completions`` (non-streaming only): an OpenAI-shaped answer with OpenRouter's extras
  (``provider``, ``message.reasoning`` / ``reasoning_details``, ``usage.cost``, ``native_finish_reason``,
  the ``X-Generation-Id`` header). The text is made-up words drawn by an RNG seeded from
  (model, seed, messages), so the same request always gets the same answer. One word is one "token".
- provider routing over a list of fake providers: ``only`` / ``ignore`` / ``quantizations`` /
  ``max_price`` filters, ``order``, ``sort: price``; otherwise price-weighted load balancing, picked
  deterministically per request. A filter that leaves nothing gives 503 "No endpoints found".
- money: credits and a key limit (final 402s), an in-flight budget (transient 402 with Retry-After),
  ``GET /key``, ``GET /credits``, ``GET /models``, ``GET /models/{author}/{slug}/endpoints``.
- latency (a distribution plus time per output token) and injected faults: 429 (with or without
  Retry-After), 5xx, errors inside HTTP 200, torn bodies, connection resets, very slow answers, 402s.

Not emulated: streaming, tools, images, real tokenizers, rate limits by key, provider fallback after
a provider error, moderation. Faulted requests are never charged, except ``slow``, which is a normal
answer that arrives late (a real provider bills a finished generation even if the client gave up).

Billing is a provider's: a generation that started is charged when it ends, whether or not the client
is still there. A client that disconnects (or is killed) while its request is in flight is billed all
the same, the request log records the outcome ``client-gone``, and ``GET /key`` / ``/credits`` include
the charge once the generation would have finished.

Upstream mode (``--upstream URL``): the answer is a real model's. The chat request (messages, tools,
max_tokens, temperature, top_p, seed, stop) is forwarded to an OpenAI-compatible server - e.g.
``transformers serve`` running the target (``python -m aerie.api.serve``) - and its reasoning, content,
tool calls, finish reason and token counts are wrapped in OpenRouter's envelope: usage with the
upstream's counts, cost at the routed fake provider's price, the provider's name. Routing, money
limits, latency and faults work as in the made-up mode (faults that never reach a provider are drawn
before forwarding). Reasoning tokens are counted with ``--upstream-tokenizer`` when given, else
estimated as the reasoning's share of the characters. An upstream failure is a retryable 502.

Extra endpoints for tests: ``GET /health`` and ``GET /emulator/stats`` (counters by outcome, charges).
Every path is served under ``/api/v1`` and ``/v1`` (so plain OpenAI clients work too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import os
import random
import signal
import socket
import ssl
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

FAULT_KINDS = ("429", "429-retry-after", "500", "502", "503", "200-error", "torn", "reset", "slow", "402-in-flight")
LATENCY_DISTS = ("fixed", "exponential", "lognormal", "uniform")
OUTPUT_DISTS = ("fixed", "exponential", "lognormal")
PREFIXES = ("/api/v1", "/v1")
LISTEN_LINE = "aerie-emulator listening on {}"


@dataclass(frozen=True)
class FakeProvider:
    """One fake upstream: prices in USD per token, like OpenRouter's pricing fields."""

    name: str
    quantization: str
    prompt_price: float
    completion_price: float

    @property
    def slug(self) -> str:
        return self.name.lower()

    @property
    def tag(self) -> str:
        return f"{self.slug}/{self.quantization.lower()}"


class UpstreamError(Exception):
    """The upstream server did not answer with a usable completion (the client sees a retryable 502)."""


@dataclass(frozen=True)
class UpstreamAnswer:
    """What the upstream server generated, in the units OpenRouter reports."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]] | None
    finish: str  # stop | length | tool_calls
    prompt_tokens: int  # the upstream's own counts
    completion_tokens: int
    reasoning_tokens: int  # counted with upstream_tokenizer, else the reasoning's share of the characters


DEFAULT_PROVIDERS = (
    FakeProvider("Chutes", "int4", 0.45e-6, 1.9e-6),
    FakeProvider("Together", "fp8", 0.6e-6, 2.5e-6),
    FakeProvider("Fireworks", "fp4", 0.6e-6, 2.5e-6),
    FakeProvider("DeepInfra", "int4", 0.5e-6, 2.2e-6),
)


@dataclass
class EmulatorSettings:
    models: list[str] = field(default_factory=lambda: ["moonshotai/kimi-k2.5"])
    strict_models: bool = False  # False: any model name is answered
    providers: list[FakeProvider] = field(default_factory=lambda: list(DEFAULT_PROVIDERS))
    api_key: str | None = None  # None: any (or no) key is accepted
    output_tokens_mean: float = 200.0  # reasoning + content, before the max_tokens cap
    output_tokens_dist: str = "lognormal"
    reasoning_fraction: float = 0.5
    empty_rate: float = 0.0  # probability of an empty (still billed) content
    latency_mean: float = 0.0  # seconds
    latency_dist: str = "fixed"
    token_time: float = 0.0  # extra seconds per output token
    credits: float | None = None  # USD; None = unlimited
    key_limit: float | None = None  # USD; None = no limit
    in_flight_budget: float | None = None  # USD reserved at input + max_tokens per request
    faults: dict[str, float] = field(default_factory=dict)
    fault_seed: int = 0
    retry_after: float = 0.2  # seconds, for 429-retry-after
    slow_seconds: float = 30.0
    request_log: str | Path | None = None
    log_flush_interval: float = 0.5
    context_length: int = 262144
    max_completion_tokens: int = 65536
    default_max_tokens: int = 1024
    # Upstream mode: answers come from a real OpenAI-compatible server (e.g. `transformers serve` with the
    # target), wrapped in OpenRouter's envelope; None = made-up words.
    upstream_url: str | None = None  # e.g. http://127.0.0.1:8000/v1
    upstream_model: str | None = None  # model name the upstream expects (default: the request's)
    upstream_tokenizer: str | None = None  # folder whose tokenizer counts reasoning tokens (else by characters)
    upstream_timeout: float = 1800.0  # seconds; a CPU server answers one request at a time


def _make_words(n: int = 2048) -> tuple[str, ...]:
    """Pronounceable filler words, built once at import (no per-request work)."""
    rng = random.Random(1234)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["the", "and", "of", "qu", "sh", "th"]
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3)))))
    return tuple(sorted(words))


WORDS = _make_words()


def _usd(price: float) -> str:
    """OpenRouter writes prices as decimal strings (no exponent)."""
    text = f"{price:.12f}".rstrip("0").rstrip(".")
    return text or "0"


def _words_in(content: Any) -> int:
    """Word count of a message's content: a string or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):
        return sum(len(str(p.get("text", "")).split()) for p in content if isinstance(p, dict))
    return 0


def _draw(rng: random.Random, dist: str, mean: float) -> float:
    if mean <= 0:
        return 0.0
    if dist == "fixed":
        return mean
    if dist == "exponential":
        return rng.expovariate(1.0 / mean)
    if dist == "uniform":
        return rng.uniform(0.0, 2.0 * mean)
    sigma = 0.75  # lognormal with the requested mean: mu = ln(mean) - sigma^2 / 2
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def _error_body(status: int, message: str, metadata: dict[str, Any] | None = None) -> bytes:
    err: dict[str, Any] = {"code": status, "message": message}
    if metadata:
        err["metadata"] = metadata
    return json.dumps({"error": err}).encode()


class Emulator:
    """The server. ``await start(host, port)`` returns the base URL (``.../api/v1``); ``await stop()``."""

    def __init__(self, settings: EmulatorSettings | None = None):
        self.settings = s = settings or EmulatorSettings()
        unknown = set(s.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
        if sum(s.faults.values()) > 1.0 + 1e-9 or any(p < 0 for p in s.faults.values()):
            raise ValueError(f"fault probabilities must be >= 0 and sum to at most 1: {s.faults}")
        if s.latency_dist not in LATENCY_DISTS:
            raise ValueError(f"latency_dist must be one of {LATENCY_DISTS}")
        if s.output_tokens_dist not in OUTPUT_DISTS:
            raise ValueError(f"output_tokens_dist must be one of {OUTPUT_DISTS}")
        if not s.providers:
            raise ValueError("at least one fake provider is needed")
        # Arrival-order RNGs: the fault/latency sequence is fixed for a fixed request order.
        self._fault_rng = random.Random(s.fault_seed)
        self._latency_rng = random.Random(s.fault_seed + 1)
        self._boot = f"{int(time.time()):x}{os.getpid() & 0xFFFF:04x}"
        self._n = 0
        self._error200 = 0
        self.usage = 0.0  # USD charged so far
        self._pending_cost = 0.0  # cost of admitted, unfinished requests (keeps usage <= credits)
        self._reserved = 0.0  # in-flight budget reservations
        self._n_reserved = 0  # how many requests hold one (reset the float sum to 0 when none do)
        self.in_flight = 0
        self.max_in_flight = 0
        self.outcomes: Counter[str] = Counter()
        self._log_buf: list[str] = []
        self._log_file: Any = None
        self._flush_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None
        self._upstream_session: Any = None  # aiohttp.ClientSession, opened on the first forwarded request
        self._reasoning_tokenizer: Any = None  # loaded from upstream_tokenizer on the first forwarded request

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
        app.router.add_get("/health", self._health)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None) -> str:
        """Listen on host:port (0: a free port), over TLS when ``ssl_context`` is given; returns the API root."""
        s = self.settings
        if s.request_log:
            Path(s.request_log).parent.mkdir(parents=True, exist_ok=True)
            # Opened once, appended to; lines are buffered and written by the flush task.
            self._log_file = open(s.request_log, "a", encoding="utf-8")
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_loop())
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
        if self._upstream_session is not None:
            await self._upstream_session.close()
            self._upstream_session = None
        if self._flush_task is not None:
            self._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_task
            self._flush_task = None
        self._flush()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.log_flush_interval)
            self._flush()

    def _flush(self) -> None:
        if self._log_file is not None and self._log_buf:
            self._log_file.write("".join(self._log_buf))
            self._log_buf.clear()
            self._log_file.flush()

    def stats(self) -> dict[str, Any]:
        return {
            "requests": sum(self.outcomes.values()),
            "outcomes": dict(self.outcomes),
            "charged_usd": self.usage,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "reserved_usd": self._reserved,
        }

    # ---- helpers ---------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        want = self.settings.api_key
        if want is None:
            return True
        got = request.headers.get("Authorization", "")
        token = got[7:].strip() if got[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode(), want.encode())

    def _record(
        self,
        sha: str | None,
        model: Any,
        max_tokens: Any,
        outcome: str,
        status: int,
        cost: float = 0.0,
        provider: str | None = None,
    ) -> None:
        self.outcomes[outcome] += 1
        if self._log_file is not None:  # never the headers: no key can reach the log
            self._log_buf.append(
                json.dumps(
                    {
                        "t": round(time.time(), 3),
                        "messages_sha256": sha,
                        "model": model,
                        "max_tokens": max_tokens,
                        "outcome": outcome,
                        "status": status,
                        "cost": cost,
                        "provider": provider,
                    }
                )
                + "\n"
            )

    def _route(self, prefs: Any, rng: random.Random) -> FakeProvider | None:
        """The provider this request goes to, after the request's ``provider`` preferences."""
        prefs = prefs if isinstance(prefs, dict) else {}
        cands = list(self.settings.providers)

        def names(p: FakeProvider) -> set[str]:
            return {p.slug, p.tag}

        if prefs.get("only"):
            only = {str(x).lower() for x in prefs["only"]}
            cands = [p for p in cands if names(p) & only]
        if prefs.get("ignore"):
            ignore = {str(x).lower() for x in prefs["ignore"]}
            cands = [p for p in cands if not names(p) & ignore]
        if prefs.get("quantizations"):
            quants = {str(x).lower() for x in prefs["quantizations"]}
            cands = [p for p in cands if p.quantization.lower() in quants]
        max_price = prefs.get("max_price")
        if isinstance(max_price, dict):  # USD per million tokens, as in OpenRouter's request field
            if max_price.get("prompt") is not None:
                cands = [p for p in cands if p.prompt_price * 1e6 <= float(max_price["prompt"]) + 1e-12]
            if max_price.get("completion") is not None:
                cands = [p for p in cands if p.completion_price * 1e6 <= float(max_price["completion"]) + 1e-12]
        if not cands:
            return None

        def price(p: FakeProvider) -> tuple[float, float]:
            return (p.completion_price, p.prompt_price)

        order = [str(x).lower() for x in prefs.get("order") or []]
        if order:
            ranked = [p for o in order for p in cands if o in names(p)]
            if ranked:
                return ranked[0]
            if prefs.get("allow_fallbacks") is False:
                return None
        if prefs.get("sort") == "price" or order:
            return min(cands, key=price)
        if prefs.get("sort") in ("throughput", "latency"):
            return cands[0]  # no speed data: the configured order stands in for it
        # Default load balancing: weight 1/price^2, picked by the request's own RNG (deterministic).
        weights = [1.0 / (p.completion_price + p.prompt_price) ** 2 for p in cands]
        return rng.choices(cands, weights=weights, k=1)[0]

    def _draw_fault(self) -> str | None:
        faults = self.settings.faults
        if not faults:
            return None
        u, acc = self._fault_rng.random(), 0.0
        for kind in FAULT_KINDS:
            acc += faults.get(kind, 0.0)
            if u < acc:
                return kind
        return None

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
        s = self.settings
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        body_ok = isinstance(body, dict)
        model = body.get("model") if body_ok else None
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens")) if body_ok else None
        messages = body.get("messages") if body_ok else None
        sha = None
        if isinstance(messages, list):
            canon = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            sha = hashlib.sha256(canon.encode()).hexdigest()

        def reject(
            outcome: str,
            status: int,
            message: str,
            metadata: dict[str, Any] | None = None,
            headers: dict[str, str] | None = None,
            provider: str | None = None,
        ) -> web.Response:
            self._record(sha, model, max_tokens, outcome, status, 0.0, provider)
            return web.Response(
                status=status,
                body=_error_body(status, message, metadata),
                content_type="application/json",
                headers=headers,
            )

        if not self._authorized(request):
            return reject("401", 401, "Missing or invalid API key (emulator)")
        if not body_ok:
            return reject("400", 400, "Request body is not a JSON object")
        if not isinstance(model, str) or not model:
            return reject("400", 400, "'model' is required")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return reject("400", 400, "'messages' must be a non-empty list of message objects")
        if body.get("stream"):
            return reject("400", 400, "streaming not emulated")
        if s.strict_models and model not in s.models:
            return reject("400", 400, f"{model} is not a valid model ID (emulator knows {', '.join(s.models)})")
        if max_tokens is None:
            max_tokens = s.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            return reject("400", 400, "'max_tokens' must be a positive integer")

        # Everything about the answer comes from one RNG seeded by the request itself.
        seed_src = f"{model}\n{body.get('seed')}\n{sha}".encode()
        rng = random.Random(int.from_bytes(hashlib.sha256(seed_src).digest()[:8], "big"))
        provider = self._route(body.get("provider"), rng)
        if provider is None:
            return reject(
                "no-endpoints", 503, "No endpoints found matching the requested provider preferences (emulated routing)"
            )

        fault = self._draw_fault()
        pname = provider.name
        if fault in ("429", "429-retry-after"):
            headers = None
            msg = "Rate limited by the upstream provider (emulated)"
            if fault == "429-retry-after":
                headers = {"Retry-After": f"{s.retry_after:g}"}
                msg += f"; retry after {s.retry_after:g} s"
            return reject(fault, 429, msg, {"provider_name": pname}, headers, pname)
        if fault in ("500", "502", "503"):
            return reject(
                fault, int(fault), f"Upstream error {fault} (emulated)", {"provider_name": pname}, provider=pname
            )
        if fault == "402-in-flight":
            return reject(
                fault,
                402,
                "Insufficient credits for requests in flight (emulated)",
                {"limit_source": "openrouter_in_flight_budget"},
                {"Retry-After": "1"},
                pname,
            )
        if fault == "reset":
            self._record(sha, model, max_tokens, fault, 0, 0.0, pname)
            self._reset(request)
            return web.Response(status=500)  # never reaches the client: the socket is gone

        answer: UpstreamAnswer | None = None
        if s.upstream_url:
            # The target's own answer; faults that never reach a provider were drawn above (no wasted work).
            try:
                answer = await self._ask_upstream(body, model, max_tokens)
            except UpstreamError as exc:
                return reject(
                    "upstream-error", 502, f"Upstream server error: {exc}", {"provider_name": pname}, provider=pname
                )
            prompt_tokens, completion_tokens, finish = answer.prompt_tokens, answer.completion_tokens, answer.finish
            reasoning_tokens = answer.reasoning_tokens
        else:
            prompt_tokens = sum(_words_in(m.get("content")) for m in messages)
            reasoning_tokens, content_tokens, finish = self._plan(body.get("reasoning"), body, rng, max_tokens)
            completion_tokens = reasoning_tokens + content_tokens
        prompt_cost = prompt_tokens * provider.prompt_price
        completion_cost = completion_tokens * provider.completion_price
        cost = prompt_cost + completion_cost

        # Money: final limits first, then the transient in-flight reservation.
        committed = self.usage + self._pending_cost + cost
        if s.credits is not None and committed > s.credits + 1e-12:
            return reject(
                "402-credits",
                402,
                "Insufficient credits (emulated)",
                {"limit_source": "openrouter_credits"},
                provider=pname,
            )
        if s.key_limit is not None and committed > s.key_limit + 1e-12:
            return reject(
                "402-key-limit", 402, "Key limit exceeded (emulated)", {"limit_source": "key_limit"}, provider=pname
            )
        reserve = prompt_tokens * provider.prompt_price + max_tokens * provider.completion_price
        if s.in_flight_budget is not None and self._reserved + reserve > s.in_flight_budget + 1e-12:
            return reject(
                "402-in-flight",
                402,
                "In-flight budget exceeded: reserve input + max_tokens against the balance (emulated)",
                {"limit_source": "openrouter_in_flight_budget"},
                {"Retry-After": "1"},
                pname,
            )

        charged = fault in (None, "slow")
        self._reserved += reserve
        self._n_reserved += 1
        self._pending_cost += cost if charged else 0.0
        try:
            delay = _draw(self._latency_rng, s.latency_dist, s.latency_mean) + s.token_time * completion_tokens
            if fault == "slow":
                delay += s.slow_seconds
            if delay > 0:
                await asyncio.sleep(delay)
        except asyncio.CancelledError:
            # The handler was cancelled (server shutdown, or aiohttp cancelling on disconnect): the
            # provider's generation had started and is billed in full, as a real provider does.
            if charged:
                self.usage += cost
                self._record(sha, model, max_tokens, "client-gone", 0, cost, pname)
            raise
        finally:
            self._n_reserved -= 1
            self._reserved -= reserve
            self._pending_cost -= cost if charged else 0.0
            if not self._n_reserved:  # no float drift left behind
                self._reserved = self._pending_cost = 0.0

        self._n += 1
        gen_id = f"gen-{self._boot}-{self._n:07d}"
        if answer is not None:
            reasoning_text, content = answer.reasoning, answer.content
            content_tokens = completion_tokens - reasoning_tokens
        else:
            reasoning_text = " ".join(rng.choices(WORDS, k=reasoning_tokens)) if reasoning_tokens else None
            content = " ".join(rng.choices(WORDS, k=content_tokens))
        excluded = isinstance(body.get("reasoning"), dict) and bool(body["reasoning"].get("exclude"))
        if excluded or body.get("include_reasoning") is False:
            reasoning_text = None  # still produced and billed, just not returned
        native = {"length": "max_tokens"}.get(finish, finish)  # stop, tool_calls (upstream mode)
        if fault == "200-error":
            self._error200 += 1
            if self._error200 % 2:  # alternate the two ways a started generation fails
                out = {
                    "id": gen_id,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "provider": pname,
                    "error": {
                        "code": 502,
                        "message": "Provider returned error mid-generation (emulated)",
                        "metadata": {"provider_name": pname},
                    },
                }
                return self._finish(sha, model, max_tokens, fault, out, gen_id, 0.0, pname)
            content = " ".join(content.split()[: content_tokens // 2])
            finish = native = "error"
        usage_cost = cost if charged else 0.0
        out = {
            "id": gen_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "provider": pname,
            "choices": [
                {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish,
                    "native_finish_reason": native,
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "refusal": None,
                        "reasoning": reasoning_text,
                        "reasoning_details": (
                            [{"type": "reasoning.text", "text": reasoning_text, "format": "unknown", "index": 0}]
                            if reasoning_text
                            else []
                        ),
                    },
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "cost": usage_cost,
                "is_byok": False,
                "cost_details": {
                    "upstream_inference_cost": None,
                    "upstream_inference_prompt_cost": prompt_cost if charged else 0.0,
                    "upstream_inference_completions_cost": completion_cost if charged else 0.0,
                },
            },
        }
        if answer is not None and answer.tool_calls:
            out["choices"][0]["message"]["tool_calls"] = answer.tool_calls
        if fault == "torn":
            self._record(sha, model, max_tokens, fault, 200, 0.0, pname)
            return await self._torn(request, json.dumps(out).encode(), gen_id)
        if charged:
            self.usage += cost
        if request.transport is None or request.transport.is_closing():
            # The client left while the model was generating: billed, never delivered.
            self._record(sha, model, max_tokens, "client-gone", 0, usage_cost, pname)
            return web.Response(status=499)  # nobody reads it; 499 "client closed request" as providers log it
        return self._finish(sha, model, max_tokens, fault or "ok", out, gen_id, usage_cost, pname)

    async def _ask_upstream(self, body: dict[str, Any], model: str, max_tokens: int) -> UpstreamAnswer:
        """Forward the chat request to the upstream server (OpenAI-compatible) and read its answer.

        Sent: messages, tools, max_tokens, temperature, top_p, seed, stop. OpenRouter's own fields
        (provider, reasoning, usage, transforms) stay here, as OpenRouter keeps them from the provider.
        """
        import aiohttp

        s = self.settings
        if self._upstream_session is None:
            self._upstream_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.upstream_timeout))
        forward = {k: body[k] for k in ("messages", "tools", "temperature", "top_p", "seed", "stop") if k in body}
        forward.update(model=s.upstream_model or model, max_tokens=max_tokens, stream=False)
        url = s.upstream_url.rstrip("/") + "/chat/completions"
        try:
            async with self._upstream_session.post(url, json=forward) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise UpstreamError(f"HTTP {resp.status} from {url}: {text[:300]}")
                data = json.loads(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise UpstreamError(f"{type(exc).__name__} from {url}: {exc}") from None
        try:
            choice = data["choices"][0]
            message = choice["message"]
            usage = data["usage"]
            prompt_tokens, completion_tokens = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise UpstreamError(f"{url} answered without choices/usage ({exc!r}): {text[:300]}") from None
        reasoning = message.get("reasoning_content") or message.get("reasoning") or None
        content = message.get("content") or ""
        finish = choice.get("finish_reason") or "stop"
        if reasoning and s.upstream_tokenizer:
            if self._reasoning_tokenizer is None:
                from transformers import AutoTokenizer  # only in upstream mode with a tokenizer folder

                self._reasoning_tokenizer = AutoTokenizer.from_pretrained(
                    str(s.upstream_tokenizer), trust_remote_code=True
                )
            counted = len(self._reasoning_tokenizer.encode(reasoning, add_special_tokens=False))
            reasoning_tokens = min(completion_tokens, counted)
        elif reasoning:
            reasoning_tokens = round(completion_tokens * len(reasoning) / (len(reasoning) + len(content)))
        else:
            reasoning_tokens = 0
        return UpstreamAnswer(
            reasoning,
            content,
            message.get("tool_calls") or None,
            finish,
            prompt_tokens,
            completion_tokens,
            reasoning_tokens,
        )

    def _plan(self, reasoning: Any, body: dict[str, Any], rng: random.Random, max_tokens: int) -> tuple[int, int, str]:
        """(reasoning tokens, content tokens, finish_reason) for this request."""
        s = self.settings
        total = max(1, int(round(_draw(rng, s.output_tokens_dist, s.output_tokens_mean))))
        empty = rng.random() < s.empty_rate
        frac = s.reasoning_fraction
        cap: int | None = None
        if isinstance(reasoning, dict):
            if reasoning.get("enabled") is False or reasoning.get("effort") == "none":
                frac = 0.0
            else:
                frac *= {"minimal": 0.25, "low": 0.5, "high": 1.5}.get(str(reasoning.get("effort")), 1.0)
                if isinstance(reasoning.get("max_tokens"), int):
                    cap = reasoning["max_tokens"]
        frac = min(frac, 0.95)
        r = int(round(total * frac))
        if cap is not None:
            r = min(r, cap)
        c = 0 if empty else max(0, total - r)
        finish = "stop"
        if r + c > max_tokens:  # the model reasons first, so reasoning eats the budget first
            finish = "length"
            r = min(r, max_tokens)
            c = max_tokens - r
        return r, c, finish

    def _finish(
        self,
        sha: str | None,
        model: Any,
        max_tokens: Any,
        outcome: str,
        out: dict[str, Any],
        gen_id: str,
        cost: float,
        provider: str,
    ) -> web.Response:
        self._record(sha, model, max_tokens, outcome, 200, cost, provider)
        return web.Response(
            body=json.dumps(out).encode(), content_type="application/json", headers={"X-Generation-Id": gen_id}
        )

    @staticmethod
    def _reset(request: web.Request) -> None:
        """Drop the connection with a TCP RST and no response at all."""
        transport = request.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # linger 0: close() sends RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()

    @staticmethod
    async def _torn(request: web.Request, data: bytes, gen_id: str) -> web.StreamResponse:
        """Headers promise the whole body, half of it is sent, then the connection is closed."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "X-Generation-Id": gen_id})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        if request.transport is not None:
            request.transport.close()  # close (not abort): the half already written still goes out
        return resp

    # ---- other endpoints -------------------------------------------------------------------
    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(status=status, body=json.dumps(obj).encode(), content_type="application/json")

    async def _key(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._json({"error": {"code": 401, "message": "Missing or invalid API key (emulator)"}}, 401)
        limit = self.settings.key_limit
        return self._json(
            {
                "data": {
                    "label": "aerie-emulator",
                    "limit": limit,
                    "limit_remaining": None if limit is None else limit - self.usage,
                    "usage": self.usage,
                    "is_free_tier": False,
                }
            }
        )

    async def _credits(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._json({"error": {"code": 401, "message": "Missing or invalid API key (emulator)"}}, 401)
        return self._json({"data": {"total_credits": self.settings.credits, "total_usage": self.usage}})

    def _model_known(self, model: str) -> bool:
        return model in self.settings.models or not self.settings.strict_models

    async def _models(self, request: web.Request) -> web.Response:
        s = self.settings
        cheapest = min(s.providers, key=lambda p: (p.completion_price, p.prompt_price))
        data = [
            {
                "id": m,
                "name": m,
                "created": 0,
                "context_length": s.context_length,
                "pricing": {
                    "prompt": _usd(cheapest.prompt_price),
                    "completion": _usd(cheapest.completion_price),
                    "request": "0",
                    "image": "0",
                },
                "top_provider": {
                    "context_length": s.context_length,
                    "max_completion_tokens": s.max_completion_tokens,
                    "is_moderated": False,
                },
                "supported_parameters": [
                    "max_tokens",
                    "temperature",
                    "top_p",
                    "seed",
                    "reasoning",
                    "include_reasoning",
                ],
            }
            for m in s.models
        ]
        return self._json({"data": data})

    async def _endpoints(self, request: web.Request) -> web.Response:
        s = self.settings
        model = f"{request.match_info['author']}/{request.match_info['slug']}"
        if not self._model_known(model):
            return self._json({"error": {"code": 404, "message": f"No model {model} (emulator)"}}, 404)
        endpoints = [
            {
                "name": f"{p.name} | {model}",
                "provider_name": p.name,
                "tag": p.tag,
                "quantization": p.quantization,
                "pricing": {"prompt": _usd(p.prompt_price), "completion": _usd(p.completion_price)},
                "context_length": s.context_length,
                "max_completion_tokens": s.max_completion_tokens,
                "status": 0,
            }
            for p in s.providers
        ]
        return self._json({"data": {"id": model, "name": model, "endpoints": endpoints}})

    async def _health(self, request: web.Request) -> web.Response:
        return self._json({"status": "ok"})

    async def _stats(self, request: web.Request) -> web.Response:
        return self._json(self.stats())


# ---- running it in a thread (tests) ----------------------------------------------------------
def run_in_thread(
    settings: EmulatorSettings | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 10.0,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[str, Callable[[], None]]:
    """Start an emulator on its own event loop in a daemon thread (HTTPS with ``ssl_context``); returns
    (base_url, stop)."""
    emu = Emulator(settings)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            box["url"] = loop.run_until_complete(emu.start(host, port, ssl_context))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc
            ready.set()
            loop.close()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(emu.stop())
        loop.close()

    thread = threading.Thread(target=main, name="aerie-emulator", daemon=True)
    thread.start()
    if not ready.wait(timeout):
        raise TimeoutError("the emulator did not start")
    if "error" in box:
        raise box["error"]

    def stop() -> None:
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)

    return box["url"], stop


@contextlib.contextmanager
def serve_in_thread(
    settings: EmulatorSettings | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
) -> Iterator[str]:
    """``with serve_in_thread(settings) as base_url: ...``"""
    url, stop = run_in_thread(settings, host, port, ssl_context=ssl_context)
    try:
        yield url
    finally:
        stop()


# ---- command line ----------------------------------------------------------------------------
def parse_faults(specs: list[str]) -> dict[str, float]:
    """``["429=0.05,500=0.01", "torn=0.02"]`` -> ``{"429": 0.05, "500": 0.01, "torn": 0.02}``."""
    faults: dict[str, float] = {}
    for spec in specs:
        for item in filter(None, (x.strip() for x in spec.split(","))):
            kind, sep, prob = item.partition("=")
            if not sep:
                raise ValueError(f"fault {item!r}: expected KIND=PROBABILITY")
            faults[kind.strip()] = float(prob)
    return faults


def parse_provider(spec: str) -> FakeProvider:
    """``NAME:QUANT:INPUT_USD_PER_M:OUTPUT_USD_PER_M`` (prices per million tokens, for readability)."""
    parts = spec.split(":")
    if len(parts) != 4:
        raise ValueError(f"provider {spec!r}: expected NAME:QUANT:INPUT_USD_PER_M:OUTPUT_USD_PER_M")
    return FakeProvider(parts[0], parts[1], float(parts[2]) / 1e6, float(parts[3]) / 1e6)


def build_parser() -> argparse.ArgumentParser:
    d = EmulatorSettings()
    p = argparse.ArgumentParser(prog="python -m aerie.api.emulator", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=0, help="0 picks a free port (see --port-file)")
    a("--port-file", help="write the bound port to this file once listening")
    a("--model", action="append", dest="models", help="model id to list (repeatable; default %(default)s)")
    a("--strict-models", action="store_true", help="400 for models not given with --model")
    a("--provider", action="append", dest="providers", help="NAME:QUANT:IN_USD_PER_M:OUT_USD_PER_M (repeatable)")
    a("--api-key-env", help="expect the key held by this environment variable (else any key passes)")
    a("--output-tokens-mean", type=float, default=d.output_tokens_mean)
    a("--output-tokens-dist", choices=OUTPUT_DISTS, default=d.output_tokens_dist)
    a("--reasoning-fraction", type=float, default=d.reasoning_fraction)
    a("--empty-rate", type=float, default=d.empty_rate)
    a("--latency-mean", type=float, default=d.latency_mean, help="seconds")
    a("--latency-dist", choices=LATENCY_DISTS, default=d.latency_dist)
    a("--token-time", type=float, default=d.token_time, help="seconds per output token")
    a("--credits", type=float, help="USD; unlimited when absent")
    a("--key-limit", type=float, help="USD")
    a("--in-flight-budget", type=float, help="USD reserved at input + max_tokens per request in flight")
    a("--fault", action="append", default=[], help="KIND=PROBABILITY (repeatable); kinds: " + ", ".join(FAULT_KINDS))
    a("--faults", action="append", default=[], help="comma-separated KIND=PROBABILITY list")
    a("--fault-seed", type=int, default=d.fault_seed)
    a("--retry-after", type=float, default=d.retry_after, help="seconds, for 429-retry-after")
    a("--slow-seconds", type=float, default=d.slow_seconds)
    a("--request-log", help="JSONL of every chat request (buffered, appended)")
    a(
        "--upstream",
        help="answer with this OpenAI-compatible server (API root, e.g. http://127.0.0.1:8000/v1) "
        "instead of made-up words: its text, token counts and finish reason, OpenRouter's envelope",
    )
    a("--upstream-model", help="model name sent upstream (default: the request's model)")
    a("--upstream-tokenizer", help="tokenizer folder that counts reasoning tokens (default: by character share)")
    a("--upstream-timeout", type=float, default=d.upstream_timeout, help="seconds per upstream request")
    a("--tls-cert", help="serve HTTPS with this PEM certificate (chain); needs --tls-key")
    a("--tls-key", help="PEM private key of --tls-cert")
    return p


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context for --tls-cert/--tls-key (the library's secure defaults: TLS 1.2+)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


def settings_from_args(args: argparse.Namespace) -> EmulatorSettings:
    d = EmulatorSettings()
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SystemExit(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    return EmulatorSettings(
        models=args.models or d.models,
        strict_models=args.strict_models,
        providers=[parse_provider(x) for x in args.providers] if args.providers else d.providers,
        api_key=api_key,
        output_tokens_mean=args.output_tokens_mean,
        output_tokens_dist=args.output_tokens_dist,
        reasoning_fraction=args.reasoning_fraction,
        empty_rate=args.empty_rate,
        latency_mean=args.latency_mean,
        latency_dist=args.latency_dist,
        token_time=args.token_time,
        credits=args.credits,
        key_limit=args.key_limit,
        in_flight_budget=args.in_flight_budget,
        faults=parse_faults(args.faults + args.fault),
        fault_seed=args.fault_seed,
        retry_after=args.retry_after,
        slow_seconds=args.slow_seconds,
        request_log=args.request_log,
        upstream_url=args.upstream,
        upstream_model=args.upstream_model,
        upstream_tokenizer=args.upstream_tokenizer,
        upstream_timeout=args.upstream_timeout,
    )


async def _serve(
    settings: EmulatorSettings, host: str, port: int, port_file: str | None, ssl_context: ssl.SSLContext | None = None
) -> None:
    emu = Emulator(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = await emu.start(host, port, ssl_context)
    try:
        if port_file:  # written whole then renamed, so a reader never sees half a number
            tmp = Path(f"{port_file}.tmp")
            tmp.write_text(f"{url.split(':')[-1].split('/')[0]}\n")
            tmp.replace(port_file)
        print(LISTEN_LINE.format(url), flush=True)
        await stop.wait()
    finally:
        await emu.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        Emulator(settings)  # validate before binding a port
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = server_tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    except (ValueError, OSError) as exc:  # OSError: unreadable or mismatched certificate/key files
        print(f"aerie-emulator: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(settings, args.host, args.port, args.port_file, tls))
    except OSError as exc:  # e.g. the port is taken
        print(f"aerie-emulator: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
