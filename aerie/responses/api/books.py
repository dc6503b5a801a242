"""A results folder's books: its journals, and its share of what the account billed beyond every journal on its key.

The share is attributed key-wide (aerie.responses.api.key_books) in the key's ledger; each job of the folder also
appends what the attribution said at each of its account readings to the folder's own account ledger
(``results/api_account.jsonl``, format :data:`ACCOUNT_FORMAT`, docs/formats.md), so that the report and the preview
can tell the folder's money without the key. With the key they recompute the attribution from the key's ledger and
a live reading: what other runs did on the key since (a killed run's requests billed later, a second run's spend)
then lands in the right folder.

:func:`folder_money` is that view (the preview and the report); :func:`spend_story` is the report's figure.
Parse-time safe: no aiohttp, no torch.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.formats.responses import is_in_process
from aerie.responses.api.backends import api_backend, backend_of_account
from aerie.responses.api.journal import dataset_journal_totals, journal_path, jsonl_objects, request_tally
from aerie.responses.api.key_books import Attribution, FolderBooks, FolderShare, Weights, attribute
from aerie.responses.api.key_ledger import (
    STALE_S,
    key_ledger_path,
    pid_alive,
    read_key_ledger,
    run_label,
    settle_dead_run,
)
from aerie.responses.api.money import RequestCosts, Unjournaled, usd
from aerie.responses.api.settings import ACCOUNT_LAG_S

ACCOUNT_FORMAT = "aerie.api-account/2"
OLD_ACCOUNT_FORMAT = "aerie.api-account/1"  # before per-folder books: the account's growth since the first start


def account_ledger_path(results_dir: Path) -> Path:
    """``results/api_account.jsonl``: the folder's books at every account reading of its jobs."""
    return Path(results_dir) / "api_account.jsonl"


# ---- the weights of a folder's requests (its intents logs) -----------------------------------------------------------


def dataset_weights(responses_dir: Path, costs: RequestCosts, settle_s: float, since: float) -> Weights:
    """What a dataset's requests sent since ``since`` may have cost beyond its journals, from every shard's intents
    log: billable failures (billed retries) and requests unanswered when their process died (lost; pending until
    their settle time), each at the expected and the most cost of a request."""
    w = Weights()
    for intents in sorted(Path(responses_dir).glob("shard-*.intents.jsonl")):
        tally = request_tally(intents.with_name(intents.name.replace(".intents.jsonl", ".jsonl")))
        failures = [t for t in tally.billable if t >= since]
        w.retries += len(failures) * costs.expected
        w.retries_max += len(failures) * costs.most
        for t in tally.unanswered:
            if t >= since:
                w.lost += costs.expected
                w.lost_max += costs.most
                w.add_unsettled(t + settle_s, costs.expected)
    return w


def sum_weights(parts: list[Weights]) -> Weights:
    total = Weights()
    for w in parts:
        for name in ("retries", "retries_max", "lost", "lost_max", "in_flight", "in_flight_max"):
            setattr(total, name, getattr(total, name) + getattr(w, name))
        for until, c in w.unsettled:
            total.add_unsettled(until - 1e-9, c)
    return total


def split_share(share: FolderShare, weights: dict[str, Weights]) -> dict[str, Unjournaled]:
    """A folder's share split between its datasets in proportion to their weights (retries by the retries'
    weights, lost and pending by the lost requests')."""
    out = {}
    retry_w = sum(w.retries for w in weights.values())
    lost_w = sum(w.lost for w in weights.values())
    for d, w in weights.items():
        out[d] = Unjournaled(
            retries=share.retries * w.retries / retry_w if retry_w else 0.0,
            lost=share.lost * w.lost / lost_w if lost_w else 0.0,
            pending=share.pending * w.lost / lost_w if lost_w else 0.0,
        )
    if not retry_w and share.retries and weights:  # carried from an older ledger: named on the first dataset
        out[next(iter(out))].retries += share.retries
    if not lost_w and share.lost and weights:
        out[next(iter(out))].lost += share.lost
    return out


