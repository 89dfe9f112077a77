"""One validator process: open the validator (its store, grant server and metrics endpoint), serve
windows until done or stopped, close; the exit status (``sparseloco-validator run``,
:mod:`validator.cli`, parses the options and hands them here).

    code = validate("run.toml", local, Node(key_path, state_dir, windows=None, wait_for_peers=0),
                    Reporting(event_lines(status_json=False, log_format="human"), None, "0.0.0.0"))

Events go to ``Reporting.emit`` (:mod:`protocol.events`: human lines, JSON events or JSON log
lines) and to the grant desk's window clock and the metrics. Ctrl-C or SIGTERM finish or abandon
the current window (a restart resumes it); a second Ctrl-C stops at once. torch and the node load
when a validator is opened, not at import.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console

from protocol.config import RunSpec
from protocol.errors import ConfigError, StoreError
from protocol.events import (
    Event,
    EventWriter,
    Failed,
    Granted,
    GrantsServed,
    Stopped,
    ValidatorStarted,
    WindowHeld,
    WindowPublished,
    describe,
)
from protocol.identity import Identity
from protocol.logformat import JsonLogLines
from protocol.settings import LocalSettings
from protocol.store import open_from_settings
from protocol.store.dht.listing import ListBounds
from protocol.store.presign import Presigner

if TYPE_CHECKING:
    from validator.grant_server import GrantServer
    from validator.grants import OpenWindows
    from validator.node import Validator

__all__ = [
    "EXIT_CONFIG",
    "EXIT_INTERRUPTED",
    "EXIT_STORE",
    "ROLE",
    "Node",
    "Reporting",
    "ValidatorRoster",
    "event_lines",
    "validate",
]

ROLE = "validator"
EXIT_STORE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130

Emit = Callable[[Event], None]


@dataclasses.dataclass(frozen=True)
class Node:
    """The validator of ``run``: its key, state directory, how many windows, and whom it waits for."""

    key_path: str
    state_dir: str
    windows: int | None
    wait_for_peers: int
    fault: str = ""  # several validators: misbehave on purpose (validator.agreement)


@dataclasses.dataclass(frozen=True)
class Reporting:
    """Where the events go: ``emit`` (the lines on stdout) and the optional metrics endpoint."""

    emit: Emit
    metrics_port: int | None
    metrics_host: str


def event_lines(status_json: bool, log_format: str) -> Emit:
    """``--status-json``: JSON events; ``--log-format json``: JSON log lines; else human lines."""
    if status_json:
        return EventWriter(sys.stdout)
    if log_format == "json":
        return JsonLogLines(sys.stdout, role=ROLE)
    return HumanLines(Console(highlight=False, soft_wrap=True))


def validate(run_path: str, local: LocalSettings, node: Node, out: Reporting) -> int:
    """Open the validator (and its grant server, metrics endpoint), serve, close; the exit status."""
    # torch and the grant desk load here, not at import: `logs` (what sparseloco demo runs) stays quick.
    from validator.grants import OpenWindows
    from validator.state import STATE_FILE

    windows_open = OpenWindows()  # the grant desk's view of the window clock, from our own events
    waiting = PeerWait()  # and of the wait for peers before genesis
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
            validator = open_validator(run_path, local, node.key_path, node.state_dir, emit_all, fault=node.fault)
            stack.callback(validator.close)
            if local.validator.grant_port:
                stack.enter_context(grant_server(validator, local, windows_open, emit_all, waiting))
        except ConfigError as exc:
            out.emit(Failed(role=ROLE, reason="config_error", detail=str(exc)))
            return EXIT_CONFIG
        except StoreError as exc:  # the run's dataset manifest could not be read
            out.emit(Failed(role=ROLE, reason=exc.reason, detail=str(exc)))
            return EXIT_STORE
        sinks.append(partial(hold_sink, validator, waiting))
        install_stop(validator)
        if node.wait_for_peers and not (Path(node.state_dir) / STATE_FILE).exists():
            wait_for_peers(validator, node.wait_for_peers, waiting)
        return serve(validator, node.windows, emit_all)


def hold_sink(validator: Validator, waiting: PeerWait, event: Event) -> None:
    """A grant to a peer is a sign of life (it ends a restart's hold, :mod:`validator.hold`); while
    a window is held, ``/v1/info`` says the validator waits for a peer."""
    if isinstance(event, Granted):
        validator.heard_from(event.peer_id)
    elif isinstance(event, WindowHeld):
        waiting.set((1, 0))
    elif isinstance(event, WindowPublished) and waiting() is not None:
        waiting.set(None)


def open_validator(
    run_path: str, local: LocalSettings, key_path: str, state_dir: str, emit: Emit, *, fault: str = ""
) -> Validator:
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
    store = open_from_settings(
        local.store,
        identity=ident,
        validator_keys=spec.validator.public_keys,
        list_bounds=ListBounds.for_run(spec.validator.max_contributors),
    )
    validator = Validator(spec, store, ident, state_dir, device=device, local=local, emit=emit, fault=fault)
    started = ValidatorStarted(
        peer_id=ident.peer_id,
        run_id=validator.run_id,
        run_hash=validator.run_hash,
        store=local.store.location(),
        device=device,
    )
    emit(started)
    return validator


def grant_server(
    validator: Validator,
    local: LocalSettings,
    windows_open: OpenWindows,
    emit: Emit,
    waiting: PeerWait | None = None,
) -> GrantServer:
    """The started grant server of ``validator`` (its store signs the grants); GrantsServed says where."""
    from validator.grant_server import GrantServer
    from validator.grants import GrantDesk, GrantPolicy

    if not isinstance(validator.store, Presigner):
        raise ConfigError(
            f"--grant-port hands out presigned S3 requests: it needs an s3:// store, not {local.store.url}"
        )
    settings = local.validator
    policy = GrantPolicy(prefix_v4=settings.grant_prefix_v4, prefix_v6=settings.grant_prefix_v6)
    desk = GrantDesk(
        validator.spec,
        validator.store,
        windows_open.current,
        policy=policy,
        emit=emit,
        roster=ValidatorRoster(validator),
        waiting=waiting,
    )
    server = GrantServer(
        desk, settings.grant_host, settings.grant_port, tls_cert=settings.tls_cert, tls_key=settings.tls_key
    ).start()
    emit(GrantsServed(url=server.url, warnings=listening_warnings(settings.grant_host, tls=bool(settings.tls_cert))))
    return server


def listening_warnings(host: str, *, tls: bool) -> list[str]:
    """What an operator should hear about a grant server on ``host``: reachable beyond this
    machine (fine for a public run, a surprise for a local one), and grants over plain HTTP (the
    presigned URLs, which anyone holding one may use until it expires, cross the network in the
    clear)."""
    warnings = []
    if not _loopback(host):
        warnings.append(
            f"it listens on {host}: every network this machine is on can ask it for grants "
            "(--grant-host 127.0.0.1 keeps a local run local)"
        )
        if not tls:
            warnings.append(
                "grants go over plain HTTP: anyone on the path can read and use the presigned URLs "
                "until they expire (--tls-cert/--tls-key, or TLS in front of it)"
            )
    return warnings


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class ValidatorRoster:
    """The grant desk's :class:`~validator.grants.Roster`: the peers whose announcement ``validator``
    has read (and not withdrawn), and their standing before the open window (read from the grant
    server's threads; the validator replaces these objects, never mutates them half-way)."""

    def __init__(self, validator: Validator) -> None:
        self.validator = validator

    def announced(self, peer_id: str) -> bool:
        registry = self.validator.registry
        return peer_id in registry.announcements and peer_id not in registry.withdrawn

    def excluded(self, peer_id: str, window: int) -> bool:
        from validator.reputation import is_excluded

        state = self.validator.state
        standing = (state.standings or {}).get(peer_id) if state is not None and state.window == window else None
        return standing is not None and is_excluded(standing, window)


class PeerWait:
    """Before genesis with ``--wait-for-peers``: how many peers the validator waits for and how
    many have announced (what the grant server's ``/v1/info`` tells a peer's preflight)."""

    def __init__(self) -> None:
        self._state: tuple[int, int] | None = None

    def __call__(self) -> tuple[int, int] | None:
        return self._state

    def set(self, state: tuple[int, int] | None) -> None:
        self._state = state


def wait_for_peers(validator: Validator, count: int, waiting: PeerWait | None = None) -> None:
    """Until ``count`` peers have announced (and not withdrawn), or the validator is stopped;
    ``waiting`` hears the count meanwhile."""
    waiting = waiting or PeerWait()
    try:
        while not validator.stop.is_set():
            registry = validator.registry
            announced = len(registry.refresh() - registry.withdrawn)
            if announced >= count:
                return
            waiting.set((count, announced))
            validator.stop.wait(validator.local.poll_interval_s)
    finally:
        waiting.set(None)


def serve(validator: Validator, windows: int | None, emit: Emit) -> int:
    """Run until done, stopped or failed; the exit status (the last event says why)."""
    try:
        validator.run(windows)
    except ConfigError as exc:
        emit(Failed(role=ROLE, reason="config_error", detail=str(exc)))
        return EXIT_CONFIG
    except StoreError as exc:  # a window failed validator.window_retries times (validator.retry): a restart redoes it
        emit(Failed(role=ROLE, reason=exc.reason, detail=str(exc)))
        return EXIT_STORE
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


class HumanLines:
    """Events as human lines on ``console``: local time, then :func:`protocol.events.describe`.

    Grants are many (every request of every peer) and routine: they are counted, not printed,
    and summed up in one line before the next window's publication (``grants since the last
    window: 96 to 3 peers (get 88, list 5, put 3)``); refusals are printed as they come. The JSON
    forms (``--log-format json``, ``--status-json``) keep every ``granted`` event."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._lock = threading.Lock()  # the grant server's threads emit too
        self._grants: Counter[str] = Counter()
        self._granted_peers: set[str] = set()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, Granted):
                self._grants[event.op] += 1
                self._granted_peers.add(event.peer_id)
                return
            if isinstance(event, WindowPublished) and self._grants:
                self._print(event.time, self._grant_summary())
            self._print(event.time, describe(event))

    def _grant_summary(self) -> str:
        ops = ", ".join(f"{op} {n:,}" for op, n in sorted(self._grants.items()))
        line = (
            f"grants since the last window: {sum(self._grants.values()):,} to "
            f"{len(self._granted_peers)} peer(s) ({ops})"
        )
        self._grants.clear()
        self._granted_peers.clear()
        return line

    def _print(self, at: float, line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        self.console.print(f"{stamp} {line}")
        sys.stdout.flush()  # a pipe (a log collector) sees each line when it happens


def install_stop(validator: Validator) -> None:
    """First Ctrl-C / SIGTERM: stop after (or abandon) the current window; second Ctrl-C: now."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if validator.stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        validator.stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


# ------------------------------------------------------------------------------ logs
