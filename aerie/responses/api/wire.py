"""The wire format of an answer: how an HTTP answer of a chat or SGLang server becomes a record's fields, or a
retryable / fatal error carrying the server's own message. No I/O; used by every API backend
(aerie.responses.api.backends) and by the batch path (aerie.responses.api.batches) for each result.
"""

from __future__ import annotations

import json
import time
from email.utils import parsedate_to_datetime
from typing import Any


class RetryableError(Exception):
    """Worth another attempt (rate limit, provider hiccup, torn body...). ``kind`` names it in stats."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after


class FatalError(Exception):
    """The run must stop: a retry cannot help (bad key, bad parameters, no endpoint, no credits)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _error_message(body: Any, text: str) -> tuple[str, dict[str, Any]]:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err), err.get("metadata") or {}
    if isinstance(err, str):
        return err, {}
    return (text[:300] or "(empty body)"), {}


NO_ENDPOINTS = ("no endpoints", "no allowed providers")


def classify_http_error(status: int, body: Any, text: str, retry_after: str | None) -> Exception:
    """Map a non-200 answer to a retryable or fatal error carrying the server's message."""
    message, metadata = _error_message(body, text)
    wait = parse_retry_after(retry_after)
    low = message.lower()
    if status in (404, 503) and any(s in low for s in NO_ENDPOINTS):
        return FatalError(
            "no_endpoints", f"HTTP {status}: {message} (provider routing leaves no endpoint; relax responses.provider)"
        )
    if status == 402:
        source = str(metadata.get("limit_source") or "")
        if "in_flight" in source:
            return RetryableError("402_in_flight", f"HTTP 402 ({source}): {message}", wait or 1.0)
        return FatalError("402_credits", f"HTTP 402 ({source or 'credits'}): {message}")
    if status == 401:
        return FatalError("401", f"HTTP 401: {message} (check the API key variable named by responses.api_key_env)")
    if status in (400, 403, 413, 422):
        return FatalError(str(status), f"HTTP {status}: {message}")
    if status == 429:
        return RetryableError("429", f"HTTP 429: {message}", wait)
    if status == 408 or status >= 500:
        return RetryableError("5xx" if status >= 500 else "408", f"HTTP {status}: {message}", wait)
    return FatalError(str(status), f"HTTP {status}: {message}")


def _flags(finish_reason: str, reasoning: str | None, content: str, tool_calls: Any, want_reasoning: bool) -> list[str]:
    flags = []
    if finish_reason == "length":
        flags.append("truncated")
    elif not content and not tool_calls:  # finished without an answer (a cut-off one is "truncated")
        flags.append("empty")
    if want_reasoning and not reasoning:
        flags.append("no_reasoning")
    return flags


def parse_chat_completion(body: Any, want_reasoning: bool) -> dict[str, Any]:
    """Fields of a record from an OpenAI-compatible (or OpenRouter) chat completion body."""
    if not isinstance(body, dict):
        raise RetryableError("bad_body", f"response is not a JSON object: {str(body)[:200]}")
    if body.get("error"):
        # Errors after the model started arrive with HTTP 200: a failed generation, retry it.
        message, _ = _error_message(body, "")
        raise RetryableError("200_error", f"error in a 200 response: {message}")
    choices = body.get("choices")
    if not choices:
        raise RetryableError("bad_body", "response has no choices")
    choice = choices[0]
    finish_reason = choice.get("finish_reason")
    if finish_reason == "error":
        raise RetryableError("200_error", f"finish_reason 'error' (native: {choice.get('native_finish_reason')})")
    message = choice.get("message") or {}
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    content = message.get("content") or ""
    tool_calls = message.get("tool_calls") or None
    usage = body.get("usage") or {}
    finish_reason = finish_reason or "stop"
    return {
        "reasoning": reasoning,
        "content": content,
        "tool_calls": tool_calls,
        "finish_reason": finish_reason,
        "native_finish_reason": choice.get("native_finish_reason"),
        "flags": _flags(finish_reason, reasoning, content, tool_calls, want_reasoning),
        "usage": usage,
        "cost": float(usage.get("cost") or 0.0),
        "provider": body.get("provider"),
        "generation_id": body.get("id"),
    }


def parse_sglang_generate(body: Any, split_ids, eos_ids: list[int], want_reasoning: bool) -> dict[str, Any]:
    """Fields of a record from SGLang's native ``/generate`` body (exact ``output_ids``).

    ``split_ids(ids) -> {reasoning, content, finish_reason}`` cuts the ids at ``</think>`` with the
    target's tokenizer (aerie.responses.in_process.split_generated).
    """
    if not isinstance(body, dict):
        raise RetryableError("bad_body", f"response is not a JSON object: {str(body)[:200]}")
    if body.get("error"):
        message, _ = _error_message(body, "")
        raise RetryableError("200_error", f"error in a 200 response: {message}")
    meta = body.get("meta_info") or {}
    ids = body.get("output_ids")
    if not isinstance(ids, list):
        raise RetryableError("bad_body", "response has no output_ids")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        raise RetryableError("200_error", f"request aborted by the server: {finish.get('message')}")
    matched = finish.get("matched") if isinstance(finish, dict) else None
    ids = list(ids)
    # A stop on an end-of-turn id: make sure that id ends the sample (it is trained on).
    if kind == "stop" and isinstance(matched, int) and (not ids or ids[-1] != matched):
        ids.append(matched)
    parts = split_ids(ids)
    finish_reason = "length" if kind == "length" else parts["finish_reason"]
    usage = {
        "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": meta.get("completion_tokens", len(ids)),
        "cached_tokens": meta.get("cached_tokens"),
    }
    return {
        "reasoning": parts["reasoning"],
        "content": parts["content"],
        "tool_calls": None,
        "finish_reason": finish_reason,
        "native_finish_reason": json.dumps(finish) if isinstance(finish, dict) else finish,
        "flags": _flags(finish_reason, parts["reasoning"], parts["content"], None, want_reasoning),
        "usage": usage,
        "cost": 0.0,
        "provider": "sglang",
        "generation_id": meta.get("id"),
        "output_token_ids": ids,
    }
