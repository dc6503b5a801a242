"""Rule ``responses`` (API backends): one job per run regenerates every API shard of every dataset.

One owner for one account's limits. A run has one budget, one ``responses.concurrency`` and one quota per dataset,
and they are kept by one process whatever Snakemake schedules (``--cores all``, ``--jobs N``, SLURM): the job
serves every pending API shard through one HTTP session (aerie.responses.api.client.regenerate), so requests in
flight, the budget and each quota are counted in one place, and the overshoot bound of the whole run is the one of
a single client: at most ``concurrency`` x (actual - expected cost per request). One job per shard, as before, let
each of up to 10 shard jobs spend the whole remaining budget and keep ``concurrency`` requests in flight.

Finished work lives in the journals, not in the declared outputs: Snakemake deletes a job's outputs when it
starts again or fails, so a rerun publishes every finished shard again from its journal (nothing is requested
twice) and requests only what is missing. Each shard keeps its own log (declared, attempt-numbered like the job's,
aerie.tools.rulelog); a shard that cannot finish (budget, a dataset's fatal error, samples failing every attempt) does
not stop the others: they are finished and written, and the job then fails naming the unfinished ones (their
outputs wait for the next run, which requests only their missing samples).

At the start the job reads each provider account and enters its results folder in the key's books
(``open_account_books``; aerie.responses.api.key_books): this folder's share of what the account billed beyond every
journal on the key (billed retries, requests lost to interrupted runs) and what requests sent before an
interruption may still add (priced at the expected cost until they settle) count against the budget.

One budget per key across runs: a second run on the same key (another results folder or config) is another
process, so each account's job also keeps an entry in the key's ledger beside the account
(aerie.responses.api.key_ledger, outside the results folder); what the other runs on the key spend and hold counts
against this run's budget, and this run's requests go out only inside leases taken under the ledger's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.formats.prompts import estimate_prompt_tokens, read_prompts
from aerie.responses.api.backends import batch_provider, provider_refusal
from aerie.responses.api.batches import BatchLaneState
from aerie.responses.api.books import (
    AccountOfFolder,
    account_ledger_path,
    append_folder_books,
    carried_from_older_ledger,
    dataset_weights,
    read_folder_books,
    sum_weights,
)
from aerie.responses.api.client import Lane, RegenerationStopped, ShardWork, regenerate
from aerie.responses.api.journal import journal_path, read_journal
from aerie.responses.api.key_ledger import KeyLedger, key_ledger_path, run_label
from aerie.responses.api.money import (
    JOURNALED,
    RequestCosts,
    Unjournaled,
    api_key_from_env,
    batch_prices,
    expected_output_tokens,
    expected_sample_cost,
    measured_batch_factor,
    most_request_cost,
    resolve_prices,
    run_spend,
    usd,
)
from aerie.responses.api.prices import ceiling_price
from aerie.responses.api.settings import ApiRun, ResponsesSettings, TargetSettings
from aerie.responses.api.spend import KeyAccount, MoneyGuard, RunSpend
from aerie.target_model.chat import read_chat_format, split_generated
from aerie.target_model.model import load_tokenizer, pick_device, read_generation_config
from aerie.target_model.serve import serve_on_loopback, transformers_serve_command
from aerie.target_model.template import render_prompt_ids
from aerie.tools.progress import JobProgress, job_progress
from aerie.tools.rulelog import attempt_logs, keep_attempt_log


class ProgressSpend(RunSpend):
    """The run's spend, moving the job's progress too: the client calls ``add`` once per answered, journaled
    sample, so the progress line counts samples (rate, ETA)."""

    def __init__(self, *args: Any, progress: JobProgress, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.progress = progress

    def add(self, account: str | None, cost: float) -> None:
        super().add(account, cost)
        self.progress.update(1)


def account_headers(settings: ResponsesSettings, api_key: str | None) -> dict[str, str]:
    headers = dict(settings.request.extra_headers or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def open_account_books(
    run: ApiRun,
    account: str,
    results_dir: Path,
    costs: dict[str, RequestCosts],
    api_key: str | None,
    ledger: KeyLedger,
    job: str,
    log: Callable[[str], None],
) -> KeyAccount | None:
    """At the job's start: read the account, enter the folder in the key's books and reconcile (this folder's share
    of what the account billed beyond every journal on the key: billed retries, lost requests, and requests sent
    before an interruption priced until billed), record the reading in the folder's account ledger. Stops
    (RuntimeError) when the key's own limit is exhausted. No usage figure from the provider: None (the budget counts
    the journals only)."""
    mine = run.account_datasets(account)
    settings = run.datasets[mine[0]].settings
    api = settings.api
    try:
        reading = api.read_account(settings.base_url, api_key, settings.api_key_env)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; nothing was requested") from None
    if reading is None or api.account_url(settings.base_url) is None:
        log("the account gave no usage figure: the books are the journals only, and so is the budget")
        return None
    path = account_ledger_path(results_dir)
    where = AccountOfFolder(account, api.name, settings.base_url, settings.api_key_env, settings.settle_s)
    journal = sum(run_spend(results_dir, mine)[d]["cost"] for d in mine)
    joined = ledger.join(journal, carried_from_older_ledger(read_folder_books(path, account)))
    since = joined - settings.settle_s  # requests sent this long before joining may be billed after the baseline
    weights = sum_weights(
        [
            dataset_weights(results_dir / d / "responses", costs[d], run.datasets[d].settings.settle_s, since)
            for d in mine
        ]
    )
    attribution = ledger.reconcile(reading.usage, journal, weights)
    share = attribution.shares[ledger.label] if attribution else None
    mine_costs = {d: costs[d] for d in mine}
    append_folder_books(path, where, "start", job, journal, attribution, share, weights, mine_costs)
    parts = Unjournaled(share.retries, share.lost, 0.0, share.pending) if share else Unjournaled()
    log(
        f"account ({reading.endpoint}): usage {usd(reading.usage)}, limit {reading.limit}, remaining "
        f"{reading.limit_remaining}; this folder: {usd(journal)} {JOURNALED} + {parts.words()}"
        + (
            f"; the key's books: {len(attribution.shares)} results folder(s), {usd(attribution.unattributed)} billed "
            "that no request of any run explains"
            if attribution
            else ""
        )
    )
    if reading.limit_remaining is not None and float(reading.limit_remaining) <= 0:
        raise RuntimeError("the API key has no limit remaining (GET /key); raise its limit; nothing was requested")

    def record(attr, share, weights, journal) -> None:
        append_folder_books(path, where, "poll", job, journal, attr, share, weights, mine_costs)

    return KeyAccount(
        ledger,
        api.account_url(settings.base_url),
        api.usage_of,
        weights,
        attribution,
        record,
        headers=account_headers(settings, api_key),
        ca_bundle=settings.limits.ca_bundle,
    )


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


@dataclass(frozen=True)
class ApiShardTask:
    """One API shard of the job: its dataset, prompts shard, output, and own log (None: the job's log only)."""

    dataset: str
    prompts: Path
    out: Path
    log: Path | None = None


def open_shard_log(path: Path) -> Callable[[str], None]:
    """A shard's own log in the job of every shard: a declared log of the job, so Snakemake deletes it when the job
    starts again; like a rule's log (aerie.tools.rulelog) each attempt keeps a numbered second name of it, announced
    in its first line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    attempt, linked = keep_attempt_log(path)
    names = [path] if linked is not None else [path, path.with_name(f"{path.stem}.attempt-{attempt}{path.suffix}")]

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}\n"
        for name in names:
            with open(name, "a", encoding="utf-8") as f:
                f.write(line)

    earlier = [p.name for n, p in attempt_logs(path).items() if n < attempt]
    log(
        f"attempt {attempt} (pid {os.getpid()} on {socket.gethostname()}); this log is kept as "
        f"{path.stem}.attempt-{attempt}{path.suffix}" + (f"; earlier attempts: {', '.join(earlier)}" if earlier else "")
    )
    return log


def _sglang_ids(target: TargetSettings) -> tuple[Callable, Callable, list[int]]:
    """The sglang backend sends ids rendered by the target's template and splits the answer's ids at its markers."""
    tok = load_tokenizer(target.path, target.trust_remote_code)
    fmt = read_chat_format(tok, read_generation_config(target.path))

    def render_ids(messages, tools=None):
        return render_prompt_ids(tok, messages, tools=tools)

    def split_ids(ids):
        return split_generated(tok, ids, fmt)

    return render_ids, split_ids, list(fmt.stop_ids)


def _server(run: ApiRun, datasets: list[str], log_path: Path):
    """One loopback server for every dataset that asks the rule to serve the target (``responses.serve``)."""
    if not any(run.datasets[d].settings.served for d in datasets):
        return contextlib.nullcontext(None)

    target = run.target
    device = str(pick_device(target.device))
    return serve_on_loopback(
        lambda port: transformers_serve_command(
            target.path, port, device=device, trust_remote_code=target.trust_remote_code
        ),
        "/health",
        log_path,
    )


@dataclass
class Priced:
    """What the job priced per dataset: the money guards of the datasets with work, every dataset's request
    costs (the key's books weigh requests that may be billed unseen with them), the batch lanes' states."""

    guards: dict[str, MoneyGuard]
    costs: dict[str, RequestCosts]
    batches: dict[str, BatchLaneState]


def _price_dataset(
    run: ApiRun,
    d: str,
    key: str | None,
    prompts: list[dict[str, Any]],
    spent: dict[str, float],
    responses_dir: Path,
    log: Callable[[str], None],
) -> tuple[MoneyGuard, RequestCosts, BatchLaneState | None]:
    """One dataset's prices, expected and most cost per request, and in mode batch its batch lane (the provider
    settings mapped to one provider per batch, or refused naming the setting: before any request)."""
    dataset = run.datasets[d]
    s = dataset.settings
    live = s.api.endpoints(s.request, key) if s.live_prices else None
    prices = resolve_prices(s, key, live=s.live_prices)
    ceiling = (ceiling_price(live, s.request.provider or {}) if live else None) or prices
    mean_tokens, basis = expected_output_tokens(dataset, spent)
    prompt_tokens = sum(estimate_prompt_tokens(p["messages"]) for p in prompts) / len(prompts) if prompts else 0.0
    batch = None
    charged, most_factor = prices, 1.0
    if s.mode == "batch":
        if why := provider_refusal(s.request.provider):
            raise RuntimeError(f"datasets.{d}: responses.provider.{why}; nothing was requested")
        only, words = batch_provider(s.request.provider, live)
        measured = measured_batch_factor(responses_dir, prices)
        charged = batch_prices(prices, s, measured)
        most_factor = measured if measured is not None else 1.0
        batch = BatchLaneState(s.batch, only, prices)
        log(f"{d}: batches of {s.batch.size} to {s.request.model}, provider {words}; price {charged.source}")
    expected = expected_sample_cost(spent, mean_tokens, charged, prompt_tokens)
    most = most_request_cost(prompt_tokens, s.request.max_new_tokens, ceiling) * most_factor
    log(
        f"{d}: price {charged.per_million} ({charged.source}); expected {mean_tokens:.0f} output tokens ({basis}), "
        f"{usd(expected)} per request, at most {usd(most)}; {usd(spent['cost'])} {JOURNALED} so far"
    )
    guard = MoneyGuard(
        budget_usd=run.budget_usd,
        expected_cost=expected,
        most_cost=most,
        token_cap=dataset.max_output_tokens,
        tokens_before=int(spent["completion_tokens"]),
        expected_tokens=mean_tokens,
    )
    return guard, RequestCosts(expected, most), batch


def _price_requests(
    run: ApiRun,
    by_dataset: dict[str, list[ApiShardTask]],
    keys: dict[str, str | None],
    prompts: dict[Path, list[dict[str, Any]]],
    spend: dict[str, dict[str, float]],
    results_dir: Path,
    log: Callable[[str], None],
) -> Priced:
    """Per dataset with work: its money guard (budget, quota) and request costs; per dataset without: the costs its
    requests that may still be billed are weighed at (its journals' mean, else the most any dataset expects)."""
    priced = Priced({}, {}, {})
    for d in by_dataset:
        mine = [p for t in by_dataset[d] for p in prompts[t.out]]
        guard, costs, batch = _price_dataset(run, d, keys[d], mine, spend[d], results_dir / d / "responses", log)
        priced.guards[d], priced.costs[d] = guard, costs
        if batch is not None:
            priced.batches[d] = batch
    fallback = max(priced.costs.values(), key=lambda c: c.expected, default=RequestCosts(0.0, 0.0))
    for d in run.datasets:
        if d not in priced.costs:
            done = spend[d]
            mean = done["cost"] / done["samples"] if done["samples"] else fallback.expected
            priced.costs[d] = RequestCosts(mean, max(mean, fallback.most))
    return priced


def regenerate_api_shards(
    tasks: list[ApiShardTask],
    run: ApiRun,
    results_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[Path, dict[str, Any] | str]:
    """Run every API shard of ``tasks`` in one process: per shard output, its summary (published) or why it is not
    finished. ``run``: the run's API settings as the planning layer resolved them (aerie.plan.resolve.api_run);
    ``results_dir``: where every dataset's journals are; by default the one the outputs lie in."""
    if not tasks:
        return {}
    if results_dir is None:
        dirs = {responses_results_dir(t.out, t.dataset) for t in tasks}
        if len(dirs) > 1:
            raise ValueError(f"the API shards of one job lie in several results folders: {sorted(map(str, dirs))}")
        results_dir = dirs.pop()
    datasets = list(run.datasets)
    by_dataset: dict[str, list[ApiShardTask]] = {}
    for t in tasks:
        run.dataset(t.dataset)  # refuses a dataset not regenerated through an API
        by_dataset.setdefault(t.dataset, []).append(t)
    keys = {d: api_key_from_env(run.datasets[d].settings) for d in datasets}
    for d in by_dataset:
        s = run.datasets[d].settings
        if s.api.needs_key and not keys[d]:
            raise RuntimeError(
                f"responses.api_key_env: environment variable ${s.api_key_env} is not set "
                "(the key is read from the environment only)"
            )
    prompts = {t.out: read_prompts(t.prompts) for t in tasks}
    spend = run_spend(results_dir, datasets)
    priced = _price_requests(run, by_dataset, keys, prompts, spend, results_dir, log)

    accounts = {run.datasets[d].account for d in datasets}
    before = {a: sum(spend[d]["cost"] for d in run.account_datasets(a)) for a in accounts}
    job = f"responses ({len(tasks)} shards)"
    spending = sorted({run.datasets[d].account for d in by_dataset} - {None})
    # The key ledgers open before the accounts are read: another run's spend from then on is counted from the
    # ledger, and the key's books attribute the account's spend beyond every journal to the folders.
    ledgers = open_key_ledgers(run, spending, keys, results_dir, log)
    run_spend_now: ProgressSpend | None = None
    with close_key_ledgers(ledgers, lambda a: run_spend_now.now.get(a, 0.0) if run_spend_now else 0.0):
        books = {}
        for a in spending:
            key = keys[next(d for d in by_dataset if run.datasets[d].account == a)]
            if a in ledgers and (
                opened := open_account_books(run, a, results_dir, priced.costs, key, ledgers[a], job, log)
            ):
                books[a] = opened
        done = sum(
            len(read_journal(journal_path(t.out), run.datasets[t.dataset].settings.request.params_hash()).finished)
            for t in tasks
        )
        total = sum(len(p) for p in prompts.values())
        progress = job_progress("responses", total, unit="sample", log=log, initial=done)
        run_spend_now = ProgressSpend(before, books, keys=ledgers, progress=progress)
        log(f"spent so far: {run_spend_now.words()} = {usd(run_spend_now.spent())}")
        results = _regenerate_lanes(run, by_dataset, priced, keys, prompts, run_spend_now, results_dir, log)
    progress.close()
    log(f"spent: {run_spend_now.words()} = {usd(run_spend_now.spent())}")
    return results


def open_key_ledgers(
    run: ApiRun, accounts: list[str], keys: dict[str, str | None], results_dir: Path, log: Callable[[str], None]
) -> dict[str, KeyLedger]:
    """Per account this job spends from with a key, on a backend that keeps the key ledger: this run's entry in
    the key's ledger (aerie.responses.api.key_ledger)."""
    ledgers = {}
    label = run_label(results_dir)
    for a in accounts:
        d = next((d for d in run.account_datasets(a) if keys.get(d)), None)
        if d is None or not run.datasets[d].settings.api.key_ledger:
            continue
        s = run.datasets[d].settings
        ledgers[a] = KeyLedger(key_ledger_path(s.base_url, keys[d]), label=label, settle_s=s.settle_s, log=log)
        ledgers[a].open()
    return ledgers


@contextlib.contextmanager
def close_key_ledgers(ledgers: dict[str, KeyLedger], spent_of: Callable[[str], float]):
    """Leave the key ledgers when the job ends: cleanly (the entries go) when the lanes finished; on an error or
    an interrupt the entries stay, holding nothing but what may still be in flight (priced at the lease: a
    killed job's answers may still be billed), until the process is gone and its requests have settled."""
    clean = False
    try:
        yield
        clean = True
    finally:
        for a, ledger in ledgers.items():
            mine = spent_of(a)  # journaled by this job on the account
            ledger.close(clean, mine, 0.0 if clean else max(0.0, ledger.lease - mine))


def _regenerate_lanes(
    run: ApiRun,
    by_dataset: dict[str, list[ApiShardTask]],
    priced: Priced,
    keys: dict[str, str | None],
    prompts: dict[Path, list[dict[str, Any]]],
    spend: RunSpend,
    results_dir: Path,
    log: Callable[[str], None],
) -> dict[Path, dict[str, Any] | str]:
    """Every dataset's lane, through the run's own server where a dataset asks for one."""
    ids = any(run.datasets[d].settings.api.sends_token_ids for d in by_dataset)
    render_ids, split_ids, eos_ids = _sglang_ids(run.target) if ids else (None, None, None)
    with _server(run, list(by_dataset), results_dir / "logs" / "responses.server.log") as base:
        if base:
            log(f"transformers serve ready at {base}")
        lanes = []
        for d, mine in by_dataset.items():
            dataset = run.datasets[d]
            s = dataset.settings
            request = s.request
            if s.served:  # the rule's own server, at the address it got
                request = dataclasses.replace(request, base_url=f"{base}/v1")
            by_ids = s.api.sends_token_ids
            lanes.append(
                Lane(
                    dataset=d,
                    settings=request,
                    shards=[ShardWork(prompts[t.out], t.out, open_shard_log(t.log) if t.log else None) for t in mine],
                    limits=s.limits,
                    guard=priced.guards[d],
                    api_key=keys[d],
                    account=dataset.account,
                    want_reasoning=s.require_reasoning,
                    render_ids=render_ids if by_ids else None,
                    split_ids=split_ids if by_ids else None,
                    eos_ids=eos_ids if by_ids else None,
                    batch=priced.batches.get(d),
                )
            )
        return asyncio.run(
            regenerate(
                lanes,
                concurrency=run.concurrency,
                spend=spend,
                progress_interval=run.progress_interval_s,
                progress=getattr(spend, "progress", None),
                log=log,
            )
        )


def regenerate_api_shard(
    prompts_path: Path,
    out_path: Path,
    run: ApiRun,
    dataset: str,
    results_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One API shard alone through the job's path (benches, tests); raises RegenerationStopped when unfinished."""
    result = regenerate_api_shards([ApiShardTask(dataset, prompts_path, out_path)], run, results_dir, log)[out_path]
    if isinstance(result, str):
        raise RegenerationStopped(result)
    return result


def run_api_responses_job(
    tasks: list[ApiShardTask], run: ApiRun, log: Callable[[str], None] = print
) -> dict[Path, dict[str, Any]]:
    """Rule ``responses``: ``regenerate_api_shards``; when a shard is left unfinished (budget, a fatal error,
    failed requests, the key's limit) the job ends with the reasons, logged and as its exit message, after the
    other shards were finished and written."""
    try:
        results = regenerate_api_shards(tasks, run, log=log)
    except (RegenerationStopped, RuntimeError) as e:
        log(f"responses: nothing finished: {e}")
        raise SystemExit(f"responses: {e}") from None
    unfinished = {out: why for out, why in results.items() if isinstance(why, str)}
    if unfinished:
        reasons = sorted(set(unfinished.values()))
        log(f"responses: {len(unfinished)} of {len(results)} shards not finished: " + " | ".join(reasons))
        raise SystemExit(
            f"responses: {len(unfinished)} of {len(results)} shards not finished "
            f"({', '.join(str(p) for p in sorted(unfinished)[:5])}{' ...' if len(unfinished) > 5 else ''}): "
            + " | ".join(reasons)
        )
    return results
