#!/usr/bin/env python
"""How fast the contribution log is read: ``logs --summary`` and the dashboard's main queries.

Builds a synthetic log with the real :class:`validator.log.ContributionLog` (``--windows`` windows ×
``--peers`` peers, each present in 90 % of the windows, 80 % accepted, rejections spread over the
usual reasons, four checks per row), then times, ``--repeats`` times each (median and max, wall
time):

  baseline        ``sparseloco-validator --help`` as a process: Python start and the CLI's imports,
                  the floor under any command
  logs --summary  the command as a process (``python -m validator.cli logs --db LOG --summary``),
                  table output and ``--json``
  queries         the dashboard's reads on one read-only connection: the leaderboard page, the peer
                  count, the chart series (300 buckets), rejections by reason, the current window,
                  one peer's newest 50 rows, and the whole overview
  http            ``GET /`` and ``GET /api/overview`` from a running dashboard (query + HTML/JSON)
  no index        the leaderboard, reasons and overview on a copy of the log without the two
                  indexes the dashboard's reads use (``contributions_standing``,
                  ``contributions_rejected``), read-only so nothing recreates them

    python scripts/bench_logs.py                          # 1,000 windows × 50 peers
    python scripts/bench_logs.py --windows 10000 --json   # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from validator.dashboard import Dashboard, views
from validator.log import CheckRow, ContributionLog, ContributionRecord, WindowRecord
from validator.logview import LogView

ROOT = Path(__file__).resolve().parent.parent
REASONS = ("harmful", "norm_outlier", "copied", "late", "foreign", "ineffective", "probation", "stale_base")
SUMMARY_LIMIT_S = 2.0


def build(path: Path, windows: int, peers: int, seed: int = 0) -> dict[str, Any]:
    """Write the synthetic log; its row counts and how long writing took."""
    rng = random.Random(seed)
    ids = [
        f"{i:04d}" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz234567") for _ in range(28)) for i in range(peers)
    ]
    reputation = dict.fromkeys(ids, 0.0)
    rows_total = 0
    t0 = time.perf_counter()
    with ContributionLog(path) as log:
        for w in range(windows):
            opened = 1_750_000_000.0 + 120.0 * w
            rows = []
            for i, peer in enumerate(ids):
                if rng.random() >= 0.9:
                    continue
                accepted = rng.random() < 0.8
                reason = None if accepted else rng.choice(REASONS)
                reputation[peer] = 0.9 * reputation[peer] + 0.1 * (1.0 if accepted else -1.0)
                checks = (
                    CheckRow("size", True),
                    CheckRow("signature", True),
                    CheckRow("format", True),
                    CheckRow("norm", accepted, reason),
                )
                rows.append(
                    ContributionRecord(
                        window=w,
                        peer=peer,
                        received_at=opened + rng.uniform(5, 90),
                        bytes=17_000 + i,
                        digest=f"{w:032x}{i:032x}",
                        accepted=accepted,
                        reason=reason,
                        detail=None if accepted else f"synthetic {reason}",
                        norm=rng.uniform(0.5, 2.0),
                        loss_own_before=5.0,
                        loss_own_after=4.9,
                        score=rng.gauss(0.02, 0.01) if accepted else None,
                        reputation=reputation[peer],
                        weight=1.0 if accepted else 0.0,
                        checks=checks,
                    )
                )
            accepted_n = sum(r.accepted for r in rows)
            loss = 2.0 + 3.0 * 0.999**w + rng.gauss(0, 0.01)
            win = WindowRecord(
                window=w,
                status="published",
                opened_at=opened,
                closed_at=opened + 100,
                published_at=opened + 110,
                val_loss=loss,
                accepted=accepted_n,
                rejected=len(rows) - accepted_n,
                unannounced=rng.randrange(3),
            )
            log.record_window(win, rows)
            rows_total += len(rows)
    return {"rows": rows_total, "build_s": round(time.perf_counter() - t0, 2), "bytes": path.stat().st_size}


def timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median and max wall seconds of ``repeats`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(samples), 4), "max_s": round(max(samples), 4)}


def run_cli(*args: str) -> Callable[[], object]:
    cmd = [sys.executable, "-m", "validator.cli", *args]
    return lambda: subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)


def queries(path: Path, repeats: int) -> dict[str, dict[str, float]]:
    """The dashboard's reads, on one read-only connection."""
    with LogView.open(path) as log:
        peer = log.peer_summaries(limit=1)[0].peer
        cases: dict[str, Callable[[], object]] = {
            "leaderboard page (50)": lambda: log.peer_summaries(limit=views.PER_PAGE),
            "peer count": log.peer_count,
            "series (300 buckets)": lambda: log.window_buckets(points=views.CHART_POINTS),
            "rejections by reason": log.rejection_reasons,
            "current window": lambda: views.current(log),
            "one peer, newest 50 rows": lambda: views.peer(log, peer),
            "overview (all of /)": lambda: views.overview(log),
            "logs --summary's leaderboard": log.leaderboard,
        }
        return {name: timed(fn, repeats) for name, fn in cases.items()}


