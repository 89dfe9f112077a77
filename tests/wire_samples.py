"""Small valid objects of every kind, shared by the wire, fuzz and inspect tests."""

from __future__ import annotations

import hashlib

import torch

from protocol import codec
from protocol.config import CodecConfig, RunSpec
from protocol.errors import PayloadTooLarge
from protocol.identity import Identity
from protocol.layout import checkpoint_key, run_id
from protocol.wire import (
    Aggregate,
    Announcement,
    CheckpointFile,
    CheckpointManifest,
    Contribution,
    DatasetManifest,
    DatasetShard,
    ManifestEntry,
    PipelineRole,
    SparseDelta,
    decode_object,
    encode_aggregate,
    encode_announcement,
    encode_checkpoint,
    encode_contribution,
    encode_dataset,
)
from protocol.wire.delta import round_values
from protocol.wire.frame import Kind, peek_kind, seal
from protocol.wire.quorum import (
    Endorsement,
    Objection,
    Reason,
    TensorCaps,
    certificate_bytes,
    decode_certificate,
    decode_endorsement,
    decode_objection,
    decode_proposal,
    encode_certificate,
    encode_endorsement,
    encode_objection,
    encode_proposal,
)

RUN = RunSpec.default().hash()
RUN_ID = run_id(RUN)
CODEC = CodecConfig()
SCHEMA = {"blocks.0.attn.wq.weight": (64, 96), "blocks.0.norm.weight": (100,), "conv.weight": (3, 5, 7)}
PEER = Identity.from_seed(b"p" * 32)
VALIDATOR = Identity.from_seed(b"v" * 32)
BASE = hashlib.sha256(b"aggregate 6").hexdigest()
LAUNCH = hashlib.sha256(b"genesis manifest").hexdigest()
PUBLISHED_AT = 1_767_225_600.25
#: The other validators of a run with several (protocol.quorum): VALIDATOR leads, all three endorse.
COVALIDATORS = (Identity.from_seed(b"u" * 32), Identity.from_seed(b"x" * 32))
QUORUM = 3


def contribution(window: int = 7, base: str = BASE, seed: int = 0) -> Contribution:
    g = torch.Generator().manual_seed(seed)
    tensors = {n: codec.encode(torch.randn(s, generator=g), CODEC) for n, s in SCHEMA.items()}
    return Contribution(RUN, window, base, CODEC, tensors, {"loss": 3.25, "tokens": 4096, "stage": -1})


