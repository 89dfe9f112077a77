"""What the dashboard shows, read from the contribution log: the same values feed its HTML pages and
its JSON API (``/api/...``), so the two never disagree.

Every view is bounded whatever the log's length: a page of the leaderboard or of one peer's rows,
windows summed into at most ``points`` chart buckets in SQL, one row per rejection reason, the
newest few windows.

    with LogView.open(db) as log:
        ov = overview(log, page=1)
        ov.series.buckets[-1].val_loss, ov.current.open_window, ov.leaderboard.peers[0].reputation
        ov.agreement[0].leader, ov.agreement[0].signers     # several validators: the newest windows' agreement
        json.dumps(to_json(ov))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from validator.log import ContributionRecord, WindowRecord
from validator.logview import AgreementSummary, LogView, PeerSummary, ReasonCount, Received, WindowBucket

__all__ = [
    "CHART_POINTS",
    "MAX_PER_PAGE",
    "PER_PAGE",
    "Current",
    "Leaderboard",
    "Overview",
    "Page",
    "PeerView",
    "Series",
    "current",
    "leaderboard",
    "overview",
    "peer",
    "agreement",
    "series",
    "to_json",
]

PER_PAGE = 50  # leaderboard and history rows per page
MAX_PER_PAGE = 500
CHART_POINTS = 300  # at most this many points (buckets of windows) per chart: 2 px each
RECENT_WINDOWS = 20  # window rows in the overview's table (and windows in its agreement table)
AGREEMENT_WINDOWS = 200  # at most this many windows' agreement per /api/agreement answer
LIST_CAP = 200  # peer ids listed in the current window's box; the counts stay exact

# What the current-window box shows instead of the validator's own waiting list, which the log does
# not hold: the validator reports it only as ``window_waiting`` events.
WAITING_NOTE = (
    "The contribution log does not record whom the validator waits for: the validator reports it as "
    "window_waiting events (sparseloco-validator run --status-json). Shown instead: the uploads read so "
    "far in the open window (rows not decided yet), the peers that had a row in the last decided window "
    "and whose upload to the open window has not been read yet, and the last window's counts."
)


@dataclass(frozen=True)
class Page:
    """Page ``number`` (from 1) of ``items`` items, ``per_page`` each."""

    number: int
    per_page: int
    items: int
    pages: int

    @classmethod
    def of(cls, number: int, per_page: int, items: int) -> Page:
        pages = max(1, -(-items // per_page))
        return cls(number=number, per_page=per_page, items=items, pages=pages)

    @property
    def offset(self) -> int:
        return (self.number - 1) * self.per_page


@dataclass(frozen=True)
class Leaderboard:
    """One page of peers, best first (reputation, then accepted windows, then id)."""

    page: Page
    peers: list[PeerSummary]


@dataclass(frozen=True)
class PeerView:
    """One peer: its standing, its rejections by reason, and a page of its rows (newest first)."""

    summary: PeerSummary
    reasons: list[ReasonCount]
    page: Page
    history: list[ContributionRecord]


@dataclass(frozen=True)
class Series:
    """Window rows as chart buckets: ``windows`` rows from ``first`` to ``last``, ``per_bucket``
    consecutive windows per bucket (1 while they fit in the chart)."""

    windows: int
    first: int | None
    last: int | None
    per_bucket: int
    buckets: list[WindowBucket]


@dataclass(frozen=True)
class Current:
    """Where the validator stands, as far as the log tells.

    ``last`` is the newest decided (or published) window; ``open_window`` the one after it, which
    the validator gathers now. ``uploaded`` are the uploads read so far in the open window;
    ``not_read`` the peers among the ``last_peers`` with a row in ``last`` whose upload to the open
    window has not been read (lists hold at most ``LIST_CAP``; the totals count all). ``waiting_recorded`` says whether the log
    holds the validator's own list of whom it waits for (it does not; ``shown`` says what is shown).
    """

    last: WindowRecord | None
    open_window: int | None
    uploaded: list[Received]
    uploaded_total: int
    last_peers: int
    not_read: list[str]
    not_read_total: int
    waiting_recorded: bool
    shown: str


@dataclass(frozen=True)
class Overview:
    """The dashboard's main page."""

    current: Current
    leaderboard: Leaderboard
    series: Series
    reasons: list[ReasonCount]
    recent: list[WindowRecord]
    # several validators: the newest windows' agreement, newest first (empty with one validator)
    agreement: list[AgreementSummary]


