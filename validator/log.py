"""The contribution log: one SQLite row per (window, peer) with every figure and the exact reason.

It is also the validator's durable memory of decisions. Rows are keyed by (window, peer), so
re-deciding a window after a crash overwrites instead of double-counting, and reputation is derived
from the rows (see :mod:`validator.reputation`) rather than kept as a counter that a restart could
bump twice. ``received_at`` and ``digest`` are kept from the first time a contribution's bytes were
read (the copy check's upload order survives a restart, and so does the digest that later bytes at
the same key are compared with). Rows exist only for announced peers: keys of unknown peers are
counted per window (``windows.unannounced``), never stored one by one.

    log = ContributionLog("state/contributions.sqlite")
    log.note_received(3, peer, received_at=time.time(), nbytes=n, digest=d)
    log.record_window(WindowRecord(window=3, ...), [ContributionRecord(...), ...])
    log.mark_published(3, digest="…", published_at=time.time())
    log.rows(peer=peer, windows=(0, 10), rejected_only=True)

The validator reads its own decisions back by key (``log.window(t)``, ``log.rows(windows=...)``);
every other read — the leaderboard, a peer's history, chart buckets, rejections by reason, what the
open window has read — is the read model, :class:`validator.logview.LogView`, which runs its
queries through :meth:`ContributionLog.reading` (:meth:`LogView.open <validator.logview.LogView.open>`
opens the log with ``readonly=True``: no schema change, every write raises).

Tables: ``contributions`` (one narrow row per contribution: its checks are a bit mask over
:data:`CHECK_BITS` and the name of the one that failed, whose reason is the row's), ``checks``
(window, peer, check, passed, reason: only rows whose checks are not in that form, and rows written
by older versions), ``windows``, and
``evaluations`` (the periodic evaluation of θ, ``sparseloco-validator run --eval-every N``):

    log.record_evaluation(EvaluationRecord(window=9, loss=1.9, perplexity=6.7, bits_per_byte=2.7, ...))
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from protocol.outcomes import PeerOutcome

__all__ = [
    "AGREEMENT_COLUMNS",
    "AGREEMENT_EVENTS",
    "CHECK_BITS",
    "CONTRIBUTION_COLUMNS",
    "CONTRIBUTION_SELECT",
    "EVALUATION_COLUMNS",
    "LOG_FILE",
    "WINDOW_COLUMNS",
    "AgreementRecord",
    "CheckRow",
    "ContributionLog",
    "ContributionRecord",
    "EvaluationRecord",
    "WindowRecord",
    "decode_contribution",
    "pack_checks",
    "unpack_checks",
    "where",
]

LOG_FILE = "contributions.sqlite"  # its name in a validator's state directory

_SCHEMA = """
CREATE TABLE IF NOT EXISTS contributions (
    window INTEGER NOT NULL,
    peer TEXT NOT NULL,
    received_at REAL,
    bytes INTEGER,
    digest TEXT,
    accepted INTEGER NOT NULL DEFAULT 0,
    reason TEXT,
    detail TEXT,
    norm REAL,
    overlap REAL,
    loss_own_before REAL,
    loss_own_after REAL,
    loss_random_before REAL,
    loss_random_after REAL,
    score REAL,
    reputation REAL,
    weight REAL NOT NULL DEFAULT 0,
    decided INTEGER NOT NULL DEFAULT 0,
    passed INTEGER,
    failed TEXT,
    PRIMARY KEY (window, peer)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checks (
    window INTEGER NOT NULL,
    peer TEXT NOT NULL,
    name TEXT NOT NULL,
    passed INTEGER NOT NULL,
    reason TEXT,
    PRIMARY KEY (window, peer, name)
);
CREATE TABLE IF NOT EXISTS windows (
    window INTEGER PRIMARY KEY,
    status TEXT NOT NULL,
    opened_at REAL,
    closed_at REAL,
    published_at REAL,
    base TEXT,
    aggregate_digest TEXT,
    fingerprint TEXT,
    val_loss REAL,
    accepted INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    unannounced INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS contributions_by_peer ON contributions (peer, window);
-- covers the leaderboard: standings of every peer are read from this index alone, not the table
CREATE INDEX IF NOT EXISTS contributions_standing
    ON contributions (peer, decided, window, accepted, score, received_at, reputation);
CREATE INDEX IF NOT EXISTS contributions_rejected
    ON contributions (reason, peer, window) WHERE decided = 1 AND accepted = 0;
-- runs with several validators: what this validator saw of a window's agreement (validator/agreement.py)
CREATE TABLE IF NOT EXISTS agreement (
    window INTEGER NOT NULL,
    validator TEXT NOT NULL,
    event TEXT NOT NULL,
    digest TEXT NOT NULL DEFAULT '',
    view INTEGER NOT NULL DEFAULT 0,
    detail TEXT,
    at REAL,
    PRIMARY KEY (window, validator, event, digest)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS evaluations (
    window INTEGER PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    sequences INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    loss REAL NOT NULL,
    perplexity REAL NOT NULL,
    bits_per_byte REAL NOT NULL,
    evaluated_at REAL NOT NULL,
    seconds REAL NOT NULL
);
"""


@dataclass(frozen=True)
class CheckRow:
    """One check's outcome for one contribution."""

    name: str
    passed: bool
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class ContributionRecord:
    """Everything the validator decided about one peer's contribution in one window: its
    :meth:`outcome` and the figures only the log keeps (digest, size, times, norms, losses,
    checks). Flat, as the table's columns and ``logs --json`` rows are."""

    window: int
    peer: str
    received_at: float | None = None
    bytes: int | None = None
    digest: str | None = None
    accepted: bool = False
    reason: str | None = None  # stable rejection reason (None when accepted)
    detail: str | None = None  # human-readable explanation
    norm: float | None = None
    overlap: float | None = None  # largest Top-k index overlap with an earlier upload (copy margin)
    loss_own_before: float | None = None
    loss_own_after: float | None = None
    loss_random_before: float | None = None
    loss_random_after: float | None = None
    score: float | None = None
    reputation: float | None = None
    weight: float = 0.0
    checks: tuple[CheckRow, ...] = field(default=())

    def outcome(self) -> PeerOutcome:
        """The row's outcome: what reputation folds, the validator publishes and the demo reads."""
        failed = next((c.name for c in self.checks if not c.passed), None)
        return PeerOutcome(
            self.peer,
            self.accepted,
            self.reason,
            self.score,
            self.reputation,
            window=self.window,
            check=failed,
            weight=self.weight,
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["checks"] = {c.name: ("pass" if c.passed else f"fail:{c.reason}") for c in self.checks}
        return out


@dataclass(frozen=True, kw_only=True)
class WindowRecord:
    """One window's outcome: status ``decided`` (before publishing) then ``published``."""

    window: int
    status: str = "decided"
    opened_at: float | None = None
    closed_at: float | None = None
    published_at: float | None = None
    base: str | None = None
    aggregate_digest: str | None = None
    fingerprint: str | None = None
    val_loss: float | None = None
    accepted: int = 0
    rejected: int = 0
    unannounced: int = 0  # uploads under keys of peers without an announcement (not read)


@dataclass(frozen=True, kw_only=True)
class AgreementRecord:
    """One step of a window's agreement among several validators, as this validator saw it:
    ``event`` is ``proposed``, ``endorsed``, ``objected`` (``detail``: the reasons, one per line),
    ``handover`` (view ``view`` began without a proposal it could endorse) or ``certified``
    (``detail``: the signers, comma-separated); ``validator`` is whose step it was."""

    window: int
    validator: str
    event: str
    digest: str = ""
    view: int = 0
    detail: str | None = None
    at: float | None = None


AGREEMENT_EVENTS = ("proposed", "endorsed", "objected", "handover", "certified")


@dataclass(frozen=True, kw_only=True)
class EvaluationRecord:
    """θ after window ``window``'s aggregate, scored on the validation split (loss in nats/token)."""

    window: int
    fingerprint: str
    sequences: int
    tokens: int
    bytes: int
    loss: float
    perplexity: float
    bits_per_byte: float
    evaluated_at: float
    seconds: float


# Every check a row can name (validator/reasons.py's CHECKS), in the order the validator runs them;
# a row's checks are kept as a bit mask over this tuple, so names are only ever appended (a test pins
# the positions).
CHECK_BITS = (
    "size",
    "format",
    "signature",
    "run",
    "window",
    "registered",
    "codec",
    "schema",
    "finite",
    "sync",
    "excluded",
    "immutable",
    "norm",
    "copy",
    "score",
    "probation",
    "capacity",
    "stable",
    "fetch",
    "deadline",
)
_BIT = {name: i for i, name in enumerate(CHECK_BITS)}


def pack_checks(rows: Iterable[CheckRow], reason: str | None) -> tuple[int, str | None] | None:
    """(mask of the passed checks, the failed one) when ``rows`` are in the usual form — known
    checks in :data:`CHECK_BITS` order, at most one failing, last, with the row's ``reason`` —
    else None (such rows are kept one by one). One narrow column instead of a row per check."""
    mask, last, failed = 0, -1, None
    for c in rows:
        bit = _BIT.get(c.name)
        if failed is not None or bit is None or bit <= last:
            return None
        if c.passed and c.reason is None:
            mask |= 1 << bit
        elif not c.passed and c.reason == reason:
            failed = c.name
        else:
            return None
        last = bit
    return mask, failed


def unpack_checks(mask: int, failed: str | None, reason: str | None) -> tuple[CheckRow, ...]:
    """The check rows :func:`pack_checks` packed."""
    rows = [CheckRow(name, True) for i, name in enumerate(CHECK_BITS) if mask >> i & 1]
    return (*rows, CheckRow(failed, False, reason)) if failed is not None else tuple(rows)


CONTRIBUTION_COLUMNS = tuple(f.name for f in fields(ContributionRecord) if f.name != "checks")
WINDOW_COLUMNS = tuple(f.name for f in fields(WindowRecord))
EVALUATION_COLUMNS = tuple(f.name for f in fields(EvaluationRecord))
AGREEMENT_COLUMNS = tuple(f.name for f in fields(AgreementRecord))
# a contributions row as :func:`decode_contribution` reads it: the record's columns, then its checks
CONTRIBUTION_SELECT = ", ".join([*CONTRIBUTION_COLUMNS, "passed", "failed"])


def decode_contribution(row: Sequence[Any], checks: Iterable[CheckRow] = ()) -> ContributionRecord:
    """A ``contributions`` row selected as :data:`CONTRIBUTION_SELECT`, as its record: its checks
    unpacked from the bit mask, or ``checks`` (its rows in the ``checks`` table) where it has none."""
    n = len(CONTRIBUTION_COLUMNS)
    values = dict(zip(CONTRIBUTION_COLUMNS, row[:n]))
    values["accepted"] = bool(values["accepted"])
    passed, failed = row[n], row[n + 1]
    found = tuple(checks) if passed is None else unpack_checks(passed, failed, values["reason"])
    return ContributionRecord(**values, checks=found)


def where(
    peer: str | None,
    windows: tuple[int | None, int | None],
    *,
    rejected_only: bool = False,
    decided_only: bool = True,
    exact_peer: bool = False,
) -> tuple[str, list[Any]]:
    """A ``WHERE`` clause over ``contributions`` and its arguments: one peer (by exact id, or by a
    prefix of it as the command line takes), an inclusive window range with either end open (None),
    rejected rows only, decided rows only; an empty clause where nothing is filtered."""
    clauses: list[str] = []
    args: list[Any] = []
    if decided_only:
        clauses.append("decided = 1")
    if peer is not None and exact_peer:
        clauses.append("peer = ?")
        args.append(peer)
    elif peer is not None:
        clauses.append("peer LIKE ?")  # a prefix of a peer id is enough on the command line
        args.append(peer + "%")
    lo, hi = windows
    if lo is not None:
        clauses.append("window >= ?")
        args.append(lo)
    if hi is not None:
        clauses.append("window <= ?")
        args.append(hi)
    if rejected_only:
        clauses.append("accepted = 0")
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", args


class ContributionLog:
    """The SQLite contribution log. Safe to share between threads (one connection, one lock)."""

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        """Open (creating it if needed) the log at ``path``. ``readonly=True`` opens an existing
        log through a read-only connection: no schema change, every write raises
        :class:`sqlite3.OperationalError`, and a validator may keep writing meanwhile (WAL)."""
        self.path = str(path)
        self._lock = threading.Lock()
        if readonly:
            uri = Path(self.path).resolve().as_uri() + "?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
            return
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a decided window must survive a power cut
        self._db.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Add the columns a log written by an older version lacks (its rows keep their checks in
        the ``checks`` table, where they are read from)."""
        have = {row[1] for row in self._db.execute("PRAGMA table_info(windows)")}
        if "unannounced" not in have:
            self._db.execute("ALTER TABLE windows ADD COLUMN unannounced INTEGER NOT NULL DEFAULT 0")
        have = {row[1] for row in self._db.execute("PRAGMA table_info(contributions)")}
        for column in ("passed INTEGER", "failed TEXT"):
            if column.split()[0] not in have:
                self._db.execute(f"ALTER TABLE contributions ADD COLUMN {column}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ContributionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writes
    def note_received(
        self, window: int, peer: str, *, received_at: float, nbytes: int | None, digest: str | None = None
    ) -> tuple[float, str | None]:
        """Remember when a contribution's bytes were first read and their digest; returns the
        first (time, digest) (kept across restarts, so the later uploader of a copied pair stays
        the later one, and bytes replaced at the key are noticed)."""
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO contributions (window, peer, received_at, bytes, digest) VALUES (?, ?, ?, ?, ?)",
                (window, peer, received_at, nbytes, digest),
            )
            self._db.execute(
                "UPDATE contributions SET digest = ? WHERE window = ? AND peer = ? AND digest IS NULL AND decided = 0",
                (digest, window, peer),
            )
            row = self._db.execute(
                "SELECT received_at, digest FROM contributions WHERE window = ? AND peer = ?", (window, peer)
            ).fetchone()
        first = float(row[0]) if row and row[0] is not None else received_at
        return first, (row[1] if row else digest)

    def record_window(self, win: WindowRecord, rows: Iterable[ContributionRecord]) -> None:
        """Write a window's decisions atomically: all rows and the window record, or nothing."""
        rows = list(rows)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for rec in rows:
                    self._upsert_contribution(rec)
                self._db.execute(
                    f"INSERT OR REPLACE INTO windows ({', '.join(WINDOW_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(WINDOW_COLUMNS))})",
                    [getattr(win, c) for c in WINDOW_COLUMNS],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def record_rows(self, rows: Iterable[ContributionRecord]) -> None:
        """Add or replace decided rows outside a window's commit (late uploads)."""
        rows = list(rows)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for rec in rows:
                    self._upsert_contribution(rec)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def forget_window(self, window: int) -> None:
        """Drop a window's decided rows and record (a decision that was not the one certified);
        the times uploads were first read stay."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM checks WHERE window = ?", (window,))
                self._db.execute("DELETE FROM contributions WHERE window = ? AND received_at IS NULL", (window,))
                self._db.execute(
                    "UPDATE contributions SET decided = 0, accepted = 0, reason = NULL, detail = NULL, score = NULL, "
                    "weight = 0, passed = NULL, failed = NULL WHERE window = ?",
                    (window,),
                )
                self._db.execute("DELETE FROM windows WHERE window = ?", (window,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def mark_published(self, window: int, *, digest: str, published_at: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE windows SET status = 'published', aggregate_digest = ?, published_at = ? WHERE window = ?",
                (digest, published_at, window),
            )

    def record_agreement(self, records: Iterable[AgreementRecord]) -> None:
        """Add what was seen of a window's agreement; a step seen again keeps its first time."""
        with self._lock:
            for rec in records:
                self._db.execute(
                    f"INSERT OR IGNORE INTO agreement ({', '.join(AGREEMENT_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(AGREEMENT_COLUMNS))})",
                    [getattr(rec, c) for c in AGREEMENT_COLUMNS],
                )

    def agreement(self, windows: tuple[int | None, int | None] = (None, None)) -> list[AgreementRecord]:
        """The agreement steps of the windows in the inclusive range, by (window, time)."""
        lo, hi = windows
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(AGREEMENT_COLUMNS)} FROM agreement WHERE window >= ? AND window <= ? "
                "ORDER BY window, at, validator, event",
                (-1 if lo is None else lo, 2**62 if hi is None else hi),
            ).fetchall()
        return [AgreementRecord(**dict(zip(AGREEMENT_COLUMNS, row, strict=True))) for row in rows]

    def record_evaluation(self, rec: EvaluationRecord) -> None:
        """Add (or, for a window evaluated again, replace) a periodic evaluation."""
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO evaluations ({', '.join(EVALUATION_COLUMNS)}) VALUES ({', '.join('?' * len(EVALUATION_COLUMNS))})",
                [getattr(rec, c) for c in EVALUATION_COLUMNS],
            )

    def _upsert_contribution(self, rec: ContributionRecord) -> None:
        values = {c: getattr(rec, c) for c in CONTRIBUTION_COLUMNS}
        values["accepted"] = int(rec.accepted)
        # keep the first-seen time recorded during gathering
        old = self._db.execute(
            "SELECT received_at FROM contributions WHERE window = ? AND peer = ?", (rec.window, rec.peer)
        ).fetchone()
        if old and old[0] is not None:
            values["received_at"] = old[0]
        packed = pack_checks(rec.checks, rec.reason)
        passed, failed = packed if packed is not None else (None, None)
        cols = [*values, "decided", "passed", "failed"]
        self._db.execute(
            f"INSERT OR REPLACE INTO contributions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
            [*values.values(), 1, passed, failed],
        )
        self._db.execute("DELETE FROM checks WHERE window = ? AND peer = ?", (rec.window, rec.peer))
        if packed is None:  # not in the usual form: kept row by row
            self._db.executemany(
                "INSERT INTO checks (window, peer, name, passed, reason) VALUES (?, ?, ?, ?, ?)",
                [(rec.window, rec.peer, c.name, int(c.passed), c.reason) for c in rec.checks],
            )

    # ------------------------------------------------------------------ reads
    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """The connection under the log's lock, for the statements of one read (the read model's
        queries, :class:`validator.logview.LogView`); nothing is written through it."""
        with self._lock:
            yield self._db

    def window(self, window: int) -> WindowRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {', '.join(WINDOW_COLUMNS)} FROM windows WHERE window = ?", (window,)
            ).fetchone()
        return WindowRecord(**dict(zip(WINDOW_COLUMNS, row))) if row else None

    def rows(
        self,
        *,
        peer: str | None = None,
        windows: tuple[int | None, int | None] = (None, None),
        rejected_only: bool = False,
        decided_only: bool = True,
    ) -> list[ContributionRecord]:
        """Decided contributions ordered by (window, peer); filters combine with AND.
        ``windows`` is an inclusive range, either end open (None); ``peer`` is a prefix of an id."""
        clause, args = where(peer, windows, rejected_only=rejected_only, decided_only=decided_only)
        unpacked = f"{clause} AND passed IS NULL" if clause else "WHERE passed IS NULL"
        with self._lock:
            raw = self._db.execute(
                f"SELECT {CONTRIBUTION_SELECT} FROM contributions {clause} ORDER BY window, peer", args
            ).fetchall()
            checks = self._db.execute(
                f"SELECT window, peer, name, passed, reason FROM checks WHERE (window, peer) IN "
                f"(SELECT window, peer FROM contributions {unpacked}) ORDER BY rowid",
                args,
            ).fetchall()
        by_key: dict[tuple[int, str], list[CheckRow]] = {}
        for w, p, name, passed, reason in checks:
            by_key.setdefault((w, p), []).append(CheckRow(name, bool(passed), reason))
        return [decode_contribution(r, by_key.get((r[0], r[1]), ())) for r in raw]
