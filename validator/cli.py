"""``sparseloco-validator``: create a run, run its validator, audit it, read its contribution log, make its key.

    sparseloco-validator keygen --key validator.pem          # prints the public key for the RunSpec
    sparseloco-validator init --corpus PATH... --store URL --key validator.pem --out run.toml
                              [--tokenizer bytes|tokenizer.json] [--preset NAME | --spec base.toml]
                              [--text-field text] [--name NAME] [--shard-tokens N] [--json]
    sparseloco-validator run --run run.toml --key validator.pem --state vstate [--settings FILE]
                             [--store URL] [--dht-peer MULTIADDR ...] [--device cuda] [--threads N]
                             [--windows N] [--status-json]
                             [--eval-every N [--eval-sequences M]]
                             [--grant-port PORT [--grant-host HOST] [--tls-cert PEM --tls-key PEM]]
                             [--wait-for-peers N] [--retain-windows K [--retain-checkpoint-every M]]
                             [--metrics-port PORT] [--log-format human|json]
                             [--max-fetches N] [--max-fetch-bytes B] [--fetch-timeout S] …
    sparseloco-validator gc --run run.toml [--store URL] [--retain-windows K]
                            [--retain-checkpoint-every M] [--key validator.pem] [--dry-run] [--json]
    sparseloco-validator audit --run run.toml [--store URL] [--from W] [--to W] [--json]
    sparseloco-validator logs --db vstate/contributions.sqlite [--peer ID] [--window A:B] [--rejected]
                              [--windows | --evals | --agreement] [--json | --csv] [--summary] [--plot PNG]
    sparseloco-validator dashboard --db vstate/contributions.sqlite [--host 127.0.0.1] [--port 8080]

Local settings (store, device, poll interval, the window budgets …; :mod:`protocol.settings`) come
from the flags, then ``SPARSELOCO_*`` variables, then ``--settings FILE``, then run.toml's
``[local]`` table; the flags of each command are generated from the settings it names
(:mod:`protocol.settings_cli`).
With ``--grant-port`` the validator also serves grants (:mod:`validator.grant_server`): peers
without a store credential get presigned requests for their own keys and for reading the run.

``run`` reports what happens as :mod:`protocol.events` records: one timestamped human line each
(``2025-01-31 12:00:03 window 3 published: accepted=3 rejected=0 val_loss=4.5487 …``), or with
``--status-json`` one JSON object per line on stdout and nothing else there (what ``sparseloco
demo`` reads), or with ``--log-format json`` one JSON log object per line (:mod:`protocol.logformat`);
``--metrics-port`` serves Prometheus metrics fed by the same events (:mod:`protocol.metrics`). Ctrl-C or SIGTERM finish or abandon the current window cleanly (a restart resumes
it). Exit codes: 0 done, 1 the store failed at start, 2 configuration/identity error, 130 interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from protocol.config import RunSpec
from protocol.errors import ConfigError, ProtocolError, StoreError
from protocol.events import Failed
from protocol.identity import Identity
from protocol.logformat import FORMATS, setup_logging
from protocol.settings import SETTINGS, resolve_settings, settings_help
from protocol.settings_cli import COMPUTE_FLAGS, STORE_FLAGS, Overrides, setting_options
from validator import logs_report
from validator.log import LOG_FILE, ContributionLog
from validator.logview import LogView
from validator.serve import EXIT_CONFIG, EXIT_STORE, ROLE, Node, Reporting, event_lines, validate

# What `init` writes into run.toml's [local.store] besides the store: where volunteers reach it.
INIT_STORE_FLAGS = ("store.s3_endpoint", "store.s3_region", "store.grant_url")

if TYPE_CHECKING:
    from validator.audit import AuditReport
    from validator.init import InitResult

DEFAULT_KEY = "~/.sparseloco/validator.pem"
DEFAULT_STATE = "validator-state"

# The settings each command takes as flags (the others: environment, --settings, run.toml [local]).
RETAIN_FLAGS = ("validator.retain_windows", "validator.retain_checkpoint_every")
BUDGET_FLAGS = tuple(name for name in SETTINGS if name.startswith("budgets."))
RUN_FLAGS = (
    *STORE_FLAGS,
    *COMPUTE_FLAGS,
    "validator.eval_every",
    "validator.eval_sequences",
    "validator.grant_port",
    "validator.grant_host",
    "validator.tls_cert",
    "validator.tls_key",
    *RETAIN_FLAGS,
    *BUDGET_FLAGS,
)


@click.group()
def cli() -> None:
    """SparseLoCo validator: checks, scores and aggregates contributions; keeps the contribution log."""


@cli.command()
@click.option(
    "--key", "key_path", default=DEFAULT_KEY, show_default=True, help="Ed25519 key file (created if missing)."
)
@click.option("--json", "as_json", is_flag=True, help='Print {"public_key": …, "peer_id": …}.')
def keygen(key_path: str, as_json: bool) -> None:
    """Create (or load) the validator key; print its public key (hex, for ``validator.public_keys``
    in run.toml) and its id form (the peer id the validator signs and is listed under)."""
    ident = Identity.load_or_create(Path(key_path).expanduser())
    if as_json:
        click.echo(json.dumps({"public_key": ident.public_key_hex, "peer_id": ident.peer_id}))
        return
    click.echo(f"public key  {ident.public_key_hex}")
    click.echo(f"peer id     {ident.peer_id}")


@cli.command()
@click.option(
    "--corpus",
    "corpus",
    multiple=True,
    required=True,
    help="builtin:stdlib, a text file or directory, a .jsonl file, or a shard directory (repeatable).",
)
@setting_options(*STORE_FLAGS, *INIT_STORE_FLAGS, settings_file=False, required=("store.url",))
@click.option(
    "--key", "key_path", default=DEFAULT_KEY, show_default=True, help="Validator Ed25519 key (created if missing)."
)
@click.option(
    "--tokenizer",
    default="bytes",
    show_default=True,
    help="'bytes', or a tokenizer.json (stored in the run's store, named by its sha256 in the RunSpec).",
)
@click.option("--text-field", default="text", show_default=True, help="The text field of JSONL lines.")
@click.option(
    "--preset", default=None, help="A run preset (protocol/presets: demo) or a model preset (tiny, small, 150m …)."
)
@click.option(
    "--spec", "spec_path", default=None, type=click.Path(exists=True, dir_okay=False), help="Base RunSpec TOML."
)
@click.option("--name", default=None, help="The run's name (RunSpec name) [default: the base's].")
@click.option("--shard-tokens", type=click.IntRange(1), default=None, help="Tokens per shard [default: 1 Mi].")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="The run.toml to write (new).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def init(
    corpus: tuple[str, ...],
    overrides: Overrides,
    key_path: str,
    tokenizer: str,
    text_field: str,
    preset: str | None,
    spec_path: str | None,
    name: str | None,
    shard_tokens: int | None,
    out_path: str,
    as_json: bool,
) -> None:
    """Create a run from a corpus: tokenize it once into content-addressed shards, put them and a
    signed dataset manifest into the run's store, and write run.toml (`run` publishes genesis).

    \b
    The RunSpec is the base (--preset or --spec) with data.dataset (the manifest's digest),
    data.tokenizer ('bytes' or 'hf:<sha256>'), this key in validator.public_keys and
    model.vocab_size at least the tokenizer's; run.toml's [local] table names the store (and
    keeps the base's [local] table; --store, --dht-peer, --s3-endpoint, --s3-region and
    --grant-url are written to it: with --grant-url the volunteers' run.toml needs nothing added).
    Peers fetch only the shards their batches need.
    Prints the run id and run hash. Exit status: 0 done, 1 the store failed, 2 configuration.
    """
    from validator.dataset import DEFAULT_SHARD_TOKENS
    from validator.init import base_spec, init_run

    err = Console(stderr=True, highlight=False)
    try:
        base, table = base_spec(preset, spec_path)
        given = {
            name.split(".")[1]: overrides.get(name) for name in (*STORE_FLAGS, *INIT_STORE_FLAGS) if overrides.get(name)
        }
        table = {**table, "store": {**table.get("store", {}), **given}}
        settings = resolve_settings(run_local=table, env=os.environ, flags=overrides.flags)
        identity = Identity.load_or_create(Path(key_path).expanduser())
        with _InitProgress(err) as steps:
            result = init_run(
                list(corpus),
                base=base,
                local=table,
                store=settings.store,
                identity=identity,
                out=out_path,
                tokenizer=tokenizer,
                name=name,
                shard_tokens=shard_tokens or DEFAULT_SHARD_TOKENS,
                text_field=text_field,
                steps=steps,
            )
    except ConfigError as exc:
        err.print(f"sparseloco-validator init: {escape(str(exc))}")
        sys.exit(EXIT_CONFIG)
    except (StoreError, ProtocolError) as exc:
        err.print(f"sparseloco-validator init: the store failed: {escape(str(exc))}")
        sys.exit(EXIT_STORE)
    _print_init(result, settings.store.location(), as_json)


def _print_init(r: InitResult, store: str, as_json: bool) -> None:
    if as_json:
        fields = {
            "run_id": r.run_id,
            "run_hash": r.run_hash,
            "dataset": r.dataset,
            "tokenizer": r.spec.data.tokenizer,
            "shards": r.shards,
            "train_tokens": r.train_tokens,
            "val_tokens": r.val_tokens,
            "data_bytes": r.data_bytes,
            "documents": r.documents,
            "store": store,
            "run_toml": str(r.out),
        }
        click.echo(json.dumps(fields))
        return
    click.echo(f"run id     {r.run_id}")
    click.echo(f"run hash   {r.run_hash}")
    click.echo(
        f"dataset    {r.dataset}  ({r.documents:,} documents, {r.shards} shards, {r.train_tokens:,} train + "
        f"{r.val_tokens:,} val tokens, {r.data_bytes / 2**20:.1f} MiB)"
    )
    click.echo(f"tokenizer  {r.spec.data.tokenizer}")
    click.echo(f"store      {store}")
    click.echo(f"wrote      {r.out}  (give it to every peer: sparseloco-peer join --run {r.out.name})")


class _InitProgress:
    """``init``'s progress bars on stderr (rich): tokenizing, then uploading."""

    def __init__(self, console: Console) -> None:
        self.bars = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=console,
        )

    def __enter__(self) -> _InitProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def tokenizing(self, total_bytes: int) -> Callable[[int], None]:
        return self._task("tokenizing", total_bytes)

    def uploading(self, total_bytes: int) -> Callable[[int], None]:
        return self._task("uploading", total_bytes)

    def _task(self, what: str, total: int) -> Callable[[int], None]:
        task = self.bars.add_task(what, total=total or None)
        return lambda n: self.bars.advance(task, n)


@cli.command(epilog=settings_help())
@click.option("--run", "run_path", required=True, type=click.Path(dir_okay=False), help="RunSpec TOML.")
@setting_options(*RUN_FLAGS)
@click.option("--key", "key_path", default=DEFAULT_KEY, show_default=True, help="Validator Ed25519 key file.")
@click.option("--state", "state_dir", default=DEFAULT_STATE, show_default=True, help="State directory (θ, log).")
@click.option("--windows", type=int, default=None, help="Stop after N windows (default: run until stopped).")
@click.option("--status-json", is_flag=True, help="One JSON event per line on stdout instead of human lines.")
@click.option(
    "--wait-for-peers",
    type=click.IntRange(0),
    default=0,
    help="A new run: publish genesis (open window 0) only once N peers have announced.",
)
@click.option(
    "--log-format",
    type=click.Choice(FORMATS),
    default="human",
    show_default=True,
    help="human: timestamped lines; json: one JSON object per line (time, level, logger, event, message, "
    "the event's fields), events on stdout, log records on stderr.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (window, phase, accepted/rejected, "
    "check failures by reason, phase durations, peers expected/uploaded, bytes read …).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics endpoint binds (0.0.0.0: every network this machine is on).",
)
@click.option(
    "--fault",
    type=click.Choice(["liar"]),
    default=None,
    hidden=True,
    help="Misbehave on purpose, to show what the other validators do (a run with several validators): "
    "liar proposes a Δ̄ that is not the sum it claims and endorses everything.",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def run(
    run_path: str,
    overrides: Overrides,
    key_path: str,
    state_dir: str,
    windows: int | None,
    status_json: bool,
    wait_for_peers: int,
    log_format: str,
    metrics_port: int | None,
    metrics_host: str,
    fault: str | None,
    verbose: bool,
) -> None:
    """Validate windows: gather, check, score, aggregate, publish.

    \b
    Events (protocol.events; with --status-json one JSON object per line,
    {"event": kind, "time": unix s, ...fields}):
      validator_started  peer_id, run_id, run_hash, store, device
      window_opened      window, base, opened_at      (gathering begins)
      window_waiting     window, waiting_for [peer ids], uploaded, closes_in_s
                         (every few seconds while expected peers are missing)
      window_published   window, accepted, rejected, val_loss, digest, fingerprint,
                         published_at, reasons {reason: count}, seconds {phase: s},
                         leader, view, signers [ids] (several validators)
      agreement          window, validator, step (proposed | endorsed | objected |
                         handover | certified), digest, view, detail
                         (several validators: each step this validator saw)
      window_retry       window, reason, detail, attempt, limit, wait_s
                         (a store error; retried after wait_s, at most
                         validator.window_retries times in a row)
      window_held        window, announced, hold_s    (restarted, nobody uploaded: held
                         until a peer is back, validator.restart_hold_s at most)
      store_errors       window, failed {kind: n}, reasons {reason: n}, first_at,
                         last_at, recovered, detail   (store requests that failed
                         while gathering the window: one summary per window)
      checkpoint_skipped window, reason, detail       (the store refused it; the run goes on)
      store_object_rejected  key, reason, detail      (a checkpoint retention cannot verify)
      model_evaluated    window, fingerprint, sequences, loss, perplexity,
                         bits_per_byte, seconds       (--eval-every N)
      grants_served      url                          (--grant-port)
      granted            peer_id, address, op, key, size, expires_at
      grant_denied       peer_id, address, op, key, reason, status, detail
      stopped            role, reason (done | stopped | interrupted), window
      failed             role, reason, detail

    Exit status: 0 done, 1 the store failed at start or failed one window validator.window_retries
    times in a row, 2 configuration or identity error, 130 stopped or interrupted.
    """
    setup_logging(log_format, verbose=verbose, stream=sys.stderr)
    out = Reporting(event_lines(status_json, log_format), metrics_port, metrics_host)
    try:
        local = overrides.load(run_path)
    except ConfigError as exc:
        out.emit(Failed(role=ROLE, reason="config_error", detail=str(exc)))
        sys.exit(EXIT_CONFIG)
    sys.exit(validate(run_path, local, Node(key_path, state_dir, windows, wait_for_peers, fault or ""), out))


@cli.command(epilog=settings_help())
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False), help="RunSpec TOML.")
@setting_options(*STORE_FLAGS, *RETAIN_FLAGS)
@click.option(
    "--key",
    "key_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Validator Ed25519 key: a dht:// store deletes only the validator's records.",
)
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def gc(run_path: str, overrides: Overrides, key_path: str | None, dry_run: bool, as_json: bool) -> None:
    """Delete what the retention policy no longer keeps: contributions and aggregates older than
    the last K windows, checkpoints before the newest one a joiner can start from (except genesis
    and every M-th). The newest checkpoint, every aggregate after it, the dataset and the
    announcements always stay. The run's window is read from its newest signed aggregate. Lists
    every key with its size, and totals of what goes and what stays.

    Exit status: 0 done, 1 a store error, 2 configuration error (retention off, bad RunSpec).
    """
    from validator.collection import collect_run

    try:
        local = overrides.load(run_path)
        spec = RunSpec.load(run_path)
        ident = Identity.load(Path(key_path)) if key_path else None
        report = collect_run(spec, local, identity=ident, dry_run=dry_run)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except StoreError as exc:
        click.echo(f"store error: {exc}", err=True)
        sys.exit(EXIT_STORE)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        report.print(Console(highlight=False, soft_wrap=True))


