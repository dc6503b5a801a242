"""Books per results folder on a shared API key: who the account's spend beyond the journals is for.

The account (``GET /key``) is key-wide: it bills every run on the key, and a folder's journals say only what its
answered requests cost. What the account billed beyond *all* journals on the key - the key's unexplained money -
comes from requests that were billed without an answer: failed requests the provider still billed (timeouts,
resets, torn bodies: retried, so "billed retries"), requests in flight when their process died ("lost to
interrupted requests"), and answers billed a moment before their journal line is written (requests in flight).
So it is attributed key-wide, in one place, to the folders whose requests can explain it - never worked out by
one folder from the account's growth alone (which books every other run's spend as its own: issue 39).

The key ledger (aerie.responses.api.key_ledger) keeps, per key, these books beside its runs: the account's usage
when the books began, the last reading, and per folder (its run label) its journal total when it joined and now,
and the *weights* of its requests that may be billed unseen - each at its expected cost and at its most (prompt +
``max_new_tokens`` at the price ceiling). :func:`attribute` is a pure function of them, recomputed at every
reading (so a transient - an answer billed before it was journaled - corrects itself at the next reading):

1. the unexplained money ``X`` = usage growth since the books began - every folder's journal growth since it joined;
2. ``X`` fills, in order, each folder's billed retries, lost requests and requests in flight at their expected
   cost, then billed retries and lost requests up to their maximum cost, each pass shared in proportion to what the
   folders can explain (what is in flight never takes more than its expected cost: an answer on its way is
   journaled a moment later, and money hidden there would escape the budget);
3. what is left no request of any run explains: *unattributed* (another use of the key), in no folder's books.

A folder's requests sent before an interruption and still within their settle time are *pending*: priced at the
expected cost (less what is attributed to them already) until the account shows them.

Pure and torch/aiohttp-free: the key ledger, the job, the preview and the report call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BOOKS_FORMAT = "aerie.key-books/1"
# Per folder, pending requests are kept in buckets of this many seconds of settle time (a long run at 1,000
# requests a second with 5% failing would otherwise write thousands of entries into the ledger at every change).
BUCKET_S = 60.0


@dataclass
class Weights:
    """What a folder's requests may have cost beyond its journals (USD): expected and at most."""

    retries: float = 0.0  # failed after the provider could bill them (aerie.responses.api.journal.BILLABLE_FAILURES)
    retries_max: float = 0.0
    lost: float = 0.0  # in flight when their process died
    lost_max: float = 0.0
    # (settle time, expected USD) of lost requests the account may not show yet, bucketed by BUCKET_S
    unsettled: list[list[float]] = field(default_factory=list)
    in_flight: float = 0.0  # requests a live job has in flight now (batches submitted and not finished included)
    in_flight_max: float = 0.0

    def add_unsettled(self, until: float, expected: float) -> None:
        """One more lost request (or a dead job's requests in flight) that may be billed up to ``until``."""
        key = (until // BUCKET_S + 1) * BUCKET_S  # the bucket's end: never before the request settles
        for bucket in self.unsettled:
            if bucket[0] == key:
                bucket[1] += expected
                return
        self.unsettled.append([key, expected])

    def unsettled_at(self, now: float) -> float:
        return sum(c for until, c in self.unsettled if until > now)

    def to_json(self) -> dict[str, Any]:
        return {
            "retries": round(self.retries, 9),
            "retries_max": round(self.retries_max, 9),
            "lost": round(self.lost, 9),
            "lost_max": round(self.lost_max, 9),
            "unsettled": [[u, round(c, 9)] for u, c in sorted(self.unsettled)],
            "in_flight": round(self.in_flight, 9),
            "in_flight_max": round(self.in_flight_max, 9),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Weights:
        w = cls(**{k: float(d.get(k) or 0.0) for k in ("retries", "retries_max", "lost", "lost_max")})
        w.unsettled = [[float(u), float(c)] for u, c in d.get("unsettled") or []]
        w.in_flight, w.in_flight_max = float(d.get("in_flight") or 0.0), float(d.get("in_flight_max") or 0.0)
        return w


@dataclass
class FolderBooks:
    """One results folder in a key's books."""

    journal: float  # the folder's journal total (USD, every dataset on this key) as last published
    journal_at_join: float  # ... when it joined the books (what it journaled before is before the baseline)
    joined: float  # unix s
    weights: Weights = field(default_factory=Weights)
    # Attributed before these books existed (an older account ledger of the folder): (billed retries, lost)
    carried: tuple[float, float] = (0.0, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "journal": round(self.journal, 9),
            "journal_at_join": round(self.journal_at_join, 9),
            "joined": round(self.joined, 3),
            "weights": self.weights.to_json(),
            "carried": [round(c, 9) for c in self.carried],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FolderBooks:
        carried = d.get("carried") or (0.0, 0.0)
        return cls(
            float(d["journal"]),
            float(d["journal_at_join"]),
            float(d["joined"]),
            Weights.from_json(d.get("weights") or {}),
            (float(carried[0]), float(carried[1])),
        )


@dataclass
class FolderShare:
    """A folder's part of the key's unexplained money, named as the logs, the preview and the report name it."""

    retries: float = 0.0  # billed retries
    lost: float = 0.0  # lost to interrupted requests
    in_flight: float = 0.0  # billed, on its way to a live job's journal (counted as in flight, not spend)
    pending: float = 0.0  # sent before an interruption, not yet billed: priced at the expected cost

    @property
    def billed(self) -> float:
        """What the account billed for the folder's requests beyond its journals."""
        return self.retries + self.lost


@dataclass
class Attribution:
    usage: float  # the reading it was computed from
    unexplained: float  # X: account growth since the books began beyond every folder's journal growth
    shares: dict[str, FolderShare]
    unattributed: float  # billed, explained by no request of any run on the key


# The fill order: each folder's weights at their expected cost first (billed retries, lost requests, then requests
# in flight), then up to their maximum cost. (share field, expected weight, maximum weight)
_KINDS = (
    ("retries", "retries", "retries_max"),
    ("lost", "lost", "lost_max"),
    ("in_flight", "in_flight", "in_flight_max"),
)


def attribute(usage: float, baseline_usage: float, folders: dict[str, FolderBooks], now: float) -> Attribution:
    """Split the key's unexplained money between the folders (see the module)."""
    growth = sum(f.journal - f.journal_at_join for f in folders.values())
    unexplained = max(0.0, (usage - baseline_usage) - growth)
    left = unexplained
    shares = {label: FolderShare() for label in folders}
    for pass_ in ("expected", "max"):
        for share_field, expected, most in _KINDS:
            if pass_ == "max" and share_field == "in_flight":
                continue  # an answer on its way beyond its expected cost stays unexplained until it is journaled
            room = {}
            for label, f in folders.items():
                w = f.weights
                e, m = getattr(w, expected), getattr(w, most)
                room[label] = e if pass_ == "expected" else max(0.0, m - e)
            total = sum(room.values())
            if left <= 0 or total <= 0:
                continue
            give = min(left, total)
            for label, r in room.items():
                setattr(shares[label], share_field, getattr(shares[label], share_field) + give * r / total)
            left -= give
    for label, f in folders.items():
        s = shares[label]
        s.retries += f.carried[0]
        s.lost += f.carried[1]
        s.pending = min(f.weights.unsettled_at(now), max(0.0, f.weights.lost - (s.lost - f.carried[1])))
    return Attribution(usage, unexplained, shares, max(0.0, left))
