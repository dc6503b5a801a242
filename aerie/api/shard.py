"""Glue between the pipeline config and the API client: one responses shard, and the run's cost preview."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aerie.api.backends import API_BACKENDS, BackendSettings
from aerie.api.client import ClientLimits, LedgerWatcher, MoneyGuard, regenerate_shard
from aerie.api.journal import journal_path
from aerie.api.money import (
    Prices,
    api_key_from_env,
    estimate_shard,
    format_preview,
    mean_output_tokens,
    resolve_prices,
    run_spend,
)
from aerie.plan import responses_config
from aerie.prompts import iter_prompts, read_prompts


def backend_settings(responses: dict[str, Any], target_path: str, base_url: str | None = None) -> BackendSettings:
    served = bool(responses.get("serve"))
    return BackendSettings(
        backend=responses["backend"],
        # A server started by the rule serves the target folder under its path.
        model=str(target_path) if served else responses["model"] if responses["backend"] != "sglang"
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


def client_limits(responses: dict[str, Any]) -> ClientLimits:
    return ClientLimits(
        concurrency=responses["concurrency"],
        connect_timeout=responses["connect_timeout_s"],
        read_timeout=responses["read_timeout_s"],
        max_attempts=responses["max_attempts"],
        backoff_base=responses["backoff_base_s"],
        backoff_max=responses["backoff_max_s"],
        progress_interval=responses["progress_interval_s"],
    )


def api_datasets(config: dict[str, Any]) -> list[str]:
    return [name for name in config["datasets"] if responses_config(config, name)["backend"] in API_BACKENDS]


def _all_journals(results_dir: Path, datasets: list[str]) -> Callable[[], list[Path]]:
    return lambda: [p for d in datasets for p in sorted((results_dir / d / "responses").glob("shard-*.journal.jsonl"))]


def check_key(responses: dict[str, Any], api_key: str | None, log: Callable[[str], None]) -> None:
    """OpenRouter: read the key's live usage and limit before spending (GET /key); stop when exhausted."""
    if responses["backend"] != "openrouter":
        return
    import requests

    try:
        resp = requests.get(f"{responses['base_url'].rstrip('/')}/key",
                            headers={"Authorization": f"Bearer {api_key}"}, timeout=15)
    except requests.RequestException as e:
        raise RuntimeError(f"responses.base_url {responses['base_url']}: unreachable ({type(e).__name__}); "
                           "nothing was requested") from None
    if resp.status_code == 401:
        raise RuntimeError(f"the API key in ${responses['api_key_env']} was refused (HTTP 401); nothing was requested")
    if resp.status_code != 200:
        log(f"GET /key answered HTTP {resp.status_code}: live key usage unknown, continuing with journal spend")
        return
    data = resp.json().get("data") or {}
    log(f"key: usage ${float(data.get('usage') or 0):.2f}, limit {data.get('limit')}, "
        f"remaining {data.get('limit_remaining')}")
    remaining = data.get("limit_remaining")
    if remaining is not None and float(remaining) <= 0:
        raise RuntimeError("the API key has no limit remaining (GET /key); raise its limit; nothing was requested")


