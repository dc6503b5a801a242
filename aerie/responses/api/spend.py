"""The run's spend as the budget sees it while the job runs: the journals, this folder's share of what the account
billed beyond every journal on the key (read while running: :class:`KeyAccount`), and what the other runs on the
key spend and hold (aerie.responses.api.key_ledger).

The job reads the account at its start and every ``progress_interval_s``; each reading goes through the key's books
(aerie.responses.api.key_books) under the ledger's lock, which attribute the key's unexplained money to the folders
whose requests can explain it. The budget of this run counts its folder's share (billed retries, lost requests, and
requests sent before an interruption priced until billed) and what the other folders' shares and the unexplained
rest grew by while this job runs (the runs that overlap share one budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from aerie.responses.api.key_books import Attribution, FolderShare, Weights
from aerie.responses.api.key_ledger import KeyLedger
from aerie.responses.api.money import JOURNALED, UNATTRIBUTED, Unjournaled, usd


@dataclass
class MoneyGuard:
    """One dataset's money checks: its expected and most cost per request (until 20 of its samples are measured in
    this run, then their mean), its output-token quota and what the dataset used of it before. ``budget_usd``: the
    run's budget (aerie.responses.api.settings.ApiRun.budget_usd); ``spent_before`` and ``lost_usd`` are the run's spend
    for a caller that runs one shard alone (``regenerate_shard``); a whole run passes them in a ``RunSpend``."""

    budget_usd: float | None = None
    spent_before: float = 0.0
    expected_cost: float = 0.0
    most_cost: float = 0.0  # the most one request can cost (prompt + max_new_tokens at the price ceiling)
    token_cap: int | None = None  # this dataset's output-token cap
    tokens_before: int = 0  # this dataset's journaled output tokens
    expected_tokens: float = 0.0
    lost_usd: float = 0.0


class KeyAccount:
    """One provider account while the job runs: read (``GET /key``) on a connection of its own, each reading
    attributed through the key's books, and this folder's share of it kept for the budget.

    ``weights``: what this folder's requests may have cost beyond its journals (from its intents logs at the start;
    this job's billable failures are added as they happen, its requests in flight are published with each reading).
    ``record(attribution, share, weights, journal)`` appends a reading to the folder's account ledger."""

    def __init__(
        self,
        ledger: KeyLedger,
        url: str,
        usage_of: Callable[[object], float | None],
        weights: Weights,
        first: Attribution | None,
        record: Callable[[Attribution, FolderShare, Weights, float], None] | None = None,
        headers: dict[str, str] | None = None,
        ca_bundle: str | None = None,
    ):
        self.ledger, self.url, self.usage_of, self.weights, self._record = ledger, url, usage_of, weights, record
        self.headers, self.ca_bundle = headers or {}, ca_bundle
        self.share = FolderShare()
        self.others_at_start = self.unattributed_at_start = 0.0
        self.others_growth = self.unattributed_growth = 0.0
        if first is not None:
            self.share = first.shares.get(ledger.label, FolderShare())
            self.others_at_start = self._others(first)
            self.unattributed_at_start = first.unattributed
        # Whether the last reading was taken with nothing of this job in flight (then it holds none of its own
        # answers billed and not journaled yet: what a final budget stop must be decided on).
        self.exact = True
        self.polls = self.errors = 0

    def _others(self, a: Attribution) -> float:
        return sum(s.billed for label, s in a.shares.items() if label != self.ledger.label)

    def retried(self, expected: float, most: float) -> None:
        """A request of this job failed after the provider could bill it."""
        self.weights.retries += expected
        self.weights.retries_max += most

    def figure(self) -> float:
        """What the budget counts beyond this job's journals: the folder's share (billed and pending) and what the
        other folders' shares and the unexplained rest grew by since this job started."""
        return self.share.billed + self.share.pending + self.others_growth + self.unattributed_growth

    def words(self) -> str:
        parts = Unjournaled(self.share.retries, self.share.lost, 0.0, self.share.pending).words()
        extra = []
        if self.others_growth >= 5e-5:
            extra.append(f"{usd(self.others_growth)} billed beyond the journals of other runs on the key")
        if self.unattributed_growth >= 5e-5:
            extra.append(f"{usd(self.unattributed_growth)} {UNATTRIBUTED}")
        return " + ".join(([parts] if parts != "nothing" else []) + extra) or "nothing"

    def take(self, attribution: Attribution | None, journal: float) -> None:
        """A reconcile's attribution becomes the figures (and a line of the folder's account ledger)."""
        if attribution is None:
            return
        self.share = attribution.shares.get(self.ledger.label, FolderShare())
        self.others_growth = max(0.0, self._others(attribution) - self.others_at_start)
        self.unattributed_growth = max(0.0, attribution.unattributed - self.unattributed_at_start)
        if self._record is not None:
            self._record(attribution, self.share, self.weights, journal)

    async def poll(
        self, session: aiohttp.ClientSession, journal: float, flight: tuple[float, float], in_flight: int = 0
    ) -> None:
        """Read the account and reconcile; ``journal``: this folder's journal total on the account now, ``flight``:
        this job's requests in flight there (expected USD, at most), ``in_flight``: how many."""
        try:
            async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=15), headers=self.headers) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            body = None
        usage = self.usage_of(body) if body is not None else None
        if usage is None:
            self.errors += 1  # the last known figure stands; the journals still count live
            return
        self.polls += 1
        self.exact = in_flight == 0
        self.weights.in_flight, self.weights.in_flight_max = flight
        self.take(self.ledger.reconcile(float(usage), journal, self.weights), journal)


