"""How the read-only commands (``sparseloco checkpoints``, ``export``, ``eval``, ``sample``,
``inspect``, ``status``) reach a run's store: exactly as ``sparseloco-peer join`` does.

The local settings resolve as for ``join`` (flags > ``SPARSELOCO_*`` > ``--settings FILE`` >
run.toml ``[local]``) and the run's store opens with :func:`protocol.store.open_peer_store`: with
``store.grant_url`` every read is a request the validator's grant server presigned, so a volunteer
holding only run.toml needs no store credential. A grant request is signed; the grant desk serves
reads of the run to any key (an identity that has not announced shares a small per-network budget,
:mod:`validator.grants`), so the key is the peer's own (``--key``, else ``key.pem`` of the state
directory ``join`` uses) when there is one and a throwaway identity otherwise::

    access = ReadAccess.load("run.toml", overrides, key_path=None)
    with access.open() as store: ...                        # the run's store of the local settings
    with access.open("file:///elsewhere") as store: ...     # another store: its own credentials
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.layout import run_id
from protocol.settings import LocalSettings, StoreSettings
from protocol.settings_cli import Overrides

if TYPE_CHECKING:
    from protocol.store.base import ObjectStore

F = TypeVar("F", bound=Callable[..., object])
KEY_FILE = "key.pem"  # in the state directory, as sparseloco-peer join keeps it
KEY_HELP = (
    "Ed25519 key that signs grant requests (store.grant_url) [default: the key of join's state directory "
    "~/.sparseloco/<run id>/key.pem, else a throwaway key: the grant server serves reads of the run to any key]."
)


def key_option(fn: F) -> F:
    """``--key PATH`` for a read-only command (see :data:`KEY_HELP`)."""
    return click.option("--key", "key_path", default=None, type=click.Path(dir_okay=False), help=KEY_HELP)(fn)


def default_state_dir(spec: RunSpec) -> Path:
    """The state directory ``sparseloco-peer join`` uses without ``--state``."""
    return Path("~/.sparseloco").expanduser() / run_id(spec.hash())


def read_identity(spec: RunSpec, key_path: str | None, state_dir: str | Path | None = None) -> tuple[Identity, bool]:
    """(identity, whether it is the peer's own key): ``key_path``, else ``key.pem`` of ``state_dir``
    (default: join's), else a throwaway identity. A given ``key_path`` must exist (nothing is created)."""
    if key_path is not None:
        return Identity.load(Path(key_path)), True
    key = Path(state_dir or default_state_dir(spec)) / KEY_FILE
    if key.exists():
        return Identity.load(key), True
    return Identity.generate(), False


def open_run_store(
    settings: StoreSettings,
    identity: Identity | None,
    spec: RunSpec | None,
    url: str | None = None,
    dht_peers: Sequence[str] = (),
) -> ObjectStore:
    """The store at ``url`` (default: ``settings.url``) with the local ``settings``: the run's own
    store (``url`` is ``settings.url``) through :func:`~protocol.store.open_peer_store`, as ``join``
    opens it (grants when ``store.grant_url`` is set); any other store with its own credentials."""
    from protocol.store import open_from_settings, open_peer_store

    bootstrap = tuple(dht_peers) or settings.dht_bootstrap
    if identity is not None and spec is not None and (url is None or url == settings.url):
        store_settings = dataclasses.replace(settings, dht_bootstrap=bootstrap)
        return open_peer_store(store_settings, identity, spec.hash(), validator_keys=spec.validator.public_keys)
    keys = spec.validator.public_keys if spec is not None else ()
    other = dataclasses.replace(settings, url=url or settings.url, dht_bootstrap=bootstrap)
    return open_from_settings(other, identity=identity, validator_keys=keys)


@dataclass(frozen=True)
class ReadAccess:
    """A read-only command's run, local settings and the identity its grant requests carry."""

    spec: RunSpec
    local: LocalSettings
    identity: Identity
    own_key: bool  # the peer's key (not a throwaway one)

    @classmethod
    def load(
        cls, run_path: str, overrides: Overrides, key_path: str | None, state_dir: str | Path | None = None
    ) -> ReadAccess:
        spec = RunSpec.load(run_path)
        identity, own = read_identity(spec, key_path, state_dir)
        return cls(spec, overrides.load(run_path), identity, own)

    def open(self, url: str | None = None, dht_peers: Sequence[str] = ()) -> ObjectStore:
        """The store at ``url`` (default: the run's store of the local settings), see :func:`open_run_store`."""
        return open_run_store(self.local.store, self.identity, self.spec, url, dht_peers)
