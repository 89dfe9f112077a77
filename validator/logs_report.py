"""``sparseloco-validator logs``: the contribution log as tables, JSON or CSV, and the command's help.

    with LogView.open(db) as log:
        show(log, windows=(1, None), peer=None, rejected=False, per_window=False, evaluations=False,
             summary=True, as_json=False, as_csv=False)

One row per decided contribution (the default), one per window (``per_window``), the periodic
evaluations (``evaluations``), the leaderboard (``summary``, with the evaluations under it in a
table) or, in a run with several validators, each window's agreement (``agreement``: who led, in
which view, who signed, objections with their reasons, handovers; ``per_window`` shows it too),
printed as a rich table (not cut to 80 columns when piped), a JSON array or CSV. A log of a run
with one validator has no agreement: its output is what it always was.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from collections.abc import Callable

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from validator import reasons
from validator.log import ContributionRecord, WindowRecord
from validator.logview import AgreementSummary, LogView

__all__ = ["HELP", "show"]

HELP = """Show the contribution log: who sent what, how it scored, why it was rejected.

\b
Fields of each row (--json: an array of objects; --csv: the same columns):
  contributions  window, peer, received_at, bytes, digest, accepted, reason, detail,
                 norm, overlap, loss_own_before, loss_own_after, loss_random_before,
                 loss_random_after, score, reputation, weight, checks ("name:pass;..."),
                 decided rows only
  --windows      window, status (decided | published), opened_at, closed_at,
                 published_at, base, digest (of the aggregate), fingerprint (of θ
                 after it), val_loss, accepted, rejected, unannounced (uploads under
                 keys of peers without an announcement: counted, never read);
                 with several validators (--json) also agreement (as below) for
                 the windows that have one; the table prints it under the windows
  --agreement    several validators only: window, certified, leader (whose
                 proposal was certified), view, digest, signers, proposals
                 {validator: view}, endorsements {validator: digest}, objections
                 [{validator, proposer, view, digest, reasons}], handovers
                 [{validator, view}] (CSV: each list joined with ";")
  --evals        window (θ after its aggregate), fingerprint, sequences, tokens,
                 bytes, loss (nats/token), perplexity, bits_per_byte,
                 evaluated_at, seconds
  --summary      peer, windows, accepted, acceptance_rate, mean_score, reputation,
                 last_window; the table also shows the periodic evaluations
Times are unix seconds; absent values are null (empty in CSV). Rows exist only for
announced peers.

\b
Columns of the table (one row per contribution):
  accepted / reason  the decision; the reason of a rejection (below)
  bytes     the contribution's size in the store
  norm      its update's norm (checked against the reference: norm_outlier, norm_tiny)
  overlap   its largest Top-k index overlap with an upload read before it (0..1; the
            copy check), – when not compared
  own Δ     loss_own_after − loss_own_before: the change of the loss on the peer's own
            assigned data when its update alone is applied (negative = it learned)
  random Δ  the same on random held-out sequences, shared by every peer of the window
  score     own gain − |random gain| (gain = before − after): > 0 means the update lowered
            the loss on its own data more than it moved it elsewhere; – when not scored
            (only a sample of peers is scored per window)
  rep       reputation after the window: an exponential moving average (decay
            validator.reputation_decay) of +1 for a scored update with score > 0, −1 for
            a score ≤ 0 or a rejection held against the peer; unscored accepted windows
            and the rejections marked * below leave it unchanged. It can be negative for
            accepted work: an update within eval_harm_tolerance is accepted (it did no
            harm) but a score ≤ 0 is no evidence of useful training, so it counts −1.
  weight    its weight in the aggregate (1.0 accepted, 0.0 rejected)
