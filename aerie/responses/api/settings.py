"""A run's API settings, resolved once by the planning layer and handed down (aerie.plan.resolve.api_run).

The planning layer merges each dataset's ``responses`` overrides into the global section and checks them against
the schema (config/schema.yaml fills the defaults); :func:`responses_settings` turns that merged section into one
frozen, typed :class:`ResponsesSettings`, and the run's own limits - the budget among them, which has one home,
:attr:`ApiRun.budget_usd` - come as one :class:`ApiRun`. The API job (aerie.responses.api.job) and the cost preview
(aerie.preview.money) read these objects only: nothing in aerie.responses.api reads the config or the plan, so one
setting is resolved in one place and followed downward only (tests/test_architecture.py guards the direction).

Torch- and aiohttp-free: parse time builds it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aerie.responses.api.backends import ApiBackend, BackendSettings, api_backend
from aerie.responses.api.prices import Prices

MODES = ("stream", "batch")
FAILED_BATCH_ENTRIES = ("next_batch", "stream")


@dataclass(frozen=True)
class ClientLimits:
    """How the client talks to the server: requests in flight, timeouts, retries, progress."""

    concurrency: int = 64
    connect_timeout: float = 30.0
    read_timeout: float = 600.0  # a long reasoning answer is one silent wait: be generous
    max_attempts: int = 8
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    progress_interval: float = 10.0
    # PEM file of the CAs to trust for HTTPS (a private CA, a proxy, a test server's self-signed certificate);
    # None: the system store, which honours SSL_CERT_FILE / SSL_CERT_DIR. Verification is never turned off.
    ca_bundle: str | None = None


def backoff_seconds(attempt: int, limits: ClientLimits, retry_after: float | None) -> float:
    """How long to wait before attempt ``attempt + 1``: the server's ``Retry-After`` (within reason), else
    exponential backoff with full jitter."""
    if retry_after is not None:
        return min(retry_after, limits.backoff_max * 5)
    return random.uniform(0, min(limits.backoff_max, limits.backoff_base * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class BatchSettings:
    """``responses.batch``: how ``responses.mode: batch`` submits a shard's pending requests (docs/api.md)."""

    size: int = 1000  # requests per batch (a batch is cut smaller when the budget leaves less room)
    poll_interval_s: float = 30.0  # seconds between two polls of a batch in flight
    failed: str = "next_batch"  # a failed entry is retried in the next batch, or through the streaming path
    # The batch price as a share of the per-token price until this run has measured it from billed batch results
    # (OpenRouter: "typically 50%"; no per-endpoint batch price is published).
    price_factor: float = 0.5
    max_batches_in_flight: int = 4  # batches submitted and not finished, per dataset


@dataclass(frozen=True)
class ResponsesSettings:
    """One dataset's ``responses`` settings (the global section with the dataset's overrides), typed."""

    request: BackendSettings  # what its requests are made of (an own server's address is filled in by the job)
    limits: ClientLimits
    api_key_env: str = "OPENROUTER_API_KEY"
    require_reasoning: bool = True
    expected_output_tokens: int | None = None  # responses.expected_output_tokens (a dataset's own wins)
    live_prices: bool = True
    price_per_million_input_usd: float | None = None
    price_per_million_output_usd: float | None = None
    served: bool = False  # responses.serve: the job starts a loopback server of the target for it
    mode: str = "stream"  # "stream": one request per sample; "batch": OpenRouter's Batch API
    batch: BatchSettings = field(default_factory=BatchSettings)

    @property
    def backend(self) -> str:
        return self.request.backend

    @property
    def api(self) -> ApiBackend:
        return api_backend(self.request.backend)

    @property
    def base_url(self) -> str:
        return self.request.base_url

    @property
    def account(self) -> str | None:
        """Which provider account it spends from (the key's variable, never the key); None: no account."""
        return self.api.account_id(self.base_url, self.api_key_env)

    @property
    def settle_s(self) -> float:
        """After this long a request sent has been answered or given up, and billed if it ever will be."""
        return float(self.limits.read_timeout) + ACCOUNT_LAG_S

    def configured_prices(self) -> Prices | None:
        return self.api.prices(self.price_per_million_input_usd, self.price_per_million_output_usd)


