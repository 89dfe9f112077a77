"""``sparseloco``: shared utilities (``run-id``, ``inspect``; the local swarm launcher ``demo``; using
the trained model: ``checkpoints``, ``export``, ``eval``, ``sample``).

Each subcommand is a thin click command; the work lives in the library. To add one: import it and
``main.add_command(it)`` at the bottom of this file. Commands import torch only when they run, so
``sparseloco --help`` stays quick.
"""

from __future__ import annotations

import json
import re
import sys

import click

from client.demo.cli import demo as demo_cmd
from client.model_tools import COMMANDS as MODEL_COMMANDS
from protocol.config import RunSpec
from protocol.errors import ConfigError
from protocol.identity import public_key_from_hex
from protocol.layout import run_id
from protocol.settings import local_table

EXIT_INVALID = 2
INSPECT_MAX_BYTES = 1 << 30  # client.inspect.DEFAULT_MAX_BYTES (that module loads torch)


@click.group()
@click.version_option(package_name="sparseloco")
def main() -> None:
    """sparseloco: decentralized LLM pre-training with SparseLoCo."""


@click.command("inspect")
@click.argument("paths", nargs=-1, required=True, type=click.Path(dir_okay=True, path_type=str))
@click.option("--max-bytes", type=int, default=INSPECT_MAX_BYTES, show_default=True, help="Size cap per object.")
@click.option("--run-hash", default=None, help="Also require this RunSpec hash (64 hex).")
@click.option(
    "--validator-key", "validator_keys", multiple=True, help="Hex public key allowed to sign aggregates (repeatable)."
)
def inspect_cmd(paths: tuple[str, ...], max_bytes: int, run_hash: str | None, validator_keys: tuple[str, ...]) -> None:
    """Validate signed object files (signature, structure, payloads) and print one line per file.

    Exit status 0 when every file is valid, 2 otherwise. A directory stands for all files below it.
    """
    from client.inspect import inspect_paths

    if run_hash is not None and not re.fullmatch(r"[0-9a-f]{64}", run_hash):
        raise click.BadParameter("must be 64 lowercase hex characters", param_hint="--run-hash")
    try:
        allowed = [public_key_from_hex(k) for k in validator_keys] or None
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--validator-key") from None
    all_ok = True
    for result in inspect_paths(paths, max_bytes=max_bytes, run_hash=run_hash, allowed_signers=allowed):
        click.echo(result.line)
        all_ok &= result.ok
    sys.exit(0 if all_ok else EXIT_INVALID)


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


main.add_command(run_id_cmd)
main.add_command(inspect_cmd)
main.add_command(demo_cmd)  # the local swarm launcher (client/demo/cli.py)
for _cmd in MODEL_COMMANDS:  # checkpoints, export, eval, sample (client/model_tools.py)
    main.add_command(_cmd)
