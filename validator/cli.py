"""``sparseloco-validator``: create a run, run its validator, read its contribution log, make its key.

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
    sparseloco-validator logs --db vstate/contributions.sqlite [--peer ID] [--window A:B] [--rejected]
                              [--windows | --evals] [--json | --csv] [--summary] [--plot PNG]
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

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from protocol.config import RunSpec
from protocol.errors import ConfigError, ProtocolError, StoreError
from protocol.events import Event, EventWriter, Failed, GrantsServed, Stopped, ValidatorStarted, describe
from protocol.identity import Identity
from protocol.logformat import FORMATS, JsonLogLines, setup_logging
from protocol.settings import SETTINGS, LocalSettings, resolve_settings, settings_help
from protocol.settings_cli import COMPUTE_FLAGS, STORE_FLAGS, Overrides, setting_options
from protocol.store import open_from_settings
from protocol.store.presign import Presigner
from validator import logs_report
from validator.log import LOG_FILE, ContributionLog
from validator.logview import LogView

if TYPE_CHECKING:
    from validator.grant_server import GrantServer
    from validator.grants import OpenWindows
    from validator.init import InitResult
    from validator.node import Validator

DEFAULT_KEY = "~/.sparseloco/validator.pem"
DEFAULT_STATE = "validator-state"
ROLE = "validator"
EXIT_STORE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130

Emit = Callable[[Event], None]

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
@setting_options(*STORE_FLAGS, settings_file=False, required=("store.url",))
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
    keeps the base's [local] table; --store and --dht-peer are written to it). Peers fetch only
    the shards their batches need.
    Prints the run id and run hash. Exit status: 0 done, 1 the store failed, 2 configuration.
    """
    from validator.dataset import DEFAULT_SHARD_TOKENS
    from validator.init import base_spec, init_run

    err = Console(stderr=True, highlight=False)
    try:
        base, table = base_spec(preset, spec_path)
        given = {name.split(".")[1]: overrides.get(name) for name in STORE_FLAGS if overrides.get(name)}
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
        err.print(f"sparseloco-validator init: {exc}")
        sys.exit(EXIT_CONFIG)
    except (StoreError, ProtocolError) as exc:
        err.print(f"sparseloco-validator init: the store failed: {exc}")
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
@click.option("--metrics-host", default="0.0.0.0", show_default=True, help="Address the metrics endpoint binds.")
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
                         published_at, reasons {reason: count}, seconds {phase: s}
      window_retry       window, reason, detail       (a store error; retried)
      model_evaluated    window, fingerprint, sequences, loss, perplexity,
                         bits_per_byte, seconds       (--eval-every N)
      grants_served      url                          (--grant-port)
      granted            peer_id, address, op, key, size, expires_at
      grant_denied       peer_id, address, op, key, reason, status, detail
      stopped            role, reason (done | stopped | interrupted), window
      failed             role, reason, detail

    Exit status: 0 done, 1 the store failed at start, 2 configuration or identity error, 130 stopped
    or interrupted.
    """
    setup_logging(log_format, verbose=verbose, stream=sys.stderr)
    out = _Reporting(_event_lines(status_json, log_format), metrics_port, metrics_host)
    try:
        local = overrides.load(run_path)
    except ConfigError as exc:
        out.emit(Failed(role=ROLE, reason="config_error", detail=str(exc)))
        sys.exit(EXIT_CONFIG)
    sys.exit(_validate(run_path, local, _Node(key_path, state_dir, windows, wait_for_peers), out))


@dataclasses.dataclass(frozen=True)
class _Node:
    """``run``'s validator: its key, state directory, how many windows, and whom it waits for."""

    key_path: str
    state_dir: str
    windows: int | None
    wait_for_peers: int


@dataclasses.dataclass(frozen=True)
class _Reporting:
    """Where ``run``'s events go: ``emit`` (the lines on stdout) and the optional metrics endpoint."""

    emit: Emit
    metrics_port: int | None
    metrics_host: str


def _event_lines(status_json: bool, log_format: str) -> Emit:
    """``--status-json``: JSON events; ``--log-format json``: JSON log lines; else human lines."""
    if status_json:
        return EventWriter(sys.stdout)
    if log_format == "json":
        return JsonLogLines(sys.stdout, role=ROLE)
    return _HumanLines(Console(highlight=False, soft_wrap=True))


def _validate(run_path: str, local: LocalSettings, node: _Node, out: _Reporting) -> int:
    """Open the validator (and its grant server, metrics endpoint), serve, close; the exit status."""
    # torch and the grant desk load here, not at import: `logs` (what sparseloco demo runs) stays quick.
    from validator.grants import OpenWindows
    from validator.state import STATE_FILE

    windows_open = OpenWindows()  # the grant desk's view of the window clock, from our own events
    sinks: list[Emit] = [windows_open.observe]

    def emit_all(event: Event) -> None:
        for sink in sinks:
            sink(event)
        out.emit(event)

    with ExitStack() as stack:
        if out.metrics_port is not None:
            from protocol.metrics import Metrics

            metrics = Metrics(role=ROLE)
            sinks.append(metrics)
            stack.enter_context(metrics.serve(out.metrics_port, out.metrics_host))
        try:
            validator = _open_validator(run_path, local, node.key_path, node.state_dir, emit_all)
            stack.callback(validator.close)
            if local.validator.grant_port:
                stack.enter_context(_grant_server(validator, local, windows_open, emit_all))
        except ConfigError as exc:
            out.emit(Failed(role=ROLE, reason="config_error", detail=str(exc)))
            return EXIT_CONFIG
        except StoreError as exc:  # the run's dataset manifest could not be read
            out.emit(Failed(role=ROLE, reason=exc.reason, detail=str(exc)))
            return EXIT_STORE
        _install_stop(validator)
        if node.wait_for_peers and not (Path(node.state_dir) / STATE_FILE).exists():
            _wait_for_peers(validator, node.wait_for_peers)
        return _serve(validator, node.windows, emit_all)


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