# An answer we still wait for arrives within responses.read_timeout_s; the account shows its charge within about
# this much more (GET /key lags by seconds).
ACCOUNT_LAG_S = 60.0


def responses_settings(responses: Mapping[str, Any], target_path: str) -> ResponsesSettings:
    """The typed settings of a dataset's merged, schema-checked ``responses`` section (defaults filled in)."""
    api = api_backend(responses["backend"])
    served = responses.get("serve") == "transformers"
    model = str(target_path) if served or (not api.needs_model and not responses.get("model")) else responses["model"]
    batch = responses.get("batch") or {}
    return ResponsesSettings(
        request=BackendSettings(
            backend=api.name,
            model=model,
            base_url=responses.get("base_url") or "",
            temperature=responses["temperature"],
            top_p=responses["top_p"],
            max_new_tokens=responses["max_new_tokens"],
            seed=responses["seed"] if responses.get("send_seed") else None,
            provider=responses.get("provider"),
            reasoning=responses.get("reasoning"),
            extra_headers=responses.get("extra_headers"),
        ),
        limits=ClientLimits(
            concurrency=responses["concurrency"],
            connect_timeout=responses["connect_timeout_s"],
            read_timeout=responses["read_timeout_s"],
            max_attempts=responses["max_attempts"],
            backoff_base=responses["backoff_base_s"],
            backoff_max=responses["backoff_max_s"],
            progress_interval=responses["progress_interval_s"],
            ca_bundle=responses.get("ca_bundle"),
        ),
        api_key_env=responses.get("api_key_env") or "OPENROUTER_API_KEY",
        require_reasoning=responses["require_reasoning"],
        expected_output_tokens=responses.get("expected_output_tokens"),
        live_prices=responses["live_prices"],
        price_per_million_input_usd=responses.get("price_per_million_input_usd"),
        price_per_million_output_usd=responses.get("price_per_million_output_usd"),
        served=served,
        mode=responses.get("mode") or "stream",
        batch=BatchSettings(**batch),
    )


@dataclass(frozen=True)
class PlannedShard:
    """One planned training shard of a dataset: its name and its prompts' positions in the plan's order."""

    name: str  # "00000"
    start: int
    stop: int


@dataclass(frozen=True)
class ApiDataset:
    """One dataset regenerated through an API, as the planning layer resolved it."""

    name: str
    settings: ResponsesSettings
    max_output_tokens: int | None = None  # datasets.<name>.max_output_tokens: its output-token quota
    expected_output_tokens: int | None = None  # datasets.<name>.expected_output_tokens
    # Its planned training shards, and their prompts in the plan's order (shard 0 first): the cost preview reads
    # them; empty / None where the plan was not asked for (the job reads its shards' prompt files).
    shards: tuple[PlannedShard, ...] = ()
    planned_prompts: Callable[[], Iterator[dict[str, Any]]] | None = field(default=None, compare=False)

    @property
    def account(self) -> str | None:
        return self.settings.account


@dataclass(frozen=True)
class TargetSettings:
    """What the API job needs of the target: a served target's folder, and its tokenizer for SGLang's ids."""

    path: str
    trust_remote_code: bool = False
    device: str = "auto"


@dataclass(frozen=True)
class ApiRun:
    """Every API dataset of a run (in the config's order) and the run's own limits."""

    datasets: Mapping[str, ApiDataset]
    target: TargetSettings
    concurrency: int  # responses.concurrency: requests in flight in all (a dataset's own caps its share)
    progress_interval_s: float  # responses.progress_interval_s
    # responses.budget_usd: the run's one budget (shared with the other runs on its key while they overlap); no
    # dataset has its own (the planning layer refuses a per-dataset budget_usd).
    budget_usd: float | None

    def dataset(self, name: str) -> ApiDataset:
        if name not in self.datasets:
            raise ValueError(f"dataset {name!r} is not regenerated through an API (responses.backend)")
        return self.datasets[name]

    def account_datasets(self, account: str | None) -> list[str]:
        """The API datasets that spend from one provider account."""
        return [d for d, ds in self.datasets.items() if ds.account == account]
