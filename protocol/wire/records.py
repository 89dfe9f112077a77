"""Small signed records without tensors: checkpoint manifests and peer announcements.

Also the parts every decoded object shares (:class:`Signed`: ``digest``, ``sender``,
``public_key``, ``size``) and the signer/window checks. :mod:`protocol.wire` re-exports all of it.

    blob = encode_checkpoint(CheckpointManifest(run_hash, 10, agg_digest, fp, files, {"published_at": t}), validator)
    m = decode_checkpoint(blob, run_hash=run_hash, max_bytes=1 << 20, allowed_signers=keys)
    published_at_of(m.metadata)                  # when window 10 opened (None if not recorded)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from protocol.wire.frame import Envelope, Kind, open_envelope, seal
from protocol.errors import BadSignature, MalformedPayload, UnknownSigner, WrongWindow
from protocol.identity import Identity, peer_id_of, public_key_from_hex
from protocol.layout import parse_key
from protocol.wire.fields import Metadata, Reader, Writer, digest_to_bytes, read_base, read_metadata, write_base
from protocol.wire.fields import write_metadata


class Signed:
    """What every decoded object knows about its bytes (empty before encoding)."""

    public_key: bytes
    digest: str
    size: int

    @property
    def sender(self) -> str:
        """Peer id of the signer."""
        return peer_id_of(self.public_key)


@dataclass(frozen=True)
class CheckpointFile:
    """One file of a checkpoint: its full object key, sha256 hex and size in bytes."""

    key: str
    sha256: str
    size: int


@dataclass(frozen=True)
class CheckpointManifest(Signed):
    """Validator-signed list of the files that hold θ after ``window`` (and their hashes)."""

    run_hash: str
    window: int
    aggregate: str  # digest of the aggregate whose result the checkpoint holds (or GENESIS)
    fingerprint: str
    files: tuple[CheckpointFile, ...]  # keys are full object keys: layout.checkpoint_key(...)
    metadata: Metadata = field(default_factory=dict)  # e.g. published_at: when window ``window`` opened
    public_key: bytes = b""
    digest: str = ""
    size: int = 0


@dataclass(frozen=True)
class PipelineRole:
    """Where a peer sits in a pipeline replica: group name, its stage, number of stages."""

    group: str
    stage: int
    stages: int


@dataclass(frozen=True)
class Announcement(Signed):
    """A peer's signed self-description under ``<run>/peers/<peer_id>``; ``window``: when announced."""

    run_hash: str
    window: int
    client_version: str
    hardware: str
    role: PipelineRole | None = None
    metadata: Metadata = field(default_factory=dict)
    public_key: bytes = b""
    digest: str = ""
    size: int = 0


FILLED = ("public_key", "digest", "size")
PUBLISHED_AT = "published_at"


def published_at_of(metadata: Metadata) -> float | None:
    """The validator's signed ``published_at`` (unix seconds) in an aggregate's or a checkpoint
    manifest's metadata: when the window after the aggregate (the checkpoint's window) opened."""
    value = metadata.get(PUBLISHED_AT)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fill_signature(obj: object, env: Envelope) -> None:
    """Record on a freshly decoded (frozen) object what its envelope proved."""
    for name, value in zip(FILLED, (env.public_key, env.digest, env.size)):
        object.__setattr__(obj, name, value)


def check_window_sender(env: Envelope, window: int | None, sender: str | None) -> None:
    if window is not None and env.window != window:
        raise WrongWindow(f"object is for window {env.window}, expected {window}")
    if sender is not None and peer_id_of(env.public_key) != sender:
        raise BadSignature(f"signed by {peer_id_of(env.public_key)}, expected {sender}")


def check_signer(env: Envelope, allowed: Collection[bytes | str] | None) -> None:
    if allowed is None:
        return
    keys = {k if isinstance(k, bytes) else public_key_from_hex(k) for k in allowed}
    if env.public_key not in keys:
        raise UnknownSigner(f"signer {peer_id_of(env.public_key)} is not an allowed validator key")


# ---------------------------------------------------------------------------- checkpoint
def encode_checkpoint(m: CheckpointManifest, identity: Identity) -> bytes:
    """Sign and serialize a checkpoint manifest (file keys: ``layout.checkpoint_key(run, window, name)``)."""
    w = Writer()
    write_base(w, m.aggregate)
    w.text(m.fingerprint, 128)
    write_metadata(w, m.metadata)
    w.varint(len(m.files))
    for f in m.files:
        w.text(f.key, 1024)
        w.raw(digest_to_bytes(f.sha256, what="file sha256"))
        w.varint(f.size)
    return seal(Kind.CHECKPOINT, m.run_hash, m.window, identity, w.getvalue(), b"")


def decode_checkpoint(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    allowed_signers: Collection[bytes | str] | None,
    window: int | None = None,
) -> CheckpointManifest:
    """Verify and parse a checkpoint manifest (signer checked like an aggregate's)."""
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.CHECKPOINT)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, None)
    r = Reader(env.body, "checkpoint manifest")
    agg = read_base(r)
    fingerprint = r.text(128)
    metadata = read_metadata(r)
    files = tuple(
        CheckpointFile(r.text(1024), r.digest(), r.varint()) for _ in range(r.count(34, 1 << 16, "files"))
    )
    r.end()
    if len(env.payload):
        raise MalformedPayload("a checkpoint manifest has no payload")
    for f in files:
        # A full object key of this checkpoint (parse_key rejects traversal and foreign segments).
        parsed = parse_key(f.key)
        if parsed.kind != "checkpoint" or parsed.window != env.window:
            raise MalformedPayload(f"file {f.key!r} is not a key of checkpoint {env.window}")
    if len({f.key for f in files}) != len(files):
        raise MalformedPayload("duplicate file in checkpoint manifest")
    out = CheckpointManifest(env.run_hash, env.window, agg, fingerprint, files, metadata)
    fill_signature(out, env)
    return out


# ---------------------------------------------------------------------------- announcement
def encode_announcement(a: Announcement, identity: Identity) -> bytes:
    """Sign and serialize an announcement; the signer's key is the peer's identity."""
    w = Writer()
    w.text(a.client_version, 64)
    w.text(a.hardware, 1024)
    w.u8(a.role is not None)
    if a.role is not None:
        if not 0 <= a.role.stage < a.role.stages:
            raise MalformedPayload(f"pipeline stage {a.role.stage} not in 0..{a.role.stages - 1}")
        w.text(a.role.group, 64)
        w.varint(a.role.stage)
        w.varint(a.role.stages)
    write_metadata(w, a.metadata)
    return seal(Kind.ANNOUNCEMENT, a.run_hash, a.window, identity, w.getvalue(), b"")


def decode_announcement(
    data: bytes, *, run_hash: str | None, max_bytes: int, sender: str | None = None
) -> Announcement:
    """Verify and parse a peer announcement (``sender``: the peer id it must be signed by)."""
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.ANNOUNCEMENT)
    check_window_sender(env, None, sender)
    r = Reader(env.body, "announcement")
    version, hardware = r.text(64), r.text(1024)
    flag = r.u8()
    if flag > 1:
        raise r.fail(f"bad role flag {flag}")
    role = None
    if flag:
        role = PipelineRole(r.text(64), r.varint(1 << 16), r.varint(1 << 16))
        if role.stage >= role.stages:
            raise r.fail(f"pipeline stage {role.stage} not below {role.stages}")
    metadata = read_metadata(r)
    r.end()
    if len(env.payload):
        raise MalformedPayload("an announcement has no payload")
    out = Announcement(env.run_hash, env.window, version, hardware, role, metadata)
    fill_signature(out, env)
    return out
