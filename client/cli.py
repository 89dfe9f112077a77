"""``sparseloco-peer join``: take part in a run from this machine; ``preflight``: whether it can;
``sparseloco-peer id``: who it is.

    sparseloco-peer preflight --run run.toml [--json]                # ready to join? (exit 0 / 1)
    sparseloco-peer join --run run.toml                              # store (or grant server) from run.toml's [local]
    sparseloco-peer join --run run.toml --store s3://bucket/run      # credentials: AWS_* env vars
    sparseloco-peer join --run run.toml --store dht:// --dht-peer /ip4/1.2.3.4/tcp/31337/p2p/Qm…
    sparseloco-peer id --state ~/.sparseloco/<run id>                # the peer id (the key is created)
    sparseloco-peer join --run run.toml --metrics-port 9100 --log-format json   # for monitoring

Parse, build, run, close: the work lives in :mod:`client.peer`; this module resolves the local
settings (:mod:`protocol.settings`: flags > SPARSELOCO_* > --settings FILE > run.toml [local]) and
picks how the peer trains (a full replica, or one stage of a pipeline replica).

One peer on every GPU of a host: ``torchrun --standalone --nproc-per-node N $(which
sparseloco-peer) join …`` (:mod:`client.ddp`): rank 0 is the peer, the other ranks train with it.

Exit status: 0 done; 1 cannot join (no genesis of this run hash within ``peer.join_timeout_s``, the
store unreachable, the announcement refused, this machine's clock off the store's by more than the
run allows: :mod:`client.clock`); 2 configuration or identity error; 3 the store
refused ``peer.max_upload_failures`` contributions in a row; 4 a rank of a multi-GPU peer died or
stalled (``compute.rank_timeout_s``); 130 stopped by Ctrl-C or SIGTERM after
the local state is consistent (every save is atomic, so there is nothing to flush). Every stop after
the announcement withdraws it, so the validator does not wait for this peer.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from client.store_access import KEY_FILE, default_state_dir
from protocol.config import RunSpec
from protocol.errors import ConfigError, ProtocolError, StoreError
from protocol.identity import Identity
from protocol.layout import run_id
from protocol.logformat import FORMATS, setup_logging
from protocol.settings import LocalSettings, settings_help
from protocol.settings_cli import COMPUTE_FLAGS, STORE_FLAGS, Overrides, setting_options

if TYPE_CHECKING:  # the torch-heavy modules load after argument parsing
    from client.ddp.ranks import RankGroup
    from client.window import WindowTrainer
    from protocol.data.tokens import TokenDataset
    from protocol.events import Event
    from protocol.store.base import ObjectStore

EXIT_CANNOT_JOIN = 1
EXIT_CONFIG = 2
EXIT_UPLOADS_REFUSED = 3
EXIT_RANK_LOST = 4  # client.ddp.launch.EXIT_RANK_LOST
EXIT_INTERRUPTED = 130
# What join says outside the event stream (a configuration error, where the metrics are): through
# logging, so that it carries a timestamp, or is a JSON line with --log-format json.
_log = logging.getLogger("sparseloco.peer")


_key_option = click.option(
    "--key", "key_path", default=None, type=click.Path(dir_okay=False), help="Ed25519 key (created if missing)."
)
_state_option = click.option(
    "--state",
    "state_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Local state directory (its key.pem) [default: ~/.sparseloco/<run id>].",
)


@click.group()
@click.version_option(package_name="sparseloco")
def main() -> None:
    """sparseloco-peer: contribute compute to a SparseLoCo pre-training run."""


@main.command("join", epilog=settings_help())
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False), help="RunSpec TOML.")
@setting_options(*STORE_FLAGS, *COMPUTE_FLAGS, "peer.join_timeout_s")
@_key_option
@_state_option
@click.option("--windows", "max_windows", default=None, type=int, help="Train this many windows, then exit.")
@click.option("--until-window", default=None, type=int, help="Exit once θ opens this window.")
@click.option("--status-json", is_flag=True, help="One JSON object per line on stdout instead of the live panel.")
@click.option(
    "--log-format",
    type=click.Choice(FORMATS),
    default="human",
    show_default=True,
    help="human: timestamped lines and the live panel on stderr; json: one JSON object per line on stderr "
    "(time, level, logger, event, message, the event's fields).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (window, phase, loss, tokens/s, bytes, score …).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics endpoint binds (0.0.0.0: every network this machine is on).",
)
@click.option(
    "--pipeline",
    "pipeline_group",
    default=None,
    metavar="GROUP",
    help="Join as one stage of pipeline replica GROUP (needs --stage, --stages, --rendezvous).",
)
@click.option("--stage", default=None, type=int, help="This peer's stage in its pipeline replica (0-based).")
@click.option("--stages", default=None, type=int, help="Number of stages of the pipeline replica.")
@click.option("--rendezvous", default=None, metavar="HOST:PORT", help="Where the stages meet (stage 0 listens).")
def join(
    run_path: str,
    overrides: Overrides,
    key_path: str | None,
    state_dir: str | None,
    max_windows: int | None,
    until_window: int | None,
    status_json: bool,
    log_format: str,
    metrics_port: int | None,
    metrics_host: str,
    pipeline_group: str | None,
    stage: int | None,
    stages: int | None,
    rendezvous: str | None,
) -> None:
    """Join the run: announce, catch up, then train and upload every window.

    The peer first reports its peer id, the run id and the full run hash (compare it with the
    operator's `sparseloco run-id run.toml`). Exit status: 0 done, 1 cannot join (no genesis of
    this run hash within peer.join_timeout_s, store unreachable), 2 configuration error, 3 the
    store refused peer.max_upload_failures contributions in a row, 4 a rank of a multi-GPU peer
    died or stalled, 130 stopped (Ctrl-C, SIGTERM). Any stop after the announcement withdraws it.

    \b
    Every GPU of this host as one peer (rank 0 is the peer, the others train with it):
      torchrun --standalone --nproc-per-node 8 $(which sparseloco-peer) -- join --run run.toml
    """
    _sigterm_is_interrupt()
    setup_logging(log_format, verbose=False, stream=sys.stderr)
    out = Output(log_format, metrics_port, metrics_host)
    try:
        pipeline = _pipeline_options(pipeline_group, stage, stages, rendezvous)
        local = overrides.load(run_path)
        code = _join(run_path, local, key_path, state_dir, max_windows, until_window, status_json, pipeline, out)
    except ConfigError as exc:
        _log.error(f"sparseloco-peer: {exc}")
        code = EXIT_CONFIG
    sys.exit(code)


def _join(
    run_path: str,
    local: LocalSettings,
    key_path: str | None,
    state_dir: str | None,
    max_windows: int | None,
    until_window: int | None,
    status_json: bool,
    pipeline: dict[str, Any] | None = None,
    out: Output | None = None,
) -> int:
    # Heavy imports after argument parsing: `--help` stays instant.
    from client.clock import check_clock
    from client.ddp.launch import lead, open_ranks, serve
    from client.ddp.ranks import RankLost
    from client.peer import Peer, RunNotFound, UploadsRefused
    from client.progress import PeerDisplay
    from client.state import LocalState
    from protocol.events import Failed
    from protocol.store import open_peer_store

    spec = _load_spec(run_path)
    device = _device(local)
    if pipeline is not None:
        _single_process()
    clock = check_clock(spec, local.store)
    if clock.status == "failed":
        _log.error(f"sparseloco-peer: cannot join: {clock.detail}")
        return EXIT_CANNOT_JOIN
    if clock.status == "warning":
        _log.warning(f"sparseloco-peer: {clock.detail}")
    ranks = open_ranks(local) if pipeline is None else None
    if ranks is not None and ranks.rank != 0:
        return serve(spec, local, ranks)  # trains on rank 0's commands; rank 0 is the peer
    identity = Identity.load_or_create(_key_path(key_path, state_dir, spec))
    state = LocalState(_state_dir(state_dir, spec))
    until = until_window
    if local.max_windows > 0:
        until = min(until, local.max_windows) if until is not None else local.max_windows
    store = open_peer_store(local.store, identity, spec.hash(), validator_keys=spec.validator.public_keys)
    trainer = _window_trainer(spec, local, store, identity.peer_id, device, pipeline, ranks)
    out = out or Output()
    sinks: list[Callable[[Event], None]] = []
    server = None
    if out.metrics_port is not None:
        from protocol.metrics import Metrics

        metrics = Metrics(role="peer")
        sinks.append(metrics)
        server = metrics.serve(out.metrics_port, out.metrics_host)
        _log.info(f"metrics at http://{out.metrics_host}:{server.port}/metrics")
    display = PeerDisplay(json_lines=status_json, log_format=out.log_format, sinks=sinks)
    peer = Peer(spec, store, identity, state, trainer, local=local, display=display, clock_offset=clock.offset)
    try:
        with lead(ranks):
            try:
                with display:
                    peer.run(until_window=until, max_windows=max_windows)
            except KeyboardInterrupt:
                if ranks is None or ranks.lost is None:
                    raise
                raise ranks.lost from None  # the heartbeat found a rank gone between windows
        return 0
    except RankLost as exc:
        display.emit(Failed(reason=exc.reason, detail=str(exc)))
        _log.error(f"sparseloco-peer: stopped: {exc}")
        return EXIT_RANK_LOST
    except KeyboardInterrupt:
        display.emit(peer.stopped("interrupted"))
        return EXIT_INTERRUPTED
    except UploadsRefused as exc:
        display.emit(Failed(reason=exc.reason, detail=str(exc)))
        _log.error(f"sparseloco-peer: stopped: {exc}")
        return EXIT_UPLOADS_REFUSED
    except (RunNotFound, ProtocolError, StoreError) as exc:
        # Only reached when joining itself fails (no genesis, no usable checkpoint, store unreachable).
        display.emit(Failed(reason=exc.reason, detail=str(exc)))
        # RunNotFound names the run and store already; a grant server's wrong_run both run hashes.
        hint = "" if isinstance(exc, RunNotFound) or exc.reason == "wrong_run" else _run_hint(spec, local)
        _log.error(f"sparseloco-peer: cannot join: {exc}{hint}")
        return EXIT_CANNOT_JOIN
    finally:
        store.close()
        if server is not None:
            server.close()


@dataclass(frozen=True)
class Output:
    """How ``join`` reports: ``--log-format`` and the optional metrics endpoint."""

    log_format: str = "human"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


def _load_spec(run_path: str) -> RunSpec:
    spec = RunSpec.load(run_path)
    if not spec.validator.public_keys:
        raise ConfigError("the RunSpec lists no validator.public_keys: there is nobody whose aggregates to trust")
    if not spec.data.dataset:
        raise ConfigError(
            f"{run_path} names no dataset (data.dataset): a run's data lies in its store, and its operator "
            "creates the run.toml with `sparseloco-validator init`"
        )
    return spec


def _device(local: LocalSettings) -> str:
    """The torch device of ``compute.device`` (CUDA when torch sees it, else the CPU), checked
    (``cuda:N`` within the devices torch sees); threads set."""
    import torch

    from protocol.devices import resolve_device

    if local.compute.threads > 0:
        torch.set_num_threads(local.compute.threads)
    return resolve_device(local.compute.device)


def _single_process() -> None:
    """A pipeline stage is one process: torchrun with several would start the same stage twice."""
    from client.ddp.ranks import torchrun_world

    if torchrun_world() is not None:
        raise ConfigError("--pipeline runs one process per stage: start it without torchrun (or with one process)")


@main.command("preflight", epilog=settings_help())
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False), help="RunSpec TOML.")
@setting_options(*STORE_FLAGS, *COMPUTE_FLAGS)
@_key_option
@_state_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the verdict, every check) on stdout.")
def preflight(run_path: str, overrides: Overrides, key_path: str | None, state_dir: str | None, as_json: bool) -> None:
    """Check whether this machine can join the run, without joining it.

    \b
    Checks: memory (suggests compute.micro_batch_size), compute (inner steps
    timed on this device, the contribution's size), clock (this machine's
    clock against the store's Date header), run (its genesis for
    this run hash), reads (the chain), grant (the grant server would grant
    this peer's upload), write (a probe object: up/down bandwidth), link
    (the contribution's upload at that bandwidth against
    windows.upload_deadline_s), window (one window's time against it).

    Exit status: 0 ready, 1 not ready (the failed checks say why), 2 configuration error.
    """
    try:
        local = overrides.load(run_path)
        code = _preflight(run_path, local, key_path, state_dir, as_json)
    except ConfigError as exc:
        click.echo(f"sparseloco-peer: {exc}", err=True)
        code = EXIT_CONFIG
    sys.exit(code)


def _preflight(run_path: str, local: LocalSettings, key_path: str | None, state_dir: str | None, as_json: bool) -> int:
    from client.preflight import Preflight
    from protocol.store import open_peer_store

    spec = _load_spec(run_path)
    device = _device(local)
    identity = Identity.load_or_create(_key_path(key_path, state_dir, spec))
    with open_peer_store(local.store, identity, spec.hash()) as store:
        checks = Preflight(spec, local, identity, store, device=device)
        if not as_json:
            click.echo(f"peer {identity.peer_id}  run {run_id(spec.hash())} (hash {spec.hash()})")
            click.echo(f"store {local.store.location()}  device {device}")
        for check in checks.run():
            if not as_json:
                click.echo(f"{check.status:<8} {check.name:<8} {check.detail}")
        report = checks.report()
    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
    elif report.ok:
        suggested = report.suggested.get("compute.micro_batch_size")
        click.echo(
            "ready to join: sparseloco-peer join --run "
            + run_path
            + (f"  (micro batch {suggested})" if suggested else "")
        )
    else:
        click.echo("not ready: " + "; ".join(f"{c.name}: {c.reason}" for c in report.failed))
    return 0 if report.ok else EXIT_CANNOT_JOIN


def _run_hint(spec: RunSpec, local: LocalSettings) -> str:
    """Which run and store a failed join was about, to compare with the operator's."""
    return (
        f" (run {run_id(spec.hash())}, run hash {spec.hash()}, store {local.store.location()}; "
        "`sparseloco run-id run.toml` on both sides shows whether this is the operator's run)"
    )


def _state_dir(state_dir: str | None, spec: RunSpec) -> Path:
    """``--state``, or ``~/.sparseloco/<run id>``."""
    return Path(state_dir) if state_dir else default_state_dir(spec)


def _key_path(key_path: str | None, state_dir: str | None, spec: RunSpec | None) -> Path:
    """``--key``, or ``key.pem`` in the state directory."""
    if key_path:
        return Path(key_path).expanduser()
    if state_dir is not None:
        return Path(state_dir) / KEY_FILE
    if spec is not None:
        return _state_dir(None, spec) / KEY_FILE
    raise ConfigError("give --key PATH, --state DIR or --run run.toml (its default state directory)")


def _window_trainer(
    spec: RunSpec,
    local: LocalSettings,
    store: ObjectStore,
    peer_id: str,
    device: str,
    pipeline: dict[str, Any] | None,
    ranks: RankGroup | None = None,
) -> WindowTrainer:
    """How this peer trains a window: the whole model (on this device, or data parallel on the
    ranks of a torchrun launch), or its stage of a pipeline replica; each reads the run's dataset
    from ``store`` into this machine's data cache."""
    from protocol.data.run_data import open_run_dataset

    def dataset() -> TokenDataset:
        # A link that drops for less than a window costs the window nothing: reads wait for it.
        return open_run_dataset(spec, store, local.data, patience_s=spec.windows.upload_deadline_s)

    if ranks is not None:
        from client.ddp.replica import DataParallelReplica

        return DataParallelReplica(
            spec, ranks, data_key=peer_id, data=dataset, micro_batch_size=local.compute.micro_batch_size
        )
    if pipeline is None:
        from client.replica import FullReplica

        return FullReplica(
            spec, data_key=peer_id, device=device, data=dataset, micro_batch_size=local.compute.micro_batch_size
        )
    from client.pipeline.trainer import StageTrainer

    return StageTrainer(spec, device=device, data=dataset, **pipeline)


@main.command("id")
@click.option("--key", "key_path", default=None, type=click.Path(dir_okay=False), help="Ed25519 key file.")
@click.option(
    "--state", "state_dir", default=None, type=click.Path(file_okay=False), help="State directory (its key.pem)."
)
@click.option(
    "--run",
    "run_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="RunSpec TOML: its default state directory ~/.sparseloco/<run id>.",
)
def id_cmd(key_path: str | None, state_dir: str | None, run_path: str | None) -> None:
    """Print this peer's id (the key is created if it does not exist yet): what an operator needs
    to scope a credential to <run>/contrib/*/<peer id> and <run>/peers/<peer id>."""
    try:
        spec = RunSpec.load(run_path) if run_path else None
        ident = Identity.load_or_create(_key_path(key_path, state_dir, spec))
    except ConfigError as exc:
        click.echo(f"sparseloco-peer: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    click.echo(ident.peer_id)


def _pipeline_options(
    group: str | None, stage: int | None, stages: int | None, rendezvous: str | None
) -> dict[str, Any] | None:
    """The pipeline-stage options, all or none of them (see client/pipeline/trainer.py)."""
    if group is None:
        if stage is not None or stages is not None or rendezvous is not None:
            raise ConfigError("--stage/--stages/--rendezvous need --pipeline GROUP")
        return None
    if stage is None or stages is None or rendezvous is None:
        raise ConfigError("--pipeline needs --stage, --stages and --rendezvous")
    if not (stages >= 2 and 0 <= stage < stages):
        raise ConfigError(f"--stage must be in 0..{stages - 1} and --stages >= 2")
    return {"group": group, "stage": stage, "stages": stages, "rendezvous": rendezvous}


def _sigterm_is_interrupt() -> None:
    """SIGTERM/SIGHUP unwind like Ctrl-C (the swarm launcher stops peers with SIGTERM), and so does
    SIGINT even when the launching shell ignored it (a background job inherits it ignored)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


if __name__ == "__main__":
    main()