@cli.command(epilog=settings_help())
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False), help="RunSpec TOML.")
@setting_options(*STORE_FLAGS, "compute.threads")
@click.option(
    "--from",
    "start",
    type=click.IntRange(0),
    default=None,
    help="First window (θ from the newest checkpoint at/below).",
)
@click.option("--to", "end", type=click.IntRange(0), default=None, help="Last window (default: the chain's head).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per window, then a summary line.")
def audit(run_path: str, overrides: Overrides, start: int | None, end: int | None, as_json: bool) -> None:
    """Recompute every published aggregate of a run from its store, with the settings a peer
    uses and no validator key: the aggregate (or certificate) verifies and chains; with several
    validators the signer's proposal carries it, and Δ̄ and θ_(t+1) are recomputed bit for bit
    from the contributions by digest; with one validator every contribution is checked and
    θ_(t+1)'s fingerprint (its Δ̄ cannot be recomputed without the clip caps). Windows whose
    contributions retention deleted, or whose re-compressed Δ̄ needs a buffer unknown from a
    checkpoint, are reported unchecked.

    Exit status: 0 no mismatch, 1 a mismatch (or a store error), 2 configuration error.
    """
    from protocol.store import open_peer_store
    from validator.audit import MISMATCH, OK, Auditor, WindowAudit

    if start is not None and end is not None and end < start:
        click.echo("error: --to is before --from", err=True)
        sys.exit(EXIT_CONFIG)
    err = Console(stderr=True, highlight=False)

    def progress(row: WindowAudit) -> None:
        err.print(f"audit: window {row.window} {row.verdict}", style=None if row.verdict == OK else "yellow")

    try:
        spec = RunSpec.load(run_path)
        local = overrides.load(run_path)
        reader = Identity.generate()  # reads need no standing: a throwaway key for grant requests
        with open_peer_store(local.store, reader, spec.hash(), validator_keys=spec.validator.public_keys) as store:
            auditor = Auditor(spec, store, workers=max(1, local.compute.threads or 2))
            try:
                report = auditor.audit(start, end, progress=progress)
            finally:
                auditor.close()
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except StoreError as exc:
        click.echo(f"store error: {exc}", err=True)
        sys.exit(EXIT_STORE)
    except ProtocolError as exc:  # what θ is rebuilt from (the launch, a checkpoint) does not verify
        click.echo(f"audit stopped: {exc}", err=True)
        sys.exit(1)
    if as_json:
        for row in report.rows:
            click.echo(json.dumps(row.to_json()))
        click.echo(json.dumps(report.summary()))
    else:
        _print_audit(report)
    sys.exit(0 if report.count(MISMATCH) == 0 else 1)


