"""Who may write which DHT record of a run: the write permissions a DHT does not have by itself.

Every node of a run applies the same :class:`WritePolicy` to every record it is asked to store or
is handed by another node (:mod:`protocol.store.dht.auth`), and every reader applies it again to
what it gets back, so a record written against the rules is refused everywhere::

    policy = WritePolicy("sparseloco", validator_keys=spec.validator.public_keys)
    policy.check(open_record(raw))      # UnknownSigner / MalformedPayload / DigestMismatch, or fine

The rules, by DHT key (``<ns>`` is the store's namespace, ``<key>`` an object key of
:mod:`protocol.layout`):

``<ns>:obj:<key>`` (an object's manifest)
    ``<run>/contrib/<window>/<peer_id>`` and ``<run>/peers/<peer_id>``: only the key whose peer id
    is ``<peer_id>``; ``<run>/proposal|endorsement/<window>/<id>`` and
    ``<run>/objection/<window>/<id>/<proposer>``: only the validator key whose id is ``<id>`` (one
    validator can neither forge nor overwrite another's signature); every other key (``aggregate/``, ``checkpoint/``, ``data/``, genesis, and
    anything the layout does not name): only a validator key of the run. The content must be a
    well-formed manifest.
``<ns>:piece:<sha256>``
    anyone with a valid signature, but the content must hash to the name (content-addressed).
``<ns>:dir:<folder>`` with subkey ``<peer_id>/<entry>`` (one directory entry)
    owned by ``<peer_id>``: only its key may write (or tombstone) it, so nobody can forge, hide or
    delete another writer's entry. A file entry is allowed when its writer may write the object
    it names; a folder entry (``<entry>/``) when its writer may write some object below it.

A signature proves who wrote a record, never that the writer was allowed to: both are checked.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from protocol import layout
from protocol.errors import DigestMismatch, InvalidKey, MalformedPayload, UnknownSigner
from protocol.identity import peer_id_of, public_key_from_hex
from protocol.store.base import check_key
from protocol.store.dht.pieces import decode_manifest
from protocol.store.dht.records import Record

OBJ, PIECE, DIR = "obj", "piece", "dir"
#: Directory entry markers: a file, a folder, a deleted file.
FILE, FOLDER, DELETED = b"f", b"d", b"-"
# Object kinds a peer writes under its own peer id: <run>/contrib/<window>/<peer_id>, <run>/peers/<peer_id>.
_OWNED_KINDS = ("contrib", "peers")


@dataclass(frozen=True)
class DirEntry:
    """One verified directory entry: ``name`` in ``folder`` (a trailing ``/`` for a sub-folder)."""

    folder: str
    name: str
    marker: bytes
    owner: str  # the peer id whose key wrote it


def entry_subkey(owner: str, name: str) -> str:
    """The subkey of ``owner``'s entry ``name`` in a directory record."""
    return f"{owner}/{name}"


