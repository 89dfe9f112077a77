"""A whole SparseLoCo run on this machine: a validator and N peers as separate OS processes.

``sparseloco demo`` (the command) builds a :class:`LocalSwarm`, starts everything, follows the
processes' events until the last window is published, and prints a summary::

    with LocalSwarm(run_dir, peers=3, windows=8, store="file") as swarm:
        swarm.start_validator()
        for i in range(3):
            swarm.start_peer(i)
        swarm.follow(until=swarm.finished, timeout_s=600)
        summary = swarm.summary()          # val loss per window, fingerprints_equal, bytes …

The run is created as an operator creates one: ``sparseloco-validator init`` tokenizes the corpus
(``builtin:stdlib`` by default) once, puts the shards and the signed dataset manifest into the
run's store, publishes genesis and writes the run directory's ``run.toml``: the RunSpec (the preset
with the dataset's digest and the validator key) and a ``[local]`` table with the store (URL,
endpoint, DHT bootstrap nodes), ``max_windows`` and the preset's own local settings. Peers start
with no data: each fetches the shards its batches need into its own cache directory, as separate
machines would. Each process gets its per-process settings as flags and ``SPARSELOCO_*`` variables
(device, threads, the join timeout, the data cache). The integration tests drive the same class
to inject faults (kill a peer mid-window, restart the validator, start a late joiner, stop a peer
cleanly). Peers run ``sparseloco-peer join --status-json`` and the validator ``sparseloco-validator
run --status-json``: both write :mod:`protocol.events` records as JSON lines, read here with
:func:`protocol.events.parse_line`. The contribution log is read through its owner,
``sparseloco-validator logs --json`` (:mod:`client.demo.validator_log`), the events followed in a
:class:`~client.demo.followed.Followed`. Nothing here imports the peer or ``validator/``; a process
that crashes or a run that overruns its timeout is a :class:`~client.demo.errors.DemoError`.

**Several validators** (``validators=4, quorum=3``): four keys are made, sorted as the rotation
sorts them (:class:`protocol.quorum.Quorum`), and the RunSpec names them all with the quorum and a
handover timeout suited to a local run (:data:`HANDOVER_S`); process ``validator-<i>`` holds key
``i``, so ``validator-<(t + v) mod n>`` leads window t in view v. Only the leader of window 0,
view 0 (``validator-0``) may publish genesis: it starts first, the others once it opened window 0.
Its state directory holds the log the summary reads. Over S3 each validator serves grants on its
own port and the peers' ``grant_url`` lists them all, validator-0's first: a peer whose grant
server went down asks the next one (:mod:`client.demo.backends`). ``faults`` adds what ``sparseloco demo
--faults`` shows: ``liar`` (the leader of window 1 runs with ``--fault liar``) and ``kill-leader``
(:class:`KillLeader`: the leader of window 2 is SIGKILLed once it opened the window and restarted
with its state directory and key once the window is certified). The summary then adds who led and
signed each certified window, the handovers and the liar's certified proposals
(:meth:`LocalSwarm.agreement_summary`), from the validators' ``window_published`` and
``agreement`` events.

**In a WAN box** (``wan=Wan.for_swarm(profile, peers, validators)``, started, S3 only): the store
runs in the box's ``store`` namespace, validator ``i`` in ``validator-<i>`` (its grant server on
that address) and peer ``i`` in ``peer-<i>``, each process started through the box's launcher
(``ip netns exec``), so every byte a participant sends or receives crosses its shaped link;
``init`` and the summary's reads run in this process, over the box's bridge
(:mod:`client.demo.wan`, :meth:`LocalSwarm.wan_name`).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import protocol
from client.demo.backends import Backend, open_backend
from client.demo.errors import DemoError
from client.demo.followed import Followed, PeerView, ValidatorView
from client.demo.processes import ProcessGroup, python_console
from client.demo.validator_log import LoggedWindow, read_contributions, read_windows
from client.demo.wan import Wan
from protocol.config import RunSpec
from protocol.errors import ConfigError
from protocol.events import Event, PeerWindow, WindowPublished, parse_line
from protocol.identity import Identity
from protocol.outcomes import PeerOutcome
from protocol.quorum import Quorum
from protocol.settings import env_name, local_table, local_table_toml

PRESET = Path(protocol.__file__).parent / "presets" / "demo.toml"
VALIDATOR = "validator"
INIT = "init"
LOG_DB = "contributions.sqlite"
CORPUS = "builtin:stdlib"
INIT_TIMEOUT_S = 600.0
# Several validators: how long a view's leader has to propose (validator.handover_s). A leader
# decides the window when its view begins (the demo preset's scoring takes ~10 s on two busy
# cores); a shorter handover lets the leaders of consecutive views each propose and sign their
# own aggregate, which splits the honest signatures of the window.
HANDOVER_S = 30.0
FAULTS = ("liar", "kill-leader")
#: The small run of the integration tests and the WAN box (RunSpec overrides): ~0.1 M parameters,
#: H = 8 steps of 4 × 64 tokens, a 60 s upload deadline, a checkpoint every 2 windows.
SMALL_RUN: dict[str, dict[str, Any]] = {
    "model": {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
    "data": {"seq_len": 64, "batch_size": 4},
    "inner": {"steps": 8, "lr": 3e-3, "warmup_steps": 4, "total_steps": 200},
    "windows": {"upload_deadline_s": 60.0, "gather_grace_s": 1.0, "checkpoint_every": 2},
    "validator": {"eval_sequences": 8, "eval_peers_per_window": 8},
}
KILL_WINDOW = 2  # kill-leader: the window whose view-0 leader is killed


@dataclass(frozen=True)
class SwarmSetup:
    """How a local run is made and its processes started (:class:`LocalSwarm`'s arguments)."""

    peers: int
    windows: int
    store: str
    preset: Path
    overrides: dict[str, Mapping[str, Any]]
    local: dict[str, Any]
    corpus: str
    tokenizer: str
    shard_tokens: int | None
    peer_threads: int
    validator_threads: int
    validator_args: list[str]
    join_timeout_s: float
    validators: int = 1
    quorum: int = 0  # 0: a majority of the validators
    handover_s: float = HANDOVER_S
    faults: tuple[str, ...] = ()
    wan: Wan | None = None  # the box every process runs in (module doc), None: this machine's loopback


class LocalSwarm:
    """Run directory, store backend, and the validator and peer processes of a local run."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        peers: int = 3,
        windows: int = 8,
        store: str = "file",
        preset: str | Path = PRESET,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        local: Mapping[str, Any] | None = None,
        peer_threads: int = 1,
        join_timeout_s: float = 300.0,
        on_event: Callable[[str, Event], None] | None = None,
        corpus: str = CORPUS,
        tokenizer: str = "bytes",
        shard_tokens: int | None = None,
        validator_args: Sequence[str] = (),
        validators: int = 1,
        quorum: int = 0,
        handover_s: float = HANDOVER_S,
        faults: Sequence[str] = (),
        wan: Wan | None = None,
    ) -> None:
        """``overrides``: RunSpec sections over the preset's; ``local``: run.toml [local] settings
        over the preset's [local] table; ``join_timeout_s``: each peer's ``peer.join_timeout_s``;
        ``corpus``, ``tokenizer`` (``bytes`` or a tokenizer.json) and ``shard_tokens`` (None:
        init's default): how ``init`` makes the run's dataset; ``validator_args``: more options of
        ``sparseloco-validator run`` (``--metrics-port``); ``validators``, ``quorum`` (0: a
        majority), ``handover_s`` and ``faults``: several validators; ``wan``: a started box to run in
        (module doc)."""
        _check_validators(validators, quorum, tuple(faults))
        self._own_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="sparseloco-demo-"))
        self.setup = SwarmSetup(
            peers=peers,
            windows=windows,
            store=store,
            preset=Path(preset),
            overrides=dict(overrides or {}),
            local=dict(local or {}),
            corpus=corpus,
            tokenizer=tokenizer,
            shard_tokens=shard_tokens,
            peer_threads=peer_threads,
            validator_threads=max(1, (os.cpu_count() or 1) // max(1, peers + validators))
            if peer_threads == 1
            else peer_threads,
            validator_args=list(validator_args),
            join_timeout_s=join_timeout_s,
            validators=validators,
            quorum=quorum,
            handover_s=handover_s,
            faults=tuple(faults),
            wan=wan,
        )
        # One validator keeps the names it always had; several are validator-<rotation index>.
        self.validator_names = [VALIDATOR] if validators == 1 else [f"{VALIDATOR}-{i}" for i in range(validators)]
        self._accounted: set[tuple[str, float]] = set()
        self.peer_envs: dict[str, dict[str, str]] = {}
        self.may_exit: set[str] = set()  # processes whose non-zero exit is expected (stopped, tested)
        self.on_event = on_event  # (process name, event) for every event a validator or peer writes
        self.followed = Followed()
        self.started_at = time.time()
        self._stack = ExitStack()
        self.group: ProcessGroup | None = None
        self.backend: Backend | None = None
        self.spec: RunSpec | None = None
        self.store_requests_at_start: dict[str, int] | None = None  # S3: the store's count once init is done

    @property
    def peers(self) -> dict[str, PeerView]:
        """Every peer started so far, by process name (``peer-<i>``)."""
        return self.followed.peers

    @property
    def published(self) -> dict[int, WindowPublished]:
        """The validator's ``window_published`` events, by window."""
        return self.followed.published

    @property
    def validator_opened(self) -> list[int]:
        """The window each validator (re)start resumed at."""
        return self.followed.validator_opened

    @property
    def several(self) -> bool:
        """Whether the run has several validators (proposals, endorsements, certificates)."""
        return len(self.validator_names) > 1

    def validator_view(self, i: int) -> ValidatorView:
        """What validator ``i`` (rotation order) reported so far."""
        name = self.validator_names[i]
        return self.followed.validators.setdefault(name, ValidatorView(name))

    @property
    def quorum(self) -> Quorum:
        """The run's validators (rotation, quorum, handover timeout), from its RunSpec."""
        assert self.spec is not None
        return Quorum.of(self.spec)

    def leader_index(self, window: int, view: int = 0) -> int:
        """The rotation index (process ``validator-<i>``) of the leader of ``window`` in ``view``."""
        return (window + view) % len(self.validator_names)

    # ------------------------------------------------------------------ setup
    def __enter__(self) -> LocalSwarm:
        try:
            self.group = self._stack.enter_context(ProcessGroup(self.run_dir / "logs", grace_s=10.0))
            # First: every DHT node is told the run's validator keys. Sorted as the rotation sorts
            # them, so that the key of validator-<i> is the i-th of the run.
            vkeys = sorted((Identity.generate() for _ in self.validator_names), key=lambda k: k.public_key_hex)
            for i, vkey in enumerate(vkeys):
                vkey.save(self.validator_key_of(i))
            self.backend = self._stack.enter_context(
                open_backend(
                    self.setup.store, self.run_dir, self.group, [k.public_key_hex for k in vkeys], wan=self.setup.wan
                )
            )
            self.spec = self._write_run([k.public_key_hex for k in vkeys])
            self.store_requests_at_start = self.backend.request_counts()  # after init: the run's own
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _write_run(self, keys: list[str]) -> RunSpec:
        """run.toml, made by ``sparseloco-validator init`` (with the key at ``validator_key``)
        from the base ``base.toml``: the preset's RunSpec with ``overrides`` (and with several
        validators their ``keys``, the quorum and the handover timeout), and a [local] table with
        the store, max_windows, the preset's own [local] table and ``local``. init adds the dataset
        and the validator key."""
        assert self.backend is not None
        sections: dict[str, dict[str, Any]] = {k: dict(v) for k, v in self.setup.overrides.items()}
        if self.several:
            sections["validator"] = {
                **sections.get("validator", {}),
                "public_keys": keys,
                "quorum": self.setup.quorum,
                "handover_s": self.setup.handover_s,
            }
        base = RunSpec.load(self.setup.preset).replace(**sections)
        local: dict[str, Any] = {}
        for layer in (
            local_table(self.setup.preset),
            self.setup.local,
            {"max_windows": self.setup.windows, "store": {"url": self.backend.url, **self.backend.store_settings}},
        ):
            for key, value in layer.items():
                local[key] = {**local.get(key, {}), **value} if isinstance(value, Mapping) else value
        self.base_toml.write_text(base.to_toml() + local_table_toml(local))
        self._init()
        return RunSpec.load(self.run_toml)

    def _init(self) -> None:
        """Run ``sparseloco-validator init`` with the validator's credential; DemoError if it fails."""
        assert self.group is not None and self.backend is not None
        argv = python_console("sparseloco-validator") + [
            "init",
            "--corpus",
            self.setup.corpus,
            "--store",
            self.backend.url,
            "--key",
            str(self.validator_key),
            "--spec",
            str(self.base_toml),
            "--out",
            str(self.run_toml),
            "--tokenizer",
            self.setup.tokenizer,
            "--json",
            *(["--shard-tokens", str(self.setup.shard_tokens)] if self.setup.shard_tokens else []),
            *self.backend.args(),
        ]
        env = {**self.backend.validator_env(), env_name("data.cache_dir"): str(self.run_dir / INIT / "cache")}
        child = self.group.start(INIT, argv, env=env)
        try:
            rc = self.group.wait(INIT, timeout=INIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DemoError(
                f"sparseloco-validator init took over {INIT_TIMEOUT_S:.0f} s; log {child.log_path}"
            ) from None
        if rc != 0:
            tail = child.log_path.read_text(errors="replace")[-2000:]
            raise DemoError(f"sparseloco-validator init exited with status {rc}; log {child.log_path}:\n{tail}")

    @property
    def validator_key(self) -> Path:
        """The key of the validator that creates the run and publishes genesis (validator-0)."""
        return self.validator_key_of(0)

    def validator_key_of(self, i: int) -> Path:
        return self.run_dir / f"{self.validator_names[i]}.pem"

    def validator_dir(self, i: int) -> Path:
        """The state directory of validator ``i`` (θ, its log, signed.json)."""
        return self.run_dir / self.validator_names[i]

    @property
    def run_toml(self) -> Path:
        return self.run_dir / "run.toml"

    @property
    def base_toml(self) -> Path:
        """The RunSpec and [local] table ``init`` starts from."""
        return self.run_dir / "base.toml"

    @property
    def log_db(self) -> Path:
        """The contribution log the summary reads: validator-0's (the only one with one validator)."""
        return self.log_db_of(0)

    def log_db_of(self, i: int) -> Path:
        return self.validator_dir(i) / LOG_DB

    def peer_dir(self, i: int) -> Path:
        return self.run_dir / "peers" / f"peer-{i}"

    # ------------------------------------------------------------------ processes
    @property
    def store_url(self) -> str:
        """The store every process opens (run.toml's local.store.url)."""
        assert self.backend is not None
        return self.backend.url

    def start_validator(self, i: int = 0, *, wait_for_peers: int = 0) -> str:
        """Start (or restart, with its state directory and key) validator ``i``; its process name.
        ``wait_for_peers``: a new run opens window 0 only once that many peers have announced.
        With ``faults = ("liar", …)`` the leader of window 1 runs with ``--fault liar``."""
        assert self.group is not None and self.backend is not None
        name = self.validator_names[i]
        fault = ["--fault", "liar"] if i == self.liar_index else []
        argv = (
            self._launcher(name)
            + python_console("sparseloco-validator")
            + [
                "run",
                "--run",
                str(self.run_toml),
                "--key",
                str(self.validator_key_of(i)),
                "--state",
                str(self.validator_dir(i)),
                "--status-json",
                "--wait-for-peers",
                str(wait_for_peers),
                *fault,
                *self.backend.validator_args(i),
                *self.setup.validator_args,
            ]
        )
        # One thread, like each peer: OpenMP threads spinning on an oversubscribed machine made
        # the validator's evaluation ~8x slower than its single-threaded speed.
        env = {
            **self.backend.validator_env(),
            "OMP_NUM_THREADS": str(self.setup.validator_threads),
            env_name("data.cache_dir"): str(self.validator_dir(i) / "cache"),
        }
        self.may_exit.discard(name)
        self.group.start(name, argv, env=env)
        return name

    @property
    def liar_index(self) -> int | None:
        """The validator that runs with ``--fault liar`` (``faults`` names ``liar``): the leader of
        window 1 in view 0, so that it leads in the run's first windows."""
        return self.leader_index(1) if "liar" in self.setup.faults else None

    def start_validators(self, timeout_s: float = 300.0) -> None:
        """Start every validator: with several, validator-0 first (only the leader of window 0,
        view 0 publishes genesis) and the others once it opened window 0, so genesis is in the
        store when they start."""
        self.start_validator(0)
        self._start_after_genesis(timeout_s)

    def _start_after_genesis(self, timeout_s: float) -> None:
        """Several validators: once validator-0 opened window 0 (genesis is in the store), start
        the others."""
        if not self.several:
            return
        view = self.validator_view(0)
        self.follow(lambda: view.ready, timeout_s=timeout_s)
        for i in range(1, len(self.validator_names)):
            self.start_validator(i)

    def start_peers_then_validator(self, timeout_s: float = 300.0) -> None:
        """Start every peer and the validator so that window 0 opens once every peer has announced.

        A window closes early once every peer the validator expects has uploaded, and it expects
        the peers announced so far (it re-reads the announcements while gathering, so a later one
        is still accepted). Opened after every announcement, window 0 waits for all the peers
        instead of closing as soon as those announced so far have uploaded. Peers that announce
        through the validators' grants need a grant server first: then validator-0 (the genesis
        leader, first in their ``grant_url``) starts first and waits for them
        (``--wait-for-peers``) before it publishes genesis; the other validators start once it
        opened window 0.
        """
        assert self.backend is not None
        if self.backend.grants:
            self.start_validator(0, wait_for_peers=self.setup.peers)
        for i in range(self.setup.peers):
            self.start_peer(i)
        self.follow(lambda: all(v.announced for v in self.peers.values()), timeout_s=timeout_s)
        if self.backend.grants:
            self._start_after_genesis(timeout_s)
        else:
            self.start_validators(timeout_s)

    def wait_validator_ready(self, timeout_s: float = 300.0) -> None:
        """Until the validator has published genesis (or resumed) and opened its window."""
        self.followed.validator_ready = False
        self.follow(lambda: self.followed.validator_ready, timeout_s=timeout_s)

    def start_peer(self, i: int, *extra: str, launcher: Sequence[str] = ()) -> str:
        """Start peer ``i`` (its key is created first so that a credential can be scoped to it);
        ``peer_envs[name]``, when set before, is its environment (settings, a credential).
        ``launcher``: what runs the peer's console script (``torchrun --nproc-per-node 2``)."""
        assert self.group is not None and self.backend is not None and self.spec is not None
        state = self.peer_dir(i)
        ident = Identity.load_or_create(state / "key.pem")
        name = f"peer-{i}"
        # "--": torchrun's own options would otherwise swallow abbreviations (--run for --run-path).
        argv = [*self._launcher(name), *launcher, *python_console("sparseloco-peer"), *(["--"] if launcher else [])] + [
            "join",
            "--run",
            str(self.run_toml),
            "--state",
            str(state),
            "--device",
            "cpu",
            "--threads",
            str(self.setup.peer_threads),
            "--status-json",
            *self.backend.args(),
            *extra,
        ]
        if name not in self.peer_envs:  # a restarted peer keeps its credential
            self.peer_envs[name] = self.backend.peer_env(self.spec.hash(), ident.peer_id)
        env = {
            **self.peer_envs[name],
            "OMP_NUM_THREADS": str(self.setup.peer_threads),
            env_name("peer.join_timeout_s"): str(self.setup.join_timeout_s),
            env_name("data.cache_dir"): str(state / "cache"),  # its own: peers start with no data
        }
        self.may_exit.discard(name)
        self.group.start(name, argv, env=env)
        view = self.peers.setdefault(name, PeerView(name))
        view.peer_id = ident.peer_id
        return name

    def wan_name(self, name: str) -> str:
        """The WAN box participant process ``name`` runs as: ``validator-<i>`` for a validator
        (``validator`` is ``validator-0``), ``peer-<i>`` for a peer."""
        if name in self.validator_names:
            return f"{VALIDATOR}-{self.validator_names.index(name)}"
        return name

    def _launcher(self, name: str) -> list[str]:
        """The argv prefix of process ``name``: its namespace's in a WAN box, else nothing."""
        return self.setup.wan.launcher(self.wan_name(name)) if self.setup.wan is not None else []

    def kill(self, name: str) -> None:
        """SIGKILL a process group: no cleanup runs (fault injection)."""
        assert self.group is not None
        self.group.kill(name)
        self._account_wall(name)

    def pause(self, name: str) -> None:
        """SIGSTOP a process group (a peer that stalls: fault injection and test choreography)."""
        assert self.group is not None
        self.group.signal(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        assert self.group is not None
        self.group.signal(name, signal.SIGCONT)

    def stop(self, name: str) -> int:
        """SIGTERM ``name`` (a clean stop: a peer withdraws its announcement) and wait for it."""
        assert self.group is not None
        self.may_exit.add(name)  # 130, stopped on purpose
        rc = self.group.stop(name)
        self._account_wall(name)
        return rc

    def _account_wall(self, name: str) -> None:
        """Add the wall time of ``name``'s last incarnation once it has ended (once per process)."""
        assert self.group is not None
        self.group.running([name])  # notes the exit time of a process that ended by itself
        child = self.group.children[name]
        if name in self.peers and child.ended_at is not None and (name, child.started_at) not in self._accounted:
            self._accounted.add((name, child.started_at))
            self.peers[name].wall_s += child.ended_at - child.started_at

    # ------------------------------------------------------------------ following
    def follow(self, until: Callable[[], bool], *, timeout_s: float) -> None:
        """Consume events until ``until()`` is true; DemoError on timeout or a crash."""
        assert self.group is not None
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                raise DemoError(f"local swarm timed out after {timeout_s:.0f} s; logs in {self.run_dir / 'logs'}")
            self.pump(0.1)
            self._check_crashes()
        self.pump(0.0)

    def pump(self, timeout: float = 0.1) -> None:
        assert self.group is not None
        for name, line in self.group.lines(timeout=timeout):
            self._on_line(name, line)

    def _on_line(self, name: str, line: str) -> None:
        if name not in self.validator_names and name not in self.peers:
            return  # a store's own process (a DHT bootstrap node) writes no events
        try:
            event = parse_line(line)
        except ValueError as exc:  # a known kind with fields this reader does not know
            raise DemoError(f"{name} wrote an event the launcher cannot read ({exc}): {line[:300]}") from exc
        if event is None:
            return  # a log line on stderr
        if name in self.validator_names:
            self.followed.on_validator(event, name)
        else:
            self.followed.on_peer(self.peers[name], event)
        if self.on_event is not None:
            self.on_event(name, event)

    def _check_crashes(self) -> None:
        """DemoError when a process exited with an error status (not one killed on purpose)."""
        assert self.group is not None
        for name, child in self.group.children.items():
            rc = child.returncode
            if rc is not None and rc > 0 and name not in self.may_exit:  # negative: killed by a signal
                tail = child.log_path.read_text(errors="replace")[-2000:] if child.log_path.exists() else ""
                raise DemoError(f"{name} exited with status {rc}; log {child.log_path}:\n{tail}")

    def finished(self) -> bool:
        """The validator published the last window and every peer process has exited."""
        assert self.group is not None
        return (self.setup.windows - 1) in self.published and not self.group.running(list(self.peers))

    def wait_exit(self, timeout_s: float = 60.0) -> None:
        """Wait for the validator (which stops itself after the last window) and account wall time."""
        group = self.group
        assert group is not None
        members = [*self.validator_names, *self.peers]  # not the store's own processes (a DHT bootstrap node)
        self.follow(lambda: not group.running(members), timeout_s=timeout_s)
        for name in self.peers:
            self._account_wall(name)

    # ------------------------------------------------------------------ results
    def log_windows(self) -> list[LoggedWindow]:
        """Every window in the validator's contribution log (``sparseloco-validator logs --windows``)."""
        return read_windows(self.log_db)

    def log_contributions(self) -> list[PeerOutcome]:
        """Every decided contribution in the validator's log (``sparseloco-validator logs``)."""
        return read_contributions(self.log_db)

    def summary(self) -> dict[str, Any]:
        """The demo's result record (see ``sparseloco demo --help`` for the fields; with several
        validators also :meth:`agreement_summary`'s)."""
        from protocol.model import param_schema  # torch loads here, not for `sparseloco --help`

        assert self.spec is not None
        windows = {w.window: w for w in self.log_windows() if w.status == "published"}
        order = sorted(windows)
        equal = all(self._fingerprints_agree(w, windows[w].fingerprint) for w in order)
        uploads = [e.upload_bytes for v in self.peers.values() for e in v.windows.values() if e.outcome == "uploaded"]
        trained = [e for v in self.peers.values() for e in v.events if isinstance(e, PeerWindow) and e.tokens > 0]
        looked_up = sum(e.data_hits + e.data_misses for e in trained)
        reported = [e for v in self.peers.values() for e in v.events if isinstance(e, PeerWindow)]
        wall = sum(v.wall_s for v in self.peers.values())
        running = sum(v.running_s() for v in self.peers.values())
        inner = sum(v.inner_s for v in self.peers.values())
        n_params = sum(_numel(s) for s in param_schema(self.spec.model).values())
        return {
            "store": self.setup.store,
            "peers": len(self.peers),
            "windows_completed": len(order),
            "val_loss_per_window": [_round(self._val_loss(w, windows[w].val_loss)) for w in order],
            "accepted_per_window": [windows[w].accepted for w in order],
            "rejected_per_window": [windows[w].rejected for w in order],
            "fingerprints_equal": bool(order) and equal,
            "contributions_accounted": self.unaccounted() == [],
            "upload_bytes_per_peer_per_window": round(sum(uploads) / len(uploads)) if uploads else 0,
            "data_bytes_per_peer_per_window": round(sum(e.data_bytes for e in trained) / len(trained))
            if trained
            else 0,
            "data_cache_hit_rate": round(sum(e.data_hits for e in trained) / looked_up, 4) if looked_up else 0.0,
            "download_bytes_per_peer_per_window": round(sum(e.download_bytes for e in reported) / len(reported))
            if reported
            else 0,
            "wire_up_bytes_per_peer_per_window": round(sum(e.wire_up_bytes for e in reported) / len(reported))
            if reported
            else 0,
            "wire_down_bytes_per_peer_per_window": round(sum(e.wire_down_bytes for e in reported) / len(reported))
            if reported
            else 0,
            "dense_fp32_bytes": 4 * n_params,
            "parameters": n_params,
            "inner_steps": self.spec.inner.steps,
            "compute_fraction": round(inner / wall, 4) if wall else 0.0,
            "compute_fraction_running": round(inner / running, 4) if running else 0.0,
            "forecast_wait_s_per_window": round(sum(e.forecast_wait_s for e in trained) / len(trained), 3)
            if trained
            else 0.0,
            **self.request_summary(len(order)),
            "seconds": round(time.time() - self.started_at, 1),
            "contribution_log": str(self.log_db),
            "run_dir": str(self.run_dir),
            **(self.agreement_summary() if self.several else {}),
        }

    def request_summary(self, windows: int) -> dict[str, Any]:
        """Over S3, the bucket's requests: ``requests_per_peer_per_window`` (by kind, the mean of
        the peers' window reports: what each peer's store sent), ``store_requests_per_window`` (by
        kind, counted at the store since init: every peer and the validator together) and
        ``grants_per_peer_per_window`` (by op, the grant servers' ``granted`` events: a cached read
        grant serves many requests). Nothing for a store that does not count requests."""
        assert self.backend is not None
        now = self.backend.request_counts()
        if now is None or self.store_requests_at_start is None:
            return {}
        reports = [e for v in self.peers.values() for e in v.events if isinstance(e, PeerWindow)]
        per_peer = _mean_counts([e.requests for e in reports], len(reports))
        store = {k: n - self.store_requests_at_start.get(k, 0) for k, n in now.items()}
        grants = [ops for peer, ops in self.followed.grants.items() if peer in {v.peer_id for v in self.peers.values()}]
        return {
            "requests_per_peer_per_window": per_peer,
            "store_requests_per_window": _mean_counts([store], windows),
            "grants_per_peer_per_window": _mean_counts(grants, len(self.peers) * windows),
        }

    def agreement_summary(self) -> dict[str, Any]:
        """Several validators: who led and signed each certified window, the handovers, and how
        many certified aggregates the liar proposed (from the validators' ``window_published`` and
        ``agreement`` events; windows as strings, JSON's object keys)."""
        q = self.quorum
        certified = {w: self.published[w] for w in sorted(self.published)}
        liar = q.ids[self.liar_index] if self.liar_index is not None else None
        lies = {
            s.digest
            for v in self.followed.validators.values()
            for s in v.steps
            if s.step == "proposed" and s.validator == liar
        }
        return {
            "validators": list(q.ids),
            "quorum": q.m,
            "handover_s": q.handover_s,
            "faults": list(self.setup.faults),
            "leader_per_window": {str(w): e.leader for w, e in certified.items()},
            "view_per_window": {str(w): e.view for w, e in certified.items()},
            "signers_per_window": {str(w): sorted(e.signers) for w, e in certified.items()},
            "handovers": sum(e.view > 0 for e in certified.values()),
            "liar": liar,
            "liar_proposals_applied": sum(e.leader == liar or e.digest in lies for e in certified.values()),
            "objections": self._objections(),
        }

    def _objections(self) -> dict[str, int]:
        """Per validator id: the proposals (window, digest) it objected to, as any validator read them."""
        seen = {
            (s.validator, s.window, s.digest)
            for v in self.followed.validators.values()
            for s in v.steps
            if s.step == "objected" and s.digest
        }
        return {vid: sum(who == vid for who, _, _ in seen) for vid in self.quorum.ids}

    def _val_loss(self, window: int, logged: float | None) -> float | None:
        """The logged val loss of ``window``; with several validators one the summary's log did not
        compute (another led the window) is the certified aggregate's, as its report gave it."""
        if logged is not None or not self.several or window not in self.published:
            return logged
        loss = self.published[window].val_loss
        return None if math.isnan(loss) else loss

    def _fingerprints_agree(self, window: int, validator_fp: str | None) -> bool:
        """Every peer that reported θ after ``window`` holds the validator's θ (and someone did)."""
        seen = [v.applied[window] for v in self.peers.values() if window in v.applied]
        return bool(seen) and all(fp == validator_fp for fp in seen)

    def unaccounted(self) -> list[tuple[int, str]]:
        """(window, peer) uploads a peer reported that have no decided row in the contribution log."""
        rows = {(c.window, c.peer) for c in self.log_contributions()}
        missing = []
        for v in self.peers.values():
            for w, e in v.windows.items():
                if e.outcome == "uploaded" and (w, v.peer_id) not in rows:
                    missing.append((w, v.peer_id))
        return missing

    def cleanup(self) -> None:
        """Remove the run directory if this swarm created it."""
        if self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mean_counts(counts: Sequence[Mapping[str, int]], over: int) -> dict[str, float]:
    """The sum of ``counts`` by key, divided by ``over`` (0: nothing to divide by, all 0)."""
    total: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            total[key] = total.get(key, 0) + n
    return {key: round(n / over, 2) if over else 0.0 for key, n in sorted(total.items())}


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


def default_threads(peers: int) -> int:
    """Threads per peer so that the peers together use the machine's cores (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, peers))


def _check_validators(validators: int, quorum: int, faults: tuple[str, ...]) -> None:
    """ConfigError for a set of validators the local swarm cannot run (checked before any process
    starts; the RunSpec checks the quorum itself)."""
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ConfigError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    if validators < 1:
        raise ConfigError("a run needs at least one validator")
    if faults and validators == 1:
        raise ConfigError(f"--faults {','.join(faults)} needs several validators (--validators N)")
    m = quorum or validators // 2 + 1
    if "kill-leader" in faults and validators - m < 1:
        raise ConfigError(
            f"kill-leader: {m} of {validators} validators cannot continue with one of them down (lower --quorum)"
        )


class KillLeader:
    """The ``kill-leader`` fault: SIGKILL the view-0 leader of ``window`` once it opened the window
    (before it can propose, or mid-window on a slow machine), restart it (same state directory,
    same key) once another leader's aggregate of the window is certified. Call :meth:`step`
    between events; it says whether the fault has played out.

    Should the validators left split their signatures (each honest one signed another digest:
    leaders of consecutive views each proposed when the handover was shorter than a decision),
    nothing can be certified without the killed one: it is restarted then (``split``)."""

    def __init__(self, swarm: LocalSwarm, window: int = KILL_WINDOW) -> None:
        self.swarm, self.window = swarm, window
        self.victim = swarm.leader_index(window)
        self.killed_at: float | None = None
        self.restarted = False
        self.split = False  # restarted because the others split their signatures

    @property
    def name(self) -> str:
        return self.swarm.validator_names[self.victim]

    def step(self) -> bool:
        view = self.swarm.validator_view(self.victim)
        if self.killed_at is None and self.window in view.opened:
            self.swarm.kill(self.name)
            self.killed_at = time.time()
        elif self.killed_at is not None and not self.restarted:
            if self.window in self.swarm.published or self._split():
                self.split = self.window not in self.swarm.published
                self.swarm.start_validator(self.victim)
                self.restarted = True
        return self.restarted

    def _split(self) -> bool:
        """Every honest validator left signed the window, not all the same digest."""
        ids = self.swarm.quorum.ids
        signed = set()
        for i in range(len(ids)):
            if i in (self.victim, self.swarm.liar_index):
                continue
            own = [
                s.digest
                for s in self.swarm.validator_view(i).steps_of(self.window, "endorsed")
                if s.validator == ids[i]
            ]
            if not own:
                return False
            signed.add(own[-1])
        return len(signed) > 1


# ---------------------------------------------------------------------- the command
def run_demo(
    *,
    peers: int,
    windows: int,
    store: str,
    run_dir: str | Path | None,
    timeout_s: float,
    on_event: Callable[[str, Event], None] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    preset: str | Path = PRESET,
    validators: int = 1,
    quorum: int = 0,
    faults: Sequence[str] = (),
    handover_s: float = HANDOVER_S,
) -> dict[str, Any]:
    """Start the swarm, follow it to the end, return :meth:`LocalSwarm.summary`. ``validators``,
    ``quorum``, ``faults``: several validators (the module doc)."""
    if "kill-leader" in faults and windows <= KILL_WINDOW + 1:
        raise ConfigError(
            f"kill-leader kills the leader of window {KILL_WINDOW}: run at least {KILL_WINDOW + 2} windows"
        )
    with LocalSwarm(
        run_dir,
        peers=peers,
        windows=windows,
        store=store,
        peer_threads=default_threads(peers),
        join_timeout_s=timeout_s,
        on_event=on_event,
        overrides=overrides,
        preset=preset,
        validators=validators,
        quorum=quorum,
        faults=faults,
        handover_s=handover_s,
    ) as swarm:
        swarm.start_peers_then_validator(timeout_s=timeout_s)
        kill = KillLeader(swarm) if "kill-leader" in faults else None
        swarm.follow(lambda: (kill is None or kill.step()) and swarm.finished(), timeout_s=timeout_s)
        swarm.wait_exit(timeout_s=60.0)
        summary = swarm.summary()
        if kill is not None:
            summary["killed_leader"] = {
                "window": kill.window,
                "validator": swarm.quorum.ids[kill.victim],
                "restarted_after": "split" if kill.split else "certified",
            }
        return summary