class RunSpend:
    """The run's spend as the budget sees it: per account, the journals at the start (``before``) and what this
    process journaled since; plus, per account, what its ``KeyAccount`` counts beyond the journals, and a fixed
    ``lost_usd`` (a one-shard caller's). ``keys``: per account, the key's ledger (other runs on the same key: what
    their jobs spent and their leases count against the budget too)."""

    def __init__(
        self,
        before: dict[str | None, float] | None = None,
        accounts: dict[str, KeyAccount] | None = None,
        lost_usd: float = 0.0,
        keys: dict[str, KeyLedger] | None = None,
    ):
        self.before = dict(before or {})
        self.now: dict[str | None, float] = {}
        self.accounts = dict(accounts or {})
        self.fixed_lost = lost_usd
        self.keys = dict(keys or {})
        self.started = time.time()

    def others(self) -> float:
        """What the other runs on this run's keys spent (their open jobs, and those that left since this one
        started), plus what their leases still hold."""
        return sum(k.others.committed for k in self.keys.values())

    def others_in_flight(self) -> bool:
        """Whether a live run on one of the keys holds a lease (its answers come back, or it gives it back)."""
        return any(k.others.live_reserved > 1e-12 for k in self.keys.values())

    def add(self, account: str | None, cost: float) -> None:
        self.now[account] = self.now.get(account, 0.0) + cost

    def retried(self, account: str | None, expected: float, most: float) -> None:
        """A request of ``account`` failed after the provider could bill it (journal.BILLABLE_FAILURES)."""
        if account in self.accounts:
            self.accounts[account].retried(expected, most)

    def journals(self, account: str | None) -> float:
        return self.before.get(account, 0.0) + self.now.get(account, 0.0)

    def lost(self) -> float:
        return self.fixed_lost + sum(a.figure() for a in self.accounts.values())

    def journaled(self) -> float:
        return sum(self.before.values()) + sum(self.now.values())

    def spent(self) -> float:
        """Every journal's spend plus the spend only the accounts saw (or may still bill)."""
        return self.journaled() + self.lost()

    def words(self) -> str:
        """``$1.23 journaled + $0.40 lost to interrupted requests`` (the parts that are not zero)."""
        parts = [f"{usd(self.journaled())} {JOURNALED}"]
        if self.fixed_lost:
            parts.append(Unjournaled(lost=self.fixed_lost).words())
        parts += [w for a in self.accounts.values() if (w := a.words()) != "nothing"]
        return " + ".join(parts)

    def others_words(self) -> str:
        """`` + $0.30 by other runs on the key (1 open; spent + leased)``, or ``""``."""
        runs = sum(k.others.runs for k in self.keys.values())
        if self.others() <= 0 and not runs:
            return ""
        return f" + {usd(self.others())} by other runs on the key ({runs} open; spent + leased)"
