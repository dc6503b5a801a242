"""The cost preview: the pending API work per dataset, capped at each dataset's output-token quota, priced (mode
batch: at the batch price, beside the streaming price and the wait), and this results folder's books: its journals
and its share of what the account billed beyond every journal on the key (aerie.responses.api.books) - what
`snakemake -n` prints and a real start checks (rules/common.smk).

Parse time imports this module: it reads journals, completion records and prices, and never imports the HTTP
client (aiohttp) or torch.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from aerie.formats.responses import read_completion
from aerie.responses.api.books import AccountOfFolder, FolderMoney, folder_money
from aerie.responses.api.journal import jsonl_objects
from aerie.responses.api.key_ledger import key_ledger_path, other_runs_note, run_label
from aerie.responses.api.money import (
    JOURNALED,
    DatasetEstimate,
    Prices,
    RequestCosts,
    Unjournaled,
    api_key_from_env,
    batch_prices,
    estimate_dataset,
    estimate_shard,
    expected_output_tokens,
    expected_sample_cost,
    format_preview,
    measured_batch_factor,
    resolve_prices,
    run_spend,
    usd,
)
from aerie.responses.api.settings import ApiDataset, ApiRun

# OpenRouter's word on batch waits (its announcement: median 7 minutes, 90% within an hour; 24-hour window).
PUBLISHED_BATCH_WAIT = "OpenRouter: median 7 min, 90% within 1 h, at most the 24 h window"


@dataclass
class CostPreview:
    """What ``snakemake -n`` prints and a real start checks (rules/common.smk)."""

    text: str
    pending_usd: float
    budget: float | None
    spent: float  # this folder's journals
    lost: float  # this folder's share beyond them: billed retries, lost requests, pending (priced until billed)
    datasets: dict[str, DatasetEstimate]
    words: str = ""  # the spend in named parts, as the preview, the logs and the report say it


def preview_books(
    run: ApiRun, datasets: list[str], results_dir: Path, expected: dict[str, RequestCosts], live: bool
) -> tuple[Unjournaled, str]:
    """This folder's share beyond its journals on every account, and the account line: from the key's books
    (recomputed with a live reading when the key is here), else the folder's last recorded reading."""
    total, lines = Unjournaled(), []
    for account in dict.fromkeys(run.datasets[d].account for d in datasets if run.datasets[d].account):
        mine = [d for d in datasets if run.datasets[d].account == account]
        s = run.datasets[mine[0]].settings
        where = AccountOfFolder(account, s.backend, s.base_url, s.api_key_env, s.settle_s)
        money: FolderMoney | None = folder_money(results_dir, where, mine, expected, live=live)
        if money is None:
            lines.append("no reading yet (recorded and attributed from the first start on)")
            continue
        total.retries += money.parts.retries
        total.lost += money.parts.lost
        total.pending += money.parts.pending
        lines.append(money.line())
    return total, "; ".join(lines)


def _key_ledger_notes(run: ApiRun, datasets: list[str], results_dir: Path) -> list[str]:
    """Other runs on a key this run spends from, from the key's ledger (aerie.responses.api.key_ledger), when the
    key is set."""
    label = run_label(results_dir)
    notes, seen = [], set()
    for d in datasets:
        s = run.datasets[d].settings
        key = api_key_from_env(s) if s.api.key_ledger else None
        if not key:
            continue
        path = key_ledger_path(s.base_url, key)
        if path not in seen:
            seen.add(path)
            if note := other_runs_note(path, label):
                notes.append(note)
    return notes


def _quota_raised(completion: dict[str, Any], quota: int | None) -> bool:
    recorded = completion.get("max_output_tokens")
    return recorded is not None and (quota is None or quota > recorded)


def batch_wait(responses_dir: Path) -> str:
    """The wait to expect of a batch: this dataset's finished batches (their median and longest), else
    OpenRouter's published figures."""
    seconds = [
        float(r["seconds"])
        for path in sorted(responses_dir.glob("shard-*.batches.jsonl"))
        for r in jsonl_objects(path)
        if r.get("event") == "finished" and r.get("seconds") is not None
    ]
    if not seconds:
        return f"wait: {PUBLISHED_BATCH_WAIT}"
    return f"wait: median {median(seconds) / 60:.0f} min, longest {max(seconds) / 60:.0f} min of {len(seconds)} batches"


