"""A run's API settings, resolved once by the planning layer and handed down (aerie.plan.api_run).

The planning layer merges each dataset's ``responses`` overrides into the global section, checks them against the
schema, and plans each dataset's shards; what the API job (aerie.api.job) and the cost preview (aerie.api.preview)
need of that comes to them as one :class:`ApiRun`. Nothing in aerie.api reads the config or the plan itself, so
one setting is resolved in one place and followed downward only (tests/test_architecture.py guards the direction).

Torch- and aiohttp-free: parse time builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aerie.api.backends import BackendSettings
from aerie.api.money import account_id


def backend_settings(responses: Mapping[str, Any], target_path: str, base_url: str | None = None) -> BackendSettings:
    """The request settings of a dataset's merged ``responses`` config (their hash keys the journal)."""
    served = bool(responses.get("serve"))
    return BackendSettings(
        backend=responses["backend"],
        # A server started by the rule serves the target folder under its path.
        model=str(target_path)
        if served
        else responses["model"]
        if responses["backend"] != "sglang"
        else responses.get("model") or str(target_path),
        base_url=base_url or responses.get("base_url") or "",
        temperature=responses["temperature"],
        top_p=responses["top_p"],
        max_new_tokens=responses["max_new_tokens"],
        seed=responses["seed"] if responses.get("send_seed") else None,
        provider=responses.get("provider"),
        reasoning=responses.get("reasoning"),
        extra_headers=responses.get("extra_headers"),
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
    # The global ``responses`` section with this dataset's overrides, checked against the schema (the money
    # functions of aerie.api.money read their keys from it).
    responses: dict[str, Any]
    # ``datasets.<name>`` as configured: its quota (``max_output_tokens``) and ``expected_output_tokens``.
    section: dict[str, Any]
    settings: BackendSettings  # what its requests are made of (an own server's address is filled in by the job)
    # Its planned training shards, and their prompts in the plan's order (shard 0 first): the cost preview reads
    # them; empty / None where the plan was not asked for (the job reads its shards' prompt files).
    shards: tuple[PlannedShard, ...] = ()
    planned_prompts: Callable[[], Iterator[dict[str, Any]]] | None = field(default=None, compare=False)

    @property
    def backend(self) -> str:
        return self.responses["backend"]

    @property
    def account(self) -> str | None:
        """Which provider account it spends from (aerie.api.money.account_id)."""
        return account_id(self.responses)

    @property
    def served(self) -> bool:
        """Whether the job starts a loopback server of the target for it (``responses.serve``)."""
        return self.responses.get("serve") == "transformers"

    @property
    def max_output_tokens(self) -> int | None:
        return self.section.get("max_output_tokens")

    @property
    def described(self) -> tuple[str, dict[str, Any]]:
        """``(name, datasets.<name>)``, the form aerie.api.money.mean_output_tokens takes."""
        return self.name, self.section


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
    budget_usd: float | None  # responses.budget_usd: the run's budget

    def dataset(self, name: str) -> ApiDataset:
        if name not in self.datasets:
            raise ValueError(f"dataset {name!r} is not regenerated through an API (responses.backend)")
        return self.datasets[name]

    def account_datasets(self, account: str | None) -> list[str]:
        """The API datasets that spend from one provider account."""
        return [d for d, ds in self.datasets.items() if ds.account == account]
