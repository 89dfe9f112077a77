"""Where a local swarm keeps its objects: a directory, a SeaweedFS S3 server or hivemind DHT nodes.

Each backend gives the URL every participant opens, the extra arguments and environment of the
validator and of each peer, and cleans up after itself. Over S3 the peers hold no credential: each
validator serves grants on a port of its own (``--grant-port``), all with the bucket's credential,
and run.toml's ``[local.store] grant_url`` names them all, validator-0's first (a peer asks the
next when the one it uses does not answer, :mod:`protocol.store.granted`)::

    with open_backend("s3", run_dir, processes, validator_keys) as backend:
        backend.url                          # s3://sparseloco
        backend.store_settings               # run.toml [local.store] suggestions (endpoint, grant URLs, bootstrap nodes)
        backend.validator_env()              # the bucket's write credential
        backend.validator_args(i)            # --grant-port PORT_i --grant-host 127.0.0.1 (s3), --dht-peer … (dht)
        backend.peer_env(run_hash, peer_id)  # nothing: peers of an S3 swarm ask for grants
        backend.credential_env(run_hash, peer_id)   # or a credential scoped to that peer's keys instead
        backend.args()                       # ["--dht-peer", maddr, ...] for dht
        backend.request_counts()             # s3: requests the bucket answered so far, by kind (None elsewhere)

In a :class:`~client.demo.wan.Wan` box (``wan=``, S3 only) the SeaweedFS server runs in the
``store`` namespace bound to its address, and validator ``i``'s grant server is reached at the
address of ``validator-<i>``: peers connect out to those two only and listen on nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.demo.errors import DemoError
from client.demo.processes import ProcessGroup
from client.demo.seaweed import INSTALL_HINT, SeaweedS3, free_ports, peer_grants, weed_available
from client.demo.wan import Wan
from protocol import layout
from protocol.errors import ConfigError
from protocol.settings import env_name
from protocol.store.base import ObjectStore

KINDS = ("file", "s3", "dht")


@dataclass
class Backend:
    """A started store for a local swarm (see the module docstring). ``grant_ports``: the port of
    each validator's grant server, in rotation order (S3), none for other stores; ``grant_hosts``:
    the address each binds (127.0.0.1, or its address in a WAN box)."""

    kind: str
    url: str
    store_settings: dict[str, Any] = field(default_factory=dict)  # [local.store] besides the url
    _args: list[str] = field(default_factory=list)
    _validator_env: dict[str, str] = field(default_factory=dict)
    _server: SeaweedS3 | None = None
    grant_ports: tuple[int, ...] = ()
    grant_hosts: tuple[str, ...] = ()

    @property
    def grants(self) -> bool:
        """Whether the validators serve grants (peers hold no credential and need one up to announce)."""
        return bool(self.grant_ports)

    def args(self) -> list[str]:
        return list(self._args)

    def validator_args(self, i: int = 0) -> list[str]:
        """The options of validator ``i`` (rotation order): its own grant port, if it serves grants."""
        if not self.grant_ports:
            return self.args()
        host = self.grant_hosts[i] if self.grant_hosts else "127.0.0.1"
        return [*self.args(), "--grant-port", str(self.grant_ports[i]), "--grant-host", host]

    def admin_store(self) -> ObjectStore:
        """The S3 store with the bucket's credential (what a test or a benchmark reads back)."""
        if self._server is None:
            raise ConfigError(f"a {self.kind} store has no admin credential")
        return self._server.store()

    def request_counts(self) -> dict[str, int] | None:
        """The S3 requests the store answered so far, all clients together, by billed kind
        (:meth:`SeaweedS3.request_counts`); None for a store that does not count them."""
        return self._server.request_counts() if self._server is not None else None

    def validator_env(self) -> dict[str, str]:
        return dict(self._validator_env)

    def peer_env(self, run_hash: str, peer_id: str) -> dict[str, str]:
        """Environment of one peer: nothing (an S3 peer asks the validator for grants)."""
        return {}

    def credential_env(self, run_hash: str, peer_id: str, *, may_contribute: bool = True) -> dict[str, str]:
        """Environment of an S3 peer that uses a credential of its own instead of grants: one that
        may write only that peer's objects (``may_contribute=False``: its announcement only, a
        credential that cannot upload)."""
        if self._server is None:
            raise ConfigError(f"a {self.kind} store has no credentials to issue")
        contributions, announcement, probe = peer_grants(layout.run_id(run_hash), peer_id)
        grants = (contributions, announcement, probe) if may_contribute else (announcement,)
        creds = self._server.issue_credentials(*grants, name=peer_id[:8])
        return {**creds.env(self._server.endpoint_url), env_name("store.grant_url"): ""}


