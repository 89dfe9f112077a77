"""The validator's contribution log, read through its owner: ``sparseloco-validator logs --json``.

The log's schema belongs to the validator, and the launcher (in ``client/``) never imports
``validator/``; it runs the validator's command and keeps the documented JSON fields it needs::

    windows = read_windows(run_dir / "validator" / "contributions.sqlite")
    [w.val_loss for w in windows if w.status == "published"]
    read_contributions(db)          # one PeerOutcome per decided (window, peer)
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from client.demo.errors import DemoError
from client.demo.processes import python_console
from protocol.outcomes import PeerOutcome

__all__ = ["LoggedWindow", "read_contributions", "read_windows"]

TIMEOUT_S = 120.0  # the command imports no torch; this only bounds a machine under heavy load


@dataclass(frozen=True)
class LoggedWindow:
    """One window of the log (``logs --windows --json``); ``status``: ``decided`` or ``published``."""

    window: int
    status: str
    val_loss: float | None
    accepted: int
    rejected: int
    fingerprint: str | None  # θ after the window's aggregate
    digest: str | None  # the published aggregate's


def read_windows(db: Path) -> list[LoggedWindow]:
    """Every window in the log at ``db``, by window."""
    return [_record(LoggedWindow, row) for row in _logs(db, "--windows")]


def read_contributions(db: Path) -> list[PeerOutcome]:
    """The outcome of every decided contribution in the log at ``db``, by (window, peer): accepted,
    or rejected with ``reason`` by ``check``."""
    return [_outcome(row) for row in _logs(db)]


def _logs(db: Path, *options: str) -> list[dict[str, Any]]:
    argv = [*python_console("sparseloco-validator"), "logs", "--db", str(db), *options, "--json"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DemoError(f"`sparseloco-validator logs` did not answer in {TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        raise DemoError(
            f"`sparseloco-validator logs --db {db}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    try:
        rows = json.loads(done.stdout)
    except ValueError as exc:
        raise DemoError(f"`sparseloco-validator logs --json` printed no JSON: {done.stdout[:200]!r}") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DemoError("`sparseloco-validator logs --json` printed something other than an array of rows")
    return rows


def _record(cls: type[LoggedWindow], row: dict[str, Any]) -> LoggedWindow:
    try:
        return cls(**{f.name: row[f.name] for f in fields(cls)})
    except KeyError as exc:
        raise DemoError(f"a `sparseloco-validator logs` row lacks the documented field {exc}") from exc


def _outcome(row: dict[str, Any]) -> PeerOutcome:
    """A ``logs --json`` row's outcome; its ``checks`` read ``name:pass;name:fail:<reason>``."""
    try:
        checks = (item.split(":", 1) for item in str(row["checks"] or "").split(";") if item)
        failed = next((c[0] for c in checks if c[1:] != ["pass"]), None)
        return PeerOutcome(
            row["peer"],
            row["accepted"],
            row["reason"],
            row["score"],
            row["reputation"],
            window=row["window"],
            check=failed,
            weight=row["weight"],
        )
    except KeyError as exc:
        raise DemoError(f"a `sparseloco-validator logs` row lacks the documented field {exc}") from exc
