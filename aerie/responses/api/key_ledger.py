"""One budget per key across runs: what every run on one API key has spent and holds, in a ledger beside the account.

A run keeps its journals and its account ledger in its own results folder, so two ``snakemake`` invocations with the
same key (two folders, or a second config) saw each other only in the account's usage - seconds after it was billed,
never their requests in flight - and each could keep a whole budget's worth of requests in flight. So the responses
job of every run keeps its figures in one ledger per key, shared by every run of this user on this machine (and on
every host that shares the state folder): ``<state>/keys/<hash>.json``, where ``<state>`` is ``$AERIE_STATE_DIR``, else
``$XDG_STATE_HOME/aerie``, else ``~/.local/state/aerie``, and ``<hash>`` is a SHA-256 of the API root and the key (the
key itself is never written). It is read and changed only under an exclusive ``flock`` of ``<hash>.lock`` beside it
(on NFS, ``flock`` needs NFSv4 or lockd; a state folder on a local disk makes runs on different hosts independent).

Per run (format :data:`KEY_LEDGER_FORMAT`): ``spent``, what its job journaled since it opened; ``reserved``, the
rest of its *lease*; its label (host and results folder), pid, settle time and heartbeat. The lease is a ceiling on
what the run may have committed since it opened - journaled plus in flight at the expected cost per request - before
it must come back under the lock: taking a new lease reads the other runs and grants at most what the budget leaves
after every run's spend and leases (plus :data:`LEASE_REQUESTS` requests of headroom, so a run at 1,000 requests a
second writes the file ~16 times a second, not 2,000). Every request of every run is admitted inside a lease that was
granted under the lock, so the leases never add up to more than the budget: the overshoot of all runs on a key
together is the single-client one, ``requests in flight x (actual - expected cost)``, summed over the runs.

Whose spend counts: everything the other open runs' jobs journaled on the key - also before this one started - and
the spend of runs that left while this one was open. So runs that overlap share one budget: each run's
``budget_usd`` holds for all of them together (two runs started at once with $100 each spend $100 in all; a run
that joins one which has spent $60 of its $100 has $40 left while they overlap). A run that ended before this one
started is not in the ledger and does not count (the key's own limit is the account-wide cap). Counted once: from
this ledger, and what the others publish after this job's first reading of the account is taken out of the growth
the account polls (aerie.responses.api.client.AccountWatcher) would otherwise count as spend no journal holds.

Crash safety. A run that ends cleanly marks its entry ended; one that stops on an error or an interrupt leaves it with
its lease reserved (what it may still have had in flight). A run killed (``kill -9``, a lost node) leaves its last
entry: it is dead when its pid is gone on this host, or when its heartbeat is older than :data:`STALE_S` (another host).
Its reservations still count until its last heartbeat plus its settle time (its requests in flight may still be billed;
after that the account shows what they cost), then whichever run reads the ledger first drops it; its requests in flight
become its folder's lost requests in the key's books at once. A dead entry of the same run (its results folder: a job of
the same run killed earlier) is skipped: that job's requests are priced from its intents log
(aerie.responses.api.journal) by the new job. A torn or unreadable file (a machine crash mid-write) is started afresh
and says so; every live run writes its entry back at its next change.

The key's books (aerie.responses.api.key_books) live in the same file, under the same lock: per results folder its
journal total and the weights of its requests that may be billed unseen, and the account's readings, from which the
spend no journal on the key holds is attributed to the folders (:meth:`KeyLedger.join`, :meth:`KeyLedger.reconcile`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.responses.api.key_books import BOOKS_FORMAT, Attribution, FolderBooks, Weights, attribute

KEY_LEDGER_FORMAT = "aerie.key-ledger/1"
ENV_STATE_DIR = "AERIE_STATE_DIR"
# Seen from another host, a run whose heartbeat is older than this is dead (a live run beats every HEARTBEAT_S).
STALE_S = 120.0
HEARTBEAT_S = 15.0
# Headroom of one lease, in requests at the dataset's expected cost (capped by what the budget leaves).
LEASE_REQUESTS = 64
_EPS = 1e-12


def state_dir(env: dict[str, str] | None = None) -> Path:
    """Where aerie keeps per-user state that outlives a results folder."""
    env = os.environ if env is None else env
    if env.get(ENV_STATE_DIR):
        return Path(env[ENV_STATE_DIR])
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "aerie"
    return Path.home() / ".local" / "state" / "aerie"


def key_ledger_path(base_url: str, api_key: str, env: dict[str, str] | None = None) -> Path:
    """The ledger of one key at one API root (named by a hash: the key is never written)."""
    digest = hashlib.sha256(f"{base_url.rstrip('/')}\n{api_key}".encode()).hexdigest()[:32]
    return state_dir(env) / "keys" / f"{digest}.json"


def run_label(results_dir: Path) -> str:
    """Which run an entry belongs to: its host and results folder (a later job of the same run has the same)."""
    return f"{socket.gethostname()}:{Path(results_dir).resolve()}"


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


@dataclass
class OtherRuns:
    """The other runs on the key, as the last locked read saw them (USD)."""

    # journaled by their jobs (all of it: also before this job opened; runs that left since included)
    spent: float = 0.0
    reserved: float = 0.0  # the rest of their leases: in flight at the expected cost, and headroom
    live_reserved: float = 0.0  # of which held by live runs (it comes back as answers or is released)
    runs: int = 0  # entries besides this run's (dead ones within their settle time included)

    @property
    def committed(self) -> float:
        return self.spent + self.reserved


class KeyLedger:
    """This run's entry in the ledger of one key, its lease, and the figures of the other runs on the key."""

    def __init__(
        self,
        path: Path,
        *,
        label: str,
        settle_s: float,
        stale_s: float = STALE_S,
        log: Callable[[str], None] | None = None,
    ):
        self.path = Path(path)
        self.lock_path = self.path.with_suffix(".lock")
        self.label, self.settle_s, self.stale_s = label, float(settle_s), float(stale_s)
        self.log = log or (lambda msg: None)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.run_id = f"{self.host}:{self.pid}:{time.time_ns()}"
        self.lease = 0.0  # the most this run may have committed since it opened, until it takes the lock again
        self.others = OtherRuns()
        self.takes = 0  # leases taken (writes of the file, heartbeats aside)
        self._published: tuple[float, float] | None = None  # (spent, reserved) last written
        self._beat = 0.0  # when this run's entry was last written
        self._seen: dict[str, float] = {}  # other runs' spend at the last read (kept after they leave)
        self._doc: dict[str, Any] | None = None
        self._dirty = False
        # This run's requests in flight (expected USD, at most): published with its entry, so that if it dies
        # the other runs move them to its folder's lost requests in the key's books (aerie.responses.api.key_books).
        self.flight = (0.0, 0.0)

    # ---- the lock and the file ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Hold the key's lock: read the ledger and the others' figures, yield it, write it back if changed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._doc, self._dirty = self._read(), False
            self._read_others(time.time())
            yield self._doc
            if self._dirty:
                tmp = self.path.with_name(f"{self.path.name}.{self.pid}.tmp")
                tmp.write_text(json.dumps(self._doc, sort_keys=True))
                os.replace(tmp, self.path)
        finally:
            self._doc = None
            os.close(fd)  # closing drops the flock

    def _read(self) -> dict[str, Any]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {"format": KEY_LEDGER_FORMAT, "runs": {}}
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != KEY_LEDGER_FORMAT or not isinstance(doc["runs"], dict):
                raise ValueError(f"not {KEY_LEDGER_FORMAT}")
            return doc
        except (ValueError, KeyError) as e:
            self.log(f"{self.path}: unreadable ({e}); started afresh (live runs write their entries back)")
            self._dirty = True
            return {"format": KEY_LEDGER_FORMAT, "runs": {}}

    def _dead(self, entry: dict[str, Any], now: float) -> bool:
        if entry.get("host") == self.host and not pid_alive(int(entry.get("pid") or 0)):
            return True
        return now - float(entry.get("heartbeat") or 0.0) > self.stale_s

    def _read_others(self, now: float) -> None:
        runs = self._doc["runs"]
        others = OtherRuns()
        # A folder with a live job publishes its own weights in the books: a dead job of it settles nothing there.
        live_labels = {self.label} | {
            e.get("label")
            for r, e in runs.items()
            if r != self.run_id and not e.get("ended") and not self._dead(e, now)
        }
        for rid, entry in list(runs.items()):
            if rid == self.run_id:
                continue
            spent, reserved = float(entry.get("spent") or 0.0), float(entry.get("reserved") or 0.0)
            if entry.get("ended"):
                # A job that ended cleanly leaves its final spend for the runs that knew it (its last answers may
                # not have been published before), until its requests have settled; a run that opens later does
                # not count it.
                if rid in self._seen:
                    self._seen[rid] = spent
                if now >= float(entry.get("heartbeat") or 0.0) + float(entry.get("settle_s") or 0.0):
                    del runs[rid]
                    self._dirty = True
                continue
            dead = self._dead(entry, now)
            if dead and entry.get("label") not in live_labels:
                self._dirty |= settle_dead_run(self._doc, entry)
            if dead and entry.get("label") == self.label:
                continue  # a killed job of this same run: the new job prices its requests from the intents log
            self._seen[rid] = spent
            if dead and now >= float(entry.get("heartbeat") or 0.0) + float(entry.get("settle_s") or 0.0):
                del runs[rid]
                self._dirty = True
                self.log(
                    f"key ledger: dropped the entry of run {entry.get('label') or rid}: dead, and its "
                    f"${reserved:.4f} reserved has settled (the account shows what it cost)"
                )
                continue
            if not dead:
                others.live_reserved += reserved
            others.reserved += reserved
            others.runs += 1
        others.spent = sum(self._seen.values())
        self.others = others

    def _publish(self, spent: float, reserved: float) -> None:
        """Write this run's figures (inside ``_locked``)."""
        runs = self._doc["runs"]
        runs[self.run_id] = {
            "label": self.label,
            "host": self.host,
            "pid": self.pid,
            "started": runs.get(self.run_id, {}).get("started", round(time.time(), 3)),
            "heartbeat": round(time.time(), 3),
            "spent": round(spent, 9),
            "reserved": round(max(0.0, reserved), 9),
            "settle_s": self.settle_s,
            "in_flight": round(self.flight[0], 9),
            "in_flight_max": round(self.flight[1], 9),
        }
        self._dirty = True
        self._published, self._beat = (spent, reserved), time.monotonic()

    # ---- what the client asks ----------------------------------------------------------------------------------

    def open(self) -> OtherRuns:
        """Enter this run, nothing spent or leased yet; the other runs' jobs' spend counts against its budget."""
        with self._locked():
            self._publish(0.0, 0.0)
        if self.others.runs:
            self.log(
                f"key ledger {self.path}: {self.others.runs} other run(s) on this key hold "
                f"${self.others.spent:.4f} spent and ${self.others.reserved:.4f} leased: it counts against this "
                "run's budget"
            )
        return self.others

    def refresh(self) -> OtherRuns:
        """Read the other runs' figures (and drop settled dead ones) without changing this run's entry."""
        with self._locked():
            pass
        return self.others

    def covers(self, committed: float) -> bool:
        """Whether ``committed`` (this run's spend since it opened + its requests in flight at the expected cost,
        the next one included) is within its lease: then the request goes without the lock."""
        return committed <= self.lease + _EPS

    def take(self, spent: float, committed: float, need: float, room: Callable[[], float], headroom: float) -> bool:
        """Under the lock: a lease for ``need`` more (the next request) on top of ``committed``, if the budget has
        ``room()`` for it once the other runs are read afresh; with up to ``headroom`` more for the requests after
        it. Publishes this run's figures either way; False when it does not fit."""
        with self._locked():
            left = room()  # what the budget leaves for this run's new requests, the others' figures just read
            fits = need <= left + _EPS
            self.lease = committed + (min(left, max(need, headroom)) if fits else 0.0)
            self._publish(spent, self.lease - spent)
            self.takes += 1
        return fits

    def give_back(self, spent: float, committed: float) -> None:
        """The budget refused this run's next request: give back the lease's unused headroom (it may be just what
        another run waits for), keeping what is in flight. Nothing to give back: no lock (2,000 workers refused in
        turn near the end of a budget would otherwise each take it)."""
        if self.lease <= committed + _EPS:
            return
        with self._locked():
            self.lease = committed
            self._publish(spent, committed - spent)

    def sync(self, spent: float, committed: float, busy: bool) -> None:
        """Read the others and refresh this run's entry: its spend, its heartbeat; an idle run (``busy`` False: no
        request waiting to be sent) gives back its unused lease headroom."""
        if not busy:
            self.lease = min(self.lease, committed)
        self.lease = max(self.lease, committed)  # answers dearer than expected: the spend is real either way
        figures = (spent, self.lease - spent)
        with self._locked():
            if figures != self._published or time.monotonic() - self._beat >= HEARTBEAT_S:
                self._publish(*figures)

    def close(self, clean: bool, spent: float, in_flight: float) -> None:
        """Leave. ``clean``: nothing in flight; the entry keeps only this job's final spend, marked ended, for the
        runs that knew it (runs opening later ignore it) until its settle time. Otherwise it stays a live-looking
        entry with ``in_flight`` reserved until this process is gone and its requests have settled."""
        if clean:
            self.flight = (0.0, 0.0)
        with self._locked():
            self._publish(spent, 0.0 if clean else in_flight)
            if clean:
                self._doc["runs"][self.run_id]["ended"] = True

    # ---- the key's books (aerie.responses.api.key_books) ---------------------------------------------------------

    def join(self, journal: float, carried: tuple[float, float] = (0.0, 0.0)) -> float:
        """Enter this run's folder in the key's books (once per folder: a later job finds it there); ``journal``: the
        folder's journal total on this key now, ``carried``: what its older account ledger attributed (billed
        retries, lost). Returns when the folder joined: its requests sent since count in its weights."""
        with self._locked() as doc:
            folders = _books(doc)["folders"]
            if self.label not in folders:
                folders[self.label] = FolderBooks(journal, journal, time.time(), Weights(), carried).to_json()
                self._dirty = True
            return float(folders[self.label]["joined"])

    def reconcile(self, usage: float | None, journal: float, weights: Weights) -> Attribution | None:
        """Under the lock: publish this folder's journal total and weights (its requests in flight among them), take
        ``usage`` (the account now; None: unread) as the key's last reading, and attribute the key's unexplained
        money to every folder. None before any reading of the account."""
        with self._locked() as doc:
            books = _books(doc)
            now = time.time()
            if usage is not None and usage < float(books.get("usage", usage)) - 1e-9:
                # An account's usage never falls: another account answers at this API root with this key now (a
                # restarted test server). Its books start afresh; every live run enters its folder again.
                self.log(f"{self.path}: the account's usage fell ({books['usage']} -> {usage}): its books start afresh")
                books = doc["books"] = {"format": BOOKS_FORMAT, "folders": {}}
            mine = books["folders"].setdefault(self.label, FolderBooks(journal, journal, now).to_json())
            mine["journal"], mine["weights"] = round(journal, 9), weights.to_json()
            if usage is not None:
                books.setdefault("baseline_usage", usage)
                books["usage"], books["t"] = usage, round(now, 3)
            self._dirty = True
            return books_attribution(books, now)


