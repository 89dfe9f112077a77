"""``sparseloco-peer join``: take part in a run from this machine.

    sparseloco-peer join --run run.toml                              # store from the RunSpec
    sparseloco-peer join --run run.toml --store s3://bucket/run      # credentials: AWS_* env vars
    sparseloco-peer join --run run.toml --store dht:// --dht-peer /ip4/1.2.3.4/tcp/31337/p2p/Qm…

Parse, build, run, close: the work lives in :mod:`client.peer`; this module picks how the peer
trains (a full replica, or one stage of a pipeline replica). Configuration and identity errors
exit with status 2 and a one-line reason; Ctrl-C (or SIGTERM) stops cleanly with status 130 after
the local state is consistent (every save is atomic, so there is nothing to flush).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from protocol.config import RunSpec
from protocol.errors import ConfigError, ProtocolError, StoreError
from protocol.layout import run_id

if TYPE_CHECKING:  # the torch-heavy modules load after argument parsing
    from client.window import WindowTrainer

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


@click.group()
@click.version_option(package_name="sparseloco")
def main() -> None:
    """sparseloco-peer: contribute compute to a SparseLoCo pre-training run."""


@main.command("join")
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False), help="RunSpec TOML.")
@click.option("--store", "store_url", default=None, help="Store URL (default: the RunSpec's storage.url).")
@click.option("--dht-peer", "dht_peers", multiple=True, help="DHT bootstrap multiaddr (repeatable; dht:// only).")
@click.option(
    "--key", "key_path", default=None, type=click.Path(dir_okay=False), help="Ed25519 key (created if missing)."
)
@click.option(
    "--state",
    "state_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Local state directory [default: ~/.sparseloco/<run id>].",
)
@click.option("--device", default=None, type=click.Choice(["cuda", "cpu"]), help="[default: cuda if available]")
@click.option("--windows", "max_windows", default=None, type=int, help="Train this many windows, then exit.")
@click.option("--until-window", default=None, type=int, help="Exit once θ opens this window.")
@click.option("--threads", default=0, type=int, help="torch CPU threads (0: torch's default).")
@click.option("--status-json", is_flag=True, help="One JSON object per line on stdout instead of the live panel.")
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
    store_url: str | None,
    dht_peers: tuple[str, ...],
    key_path: str | None,
    state_dir: str | None,
    device: str | None,
    max_windows: int | None,
    until_window: int | None,
    threads: int,
    status_json: bool,
    pipeline_group: str | None,
    stage: int | None,
    stages: int | None,
    rendezvous: str | None,
) -> None:
    """Join the run: announce, catch up, then train and upload every window."""
    _sigterm_is_interrupt()
    try:
        pipeline = _pipeline_options(pipeline_group, stage, stages, rendezvous)
        code = _join(
            run_path,
            store_url,
            dht_peers,
            key_path,
            state_dir,
            device,
            max_windows,
            until_window,
            threads,
            status_json,
            pipeline,
        )
    except ConfigError as exc:
        click.echo(f"sparseloco-peer: {exc}", err=True)
        code = EXIT_CONFIG
    sys.exit(code)


def _join(
    run_path: str,
    store_url: str | None,
    dht_peers: tuple[str, ...],
    key_path: str | None,
    state_dir: str | None,
    device: str | None,
    max_windows: int | None,
    until_window: int | None,
    threads: int,
    status_json: bool,
    pipeline: dict[str, Any] | None = None,
) -> int:
    # Heavy imports after argument parsing: `--help` stays instant.
    import torch

    from client.peer import Peer
    from client.progress import PeerDisplay
    from client.state import LocalState
    from protocol.events import Failed, Stopped
    from protocol.identity import Identity
    from protocol.store import open_from_settings

    spec = RunSpec.load(run_path)
    if not spec.validator.public_keys:
        raise ConfigError("the RunSpec lists no validator.public_keys: there is nobody whose aggregates to trust")
    if threads > 0:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA device")
    state = LocalState(Path(state_dir) if state_dir else Path("~/.sparseloco").expanduser() / run_id(spec.hash()))
    identity = Identity.load_or_create(key_path or state.key_path)
    until = until_window
    if spec.windows.max_windows > 0:
        until = min(until, spec.windows.max_windows) if until is not None else spec.windows.max_windows
    trainer = _window_trainer(spec, identity.peer_id, device, pipeline)
    store = open_from_settings(
        spec.storage, store_url, dht_peers, identity=identity, validator_keys=spec.validator.public_keys
    )
    display = PeerDisplay(json_lines=status_json)
    try:
        with display:
            Peer(spec, store, identity, state, trainer, display=display).run(
                until_window=until, max_windows=max_windows
            )
        return 0
    except KeyboardInterrupt:
        display.emit(Stopped(reason="interrupted"))
        return EXIT_INTERRUPTED
    except (ProtocolError, StoreError) as exc:
        # Only reached when joining itself fails (no usable checkpoint, store unreachable).
        display.emit(Failed(reason=exc.reason, detail=str(exc)))
        click.echo(f"sparseloco-peer: cannot join: {exc}", err=True)
        return 1
    finally:
        store.close()


def _window_trainer(spec: RunSpec, peer_id: str, device: str, pipeline: dict[str, Any] | None) -> WindowTrainer:
    """How this peer trains a window: the whole model, or its stage of a pipeline replica."""
    if pipeline is None:
        from client.replica import FullReplica

        return FullReplica(spec, data_key=peer_id, device=device)
    from client.pipeline.trainer import StageTrainer

    return StageTrainer(spec, device=device, **pipeline)


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
    """SIGTERM/SIGHUP unwind like Ctrl-C (the swarm launcher stops peers with SIGTERM)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


if __name__ == "__main__":
    main()
