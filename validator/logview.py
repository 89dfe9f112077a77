"""The contribution log's read model: the queries the dashboard, ``sparseloco-validator logs`` and
``logs --plot`` read it with, and the summary rows they return.

Reads are bounded where a log grows without end: a page of peers, one peer's rows a page at a time,
windows summed into at most a few hundred chart points, counts per rejection reason. Open a log
read-only (no schema change, every write refused, and a validator may keep writing it meanwhile:
WAL), or read a :class:`~validator.log.ContributionLog` that is open already:

    with LogView.open("state/contributions.sqlite") as log:
        log.peer_summaries(limit=50, offset=0)      # the leaderboard, best first, with first/last seen
        log.window_buckets(points=300)              # val loss and outcomes per window (or per bucket)
        log.rejection_reasons()                     # [ReasonCount(reason, rejections, peers, last_window)]
        log.pending(after=7)                        # uploads read after window 7, not decided yet
        log.evaluations(windows=(0, None))          # the periodic evaluations of θ
        log.agreements(windows=(0, None))           # runs with several validators: who led, who signed
    LogView(validator.log).leaderboard()

The schema, the row encoding and the validator's writes are :mod:`validator.log`'s; every query here
runs through :meth:`ContributionLog.reading`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from validator.log import (
    CONTRIBUTION_SELECT,
    EVALUATION_COLUMNS,
    WINDOW_COLUMNS,
    AgreementRecord,
    CheckRow,
    ContributionLog,
    ContributionRecord,
    EvaluationRecord,
    WindowRecord,
    decode_contribution,
    where,
)

__all__ = [
    "AgreementSummary",
    "LeaderRow",
    "LogView",
    "Objected",
    "PeerSummary",
    "ReasonCount",
    "Received",
    "WindowBucket",
    "summarize_agreement",
]


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


@dataclass(frozen=True, kw_only=True)
class Objected:
    """An objection seen in a window: ``validator`` refused the proposal of ``proposer`` (its
    ``digest``, of view ``view``) for ``reasons`` (one line each: check, peer, numbers)."""

    validator: str
    proposer: str
    view: int
    digest: str
    reasons: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class AgreementSummary:
    """One window's agreement among several validators, as this validator's log saw it: the
    ``leader`` whose proposal was certified and its ``view`` ("" / None until one was), the
    ``signers`` of the certificate, every proposal (proposer → view), the endorsements (validator →
    the digest it endorsed), the objections with their reasons and the handovers (the views a
    validator began leading in). A run with one validator has none of these rows."""

    window: int
    certified: bool
    leader: str
    view: int | None
    digest: str
    signers: tuple[str, ...]
    proposals: dict[str, int]
    endorsements: dict[str, str]
    objections: tuple[Objected, ...]
    handovers: tuple[tuple[str, int], ...]  # (validator, view)


def summarize_agreement(records: list[AgreementRecord]) -> list[AgreementSummary]:
    """The steps of :meth:`ContributionLog.agreement` taken together per window, by window."""
    by_window: dict[int, list[AgreementRecord]] = {}
    for rec in records:
        by_window.setdefault(rec.window, []).append(rec)
    return [_summary(w, recs) for w, recs in sorted(by_window.items())]


def _summary(window: int, recs: list[AgreementRecord]) -> AgreementSummary:
    proposer_of = {r.digest: r.validator for r in recs if r.event == "proposed" and r.digest}
    proposals = {r.validator: r.view for r in recs if r.event == "proposed"}
    certified = next((r for r in recs if r.event == "certified"), None)
    objections = tuple(
        Objected(
            validator=r.validator,
            proposer=proposer_of.get(r.digest, r.validator if not r.digest else ""),
            view=r.view,
            digest=r.digest,
            reasons=tuple(line for line in (r.detail or "").splitlines() if line),
        )
        for r in recs
        if r.event == "objected"
    )
    return AgreementSummary(
        window=window,
        certified=certified is not None,
        leader=proposer_of.get(certified.digest, "") if certified is not None else "",
        view=certified.view if certified is not None else None,
        digest=certified.digest if certified is not None else "",
        signers=tuple(s for s in (certified.detail or "").split(",") if s) if certified is not None else (),
        proposals=proposals,
        endorsements={r.validator: r.digest for r in recs if r.event == "endorsed"},
        objections=objections,
        handovers=tuple(sorted({(r.validator, r.view) for r in recs if r.event == "handover"}, key=lambda h: h[1])),
    )


class LogView:
    """Queries over an open contribution log; closes it on :meth:`close` only when it opened it."""

    def __init__(self, log: ContributionLog, *, owned: bool = False) -> None:
        self._log = log
        self._owned = owned

    @classmethod
    def open(cls, path: str | Path) -> LogView:
        """The log at ``path`` (which must exist) through a read-only connection."""
        return cls(ContributionLog(path, readonly=True), owned=True)

    def close(self) -> None:
        if self._owned:
            self._log.close()

    def __enter__(self) -> LogView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ rows and windows
    def window(self, window: int) -> WindowRecord | None:
        return self._log.window(window)

    def rows(
        self,
        *,
        peer: str | None = None,
        windows: tuple[int | None, int | None] = (None, None),
        rejected_only: bool = False,
        decided_only: bool = True,
    ) -> list[ContributionRecord]:
        """Decided contributions by (window, peer): :meth:`ContributionLog.rows`."""
        return self._log.rows(peer=peer, windows=windows, rejected_only=rejected_only, decided_only=decided_only)

    def windows(self) -> list[WindowRecord]:
        """Every window row, oldest first (``sparseloco-validator logs --windows``)."""
        with self._log.reading() as db:
            rows = db.execute(f"SELECT {', '.join(WINDOW_COLUMNS)} FROM windows ORDER BY window").fetchall()
        return [WindowRecord(**dict(zip(WINDOW_COLUMNS, r))) for r in rows]

    def evaluations(self, *, windows: tuple[int | None, int | None] = (None, None)) -> list[EvaluationRecord]:
        """Periodic evaluations by window; ``windows`` is an inclusive range, either end open."""
        lo, hi = windows
        with self._log.reading() as db:
            rows = db.execute(
                f"SELECT {', '.join(EVALUATION_COLUMNS)} FROM evaluations "
                "WHERE (? IS NULL OR window >= ?) AND (? IS NULL OR window <= ?) ORDER BY window",
                (lo, lo, hi, hi),
            ).fetchall()
        return [EvaluationRecord(**dict(zip(EVALUATION_COLUMNS, r))) for r in rows]

    def agreements(
        self, *, windows: tuple[int | None, int | None] = (None, None), limit: int | None = None
    ) -> list[AgreementSummary]:
        """The agreement of each window in ``windows`` that has agreement steps (none with one
        validator), by window; ``limit``: only the newest that many windows."""
        lo, hi = windows
        with self._log.reading() as db:
            # a log of an older version opened read-only has no agreement table
            if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'agreement'").fetchone():
                return []
        if limit is not None:
            with self._log.reading() as db:
                newest = db.execute(
                    "SELECT DISTINCT window FROM agreement WHERE window >= ? AND window <= ? "
                    "ORDER BY window DESC LIMIT ?",
                    (-1 if lo is None else lo, 2**62 if hi is None else hi, limit),
                ).fetchall()
            if not newest:
                return []
            lo = newest[-1][0]
        return summarize_agreement(self._log.agreement((lo, hi)))

    def history(self, peer: str, *, limit: int, offset: int = 0) -> list[ContributionRecord]:
        """One peer's decided rows (exact id), newest window first, a page at a time."""
        with self._log.reading() as db:
            raw = db.execute(
                f"SELECT {CONTRIBUTION_SELECT} FROM contributions WHERE peer = ? AND decided = 1 "
                "ORDER BY window DESC LIMIT ? OFFSET ?",
                (peer, limit, offset),
            ).fetchall()
            # rows packed as a bit mask (``passed``, the next to last column) need no read of the checks table
            checks = [
                db.execute(
                    "SELECT name, passed, reason FROM checks WHERE window = ? AND peer = ? ORDER BY rowid",
                    (r[0], r[1]),
                ).fetchall()
                if r[-2] is None
                else []
                for r in raw
            ]
        return [
            decode_contribution(r, (CheckRow(name, bool(ok), reason) for name, ok, reason in rows))
            for r, rows in zip(raw, checks)
        ]

    # ------------------------------------------------------------------ standings
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
        clause, args = where(peer, windows, exact_peer=True)
        with self._log.reading() as db:
            raw = db.execute(
                f"""SELECT peer, COUNT(*), SUM(accepted) AS acc, AVG(score), MIN(window), MAX(window),
                    MIN(received_at), MAX(received_at),
                    (SELECT c2.reputation FROM contributions c2 WHERE c2.peer = c.peer AND c2.decided = 1
                     ORDER BY c2.window DESC LIMIT 1) AS rep
                    FROM contributions c {clause} GROUP BY peer
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
        clause, args = where(None, windows)
        with self._log.reading() as db:
            (n,) = db.execute(f"SELECT COUNT(DISTINCT peer) FROM contributions {clause}", args).fetchone()
        return int(n)

    def rejection_reasons(
        self, *, windows: tuple[int | None, int | None] = (None, None), peer: str | None = None
    ) -> list[ReasonCount]:
        """Rejections per reason (most frequent first) over ``windows``, of one peer (exact id) or
        of all; from the ``contributions_rejected`` index."""
        clause, args = where(peer, windows, rejected_only=True, exact_peer=True)
        with self._log.reading() as db:
            raw = db.execute(
                f"SELECT COALESCE(reason, ''), COUNT(*), COUNT(DISTINCT peer), MAX(window) FROM contributions {clause} "
                "GROUP BY reason ORDER BY COUNT(*) DESC, reason",
                args,
            ).fetchall()
        return [ReasonCount(reason=r, rejections=n, peers=p, last_window=w) for r, n, p, w in raw]

    # ------------------------------------------------------------------ windows for charts and the open window
    def window_span(self) -> tuple[int, int | None, int | None]:
        """(window rows, first window, last window) of the log."""
        with self._log.reading() as db:
            n, lo, hi = db.execute("SELECT COUNT(*), MIN(window), MAX(window) FROM windows").fetchone()
        return int(n), lo, hi

    def latest_window(self) -> WindowRecord | None:
        """The newest window row (decided or published), or None before the first."""
        with self._log.reading() as db:
            row = db.execute(f"SELECT {', '.join(WINDOW_COLUMNS)} FROM windows ORDER BY window DESC LIMIT 1").fetchone()
        return WindowRecord(**dict(zip(WINDOW_COLUMNS, row))) if row else None

    def recent_windows(self, limit: int) -> list[WindowRecord]:
        """The newest ``limit`` window rows, newest first."""
        with self._log.reading() as db:
            rows = db.execute(
                f"SELECT {', '.join(WINDOW_COLUMNS)} FROM windows ORDER BY window DESC LIMIT ?", (limit,)
            ).fetchall()
        return [WindowRecord(**dict(zip(WINDOW_COLUMNS, r))) for r in rows]

    def window_buckets(
        self, *, windows: tuple[int | None, int | None] = (None, None), points: int = 300
    ) -> list[WindowBucket]:
        """Window rows in ``windows`` as at most ``points`` buckets of equally many consecutive
        windows (one window per bucket while they fit), oldest first: summed in SQL, so a chart of
        10,000 windows reads a few hundred rows."""
        lo, hi = windows
        with self._log.reading() as db:
            first, last = db.execute(
                "SELECT MIN(window), MAX(window) FROM windows WHERE (? IS NULL OR window >= ?) AND (? IS NULL OR window <= ?)",
                (lo, lo, hi, hi),
            ).fetchone()
            if first is None:
                return []
            size = -(-(last - first + 1) // max(1, points))  # windows per bucket, rounded up
            raw = db.execute(
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
        with self._log.reading() as db:
            raw = db.execute(
                f"SELECT window, peer, received_at, bytes FROM contributions WHERE {since}decided = 0 "
                "ORDER BY window, received_at, peer",
                [after] if after is not None else [],
            ).fetchall()
        return [Received(window=w, peer=p, received_at=t, bytes=b) for w, p, t, b in raw]

    def peers_in(self, window: int) -> list[str]:
        """Peers with a decided row in ``window``."""
        with self._log.reading() as db:
            raw = db.execute(
                "SELECT peer FROM contributions WHERE window = ? AND decided = 1 ORDER BY peer", (window,)
            ).fetchall()
        return [p for (p,) in raw]
