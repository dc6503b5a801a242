"""What an emulator is told: its settings, the fake providers it routes over, and the command line's specs for them.

Everything here is plain data and checking; nothing listens or draws random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aerie.emulator.distributions import LATENCY_DISTS, OUTPUT_DISTS

BATCH_FAULT_KINDS = ("validating", "expire", "entry-error", "lost-poll", "lost-submit")
FAULT_KINDS = ("429", "429-retry-after", "500", "502", "503", "200-error", "torn", "reset", "slow", "402-in-flight")


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


DEFAULT_PROVIDERS = (
    FakeProvider("Chutes", "int4", 0.45e-6, 1.9e-6),
    FakeProvider("Together", "fp8", 0.6e-6, 2.5e-6),
    FakeProvider("Fireworks", "fp4", 0.6e-6, 2.5e-6),
    FakeProvider("DeepInfra", "int4", 0.5e-6, 2.2e-6),
)


@dataclass
class EmulatorSettings:
    """How the emulator answers, bills and misbehaves (the command line's flags, see ``aerie-emulator --help``)."""

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
    # The Batch API (aerie.emulator.batches): which models and provider slugs take batches (None: all), the batch
    # price as a share of the per-token price, how long validation and an entry take, and its faults.
    batch_models: list[str] | None = None
    batch_providers: list[str] | None = None
    batch_discount: float = 0.5
    batch_validate_s: float = 0.2
    batch_latency_mean: float = 1.0
    batch_faults: dict[str, float] = field(default_factory=dict)


def check_settings(s: EmulatorSettings) -> None:
    """Raise ValueError naming the setting when ``s`` cannot be served (before any port is bound)."""
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
    unknown = set(s.batch_faults) - set(BATCH_FAULT_KINDS)
    if unknown:
        raise ValueError(f"unknown batch fault kinds {sorted(unknown)}; known: {', '.join(BATCH_FAULT_KINDS)}")
    if not 0 < s.batch_discount <= 1:
        raise ValueError(f"batch_discount must be in (0, 1]: {s.batch_discount}")


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
