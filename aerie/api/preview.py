"""The cost preview: the pending API work per dataset, capped at each dataset's output-token quota, priced,
and reconciled with the account (what `snakemake -n` prints and a real start checks, rules/common.smk).

Parse time imports this module: it reads journals, completion records and prices, and never imports the HTTP
client (aiohttp) or torch.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.api.key_ledger import key_ledger_path, other_runs_note, run_label
from aerie.api.money import (
    ACCOUNT_LAG_S,
    JOURNALED,
    AccountMoney,
    DatasetEstimate,
    Prices,
    account_ledger_path,
    account_money,
    api_key_from_env,
    dataset_requests,
    estimate_dataset,
    estimate_shard,
    expected_sample_cost,
    format_preview,
    mean_output_tokens,
    read_account_ledger,
    read_account_usage,
    resolve_prices,
    run_spend,
    usd,
)
from aerie.api.settings import ApiRun, backend_settings  # noqa: F401 (backend_settings: its old home)
from aerie.formats.responses import read_completion


@dataclass
class CostPreview:
    """What ``snakemake -n`` prints and a real start checks (rules/common.smk)."""

    text: str
    pending_usd: float
    budget: float | None
    spent: float  # journals
    lost: float  # beyond the journals: billed by the account, or sent before an interruption and not yet billed
    datasets: dict[str, DatasetEstimate]
    words: str = ""  # the spend in named parts, as the preview, the logs and the report say it


def preview_account(
    run: ApiRun,
    datasets: list[str],
    results_dir: Path,
    spend: dict[str, dict[str, float]],
    expected_cost: dict[str, float],
    live: bool,
) -> tuple[AccountMoney | None, str]:
    """The account reconcile for the preview: live when the key is here, else the ledger's last reading; requests
    sent before an interruption and not settled yet are priced at ``expected_cost`` (what a job start counts)."""
    accounts = {run.datasets[d].account for d in datasets} - {None}
    if not accounts:
        return None, ""
    if len(accounts) > 1:
        return None, f"{len(accounts)} accounts: per-account reconcile is shown in the job's log"
    account = accounts.pop()
    mine = [d for d in datasets if run.datasets[d].account == account]
    responses = run.datasets[mine[0]].responses
    ledger = read_account_ledger(account_ledger_path(results_dir), account)
    usage = None
    key = api_key_from_env(responses)
    if live and key:
        try:
            reading = read_account_usage(responses, key, timeout=10)
            usage = reading["usage"] if reading else None
        except RuntimeError as e:
            if not ledger:
                return None, f"not readable ({e})"
    journals = sum(spend[d]["cost"] for d in mine)
    requests = {
        d: dataset_requests(
            results_dir / d / "responses",
            expected_cost[d],
            float(run.datasets[d].responses["read_timeout_s"]) + ACCOUNT_LAG_S,
        )
        for d in mine
    }
    money = account_money(ledger, usage, journals, requests)
    if money is not None and not ledger:
        # No job has started: today's usage is only the baseline the first start will record.
        return None, f"usage ${usage:.2f} now; recorded and reconciled from the first start on"
    if money is None:
        return None, "no reading yet (recorded at the first start; set the key's variable to read it live)"
    return money, ""


def _key_ledger_notes(run: ApiRun, datasets: list[str], results_dir: Path) -> list[str]:
    """Other runs on a key this run spends from, from the key's ledger (aerie.api.key_ledger), when the key is set."""
    label = run_label(results_dir)
    notes, seen = [], set()
    for d in datasets:
        responses = run.datasets[d].responses
        key = api_key_from_env(responses) if run.datasets[d].account else None
        if not key:
            continue
        path = key_ledger_path(responses["base_url"], key)
        if path not in seen:
            seen.add(path)
            if note := other_runs_note(path, label):
                notes.append(note)
    return notes


