"""A peer's signed self-description under ``<run>/peers/<peer_id>``: who it is and where it sits.

Body: client version, hardware, a flags byte (bit 0: a pipeline role follows, bit 1: withdrawn),
optional pipeline role (group, stage, stages), metadata. No payload. The signer's key is the
peer's identity.

A peer that stops cleanly replaces its announcement by a *withdrawn* one (the key is its own): the
validator stops waiting for its uploads at once. Announcing again (a restart) replaces it back.

    blob = encode_announcement(Announcement(run_hash, window, "0.1.0", "1x H100"), identity)
    a = decode_announcement(blob, run_hash=run_hash, max_bytes=64 << 10, sender=peer_id)
    a.sender, a.value.role, a.value.withdrawn
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import MalformedPayload
from protocol.identity import Identity
from protocol.wire.fields import Metadata, Reader, Writer, read_metadata, write_metadata
from protocol.wire.frame import Kind, open_envelope, seal
from protocol.wire.verified import Verified, check_window_sender, verified

# The flags byte after the hardware string.
_HAS_ROLE = 1
_WITHDRAWN = 2


@dataclass(frozen=True)
class PipelineRole:
    """Where a peer sits in a pipeline replica: group name, its stage, number of stages."""

    group: str
    stage: int
    stages: int


@dataclass(frozen=True)
class Announcement:
    """A peer's signed self-description under ``<run>/peers/<peer_id>``; ``window``: when announced
    (or, ``withdrawn``, the window the peer held when it left)."""

    run_hash: str
    window: int
    client_version: str
    hardware: str
    role: PipelineRole | None = None
    metadata: Metadata = field(default_factory=dict)
    withdrawn: bool = False


def encode_announcement(a: Announcement, identity: Identity) -> bytes:
    """Sign and serialize an announcement; the signer's key is the peer's identity."""
    w = Writer()
    w.text(a.client_version, 64)
    w.text(a.hardware, 1024)
    w.u8((_HAS_ROLE if a.role is not None else 0) | (_WITHDRAWN if a.withdrawn else 0))
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
) -> Verified[Announcement]:
    """Verify and parse a peer announcement (``sender``: the peer id it must be signed by)."""
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.ANNOUNCEMENT)
    check_window_sender(env, None, sender)
    r = Reader(env.body, "announcement")
    version, hardware = r.text(64), r.text(1024)
    flags = r.u8()
    if flags & ~(_HAS_ROLE | _WITHDRAWN):
        raise r.fail(f"bad announcement flags {flags}")
    role = None
    if flags & _HAS_ROLE:
        role = PipelineRole(r.text(64), r.varint(1 << 16), r.varint(1 << 16))
        if role.stage >= role.stages:
            raise r.fail(f"pipeline stage {role.stage} not below {role.stages}")
    metadata = read_metadata(r)
    r.end()
    if len(env.payload):
        raise MalformedPayload("an announcement has no payload")
    announcement = Announcement(env.run_hash, env.window, version, hardware, role, metadata, bool(flags & _WITHDRAWN))
    return verified(announcement, env)