class WritePolicy:
    """The write rules of one run's DHT namespace (module doc). Hashable, comparable."""

    def __init__(self, namespace: str, validator_keys: Collection[bytes | str] = ()) -> None:
        self.namespace = namespace
        self.validator_keys = frozenset(k if isinstance(k, bytes) else public_key_from_hex(k) for k in validator_keys)
        self.validator_ids = frozenset(peer_id_of(k) for k in self.validator_keys)  # writers always listed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WritePolicy) and (self.namespace, self.validator_keys) == (
            other.namespace,
            other.validator_keys,
        )

    def __hash__(self) -> int:
        return hash((self.namespace, self.validator_keys))

    # ------------------------------------------------------------------ DHT keys
    def dht_key(self, kind: str, name: str) -> str:
        return f"{self.namespace}:{kind}:{name}"

    def split_key(self, dht_key: str) -> tuple[str, str]:
        """(kind, name) of a DHT key of this namespace; ``MalformedPayload`` for anything else."""
        ns, _, rest = dht_key.partition(":")
        kind, _, name = rest.partition(":")
        if ns != self.namespace or kind not in (OBJ, PIECE, DIR):
            raise MalformedPayload(f"DHT key {dht_key!r} is not a record of namespace {self.namespace!r}")
        return kind, name

    # ------------------------------------------------------------------ the rules
    def check(self, record: Record) -> None:
        """Raise unless ``record`` (signature already verified) may exist where it claims to be."""
        kind, name = self.split_key(record.key)
        if kind == DIR:
            self.check_entry(record)
            return
        if record.subkey:
            raise MalformedPayload(f"{record.key!r} is a plain value, not a directory entry")
        if kind == PIECE:
            if record.content_sha256.hex() != name:
                raise DigestMismatch(f"DHT piece {name[:16]}… does not hash to its name")
            return
        _valid_key(name)
        decode_manifest(record.content, key=name)
        if not self.may_write(name, record.public_key):
            raise UnknownSigner(f"{peer_id_of(record.public_key)} may not write {name!r}")

    def check_entry(self, record: Record) -> DirEntry:
        """The directory entry ``record`` holds, if its writer owns it and may list that name."""
        _, folder = self.split_key(record.key)
        owner, sep, name = record.subkey.partition("/")
        if not sep or owner != peer_id_of(record.public_key):
            raise UnknownSigner(f"directory entry {record.subkey!r} is not owned by its signer")
        if record.content not in (FILE, FOLDER, DELETED) or (record.content == FOLDER) != name.endswith("/"):
            raise MalformedPayload(f"directory entry {record.subkey!r} has marker {record.content!r}")
        stem = name[:-1] if name.endswith("/") else name
        if "/" in stem:
            raise MalformedPayload(f"directory entry {name!r} is not one key segment")
        path = _valid_key(f"{folder}/{stem}" if folder else stem)
        folder_entry = name.endswith("/")
        allowed = (self.may_write_below if folder_entry else self.may_write)(path, record.public_key)
        if not allowed:
            raise UnknownSigner(f"{owner} may not list {name!r} in {folder!r}")
        return DirEntry(folder, name, record.content, owner)

    def may_write(self, key: str, public_key: bytes) -> bool:
        """Whether ``public_key`` may write the object ``key`` (module doc)."""
        owner = owner_of(key)
        if owner is not None:
            return owner == peer_id_of(public_key)
        if public_key not in self.validator_keys:
            return False
        signer = validator_owner_of(key)
        return signer is None or signer == peer_id_of(public_key)

    def may_write_below(self, folder: str, public_key: bytes) -> bool:
        """Whether ``public_key`` may write some object below ``folder``: everyone may on the way to
        a peer's own keys (``<run>``, ``<run>/contrib``, ``<run>/contrib/<window>``, ``<run>/peers``);
        below any other folder only a validator key may."""
        return _owned_prefix(folder.split("/")) or public_key in self.validator_keys


def owner_of(key: str) -> str | None:
    """The peer id that alone may write ``key``, ``""`` when nobody may (a malformed peer key),
    None for a key of the validators."""
    parts = key.split("/")
    if len(parts) < 2 or parts[1] not in _OWNED_KINDS:
        return None
    try:
        parsed = layout.parse_key(key)
    except MalformedPayload:
        return ""
    return parsed.peer_id or ""


def validator_owner_of(key: str) -> str | None:
    """The validator id that alone may write ``key`` (a proposal, endorsement or objection of a
    run with several validators: its own), ``""`` when nobody may (malformed), None for a key any
    validator of the run may write."""
    parts = key.split("/")
    if len(parts) < 2 or parts[1] not in layout.VALIDATOR_KINDS:
        return None
    try:
        return layout.parse_key(key).peer_id or ""
    except MalformedPayload:
        return ""


def _owned_prefix(parts: list[str]) -> bool:
    """Whether ``parts`` is a folder above peers' own keys (:meth:`WritePolicy.may_write_below`)."""
    if len(parts) == 1:
        return True
    if parts[1] not in _OWNED_KINDS or len(parts) > 3:
        return False
    if len(parts) == 2:
        return True
    if parts[1] == "peers":
        return False
    try:
        layout.parse_window(parts[2])
    except MalformedPayload:
        return False
    return True


def _valid_key(key: str) -> str:
    try:
        return check_key(key)
    except InvalidKey as exc:
        raise MalformedPayload(f"DHT record for an invalid key: {exc}") from None
