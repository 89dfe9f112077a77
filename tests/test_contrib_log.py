"""The SQLite contribution log and `sparseloco-validator logs`."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from validator.cli import cli
from validator.log import CheckRow, ContributionLog, ContributionRecord, WindowRecord
from validator.logview import LogView

P1, P2, P3 = "a" * 32, "b" * 32, "c" * 32


def rec(
    window: int, peer: str, accepted: bool, reason: str | None = None, score: float | None = None
) -> ContributionRecord:
    checks = (CheckRow("size", True), CheckRow("signature", accepted, None if accepted else reason))
    return ContributionRecord(
        window=window,
        peer=peer,
        bytes=1000 + window,
        digest=f"{window:064x}",
        accepted=accepted,
        reason=reason,
        detail=None if accepted else f"because {reason}",
        score=score,
        reputation=0.1 * window,
        loss_own_before=5.0,
        loss_own_after=4.5 if accepted else None,
        weight=1.0 if accepted else 0.0,
        checks=checks,
    )


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    path = tmp_path / "log.sqlite"
    with ContributionLog(path) as log:
        for w in range(3):
            log.note_received(w, P1, received_at=100.0 + w, nbytes=None)
            log.record_window(
                WindowRecord(window=w, accepted=2, rejected=1, val_loss=5.0 - w),
                [rec(w, P1, True, score=0.1), rec(w, P2, True, score=-0.05), rec(w, P3, False, "bad_signature")],
            )
            log.mark_published(w, digest=f"{w:064x}", published_at=200.0 + w)
    return path


def test_rows_round_trip_with_checks_and_first_seen(db: Path) -> None:
    with ContributionLog(db) as log:
        rows = log.rows()
        assert len(rows) == 9
        r = next(r for r in rows if r.window == 1 and r.peer == P1)
        assert r.received_at == 101.0 and r.accepted and r.score == 0.1 and r.loss_own_after == 4.5
        assert r.checks == (CheckRow("size", True), CheckRow("signature", True))
        bad = next(r for r in rows if r.peer == P3)
        assert bad.checks[-1] == CheckRow("signature", False, "bad_signature")
        assert log.window(2) == WindowRecord(
            window=2,
            status="published",
            published_at=202.0,
            aggregate_digest=f"{2:064x}",
            val_loss=3.0,
            accepted=2,
            rejected=1,
        )


def test_first_seen_is_kept_and_redeciding_overwrites(tmp_path: Path) -> None:
    with ContributionLog(tmp_path / "l.sqlite") as log:
        assert log.note_received(0, P1, received_at=10.0, nbytes=5, digest="d1") == (10.0, "d1")
        # a restart sees it again later: the first time and the first digest are kept
        assert log.note_received(0, P1, received_at=99.0, nbytes=5, digest="d2") == (10.0, "d1")
        assert log.note_received(0, P2, received_at=5.0, nbytes=None) == (5.0, None)
        assert log.note_received(0, P2, received_at=6.0, nbytes=5, digest="d3") == (5.0, "d3")
        log.record_window(WindowRecord(window=0), [rec(0, P1, False, "norm_outlier")])
        log.record_window(WindowRecord(window=0), [rec(0, P1, True)])  # the window re-decided after a crash
        rows = log.rows()
        assert len(rows) == 1 and rows[0].accepted and rows[0].received_at == 10.0  # P2 was never decided
        assert len(rows[0].checks) == 2  # old checks replaced, not appended


def test_a_failed_window_write_leaves_nothing(tmp_path: Path) -> None:
    with ContributionLog(tmp_path / "l.sqlite") as log:
        bad = ContributionRecord(window=0, peer=P2, detail=object())  # type: ignore[arg-type]
        with pytest.raises(sqlite3.Error):
            log.record_window(WindowRecord(window=0), [rec(0, P1, True), bad])
        assert log.rows() == [] and log.window(0) is None


def test_filters_combine(db: Path) -> None:
    with ContributionLog(db) as log:
        assert {r.peer for r in log.rows(peer="bbb")} == {P2}
        assert {r.window for r in log.rows(windows=(1, None))} == {1, 2}
        assert {r.window for r in log.rows(windows=(None, 0))} == {0}
        assert [(r.window, r.peer) for r in log.rows(rejected_only=True, windows=(1, 2))] == [(1, P3), (2, P3)]


def test_leaderboard(db: Path) -> None:
    with LogView.open(db) as log:
        board = {r.peer: r for r in log.leaderboard()}
        assert board[P1].windows == 3 and board[P1].accepted == 3 and board[P1].acceptance_rate == 1.0
        assert board[P3].accepted == 0 and board[P3].acceptance_rate == 0.0
        assert board[P1].mean_score == pytest.approx(0.1) and board[P1].last_window == 2
        assert board[P1].reputation == pytest.approx(0.2)


def test_cli_json_csv_table_and_summary(db: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["logs", "--db", str(db), "--rejected", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [(r["window"], r["reason"]) for r in rows] == [(w, "bad_signature") for w in range(3)]
    assert rows[0]["checks"] == "size:pass;signature:fail:bad_signature"

    out = runner.invoke(cli, ["logs", "--db", str(db), "--window", "1:2", "--peer", P1[:6], "--csv"])
    assert out.exit_code == 0, out.output
    parsed = list(csv.DictReader(io.StringIO(out.output)))
    assert [(r["window"], r["accepted"]) for r in parsed] == [("1", "True"), ("2", "True")]

    out = runner.invoke(cli, ["logs", "--db", str(db), "--window", "0"])
    assert out.exit_code == 0 and "bad_signature" in out.output and "contribution log (3 rows)" in out.output

    out = runner.invoke(cli, ["logs", "--db", str(db), "--summary", "--json"])
    board = json.loads(out.output)
    assert board[0]["peer"] == P1 and {b["peer"] for b in board} == {P1, P2, P3}
    out = runner.invoke(cli, ["logs", "--db", str(db), "--summary"])
    assert out.exit_code == 0 and "leaderboard" in out.output


def test_cli_windows_lists_each_window_with_documented_fields(db: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["logs", "--db", str(db), "--windows", "--window", "1:", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["window"] for r in rows] == [1, 2]
    fields = ["window", "status", "opened_at", "closed_at", "published_at", "base", "digest", "fingerprint"]
    assert set(rows[0]) == {*fields, "val_loss", "accepted", "rejected", "unannounced"}
    assert rows[1] | {"digest": f"{2:064x}", "status": "published", "val_loss": 3.0, "accepted": 2} == rows[1]
    documented = cli.commands["logs"].help or ""
    assert all(field in documented for field in rows[0])  # --help names every field
    out = runner.invoke(cli, ["logs", "--db", str(db), "--windows"])
    assert out.exit_code == 0 and "windows (3)" in out.output and "published" in out.output
    out = runner.invoke(cli, ["logs", "--db", str(db), "--windows", "--peer", P1])
    assert out.exit_code != 0 and "--windows" in out.output


def test_cli_errors_are_clear(tmp_path: Path, db: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["logs", "--db", str(tmp_path / "missing.sqlite")])
    assert out.exit_code != 0 and "no contribution log" in out.output
    out = runner.invoke(cli, ["logs", "--db", str(db), "--window", "x:y"])
    assert out.exit_code != 0 and "A:B" in out.output
