"""``sparseloco-validator``: run a validator, read its contribution log, make its key.

    sparseloco-validator keygen --key validator.pem          # prints the public key for the RunSpec
    sparseloco-validator run --run run.toml --key validator.pem --state vstate [--store URL] [--windows N]
                             [--device cuda] [--threads N] [--dht-peer MULTIADDR ...]
    sparseloco-validator logs --db vstate/contributions.sqlite [--peer ID] [--window A:B] [--rejected]
                              [--json | --csv] [--summary]

``run`` prints one line per published window (``window 3 published: accepted=3 rejected=0
val_loss=4.5487 …``); Ctrl-C or SIGTERM finish or abandon the current window cleanly (a restart
resumes it). Exit codes: 0 done, 2 configuration/identity error, 130 interrupted.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

import click
import torch
from rich.console import Console
from rich.table import Table

from protocol.config import RunSpec
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.store import open_from_settings
from validator.log import ContributionLog, ContributionRecord
from validator.node import LOG_FILE, Validator, WindowReport

DEFAULT_KEY = "~/.sparseloco/validator.pem"
DEFAULT_STATE = "validator-state"


@click.group()
def cli() -> None:
    """SparseLoCo validator: checks, scores and aggregates contributions; keeps the contribution log."""


@cli.command()
@click.option("--key", "key_path", default=DEFAULT_KEY, show_default=True, help="Ed25519 key file (created if missing).")
def keygen(key_path: str) -> None:
    """Create (or load) the validator key and print its public key for ``validator.public_keys``."""
    ident = Identity.load_or_create(key_path)
    click.echo(ident.public_key_hex)


@cli.command()
@click.option("--run", "run_path", required=True, type=click.Path(dir_okay=False), help="RunSpec TOML.")
@click.option("--store", "store_url", default=None, help="Store URL (default: the RunSpec's storage.url).")
@click.option("--dht-peer", "dht_peers", multiple=True, help="DHT bootstrap multiaddr (repeatable).")
@click.option("--key", "key_path", default=DEFAULT_KEY, show_default=True, help="Validator Ed25519 key file.")
@click.option("--state", "state_dir", default=DEFAULT_STATE, show_default=True, help="State directory (θ, log).")
@click.option("--device", default="cpu", show_default=True, help="Torch device for scoring (cpu, cuda, cuda:1).")
@click.option("--windows", type=int, default=None, help="Stop after N windows (default: run until stopped).")
@click.option("--threads", type=int, default=0, help="Torch CPU threads (0: torch's default).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def run(
    run_path: str,
    store_url: str | None,
    dht_peers: tuple[str, ...],
    key_path: str,
    state_dir: str,
    device: str,
    windows: int | None,
    threads: int,
    verbose: bool,
) -> None:
    """Validate windows: gather, check, score, aggregate, publish."""
    if threads > 0:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(highlight=False, soft_wrap=True)
    try:
        spec = RunSpec.load(run_path)
        ident = Identity.load(Path(key_path).expanduser())
        store = open_from_settings(spec.storage, store_url, dht_peers)
        validator = Validator(spec, store, ident, state_dir, device=device, on_window=lambda r: _status(console, r))
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)
    _install_stop(validator)
    console.print(
        f"validator {ident.peer_id} run {validator.run_id} store {store_url or spec.storage.url} state {state_dir} device {device}"
    )
    try:
        state = validator.resume()
        console.print(f"window {state.window} open (base {state.base[:16]})")
        sys.stdout.flush()
        validator.run(windows)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("interrupted; the current window is redone on restart")
        sys.exit(130)
    finally:
        validator.close()
    if validator.stop.is_set():
        console.print("stopped; the current window is redone on restart")
        sys.exit(130)


def _status(console: Console, r: WindowReport) -> None:
    reasons = " ".join(f"{k}={v}" for k, v in sorted(r.reasons.items()))
    phases = " ".join(f"{k} {v:.1f}s" for k, v in r.seconds.items())
    console.print(
        f"window {r.window} published: accepted={r.accepted} rejected={r.rejected} val_loss={r.val_loss:.4f} "
        f"fingerprint={r.fingerprint[:16]} digest={r.digest[:16]} ({phases})"
        + (f" rejected: {reasons}" if reasons else "")
    )
    sys.stdout.flush()


def _install_stop(validator: Validator) -> None:
    """First Ctrl-C / SIGTERM: stop after (or abandon) the current window; second Ctrl-C: now."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if validator.stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        validator.stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


