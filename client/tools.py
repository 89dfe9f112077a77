"""``sparseloco``: shared utilities (``run-id``, ``inspect``; the local swarm launcher ``demo``; using
the trained model: ``checkpoints``, ``export``, ``eval``, ``sample``).

Each subcommand is a thin click command; the work lives in the library. To add one: import it and
``main.add_command(it)`` at the bottom of this file. Commands import torch only when they run, so
``sparseloco --help`` stays quick.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from client.demo.cli import demo as demo_cmd
from client.model_tools import COMMANDS as MODEL_COMMANDS
from client.store_access import ReadAccess, default_state_dir, key_option, open_run_store
from protocol.config import RunSpec
from protocol.errors import ConfigError, StoreError
from protocol.identity import public_key_from_hex
from protocol.layout import run_id
from protocol.settings import local_table
from protocol.settings_cli import STORE_FLAGS, Overrides, setting_options

if TYPE_CHECKING:
    from client.inspect import InspectResult
    from client.status import RunStatus

EXIT_INVALID = 2
INSPECT_MAX_BYTES = 1 << 30  # client.inspect.DEFAULT_MAX_BYTES (that module loads torch)
INSPECT_MAX_MEMORY = 4 << 30  # client.inspect.DEFAULT_MAX_MEMORY


@click.group()
@click.version_option(package_name="sparseloco")
def main() -> None:
    """sparseloco: decentralized LLM pre-training with SparseLoCo."""


@click.command("inspect")
@click.argument("paths", nargs=-1, required=True, type=click.Path(dir_okay=True, path_type=str))
@click.option("--max-bytes", type=int, default=INSPECT_MAX_BYTES, show_default=True, help="Size cap per object.")
@click.option(
    "--max-memory",
    type=int,
    default=INSPECT_MAX_MEMORY,
    show_default=True,
    help="Cap on the decoded tensors an object's header declares (refused before its payload is read).",
)
@click.option(
    "--run",
    "run_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="RunSpec TOML: require its run hash and its validator keys (OK then means signed by this run's "
    "validator); its [local] store settings open store URLs.",
)
@click.option("--run-hash", default=None, help="Also require this RunSpec hash (64 hex).")
@click.option(
    "--validator-key", "validator_keys", multiple=True, help="Hex public key allowed to sign aggregates (repeatable)."
)
@setting_options("store.dht_bootstrap")
@key_option
def inspect_cmd(
    paths: tuple[str, ...],
    max_bytes: int,
    max_memory: int,
    run_path: str | None,
    run_hash: str | None,
    validator_keys: tuple[str, ...],
    overrides: Overrides,
    key_path: str | None,
) -> None:
    """Validate signed objects (signature, structure, payloads) and print one line per object.

    \b
    PATHS are files, directories (every file below), or store URLs: a key, a prefix,
    a run or a whole store, e.g.
      sparseloco inspect --run run.toml s3://bucket/runs/<run id>/aggregate/00000003
      sparseloco inspect --run run.toml file:///srv/store        (the run's objects)
      sparseloco inspect dht://<run id>/checkpoint/ --dht-peer /ip4/…
    S3 credentials and endpoints come from the AWS_* variables, the URL's query
    (?endpoint=…&region=…) or --run's [local] store settings; with --run, the run's own
    store (its store.url) opens as sparseloco-peer join opens it: through store.grant_url
    when set, no credential needed.

    Without --run or --validator-key, OK means well-formed and signed by the key it names, not
    that this run's validator signed it (stderr says so). Exit status 0 when every object is
    valid, 2 otherwise.
    """
    from client.inspect import inspect_paths

    if run_hash is not None and not re.fullmatch(r"[0-9a-f]{64}", run_hash):
        raise click.BadParameter("must be 64 lowercase hex characters", param_hint="--run-hash")
    try:
        allowed = [public_key_from_hex(k) for k in validator_keys] or None
        spec = RunSpec.load(run_path) if run_path else None
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--validator-key/--run") from None
    if spec is not None:
        if run_hash is not None and run_hash != spec.hash():
            raise click.BadParameter(f"{run_path} has run hash {spec.hash()}", param_hint="--run-hash")
        run_hash = spec.hash()
        allowed = [*(allowed or []), *(public_key_from_hex(k) for k in spec.validator.public_keys)]
    check = Checks(max_bytes, run_hash, allowed, max_memory)
    all_ok = True
    for path in paths:
        if "://" in path:
            results = _inspect_url(path, run_path, overrides, key_path, spec, check)
        else:
            results = inspect_paths(
                [path], max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed, max_memory=max_memory
            )
        for result in results:
            click.echo(result.line)
            all_ok &= result.ok
    _trust_note(spec, run_hash, allowed)
    sys.exit(0 if all_ok else EXIT_INVALID)


def _inspect_url(
    url: str, run_path: str | None, overrides: Overrides, key_path: str | None, spec: RunSpec | None, check: Checks
) -> Iterator[InspectResult]:
    """The objects a store URL names (see ``inspect --help``); an unusable URL is one INVALID line.
    With --run, the run's own store opens as join opens it (:mod:`client.store_access`)."""
    from client.inspect import inspect_store, split_store_url

    root, prefix = split_store_url(url, run_id(spec.hash()) if spec is not None else None)
    try:
        if run_path is not None and spec is not None:
            store = ReadAccess.load(run_path, overrides, key_path).open(root)
        else:
            store = open_run_store(overrides.load(None).store, None, None, root)
    except (ConfigError, StoreError) as exc:
        from client.inspect import InspectResult, printable

        reason = exc.reason if isinstance(exc, StoreError) else "config_error"
        yield InspectResult(url, False, printable(f"INVALID {url} {reason}: {exc}"), reason=reason)
        return
    with store:
        yield from inspect_store(
            store,
            prefix,
            label=root.partition("?")[0],
            max_bytes=check.max_bytes,
            run_hash=check.run_hash,
            allowed_signers=check.allowed_signers,
            max_memory=check.max_memory,
        )