# ---- the folder's account ledger ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AccountOfFolder:
    """Which account a folder's datasets spend from and how to read it (no key: only the variable's name)."""

    account: str
    backend: str
    base_url: str
    api_key_env: str
    settle_s: float


def append_folder_books(
    path: Path,
    where: AccountOfFolder,
    event: str,
    job: str,
    journal: float,
    attribution: Attribution | None,
    share: FolderShare | None,
    weights: Weights,
    costs: dict[str, RequestCosts],
) -> None:
    """One reading of the folder's books, appended with a single write (docs/formats.md, Account ledger)."""
    share = share or FolderShare()
    record = {
        "format": ACCOUNT_FORMAT,
        "account": where.account,
        "backend": where.backend,
        "base_url": where.base_url,
        "api_key_env": where.api_key_env,
        "settle_s": where.settle_s,
        "event": event,
        "job": job,
        "label": run_label(path.parent),
        "t": round(time.time(), 3),
        "usage": attribution.usage if attribution else None,
        "journal": round(journal, 9),
        "retries": round(share.retries, 9),
        "lost": round(share.lost, 9),
        "pending": round(share.pending, 9),
        "pending_until": max((u for u, c in weights.unsettled if c > 0), default=0.0),
        "unattributed_on_key": round(attribution.unattributed, 9) if attribution else 0.0,
        "costs": {d: {"expected": c.expected, "most": c.most} for d, c in costs.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_folder_books(path: Path, account: str | None = None) -> list[dict[str, Any]]:
    """The folder's readings (both formats), oldest first, of ``account`` (None: every account)."""
    return [
        r
        for r in jsonl_objects(path)
        if r.get("format") in (ACCOUNT_FORMAT, OLD_ACCOUNT_FORMAT) and (account is None or r.get("account") == account)
    ]


def carried_from_older_ledger(records: list[dict[str, Any]]) -> tuple[float, float]:
    """What an ``aerie.api-account/1`` ledger counted beyond the journals (its last figure, named lost: the older
    format does not split it), for a folder joining a key's books for the first time."""
    old = [r for r in records if r.get("format") == OLD_ACCOUNT_FORMAT]
    return (0.0, float(old[-1].get("lost") or 0.0)) if old else (0.0, 0.0)


# ---- the view: a folder's money now -----------------------------------------------------------------------------


@dataclass
class FolderMoney:
    """A folder's books on one account: what its journals hold and its share of the rest."""

    journal: float
    parts: Unjournaled  # billed retries, lost, pending (unattributed stays 0: it is no folder's)
    by_dataset: dict[str, Unjournaled] = field(default_factory=dict)
    unattributed_on_key: float = 0.0
    folders_on_key: int = 1
    source: str = ""

    @property
    def billed(self) -> float:
        """What the account billed for the folder's requests."""
        return self.journal + self.parts.billed

    def line(self) -> str:
        text = f"this folder {usd(self.billed)} billed ({self.source})"
        if self.folders_on_key > 1:
            text += f"; {self.folders_on_key} results folders share the key, each has its own books"
        if self.unattributed_on_key >= 5e-5:
            text += f"; {usd(self.unattributed_on_key)} billed on the key that no request of any run explains"
        return text


def _dead(entry: dict[str, Any], now: float) -> bool:
    if entry.get("host") == socket.gethostname() and not pid_alive(int(entry.get("pid") or 0)):
        return True
    return now - float(entry.get("heartbeat") or 0.0) > STALE_S


def _from_key_books(
    results_dir: Path, where: AccountOfFolder, weights: dict[str, Weights], journal: float, live: bool
) -> FolderMoney | None:
    """The attribution recomputed from the key's ledger (a copy: nothing is written), with this folder's journals
    and weights read now and the account read live when asked; None without the key or the folder in its books."""
    key = os.environ.get(where.api_key_env)
    if not key:
        return None
    doc = read_key_ledger(key_ledger_path(where.base_url, key))
    books = doc.get("books") or {}
    label = run_label(results_dir)
    if label not in books.get("folders", {}) or books.get("baseline_usage") is None:
        return None
    now = time.time()
    live_labels = {e.get("label") for e in doc.get("runs", {}).values() if not e.get("ended") and not _dead(e, now)}
    for entry in doc.get("runs", {}).values():
        if not entry.get("ended") and _dead(entry, now) and entry.get("label") not in live_labels:
            settle_dead_run(doc, entry)
    folders = {name: FolderBooks.from_json(f) for name, f in books["folders"].items()}
    mine = folders[label]
    if label not in live_labels:  # a live job publishes its own figures; otherwise the folder's files are the truth
        mine.journal, mine.weights = journal, sum_weights(list(weights.values()))
    usage, source = (
        books.get("usage"),
        "key books, last reading " + time.strftime("%Y-%m-%d %H:%M", time.localtime(float(books.get("t") or 0))),
    )
    if live:
        try:
            reading = api_backend(where.backend).read_account(where.base_url, key, where.api_key_env)
        except RuntimeError:
            reading = None
        if reading is not None:
            usage, source = reading.usage, "key books, live"
    attribution = attribute(float(usage), float(books["baseline_usage"]), folders, now)
    share = attribution.shares[label]
    return FolderMoney(
        journal,
        Unjournaled(share.retries, share.lost, 0.0, share.pending),
        split_share(share, weights),
        attribution.unattributed,
        len(folders),
        source,
    )


def folder_money(
    results_dir: Path,
    where: AccountOfFolder,
    datasets: list[str],
    costs: dict[str, RequestCosts] | None = None,
    live: bool = True,
) -> FolderMoney | None:
    """This folder's books on ``where``'s account (``datasets``: its datasets there): from the key's books when the
    key is here (recomputed now), else the folder's last recorded reading; None when no job has read the account."""
    records = read_folder_books(account_ledger_path(results_dir), where.account)
    if not records:
        return None
    last = records[-1]
    recorded = {d: RequestCosts(**c) for d, c in (last.get("costs") or {}).items()}
    costs = {d: (costs or {}).get(d) or recorded.get(d) or RequestCosts(0.0, 0.0) for d in datasets}
    journal = sum(dataset_journal_totals(Path(results_dir) / d / "responses")["cost"] for d in datasets)
    label = run_label(results_dir)
    joined = next((float(r["t"]) for r in records if r.get("format") == ACCOUNT_FORMAT and r.get("label") == label), 0)
    since = joined - where.settle_s  # as the job weighs them (aerie.responses.api.job.open_account_books)
    weights = {
        d: dataset_weights(Path(results_dir) / d / "responses", costs[d], where.settle_s, since) for d in datasets
    }
    view = _from_key_books(Path(results_dir), where, weights, journal, live)
    if view is not None:
        return view
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(last.get("t") or 0)))
    if last.get("format") == OLD_ACCOUNT_FORMAT:
        parts = Unjournaled(lost=float(last.get("lost") or 0.0))
        return FolderMoney(journal, parts, split_share(FolderShare(lost=parts.lost), weights), source=f"{when}, v1")
    pending = float(last.get("pending") or 0.0) if time.time() < float(last.get("pending_until") or 0.0) else 0.0
    share = FolderShare(float(last.get("retries") or 0.0), float(last.get("lost") or 0.0), 0.0, pending)
    return FolderMoney(
        journal,
        Unjournaled(share.retries, share.lost, 0.0, share.pending),
        split_share(share, weights),
        float(last.get("unattributed_on_key") or 0.0),
        source=f"last recorded reading {when}",
    )


