"""The dashboard's HTML pages, built from :mod:`validator.dashboard.views` values.

Everything that comes from the log (peer ids, reasons, details, digests) is escaped with
:func:`html.escape` and put in URLs percent-encoded; the pages hold no script (the server's
Content-Security-Policy allows none), and the charts are inline SVG (:mod:`validator.dashboard.svg`).
Times are UTC. A page reloads itself every ``REFRESH_S`` seconds so it follows a running validator.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from html import escape
from urllib.parse import quote

from validator.dashboard import svg
from validator.dashboard.views import PER_PAGE, Current, Overview, Page, PeerView
from validator.log import ContributionRecord, WindowRecord
from validator.logview import AgreementSummary, PeerSummary, ReasonCount

__all__ = ["REFRESH_S", "error_page", "overview_page", "peer_page", "peer_url"]

REFRESH_S = 30

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; color: #222; margin: 20px 28px; background: #fafafa; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
.muted { color: #666; } a { color: #1f5fbf; text-decoration: none; } a:hover { text-decoration: underline; }
table { border-collapse: collapse; background: #fff; } th, td { padding: 3px 8px; border-bottom: 1px solid #e3e6ea; }
th { text-align: left; background: #eef1f5; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .peer { font-family: ui-monospace, monospace; font-size: 13px; }
.box { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 10px 14px; display: inline-block;
       vertical-align: top; margin: 0 12px 12px 0; }
.chart { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; margin: 0 12px 12px 0; }
.ok { color: #2e7d32; } .bad { color: #c62828; } .pager a, .pager span { margin-right: 10px; }
.note { max-width: 760px; font-size: 12px; }
"""


def overview_page(ov: Overview, *, log_name: str) -> str:
    """The main page: current window, charts, leaderboard, rejections, recent windows."""
    body = [
        _current_box(ov.current),
        '<section id="charts"><h2>Windows</h2>',
        _series_note(ov.series.windows, ov.series.per_bucket),
        svg.loss_chart(ov.series.buckets),
        svg.outcome_chart(ov.series.buckets),
        "</section>",
        '<section id="leaderboard"><h2>Leaderboard</h2>',
        _leaderboard_table(ov.leaderboard.peers, ov.leaderboard.page),
        _pager("/", ov.leaderboard.page),
        "</section>",
        '<section id="rejections"><h2>Rejections by reason</h2>',
        svg.reasons_chart(ov.reasons),
        _reasons_table(ov.reasons),
        "</section>",
        '<section id="windows"><h2>Recent windows</h2>',
        _windows_table(ov.recent),
        "</section>",
    ]
    if ov.agreement:  # several validators; a run with one has no agreement to show
        body += [
            '<section id="agreement"><h2>Agreement</h2>',
            '<p class="muted">Per window: whose proposal the validators certified (leader, view), whose '
            "endorsements signed it, the objections with their reasons and the handovers to the next leader.</p>",
            _agreement_table(ov.agreement),
            "</section>",
        ]
    return _layout("contribution log", log_name, "/api/overview", body)


def peer_page(pv: PeerView, *, log_name: str) -> str:
    """One peer: its standing, its rejections by reason and its rows, newest first."""
    s = pv.summary
    api = f"/api/peers/{quote(s.peer, safe='')}"
    body = [
        f'<p><a href="/">← leaderboard</a></p><h2>Peer <span class="peer">{escape(s.peer)}</span></h2>',
        _peer_facts(s),
        '<section id="peer-rejections"><h2>Rejections by reason</h2>',
        _reasons_table(pv.reasons),
        "</section>",
        f'<section id="history"><h2>History ({s.windows} windows, newest first)</h2>',
        _history_table(pv.history),
        _pager(peer_url(s.peer), pv.page),
        "</section>",
    ]
    return _layout(f"peer {s.peer}", log_name, api, body)


def error_page(status: int, message: str) -> str:
    return _layout(f"{status}", "", "", [f'<p class="bad">{escape(message)}</p><p><a href="/">dashboard</a></p>'])


def peer_url(peer: str) -> str:
    return "/peer/" + quote(peer, safe="")


def _layout(title: str, log_name: str, api: str, body: Iterable[str]) -> str:
    source = f"log <code>{escape(log_name)}</code> (read-only) · " if log_name else ""
    json_link = f' · <a href="{escape(api)}">JSON</a>' if api else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        f"<title>{escape(title)} · sparseloco validator</title><style>{_STYLE}</style></head><body>"
        f"<header><h1>sparseloco validator · {escape(title)}</h1>"
        f'<p class="muted">{source}times UTC · reloads every {REFRESH_S} s{json_link}</p></header>'
        + "".join(body)
        + "</body></html>"
    )