def regenerate_api_shard(prompts_path: Path, out_path: Path, config: dict[str, Any], dataset: str,
                         results_dir: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one shard through the dataset's API backend (starting a loopback server if configured)."""
    responses = responses_config(config, dataset)
    target = config["target"]
    prompts = read_prompts(prompts_path)
    api_key = api_key_from_env(responses)
    if responses["backend"] == "openrouter" and not api_key:
        raise RuntimeError(f"responses.api_key_env: environment variable ${responses['api_key_env']} is not set "
                           "(the key is read from the environment only)")

    datasets = api_datasets(config)
    spend = run_spend(results_dir, datasets)
    prices = resolve_prices(responses, api_key, live=responses["live_prices"])
    mean_tokens, basis = mean_output_tokens(responses, spend[dataset])
    guard = MoneyGuard(
        budget_usd=responses.get("budget_usd"),
        spent_before=sum(s["cost"] for s in spend.values()),
        expected_cost=mean_tokens * prices.output,
        token_cap=config["datasets"][dataset].get("max_output_tokens"),
        tokens_before=int(spend[dataset]["completion_tokens"]),
        expected_tokens=mean_tokens,
    )
    guard.others = LedgerWatcher(_all_journals(results_dir, datasets), exclude=journal_path(out_path),
                                 dataset_dir=out_path.parent)
    guard.others.prime()
    log(f"{dataset}: price {prices.input * 1e6:.3f}/{prices.output * 1e6:.3f} USD per M in/out ({prices.source}); "
        f"expected {mean_tokens:.0f} output tokens per sample ({basis}); spent so far ${guard.spent_before:.2f}")
    check_key(responses, api_key, log)

    render_ids = split_ids = eos_ids = None
    if responses["backend"] == "sglang":
        from aerie.responses import split_generated
        from aerie.target import load_tokenizer, read_chat_format, read_generation_config, render_prompt_ids

        tok = load_tokenizer(target["path"])
        fmt = read_chat_format(tok, read_generation_config(target["path"]))
        eos_ids = list(fmt.stop_ids)

        def render_ids(messages, tools=None):  # noqa: F811 - the sglang backend sends ids rendered by the target's template
            return render_prompt_ids(tok, messages, tools=tools)

        def split_ids(ids):  # noqa: F811
            return split_generated(tok, ids, fmt)

    server = contextlib.nullcontext(None)
    if responses.get("serve") == "transformers":
        from aerie.api.serve import serve_on_loopback, transformers_serve_command
        from aerie.target import pick_device

        device = str(pick_device(target.get("device", "auto")))
        server = serve_on_loopback(
            lambda port: transformers_serve_command(target["path"], port, device=device),
            "/health", out_path.parent / f".{out_path.name}.server.log")
    with server as base:
        if base:
            log(f"{dataset}: transformers serve ready at {base}")
        settings = backend_settings(responses, target["path"], base_url=f"{base}/v1" if base else None)
        return asyncio.run(regenerate_shard(
            prompts, out_path, settings, api_key=api_key, limits=client_limits(responses), guard=guard,
            want_reasoning=responses["require_reasoning"], render_ids=render_ids, split_ids=split_ids,
            eos_ids=eos_ids, log=log))


def cost_preview(config: dict[str, Any], plans: dict[str, Any], results_dir: Path,
                 live: bool = True) -> tuple[str, float, float | None, float] | None:
    """Estimate the pending API work: (text, pending USD, budget, spent). None when no dataset uses an API.

    Pending = training shards whose declared output does not exist yet, minus the samples their
    journals already hold.
    """
    datasets = api_datasets(config)
    if not datasets:
        return None
    spend = run_spend(results_dir, datasets)
    rows, per_dataset = [], {}
    prices_seen: Prices | None = None
    budget = config["responses"].get("budget_usd")
    priced: dict[str, Prices] = {}  # one endpoints-API call per distinct model/routing, not per dataset
    for name in datasets:
        responses = responses_config(config, name)
        key = json.dumps([responses.get(k) for k in ("backend", "base_url", "model", "provider", "live_prices",
                                                      "price_per_million_input_usd", "price_per_million_output_usd")],
                         sort_keys=True)
        if key not in priced:
            priced[key] = resolve_prices(responses, api_key_from_env(responses), live=live and responses["live_prices"])
        prices = priced[key]
        prices_seen = prices_seen or prices
        mean_tokens, basis = mean_output_tokens(responses, spend[name])
        per_dataset[name] = {"basis": basis}
        phash = backend_settings(responses, config["target"]["path"]).params_hash()
        plan = plans[name]
        prompts_iter = iter_prompts(name, config["datasets"][name])
        for shard in plan.shard_names:
            out = results_dir / name / "responses" / f"shard-{shard}.jsonl"
            start, stop = plan.shard_range(int(shard))
            prompts = list(itertools.islice(prompts_iter, stop - start))
            if out.exists():
                continue
            rows.append(estimate_shard(name, shard, prompts, out, phash, mean_tokens, prices))
    spent = sum(s["cost"] for s in spend.values())
    text = format_preview(rows, per_dataset, spent, budget, prices_seen)
    return text, sum(r.dollars for r in rows), budget, spent
