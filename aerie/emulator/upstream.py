"""Upstream mode (``--upstream URL``): the answer is a real model's, from an OpenAI-compatible server.

The chat request (messages, tools, max_tokens, temperature, top_p, seed, stop) is forwarded to the server -
e.g. ``transformers serve`` running the target (``python -m aerie.target_model.serve``) - and its reasoning, content,
tool calls, finish reason and token counts come back as an :class:`UpstreamAnswer`, which the server wraps in
OpenRouter's envelope. OpenRouter's own fields (provider, reasoning, usage, transforms) stay here, as
OpenRouter keeps them from the provider. Reasoning tokens are counted with ``upstream_tokenizer`` when given,
else estimated as the reasoning's share of the characters. Any failure is an :class:`UpstreamError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from aerie.emulator.settings import EmulatorSettings


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


class Upstream:
    """The forwarding client: one HTTP session and (when asked for) one tokenizer, both opened on first use."""

    def __init__(self, settings: EmulatorSettings) -> None:
        if not settings.upstream_url:
            raise ValueError("upstream mode needs settings.upstream_url")
        self.settings = settings
        self._session: Any = None  # aiohttp.ClientSession, opened on the first forwarded request
        self._reasoning_tokenizer: Any = None  # loaded from upstream_tokenizer on the first forwarded request

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def ask(self, body: dict[str, Any], model: str, max_tokens: int) -> UpstreamAnswer:
        """Forward the chat request to the upstream server and read its answer."""
        s = self.settings
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.upstream_timeout))
        forward = {k: body[k] for k in ("messages", "tools", "temperature", "top_p", "seed", "stop") if k in body}
        forward.update(model=s.upstream_model or model, max_tokens=max_tokens, stream=False)
        url = str(s.upstream_url).rstrip("/") + "/chat/completions"
        try:
            async with self._session.post(url, json=forward) as resp:
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
        return UpstreamAnswer(
            reasoning,
            content,
            message.get("tool_calls") or None,
            finish,
            prompt_tokens,
            completion_tokens,
            self._reasoning_tokens(reasoning, content, completion_tokens),
        )

    def _reasoning_tokens(self, reasoning: str | None, content: str, completion_tokens: int) -> int:
        """How many of the completion tokens were reasoning: counted when a tokenizer is given, else estimated."""
        if not reasoning:
            return 0
        if self.settings.upstream_tokenizer:
            if self._reasoning_tokenizer is None:
                from transformers import AutoTokenizer  # only in upstream mode with a tokenizer folder

                self._reasoning_tokenizer = AutoTokenizer.from_pretrained(
                    str(self.settings.upstream_tokenizer), trust_remote_code=True
                )
            counted = len(self._reasoning_tokenizer.encode(reasoning, add_special_tokens=False))
            return min(completion_tokens, counted)
        return round(completion_tokens * len(reasoning) / (len(reasoning) + len(content)))
