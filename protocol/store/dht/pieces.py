"""Splitting values into DHT-sized pieces and putting them back together, with hash checks.

A DHT record must stay well under hivemind's 4 MiB message cap, so a value is stored as pieces
plus a small manifest that names them::

    manifest, pieces = split(data, piece_size=1 << 20)
    raw = encode_manifest(manifest)                  # goes under the object's key
    ...
    manifest = decode_manifest(raw, key=key)         # strict, size-capped
    check_piece(manifest, i, piece, key=key)         # DigestMismatch names the bad piece
    data = assemble(manifest, pieces, key=key)       # checks the whole-value sha256 as well

Pieces are content-addressed (``piece_name(manifest, i)`` derives from the whole-value hash and the
piece index), so an overwrite never mixes pieces of two versions and identical values share pieces.
A deleted object is a *tombstone* manifest (``deleted=True``, no pieces).

The manifest is a small JSON object parsed strictly: exact keys, exact types, consistent counts,
lowercase hex hashes, a hard size cap. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TypeGuard

from protocol.errors import DigestMismatch, MalformedPayload, UnsupportedVersion

MANIFEST_VERSION = 1
#: hivemind caps one RPC message at 4 MiB; pieces stay far below it (one piece per RPC).
MAX_PIECE_SIZE = 3 << 20
DEFAULT_PIECE_SIZE = 1 << 20
#: Enough for a 16 GiB value in 1 MiB pieces; rejects absurd manifests before parsing them.
MAX_MANIFEST_BYTES = 1 << 20

_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"v", "size", "piece_size", "sha256", "pieces", "deleted"}


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
    """Content address of one piece: the same bytes always land under the same name."""
    return f"{manifest.sha256}/{manifest.piece_size}/{index}"


def encode_manifest(manifest: Manifest) -> bytes:
    body = {
        "v": MANIFEST_VERSION,
        "size": manifest.size,
        "piece_size": manifest.piece_size,
        "sha256": manifest.sha256,
        "pieces": list(manifest.piece_hashes),
        "deleted": manifest.deleted,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def decode_manifest(raw: object, *, key: str) -> Manifest:
    """Parse a manifest record found under ``key``; anything off raises ``MalformedPayload``."""
    if not isinstance(raw, bytes):
        raise MalformedPayload(f"DHT manifest of {key!r} is a {type(raw).__name__}, expected bytes")
    if len(raw) > MAX_MANIFEST_BYTES:
        raise MalformedPayload(f"DHT manifest of {key!r} is {len(raw)} bytes (cap {MAX_MANIFEST_BYTES})")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise MalformedPayload(f"DHT manifest of {key!r} is not JSON: {err}") from None
    if not isinstance(body, dict) or set(body) != _FIELDS:
        raise MalformedPayload(f"DHT manifest of {key!r} has wrong fields")
    if body["v"] != MANIFEST_VERSION:
        raise UnsupportedVersion(f"DHT manifest of {key!r} has version {body['v']!r}")
    return _validated(body, key)


def _validated(body: dict[str, object], key: str) -> Manifest:
    size, piece_size, sha, hashes, deleted = (
        body["size"],
        body["piece_size"],
        body["sha256"],
        body["pieces"],
        body["deleted"],
    )
    if not _is_int(size) or not _is_int(piece_size) or not isinstance(deleted, bool):
        raise MalformedPayload(f"DHT manifest of {key!r} has non-integer sizes or flags")
    if size < 0 or not 1 <= piece_size <= MAX_PIECE_SIZE:
        raise MalformedPayload(f"DHT manifest of {key!r} has size {size} / piece_size {piece_size}")
    if not isinstance(sha, str) or not isinstance(hashes, list):
        raise MalformedPayload(f"DHT manifest of {key!r} has malformed hashes")
    if not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in [sha, *hashes]):
        raise MalformedPayload(f"DHT manifest of {key!r} has hashes that are not sha256 hex")
    expected = -(-size // piece_size)
    if len(hashes) != expected or (deleted and size != 0):
        raise MalformedPayload(
            f"DHT manifest of {key!r} lists {len(hashes)} pieces for {size} bytes in pieces of {piece_size}"
        )
    return Manifest(size=size, piece_size=piece_size, sha256=sha, piece_hashes=tuple(hashes), deleted=deleted)


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


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
