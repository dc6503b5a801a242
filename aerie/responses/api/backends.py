"""The API backend seam: what every backend of the responses stage provides, what it may leave out, and the one
registry of them. No other module compares a backend's name; they ask its :class:`ApiBackend` instead.

- ``openrouter``: OpenRouter's OpenAI-compatible chat completions with its extras (provider routing, reasoning
  settings, ``usage.cost``, ``provider``, ``native_finish_reason``), live prices, an account to reconcile, the key
  ledger and the Batch API.
- ``openai``: any OpenAI-compatible server (SGLang, vLLM, ``transformers serve``; the rule may serve the target
  itself): reasoning arrives as ``message.reasoning_content`` (or ``reasoning``), nothing is billed.
- ``sglang``: SGLang's native ``/generate`` on ids rendered with the target's chat template; the answer carries the
  exact sampled ``output_ids``.

Request bodies and answer parsing are pure (aerie.responses.api.wire); parse time imports this module (no aiohttp).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from aerie.responses.api.account import AccountReading, read_account_usage
from aerie.responses.api.prices import (
    FREE,
    Prices,
    configured_prices,
    endpoint_allowed,
    endpoint_slugs,
    fetch_endpoints,
    routed_price,
)
from aerie.responses.api.wire import parse_chat_completion, parse_sglang_generate


@dataclass(frozen=True)
class BackendSettings:
    """What one dataset's requests are made of (from its ``responses`` settings); their hash keys the journal."""

    backend: str
    model: str
    base_url: str
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int | None = None
    provider: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    extra_headers: dict[str, str] | None = None

    @property
    def api(self) -> ApiBackend:
        return api_backend(self.backend)

    def sampling(self) -> dict[str, Any]:
        """The parameters that determine a response; their hash keys the journal."""
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_new_tokens,
        }
        if self.seed is not None:
            params["seed"] = self.seed
        return params | self.api.routing_params(self)

    def params_hash(self) -> str:
        blob = json.dumps(
            {"backend": self.backend, "model": self.model, "params": self.sampling()},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def url(self) -> str:
        return self.api.url(self)


@dataclass(frozen=True)
class Answer:
    """What a backend's parser needs beside the body: whether reasoning is wanted, and for SGLang's ids the
    splitter of the answer's ids at the template's markers and the end-of-turn ids."""

    want_reasoning: bool = True
    split_ids: Any = None
    eos_ids: tuple[int, ...] = ()


class ApiBackend:
    """One API backend. Every backend provides ``name``, :meth:`url`, :meth:`request_body` and :meth:`parse`, and
    says what its configuration needs (``needs_model``, ``may_serve``, ``sends_token_ids``, ``needs_key``).

    What it may leave out, with the default here meaning "not offered": a price (:meth:`prices`: the configured
    one, else free, as a self-hosted server is), live prices (:meth:`live_prices`), an account to reconcile spend
    with (:meth:`account_id`, :meth:`read_account`; without one the budget counts the journals only), the key ledger
    that shares one budget between runs on a key (``key_ledger``: it needs an account) and a batch API
    (``batch``: aerie.responses.api.batches speaks OpenRouter's; without it ``responses.mode: batch`` is refused
    at parse time, naming the backend).
    """

    name: ClassVar[str]
    needs_model: ClassVar[bool] = True  # responses.model names the API's model (unless the rule serves the target)
    may_serve: ClassVar[bool] = False  # responses.serve may start it on loopback with the target
    sends_token_ids: ClassVar[bool] = False  # renders prompts with the target's template: needs its tokenizer
    needs_key: ClassVar[bool] = False  # a request without the key from responses.api_key_env cannot succeed
    key_ledger: ClassVar[bool] = False
    batch: ClassVar[bool] = False

    # ---- requests (must) -----------------------------------------------------------------------------------------
    def url(self, s: BackendSettings) -> str:
        raise NotImplementedError

    def routing_params(self, s: BackendSettings) -> dict[str, Any]:
        """Request parameters beyond sampling that change the answer (hashed into the journal key)."""
        return {}

    def request_body(
        self, s: BackendSettings, messages: list[dict[str, Any]], prompt_ids: list[int] | None, tools: list | None
    ) -> dict[str, Any]:
        return {"model": s.model, "messages": messages, **({"tools": tools} if tools else {}), **s.sampling()}

    def parse(self, body: Any, answer: Answer) -> dict[str, Any]:
        return parse_chat_completion(body, answer.want_reasoning)

    # ---- money (may) ---------------------------------------------------------------------------------------------
    def prices(self, input_per_million: float | None, output_per_million: float | None) -> Prices | None:
        """The configured price; a backend that bills nothing is free without one."""
        return configured_prices(input_per_million, output_per_million) or FREE

    def endpoints(self, s: BackendSettings, api_key: str | None) -> list[dict[str, Any]] | None:
        """The model's endpoints (provider, quantization, prices), when the API lists them."""
        return None

    def live_prices(self, s: BackendSettings, api_key: str | None) -> Prices | None:
        endpoints = self.endpoints(s, api_key)
        return routed_price(endpoints, s.provider or {}) if endpoints else None

    def account_url(self, base_url: str) -> str | None:
        """Where the account's usage is read while a job runs (None: no account)."""
        return None

    def usage_of(self, body: Any) -> float | None:
        """The account's usage (USD) in an answer of :meth:`account_url`."""
        return None

    def account_id(self, base_url: str, key_variable: str) -> str | None:
        """Which account a dataset spends from (the key's variable name, never the key); None: no account."""
        return None

    def read_account(self, base_url: str, api_key: str | None, key_variable: str) -> AccountReading | None:
        return None


class OpenRouter(ApiBackend):
    name = "openrouter"
    needs_key = True
    key_ledger = True
    batch = True

    def url(self, s: BackendSettings) -> str:
        return f"{s.base_url.rstrip('/')}/chat/completions"

    def routing_params(self, s: BackendSettings) -> dict[str, Any]:
        return {
            **({"provider": s.provider} if s.provider else {}),
            **({"reasoning": s.reasoning} if s.reasoning else {}),
        }

    def prices(self, input_per_million: float | None, output_per_million: float | None) -> Prices | None:
        return configured_prices(input_per_million, output_per_million)  # billed: no price is not "free"

    def endpoints(self, s: BackendSettings, api_key: str | None) -> list[dict[str, Any]] | None:
        return fetch_endpoints(s.base_url, s.model, api_key)

    def account_url(self, base_url: str) -> str | None:
        return f"{base_url.rstrip('/')}/key"

    def usage_of(self, body: Any) -> float | None:
        usage = ((body or {}).get("data") or {}).get("usage") if isinstance(body, dict) else None
        return float(usage) if usage is not None else None

    def account_id(self, base_url: str, key_variable: str) -> str | None:
        return f"{base_url.rstrip('/')} ${key_variable}"

    def read_account(self, base_url: str, api_key: str | None, key_variable: str) -> AccountReading | None:
        return read_account_usage(base_url, api_key, key_variable)


class OpenAICompatible(ApiBackend):
    name = "openai"
    may_serve = True

    def url(self, s: BackendSettings) -> str:
        return f"{s.base_url.rstrip('/')}/chat/completions"


class SglangNative(ApiBackend):
    name = "sglang"
    needs_model = False
    sends_token_ids = True

    def url(self, s: BackendSettings) -> str:
        return f"{s.base_url.rstrip('/')}/generate"

    def request_body(
        self, s: BackendSettings, messages: list[dict[str, Any]], prompt_ids: list[int] | None, tools: list | None
    ) -> dict[str, Any]:
        if prompt_ids is None:
            raise ValueError("the sglang backend sends token ids: render the prompt first")
        sampling = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_new_tokens": s.max_new_tokens,
            # Keep </think> and tool-call markers in `text`; the ids are what we train on anyway.
            "skip_special_tokens": False,
        }
        if s.seed is not None:
            sampling["sampling_seed"] = s.seed
        return {"input_ids": prompt_ids, "sampling_params": sampling}

    def parse(self, body: Any, answer: Answer) -> dict[str, Any]:
        return parse_sglang_generate(body, answer.split_ids, list(answer.eos_ids), answer.want_reasoning)


