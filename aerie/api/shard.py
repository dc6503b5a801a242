"""Glue between the pipeline config and the API client: one responses shard, and the run's cost preview."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aerie.api.client import (
    AccountWatcher,
    ClientLimits,
    LedgerWatcher,
    MoneyGuard,
    RegenerationStopped,
    regenerate_shard,
)
from aerie.api.journal import journal_path
from aerie.api.money import (
    AccountState,
    account_id,
    account_key_url,
    account_ledger_path,
    account_state,
    api_key_from_env,
    append_account_ledger,
    mean_output_tokens,
    read_account_ledger,
    read_account_usage,
    resolve_prices,
    run_spend,
)
from aerie.api.preview import api_datasets, backend_settings
from aerie.plan import responses_config
from aerie.prompts import read_prompts


def client_limits(responses: dict[str, Any]) -> ClientLimits:
    return ClientLimits(
        concurrency=responses["concurrency"],
        connect_timeout=responses["connect_timeout_s"],
        read_timeout=responses["read_timeout_s"],
        max_attempts=responses["max_attempts"],
        backoff_base=responses["backoff_base_s"],
        backoff_max=responses["backoff_max_s"],
        progress_interval=responses["progress_interval_s"],
        ca_bundle=responses.get("ca_bundle"),
    )


def _all_journals(results_dir: Path, datasets: list[str]) -> Callable[[], list[Path]]:
    return lambda: [p for d in datasets for p in sorted((results_dir / d / "responses").glob("shard-*.journal.jsonl"))]


def account_datasets(config: dict[str, Any], account: str) -> list[str]:
    """The API datasets that spend from one provider account."""
    return [d for d in api_datasets(config) if account_id(responses_config(config, d)) == account]


def start_account(
    config: dict[str, Any], dataset: str, results_dir: Path, api_key: str | None, job: str, log: Callable[[str], None]
) -> tuple[AccountState | None, AccountWatcher | None]:
    """At a job's start: read the account's usage, record it, reconcile it with the journals.

    The account's growth since the run's first start minus the journals' growth is money billed for
    answers no journal holds (requests in flight when a process died): it counts against the budget.
    Stops (RuntimeError) when the key's own limit is exhausted. Backends without an account: (None, None).
    """
    responses = responses_config(config, dataset)
    account = account_id(responses)
    if account is None:
        return None, None
    try:
        live = read_account_usage(responses, api_key)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; nothing was requested") from None
    if live is None:
        log(
            "GET /key and /credits gave no usage figure: the account is not reconciled, the budget counts "
            "journal spend only"
        )
        return None, None
    ledger_path = account_ledger_path(results_dir)
    ledger = read_account_ledger(ledger_path, account)
    mine = account_datasets(config, account)
    journals = sum(s["cost"] for s in run_spend(results_dir, mine).values())
    state = account_state(ledger, live["usage"], journals)
    append_account_ledger(ledger_path, account, "start", job, live["usage"], journals, state.lost)
    log(
        f"account ({live['endpoint']}): usage ${live['usage']:.2f}, limit {live['limit']}, remaining "
        f"{live['limit_remaining']}; since the run's first start ${state.usage - state.baseline_usage:.2f} billed, "
        f"${state.journal_spend - state.baseline_journal:.2f} journaled: "
        f"${state.lost:.2f} lost to interrupted requests"
    )
    remaining = live["limit_remaining"]
    if remaining is not None and float(remaining) <= 0:
        raise RuntimeError("the API key has no limit remaining (GET /key); raise its limit; nothing was requested")

    def record(usage: float, journal: float, lost: float) -> None:
        append_account_ledger(ledger_path, account, "poll", job, usage, journal, lost)

    # The watcher compares against the journals of every dataset the guard follows (api_datasets).
    all_journals = sum(s["cost"] for s in run_spend(results_dir, api_datasets(config)).values())
    watcher = AccountWatcher(
        account_key_url(responses),
        state.baseline_usage,
        state.baseline_journal + (all_journals - journals),
        record,
        floor=state.lost,
    )
    return state, watcher


def responses_results_dir(out_path: Path, dataset: str) -> Path:
    """The results folder of a responses shard, ``<results>/<dataset>/responses/shard-NNNNN.jsonl``: where the
    journals of every dataset are (the budget counts them all). A shard elsewhere is refused, naming the layout."""
    out = Path(out_path)
    if out.parent.name != "responses" or out.parent.parent.name != dataset:
        raise ValueError(
            f"{out}: not a responses shard of dataset {dataset!r} (<results>/{dataset}/responses/shard-NNNNN.jsonl), "
            "so the journals the budget counts cannot be found"
        )
    return out.parent.parent.parent


def regenerate_api_shard(
    prompts_path: Path,
    out_path: Path,
    config: dict[str, Any],
    dataset: str,
    results_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one shard through the dataset's API backend (starting a loopback server if configured).

    ``results_dir``: where every dataset's journals are; by default the one ``out_path`` lies in."""
    if results_dir is None:
        results_dir = responses_results_dir(out_path, dataset)
    responses = responses_config(config, dataset)
    target = config["target"]
    prompts = read_prompts(prompts_path)
    api_key = api_key_from_env(responses)
    if responses["backend"] == "openrouter" and not api_key:
        raise RuntimeError(
            f"responses.api_key_env: environment variable ${responses['api_key_env']} is not set "
            "(the key is read from the environment only)"
        )

    datasets = api_datasets(config)
    spend = run_spend(results_dir, datasets)
    prices = resolve_prices(responses, api_key, live=responses["live_prices"])
    mean_tokens, basis = mean_output_tokens(responses, spend[dataset], (dataset, config["datasets"][dataset]))
    guard = MoneyGuard(
        budget_usd=responses.get("budget_usd"),
        spent_before=sum(s["cost"] for s in spend.values()),
        expected_cost=mean_tokens * prices.output,
        token_cap=config["datasets"][dataset].get("max_output_tokens"),
        tokens_before=int(spend[dataset]["completion_tokens"]),
        expected_tokens=mean_tokens,
    )
    guard.others = LedgerWatcher(
        _all_journals(results_dir, datasets), exclude=journal_path(out_path), dataset_dir=out_path.parent
    )
    guard.others.prime()
    log(
        f"{dataset}: price {prices.input * 1e6:.3f}/{prices.output * 1e6:.3f} USD per M in/out ({prices.source}); "
        f"expected {mean_tokens:.0f} output tokens per sample ({basis}); spent so far ${guard.spent_before:.2f}"
    )
    account, guard.account = start_account(config, dataset, results_dir, api_key, f"{dataset}/{out_path.name}", log)
    if account is not None:
        guard.lost_usd = account.lost

    render_ids = split_ids = eos_ids = None
    if responses["backend"] == "sglang":
        from aerie.responses import split_generated
        from aerie.target.chat import read_chat_format
        from aerie.target.model import load_tokenizer, read_generation_config
        from aerie.target.template import render_prompt_ids

        tok = load_tokenizer(target["path"], target.get("trust_remote_code", False))
        fmt = read_chat_format(tok, read_generation_config(target["path"]))
        eos_ids = list(fmt.stop_ids)

        def render_ids(messages, tools=None):  # noqa: F811 - the sglang backend sends ids rendered by the target's template
            return render_prompt_ids(tok, messages, tools=tools)

        def split_ids(ids):  # noqa: F811
            return split_generated(tok, ids, fmt)

    server = contextlib.nullcontext(None)
    if responses.get("serve") == "transformers":
        from aerie.api.serve import serve_on_loopback, transformers_serve_command
        from aerie.target.model import pick_device

        device = str(pick_device(target.get("device", "auto")))
        server = serve_on_loopback(
            lambda port: transformers_serve_command(
                target["path"], port, device=device, trust_remote_code=target.get("trust_remote_code", False)
            ),
            "/health",
            out_path.parent / f".{out_path.name}.server.log",
        )
    with server as base:
        if base:
            log(f"{dataset}: transformers serve ready at {base}")
        settings = backend_settings(responses, target["path"], base_url=f"{base}/v1" if base else None)
        return asyncio.run(
            regenerate_shard(
                prompts,
                out_path,
                settings,
                api_key=api_key,
                limits=client_limits(responses),
                guard=guard,
                want_reasoning=responses["require_reasoning"],
                render_ids=render_ids,
                split_ids=split_ids,
                eos_ids=eos_ids,
                log=log,
            )
        )


def run_api_responses_job(
    prompts_path: Path, out_path: Path, config: dict[str, Any], dataset: str, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Rule ``responses`` (API backends): ``regenerate_api_shard``; a shard stopped short (budget, quota, key
    limit, failed requests) ends the job with the reason, logged and as its exit message."""
    try:
        return regenerate_api_shard(prompts_path, out_path, config, dataset, log=log)
    except (RegenerationStopped, RuntimeError) as e:
        log(f"{out_path}: not finished: {e}")
        raise SystemExit(f"responses {out_path}: {e}") from None