def _print_audit(report: AuditReport) -> None:
    from rich.table import Table

    from validator.audit import MISMATCH, OK

    table = Table(title=f"audit from window {report.start}")
    for column in ("window", "leader", "signers", "contributions", "verdict", "detail"):
        table.add_column(column, overflow="fold")
    colour = {OK: "green", MISMATCH: "red"}
    for r in report.rows:
        verdict = f"[{colour.get(r.verdict, 'yellow')}]{r.verdict}[/]"
        signers = ", ".join(s[:8] for s in r.signers)
        table.add_row(str(r.window), r.leader[:8], signers, str(r.contributions), verdict, escape(r.detail))
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    for note in report.notes:
        console.print(f"not checked: {note}")
    s = report.summary()
    n = s["windows"]
    console.print(
        f"{n} window{'' if n == 1 else 's'}: {s['ok']} ok, {s['mismatch']} mismatch, {s['unchecked']} unchecked"
    )


@cli.command(help=logs_report.HELP)
@click.option("--db", default=str(Path(DEFAULT_STATE) / LOG_FILE), show_default=True, help="Contribution log.")
@click.option("--peer", default=None, help="Peer id (a prefix is enough).")
@click.option("--window", "window_range", default=None, help="Window N or range A:B (either end may be empty).")
@click.option("--rejected", is_flag=True, help="Only rejected contributions.")
@click.option("--windows", "per_window", is_flag=True, help="One row per window (outcome, val loss, fingerprint).")
@click.option("--evals", "evaluations", is_flag=True, help="The periodic evaluations of θ (--eval-every).")
@click.option(
    "--agreement",
    is_flag=True,
    help="Several validators: per window who led, in which view, who signed, objections, handovers.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (an array of rows).")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV.")