# ------------------------------------------------------------------------------ logs
_COLUMNS = ("window", "peer", "accepted", "reason", "bytes", "norm", "overlap", "own Δ", "random Δ", "score", "rep", "weight")


@cli.command()
@click.option("--db", default=str(Path(DEFAULT_STATE) / LOG_FILE), show_default=True, help="Contribution log.")
@click.option("--peer", default=None, help="Peer id (a prefix is enough).")
@click.option("--window", "window_range", default=None, help="Window N or range A:B (either end may be empty).")
@click.option("--rejected", is_flag=True, help="Only rejected contributions.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (an array of rows).")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV.")
@click.option("--summary", is_flag=True, help="Leaderboard: windows, acceptance rate, mean score per peer.")
def logs(
    db: str, peer: str | None, window_range: str | None, rejected: bool, as_json: bool, as_csv: bool, summary: bool
) -> None:
    """Show the contribution log: who sent what, how it scored, why it was rejected."""
    if as_json and as_csv:
        raise click.UsageError("--json and --csv are exclusive")
    if not Path(db).exists():
        raise click.ClickException(f"no contribution log at {db}")
    windows = _parse_range(window_range)
    with ContributionLog(db) as log:
        if summary:
            board = [dataclasses.asdict(r) for r in log.leaderboard(windows=windows)]
            if peer:
                board = [b for b in board if b["peer"].startswith(peer)]
            _emit(board, as_json, as_csv, _summary_table)
            return
        rows = log.rows(peer=peer, windows=windows, rejected_only=rejected)
        _emit([_flat(r) for r in rows], as_json, as_csv, _rows_table)


def _parse_range(text: str | None) -> tuple[int | None, int | None]:
    if not text:
        return (None, None)
    try:
        if ":" not in text:
            return (int(text), int(text))
        lo, hi = text.split(":", 1)
        return (int(lo) if lo else None, int(hi) if hi else None)
    except ValueError:
        raise click.BadParameter(f"window must be N or A:B, got {text!r}") from None


def _flat(r: ContributionRecord) -> dict[str, object]:
    out = r.to_json()
    out["checks"] = ";".join(f"{k}:{v}" for k, v in out["checks"].items())
    return out


def _emit(rows: list[dict[str, object]], as_json: bool, as_csv: bool, table: object) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=None))
    elif as_csv:
        if rows:
            w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        # piped output is not cut to 80 columns: a log is read in files and pagers too
        Console(width=None if sys.stdout.isatty() else 200).print(table(rows))  # type: ignore[operator]


def _fmt(v: object, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _rows_table(rows: list[dict[str, object]]) -> Table:
    t = Table(title=f"contribution log ({len(rows)} rows)")
    for c in _COLUMNS:
        t.add_column(c, justify="left" if c in ("peer", "reason") else "right")
    for r in rows:
        own = _delta(r["loss_own_before"], r["loss_own_after"])
        rnd = _delta(r["loss_random_before"], r["loss_random_after"])
        t.add_row(
            str(r["window"]), str(r["peer"])[:12], "[green]yes[/green]" if r["accepted"] else "[red]no[/red]",
            _fmt(r["reason"]) if not r["accepted"] else "", _fmt(r["bytes"]), _fmt(r["norm"]), _fmt(r["overlap"], 2),
            own, rnd,
            _fmt(r["score"]), _fmt(r["reputation"], 3), _fmt(r["weight"], 2),
        )  # fmt: skip
    return t


def _delta(before: object, after: object) -> str:
    if isinstance(before, float) and isinstance(after, float):
        return f"{after - before:+.4f}"
    return "–"


def _summary_table(rows: list[dict[str, object]]) -> Table:
    t = Table(title="leaderboard")
    for c in ("peer", "windows", "accepted", "acceptance", "mean score", "reputation", "last window"):
        t.add_column(c, justify="left" if c == "peer" else "right")
    for r in rows:
        rate = r["acceptance_rate"]
        t.add_row(
            str(r["peer"])[:12], str(r["windows"]), str(r["accepted"]),
            f"{rate:.0%}" if isinstance(rate, float) else "–", _fmt(r["mean_score"]), _fmt(r["reputation"], 3),
            str(r["last_window"]),
        )  # fmt: skip
    return t


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