def _dataset_estimate(
    dataset: ApiDataset, results_dir: Path, prices: Prices, spent: dict[str, float], notes: list[str]
) -> tuple[DatasetEstimate, float, Prices]:
    """One dataset's pending work priced (batch price in mode batch), and its expected cost per request."""
    name = dataset.name
    mean_tokens, basis = expected_output_tokens(dataset, spent)
    responses_dir = results_dir / name / "responses"
    charged = prices
    if dataset.settings.mode == "batch":
        charged = batch_prices(prices, dataset.settings, measured_batch_factor(responses_dir, prices))
    phash = dataset.settings.request.params_hash()
    if dataset.shards and dataset.planned_prompts is None:
        raise ValueError(f"dataset {name!r}: the cost preview needs the plan's prompts (aerie.plan.resolve.api_run)")
    prompts_iter = dataset.planned_prompts() if dataset.shards else iter(())  # shard 0 first, plan order
    rows, cut = [], []
    for shard in dataset.shards:
        out = responses_dir / f"shard-{shard.name}.jsonl"
        prompts = list(itertools.islice(prompts_iter, shard.stop - shard.start))
        if out.exists():
            done = read_completion(out)
            if done and done["not_requested"] and _quota_raised(done, dataset.max_output_tokens):
                cut.append(str(out))
            continue
        rows.append(estimate_shard(name, shard.name, prompts, out, phash, mean_tokens, charged))
    if cut:
        # A published shard is never rerun by Snakemake on its own: say how to request the rest.
        notes.append(
            f"datasets.{name}.max_output_tokens was raised after {len(cut)} shard(s) were published "
            f"at the old quota; not counted above. `snakemake --forcerun {' '.join(cut)}` requests "
            "their remaining prompts (journaled samples are not paid again)"
        )
    estimate = estimate_dataset(
        name, rows, mean_tokens, basis, charged, dataset.max_output_tokens, int(spent["completion_tokens"])
    )
    if dataset.settings.mode == "batch":
        estimate.streaming_dollars = estimate.prompt_tokens * prices.input + estimate.output_tokens * prices.output
        estimate.wait = batch_wait(responses_dir)
    pending = sum(r.pending_prompts for r in rows)
    prompt_tokens = sum(r.prompt_tokens for r in rows) / pending if pending else 0.0
    return estimate, expected_sample_cost(spent, mean_tokens, charged, prompt_tokens), charged


def cost_preview(run: ApiRun, results_dir: Path, live: bool = True) -> CostPreview | None:
    """Estimate the pending API work per dataset, cut at each dataset's output-token quota; None when no
    dataset uses an API. ``run``: resolved with the shard plan (aerie.plan.resolve.api_run(config, plans)).

    Pending = training shards whose declared output does not exist yet, minus the samples their
    journals already hold.
    """
    datasets = list(run.datasets)
    if not datasets:
        return None
    spend = run_spend(results_dir, datasets)
    estimates: dict[str, DatasetEstimate] = {}
    expected: dict[str, RequestCosts] = {}  # USD per request, per dataset
    notes: list[str] = []
    shown: list[Prices] = []
    priced: dict[str, Prices] = {}  # one endpoints-API call per distinct model/routing, not per dataset
    for name in datasets:
        s = run.datasets[name].settings
        key = json.dumps(
            [s.backend, s.base_url, s.request.model, s.request.provider, s.live_prices]
            + [s.price_per_million_input_usd, s.price_per_million_output_usd],
            sort_keys=True,
        )
        if key not in priced:
            priced[key] = resolve_prices(s, api_key_from_env(s), live=live and s.live_prices)
        estimate, per_request, charged = _dataset_estimate(
            run.datasets[name], results_dir, priced[key], spend[name], notes
        )
        estimates[name] = estimate
        expected[name] = RequestCosts(per_request, per_request)
        shown += [priced[key], charged]
    spent = sum(s["cost"] for s in spend.values())
    unjournaled, account_line = preview_books(run, datasets, results_dir, expected, live)
    text = format_preview(list(estimates.values()), spent, run.budget_usd, shown, unjournaled, account_line)
    notes += _key_ledger_notes(run, datasets, results_dir)
    text += "".join(f"\n  NOTE {n}" for n in notes)
    words = f"{usd(spent)} {JOURNALED}"
    if unjournaled.total >= 5e-5:
        words += f" + {unjournaled.words()}"
    return CostPreview(
        text,
        sum(e.dollars for e in estimates.values()),
        run.budget_usd,
        spent,
        unjournaled.total,
        estimates,
        words,
    )