@dataclasses.dataclass(frozen=True)
class Checks:
    """What ``inspect`` requires of every object."""

    max_bytes: int
    run_hash: str | None
    allowed_signers: list[bytes] | None
    max_memory: int


def _trust_note(spec: RunSpec | None, run_hash: str | None, allowed: list[bytes] | None) -> None:
    """What OK meant, on stderr (stdout holds exactly one line per object)."""
    if spec is not None:
        note = f"checked against run {run_id(spec.hash())} (hash {spec.hash()}): OK means signed by its validator"
        note += " (aggregates, checkpoints, dataset) or by a peer for this run (contributions, announcements)"
    elif allowed:
        note = "OK means aggregates and checkpoints were signed by a --validator-key"
        note += f", for run hash {run_hash}" if run_hash else " (any run: give --run or --run-hash)"
    else:
        note = "no --run or --validator-key: OK means well-formed and validly signed by the key it names, not"
        note += " that a run's validator signed it"
    click.echo(f"note: {note}", err=True)


@click.command("run-id")
@click.argument("run_path", metavar="RUN_TOML", type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "run_id", "run_hash"} as one JSON object.')
def run_id_cmd(run_path: str, as_json: bool) -> None:
    """Print the run id and the full run hash of RUN_TOML.

    Two participants are in the same run exactly when these agree: compare them with the
    operator's. Only the RunSpec counts; the [local] table (checked here too), --settings files,
    SPARSELOCO_* variables and flags never change them. Exit status 2 for a file that does not load.
    """
    try:
        spec = RunSpec.load(run_path)
        local_table(run_path)
    except ConfigError as exc:
        click.echo(f"sparseloco run-id: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    run_hash = spec.hash()
    if as_json:
        click.echo(json.dumps({"name": spec.name, "run_id": run_id(run_hash), "run_hash": run_hash}))
        return
    click.echo(f"run id    {run_id(run_hash)}")
    click.echo(f"run hash  {run_hash}")


@click.command("status")
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False), help="RunSpec TOML.")
@click.option(
    "--state",
    "state_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="The local peer's state directory [default: ~/.sparseloco/<run id>].",
)
@setting_options(*STORE_FLAGS)
@key_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status_cmd(run_path: str, state_dir: str | None, overrides: Overrides, key_path: str | None, as_json: bool) -> None:
    """Where the run stands and whether this peer agrees with it.

    \b
    Shows the chain head (the newest aggregate signed by the run's validator:
    window, digest, published_at, θ fingerprint), the last checkpoint, the
    peers of the head's window (accepted from the aggregate's manifest; with
    the validator's published outcomes also the rejected ones, their reason,
    score and reputation) and whether the local peer's θ matches the chain
    (the last record of its state directory's windows.jsonl against the
    chain's aggregate of that window).

    JSON fields: run_id, run_hash, store, head {window, digest, published_at,
    fingerprint, accepted, rejected, val_loss}, head_error, checkpoint {window,
    published_at, fingerprint, bytes}, peers [{peer, accepted, reason, score,
    reputation, window, check (null: not published), weight}], outcomes
    (published | none | unreadable: …), local {peer_id, window, fingerprint,
    matches, detail}.

    Exit status: 0 (1 when the local peer's θ differs from the chain), 2 configuration error.
    """
    from client.status import run_status

    try:
        access = ReadAccess.load(run_path, overrides, key_path, state_dir)
        spec, settings = access.spec, access.local.store
        state = Path(state_dir) if state_dir else default_state_dir(spec)
        with access.open() as store:  # as join opens it: grants signed with the key (reads need no standing)
            status = run_status(
                spec,
                store,
                store_url=settings.location(),
                state_dir=state if state.exists() else None,
                peer_id=access.identity.peer_id if access.own_key else None,
            )
    except (ConfigError, StoreError) as exc:
        click.echo(f"sparseloco status: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    if as_json:
        click.echo(json.dumps(status.to_json(), sort_keys=True, allow_nan=False))
    else:
        _print_status(status)
    sys.exit(1 if status.local is not None and status.local.matches is False else 0)


def _print_status(status: RunStatus) -> None:
    from rich.console import Console
    from rich.table import Table

    def when(ts: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))

    click.echo(f"run        {status.run_id} (hash {status.run_hash})  store {status.store}")
    h = status.head
    if h is None:
        click.echo("head       no signed aggregate yet" + (f" ({status.head_error})" if status.head_error else ""))
    else:
        loss = f"  val_loss {h.val_loss:.4f}" if h.val_loss is not None else ""
        click.echo(
            f"head       window {h.window}  digest {h.digest[:16]}  published {when(h.published_at)}"
            f"  θ {h.fingerprint[:16]}  accepted {h.accepted}  rejected {_opt(h.rejected)}{loss}"
        )
    c = status.checkpoint
    click.echo(
        f"checkpoint window {c['window']}  published {when(c['published_at'])}  θ {str(c['fingerprint'])[:16]}"
        f"  {c['bytes']:,} B"
        if c
        else "checkpoint none"
    )
    if status.local is None:
        click.echo("local      no peer state directory")
    else:
        mark = {True: "MATCH", False: "DIFFERS", None: "-"}[status.local.matches]
        click.echo(f"local      {mark}  {status.local.detail}")
    if h is not None:
        table = Table(title=f"peers of window {h.window} (outcomes: {status.outcomes})")
        for col in ("peer", "accepted", "reason", "score", "rep"):
            table.add_column(col, no_wrap=True)
        me = status.local.peer_id if status.local else None
        for r in status.peers:
            table.add_row(
                f"{r.peer} (you)" if r.peer == me else r.peer,
                "yes" if r.accepted else "no",
                r.reason or "",
                _opt(r.score, "{:+.4g}"),
                _opt(r.reputation, "{:.3f}"),
            )
        Console(highlight=False, width=None if sys.stdout.isatty() else 120).print(table)  # a pipe: no truncation


def _opt(value: float | int | None, fmt: str = "{}") -> str:
    return "–" if value is None else fmt.format(value)


main.add_command(status_cmd)
main.add_command(run_id_cmd)
main.add_command(inspect_cmd)
main.add_command(demo_cmd)  # the local swarm launcher (client/demo/cli.py)
for _cmd in MODEL_COMMANDS:  # checkpoints, export, eval, sample (client/model_tools.py)
    main.add_command(_cmd)
