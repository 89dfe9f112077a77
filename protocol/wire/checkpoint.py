"""The validator's signed list of the files that hold θ at the start of a window.

Body: digest of the aggregate whose result θ is (or GENESIS), the launch (digest of the genesis
manifest, or GENESIS in the genesis manifest itself), fingerprint of θ, metadata with
``published_at``, files [(full object key, sha256, size)]. No payload: the files are separate objects.

    blob = encode_checkpoint(CheckpointManifest(run_hash, 10, agg_digest, fp, files, published_at,
                                                launch=genesis_digest), validator)
    m = decode_checkpoint(blob, run_hash=run_hash, max_bytes=1 << 20, allowed_signers=keys).value
    m.published_at                               # when window 10 opened

The genesis manifest (window 0) starts a launch: its digest is the base of window 0 and every later
manifest of that launch names it, so a checkpoint of another launch of the same RunSpec is told
apart (see :mod:`protocol.chain`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from protocol.errors import MalformedPayload
from protocol.identity import Identity
from protocol.layout import parse_key
from protocol.wire.fields import (
    GENESIS,
    Metadata,
    Reader,
    Writer,
    digest_to_bytes,
    read_base,
    read_published_metadata,
    write_base,
    write_published_metadata,
)
from protocol.wire.frame import Kind, open_envelope, seal
from protocol.wire.verified import Verified, check_signer, check_window_sender, verified


@dataclass(frozen=True)
class CheckpointFile:
    """One file of a checkpoint: its full object key, sha256 hex and size in bytes."""

    key: str
    sha256: str
    size: int


@dataclass(frozen=True)
class CheckpointManifest:
    """Validator-signed list of the files that hold θ at the start of ``window`` (and their hashes).

    ``published_at`` (unix seconds) is when window ``window`` opened. ``launch``: the digest of the
    genesis manifest this checkpoint descends from; GENESIS exactly in the genesis manifest
    (window 0), which has no aggregate either.
    """

    run_hash: str
    window: int
    aggregate: str  # digest of the aggregate whose result the checkpoint holds (or GENESIS)
    fingerprint: str
    files: tuple[CheckpointFile, ...]  # keys are full object keys: layout.checkpoint_key(...)
    published_at: float
    metadata: Metadata = field(default_factory=dict)
    launch: str = GENESIS


def encode_checkpoint(m: CheckpointManifest, identity: Identity) -> bytes:
    """Sign and serialize a checkpoint manifest (file keys: ``layout.checkpoint_key(run, window, name)``)."""
    _check_root(m.window, m.aggregate, m.launch)
    w = Writer()
    write_base(w, m.aggregate)
    write_base(w, m.launch)
    w.text(m.fingerprint, 128)
    write_published_metadata(w, m.published_at, m.metadata)
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
) -> Verified[CheckpointManifest]:
    """Verify and parse a checkpoint manifest (signer checked like an aggregate's; MalformedPayload
    without a ``published_at``, with a file key outside this checkpoint, or with a launch and
    aggregate that do not fit its window: see :class:`CheckpointManifest`)."""
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.CHECKPOINT)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, None)
    r = Reader(env.body, "checkpoint manifest")
    agg = read_base(r)
    launch = read_base(r)
    fingerprint = r.text(128)
    published_at, metadata = read_published_metadata(r)
    files = tuple(CheckpointFile(r.text(1024), r.digest(), r.varint()) for _ in range(r.count(34, 1 << 16, "files")))
    r.end()
    if len(env.payload):
        raise MalformedPayload("a checkpoint manifest has no payload")
    _check_root(env.window, agg, launch)
    for f in files:
        # A full object key of this checkpoint (parse_key rejects traversal and foreign segments).
        parsed = parse_key(f.key)
        if parsed.kind != "checkpoint" or parsed.window != env.window:
            raise MalformedPayload(f"file {f.key!r} is not a key of checkpoint {env.window}")
    if len({f.key for f in files}) != len(files):
        raise MalformedPayload("duplicate file in checkpoint manifest")
    manifest = CheckpointManifest(env.run_hash, env.window, agg, fingerprint, files, published_at, metadata, launch)
    return verified(manifest, env)


def _check_root(window: int, aggregate: str, launch: str) -> None:
    """The genesis manifest names neither an aggregate nor a launch; every later one names both."""
    if window == 0 and (aggregate != GENESIS or launch != GENESIS):
        raise MalformedPayload("the genesis manifest (window 0) names no aggregate and no launch")
    if window > 0 and launch == GENESIS:
        raise MalformedPayload(f"checkpoint {window} does not name its launch")
