"""Object store on a hivemind DHT (Kademlia over libp2p): no server, no open bucket, records in RAM.

    boot = DHTStore(validator_keys=keys)                 # first node of a run (or dht/serve.py)
    store = DHTStore(boot.visible_maddrs(), identity=me, validator_keys=keys, expiration_s=3600)
    store.put("run/contrib/00000003/<my peer id>", blob)
    store.get("run/contrib/00000003/<peer id>", max_bytes=64 << 20)
    store.get_range("run/data/shard/<sha256>", start=4096, length=512)   # only the pieces it covers
    store.list("run/peers/")                             # the announcement index
    store.list_written_by("run/contrib/00000003/", announced)   # only these writers' entries decoded
    store.close()

How objects map onto DHT records (all under ``namespace``):

- ``<ns>:obj:<key>``  the manifest (size, piece size, sha256 of the value and of every piece),
  see :mod:`protocol.store.dht.pieces`. Read with ``latest=True`` so an overwrite is seen.
- ``<ns>:piece:<sha256>``  the pieces, content-addressed by their own hash, one per RPC (hivemind
  caps a message at 4 MiB, so a batched store would overflow it). A ranged read fetches only the
  pieces that cover the range, each checked against its hash in the manifest.
- ``<ns>:dir:<folder>``  a directory record whose *subkeys* are the entries of ``folder``, one per
  writer and name (``<peer_id>/<name>``): the object names and sub-folder names (with a trailing
  ``/``) — ``list`` walks it like a file tree, so ``list("run/contrib/00000003/")`` reads one record
  whatever else the run holds. Anyone may add entries of their own, so what one listing decodes is
  bounded before any entry is decoded (:mod:`protocol.store.dht.listing`: the entries of named
  writers and of validators, at most ``list_bounds.max_entries`` others per record and
  ``max_folders`` untrusted sub-folders per walk); ``last_listing`` counts what was ignored.

Write authorization: every record is signed by the writer's Ed25519 key (``identity``, the same
key as the signed objects) together with its DHT key, subkey and expiration
(:mod:`protocol.store.dht.records`). Every node runs :class:`~protocol.store.dht.auth.SignedRecordValidator`
with the run's :class:`~protocol.store.dht.policy.WritePolicy` (built from ``validator_keys``), so a
peer's keys can be written only by that peer, chain keys only by a validator key, pieces only with
the bytes their name hashes to, and a directory entry only by its owner; nodes refuse anything else.
Readers check every record again (a node started without validators can serve anything): one that
fails counts as absent. A store without ``identity`` can read but not write.

Every record carries an expiration of ``expiration_s`` from the last put; the DHT keeps the value
with the latest expiration, so writes of one writer are last-writer-wins by expiration time (peers'
clocks must agree within a few seconds, which hivemind requires anyway). What **delete** means on
a DHT: the manifest is replaced by a tombstone and the writer's directory entry marked deleted,
both with a fresh expiration, so readers get ``ObjectNotFound`` at once; the pieces cannot be
recalled and simply expire. ``put(if_absent=True)`` is best-effort (check, then write):
``atomic_create`` is False. Records live in the RAM of the nodes nearest to their key until they
expire.

The store API is synchronous; the node runs on a private event loop thread (see
:mod:`protocol.store.dht.loop` for why not ``hivemind.DHT``). ``close()`` and interpreter exit shut
the node and its ``p2pd`` daemon down.
"""

from __future__ import annotations

import asyncio
import atexit
import builtins  # annotations in DHTStore: its list() method shadows the builtin there
import logging
import random
import re
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any, TypeVar

from protocol.errors import (
    AccessDenied,
    ConfigError,
    IncompleteObject,
    MalformedPayload,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    ProtocolError,
    StoreError,
)
from protocol.identity import Identity
from protocol.store.base import (
    DEFAULT_MAX_BYTES,
    ObjectStore,
    check_key,
    check_prefix,
    check_range,
    range_past_end,
)
from protocol.store.dht.listing import ListBounds, ListStats, choose, read_directory
from protocol.store.dht.loop import LoopThread
from protocol.store.dht.pieces import (
    DEFAULT_PIECE_SIZE,
    Manifest,
    assemble,
    check_piece,
    decode_manifest,
    encode_manifest,
    piece_name,
    split,
    tombstone,
)
from protocol.store.dht.policy import DELETED, DIR, FILE, FOLDER, OBJ, PIECE, WritePolicy, entry_subkey
from protocol.store.dht.records import Record, open_record, seal_record

