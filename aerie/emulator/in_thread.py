"""Running an emulator inside the caller's process, on its own event loop in a daemon thread (tests, benches)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

from aerie.emulator.server import Emulator
from aerie.emulator.settings import EmulatorSettings


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