def _current_box(c: Current) -> str:
    parts = ['<section id="current"><h2>Current window</h2>']
    if c.open_window is None:
        parts.append('<div class="box">no window yet: the log is empty</div>')
    else:
        parts.append(f'<div class="box"><div>open window <b id="open-window">{c.open_window}</b></div>')
        parts.append(f"<div>uploads read so far: <b>{c.uploaded_total}</b></div>")
        if c.last is not None:
            parts.append(
                f"<div>not read yet of the {c.last_peers} peers in window {c.last.window}: "
                f"<b>{c.not_read_total}</b></div>"
            )
        parts.append("</div>")
        if c.last is not None:
            parts.append(_last_window_box(c.last))
        if c.uploaded or c.not_read:
            parts.append('<div class="box"><table><tr><th>peer</th><th>upload to the open window</th></tr>')
            for r in c.uploaded:
                parts.append(f"<tr><td>{_peer_link(r.peer)}</td><td>read at {_time(r.received_at)}</td></tr>")
            for p in c.not_read:
                parts.append(f'<tr><td>{_peer_link(p)}</td><td class="muted">not read yet</td></tr>')
            parts.append("</table></div>")
    parts.append(f'<p class="note muted">{escape(c.shown)}</p></section>')
    return "".join(parts)


def _last_window_box(w: WindowRecord) -> str:
    loss = f"{w.val_loss:.4f}" if w.val_loss is not None else "–"
    return (
        f'<div class="box" id="last-window"><div>last window <b>{w.window}</b> ({escape(w.status)}, '
        f"closed {_time(w.closed_at)})</div>"
        f'<div>announced peers read: <b>{w.accepted + w.rejected}</b> (<span class="ok">{w.accepted} accepted</span>, '
        f'<span class="bad">{w.rejected} rejected</span>)</div>'
        f"<div>uploads of unannounced peers (counted, never read): <b>{w.unannounced}</b></div>"
        f"<div>val loss after it: <b>{loss}</b></div></div>"
    )


def _series_note(windows: int, per_bucket: int) -> str:
    if per_bucket <= 1:
        return f'<p class="muted">{windows} windows, one point each.</p>'
    return (
        f'<p class="muted">{windows} windows, {per_bucket} consecutive windows per point '
        "(mean loss, summed contributions).</p>"
    )


def _leaderboard_table(peers: Sequence[PeerSummary], page: Page) -> str:
    head = ["#", "peer", "first seen", "last seen", "windows", "span", "accepted", "rate", "mean score", "reputation"]
    rows = []
    for i, p in enumerate(peers, start=page.offset + 1):
        rows.append(
            f'<tr class="peer-row" data-peer="{escape(p.peer)}"><td class="num">{i}</td>'
            f"<td>{_peer_link(p.peer)}</td><td>{_time(p.first_seen)}</td><td>{_time(p.last_seen)}</td>"
            f'<td class="num windows">{p.windows}</td><td class="num">{p.first_window}–{p.last_window}</td>'
            f'<td class="num accepted">{p.accepted}</td><td class="num">{p.acceptance_rate:.0%}</td>'
            f'<td class="num">{_num(p.mean_score)}</td><td class="num">{_num(p.reputation, 3)}</td></tr>'
        )
    if not rows:
        rows.append(f'<tr><td colspan="{len(head)}" class="muted">no peer on this page</td></tr>')
    return _table(head, rows, "leaderboard")


def _peer_facts(s: PeerSummary) -> str:
    facts = [
        ("windows", str(s.windows)),
        ("accepted", f"{s.accepted} ({s.acceptance_rate:.0%})"),
        ("mean score", _num(s.mean_score)),
        ("reputation", _num(s.reputation, 3)),
        ("windows seen", f"{s.first_window}–{s.last_window}"),
        ("first seen", _time(s.first_seen)),
        ("last seen", _time(s.last_seen)),
    ]
    return "".join(f'<div class="box"><div class="muted">{k}</div><b>{escape(v)}</b></div>' for k, v in facts)


def _reasons_table(reasons: Sequence[ReasonCount]) -> str:
    rows = [
        f'<tr class="reason-row"><td class="reason"><code>{escape(r.reason)}</code></td>'
        f'<td class="num rejections">{r.rejections}</td><td class="num">{r.peers}</td>'
        f'<td class="num">{r.last_window}</td></tr>'
        for r in reasons
    ]
    if not rows:
        rows.append('<tr><td colspan="4" class="muted">no rejection</td></tr>')
    return _table(["reason", "rejections", "peers", "last window"], rows, "reasons")


