"""Storage backends behind one interface, chosen by URL.

    open_store("memory://")                     # private, in-process (tests)
    open_store("memory://swarm")                # shared by every handle named "swarm" in-process
    open_store("file:///var/lib/sparseloco")    # a local directory (also file://./relative)
    open_store("s3://bucket/prefix", endpoint_url="https://...", region="auto",
               access_key="...", secret_key="...")   # or credentials from the AWS env/profile
    open_store("s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1")
    open_store("dht://", initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."],
               identity=ident, validator_keys=spec.validator.public_keys)

Options go to the backend's constructor (:class:`LocalStore`, :class:`S3Store`, ``DHTStore``).
The validator opens the store its local settings name (``[local.store]``, the environment and
``--store`` / ``--dht-peer``: :mod:`protocol.settings`) with :func:`open_from_settings`; a peer
with :func:`open_peer_store`, which goes through the run's grant server when the settings name one
(``store.grant_url``: :class:`~protocol.store.granted.GrantedStore`, no credential needed). Both take the participant's ``identity``
and the run's ``validator_keys``: a DHT has no permissions of its own, so its records are signed
with the identity and checked against the validator keys (see :mod:`protocol.store.dht.policy`);
the other backends do not use them (their own credentials decide who may write).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from protocol.errors import ConfigError
from protocol.store.base import (
    DEFAULT_MAX_BYTES,
    MAX_RANGE_BYTES,
    ObjectStore,
    check_key,
    check_prefix,
    check_range,
    put_once,
)
from protocol.store.local import LocalStore
from protocol.store.memory import MemoryStore

if TYPE_CHECKING:
    from protocol.identity import Identity
    from protocol.settings import StoreSettings
    from protocol.store.dht.listing import ListBounds

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAX_RANGE_BYTES",
    "LocalStore",
    "MemoryStore",
    "ObjectStore",
    "check_key",
    "check_prefix",
    "check_range",
    "open_from_settings",
    "open_peer_store",
    "open_store",
    "put_once",
]

# Query parameters an s3:// URL may carry (never secrets: URLs end up in logs).
_S3_QUERY = {
    "endpoint": "endpoint_url",
    "endpoint_url": "endpoint_url",
    "region": "region",
    "profile": "profile",
    "addressing_style": "addressing_style",
}


def open_store(url: str, **options: Any) -> ObjectStore:
    """Open the store named by ``url``; raises :class:`ConfigError` for an unusable URL."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"store URL needs a scheme (memory://, file://, s3://, dht://): {url!r}")
    scheme = scheme.lower()
    if scheme == "memory":
        return _build(MemoryStore, rest.strip("/"), **options)
    if scheme == "file":
        if not rest:
            raise ConfigError(f"file:// URL without a path: {url!r}")
        return _build(LocalStore, rest, **options)
    if scheme == "s3":
        return _open_s3(url, options)
    if scheme == "dht":
        return _open_dht(url, options)
    raise ConfigError(f"unknown store scheme {scheme!r} in {url!r}")


def _build(cls: type[ObjectStore], *args: Any, **options: Any) -> ObjectStore:
    """``cls(*args, **options)``, with a misspelt option reported as a ConfigError."""
    try:
        inspect.signature(cls).bind(*args, **options)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc
    return cls(*args, **options)


def _query(url: str) -> dict[str, str]:
    parsed = parse_qs(urlsplit(url).query, keep_blank_values=False, strict_parsing=False)
    return {name: values[-1] for name, values in parsed.items()}


def _open_s3(url: str, options: dict[str, Any]) -> ObjectStore:
    from protocol.store.s3 import S3Store  # boto3 import costs ~0.3 s; only when asked

    parts = urlsplit(url)
    if not parts.netloc:
        raise ConfigError(f"s3:// URL without a bucket: {url!r}")
    merged: dict[str, Any] = {}
    for name, value in _query(url).items():
        if name not in _S3_QUERY:
            raise ConfigError(f"unknown s3:// URL parameter {name!r} (credentials go in options)")
        merged[_S3_QUERY[name]] = value
    merged.update(options)  # explicit options win over the URL
    return _build(S3Store, parts.netloc, parts.path.strip("/"), **merged)


def _open_dht(url: str, options: dict[str, Any]) -> ObjectStore:
    try:
        from protocol.store.dht.store import DHTStore
    except ImportError as exc:
        raise ConfigError(f"the DHT backend is not available: {exc}") from exc
    peers = list(options.pop("initial_peers", []))
    query = _query(url)
    if "peers" in query:
        peers += [p for p in query.pop("peers").split(",") if p]
    if query:
        raise ConfigError(f"unknown dht:// URL parameters {sorted(query)}")
    return _build(DHTStore, peers, **options)


def open_from_settings(
    settings: StoreSettings,
    *,
    identity: Identity | None = None,
    validator_keys: Sequence[bytes | str] = (),
    list_bounds: ListBounds | None = None,
    **options: Any,
) -> ObjectStore:
    """Open the store of a process's local settings (``settings.store``); ``options`` (credentials,
    timeouts) add to or override what the settings give the backend.

    ``s3://``: ``s3_endpoint`` and ``s3_region`` (an endpoint or region in the URL was already
    lifted into them, :func:`protocol.settings.lift_url_settings`). ``dht://``: ``dht_bootstrap``
    are the nodes to join through; ``identity``/``validator_keys`` sign and check its records (see
    the module doc); ``list_bounds`` caps what one listing decodes
    (:meth:`~protocol.store.dht.listing.ListBounds.for_run`; None: the defaults). Other backends
    ignore ``list_bounds``.
    """
    scheme = settings.url.partition("://")[0].lower()
    merged: dict[str, Any] = {}
    if scheme == "s3":
        if settings.s3_endpoint:
            merged["endpoint_url"] = settings.s3_endpoint
        if settings.s3_region:
            merged["region"] = settings.s3_region
    elif scheme == "dht":
        merged.update(
            initial_peers=list(settings.dht_bootstrap), identity=identity, validator_keys=list(validator_keys)
        )
        if list_bounds is not None:
            merged["list_bounds"] = list_bounds
    merged.update(options)
    return open_store(settings.url, **merged)


def open_peer_store(
    settings: StoreSettings,
    identity: Identity,
    run_hash: str,
    *,
    validator_keys: Sequence[bytes | str] = (),
    **options: Any,
) -> ObjectStore:
    """The store a peer of run ``run_hash`` opens: with ``settings.grant_url`` a
    :class:`~protocol.store.granted.GrantedStore` that signs its grant requests with ``identity``
    (reading anonymously from ``settings.url`` when ``settings.public_reads``); otherwise
    :func:`open_from_settings` (a credential from the AWS chain, a directory, the DHT: its records
    signed with ``identity`` and checked against ``validator_keys``)."""
    if not settings.grant_url:
        if settings.public_reads:
            raise ConfigError("store.public_reads needs store.grant_url (writes go through its grants)")
        return open_from_settings(settings, identity=identity, validator_keys=validator_keys, **options)
    from protocol.store.granted import GrantedStore
    from protocol.store.traffic import WireCounter

    wire = WireCounter()  # one count of the grant server's, the store's and the public reads' traffic
    reads = None
    if settings.public_reads:
        if settings.url.partition("://")[0].lower() != "s3":
            raise ConfigError(f"store.public_reads reads an s3:// bucket anonymously, not {settings.url!r}")
        reads = open_from_settings(settings, anonymous=True, wire=wire)
    return GrantedStore(settings.grant_url, identity, run_hash, reads=reads, wire=wire, **options)
