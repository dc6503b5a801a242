"""Injected misbehaviour: which fault a request gets and how long its answer takes, drawn in arrival order, and
the faults themselves (error answers, a reset connection, a torn body).

Fault kinds (``settings.FAULT_KINDS``): 429 with or without Retry-After, 500/502/503 and a transient 402
(answered before any provider works: never charged), ``200-error`` (a generation that failed after it
started, alternately as an error envelope and as a cut answer with finish ``error``), ``torn`` (half a body,
then the connection closes), ``reset`` (a TCP RST, no answer), ``slow`` (a normal, charged answer that
arrives ``slow_seconds`` late, as a real provider bills a finished generation even when the client gave up).
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct

from aiohttp import web

from aerie.emulator.distributions import draw
from aerie.emulator.envelope import Refusal
from aerie.emulator.settings import FAULT_KINDS, EmulatorSettings


class FaultInjector:
    """The arrival-order draws: the fault/latency sequence is fixed for a fixed request order (``fault_seed``)."""

    def __init__(self, settings: EmulatorSettings) -> None:
        self.settings = settings
        self._fault_rng = random.Random(settings.fault_seed)
        self._latency_rng = random.Random(settings.fault_seed + 1)
        self._error200 = 0

    def draw_fault(self) -> str | None:
        """The fault for the next request, or None (most requests)."""
        faults = self.settings.faults
        if not faults:
            return None
        u, acc = self._fault_rng.random(), 0.0
        for kind in FAULT_KINDS:
            acc += faults.get(kind, 0.0)
            if u < acc:
                return kind
        return None

    def delay(self, completion_tokens: int, fault: str | None) -> float:
        """Seconds the answer takes: a latency draw, time per output token, and the ``slow`` fault's extra."""
        s = self.settings
        seconds = draw(self._latency_rng, s.latency_dist, s.latency_mean) + s.token_time * completion_tokens
        if fault == "slow":
            seconds += s.slow_seconds
        return seconds

    def error200_as_envelope(self) -> bool:
        """For a ``200-error``: True for an error envelope, False for a cut answer (the two alternate)."""
        self._error200 += 1
        return bool(self._error200 % 2)


def refusal_before_provider(fault: str | None, s: EmulatorSettings, provider: str) -> Refusal | None:
    """The error answer of a fault that stops a request before any provider generates (429, 5xx, 402)."""
    if fault in ("429", "429-retry-after"):
        headers = None
        msg = "Rate limited by the upstream provider (emulated)"
        if fault == "429-retry-after":
            headers = {"Retry-After": f"{s.retry_after:g}"}
            msg += f"; retry after {s.retry_after:g} s"
        return Refusal(fault, 429, msg, {"provider_name": provider}, headers)
    if fault in ("500", "502", "503"):
        return Refusal(fault, int(fault), f"Upstream error {fault} (emulated)", {"provider_name": provider})
    if fault == "402-in-flight":
        return Refusal(
            fault,
            402,
            "Insufficient credits for requests in flight (emulated)",
            {"limit_source": "openrouter_in_flight_budget"},
            {"Retry-After": "1"},
        )
    return None


def reset_connection(request: web.Request) -> None:
    """Drop the connection with a TCP RST and no response at all."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # linger 0: close() sends RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def send_torn(request: web.Request, data: bytes, gen_id: str) -> web.StreamResponse:
    """Headers promise the whole body, half of it is sent, then the connection is closed."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "X-Generation-Id": gen_id})
    resp.content_length = len(data)
    await resp.prepare(request)
    await resp.write(data[: len(data) // 2])
    if request.transport is not None:
        request.transport.close()  # close (not abort): the half already written still goes out
    return resp