def _books(doc: dict[str, Any]) -> dict[str, Any]:
    return doc.setdefault("books", {"format": BOOKS_FORMAT, "folders": {}})


def books_attribution(books: dict[str, Any], now: float, usage: float | None = None) -> Attribution | None:
    """The attribution of a key's books at its last reading (or at ``usage``); None before any reading."""
    usage = books.get("usage") if usage is None else usage
    if usage is None or books.get("baseline_usage") is None:
        return None
    folders = {label: FolderBooks.from_json(f) for label, f in books.get("folders", {}).items()}
    return attribute(float(usage), float(books["baseline_usage"]), folders, now)


def settle_dead_run(doc: dict[str, Any], entry: dict[str, Any]) -> bool:
    """A dead run's requests in flight become its folder's lost requests in the books (once), and the folder has
    nothing in flight any more; whether anything changed."""
    expected, most = float(entry.get("in_flight") or 0.0), float(entry.get("in_flight_max") or 0.0)
    folder = _books(doc)["folders"].get(entry.get("label"))
    if folder is None:
        return False
    weights = Weights.from_json(folder.get("weights") or {})
    if expected <= 0 and weights.in_flight <= 0:
        return False
    if expected > 0:
        weights.lost += expected
        weights.lost_max += most
        weights.add_unsettled(float(entry.get("heartbeat") or 0.0) + float(entry.get("settle_s") or 0.0), expected)
    weights.in_flight = weights.in_flight_max = 0.0
    folder["weights"] = weights.to_json()
    entry["in_flight"] = entry["in_flight_max"] = 0.0
    return True


def read_key_ledger(path: Path) -> dict[str, Any]:
    """The ledger as stored (previews, tests); an empty one when absent."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {"format": KEY_LEDGER_FORMAT, "runs": {}}


def other_runs_note(path: Path, label: str) -> str:
    """For the cost preview: the runs on the key's ledger other than ``label`` (this results folder), or ``""``."""
    runs = [e for e in read_key_ledger(path).get("runs", {}).values() if e.get("label") != label and not e.get("ended")]
    if not runs:
        return ""
    held = sum(float(e.get("reserved") or 0.0) for e in runs)
    names = ", ".join(sorted(str(e.get("label") or "?") for e in runs)[:3]) + (" ..." if len(runs) > 3 else "")
    return (
        f"{len(runs)} other run(s) on this API key ({names}) hold ${held:.2f} of leases now: what they spend while "
        "this run goes counts against its budget too (docs/formats.md, Key ledger)"
    )
