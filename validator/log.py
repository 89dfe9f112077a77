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

Reads for the dashboard (``sparseloco-validator dashboard``) are bounded: a page of peers, one
peer's rows a page at a time, windows summed into at most a few hundred chart points, counts per
rejection reason. Open the log with ``readonly=True`` where nothing may be written:

    log = ContributionLog("state/contributions.sqlite", readonly=True)
    log.peer_summaries(limit=50, offset=0)      # the leaderboard, best first, with first/last seen
    log.window_buckets(points=300)              # val loss and outcomes per window (or per bucket)
    log.rejection_reasons()                     # [ReasonCount(reason, rejections, peers, last_window)]
    log.pending(after=7)                        # uploads read after window 7, not decided yet

Tables: ``contributions`` (one narrow row per contribution: its checks are a bit mask over
:data:`CHECK_BITS` and the name of the one that failed, whose reason is the row's), ``checks``
(window, peer, check, passed, reason: only rows whose checks are not in that form, and rows written
by older versions), ``windows``, and
``evaluations`` (the periodic evaluation of θ, ``sparseloco-validator run --eval-every N``):

    log.record_evaluation(EvaluationRecord(window=9, loss=1.9, perplexity=6.7, bits_per_byte=2.7, ...))
    log.evaluations(windows=(0, None))
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from protocol.outcomes import PeerOutcome

__all__ = [
    "CHECK_BITS",
    "LOG_FILE",
    "CheckRow",
    "ContributionLog",
    "ContributionRecord",
    "EvaluationRecord",
    "LeaderRow",
    "PeerSummary",
    "ReasonCount",
    "Received",
    "WindowBucket",
    "WindowRecord",
    "pack_checks",
    "unpack_checks",
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


@dataclass(frozen=True, kw_only=True)
class LeaderRow:
    """A peer's standing over the selected windows (``logs --summary``)."""

    peer: str
    windows: int
    accepted: int
    acceptance_rate: float
    mean_score: float | None
    reputation: float | None
    last_window: int


@dataclass(frozen=True, kw_only=True)
class PeerSummary:
    """A peer's standing and when it was seen: a leaderboard row of the dashboard. Times are unix
    seconds of the first read of its earliest and latest uploads (None for rows without one)."""

    peer: str
    windows: int
    accepted: int
    acceptance_rate: float
    mean_score: float | None
    reputation: float | None  # of its latest decided row, whatever the window range
    first_window: int
    last_window: int
    first_seen: float | None
    last_seen: float | None

    def leader_row(self) -> LeaderRow:
        return LeaderRow(
            peer=self.peer,
            windows=self.windows,
            accepted=self.accepted,
            acceptance_rate=self.acceptance_rate,
            mean_score=self.mean_score,
            reputation=self.reputation,
            last_window=self.last_window,
        )


@dataclass(frozen=True, kw_only=True)
class WindowBucket:
    """Windows ``first``..``last`` taken together for a chart (one window each while they fit):
    their mean validation loss and their summed outcomes."""

    first: int
    last: int
    windows: int  # window rows in the bucket
    val_loss: float | None  # mean over those that have one
    accepted: int
    rejected: int
    unannounced: int


@dataclass(frozen=True, kw_only=True)
class ReasonCount:
    """How often one rejection reason was given, to how many peers, and last when."""

    reason: str
    rejections: int
    peers: int
    last_window: int


@dataclass(frozen=True, kw_only=True)
class Received:
    """An upload read in a window that is not decided yet (what gathering has seen so far)."""

    window: int
    peer: str
    received_at: float | None
    bytes: int | None


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


_CONTRIB_COLS = [f.name for f in fields(ContributionRecord) if f.name != "checks"]
_WINDOW_COLS = [f.name for f in fields(WindowRecord)]
_EVAL_COLS = [f.name for f in fields(EvaluationRecord)]


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
                    f"INSERT OR REPLACE INTO windows ({', '.join(_WINDOW_COLS)}) "
                    f"VALUES ({', '.join('?' * len(_WINDOW_COLS))})",
                    [getattr(win, c) for c in _WINDOW_COLS],
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

    def mark_published(self, window: int, *, digest: str, published_at: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE windows SET status = 'published', aggregate_digest = ?, published_at = ? WHERE window = ?",
                (digest, published_at, window),
            )

    def record_evaluation(self, rec: EvaluationRecord) -> None:
        """Add (or, for a window evaluated again, replace) a periodic evaluation."""
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO evaluations ({', '.join(_EVAL_COLS)}) VALUES ({', '.join('?' * len(_EVAL_COLS))})",
                [getattr(rec, c) for c in _EVAL_COLS],
            )

    def _upsert_contribution(self, rec: ContributionRecord) -> None:
        values = {c: getattr(rec, c) for c in _CONTRIB_COLS}
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
    def window(self, window: int) -> WindowRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {', '.join(_WINDOW_COLS)} FROM windows WHERE window = ?", (window,)
            ).fetchone()
        return WindowRecord(**dict(zip(_WINDOW_COLS, row))) if row else None

    def windows(self) -> list[WindowRecord]:
        """Every window row, oldest first (``sparseloco-validator logs --windows``)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(_WINDOW_COLS)} FROM windows ORDER BY window").fetchall()
        return [WindowRecord(**dict(zip(_WINDOW_COLS, r))) for r in rows]

    def evaluations(self, *, windows: tuple[int | None, int | None] = (None, None)) -> list[EvaluationRecord]:
        """Periodic evaluations by window; ``windows`` is an inclusive range, either end open."""
        lo, hi = windows
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_EVAL_COLS)} FROM evaluations "
                "WHERE (? IS NULL OR window >= ?) AND (? IS NULL OR window <= ?) ORDER BY window",
                (lo, lo, hi, hi),
            ).fetchall()
        return [EvaluationRecord(**dict(zip(_EVAL_COLS, r))) for r in rows]

    def rows(
        self,
        *,
        peer: str | None = None,
        windows: tuple[int | None, int | None] = (None, None),
        rejected_only: bool = False,
        decided_only: bool = True,
    ) -> list[ContributionRecord]:
        """Decided contributions ordered by (window, peer); filters combine with AND.
        ``windows`` is an inclusive range, either end open (None)."""
        where, args = self._filters(peer, windows, rejected_only, decided_only)
        unpacked = f"{where} AND passed IS NULL" if where else "WHERE passed IS NULL"
        with self._lock:
            raw = self._db.execute(
                f"SELECT {', '.join(_CONTRIB_COLS)}, passed, failed FROM contributions {where} ORDER BY window, peer",
                args,
            ).fetchall()
            checks = self._db.execute(
                f"SELECT window, peer, name, passed, reason FROM checks WHERE (window, peer) IN "
                f"(SELECT window, peer FROM contributions {unpacked}) ORDER BY rowid",
                args,
            ).fetchall()
        by_key: dict[tuple[int, str], list[CheckRow]] = {}
        for w, p, name, passed, reason in checks:
            by_key.setdefault((w, p), []).append(CheckRow(name, bool(passed), reason))
        out = []
        n = len(_CONTRIB_COLS)
        for r in raw:
            values = dict(zip(_CONTRIB_COLS, r[:n]))
            values["accepted"] = bool(values["accepted"])
            passed, failed = r[n], r[n + 1]
            rows = (
                tuple(by_key.get((values["window"], values["peer"]), ()))
                if passed is None
                else unpack_checks(passed, failed, values["reason"])
            )
            out.append(ContributionRecord(**values, checks=rows))
        return out

    def leaderboard(self, *, windows: tuple[int | None, int | None] = (None, None)) -> list[LeaderRow]:
        """Per peer: windows contributed, accepted, acceptance rate, mean score, last reputation;
        highest reputation first, then most accepted, then by peer id."""
        return [s.leader_row() for s in self.peer_summaries(windows=windows)]

    def peer_summaries(
        self,
        *,
        windows: tuple[int | None, int | None] = (None, None),
        peer: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[PeerSummary]:
        """The leaderboard with first/last seen, ordered as :meth:`leaderboard`; ``peer`` picks one
        peer by its exact id, ``limit``/``offset`` a page. Read from the ``contributions_standing``
        index alone, so its cost grows with the rows but never touches the table."""
        where, args = self._filters(peer, windows, False, True, exact_peer=True)
        with self._lock:
            raw = self._db.execute(
                f"""SELECT peer, COUNT(*), SUM(accepted) AS acc, AVG(score), MIN(window), MAX(window),
                    MIN(received_at), MAX(received_at),
                    (SELECT c2.reputation FROM contributions c2 WHERE c2.peer = c.peer AND c2.decided = 1
                     ORDER BY c2.window DESC LIMIT 1) AS rep
                    FROM contributions c {where} GROUP BY peer
                    ORDER BY COALESCE(rep, 0.0) DESC, acc DESC, peer LIMIT ? OFFSET ?""",
                [*args, -1 if limit is None else limit, offset],
            ).fetchall()
        return [
            PeerSummary(
                peer=p,
                windows=n,
                accepted=int(acc or 0),
                acceptance_rate=(acc or 0) / n,
                mean_score=score,
                reputation=rep,
                first_window=first,
                last_window=last,
                first_seen=seen0,
                last_seen=seen1,
            )
            for p, n, acc, score, first, last, seen0, seen1, rep in raw
        ]

    def peer_count(self, *, windows: tuple[int | None, int | None] = (None, None)) -> int:
        """How many peers have a decided row in ``windows`` (the leaderboard's length)."""
        where, args = self._filters(None, windows, False, True)
        with self._lock:
            (n,) = self._db.execute(f"SELECT COUNT(DISTINCT peer) FROM contributions {where}", args).fetchone()
        return int(n)

    def history(self, peer: str, *, limit: int, offset: int = 0) -> list[ContributionRecord]:
        """One peer's decided rows (exact id), newest window first, a page at a time."""
        with self._lock:
            raw = self._db.execute(
                f"SELECT {', '.join(_CONTRIB_COLS)}, passed, failed FROM contributions WHERE peer = ? AND decided = 1 "
                "ORDER BY window DESC LIMIT ? OFFSET ?",
                (peer, limit, offset),
            ).fetchall()
            n = len(_CONTRIB_COLS)
            # rows packed as a bit mask need no read of the checks table
            checks = [
                self._db.execute(
                    "SELECT name, passed, reason FROM checks WHERE window = ? AND peer = ? ORDER BY rowid",
                    (r[0], r[1]),
                ).fetchall()
                if r[n] is None
                else []
                for r in raw
            ]
        out = []
        for r, rows in zip(raw, checks):
            values = dict(zip(_CONTRIB_COLS, r[:n]))
            values["accepted"] = bool(values["accepted"])
            passed, failed = r[n], r[n + 1]
            found = (
                tuple(CheckRow(name, bool(ok), reason) for name, ok, reason in rows)
                if passed is None
                else unpack_checks(passed, failed, values["reason"])
            )
            out.append(ContributionRecord(**values, checks=found))
        return out

    def rejection_reasons(
        self, *, windows: tuple[int | None, int | None] = (None, None), peer: str | None = None
    ) -> list[ReasonCount]:
        """Rejections per reason (most frequent first) over ``windows``, of one peer (exact id) or
        of all; from the ``contributions_rejected`` index."""
        where, args = self._filters(peer, windows, True, True, exact_peer=True)
        with self._lock:
            raw = self._db.execute(
                f"SELECT COALESCE(reason, ''), COUNT(*), COUNT(DISTINCT peer), MAX(window) FROM contributions {where} "
                "GROUP BY reason ORDER BY COUNT(*) DESC, reason",
                args,
            ).fetchall()
        return [ReasonCount(reason=r, rejections=n, peers=p, last_window=w) for r, n, p, w in raw]

    def window_span(self) -> tuple[int, int | None, int | None]:
        """(window rows, first window, last window) of the log."""
        with self._lock:
            n, lo, hi = self._db.execute("SELECT COUNT(*), MIN(window), MAX(window) FROM windows").fetchone()
        return int(n), lo, hi

    def latest_window(self) -> WindowRecord | None:
        """The newest window row (decided or published), or None before the first."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {', '.join(_WINDOW_COLS)} FROM windows ORDER BY window DESC LIMIT 1"
            ).fetchone()
        return WindowRecord(**dict(zip(_WINDOW_COLS, row))) if row else None

    def recent_windows(self, limit: int) -> list[WindowRecord]:
        """The newest ``limit`` window rows, newest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_WINDOW_COLS)} FROM windows ORDER BY window DESC LIMIT ?", (limit,)
            ).fetchall()
        return [WindowRecord(**dict(zip(_WINDOW_COLS, r))) for r in rows]

    def window_buckets(
        self, *, windows: tuple[int | None, int | None] = (None, None), points: int = 300
    ) -> list[WindowBucket]:
        """Window rows in ``windows`` as at most ``points`` buckets of equally many consecutive
        windows (one window per bucket while they fit), oldest first: summed in SQL, so a chart of
        10,000 windows reads a few hundred rows."""
        lo, hi = windows
        with self._lock:
            first, last = self._db.execute(
                "SELECT MIN(window), MAX(window) FROM windows WHERE (? IS NULL OR window >= ?) AND (? IS NULL OR window <= ?)",
                (lo, lo, hi, hi),
            ).fetchone()
            if first is None:
                return []
            size = -(-(last - first + 1) // max(1, points))  # windows per bucket, rounded up
            raw = self._db.execute(
                "SELECT MIN(window), MAX(window), COUNT(*), AVG(val_loss), SUM(accepted), SUM(rejected), "
                "SUM(unannounced) FROM windows WHERE window >= ? AND window <= ? GROUP BY (window - ?) / ? ORDER BY 1",
                (first, last, first, size),
            ).fetchall()
        return [
            WindowBucket(first=a, last=b, windows=n, val_loss=loss, accepted=acc, rejected=rej, unannounced=un)
            for a, b, n, loss, acc, rej, un in raw
        ]

    def pending(self, *, after: int | None) -> list[Received]:
        """Uploads read but not decided yet in windows after ``after`` (every window when None):
        what the validator has gathered so far in the window it has open."""
        # a plain range on the primary key: "(? IS NULL OR window > ?)" would scan the whole table
        since = "window > ? AND " if after is not None else ""
        with self._lock:
            raw = self._db.execute(
                f"SELECT window, peer, received_at, bytes FROM contributions WHERE {since}decided = 0 "
                "ORDER BY window, received_at, peer",
                [after] if after is not None else [],
            ).fetchall()
        return [Received(window=w, peer=p, received_at=t, bytes=b) for w, p, t, b in raw]

    def peers_in(self, window: int) -> list[str]:
        """Peers with a decided row in ``window``."""
        with self._lock:
            raw = self._db.execute(
                "SELECT peer FROM contributions WHERE window = ? AND decided = 1 ORDER BY peer", (window,)
            ).fetchall()
        return [p for (p,) in raw]

    @staticmethod
    def _filters(
        peer: str | None,
        windows: tuple[int | None, int | None],
        rejected_only: bool,
        decided_only: bool,
        *,
        exact_peer: bool = False,
    ) -> tuple[str, list[Any]]:
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
