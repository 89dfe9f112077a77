"""Splitting values into DHT-sized pieces and putting them back together, with hash checks.

A DHT record must stay well under hivemind's 4 MiB message cap, so a value is stored as pieces
plus a small manifest that names them::

    manifest, pieces = split(data, piece_size=1 << 20)
    raw = encode_manifest(manifest)                  # goes under the object's key
    ...
    manifest = decode_manifest(raw, key=key)         # strict, size-capped
    check_piece(manifest, i, piece, key=key)         # DigestMismatch names the bad piece
    data = assemble(manifest, pieces, key=key)       # checks the whole-value sha256 as well

Pieces are content-addressed (``piece_name(manifest, i)`` is the sha256 of piece ``i``), so an
overwrite never mixes pieces of two versions, identical pieces share one record, and every node can
refuse a piece whose bytes do not hash to its name. A deleted object is a *tombstone* manifest
(``deleted=True``, no pieces).

The manifest has one fixed binary layout (no nesting, so nothing to recurse into), parsed strictly
and with a hard size cap; decoding allocates a small multiple of its input. Integers little-endian::

    offset  size  field
    0       1     version (MANIFEST_VERSION)
    1       1     flags: 1 = deleted (tombstone), every other bit zero
    2       8     size of the value in bytes
    10      4     piece size (1..MAX_PIECE_SIZE)
    14      32    sha256 of the whole value
    46      32·n  sha256 of each piece, n = ceil(size / piece size)

Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from protocol.errors import DigestMismatch, MalformedPayload, UnsupportedVersion

MANIFEST_VERSION = 2
#: hivemind caps one RPC message at 4 MiB; pieces stay far below it (one piece per RPC).
MAX_PIECE_SIZE = 3 << 20
DEFAULT_PIECE_SIZE = 1 << 20
#: Enough for a 16 GiB value in 1 MiB pieces; rejects absurd manifests before parsing them.
MAX_MANIFEST_BYTES = 1 << 20

_HEAD = struct.Struct("<BBQI32s")
_DELETED = 1


@dataclass(frozen=True)
class Manifest:
    """What a reader needs to fetch and verify a value: its size, how it was cut, and every hash."""

    size: int
    piece_size: int
    sha256: str
    piece_hashes: tuple[str, ...]
    deleted: bool = False

    @property
    def n_pieces(self) -> int:
        return len(self.piece_hashes)

    def piece_length(self, index: int) -> int:
        """Exact byte length of piece ``index`` (the last one may be short)."""
        return min(self.piece_size, self.size - index * self.piece_size)


def tombstone() -> Manifest:
    """The manifest that marks a deleted key (no pieces, no content)."""
    return Manifest(size=0, piece_size=1, sha256=hashlib.sha256(b"").hexdigest(), piece_hashes=(), deleted=True)


def split(data: bytes, piece_size: int = DEFAULT_PIECE_SIZE) -> tuple[Manifest, list[bytes]]:
    """Cut ``data`` into pieces of ``piece_size`` bytes (the last one shorter) and describe them."""
    if not 1 <= piece_size <= MAX_PIECE_SIZE:
        raise ValueError(f"piece_size must be in [1, {MAX_PIECE_SIZE}], got {piece_size}")
    view = memoryview(data)
    pieces = [bytes(view[i : i + piece_size]) for i in range(0, len(data), piece_size)]
    manifest = Manifest(
        size=len(data),
        piece_size=piece_size,
        sha256=hashlib.sha256(data).hexdigest(),
        piece_hashes=tuple(hashlib.sha256(p).hexdigest() for p in pieces),
    )
    return manifest, pieces


def piece_name(manifest: Manifest, index: int) -> str:
    """Content address of piece ``index``: its sha256 (hex), so the same bytes land under one name."""
    return manifest.piece_hashes[index]


def encode_manifest(manifest: Manifest) -> bytes:
    head = _HEAD.pack(
        MANIFEST_VERSION,
        _DELETED if manifest.deleted else 0,
        manifest.size,
        manifest.piece_size,
        bytes.fromhex(manifest.sha256),
    )
    return head + b"".join(bytes.fromhex(h) for h in manifest.piece_hashes)


def decode_manifest(raw: object, *, key: str) -> Manifest:
    """Parse a manifest record found under ``key``; anything off raises ``MalformedPayload``
    (``UnsupportedVersion`` for another version)."""
    if not isinstance(raw, bytes):
        raise MalformedPayload(f"DHT manifest of {key!r} is a {type(raw).__name__}, expected bytes")
    if len(raw) > MAX_MANIFEST_BYTES:
        raise MalformedPayload(f"DHT manifest of {key!r} is {len(raw)} bytes (cap {MAX_MANIFEST_BYTES})")
    if len(raw) < _HEAD.size or (len(raw) - _HEAD.size) % 32:
        raise MalformedPayload(f"DHT manifest of {key!r} has {len(raw)} bytes: not a manifest")
    version, flags, size, piece_size, sha = _HEAD.unpack_from(raw, 0)
    if version != MANIFEST_VERSION:
        raise UnsupportedVersion(f"DHT manifest of {key!r} has version {version}")
    if flags & ~_DELETED:
        raise MalformedPayload(f"DHT manifest of {key!r} has unknown flags {flags:#x}")
    deleted = bool(flags & _DELETED)
    if not 1 <= piece_size <= MAX_PIECE_SIZE or (deleted and size != 0):
        raise MalformedPayload(f"DHT manifest of {key!r} has size {size} / piece_size {piece_size}")
    n = (len(raw) - _HEAD.size) // 32
    if n != -(-size // piece_size):
        raise MalformedPayload(f"DHT manifest of {key!r} lists {n} pieces for {size} bytes in pieces of {piece_size}")
    hashes = tuple(raw[i : i + 32].hex() for i in range(_HEAD.size, len(raw), 32))
    return Manifest(size=size, piece_size=piece_size, sha256=sha.hex(), piece_hashes=hashes, deleted=deleted)


def check_piece(manifest: Manifest, index: int, piece: object, *, key: str) -> bytes:
    """Return ``piece`` if it has the length and sha256 the manifest promises for ``index``."""
    where = f"piece {index}/{manifest.n_pieces} of {key!r}"
    if not isinstance(piece, bytes):
        raise MalformedPayload(f"{where} is a {type(piece).__name__}, expected bytes")
    if len(piece) != manifest.piece_length(index):
        raise DigestMismatch(f"{where} has {len(piece)} bytes, manifest says {manifest.piece_length(index)}")
    if hashlib.sha256(piece).hexdigest() != manifest.piece_hashes[index]:
        raise DigestMismatch(f"{where} does not match its sha256 in the manifest")
    return piece


def assemble(manifest: Manifest, pieces: list[bytes], *, key: str) -> bytes:
    """Join checked pieces and verify the whole value against the manifest's sha256."""
    for index, piece in enumerate(pieces):
        check_piece(manifest, index, piece, key=key)
    if len(pieces) != manifest.n_pieces:
        raise MalformedPayload(f"{key!r}: got {len(pieces)} pieces, manifest lists {manifest.n_pieces}")
    data = b"".join(pieces)
    # Every piece matched, so this only fails if the manifest itself is inconsistent (forged).
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise DigestMismatch(f"{key!r}: reassembled value does not match the manifest's sha256")
    return data