def _open_validator(run_path: str, local: LocalSettings, key_path: str, state_dir: str, emit: Emit) -> Validator:
    """The Validator the options describe; ValidatorStarted is its first event."""
    # torch and the node load here, not at import: `logs` (what sparseloco demo runs) stays quick.
    import torch

    from protocol.devices import resolve_device
    from validator.node import Validator

    if local.compute.threads > 0:
        torch.set_num_threads(local.compute.threads)
    spec = RunSpec.load(run_path)
    if not spec.data.dataset:
        raise ConfigError(
            f"{run_path} names no dataset (data.dataset): a run's data lies in its store; create the run "
            "with `sparseloco-validator init`"
        )
    ident = Identity.load(Path(key_path).expanduser())
    device = resolve_device(local.compute.device, default="cpu")
    # store.grant_url / public_reads are how peers reach the run; the validator holds the credential.
    local = dataclasses.replace(local, store=dataclasses.replace(local.store, grant_url="", public_reads=False))
    store = open_from_settings(local.store, identity=ident, validator_keys=spec.validator.public_keys)
    validator = Validator(spec, store, ident, state_dir, device=device, local=local, emit=emit)
    started = ValidatorStarted(
        peer_id=ident.peer_id,
        run_id=validator.run_id,
        run_hash=validator.run_hash,
        store=local.store.location(),
        device=device,
    )
    emit(started)
    return validator


def _grant_server(validator: Validator, local: LocalSettings, windows_open: OpenWindows, emit: Emit) -> GrantServer:
    """The started grant server of ``validator`` (its store signs the grants); GrantsServed says where."""
    from validator.grant_server import GrantServer
    from validator.grants import GrantDesk

    if not isinstance(validator.store, Presigner):
        raise ConfigError(
            f"--grant-port hands out presigned S3 requests: it needs an s3:// store, not {local.store.url}"
        )
    desk = GrantDesk(validator.spec, validator.store, windows_open.current, emit=emit)
    settings = local.validator
    server = GrantServer(
        desk, settings.grant_host, settings.grant_port, tls_cert=settings.tls_cert, tls_key=settings.tls_key
    ).start()
    emit(GrantsServed(url=server.url))
    return server


def _wait_for_peers(validator: Validator, count: int) -> None:
    """Until ``count`` peers have announced (and not withdrawn), or the validator is stopped."""
    while not validator.stop.is_set():
        registry = validator.registry
        if len(registry.refresh() - registry.withdrawn) >= count:
            return
        validator.stop.wait(validator.local.poll_interval_s)


def _serve(validator: Validator, windows: int | None, emit: Emit) -> int:
    """Run until done, stopped or failed; the exit status (the last event says why)."""
    try:
        validator.run(windows)
    except ConfigError as exc:
        emit(Failed(role=ROLE, reason="config_error", detail=str(exc)))
        return EXIT_CONFIG
    except KeyboardInterrupt:  # a second Ctrl-C: the current window is redone on restart
        emit(Stopped(role=ROLE, reason="interrupted", window=_window(validator)))
        return EXIT_INTERRUPTED
    if validator.stop.is_set():  # Ctrl-C or SIGTERM: an unfinished window is redone on restart
        emit(Stopped(role=ROLE, reason="stopped", window=_window(validator)))
        return EXIT_INTERRUPTED
    emit(Stopped(role=ROLE, reason="done", window=_window(validator)))
    return 0


def _window(validator: Validator) -> int | None:
    """The window a restart resumes at (None before the state was loaded)."""
    return validator.state.window if validator.state is not None else None


class _HumanLines:
    """Events as human lines on ``console``: local time, then :func:`protocol.events.describe`."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, event: Event) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.time))
        self.console.print(f"{stamp} {describe(event)}")
        sys.stdout.flush()  # a pipe (a log collector) sees each line when it happens


def _install_stop(validator: Validator) -> None:
    """First Ctrl-C / SIGTERM: stop after (or abandon) the current window; second Ctrl-C: now."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if validator.stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        validator.stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


# ------------------------------------------------------------------------------ logs
@cli.command(help=logs_report.HELP)
@click.option("--db", default=str(Path(DEFAULT_STATE) / LOG_FILE), show_default=True, help="Contribution log.")
@click.option("--peer", default=None, help="Peer id (a prefix is enough).")
@click.option("--window", "window_range", default=None, help="Window N or range A:B (either end may be empty).")
@click.option("--rejected", is_flag=True, help="Only rejected contributions.")
@click.option("--windows", "per_window", is_flag=True, help="One row per window (outcome, val loss, fingerprint).")
@click.option("--evals", "evaluations", is_flag=True, help="The periodic evaluations of θ (--eval-every).")
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
    as_json: bool,
    as_csv: bool,
    summary: bool,
    plot_path: str | None,
) -> None:
    # the help is logs_report.HELP: the fields, the table's columns and the rejection reasons
    _check_logs_flags(peer, rejected, per_window, evaluations, as_json, as_csv, summary)
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
    validator. Prints "dashboard at URL" once it listens; Ctrl-C or SIGTERM stops it.
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
    click.echo(f"dashboard at {server.start()}  (log {db}, read-only; Ctrl-C stops)")
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
