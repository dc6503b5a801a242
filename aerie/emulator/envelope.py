"""OpenRouter's JSON shapes, as the emulator answers them: error bodies, the chat completion with OpenRouter's
extras (``provider``, ``reasoning`` / ``reasoning_details``, ``usage.cost``, ``native_finish_reason``), the key,
credits, model and endpoint listings, and prices written as OpenRouter writes them.

Only shapes: what goes into them (routing, billing, faults) is decided elsewhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from aerie.emulator.settings import EmulatorSettings


@dataclass(frozen=True)
class Refusal:
    """A request answered with an error before any generation: how it is logged and what the client gets."""

    outcome: str  # the request log's and /emulator/stats' name for it
    status: int
    message: str
    metadata: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


def usd(price: float) -> str:
    """OpenRouter writes prices as decimal strings (no exponent)."""
    text = f"{price:.12f}".rstrip("0").rstrip(".")
    return text or "0"


def error_body(status: int, message: str, metadata: dict[str, Any] | None = None) -> bytes:
    """``{"error": {"code", "message", "metadata"?}}``, the body of every error answer."""
    err: dict[str, Any] = {"code": status, "message": message}
    if metadata:
        err["metadata"] = metadata
    return json.dumps({"error": err}).encode()


def _completion_head(gen_id: str, model: str, provider: str) -> dict[str, Any]:
    """The fields every chat completion starts with, failed or not: its generation id, model and provider."""
    return {
        "id": gen_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "provider": provider,
    }


def mid_generation_error(gen_id: str, model: str, provider: str) -> dict[str, Any]:
    """A generation that failed after it started, reported inside an HTTP 200 (never charged)."""
    return {
        **_completion_head(gen_id, model, provider),
        "error": {
            "code": 502,
            "message": "Provider returned error mid-generation (emulated)",
            "metadata": {"provider_name": provider},
        },
    }


def assistant_message(content: str, reasoning: str | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The answer's ``message``: content, OpenRouter's ``reasoning`` and ``reasoning_details``, tool calls if any."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "reasoning": reasoning,
        "reasoning_details": (
            [{"type": "reasoning.text", "text": reasoning, "format": "unknown", "index": 0}] if reasoning else []
        ),
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def usage_and_cost(
    prompt_tokens: int,
    completion_tokens: int,
    reasoning_tokens: int,
    cost: float,
    prompt_cost: float,
    completion_cost: float,
) -> dict[str, Any]:
    """The answer's ``usage``: token counts and what was charged (``cost`` = prompt + completion parts)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "cost": cost,
        "is_byok": False,
        "cost_details": {
            "upstream_inference_cost": None,
            "upstream_inference_prompt_cost": prompt_cost,
            "upstream_inference_completions_cost": completion_cost,
        },
    }


def chat_completion(
    gen_id: str,
    model: str,
    provider: str,
    finish: str,
    native_finish: str,
    message: dict[str, Any],
    usage: dict[str, Any],
) -> dict[str, Any]:
    """A non-streaming chat completion as OpenRouter returns it."""
    return {
        **_completion_head(gen_id, model, provider),
        "choices": [
            {
                "index": 0,
                "logprobs": None,
                "finish_reason": finish,
                "native_finish_reason": native_finish,
                "message": message,
            }
        ],
        "usage": usage,
    }


def key_info(limit: float | None, usage: float) -> dict[str, Any]:
    """``GET /key``: the key's limit and what it has spent."""
    return {
        "data": {
            "label": "aerie-emulator",
            "limit": limit,
            "limit_remaining": None if limit is None else limit - usage,
            "usage": usage,
            "is_free_tier": False,
        }
    }


def models_listing(s: EmulatorSettings) -> dict[str, Any]:
    """``GET /models``: every configured model at the cheapest provider's price."""
    cheapest = min(s.providers, key=lambda p: (p.completion_price, p.prompt_price))
    data = [
        {
            "id": m,
            "name": m,
            "created": 0,
            "context_length": s.context_length,
            "pricing": {
                "prompt": usd(cheapest.prompt_price),
                "completion": usd(cheapest.completion_price),
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
    return {"data": data}


def endpoints_listing(s: EmulatorSettings, model: str) -> dict[str, Any]:
    """``GET /models/{author}/{slug}/endpoints``: one endpoint per fake provider."""
    endpoints = [
        {
            "name": f"{p.name} | {model}",
            "provider_name": p.name,
            "tag": p.tag,
            "quantization": p.quantization,
            "pricing": {"prompt": usd(p.prompt_price), "completion": usd(p.completion_price)},
            "context_length": s.context_length,
            "max_completion_tokens": s.max_completion_tokens,
            "status": 0,
        }
        for p in s.providers
    ]
    return {"data": {"id": model, "name": model, "endpoints": endpoints}}