T = TypeVar("T")
V = TypeVar("V")
log = logging.getLogger(__name__)

DEFAULT_EXPIRATION_S = 3600.0
# A bootstrap address must name the peer (".../p2p/<base58 peer id>"): hivemind pings peers by id.
_BOOTSTRAP_MADDR = re.compile(r"/\S+/p2p/[1-9A-HJ-NP-Za-km-z]{20,}")
# Strong references: a running node is a resource that lives until close() or interpreter exit.
_LIVE: set[DHTStore] = set()


class DHTStore(ObjectStore):
    """:class:`ObjectStore` backed by one hivemind ``DHTNode`` that this object owns.

    ``initial_peers``: multiaddrs of running nodes (``visible_maddrs()`` of another store, or the
    bootstrap addresses of the RunSpec); none starts a new DHT. ``host``/``port``: where this node
    listens (port 0 picks a free one). ``expiration_s``: lifetime of every record written.
    ``piece_size``: bytes per DHT record. ``timeout_s``: limit for one put/get/list.
    ``identity_path``: libp2p key file (created if missing) so that the node keeps its peer id, and
    so its bootstrap address, across restarts. ``client_mode``: only make requests, store nothing
    for others (for nodes behind NAT). ``start=False`` defers starting the node to :meth:`start`.
    ``identity``: the Ed25519 key every record this store writes is signed with (a peer's or the
    validator's key; None: read-only). ``validator_keys``: the run's validator public keys (raw or
    hex), the only keys that may write chain objects; every node of a run must be given the same.
    ``list_bounds``: how many directory entries and folders one ``list`` decodes at most
    (:class:`~protocol.store.dht.listing.ListBounds`; ``ListBounds.for_run`` follows the RunSpec).
    A malformed bootstrap address is a ``ConfigError``; peers that do not answer make
    :meth:`start` raise ``StoreError``.
    """

    atomic_create = False

    def __init__(
        self,
        initial_peers: Iterable[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        expiration_s: float = DEFAULT_EXPIRATION_S,
        start: bool = True,
        namespace: str = "sparseloco",
        piece_size: int = DEFAULT_PIECE_SIZE,
        num_replicas: int = 5,
        timeout_s: float = 60.0,
        max_concurrency: int = 8,
        client_mode: bool = False,
        announce_maddrs: Iterable[str] | None = None,
        identity_path: str | None = None,
        identity: Identity | None = None,
        validator_keys: Collection[bytes | str] = (),
        list_bounds: ListBounds | None = None,
    ) -> None:
        if expiration_s <= 0 or timeout_s <= 0 or max_concurrency < 1:
            raise ValueError("expiration_s, timeout_s and max_concurrency must be positive")
        split(b"", piece_size)  # validates piece_size early
        self.initial_peers = [str(p) for p in initial_peers or ()]
        bad = [p for p in self.initial_peers if not _BOOTSTRAP_MADDR.fullmatch(p)]
        if bad:
            raise ConfigError(f"DHT bootstrap addresses must look like /ip4/HOST/tcp/PORT/p2p/PEER_ID: {bad}")
        self.host, self.port = host, port
        self.expiration_s, self.timeout_s = float(expiration_s), float(timeout_s)
        self.namespace, self.piece_size, self.num_replicas = namespace, piece_size, num_replicas
        self.max_concurrency, self.client_mode = max_concurrency, client_mode
        self.announce_maddrs = [str(a) for a in announce_maddrs or ()]
        self.identity_path = identity_path
        self.identity = identity
        self.policy = WritePolicy(namespace, validator_keys)
        self._loop: LoopThread | None = None
        self._node: Any = None  # hivemind.dht.node.DHTNode once started
        self._maddrs: list[str] = []
        self._expirations = _Expirations()
        self.list_bounds = list_bounds or ListBounds()
        self.last_listing = ListStats()  # what the latest list() read and ignored
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> DHTStore:
        """Start the node (idempotent). Raises ``StoreError`` if no initial peer answers."""
        if self._node is not None:
            return self
        self._loop = LoopThread(name=f"dht-{self.namespace}")
        try:
            self._node = self._loop.run(self._create_node(), self.timeout_s)
            maddrs = self._loop.run(self._node.get_visible_maddrs(), self.timeout_s)
        except BaseException as err:
            self.close()
            if isinstance(err, Exception):
                raise StoreError(f"could not start a DHT node on {self.host}:{self.port}: {err}") from err
            raise
        self._maddrs = [str(m) for m in maddrs]
        _LIVE.add(self)
        return self

    async def _create_node(self) -> Any:
        from hivemind.dht.node import DHTNode  # ~3 s import: only when a DHT is really used

        from protocol.store.dht.auth import SignedRecordValidator  # imports hivemind too

        proto = "ip6" if ":" in self.host else "ip4"
        loopback = self.host in ("127.0.0.1", "::1", "localhost")
        return await DHTNode.create(
            initial_peers=self.initial_peers or None,
            host_maddrs=[f"/{proto}/{self.host}/tcp/{self.port}"],
            announce_maddrs=self.announce_maddrs or None,
            num_replicas=self.num_replicas,
            client_mode=self.client_mode,
            nat_port_map=not loopback,  # UPnP makes no sense on loopback and slows the start
            identity_path=self.identity_path,
            record_validator=SignedRecordValidator(self.policy),
        )

    def __enter__(self) -> DHTStore:
        return self

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (``/ip4/.../tcp/.../p2p/<id>``) other nodes can pass as ``initial_peers``."""
        return list(self._maddrs)

    def close(self) -> None:
        """Shut the node and its p2pd daemon down, stop the loop thread. Idempotent."""
        _LIVE.discard(self)
        node, loop, self._node, self._loop = self._node, self._loop, None, None
        if loop is None:
            return
        if node is not None and loop.alive:
            try:
                loop.run(node.shutdown(), 15.0)
            except Exception as err:
                log.warning("DHT node shutdown failed: %r", err)
        loop.stop()

    # ------------------------------------------------------------------ ObjectStore
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._writer(check_key(key))
        if if_absent and self._live_manifest(key) is not None:
            raise ObjectExists(f"{key!r} already exists on the DHT")
        manifest, pieces = split(bytes(data), self.piece_size)
        self._run(self._put(key, manifest, pieces), f"put {key!r}")

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        manifest = self.manifest(key)
        if manifest.size > max_bytes:
            raise PayloadTooLarge(f"{key!r} is {manifest.size} bytes, more than max_bytes={max_bytes}")
        pieces = self._run(self._fetch_pieces(key, manifest, range(manifest.n_pieces)), f"get {key!r}")
        return assemble(manifest, pieces, key=key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        end = check_range(key, start, length)
        manifest = self.manifest(key)
        if manifest.size < end:
            raise range_past_end(key, start, length, manifest.size)
        first, last = start // manifest.piece_size, (end - 1) // manifest.piece_size
        what = f"get {key!r} [{start}, {end})"
        pieces = self._run(self._fetch_pieces(key, manifest, range(first, last + 1)), what)
        offset = start - first * manifest.piece_size
        return b"".join(pieces)[offset : offset + length]

    def size(self, key: str) -> int:
        return self.manifest(key).size

    def list(self, prefix: str) -> list[str]:
        return self._list(prefix, None)

    def list_written_by(self, prefix: str, writers: Collection[str]) -> builtins.list[str]:
        """``list(prefix)`` reading only the directory entries of ``writers`` and of the run's
        validators: every other writer's entries are counted and never decoded."""
        return self._list(prefix, frozenset(writers))

    def _list(self, prefix: str, writers: frozenset[str] | None) -> builtins.list[str]:
        folder, _, partial = check_prefix(prefix).rpartition("/")
        walk = _Walk(self.list_bounds.max_folders)
        keys = sorted(self._run(self._walk(folder, partial, writers, walk), f"list {prefix!r}"))
        self.last_listing = walk.stats
        if walk.stats.ignored:
            s = walk.stats
            # entries of writers not asked for are routine (peers not announced yet); caps reached are not
            level = logging.WARNING if s.over_cap or s.malformed or s.folders_ignored else logging.INFO
            log.log(
                level,
                "DHT list %r: ignored %d of %d directory entries (%d of unknown writers, %d over the cap of %d "
                "per directory, %d malformed) and %d folders over the cap of %d per walk",
                prefix,
                s.unlisted + s.over_cap + s.malformed,
                s.entries,
                s.unlisted,
                s.over_cap,
                self.list_bounds.max_entries,
                s.malformed,
                s.folders_ignored,
                self.list_bounds.max_folders,
            )
        return keys

    def delete(self, key: str) -> None:
        self._writer(check_key(key))
        self._run(self._delete(key), f"delete {key!r}")

    def manifest(self, key: str) -> Manifest:
        """The live manifest of ``key`` (size and hashes); ``ObjectNotFound`` if absent or deleted."""
        found = self._live_manifest(key)
        if found is None:
            raise ObjectNotFound(f"{key!r} not found on the DHT")
        return found

    # ------------------------------------------------------------------ coroutines on the loop
    async def _put(self, key: str, manifest: Manifest, pieces: builtins.list[bytes]) -> None:
        expiration = self._next_expiration()

        async def store_piece(index: int) -> None:
            await self._store(self.policy.dht_key(PIECE, piece_name(manifest, index)), pieces[index], expiration)

        # Pieces first, then the manifest, then the index: whoever can see a name can read it.
        await self._bounded(store_piece, range(len(pieces)))
        await self._store(self._obj_key(key), encode_manifest(manifest), expiration)
        owner = self._identity().peer_id
        entries = _ancestry(key)
        dht_keys = [self._dir_key(folder) for folder, _ in entries]
        subkeys = [entry_subkey(owner, name) for _, name in entries]
        markers = [FOLDER if name.endswith("/") else FILE for _, name in entries]
        values = [self._seal(k, sub, expiration, m) for k, sub, m in zip(dht_keys, subkeys, markers)]
        await self._node.store_many(dht_keys, values, expiration, subkeys=subkeys)

    async def _delete(self, key: str) -> None:
        expiration = self._next_expiration()
        folder, name = _ancestry(key)[-1]
        await self._store(self._obj_key(key), encode_manifest(tombstone()), expiration)
        await self._store(
            self._dir_key(folder), DELETED, expiration, subkey=entry_subkey(self._identity().peer_id, name)
        )

    async def _store(self, dht_key: str, content: bytes, expiration: float, *, subkey: str = "") -> None:
        value = self._seal(dht_key, subkey, expiration, content)
        # False means "a replica kept a newer value" or "no reply", so it proves nothing either way:
        # readers verify everything, so it is logged, not raised.
        if not await self._node.store(dht_key, value, expiration, subkey=subkey or None):
            log.debug("DHT store of %s was not acknowledged", dht_key)

    async def _get_manifest(self, key: str) -> Manifest | None:
        dht_key = self._obj_key(key)
        found = await self._node.get(dht_key, latest=True)
        record = None if found is None else self._verified(dht_key, "", found.value, found.expiration_time)
        return None if record is None else decode_manifest(record.content, key=key)

    async def _fetch_pieces(self, key: str, manifest: Manifest, indices: range) -> builtins.list[bytes]:
        """Pieces ``indices`` of ``key``, in order, each checked against its hash in ``manifest``."""

        async def fetch(index: int) -> bytes:
            dht_key = self.policy.dht_key(PIECE, piece_name(manifest, index))
            found = await self._node.get(dht_key)
            record = None if found is None else self._verified(dht_key, "", found.value, found.expiration_time)
            if record is None:
                raise IncompleteObject(
                    f"piece {index}/{manifest.n_pieces} of {key!r} is missing from the DHT (expired or lost)"
                )
            return check_piece(manifest, index, record.content, key=key)

        return await self._bounded(fetch, indices)

    async def _walk(
        self, folder: str, partial: str, writers: Collection[str] | None, walk: _Walk
    ) -> builtins.list[str]:
        dht_key = self._dir_key(folder)
        found = await self._node.get(dht_key, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        bounds = self.list_bounds
        choice = choose(
            entries,
            partial=partial,
            writers=writers,
            trusted=self.policy.validator_ids,
            max_entries=bounds.max_entries,
            rng=walk.rng,
        )
        listing = read_directory(self.policy, dht_key, entries, choice)
        walk.stats.add(listing.stats)
        keys: list[str] = []
        trusted: list[str] = []
        others: list[str] = []
        for name, found_markers in listing.markers.items():  # present while any owner's entry says so
            path = f"{folder}/{name}" if folder else name
            if FOLDER in found_markers:
                (trusted if name in listing.trusted_names else others).append(path[:-1])
            elif FILE in found_markers:
                keys.append(path)
        walk.rng.shuffle(others)
        take = min(len(others), walk.folders_left)
        walk.folders_left -= take
        walk.stats.folders_ignored += len(others) - take
        subfolders = trusted + others[:take]
        for sub in await self._bounded(lambda sub: self._walk(sub, "", writers, walk), subfolders):
            keys.extend(sub)
        return keys

    async def _bounded(self, fn: Callable[[V], Awaitable[T]], items: Iterable[V]) -> builtins.list[T]:
        """``[await fn(x) for x in items]``, at most ``max_concurrency`` at once; an error cancels the rest."""
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(item: V) -> T:
            async with limit:  # the coroutine is created only once it may run
                return await fn(item)

        tasks = [asyncio.ensure_future(one(item)) for item in items]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    # ------------------------------------------------------------------ helpers
    def _live_manifest(self, key: str) -> Manifest | None:
        check_key(key)
        found = self._run(self._get_manifest(key), f"get manifest of {key!r}")
        return None if found is None or found.deleted else found

    def _run(self, coro: Awaitable[T], what: str) -> T:
        loop = self._loop
        if loop is None or self._node is None:
            _close_awaitable(coro)
            raise StoreError(f"DHT {what}: the store is closed")
        try:
            return loop.run(_as_coroutine(coro), self.timeout_s)
        except (ProtocolError, StoreError):
            raise
        except TimeoutError:
            raise StoreError(f"DHT {what} timed out after {self.timeout_s} s") from None
        except Exception as err:
            raise StoreError(f"DHT {what} failed: {err!r}") from err

    def _next_expiration(self) -> float:
        return self._expirations.next(self.expiration_s)

    def _obj_key(self, key: str) -> str:
        return self.policy.dht_key(OBJ, key)

    def _piece_key(self, manifest: Manifest, index: int) -> str:
        return self.policy.dht_key(PIECE, piece_name(manifest, index))

    def _dir_key(self, folder: str) -> str:
        return self.policy.dht_key(DIR, folder)

    def _identity(self) -> Identity:
        if self.identity is None:
            raise AccessDenied("this DHT store has no key to sign records with (read-only)")
        return self.identity

    def _writer(self, key: str) -> None:
        """AccessDenied unless this store's key may write ``key`` (every node would refuse it)."""
        ident = self._identity()
        if not self.policy.may_write(key, ident.public_key):
            raise AccessDenied(f"{ident.peer_id} may not write {key!r} on this run's DHT")

    def _seal(self, dht_key: str, subkey: str, expiration: float, content: bytes) -> bytes:
        return seal_record(self._identity(), key=dht_key, subkey=subkey, expiration=expiration, content=content)

    def _verified(self, dht_key: str, subkey: str, value: object, expiration: float) -> Record | None:
        """The record a node returned for ``dht_key``/``subkey``, if it verifies; None (absent) if not."""
        try:
            record = open_record(value)
            if not record.matches(key=dht_key, subkey=subkey, expiration=expiration):
                raise MalformedPayload(f"record signed for {record.key!r}/{record.subkey!r} found elsewhere")
            self.policy.check(record)
        except ProtocolError as exc:
            log.warning("ignoring DHT record of %s that does not verify: %s", dht_key, exc)
            return None
        return record


class _Expirations:
    """Strictly increasing expiration times: the DHT rejects a record whose expiration is not
    later than the one it holds, so a delete right after a put must carry a later time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0.0

    def next(self, lifetime_s: float) -> float:
        from hivemind.utils.timed_storage import get_dht_time

        with self._lock:
            self._last = max(get_dht_time() + lifetime_s, self._last + 1e-3)
            return self._last


class _Walk:
    """The state one ``list`` shares across the directory records it reads."""

    def __init__(self, max_folders: int) -> None:
        self.folders_left = max_folders
        self.stats = ListStats()
        self.rng = random.Random()  # which untrusted entries a capped listing takes: not predictable


def _ancestry(key: str) -> list[tuple[str, str]]:
    """(folder, entry) pairs from the root down: "a/b/c" -> [("", "a/"), ("a", "b/"), ("a/b", "c")]."""
    parts = key.split("/")
    entries = [("/".join(parts[:i]), parts[i] + "/") for i in range(len(parts) - 1)]
    return [*entries, ("/".join(parts[:-1]), parts[-1])]


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _close_awaitable(awaitable: Awaitable[Any]) -> None:
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()


@atexit.register
def _close_all() -> None:
    """No p2pd outlives the interpreter: close every store still open at exit."""
    for store in list(_LIVE):
        store.close()