def _quota_raised(completion: dict[str, Any], quota: int | None) -> bool:
    recorded = completion.get("max_output_tokens")
    return recorded is not None and (quota is None or quota > recorded)


def cost_preview(run: ApiRun, results_dir: Path, live: bool = True) -> CostPreview | None:
    """Estimate the pending API work per dataset, cut at each dataset's output-token quota; None when no
    dataset uses an API. ``run``: resolved with the shard plan (aerie.plan.api_run(config, plans)).

    Pending = training shards whose declared output does not exist yet, minus the samples their
    journals already hold.
    """
    datasets = list(run.datasets)
    if not datasets:
        return None
    spend = run_spend(results_dir, datasets)
    estimates: dict[str, DatasetEstimate] = {}
    expected: dict[str, float] = {}  # USD per request, per dataset
    notes: list[str] = []
    prices_seen: Prices | None = None
    budget = run.budget_usd
    priced: dict[str, Prices] = {}  # one endpoints-API call per distinct model/routing, not per dataset
    for name in datasets:
        dataset = run.datasets[name]
        responses = dataset.responses
        key = json.dumps(
            [
                responses.get(k)
                for k in (
                    "backend",
                    "base_url",
                    "model",
                    "provider",
                    "live_prices",
                    "price_per_million_input_usd",
                    "price_per_million_output_usd",
                )
            ],
            sort_keys=True,
        )
        if key not in priced:
            priced[key] = resolve_prices(responses, api_key_from_env(responses), live=live and responses["live_prices"])
        prices = priced[key]
        prices_seen = prices_seen or prices
        mean_tokens, basis = mean_output_tokens(responses, spend[name], dataset.described)
        phash = dataset.settings.params_hash()
        if dataset.shards and dataset.planned_prompts is None:
            raise ValueError(f"dataset {name!r}: the cost preview needs the plan's prompts (aerie.plan.api_run)")
        prompts_iter = dataset.planned_prompts() if dataset.shards else iter(())  # shard 0 first, plan order
        rows, cut = [], []
        for shard in dataset.shards:
            out = results_dir / name / "responses" / f"shard-{shard.name}.jsonl"
            prompts = list(itertools.islice(prompts_iter, shard.stop - shard.start))
            if out.exists():
                done = read_completion(out)
                if done and done["not_requested"] and _quota_raised(done, dataset.max_output_tokens):
                    cut.append(str(out))
                continue
            rows.append(estimate_shard(name, shard.name, prompts, out, phash, mean_tokens, prices))
        if cut:
            # A published shard is never rerun by Snakemake on its own: say how to request the rest.
            notes.append(
                f"datasets.{name}.max_output_tokens was raised after {len(cut)} shard(s) were published "
                f"at the old quota; not counted above. `snakemake --forcerun {' '.join(cut)}` requests "
                "their remaining prompts (journaled samples are not paid again)"
            )
        estimates[name] = estimate_dataset(
            name, rows, mean_tokens, basis, prices, dataset.max_output_tokens, int(spend[name]["completion_tokens"])
        )
        pending = sum(r.pending_prompts for r in rows)
        prompt_tokens = sum(r.prompt_tokens for r in rows) / pending if pending else 0.0
        expected[name] = expected_sample_cost(spend[name], mean_tokens, prices, prompt_tokens)
    spent = sum(s["cost"] for s in spend.values())
    account, note = preview_account(run, datasets, results_dir, spend, expected, live)
    text = format_preview(list(estimates.values()), spent, budget, prices_seen, account, note)
    notes += _key_ledger_notes(run, datasets, results_dir)
    text += "".join(f"\n  NOTE {n}" for n in notes)
    words = f"{usd(spent)} {JOURNALED}"
    if account is not None and account.unjournaled.total:
        words += f" + {account.unjournaled.words()}"
    return CostPreview(
        text,
        sum(e.dollars for e in estimates.values()),
        budget,
        spent,
        account.lost if account else 0.0,
        estimates,
        words,
    )
