"""The five signed objects of the protocol and their bytes.

==================  ==========================  ===========================================
object              signed by                   body (see :mod:`protocol.wire.frame` for the frame)
==================  ==========================  ===========================================
Contribution        the peer                    base, codec params, metadata, tensor table;
                                                payload = ``codec.pack`` of every tensor
Aggregate           a validator key of the run  base, alpha, fingerprint of θ_{t+1}, metadata
                                                with published_at, manifest [(peer, digest,
                                                weight)], encoding, tensor table; payload =
                                                coded index sets + bfloat16 values, or codec
                                                payloads of a re-compressed Δ̄
CheckpointManifest  a validator key             aggregate digest, fingerprint, metadata with
                                                published_at, files
Announcement        the peer                    client version, hardware, pipeline role, metadata
DatasetManifest     a validator key of the run  tokenizer, token width, vocabulary, end-of-document
                                                id, metadata, shards [(split, sha256, tokens)]
==================  ==========================  ===========================================

One module per kind (:mod:`~protocol.wire.contribution`, :mod:`~protocol.wire.aggregate`,
:mod:`~protocol.wire.checkpoint`, :mod:`~protocol.wire.announcement`,
:mod:`~protocol.wire.dataset`); the fields they share are in
:mod:`~protocol.wire.fields`, the signed frame in :mod:`~protocol.wire.frame`. Every ``decode_*``
returns a :class:`~protocol.wire.verified.Verified`: the object in ``.value`` and what the
signature proved about its bytes (``digest``, ``sender``, ``public_key``, ``size``)::

    blob = encode_contribution(Contribution(run_hash, window, base, spec.codec_at(window), encoded, meta), ident)
    c = decode_contribution(blob, run_hash=spec.hash(), max_bytes=cap, window=w, schema=shapes,
                            partial=True, codec_cfg=spec.codec_at(w))   # a stage may send a subset
    c.digest, c.sender, c.value.tensors["tok_emb.weight"]      # Encoded, ready for codec.decode
    agg = decode_aggregate(blob, run_hash=..., max_bytes=cap, allowed_signers=keys, schema=shapes)
    agg.digest, agg.value.manifest, agg.value.published_at

Decoding is strict: every failure is a :class:`protocol.errors.ProtocolError` subclass (see the
``decode_*`` docstrings); the signature is verified before the body is interpreted.
"""

from __future__ import annotations

from collections.abc import Collection

from protocol.errors import PayloadTooLarge
from protocol.wire.aggregate import (
    Aggregate,
    AggregateTensor,
    Encoding,
    ManifestEntry,
    SparseDelta,
    decode_aggregate,
    encode_aggregate,
)
from protocol.wire.announcement import Announcement, PipelineRole, decode_announcement, encode_announcement
from protocol.wire.checkpoint import CheckpointFile, CheckpointManifest, decode_checkpoint, encode_checkpoint
from protocol.wire.contribution import Contribution, decode_contribution, encode_contribution
from protocol.wire.dataset import (
    DatasetManifest,
    DatasetShard,
    block_digests,
    dataset_body,
    dataset_digest,
    decode_dataset,
    encode_dataset,
)
from protocol.wire.fields import GENESIS
from protocol.wire.frame import Kind, peek_kind
from protocol.wire.verified import Verified

__all__ = [
    "GENESIS",
    "Kind",
    "Verified",
    "SignedObject",
    "Contribution",
    "Aggregate",
    "AggregateTensor",
    "Encoding",
    "SparseDelta",
    "ManifestEntry",
    "CheckpointManifest",
    "CheckpointFile",
    "Announcement",
    "PipelineRole",
    "DatasetManifest",
    "DatasetShard",
    "encode_contribution",
    "decode_contribution",
    "encode_aggregate",
    "decode_aggregate",
    "encode_checkpoint",
    "decode_checkpoint",
    "encode_announcement",
    "decode_announcement",
    "block_digests",
    "dataset_body",
    "dataset_digest",
    "encode_dataset",
    "decode_dataset",
    "decode_object",
]

SignedObject = Contribution | Aggregate | CheckpointManifest | Announcement | DatasetManifest


def decode_object(
    data: bytes,
    *,
    max_bytes: int,
    run_hash: str | None = None,
    allowed_signers: Collection[bytes | str] | None = None,
) -> Verified[SignedObject]:
    """Verify and parse an object of whatever kind it is (``sparseloco inspect``)."""
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"object is {len(data)} bytes, limit {max_bytes}")
    kind = peek_kind(data)
    if kind == Kind.CONTRIBUTION:
        return decode_contribution(data, run_hash=run_hash, max_bytes=max_bytes)
    if kind == Kind.AGGREGATE:
        return decode_aggregate(data, run_hash=run_hash, max_bytes=max_bytes, allowed_signers=allowed_signers)
    if kind == Kind.CHECKPOINT:
        return decode_checkpoint(data, run_hash=run_hash, max_bytes=max_bytes, allowed_signers=allowed_signers)
    if kind == Kind.DATASET:
        return decode_dataset(data, run_hash=run_hash, max_bytes=max_bytes, allowed_signers=allowed_signers)
    return decode_announcement(data, run_hash=run_hash, max_bytes=max_bytes)