def http(path: Path, repeats: int) -> dict[str, dict[str, float]]:
    with Dashboard(path, port=0) as dash:

        def get(route: str) -> Callable[[], object]:
            return lambda: urllib.request.urlopen(dash.url + route, timeout=60).read()

        return {"GET /": timed(get(""), repeats), "GET /api/overview": timed(get("api/overview"), repeats)}


def without_indexes(path: Path, repeats: int) -> dict[str, dict[str, float]]:
    bare = path.with_name("bare.sqlite")
    shutil.copyfile(path, bare)
    with sqlite3.connect(bare) as db:
        db.execute("DROP INDEX contributions_standing")
        db.execute("DROP INDEX contributions_rejected")
    with LogView.open(bare) as log:
        cases: dict[str, Callable[[], object]] = {
            "leaderboard page (50)": lambda: log.peer_summaries(limit=views.PER_PAGE),
            "rejections by reason": log.rejection_reasons,
            "overview (all of /)": lambda: views.overview(log),
        }
        return {name: timed(fn, repeats) for name, fn in cases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=1000)
    ap.add_argument("--peers", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    ap.add_argument("--keep", type=Path, default=None, help="write the log here and keep it")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    try:
        path = args.keep or work / "contributions.sqlite"
        setup = {"windows": args.windows, "peers": args.peers, "repeats": args.repeats}
        setup |= build(path, args.windows, args.peers)
        setup |= {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "python": sys.version.split()[0]}
        results: dict[str, Any] = {"setup": setup}
        results["process"] = {
            "baseline: sparseloco-validator --help": timed(run_cli("--help"), args.repeats),
            "logs --summary": timed(run_cli("logs", "--db", str(path), "--summary"), args.repeats),
            "logs --summary --json": timed(run_cli("logs", "--db", str(path), "--summary", "--json"), args.repeats),
        }
        results["queries"] = queries(path, args.repeats)
        results["http"] = http(path, args.repeats)
        results["without_indexes"] = without_indexes(path, args.repeats)
        summary = results["process"]["logs --summary"]["max_s"]
        results["summary_under_2s"] = summary < SUMMARY_LIMIT_S
    finally:
        shutil.rmtree(work, ignore_errors=True)

    console = Console(file=sys.stderr if args.json else sys.stdout, width=200)
    table = Table(
        title=f"contribution log reads: {args.windows:,} windows × {args.peers} peers, {setup['rows']:,} rows"
    )
    for col in ("group", "measurement", "median s", "max s"):
        table.add_column(col, justify="right" if col.endswith(" s") else "left")
    for group in ("process", "queries", "http", "without_indexes"):
        for name, t in results[group].items():
            table.add_row(group, name, f"{t['median_s']:.4f}", f"{t['max_s']:.4f}")
    console.print(table)
    console.print(
        f"logs --summary under {SUMMARY_LIMIT_S:.0f} s (max of {args.repeats}): {results['summary_under_2s']}"
    )
    console.print(f"setup: {json.dumps(setup)}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