def leaderboard(log: LogView, *, page: int = 1, per_page: int = PER_PAGE) -> Leaderboard:
    """Page ``page`` of the leaderboard; a page past the end is empty."""
    pg = Page.of(page, per_page, log.peer_count())
    return Leaderboard(page=pg, peers=log.peer_summaries(limit=pg.per_page, offset=pg.offset))


def peer(log: LogView, peer_id: str, *, page: int = 1, per_page: int = PER_PAGE) -> PeerView | None:
    """The peer with exactly this id, or None when it has no decided row."""
    found = log.peer_summaries(peer=peer_id)
    if not found:
        return None
    summary = found[0]
    pg = Page.of(page, per_page, summary.windows)
    return PeerView(
        summary=summary,
        reasons=log.rejection_reasons(peer=peer_id),
        page=pg,
        history=log.history(peer_id, limit=pg.per_page, offset=pg.offset),
    )


def series(
    log: LogView, *, windows: tuple[int | None, int | None] = (None, None), points: int = CHART_POINTS
) -> Series:
    """The windows in ``windows`` (an inclusive range, either end open) as at most ``points`` buckets."""
    buckets = log.window_buckets(windows=windows, points=points)
    if not buckets:
        return Series(windows=0, first=None, last=None, per_bucket=1, buckets=[])
    per_bucket = max(b.last - b.first + 1 for b in buckets) if len(buckets) > 1 else 1
    return Series(
        windows=sum(b.windows for b in buckets),
        first=buckets[0].first,
        last=buckets[-1].last,
        per_bucket=per_bucket,
        buckets=buckets,
    )


def current(log: LogView) -> Current:
    """The open window, what was read in it so far, and the last decided window."""
    last = log.latest_window()
    pending = log.pending(after=last.window if last is not None else None)
    if last is not None:
        open_window: int | None = last.window + 1
    else:
        open_window = pending[0].window if pending else None
    read = [r for r in pending if r.window == open_window]
    seen = {r.peer for r in read}
    before = log.peers_in(last.window) if last is not None else []
    not_read = [p for p in before if p not in seen]
    return Current(
        last=last,
        open_window=open_window,
        uploaded=read[:LIST_CAP],
        uploaded_total=len(read),
        last_peers=len(before),
        not_read=not_read[:LIST_CAP],
        not_read_total=len(not_read),
        waiting_recorded=False,
        shown=WAITING_NOTE,
    )


def overview(log: LogView, *, page: int = 1, per_page: int = PER_PAGE) -> Overview:
    """Everything the main page shows."""
    return Overview(
        current=current(log),
        leaderboard=leaderboard(log, page=page, per_page=per_page),
        series=series(log),
        reasons=log.rejection_reasons(),
        recent=log.recent_windows(RECENT_WINDOWS),
        agreement=agreement(log, limit=RECENT_WINDOWS),
    )


def agreement(
    log: LogView, *, windows: tuple[int | None, int | None] = (None, None), limit: int = AGREEMENT_WINDOWS
) -> list[AgreementSummary]:
    """The agreement of the newest ``limit`` windows in ``windows`` that have one, newest first:
    who led, in which view, who signed, the objections and handovers (none with one validator)."""
    return list(reversed(log.agreements(windows=windows, limit=limit)))


def to_json(view: object) -> Any:
    """A view (or a list of them) as plain JSON values: dataclasses become objects, a row's checks a
    list of ``{name, passed, reason}``."""
    if isinstance(view, list):
        return [to_json(v) for v in view]
    if dataclasses.is_dataclass(view) and not isinstance(view, type):
        return dataclasses.asdict(view)
    raise TypeError(f"not a view: {type(view).__name__}")