Peers read their own row of each window (accepted, reason, score, rep) from the outcomes
the validator publishes with every aggregate (<run>/outcomes/<window>, protocol.outcomes).
"""
HELP += "\n\n" + reasons.help_text()  # the rejection reasons, from their one table

_COLUMNS = (
    "window",
    "peer",
    "accepted",
    "reason",
    "bytes",
    "norm",
    "overlap",
    "own Δ",
    "random Δ",
    "score",
    "rep",
    "weight",
)


def show(
    log: LogView,
    *,
    windows: tuple[int | None, int | None],
    peer: str | None,
    rejected: bool,
    per_window: bool,
    evaluations: bool,
    summary: bool,
    as_json: bool,
    as_csv: bool,
    agreement: bool = False,
) -> None:
    """Print what ``logs`` was asked for (the flags as the command takes them, checked there):
    ``windows`` is an inclusive range, either end open; ``peer`` a prefix of a peer id."""
    if agreement:
        _emit(
            [agreement_json(a, flat=as_csv) for a in log.agreements(windows=windows)], as_json, as_csv, _agreement_table
        )
        return
    if per_window:
        lo, hi = windows
        picked = [w for w in log.windows() if (lo is None or w.window >= lo) and (hi is None or w.window <= hi)]
        agreed = {a.window: a for a in log.agreements(windows=windows)}
        picked_rows = [_window_row(w) for w in picked]
        if as_json:
            for r in picked_rows:
                if r["window"] in agreed:
                    r["agreement"] = agreement_json(agreed[r["window"]])
        _emit(picked_rows, as_json, as_csv, _windows_table)
        if agreed and not (as_json or as_csv):
            _emit([agreement_json(a) for a in agreed.values()], False, False, _agreement_table)
        return
    evals = [dataclasses.asdict(e) for e in log.evaluations(windows=windows)]
    if evaluations:
        _emit(evals, as_json, as_csv, _evals_table)
        return
    if summary:
        board = [dataclasses.asdict(r) for r in log.leaderboard(windows=windows)]
        if peer:
            board = [b for b in board if b["peer"].startswith(peer)]
        _emit(board, as_json, as_csv, _summary_table)
        if evals and not (as_json or as_csv):
            _emit(evals, False, False, _evals_table)
        return
    rows = log.rows(peer=peer, windows=windows, rejected_only=rejected)
    _emit([_flat(r) for r in rows], as_json, as_csv, _rows_table)


def _flat(r: ContributionRecord) -> dict[str, object]:
    out = r.to_json()
    out["checks"] = ";".join(f"{k}:{v}" for k, v in out["checks"].items())
    return out


def _window_row(w: WindowRecord) -> dict[str, object]:
    """A window as ``logs --windows`` prints it (``digest``: the published aggregate's)."""
    out: dict[str, object] = dataclasses.asdict(w)
    out["digest"] = out.pop("aggregate_digest")
    return out


def agreement_json(a: AgreementSummary, *, flat: bool = False) -> dict[str, object]:
    """A window's agreement as ``logs --agreement --json`` prints it (``flat``: the CSV form, each
    list joined with ";", each objection ``validator>proposer@view: reason | reason``)."""
    objections = [
        {
            "validator": o.validator,
            "proposer": o.proposer,
            "view": o.view,
            "digest": o.digest,
            "reasons": list(o.reasons),
        }
        for o in a.objections
    ]
    handovers = [{"validator": v, "view": view} for v, view in a.handovers]
    out: dict[str, object] = {
        "window": a.window,
        "certified": a.certified,
        "leader": a.leader,
        "view": a.view,
        "digest": a.digest,
        "signers": list(a.signers),
        "proposals": dict(a.proposals),
        "endorsements": dict(a.endorsements),
        "objections": objections,
        "handovers": handovers,
    }
    if flat:
        out["signers"] = ";".join(a.signers)
        out["proposals"] = ";".join(f"{v}@{view}" for v, view in a.proposals.items())
        out["endorsements"] = ";".join(f"{v}:{d}" for v, d in a.endorsements.items())
        out["objections"] = ";".join(
            f"{o.validator}>{o.proposer}@{o.view}: {' | '.join(o.reasons)}" for o in a.objections
        )
        out["handovers"] = ";".join(f"{v}@{view}" for v, view in a.handovers)
    return out


def _emit(
    rows: list[dict[str, object]], as_json: bool, as_csv: bool, table: Callable[[list[dict[str, object]]], Table]
) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=None))
    elif as_csv:
        if rows:
            w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        # piped output is not cut to 80 columns: a log is read in files and pagers too
        Console(width=None if sys.stdout.isatty() else 200).print(table(rows))


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
            str(r["window"]),
            str(r["peer"])[:12],
            "[green]yes[/green]" if r["accepted"] else "[red]no[/red]",
            _fmt(r["reason"]) if not r["accepted"] else "",
            _fmt(r["bytes"]),
            _fmt(r["norm"]),
            _fmt(r["overlap"], 2),
            own,
            rnd,
            _fmt(r["score"]),
            _fmt(r["reputation"], 3),
            _fmt(r["weight"], 2),
        )
    return t