@click.option("--summary", is_flag=True, help="Leaderboard: windows, acceptance rate, mean score per peer.")
@click.option(
    "--plot",
    "plot_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write the dashboard's charts to this PNG (val loss, outcomes per window, rejections by reason; "
    "--window picks windows; needs matplotlib: pip install 'sparseloco[plot]').",
)
def logs(
    db: str,
    peer: str | None,
    window_range: str | None,
    rejected: bool,
    per_window: bool,
    evaluations: bool,
    agreement: bool,
    as_json: bool,
    as_csv: bool,
    summary: bool,
    plot_path: str | None,
) -> None:
    # the help is logs_report.HELP: the fields, the table's columns and the rejection reasons
    _check_logs_flags(peer, rejected, per_window, evaluations, as_json, as_csv, summary)
    if agreement and (per_window or evaluations or summary or peer or rejected or plot_path):
        raise click.UsageError("--agreement lists whole windows: only --window, --json and --csv apply")
    if not Path(db).exists():
        raise click.ClickException(f"no contribution log at {db}")
    windows = _parse_range(window_range)
    if plot_path is not None:
        _plot(db, plot_path, windows, others=(peer, rejected, per_window, evaluations, as_json, as_csv, summary))
        return
    # opened as the validator opens it, so a log written by an older version is brought up to date
    with ContributionLog(db) as log:
        logs_report.show(
            LogView(log),
            windows=windows,
            peer=peer,
            rejected=rejected,
            per_window=per_window,
            evaluations=evaluations,
            summary=summary,
            as_json=as_json,
            as_csv=as_csv,
            agreement=agreement,
        )