# ---- the whole money story of a folder (the report's spend figure) ------------------------------------------------


@dataclass
class SpendStory:
    """Where every dollar of a results folder's API spend went, in parts that add up to what was billed for it.

    ``journaled``: per dataset and provider, the ``cost`` of every journal line (the published shard's records where
    a shard has no journal). ``billed``: per dataset, the folder's share of what the account billed beyond every
    journal on its key (billed retries, lost to interrupted requests); ``pending``: sent before an interruption and
    not billed yet (the budget prices it). ``unattributed``: billed on the key, explained by no request of any run
    (not this folder's: shown beside it). ``account``: what the account billed for this folder's requests, or None
    without a reading."""

    journaled: dict[str, dict[str, float]]
    billed: dict[str, Unjournaled]
    unattributed: float = 0.0
    pending: float = 0.0
    account: float | None = None
    source: str = "no account reading (journals only)"

    @property
    def journaled_usd(self) -> float:
        return sum(sum(p.values()) for p in self.journaled.values())

    @property
    def total(self) -> float:
        """Journaled + billed retries + lost to interrupted requests: what was billed for the folder's requests."""
        return self.journaled_usd + sum(u.retries + u.lost for u in self.billed.values())

    def words(self) -> str:
        parts = Unjournaled(
            retries=sum(u.retries for u in self.billed.values()),
            lost=sum(u.lost for u in self.billed.values()),
            pending=self.pending,
        )
        text = f"{usd(self.journaled_usd)} journaled"
        return text + (f" + {parts.words()}" if parts.total >= 5e-5 else "")


