"""The generic signed container every object on the wire travels in.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic  b"SLoC"
    4       1     format version of the kind (KIND_VERSIONS)
    5       1     kind (Kind)
    6       32    RunSpec hash (raw sha256)
    38      8     window (u64)
    46      32    sender's Ed25519 public key
    78      4     body length    (u32)  kind-specific header: codec params, tensor table, metadata
    82      8     payload length (u64)  tensor bytes
    90      ...   body, then payload
    end-64  64    Ed25519 signature over sha256(every byte before it)

:func:`open_envelope` checks, in this order and before allocating anything: the size cap, magic,
version and kind, that the declared lengths add up to exactly the bytes present, then the
signature. Only then are body and payload handed out (as zero-copy memoryviews) to the per-kind
parsers in :mod:`protocol.wire`, which read them with :class:`protocol.wire.fields.Reader`.

The object's ``digest`` is the sha256 of all its bytes, signature included: what ``sha256sum``
prints for the stored file, and the name other objects use for it (``base``, manifests). Decoders
hand it out with the signer's key and the size in :class:`protocol.wire.verified.Verified`.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

from protocol.errors import MalformedPayload, PayloadTooLarge, UnsupportedVersion, WrongRun
from protocol.identity import SIGNATURE_BYTES, Identity, verify
from protocol.wire.fields import digest_to_bytes

MAGIC = b"SLoC"
FORMAT_VERSION = 1  # the frame itself and every kind whose bytes never changed
_FIXED = struct.Struct("<4sBB32sQ32sIQ")
FIXED_HEADER_BYTES = _FIXED.size  # 90
ENVELOPE_OVERHEAD = FIXED_HEADER_BYTES + SIGNATURE_BYTES  # bytes every object pays besides body+payload


class Kind(enum.IntEnum):
    CONTRIBUTION = 1
    AGGREGATE = 2
    CHECKPOINT = 3
    ANNOUNCEMENT = 4
    DATASET = 5
    PROPOSAL = 6
    ENDORSEMENT = 7
    OBJECTION = 8
    CERTIFICATE = 9

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def version(self) -> int:
        """The format version objects of this kind are written in (byte 4 of the frame)."""
        return KIND_VERSIONS.get(self, FORMAT_VERSION)


# Kinds whose body or payload changed since FORMAT_VERSION. Aggregate 2: coded index sets and
# bfloat16 values, or codec payloads of a re-compressed Δ̄ (protocol.wire.aggregate).
KIND_VERSIONS: dict[Kind, int] = {Kind.AGGREGATE: 2}


@dataclass(frozen=True)
class Envelope:
    """A verified container: the signature checked, body and payload not yet interpreted."""

    kind: Kind
    run_hash: str
    window: int
    public_key: bytes
    body: memoryview
    payload: memoryview
    digest: str
    size: int


def seal(kind: Kind, run_hash: str, window: int, identity: Identity, body: bytes, payload: bytes) -> bytes:
    """Assemble header + body + payload and sign it with ``identity``."""
    run_raw = digest_to_bytes(run_hash, what="run hash")
    if not 0 <= window < 2**63:
        raise MalformedPayload(f"cannot encode window {window}")
    header = _FIXED.pack(MAGIC, kind.version, int(kind), run_raw, window, identity.public_key, len(body), len(payload))
    unsigned = b"".join((header, body, payload))
    return unsigned + identity.sign(hashlib.sha256(unsigned).digest())


def peek_kind(data: bytes | memoryview) -> Kind:
    """The kind an object claims to be (no verification); UnsupportedVersion when unknown."""
    if len(data) < 6 or bytes(data[:4]) != MAGIC:
        raise UnsupportedVersion("not a sparseloco object (bad magic)")
    try:
        kind = Kind(data[5])
    except ValueError:
        raise UnsupportedVersion(f"unknown object kind {data[5]}") from None
    if data[4] != kind.version:
        raise UnsupportedVersion(
            f"{kind.label} format version {data[4]} is not supported (this client: {kind.version})"
        )
    return kind


def open_envelope(data: bytes, *, max_bytes: int, run_hash: str | None, kind: Kind | None = None) -> Envelope:
    """Check size, structure and signature of ``data``; return the verified :class:`Envelope`.

    ``run_hash=None`` skips the run check (``sparseloco inspect``); ``kind`` restricts the kind.
    """
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"object is {len(data)} bytes, limit {max_bytes}")
    found = peek_kind(data)
    if kind is not None and found != kind:
        raise UnsupportedVersion(f"expected kind {kind.label}, found {found.label}")
    if len(data) < ENVELOPE_OVERHEAD:
        raise MalformedPayload(f"object of {len(data)} bytes is shorter than the fixed header")
    _, _, _, run_raw, window, pub, body_len, payload_len = _FIXED.unpack_from(data, 0)
    declared = ENVELOPE_OVERHEAD + body_len + payload_len
    if declared != len(data):
        raise MalformedPayload(f"declared lengths add up to {declared} bytes, object has {len(data)}")
    if window >= 2**63:
        raise MalformedPayload(f"window {window} out of range")
    view = memoryview(data)
    signed = view[: len(data) - SIGNATURE_BYTES]
    verify(pub, bytes(view[len(data) - SIGNATURE_BYTES :]), hashlib.sha256(signed).digest())
    if run_hash is not None and run_raw != digest_to_bytes(run_hash, what="run hash"):
        raise WrongRun(f"object belongs to run {run_raw.hex()[:16]}…, expected {run_hash[:16]}…")
    body_start = FIXED_HEADER_BYTES
    return Envelope(
        kind=found,
        run_hash=run_raw.hex(),
        window=window,
        public_key=bytes(pub),
        body=view[body_start : body_start + body_len],
        payload=view[body_start + body_len : body_start + body_len + payload_len],
        digest=hashlib.sha256(view).hexdigest(),
        size=len(data),
    )