def _check_logs_flags(
    peer: str | None, rejected: bool, per_window: bool, evaluations: bool, as_json: bool, as_csv: bool, summary: bool
) -> None:
    """Refuse ``logs`` flags that do not go together."""
    if as_json and as_csv:
        raise click.UsageError("--json and --csv are exclusive")
    if per_window and (summary or peer or rejected):
        raise click.UsageError("--windows lists whole windows: --summary, --peer and --rejected do not apply")
    if evaluations and (per_window or summary or peer or rejected):
        raise click.UsageError("--evals lists evaluations: --windows, --summary, --peer and --rejected do not apply")


def _plot(db: str, path: str, windows: tuple[int | None, int | None], others: tuple[object, ...]) -> None:
    """``logs --plot``: the charts of the whole log (or of ``--window``) as one PNG."""
    from validator.plots import write_plots  # matplotlib loads only for a plot

    if any(others):
        raise click.UsageError("--plot draws whole windows: only --window applies")
    try:
        with LogView.open(db) as log:
            write_plots(log, path, windows=windows)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {path}")


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


# ------------------------------------------------------------------------------ dashboard
@cli.command()
@click.option(
    "--db", default=str(Path(DEFAULT_STATE) / LOG_FILE), show_default=True, help="Contribution log (read only)."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port (0: a free one).")
def dashboard(db: str, host: str, port: int) -> None:
    """Serve the contribution log as web pages: leaderboard (first and last seen, windows, acceptance,
    mean score, reputation), one page per peer, validation loss and outcomes per window (SVG charts),
    rejections by reason, and the window the validator has open.

    \b
    The same data as JSON, for other tools:
      /api/overview  /api/leaderboard?page=N&per_page=M  /api/peers/<id>?page=N
      /api/windows?from=A&to=B&points=N  /api/rejections?from=A&to=B  /api/current
    The log is opened read-only on every request, so it can run beside a running
    validator; started before the validator (its directory exists, the log not yet), it answers
    503 until the log appears. Prints "dashboard at URL" once it listens; Ctrl-C or SIGTERM stops it.
    """
    from validator.dashboard import Dashboard

    try:
        server = Dashboard(db, host=host, port=port)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    waiting = "" if Path(db).is_file() else "; no log there yet: it shows the validator's once it starts"
    click.echo(f"dashboard at {server.start()}  (log {db}, read-only{waiting}; Ctrl-C stops)")
    sys.stdout.flush()  # whoever started it reads the URL from a pipe
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