def where_from_record(record: dict[str, Any]) -> AccountOfFolder | None:
    """The account a folder's ledger record names (``aerie.api-account/1`` records: from the account's id)."""
    if record.get("format") == ACCOUNT_FORMAT:
        return AccountOfFolder(
            record["account"], record["backend"], record["base_url"], record["api_key_env"], float(record["settle_s"])
        )
    account = str(record.get("account") or "")
    api = backend_of_account(account)
    if api is None:
        return None
    base, _, variable = account.rpartition(" $")
    return AccountOfFolder(account, api.name, base, variable, 900.0 + ACCOUNT_LAG_S)  # the default read timeout


def spend_story(shard_paths: list[Path], live: bool = True) -> SpendStory:
    """The money story of the API shards among ``shard_paths`` (``<results>/<dataset>/responses/shard-*.jsonl``):
    their journals, and the folder's share of the account's spend beyond them (:func:`folder_money`: the account
    read live when ``live`` and the key is set)."""
    journaled: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    results_dirs = set()
    for path in map(Path, shard_paths):
        journal = journal_path(path)
        records = jsonl_objects(journal) if journal.exists() else jsonl_objects(path)
        api = [r for r in records if not is_in_process(r.get("backend")) and r.get("cost") is not None]
        if not api and not journal.exists():
            continue
        dataset = path.parent.parent.name
        results_dirs.add(path.parent.parent.parent)
        for r in api:
            journaled[dataset][r.get("provider") or r.get("backend") or "unknown"] += float(r["cost"])
    story = SpendStory({d: dict(p) for d, p in journaled.items()}, {})
    if len(results_dirs) != 1:
        return story
    results_dir = results_dirs.pop()
    records = read_folder_books(account_ledger_path(results_dir))
    accounts = list(dict.fromkeys(r["account"] for r in records if r.get("account")))
    figures, sources = [], []
    for account in accounts:
        mine = [r for r in records if r["account"] == account]
        where = where_from_record(mine[-1])
        named = next((r["datasets"] for r in reversed(mine) if r.get("datasets") is not None), None)
        datasets = [
            d for d in (named or list(mine[-1].get("costs") or {}) or list(journaled)) if (results_dir / d).is_dir()
        ]
        money = folder_money(results_dir, where, datasets, live=live) if where is not None else None
        if money is None:
            continue
        for d, parts in money.by_dataset.items():
            story.billed[d] = parts
        story.unattributed += money.unattributed_on_key
        story.pending += money.parts.pending
        figures.append(money.billed)
        sources.append(money.source)
    if figures:
        story.account = sum(figures)
        story.source = ", ".join(sorted(set(sources)))
    return story