@contextmanager
def open_backend(
    kind: str, run_dir: Path, group: ProcessGroup, validator_keys: Sequence[str] = (), wan: Wan | None = None
) -> Iterator[Backend]:
    """Start the store of kind ``file``, ``s3`` or ``dht`` for a swarm in ``run_dir``.
    ``validator_keys`` (hex): the run's validator keys, which every DHT node must know; over S3 one
    grant port per key (one when none are given). ``wan``: the box the swarm runs in (S3 only)."""
    if wan is not None and kind != "s3":
        raise ConfigError(f"a swarm in a WAN box runs over an S3 store, not {kind!r}")
    if kind == "file":
        yield Backend("file", f"file://{(run_dir / 'store').resolve()}")
    elif kind == "s3":
        with _seaweed(wan) as server:
            env = server.admin.env(server.endpoint_url)
            ports = tuple(free_ports(max(1, len(validator_keys))))
            hosts = tuple(wan.address(f"validator-{i}") if wan else "127.0.0.1" for i in range(len(ports)))
            store = {
                "s3_endpoint": server.endpoint_url,
                "s3_region": "us-east-1",
                "grant_url": ",".join(f"http://{host}:{port}" for host, port in zip(hosts, ports)),
            }
            yield Backend(
                "s3", server.url(), store, _validator_env=env, _server=server, grant_ports=ports, grant_hosts=hosts
            )
    elif kind == "dht":
        maddrs = _dht_bootstrap(group, validator_keys)
        yield Backend("dht", "dht://", {"dht_bootstrap": maddrs}, [a for m in maddrs for a in ("--dht-peer", m)])
    else:
        raise ConfigError(f"unknown store kind {kind!r}; choose one of {', '.join(KINDS)}")


# ---------------------------------------------------------------------- S3 (SeaweedFS)
@contextmanager
def _seaweed(wan: Wan | None = None) -> Iterator[SeaweedS3]:
    if not weed_available():
        raise ConfigError(
            f"--store s3 runs a local SeaweedFS server and needs its `weed` binary: {INSTALL_HINT} "
            "(or use --store file / --store dht)"
        )
    server = SeaweedS3(host=wan.address("store"), launcher=wan.launcher("store")) if wan else SeaweedS3()
    try:
        server.start()
    except RuntimeError as exc:
        raise DemoError(f"cannot start SeaweedFS: {exc}") from exc
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------- DHT (hivemind)
def _dht_bootstrap(group: ProcessGroup, validator_keys: Sequence[str], timeout_s: float = 60.0) -> list[str]:
    """Start a bootstrap DHT node on 127.0.0.1 in ``group``; return its multiaddrs."""
    keys = [arg for key in validator_keys for arg in ("--validator-key", key)]
    group.start(
        "dht-bootstrap",
        [sys.executable, "-m", "protocol.store.dht.serve", "--host", "127.0.0.1", "--port", "0", *keys],
    )
    maddrs: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, line in group.lines(timeout=0.2):
            if name != "dht-bootstrap":
                continue
            if line.startswith("MADDR "):
                maddrs.append(line.split(" ", 1)[1].strip())
            elif line.strip() == "READY":
                if not maddrs:
                    raise DemoError("the DHT bootstrap node printed no address")
                return maddrs
        if not group.running(["dht-bootstrap"]):
            raise DemoError(f"the DHT bootstrap node exited; see {group.children['dht-bootstrap'].log_path}")
    raise DemoError("the DHT bootstrap node did not become ready in time")
