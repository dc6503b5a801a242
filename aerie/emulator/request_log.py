"""What happened to each chat request: counts by outcome (``GET /emulator/stats``) and, with ``--request-log``,
one JSONL line per request, buffered and appended.

A line holds the time, the messages' SHA-256, model, max_tokens, outcome, HTTP status, cost, provider and the
output tokens charged - never the headers, so no key can reach the log. Lines are buffered in memory and written
by a task every ``log_flush_interval`` seconds: a write per request would cost more than the emulated request itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any


class RequestLog:
    """``open()`` on the server's event loop, ``add(...)`` per request, ``await close()`` at shutdown; without a
    path only the counts are kept."""

    def __init__(self, path: str | Path | None, flush_interval: float) -> None:
        self.path = Path(path) if path else None
        self.flush_interval = flush_interval
        self.outcomes: Counter[str] = Counter()
        self.charged_tokens = 0  # output tokens of every charged generation (answered or not)
        self._buf: list[str] = []
        self._file: Any = None
        self._flush_task: asyncio.Task | None = None

    def open(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Opened once, appended to; lines are buffered and written by the flush task.
        self._file = open(self.path, "a", encoding="utf-8")
        self._flush_task = asyncio.get_running_loop().create_task(self._flush_loop())

    def add(
        self,
        sha: str | None,
        model: Any,
        max_tokens: Any,
        outcome: str,
        status: int,
        cost: float,
        provider: str | None,
        completion_tokens: int = 0,
    ) -> None:
        self.outcomes[outcome] += 1
        self.charged_tokens += completion_tokens
        if self._file is None:  # no log asked for: spare the JSON encoding
            return
        entry = {
            "t": round(time.time(), 3),
            "messages_sha256": sha,
            "model": model,
            "max_tokens": max_tokens,
            "outcome": outcome,
            "status": status,
            "cost": cost,
            "provider": provider,
            "completion_tokens": completion_tokens,
        }
        self._buf.append(json.dumps(entry) + "\n")

    async def close(self) -> None:
        if self._flush_task is not None:
            self._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_task
            self._flush_task = None
        self._flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            self._flush()

    def _flush(self) -> None:
        if self._file is not None and self._buf:
            self._file.write("".join(self._buf))
            self._buf.clear()
            self._file.flush()