def _windows_table(windows: Sequence[WindowRecord]) -> str:
    head = ["window", "status", "closed", "val loss", "accepted", "rejected", "unannounced", "fingerprint"]
    rows = [
        f'<tr class="window-row"><td class="num">{w.window}</td><td>{escape(w.status)}</td><td>{_time(w.closed_at)}</td>'
        f'<td class="num">{_num(w.val_loss)}</td><td class="num">{w.accepted}</td><td class="num">{w.rejected}</td>'
        f'<td class="num">{w.unannounced}</td><td><code>{escape((w.fingerprint or "–")[:16])}</code></td></tr>'
        for w in windows
    ]
    if not rows:
        rows.append(f'<tr><td colspan="{len(head)}" class="muted">no window decided yet</td></tr>')
    return _table(head, rows, "windows")


def _agreement_table(windows: Sequence[AgreementSummary]) -> str:
    head = ["window", "leader", "view", "signers", "objections", "handovers"]
    rows = []
    for a in windows:
        leader = _peer_code(a.leader) if a.certified else '<span class="bad">not certified</span>'
        signers = " ".join(_peer_code(s) for s in a.signers) or '<span class="muted">–</span>'
        objections = (
            "".join(
                f'<div class="objection">{_peer_code(o.validator)} → {_peer_code(o.proposer)} (view {o.view}): '
                + "; ".join(f"<code>{escape(r)}</code>" for r in o.reasons)
                + "</div>"
                for o in a.objections
            )
            or '<span class="muted">none</span>'
        )
        handovers = " ".join(f"{_peer_code(v)} (view {view})" for v, view in a.handovers) or (
            '<span class="muted">none</span>'
        )
        rows.append(
            f'<tr class="agreement-row" data-window="{a.window}"><td class="num">{a.window}</td>'
            f'<td class="leader">{leader}</td><td class="num view">{_num(a.view)}</td>'
            f'<td class="signers">{signers}</td><td class="objections">{objections}</td>'
            f'<td class="handovers">{handovers}</td></tr>'
        )
    return _table(head, rows, "agreement")


def _peer_code(validator: str) -> str:
    return f'<code class="peer" title="{escape(validator)}">{escape(validator[:12])}</code>'


def _history_table(rows_: Sequence[ContributionRecord]) -> str:
    head = ["window", "outcome", "reason", "detail", "bytes", "norm", "overlap", "own Δ", "random Δ", "score"]
    head += ["rep", "weight", "checks"]
    rows = []
    for r in rows_:
        outcome = '<span class="ok">accepted</span>' if r.accepted else '<span class="bad">rejected</span>'
        checks = (
            " ".join(
                f'<code class="{"ok" if c.passed else "bad"}">{escape(c.name)}</code>' for c in r.checks if not c.passed
            )
            or '<span class="muted">all passed</span>'
        )
        rows.append(
            f'<tr class="history-row"><td class="num">{r.window}</td><td>{outcome}</td>'
            f"<td><code>{escape(r.reason or '')}</code></td><td>{escape(r.detail or '')}</td>"
            f'<td class="num">{_num(r.bytes)}</td><td class="num">{_num(r.norm)}</td>'
            f'<td class="num">{_num(r.overlap, 2)}</td><td class="num">{_delta(r.loss_own_before, r.loss_own_after)}</td>'
            f'<td class="num">{_delta(r.loss_random_before, r.loss_random_after)}</td>'
            f'<td class="num">{_num(r.score)}</td><td class="num">{_num(r.reputation, 3)}</td>'
            f'<td class="num">{_num(r.weight, 2)}</td><td>{checks}</td></tr>'
        )
    if not rows:
        rows.append(f'<tr><td colspan="{len(head)}" class="muted">no row on this page</td></tr>')
    return _table(head, rows, "history")


def _table(head: Sequence[str], rows: Sequence[str], ident: str) -> str:
    cols = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f'<table id="{ident}-table"><thead><tr>{cols}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _pager(base: str, page: Page) -> str:
    if page.pages <= 1:
        return ""
    size = "" if page.per_page == PER_PAGE else f"&per_page={page.per_page}"
    links = []
    for n, text in ((page.number - 1, "← previous"), (page.number + 1, "next →")):
        if 1 <= n <= page.pages:
            links.append(f'<a href="{escape(base)}?page={n}{size}">{text}</a>')
    links.insert(1 if page.number > 1 else 0, f"<span>page {page.number} of {page.pages}</span>")
    return f'<p class="pager">{"".join(links)}</p>'


def _peer_link(peer: str) -> str:
    return f'<a class="peer" href="{escape(peer_url(peer))}">{escape(peer)}</a>'


def _time(t: float | None) -> str:
    if t is None:
        return "–"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
    except (OverflowError, ValueError, OSError):  # not a time a clock gives (NaN, far out of range)
        return escape(repr(t))


def _num(v: float | int | None, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.{digits}f}"


def _delta(before: float | None, after: float | None) -> str:
    if before is None or after is None:
        return "–"
    return f"{after - before:+.4f}"
