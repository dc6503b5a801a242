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
``transformers serve`` running the target (``python -m aerie.target_model.serve``) - and its reasoning, content,
tool calls, finish reason and token counts are wrapped in OpenRouter's envelope: usage with the
upstream's counts, cost at the routed fake provider's price, the provider's name. Routing, money
limits, latency and faults work as in the made-up mode (faults that never reach a provider are drawn
before forwarding). Reasoning tokens are counted with ``--upstream-tokenizer`` when given, else
estimated as the reasoning's share of the characters. An upstream failure is a retryable 502.

Extra endpoints for tests: ``GET /health`` and ``GET /emulator/stats`` (counters by outcome, charges).
Every path is served under ``/api/v1`` and ``/v1`` (so plain OpenAI clients work too).

Modules, one job each:
- :mod:`~aerie.emulator.settings`: :class:`EmulatorSettings`, the fake providers, checking, the CLI's
  fault and provider specs;
- :mod:`~aerie.emulator.server`: :class:`Emulator`, the HTTP routes and the chat request from body to
  answer, calling the modules below;
- :mod:`~aerie.emulator.routing`: which provider a request goes to;
- :mod:`~aerie.emulator.billing`: prices, credits, key limit, in-flight budget, charges;
- :mod:`~aerie.emulator.faults`: the fault and latency draws and the faults themselves;
- :mod:`~aerie.emulator.made_up` and :mod:`~aerie.emulator.distributions`: made-up answers;
- :mod:`~aerie.emulator.upstream`: forwarding to a real OpenAI-compatible server;
- :mod:`~aerie.emulator.envelope`: OpenRouter's JSON shapes;
- :mod:`~aerie.emulator.request_log`: counts by outcome and the JSONL request log;
- :mod:`~aerie.emulator.in_thread`: ``serve_in_thread`` / ``run_in_thread`` for tests and benches;
- :mod:`~aerie.emulator.tls`: the HTTPS server context and a self-signed certificate for tests;
- :mod:`~aerie.emulator.cli`: ``aerie-emulator`` / ``python -m aerie.emulator``.
"""

from __future__ import annotations

from aerie.emulator.cli import LISTEN_LINE, build_parser, main, settings_from_args
from aerie.emulator.distributions import LATENCY_DISTS, OUTPUT_DISTS
from aerie.emulator.in_thread import run_in_thread, serve_in_thread
from aerie.emulator.server import PREFIXES, Emulator
from aerie.emulator.settings import (
    DEFAULT_PROVIDERS,
    FAULT_KINDS,
    EmulatorSettings,
    FakeProvider,
    check_settings,
    parse_faults,
    parse_provider,
)
from aerie.emulator.tls import server_tls_context, write_self_signed_certificate
from aerie.emulator.upstream import UpstreamAnswer, UpstreamError

__all__ = [
    "DEFAULT_PROVIDERS",
    "FAULT_KINDS",
    "LATENCY_DISTS",
    "LISTEN_LINE",
    "OUTPUT_DISTS",
    "PREFIXES",
    "Emulator",
    "EmulatorSettings",
    "FakeProvider",
    "UpstreamAnswer",
    "UpstreamError",
    "build_parser",
    "check_settings",
    "main",
    "parse_faults",
    "parse_provider",
    "run_in_thread",
    "serve_in_thread",
    "server_tls_context",
    "settings_from_args",
    "write_self_signed_certificate",
]
