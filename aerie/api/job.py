"""Rule ``responses`` (API backends): one job per run regenerates every API shard of every dataset.

One owner for one account's limits. A run has one budget, one ``responses.concurrency`` and one quota per dataset,
and they are kept by one process whatever Snakemake schedules (``--cores all``, ``--jobs N``, SLURM): the job
serves every pending API shard through one HTTP session (aerie.api.client.regenerate), so requests in flight, the
budget and each quota are counted in one place, and the overshoot bound of the whole run is the one of a single
client: at most ``concurrency`` x (actual - expected cost per request). One job per shard, as before, let each of
up to 10 shard jobs spend the whole remaining budget and keep ``concurrency`` requests in flight
(docs/formats.md, "Account ledger", says why the journals and the account cannot share live limits between
processes: they are seen only after the fact).

Finished work lives in the journals, not in the declared outputs: Snakemake deletes a job's outputs when it
starts again or fails, so a rerun publishes every finished shard again from its journal (nothing is requested
twice) and requests only what is missing. Each shard keeps its own log (declared, attempt-numbered like the job's,
aerie.rulelog); a shard that cannot finish (budget, a dataset's fatal error, samples failing every attempt) does
not stop the others: they are finished and written, and the job then fails naming the unfinished ones (their
outputs wait for the next run, which requests only their missing samples).

At the start the job reconciles each provider account with the journals (``start_account``): what the account
billed beyond them (billed retries, requests lost to interrupted runs) and what requests sent before an
interruption may still add (priced at the expected cost until they settle) count against the budget.

One budget per key across runs: a second run on the same key (another results folder or config) is another
process, so each account's job also keeps an entry in the key's ledger beside the account (aerie.api.key_ledger,
outside the results folder); what the other runs on the key spend and hold counts against this run's budget, and
this run's requests go out only inside leases taken under the ledger's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.api.client import (
    AccountWatcher,
    ClientLimits,
    Lane,
    MoneyGuard,
    RegenerationStopped,
    RunSpend,
    ShardWork,
    regenerate,
)
from aerie.api.journal import journal_path, read_journal
from aerie.api.key_ledger import KeyLedger, key_ledger_path, run_label
from aerie.api.money import (
    ACCOUNT_LAG_S,
    JOURNALED,
    AccountMoney,
    Prices,
    account_key_url,
    account_ledger_path,
    account_money,
    api_key_from_env,
    append_account_ledger,
    dataset_requests,
    estimate_prompt_tokens,
    expected_sample_cost,
    mean_output_tokens,
    read_account_ledger,
    read_account_usage,
    resolve_prices,
    run_spend,
    usd,
)
from aerie.api.settings import ApiRun, TargetSettings
from aerie.formats.prompts import read_prompts
from aerie.progress import JobProgress, job_progress
from aerie.rulelog import attempt_logs, keep_attempt_log


class ProgressSpend(RunSpend):
    """The run's spend, moving the job's progress too: the client calls ``add`` once per answered, journaled
    sample, so the progress line counts samples (rate, ETA) and shows the run's dollars."""

    def __init__(self, *args: Any, progress: JobProgress, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.progress = progress

    def add(self, account: str | None, cost: float) -> None:
        super().add(account, cost)
        self.progress.postfix(spent=usd(self.spent()))
        self.progress.update(1)


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


def settle_seconds(responses: dict[str, Any]) -> float:
    """After this long a request sent has been answered or given up, and billed if it ever will be."""
    return float(responses["read_timeout_s"]) + ACCOUNT_LAG_S


def account_headers(responses: dict[str, Any], api_key: str | None) -> dict[str, str]:
    headers = dict(responses.get("extra_headers") or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def start_account(
    run: ApiRun,
    account: str,
    results_dir: Path,
    expected_cost: dict[str, float],
    api_key: str | None,
    job: str,
    log: Callable[[str], None],
) -> tuple[AccountMoney | None, AccountWatcher | None]:
    """At the job's start: read the account's usage, reconcile it with the journals, record the reading.

    What the account billed since the run's first start beyond the journals' growth is money no journal holds
    (billed retries, requests lost to interrupted runs); requests sent before an interruption and not settled yet
    (aerie.api.journal.request_tally) are priced at ``expected_cost`` of their dataset on top, until the account
    shows as much. All of it counts against the budget. Stops (RuntimeError) when the key's own limit is
    exhausted. No usage figure from the provider: (None, None)."""
    mine = run.account_datasets(account)
    responses = run.datasets[mine[0]].responses
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
    journals = sum(s["cost"] for s in run_spend(results_dir, mine).values())
    requests = {
        d: dataset_requests(results_dir / d / "responses", expected_cost[d], settle_seconds(run.datasets[d].responses))
        for d in mine
    }
    money = account_money(ledger, live["usage"], journals, requests)
    append_account_ledger(ledger_path, account, "start", job, live["usage"], journals, money.lost, mine)
    log(
        f"account ({live['endpoint']}): usage {usd(live['usage'])}, limit {live['limit']}, remaining "
        f"{live['limit_remaining']}; since the run's first start {usd(money.usage - money.baseline_usage)} billed, "
        f"{usd(money.journal - money.baseline_journal)} {JOURNALED}; beyond the journals: "
        f"{money.unjournaled.words()}"
    )
    remaining = live["limit_remaining"]
    if remaining is not None and float(remaining) <= 0:
        raise RuntimeError("the API key has no limit remaining (GET /key); raise its limit; nothing was requested")

    def record(usage: float, journal: float, lost: float) -> None:
        append_account_ledger(ledger_path, account, "poll", job, usage, journal, lost, mine)

    watcher = AccountWatcher(
        account_key_url(responses),
        money.baseline_usage,
        money.baseline_journal,
        record,
        floor=money.billed_unjournaled,
        pending=money.pending,
        headers=account_headers(responses, api_key),
        ca_bundle=responses.get("ca_bundle"),
        weights=money.weights,
    )
    return money, watcher


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
    starts again; like a rule's log (aerie.rulelog) each attempt keeps a numbered second name of it, announced
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
    from aerie.responses import split_generated
    from aerie.target_model.chat import read_chat_format
    from aerie.target_model.model import load_tokenizer, read_generation_config
    from aerie.target_model.template import render_prompt_ids

    tok = load_tokenizer(target.path, target.trust_remote_code)
    fmt = read_chat_format(tok, read_generation_config(target.path))

    def render_ids(messages, tools=None):
        return render_prompt_ids(tok, messages, tools=tools)

    def split_ids(ids):
        return split_generated(tok, ids, fmt)

    return render_ids, split_ids, list(fmt.stop_ids)


def _server(run: ApiRun, datasets: list[str], log_path: Path):
    """One loopback server for every dataset that asks the rule to serve the target (``responses.serve``)."""
    if not any(run.datasets[d].served for d in datasets):
        return contextlib.nullcontext(None)
    from aerie.api.serve import serve_on_loopback, transformers_serve_command
    from aerie.target_model.model import pick_device

    target = run.target
    device = str(pick_device(target.device))
    return serve_on_loopback(
        lambda port: transformers_serve_command(
            target.path, port, device=device, trust_remote_code=target.trust_remote_code
        ),
        "/health",
        log_path,
    )


def _price_requests(
    run: ApiRun,
    by_dataset: dict[str, list[ApiShardTask]],
    keys: dict[str, str | None],
    prompts: dict[Path, list[dict[str, Any]]],
    spend: dict[str, dict[str, float]],
    log: Callable[[str], None],
) -> tuple[dict[str, MoneyGuard], dict[str, float]]:
    """Per dataset with work: its money guard (budget, quota) and the expected cost of a request; per dataset
    without: the expected cost its requests that may still be billed are priced at."""
    # one endpoints-API call per distinct routing
    priced: dict[str, Prices] = {}
    guards: dict[str, MoneyGuard] = {}
    expected: dict[str, float] = {}
    for d in by_dataset:
        responses = run.datasets[d].responses
        key = json.dumps([responses.get(k) for k in ("backend", "base_url", "model", "provider")], sort_keys=True)
        if key not in priced:
            priced[key] = resolve_prices(responses, keys[d], live=responses["live_prices"])
        prices = priced[key]
        mean_tokens, basis = mean_output_tokens(responses, spend[d], run.datasets[d].described)
        mine = [p for t in by_dataset[d] for p in prompts[t.out]]
        prompt_tokens = sum(estimate_prompt_tokens(p["messages"]) for p in mine) / len(mine) if mine else 0.0
        expected[d] = expected_sample_cost(spend[d], mean_tokens, prices, prompt_tokens)
        guards[d] = MoneyGuard(
            budget_usd=responses.get("budget_usd"),
            expected_cost=expected[d],
            token_cap=run.datasets[d].max_output_tokens,
            tokens_before=int(spend[d]["completion_tokens"]),
            expected_tokens=mean_tokens,
        )
        log(
            f"{d}: price {prices.input * 1e6:.3f}/{prices.output * 1e6:.3f} USD per M in/out ({prices.source}); "
            f"expected {mean_tokens:.0f} output tokens ({basis}), {usd(expected[d])} per request; "
            f"{usd(spend[d]['cost'])} {JOURNALED} so far"
        )
    # A finished dataset's requests that may still be billed are priced at its journals' mean (else the most any
    # dataset of the job expects).
    for d in run.datasets:
        if d not in expected:
            done = spend[d]
            expected[d] = done["cost"] / done["samples"] if done["samples"] else max(expected.values(), default=0.0)

    return guards, expected


def regenerate_api_shards(
    tasks: list[ApiShardTask],
    run: ApiRun,
    results_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[Path, dict[str, Any] | str]:
    """Run every API shard of ``tasks`` in one process: per shard output, its summary (published) or why it is not
    finished. ``run``: the run's API settings as the planning layer resolved them (aerie.plan.api_run);
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
    keys = {d: api_key_from_env(run.datasets[d].responses) for d in datasets}
    for d in by_dataset:
        responses = run.datasets[d].responses
        if responses["backend"] == "openrouter" and not keys[d]:
            raise RuntimeError(
                f"responses.api_key_env: environment variable ${responses['api_key_env']} is not set "
                "(the key is read from the environment only)"
            )
    prompts = {t.out: read_prompts(t.prompts) for t in tasks}
    spend = run_spend(results_dir, datasets)

    guards, expected = _price_requests(run, by_dataset, keys, prompts, spend, log)

    # Every account's spend: the journals of its datasets, and what only the account saw (reconciled now, for the
    # accounts this job spends from: their keys are here).
    accounts = {run.datasets[d].account for d in datasets}
    before = {a: sum(spend[d]["cost"] for d in run.account_datasets(a)) for a in accounts}
    watchers = {}
    job = f"responses ({len(tasks)} shards)"
    spending = sorted({run.datasets[d].account for d in by_dataset} - {None})
    # The key ledgers open before the accounts are read: another run's spend from then on is counted from the
    # ledger, and what it publishes after the reading is taken out of the account's growth (counted once).
    ledgers = open_key_ledgers(run, spending, keys, results_dir, log)
    run_spend_now: ProgressSpend | None = None
    with close_key_ledgers(ledgers, lambda a: run_spend_now.now.get(a, 0.0) if run_spend_now else 0.0):
        for a in spending:
            key = keys[next(d for d in by_dataset if run.datasets[d].account == a)]
            _, watcher = start_account(run, a, results_dir, expected, key, job, log)
            if watcher is not None:
                watchers[a] = watcher
                if a in ledgers:
                    read = ledgers[a].refresh().spent
                    watcher.others_spent = lambda ledger=ledgers[a], read=read: ledger.others.spent - read
        done = sum(
            len(read_journal(journal_path(t.out), run.datasets[t.dataset].settings.params_hash()).finished)
            for t in tasks
        )
        total = sum(len(p) for p in prompts.values())
        progress = job_progress("responses", total, unit="sample", log=log, initial=done)
        run_spend_now = ProgressSpend(before, watchers, keys=ledgers, progress=progress)
        log(f"spent so far: {run_spend_now.words()} = {usd(run_spend_now.spent())}")
        results = _regenerate_lanes(run, by_dataset, guards, keys, prompts, run_spend_now, results_dir, log)
    progress.close()
    log(f"spent: {run_spend_now.words()} = {usd(run_spend_now.spent())}")
    return results


def open_key_ledgers(
    run: ApiRun, accounts: list[str], keys: dict[str, str | None], results_dir: Path, log: Callable[[str], None]
) -> dict[str, KeyLedger]:
    """Per account this job spends from with a key: this run's entry in the key's ledger (aerie.api.key_ledger)."""
    ledgers = {}
    label = run_label(results_dir)
    for a in accounts:
        d = next(d for d in run.account_datasets(a) if keys.get(d))
        responses = run.datasets[d].responses
        path = key_ledger_path(responses["base_url"], keys[d])
        ledgers[a] = KeyLedger(path, label=label, settle_s=settle_seconds(responses), log=log)
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
    guards: dict[str, MoneyGuard],
    keys: dict[str, str | None],
    prompts: dict[Path, list[dict[str, Any]]],
    spend: RunSpend,
    results_dir: Path,
    log: Callable[[str], None],
) -> dict[Path, dict[str, Any] | str]:
    """Every dataset's lane, through the run's own server where a dataset asks for one."""
    sglang = any(run.datasets[d].backend == "sglang" for d in by_dataset)
    render_ids, split_ids, eos_ids = _sglang_ids(run.target) if sglang else (None, None, None)
    with _server(run, list(by_dataset), results_dir / "logs" / "responses.server.log") as base:
        if base:
            log(f"transformers serve ready at {base}")
        lanes = []
        for d, mine in by_dataset.items():
            dataset = run.datasets[d]
            responses = dataset.responses
            settings = dataset.settings
            if dataset.served:  # the rule's own server, at the address it got
                settings = dataclasses.replace(settings, base_url=f"{base}/v1")
            lanes.append(
                Lane(
                    dataset=d,
                    settings=settings,
                    shards=[ShardWork(prompts[t.out], t.out, open_shard_log(t.log) if t.log else None) for t in mine],
                    limits=client_limits(responses),
                    guard=guards[d],
                    api_key=keys[d],
                    account=dataset.account,
                    want_reasoning=responses["require_reasoning"],
                    render_ids=render_ids if responses["backend"] == "sglang" else None,
                    split_ids=split_ids if responses["backend"] == "sglang" else None,
                    eos_ids=eos_ids if responses["backend"] == "sglang" else None,
                )
            )
        return asyncio.run(
            regenerate(
                lanes,
                concurrency=run.concurrency,
                spend=spend,
                progress_interval=run.progress_interval_s,
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