def _delta(before: object, after: object) -> str:
    if isinstance(before, float) and isinstance(after, float):
        return f"{after - before:+.4f}"
    return "–"


def _windows_table(rows: list[dict[str, object]]) -> Table:
    t = Table(title=f"windows ({len(rows)})")
    for c in ("window", "status", "val loss", "accepted", "rejected", "fingerprint", "digest"):
        t.add_column(c, justify="left" if c in ("status", "fingerprint", "digest") else "right")
    for r in rows:
        t.add_row(
            str(r["window"]),
            str(r["status"]),
            _fmt(r["val_loss"]),
            str(r["accepted"]),
            str(r["rejected"]),
            _fmt(r["fingerprint"])[:16],
            _fmt(r["digest"])[:16],
        )
    return t


def _summary_table(rows: list[dict[str, object]]) -> Table:
    t = Table(title="leaderboard")
    for c in ("peer", "windows", "accepted", "acceptance", "mean score", "reputation", "last window"):
        t.add_column(c, justify="left" if c == "peer" else "right")
    for r in rows:
        rate = r["acceptance_rate"]
        t.add_row(
            str(r["peer"])[:12],
            str(r["windows"]),
            str(r["accepted"]),
            f"{rate:.0%}" if isinstance(rate, float) else "–",
            _fmt(r["mean_score"]),
            _fmt(r["reputation"], 3),
            str(r["last_window"]),
        )
    return t


def _evals_table(rows: list[dict[str, object]]) -> Table:
    t = Table(title=f"evaluations of θ ({len(rows)}, validation split)")
    for c in ("window", "loss", "perplexity", "bits/byte", "sequences", "fingerprint", "seconds"):
        t.add_column(c, justify="left" if c == "fingerprint" else "right")
    for r in rows:
        t.add_row(
            str(r["window"]),
            _fmt(r["loss"]),
            _fmt(r["perplexity"], 3),
            _fmt(r["bits_per_byte"]),
            str(r["sequences"]),
            _fmt(r["fingerprint"])[:16],
            _fmt(r["seconds"], 1),
        )
    return t


def _agreement_table(rows: list[dict[str, object]]) -> Table:
    t = Table(title=f"agreement of the validators ({len(rows)} windows)")
    for c in ("window", "leader", "view", "signers", "proposals", "objections", "handovers"):
        t.add_column(c, justify="right" if c in ("window", "view") else "left")
    for r in rows:
        objections = r["objections"]
        handovers = r["handovers"]
        proposals = r["proposals"]
        t.add_row(
            str(r["window"]),
            str(r["leader"])[:12] if r["certified"] else "[yellow]not certified[/yellow]",
            _fmt(r["view"]),
            ", ".join(str(s)[:12] for s in r["signers"]) if isinstance(r["signers"], list) else "",
            ", ".join(f"{str(v)[:12]}@{view}" for v, view in proposals.items()) if isinstance(proposals, dict) else "",
            "\n".join(
                escape(f"{str(o['validator'])[:12]} → {str(o['proposer'])[:12]}@{o['view']}: {'; '.join(o['reasons'])}")
                for o in objections
            )
            if isinstance(objections, list)
            else "",
            ", ".join(f"{str(h['validator'])[:12]}@{h['view']}" for h in handovers)
            if isinstance(handovers, list)
            else "",
        )
    return t
