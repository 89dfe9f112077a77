"""The dashboard's reads of the contribution log, its JSON API and HTML over real HTTP, its SVG
charts, and `logs --plot`."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from click.testing import CliRunner
from dashboard_log import EVIL, LIAR_WINDOW, PEERS, VALIDATORS, Built, build_log
from PIL import Image

from validator.cli import cli
from validator.dashboard import Dashboard, svg, views
from validator.log import ContributionLog, ContributionRecord, WindowRecord
from validator.logview import LogView, ReasonCount, WindowBucket


@pytest.fixture()
def built(tmp_path: Path) -> Built:
    return build_log(tmp_path / "log.sqlite")


@pytest.fixture()
def dash(built: Built) -> Iterator[Dashboard]:
    with Dashboard(built.path, port=0) as d:
        yield d


def get(dash: Dashboard, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(dash.url + path.lstrip("/"), timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def api(dash: Dashboard, path: str) -> Any:
    status, headers, body = get(dash, path)
    assert status == 200 and headers["Content-Type"] == "application/json", body
    return json.loads(body)


# ------------------------------------------------------------------------------ the log's reads
def test_peer_summaries_are_the_leaderboard_with_times_and_pages(built: Built) -> None:
    with LogView.open(built.path) as log:
        everyone = log.peer_summaries()
        assert [s.leader_row() for s in everyone] == log.leaderboard()
        assert {s.peer: (s.windows, s.accepted) for s in everyone} == built.counts
        assert log.peer_count() == len(built.counts)
        pages = log.peer_summaries(limit=2, offset=0) + log.peer_summaries(limit=2, offset=2)
        assert pages + log.peer_summaries(limit=2, offset=4) == everyone
        late = next(s for s in everyone if s.peer == PEERS[3])
        assert (late.first_window, late.last_window) == (2, built.windows - 1)
        assert late.first_seen is not None and late.last_seen is not None and late.first_seen < late.last_seen
        assert log.peer_summaries(peer=PEERS[0][:8]) == []  # the dashboard names peers exactly


def test_history_reasons_buckets_and_pending(built: Built) -> None:
    with LogView.open(built.path) as log:
        rows = log.history(PEERS[0], limit=3, offset=1)
        assert [r.window for r in rows] == [6, 5, 4] and all(len(r.checks) == 2 for r in rows)
        assert {r.reason: r.rejections for r in log.rejection_reasons()} == built.reasons
        assert log.rejection_reasons(peer=EVIL) == [ReasonCount(reason="foreign", rejections=4, peers=1, last_window=7)]
        buckets = log.window_buckets()
        assert [(b.first, b.last) for b in buckets] == [(w, w) for w in range(built.windows)]
        assert [b.val_loss for b in buckets] == built.val_loss
        halves = log.window_buckets(points=2)
        assert [(b.first, b.last, b.windows) for b in halves] == [(0, 3, 4), (4, 7, 4)]
        assert halves[0].val_loss == pytest.approx(sum(built.val_loss[:4]) / 4)
        assert sum(b.accepted + b.rejected for b in halves) == sum(n for n, _ in built.counts.values())
        assert [r.peer for r in log.pending(after=built.windows - 1)] == list(built.pending)
        assert log.latest_window() == log.window(built.windows - 1)


def test_a_read_only_log_refuses_writes_and_changes_nothing(built: Built) -> None:
    before = built.path.read_bytes()
    with ContributionLog(built.path, readonly=True) as log:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            log.record_window(WindowRecord(window=99), [])
        assert log.window(99) is None
    assert built.path.read_bytes() == before


def test_current_window_says_what_it_shows(built: Built) -> None:
    with LogView.open(built.path) as log:
        c = views.current(log)
    assert c.open_window == built.windows and c.last is not None and c.last.status == "decided"
    assert [r.peer for r in c.uploaded] == list(built.pending) and c.uploaded_total == 2
    assert set(c.not_read) == {PEERS[2], PEERS[3], EVIL} and c.not_read_total == 3 and c.last_peers == 5
    assert not c.waiting_recorded and "window_waiting" in c.shown


# ------------------------------------------------------------------------------ HTTP: JSON
def test_api_serves_the_same_data(dash: Dashboard, built: Built) -> None:
    board = api(dash, "/api/leaderboard")
    assert {p["peer"]: (p["windows"], p["accepted"]) for p in board["peers"]} == built.counts
    assert board["page"] == {"number": 1, "per_page": 50, "items": len(built.counts), "pages": 1}
    second = api(dash, "/api/leaderboard?page=2&per_page=2")
    assert [p["peer"] for p in second["peers"]] == [p["peer"] for p in board["peers"][2:4]]
    series = api(dash, "/api/windows")
    assert [b["val_loss"] for b in series["buckets"]] == built.val_loss and series["per_bucket"] == 1
    assert [b["first"] for b in api(dash, "/api/windows?from=2&to=3")["buckets"]] == [2, 3]
    assert {r["reason"]: r["rejections"] for r in api(dash, "/api/rejections")} == built.reasons
    current = api(dash, "/api/current")
    assert current["open_window"] == built.windows and current["waiting_recorded"] is False
    overview = api(dash, "/api/overview")
    assert overview["current"] == current and overview["leaderboard"] == board
    assert [w["window"] for w in overview["recent"]] == list(reversed(range(built.windows)))


def test_api_peer_by_exact_id_even_when_it_is_markup(dash: Dashboard) -> None:
    evil = api(dash, "/api/peers/" + quote(EVIL, safe=""))
    assert evil["summary"]["peer"] == EVIL and [h["detail"] for h in evil["history"]] == [EVIL] * 4
    good = api(dash, f"/api/peers/{PEERS[0]}?per_page=3&page=2")
    assert [h["window"] for h in good["history"]] == [4, 3, 2] and good["page"]["pages"] == 3
    assert good["history"][0]["checks"][0] == {"name": "size", "passed": True, "reason": None}


def test_bad_requests_are_answered_not_crashed(dash: Dashboard) -> None:
    for path in ("/api/leaderboard?page=x", "/api/leaderboard?page=0", "/api/windows?points=1%C2%B2", "/?per_page=501"):
        status, headers, body = get(dash, path)
        assert status == 400, path
    assert "page must be" in json.loads(get(dash, "/api/leaderboard?page=x")[2])["error"]
    assert get(dash, "/api/peers/" + PEERS[0][:10])[0] == 404  # a prefix is not a peer
    status, headers, body = get(dash, "/nothing")
    assert status == 404 and headers["Content-Type"].startswith("text/html")


def test_strict_json_has_no_nan(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with ContributionLog(path) as log:
        row = ContributionRecord(window=0, peer=PEERS[0], accepted=True, norm=float("inf"), score=0.5)
        log.record_window(WindowRecord(window=0, accepted=1), [row])
    with Dashboard(path, port=0) as dash:
        _, _, body = get(dash, "/api/peers/" + PEERS[0])
    assert json.loads(body)["history"][0]["norm"] is None


# ------------------------------------------------------------------------------ HTTP: HTML
def test_pages_escape_what_the_log_holds(dash: Dashboard, built: Built) -> None:
    status, headers, body = get(dash, "/")
    page = body.decode()
    assert status == 200 and "script-src" not in headers["Content-Security-Policy"]  # default-src 'none'
    assert "default-src 'none'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
    assert "<script" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&quot;&#x27;" in page
    assert page.count('class="loss-point"') == built.windows
    assert len(re.findall(r'<tr class="peer-row"', page)) == len(built.counts)
    assert 'href="/peer/%3Cscript%3Ealert%28%22x%22%29%3C%2Fscript%3E%26%22%27"' in page
    status, _, body = get(dash, "/peer/" + quote(EVIL, safe=""))
    assert status == 200 and "<script" not in body.decode() and body.decode().count('class="history-row"') == 4


def test_a_ten_thousand_window_log_is_read_in_buckets(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    ContributionLog(path).close()
    with sqlite3.connect(path) as db:  # window rows only: the series reads nothing else
        db.executemany(
            "INSERT INTO windows (window, status, val_loss, accepted, rejected) VALUES (?, 'published', ?, 3, 1)",
            [(w, 5.0 - w / 10_000) for w in range(10_000)],
        )
    with Dashboard(path, port=0) as dash:
        series = api(dash, "/api/windows")
        _, _, page = get(dash, "/")
    assert len(series["buckets"]) <= views.CHART_POINTS and series["windows"] == 10_000
    assert sum(b["accepted"] for b in series["buckets"]) == 30_000 and series["per_bucket"] == 34
    assert page.decode().count('class="loss-point"') == len(series["buckets"])


# ------------------------------------------------------------------------------ charts
def test_svg_charts_have_one_element_per_point_and_escape_reasons() -> None:
    buckets = [
        WindowBucket(
            first=w, last=w, windows=1, val_loss=None if w == 2 else 5.0 - w, accepted=2, rejected=w, unannounced=0
        )
        for w in range(5)
    ]
    loss = svg.loss_chart(buckets)
    assert loss.count('class="loss-point"') == 4 and 'data-first="2"' not in loss.split("<polyline")[1]
    outcomes = svg.outcome_chart(buckets)
    assert outcomes.count('class="bar-accepted"') == 5 and outcomes.count('class="bar-rejected"') == 4
    reasons = svg.reasons_chart([ReasonCount(reason="<b>x</b>", rejections=3, peers=1, last_window=4)])
    assert "<b>" not in reasons and "&lt;b&gt;x&lt;/b&gt;" in reasons
    assert "no validation loss" in svg.loss_chart([]) and svg.nice_ticks(0.0, 1.0, 5) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


# ------------------------------------------------------------------------------ CLI
def test_logs_plot_writes_a_png(built: Built, tmp_path: Path) -> None:
    out = tmp_path / "charts.png"
    result = CliRunner().invoke(cli, ["logs", "--db", str(built.path), "--plot", str(out), "--window", "1:"])
    assert result.exit_code == 0, result.output
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (1000, 1100)
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 20
    result = CliRunner().invoke(cli, ["logs", "--db", str(built.path), "--plot", str(out), "--summary"])
    assert result.exit_code != 0 and "only --window" in result.output


def test_a_dashboard_started_before_the_validator_waits_for_its_log(built: Built, tmp_path: Path) -> None:
    db = tmp_path / "validator" / "log.sqlite"
    db.parent.mkdir()
    with Dashboard(db, port=0) as dash:
        with pytest.raises(urllib.error.HTTPError) as early:
            urllib.request.urlopen(dash.url, timeout=10)
        assert early.value.code == 503 and "yet" in early.value.read().decode()
        assert not db.exists()  # looking did not create an empty database
        shutil.copyfile(built.path, db)  # the validator started
        with urllib.request.urlopen(dash.url, timeout=10) as resp:
            assert resp.status == 200


def test_dashboard_command_refuses_what_is_not_a_log(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["dashboard", "--db", str(tmp_path / "no-such-dir" / "log.sqlite"), "--port", "0"])
    assert result.exit_code != 0 and "no contribution log" in result.output
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 100)
    result = runner.invoke(cli, ["dashboard", "--db", str(junk), "--port", "0"])
    assert result.exit_code != 0 and "not a readable contribution log" in result.output


# ------------------------------------------------------------------------------ several validators
@pytest.fixture()
def several(tmp_path: Path) -> Built:
    return build_log(tmp_path / "several.sqlite", several=True)


def test_agreement_is_read_per_window(several: Built, built: Built) -> None:
    with LogView.open(several.path) as log:
        got = log.agreements()
        newest = log.agreements(limit=2)
    assert {a.window: (a.leader, a.view, a.signers) for a in got} == several.agreement
    assert [a.window for a in newest] == sorted(several.agreement)[-2:]
    lied = next(a for a in got if a.window == LIAR_WINDOW)
    liar = VALIDATORS[LIAR_WINDOW % len(VALIDATORS)]
    assert lied.handovers == ((lied.leader, 1),) and len(lied.objections) == 2
    assert {o.proposer for o in lied.objections} == {liar} and liar not in {o.validator for o in lied.objections}
    assert any("4x" in r for o in lied.objections for r in o.reasons)
    quiet = next(a for a in got if a.window == 0)
    assert quiet.objections == () and quiet.handovers == () and quiet.view == 0 and quiet.certified
    with LogView.open(built.path) as log:  # one validator: no agreement at all
        assert log.agreements() == [] and views.overview(log).agreement == []


def test_dashboard_shows_the_agreement_panel(several: Built, built: Built) -> None:
    with Dashboard(several.path, port=0) as dash:
        status, _, body = get(dash, "/")
        rows = api(dash, "/api/agreement")
        overview = api(dash, "/api/overview")
    page = body.decode()
    assert status == 200 and '<section id="agreement">' in page and "<script" not in page
    assert page.count('class="agreement-row"') == len(several.agreement)
    lied = re.search(rf'<tr class="agreement-row" data-window="{LIAR_WINDOW}">(.*?)</tr>', page)
    assert lied is not None
    leader, view, signers = several.agreement[LIAR_WINDOW]
    assert f'title="{leader}"' in lied.group(1) and '<td class="num view">1</td>' in lied.group(1)
    assert lied.group(1).count('class="objection"') == 2 and "4x" in lied.group(1)
    assert "&lt;script&gt;" in lied.group(1)  # an objection's reason is text, never markup
    assert all(f'title="{s}"' in lied.group(1) for s in signers)
    assert [a["window"] for a in rows] == sorted(several.agreement, reverse=True)
    assert {a["window"]: (a["leader"], a["view"], tuple(a["signers"])) for a in rows} == several.agreement
    assert overview["agreement"] == rows
    with Dashboard(built.path, port=0) as dash:  # one validator: no panel
        status, _, body = get(dash, "/")
        assert status == 200 and 'id="agreement"' not in body.decode() and api(dash, "/api/agreement") == []


def test_logs_shows_the_agreement(several: Built, built: Built) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["logs", "--db", str(several.path), "--agreement", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert {r["window"]: (r["leader"], r["view"], tuple(r["signers"])) for r in rows} == several.agreement
    lied = next(r for r in rows if r["window"] == LIAR_WINDOW)
    assert lied["handovers"] == [{"validator": lied["leader"], "view": 1}]
    assert [len(o["reasons"]) for o in lied["objections"]] == [1, 1]
    out = runner.invoke(cli, ["logs", "--db", str(several.path), "--windows", "--window", f"{LIAR_WINDOW}:", "--json"])
    windows = json.loads(out.output)
    assert windows[0]["agreement"] == lied and "agreement" not in windows[-1]  # the last is not published
    out = runner.invoke(cli, ["logs", "--db", str(several.path), "--windows"])
    assert out.exit_code == 0 and "agreement of the validators" in out.output and "4x" in out.output
    out = runner.invoke(cli, ["logs", "--db", str(several.path), "--agreement", "--csv", "--window", str(LIAR_WINDOW)])
    assert out.exit_code == 0 and out.output.count("\n") == 2 and f"{lied['leader']}@1" in out.output
    assert runner.invoke(cli, ["logs", "--db", str(several.path), "--agreement", "--summary"]).exit_code == 2
    # one validator: what logs printed before, nothing new
    one = json.loads(runner.invoke(cli, ["logs", "--db", str(built.path), "--windows", "--json"]).output)
    assert one and all("agreement" not in w for w in one)
    out = runner.invoke(cli, ["logs", "--db", str(built.path), "--windows"])
    assert "agreement" not in out.output
    assert json.loads(runner.invoke(cli, ["logs", "--db", str(built.path), "--agreement", "--json"]).output) == []
