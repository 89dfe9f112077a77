"""Signed DHT records: every value a node stores carries its writer's Ed25519 key and signature.

A DHT has no accounts, so a record proves who wrote it by itself. The bytes a node stores under a
DHT key are one record: the plain DHT key and subkey it was written for, its expiration time, the
writer's public key, the content (a manifest, a piece, a directory marker) and a signature over
all of it::

    raw = seal_record(identity, key="sparseloco:obj:run/peers/abc", subkey="", expiration=t, content=b"...")
    rec = open_record(raw)                     # structure and signature, or a ProtocolError
    rec.matches(key=..., subkey=..., expiration=t)   # bound to where it was found?
    rec.public_key, rec.content

Binding the key, the subkey and the expiration into the signature means a record cannot be
replayed under another key, as another directory entry, or with a later expiration than its
writer gave it (hivemind keeps the value with the latest expiration). Who may write what is
:mod:`protocol.store.dht.policy`; this module is only the bytes.

Layout (integers little-endian)::

    offset  size  field
    0       4     magic b"SLdr"
    4       1     version (RECORD_VERSION)
    5       8     expiration (f64, finite)
    13      32    writer's Ed25519 public key
    45      2     key length K (1..MAX_KEY_BYTES), then K bytes of UTF-8
    ..      1     subkey length S (0..255), then S bytes of UTF-8 ("" for a plain value)
    ..      4     content length C (0..MAX_CONTENT_BYTES), then C bytes
    end-64  64    Ed25519 signature over sha256(every byte before the content ‖ sha256(content))

Parsing is strict and allocates nothing proportional to the claimed lengths before checking them
against the bytes present.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from protocol.errors import MalformedPayload, UnsupportedVersion
from protocol.identity import SIGNATURE_BYTES, Identity, verify

MAGIC = b"SLdr"
RECORD_VERSION = 1
MAX_KEY_BYTES = 2048
MAX_SUBKEY_BYTES = 255
#: A piece (at most 3 MiB, see :mod:`protocol.store.dht.pieces`) plus room; hivemind caps an RPC at 4 MiB.
MAX_CONTENT_BYTES = (3 << 20) + 4096

_HEAD = struct.Struct("<4sBd32sH")  # magic, version, expiration, public key, key length
_SUBKEY_LEN = struct.Struct("<B")
_CONTENT_LEN = struct.Struct("<I")
MIN_RECORD_BYTES = _HEAD.size + 1 + _SUBKEY_LEN.size + _CONTENT_LEN.size + SIGNATURE_BYTES


@dataclass(frozen=True)
class Record:
    """A record whose signature verified: what it claims, and the key that signed it."""

    key: str
    subkey: str
    expiration: float
    public_key: bytes
    content: bytes
    content_sha256: bytes

    def matches(self, *, key: str, subkey: str, expiration: float | None = None) -> bool:
        """True when the record was written for ``key``/``subkey`` (and ``expiration``, if given)."""
        return self.key == key and self.subkey == subkey and (expiration is None or self.expiration == expiration)


def seal_record(identity: Identity, *, key: str, subkey: str, expiration: float, content: bytes) -> bytes:
    """The signed bytes of one record (see the module doc); ``ValueError`` for out-of-range fields."""
    key_raw, subkey_raw = key.encode("utf-8"), subkey.encode("utf-8")
    if not 1 <= len(key_raw) <= MAX_KEY_BYTES or len(subkey_raw) > MAX_SUBKEY_BYTES:
        raise ValueError(f"DHT record key or subkey too long: {key!r} / {subkey!r}")
    if len(content) > MAX_CONTENT_BYTES or not math.isfinite(expiration):
        raise ValueError(f"DHT record of {len(content)} bytes or expiration {expiration} out of range")
    head = b"".join(
        (
            _HEAD.pack(MAGIC, RECORD_VERSION, expiration, identity.public_key, len(key_raw)),
            key_raw,
            _SUBKEY_LEN.pack(len(subkey_raw)),
            subkey_raw,
            _CONTENT_LEN.pack(len(content)),
        )
    )
    signature = identity.sign(_signed_digest(head, hashlib.sha256(content).digest()))
    return b"".join((head, content, signature))


def open_record(raw: object) -> Record:
    """Parse ``raw`` and verify its signature; ``MalformedPayload`` / ``UnsupportedVersion`` /
    ``BadSignature`` otherwise. Says nothing about whether the signer may write the record."""
    if not isinstance(raw, bytes):
        raise MalformedPayload(f"DHT record is a {type(raw).__name__}, expected bytes")
    if not MIN_RECORD_BYTES <= len(raw) <= MIN_RECORD_BYTES + MAX_KEY_BYTES + MAX_SUBKEY_BYTES + MAX_CONTENT_BYTES:
        raise MalformedPayload(f"DHT record of {len(raw)} bytes is outside the record size range")
    magic, version, expiration, public_key, key_len = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise UnsupportedVersion("not a sparseloco DHT record (bad magic)")
    if version != RECORD_VERSION:
        raise UnsupportedVersion(f"DHT record version {version} is not supported (this client: {RECORD_VERSION})")
    if not math.isfinite(expiration):
        raise MalformedPayload("DHT record with a non-finite expiration")
    pos = _HEAD.size
    key = _text(raw, pos, key_len, "key")
    pos += key_len
    _need(raw, pos, _SUBKEY_LEN.size)
    (subkey_len,) = _SUBKEY_LEN.unpack_from(raw, pos)
    pos += _SUBKEY_LEN.size
    subkey = _text(raw, pos, subkey_len, "subkey")
    pos += subkey_len
    _need(raw, pos, _CONTENT_LEN.size)
    (content_len,) = _CONTENT_LEN.unpack_from(raw, pos)
    pos += _CONTENT_LEN.size
    if key_len == 0 or content_len > MAX_CONTENT_BYTES or pos + content_len + SIGNATURE_BYTES != len(raw):
        raise MalformedPayload("DHT record lengths do not add up to its size")
    view = memoryview(raw)
    content_sha256 = hashlib.sha256(view[pos : pos + content_len]).digest()
    verify(public_key, bytes(view[len(raw) - SIGNATURE_BYTES :]), _signed_digest(view[:pos], content_sha256))
    return Record(key, subkey, expiration, bytes(public_key), raw[pos : pos + content_len], content_sha256)


def _signed_digest(head: bytes | memoryview, content_sha256: bytes) -> bytes:
    return hashlib.sha256(b"".join((bytes(head), content_sha256))).digest()


def _need(raw: bytes, pos: int, n: int) -> None:
    if pos + n > len(raw):
        raise MalformedPayload("DHT record is truncated")


def _text(raw: bytes, pos: int, n: int, what: str) -> str:
    _need(raw, pos, n)
    try:
        return raw[pos : pos + n].decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedPayload(f"DHT record {what} is not UTF-8") from None