def aggregate(window: int = 7, seed: int = 0) -> Aggregate:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in SCHEMA.items():
        numel = int(torch.tensor(shape).prod())
        idx = torch.randperm(numel, generator=g)[: numel // 10].sort().values
        tensors[name] = SparseDelta(shape, idx, round_values(torch.randn(idx.numel(), generator=g)))
    manifest = (
        ManifestEntry(PEER.peer_id, hashlib.sha256(b"c1").hexdigest(), 1.0),
        ManifestEntry(VALIDATOR.peer_id, hashlib.sha256(b"c2").hexdigest(), 0.5),
    )
    fp = hashlib.sha256(b"theta").hexdigest()
    return Aggregate(RUN, window, BASE, 1.0, fp, manifest, tensors, PUBLISHED_AT, {"contributors": 2})


def checkpoint(window: int = 10) -> CheckpointManifest:
    files = (
        CheckpointFile(checkpoint_key(RUN_ID, window, "model.safetensors"), hashlib.sha256(b"m").hexdigest(), 123456),
        CheckpointFile(checkpoint_key(RUN_ID, window, "optimizer.safetensors"), hashlib.sha256(b"o").hexdigest(), 99),
    )
    theta = hashlib.sha256(b"theta").hexdigest()
    return CheckpointManifest(RUN, window, BASE, theta, files, PUBLISHED_AT, {"step": 9}, LAUNCH)


def announcement(window: int = 3) -> Announcement:
    return Announcement(RUN, window, "0.1.0", "cpu x2", PipelineRole("g1", 1, 3), {"store": "file:///tmp/x"})


def dataset() -> DatasetManifest:
    def shard(split: str, name: bytes, tokens: int) -> DatasetShard:
        blocks = b"".join(hashlib.sha256(name + bytes([i])).digest() for i in range(-(-tokens // 1024)))
        return DatasetShard(split, hashlib.sha256(name).hexdigest(), tokens, blocks)

    shards = (shard("train", b"t0", 1 << 13), shard("train", b"t1", 12345), shard("val", b"v0", 4321))
    return DatasetManifest("bytes", 2, 256, 0, shards, {"documents": 17, "val_fraction": 0.02})


def blobs() -> dict[Kind, bytes]:
    """One valid signed object of each kind."""
    return {
        Kind.CONTRIBUTION: encode_contribution(contribution(), PEER),
        Kind.AGGREGATE: encode_aggregate(aggregate(), VALIDATOR),
        Kind.CHECKPOINT: encode_checkpoint(checkpoint(), VALIDATOR),
        Kind.ANNOUNCEMENT: encode_announcement(announcement(), PEER),
        Kind.DATASET: encode_dataset(dataset(), RUN, VALIDATOR),
    }


def quorum_blobs() -> dict[Kind, bytes]:
    """One valid object of each kind of a run with several validators, all signed by VALIDATOR."""
    agg = encode_aggregate(aggregate(), VALIDATOR)
    digest = hashlib.sha256(agg).hexdigest()
    caps = {
        PEER.peer_id: {
            "blocks.0.attn.wq.weight": TensorCaps(2.5, 0.75, 96, ((0, 0.0), (5, 0.25))),
            "blocks.0.norm.weight": TensorCaps(0.5, float("inf"), 0),
        },
        COVALIDATORS[0].peer_id: None,
    }
    endorsements = [
        encode_endorsement(Endorsement(RUN, 7, 0, VALIDATOR.peer_id, digest), v) for v in (VALIDATOR, *COVALIDATORS)
    ]
    reasons = (Reason("norm", PEER.peer_id, "‖Δ‖ 3.5 > cap 2.0"), Reason("fingerprint", "", "θ differs"))
    return {
        Kind.PROPOSAL: encode_proposal(1, caps, agg, 7, RUN, VALIDATOR),
        Kind.ENDORSEMENT: endorsements[0],
        Kind.OBJECTION: encode_objection(Objection(RUN, 7, 1, VALIDATOR.peer_id, digest, reasons), VALIDATOR),
        Kind.CERTIFICATE: encode_certificate(agg, endorsements, 7, RUN, VALIDATOR),
    }


def all_blobs() -> dict[Kind, bytes]:
    """One valid signed object of every kind."""
    return {**blobs(), **quorum_blobs()}


def decode_any(data: bytes, max_bytes: int, run_hash: str | None = None) -> object:
    """Decode an object of any kind, like ``decode_object`` (which knows the five kinds that
    ``sparseloco inspect`` shows), any signer allowed; a certificate needs QUORUM endorsements."""
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"object is {len(data)} bytes, limit {max_bytes}")
    kind = peek_kind(data)
    if kind == Kind.PROPOSAL:
        return decode_proposal(data, run_hash=run_hash, max_bytes=max_bytes, allowed_signers=None)
    if kind == Kind.ENDORSEMENT:
        return decode_endorsement(data, run_hash=run_hash, allowed_signers=None)
    if kind == Kind.OBJECTION:
        return decode_objection(data, run_hash=run_hash, allowed_signers=None)
    if kind == Kind.CERTIFICATE:
        cap = certificate_bytes(max_bytes, QUORUM)
        return decode_certificate(data, run_hash=run_hash, max_bytes=cap, allowed_signers=None, quorum=QUORUM)
    return decode_object(data, max_bytes=max_bytes, run_hash=run_hash)


def resign(data: bytes, identity: Identity, *, body: bytes | None = None, payload: bytes | None = None) -> bytes:
    """Rebuild an object around a new body and/or payload with a valid signature (crafted input)."""
    from protocol.wire.frame import _FIXED, FIXED_HEADER_BYTES

    _, _, kind, run_raw, window, _, body_len, payload_len = _FIXED.unpack_from(data, 0)
    old_body = data[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + body_len]
    old_payload = data[FIXED_HEADER_BYTES + body_len : FIXED_HEADER_BYTES + body_len + payload_len]
    return seal(
        Kind(kind),
        run_raw.hex(),
        window,
        identity,
        old_body if body is None else body,
        old_payload if payload is None else payload,
    )


def sign_raw(unsigned: bytes, identity: Identity) -> bytes:
    """Append a valid signature to arbitrary bytes (lengths in the header are left as they are)."""
    return unsigned + identity.sign(hashlib.sha256(unsigned).digest())