_REGISTRY: dict[str, ApiBackend] = {b.name: b for b in (OpenRouter(), OpenAICompatible(), SglangNative())}
API_BACKENDS = tuple(_REGISTRY)


def is_api_backend(name: str) -> bool:
    """Whether ``responses.backend: name`` regenerates through an API (else in-process or recorded)."""
    return name in _REGISTRY


def backend_of_account(account: str) -> ApiBackend | None:
    """The backend whose account id (``<base_url> $<KEY_VARIABLE>``) this is, read back from a ledger line."""
    base, _, variable = account.rpartition(" $")
    return next((b for b in _REGISTRY.values() if base and b.account_id(base, variable) == account), None)


def api_backend(name: str) -> ApiBackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"responses.backend {name!r} is not an API backend ({', '.join(API_BACKENDS)})") from None


def request_body(
    settings: BackendSettings,
    messages: list[dict[str, Any]],
    prompt_ids: list[int] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON body for one sample. ``prompt_ids`` are required by a backend that sends ids (rendered with
    ``tools``); chat backends send ``tools`` so the server renders and parses them."""
    return settings.api.request_body(settings, messages, prompt_ids, tools)


# ---- OpenRouter's batches: one provider per batch ---------------------------------------------------------------

# Routing a batch can take (OpenRouter: "only provider.only is supported"): the rest is refused for mode batch.
BATCH_PROVIDER_KEYS = ("only", "ignore", "quantizations", "sort", "allow_fallbacks")


def provider_refusal(provider: dict[str, Any] | None) -> str:
    """Why ``responses.provider`` cannot route a batch, naming the key ("" when it can): a batch runs on one provider
    and takes ``provider.only``; ``only``, ``ignore`` and ``quantizations`` are mapped to it, ``sort: price`` is what
    a batch does anyway, ``allow_fallbacks`` does not apply."""
    for key in provider or {}:
        if key not in BATCH_PROVIDER_KEYS:
            return (
                f"{key} cannot route a batch (OpenRouter's Batch API takes provider.only: one provider per batch); "
                "drop it or use mode stream"
            )
    if (provider or {}).get("sort") not in (None, "price"):
        return "sort: a batch runs on the cheapest eligible provider (sort: price) or a pinned one (only)"
    return ""


def batch_provider(provider: dict[str, Any] | None, endpoints: list[dict[str, Any]] | None) -> tuple[list[str], str]:
    """``provider.only`` for a batch from ``responses.provider`` (checked by :func:`provider_refusal`) and the model's
    endpoints listing, and in words which it is; ``([], words)``: no pin (OpenRouter picks the cheapest eligible)."""
    provider = provider or {}
    if not any(provider.get(k) for k in ("ignore", "quantizations")):
        only = list(provider.get("only") or [])
        return only, (f"only {only} (responses.provider.only)" if only else "no pin: OpenRouter's cheapest eligible")
    if endpoints is None:
        raise ValueError(
            "responses.provider.ignore / quantizations: mapping them to a batch's provider.only needs the model's "
            "endpoints listing, which did not answer; set responses.provider.only instead"
        )
    allowed = [ep for ep in endpoints if endpoint_allowed(ep, provider)]
    only = sorted({min(endpoint_slugs(ep) - {""}, key=len) for ep in allowed})
    if not only:
        raise ValueError("responses.provider leaves no endpoint of the model for a batch (its endpoints listing)")
    return only, f"only {only} (the endpoints responses.provider allows); OpenRouter picks the cheapest eligible"
