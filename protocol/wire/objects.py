"""The four signed objects of the protocol and their bytes.

================  ==========================  ===========================================
object            signed by                   body (see :mod:`protocol.wire.frame` for the frame)
================  ==========================  ===========================================
Contribution      the peer                    base, codec params, metadata, tensor table;
                                              payload = ``codec.pack`` of every tensor
Aggregate         a validator key of the run  base, alpha, fingerprint of θ_{t+1}, metadata,
                                              manifest [(peer, digest, weight)], tensor table;
                                              payload = delta-coded flat indices + float32
CheckpointManifest a validator key            aggregate digest, fingerprint, metadata, files
Announcement      the peer                    client version, hardware, pipeline role, metadata
================  ==========================  ===========================================

Encoding::

    blob = encode_contribution(Contribution(run_hash, window, base, spec.codec, encoded, meta), ident)
    c = decode_contribution(blob, run_hash=spec.hash(), max_bytes=cap, window=w, schema=shapes,
                            partial=True, codec_cfg=spec.codec)   # a stage may send a subset
    c.digest, c.sender, c.tensors["tok_emb.weight"]          # Encoded, ready for codec.decode
    a = decode_aggregate(blob, run_hash=..., max_bytes=cap, allowed_signers=keys, schema=shapes)

Decoding is strict: every failure is a :class:`protocol.errors.ProtocolError` subclass (see the
``decode_*`` docstrings); the signature is verified before the body is interpreted.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Union

import numpy as np
import torch

from protocol import codec
from protocol.config import CodecConfig
from protocol.wire.frame import Kind, open_envelope, overhead_bytes, peek_kind, seal
from protocol.errors import (
    MalformedPayload,
    NonFiniteValues,
    PayloadTooLarge,
    ProtocolError,
    SchemaMismatch,
    StaleBase,
)
from protocol.identity import Identity
from protocol.wire.records import (
    Announcement,
    CheckpointFile,
    CheckpointManifest,
    PipelineRole,
    PUBLISHED_AT,
    Signed,
    check_signer,
    check_window_sender,
    decode_announcement,
    decode_checkpoint,
    encode_announcement,
    encode_checkpoint,
    fill_signature,
    published_at_of,
)
from protocol.wire.fields import (
    GENESIS,
    Metadata,
    Reader,
    TensorEntry,
    Writer,
    decode_indices,
    digest_to_bytes,
    encode_indices,
    read_base,
    read_codec,
    read_metadata,
    read_peer_id,
    read_table,
    write_base,
    write_codec,
    write_metadata,
    write_peer_id,
    write_table,
)

__all__ = [
    "GENESIS", "Kind", "Signed", "SignedObject", "Contribution", "Aggregate", "SparseDelta", "ManifestEntry",
    "CheckpointManifest", "CheckpointFile",
    "Announcement", "PipelineRole", "encode_contribution", "decode_contribution", "encode_aggregate",
    "decode_aggregate", "encode_checkpoint", "decode_checkpoint", "encode_announcement",
    "decode_announcement", "decode_object", "overhead_bytes", "published_at_of", "PUBLISHED_AT",
]  # fmt: skip

Shape = tuple[int, ...]
Schema = Mapping[str, Shape]
DTYPE_FLOAT32 = 0  # the only dtype on the wire today: decoded deltas are float32
_MANIFEST_ENTRY_BYTES = 20 + 32 + 8  # raw peer id, contribution digest, f64 weight


@dataclass(frozen=True)
class Contribution(Signed):
    """A peer's compressed pseudo-gradient for one window. ``base``: aggregate digest or GENESIS."""

    run_hash: str
    window: int
    base: str
    codec: CodecConfig
    tensors: Mapping[str, codec.Encoded]
    metadata: Metadata = field(default_factory=dict)
    public_key: bytes = b""
    digest: str = ""
    size: int = 0

    @property
    def nnz(self) -> int:
        return sum(int(e.nnz) for e in self.tensors.values())


@dataclass(frozen=True)
class SparseDelta:
    """One tensor of Δ̄: sorted flat int64 ``indices`` into ``shape`` and float32 ``values``."""

    shape: Shape
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(int(np.prod(self.shape, dtype=np.int64)), dtype=torch.float32)
        out[self.indices] = self.values
        return out.reshape(self.shape)


@dataclass(frozen=True)
class ManifestEntry:
    """An accepted contribution: who sent it, its digest, and its weight in the aggregate."""

    peer_id: str
    digest: str
    weight: float


@dataclass(frozen=True)
class Aggregate(Signed):
    """The validator's signed Δ̄ for a window: θ_{t+1} = θ_t − alpha·Δ̄ must have ``fingerprint``."""

    run_hash: str
    window: int
    base: str
    alpha: float
    fingerprint: str
    manifest: tuple[ManifestEntry, ...]
    tensors: Mapping[str, SparseDelta]
    metadata: Metadata = field(default_factory=dict)
    public_key: bytes = b""
    digest: str = ""
    size: int = 0

    @property
    def nnz(self) -> int:
        return sum(t.nnz for t in self.tensors.values())


SignedObject = Union[Contribution, Aggregate, CheckpointManifest, Announcement]


def _check_schema(table: list[TensorEntry], schema: Schema | None, partial: bool = False) -> None:
    if schema is None:
        return
    names = {t.name for t in table}
    missing, unknown = [] if partial else sorted(set(schema) - names), sorted(names - set(schema))
    if missing or unknown:
        raise SchemaMismatch(f"missing tensors {missing[:5]}, unknown tensors {unknown[:5]}")
    for t in table:
        if tuple(schema[t.name]) != t.shape:
            raise SchemaMismatch(f"{t.name}: shape {t.shape}, expected {tuple(schema[t.name])}")


def _slices(payload: memoryview, lengths: list[int]) -> list[memoryview]:
    if sum(lengths) != len(payload):
        raise MalformedPayload(f"tensor table declares {sum(lengths)} payload bytes, object has {len(payload)}")
    out, pos = [], 0
    for n in lengths:
        out.append(payload[pos : pos + n])
        pos += n
    return out


# ---------------------------------------------------------------------------- contribution
def encode_contribution(c: Contribution, identity: Identity) -> bytes:
    """Sign and serialize a contribution (tensors in name order; every ``Encoded`` uses ``c.codec``)."""
    names = sorted(c.tensors)
    blobs = []
    for name in names:
        if c.tensors[name].cfg != c.codec:
            raise MalformedPayload(f"{name}: encoded with another codec config than the contribution's")
        blobs.append(codec.pack(c.tensors[name]))
    table = [TensorEntry(n, tuple(c.tensors[n].shape), DTYPE_FLOAT32, (len(b),)) for n, b in zip(names, blobs)]
    w = Writer()
    write_base(w, c.base)
    write_codec(w, c.codec)
    write_metadata(w, c.metadata)
    write_table(w, table)
    return seal(Kind.CONTRIBUTION, c.run_hash, c.window, identity, w.getvalue(), b"".join(blobs))


def decode_contribution(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    window: int | None = None,
    sender: str | None = None,
    base: str | None = None,
    schema: Schema | None = None,
    partial: bool = False,
    codec_cfg: CodecConfig | None = None,
) -> Contribution:
    """Verify and parse a contribution.

    Raises PayloadTooLarge, UnsupportedVersion, MalformedPayload, BadSignature (also when signed by
    another peer than ``sender``), WrongRun, WrongWindow, StaleBase (``base`` differs),
    SchemaMismatch (tensor names/shapes vs ``schema``; codec params vs ``codec_cfg`` with reason
    ``wrong_codec``) and whatever
    ``codec.unpack`` raises for a bad tensor payload (InvalidIndices, NonFiniteValues ...).
    ``None`` skips the corresponding check. ``partial=True`` accepts a subset of ``schema``
    (pipeline stages). Pass ``schema`` when you can: shapes are then checked before the codec
    builds anything for them.
    """
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.CONTRIBUTION)
    check_window_sender(env, window, sender)
    r = Reader(env.body, "contribution header")
    c_base = read_base(r)
    cfg = read_codec(r)
    metadata = read_metadata(r)
    table = read_table(r, n_lengths=1)
    r.end()
    if base is not None and c_base != base:
        raise StaleBase(f"trained from {c_base[:16]}, current aggregate is {base[:16]}")
    if codec_cfg is not None and cfg != codec_cfg:
        raise SchemaMismatch(f"codec parameters {cfg} differ from the run's {codec_cfg}", reason="wrong_codec")
    _check_schema(table, schema, partial)
    tensors = {}
    for t, blob in zip(table, _slices(env.payload, [t.lengths[0] for t in table])):
        if t.dtype != DTYPE_FLOAT32:
            raise MalformedPayload(f"{t.name}: unknown dtype code {t.dtype}")
        tensors[t.name] = _unpack_tensor(t, blob, cfg)
    out = Contribution(env.run_hash, env.window, c_base, cfg, tensors, metadata)
    fill_signature(out, env)
    return out


def _unpack_tensor(t: TensorEntry, blob: memoryview, cfg: CodecConfig) -> codec.Encoded:
    # Every chunk costs the codec at least one payload byte, so a shape far larger than its payload
    # is rejected here, before the codec builds per-chunk tables for it (inspect has no schema).
    if _numel(t.shape) > max(cfg.block * cfg.block, cfg.chunk_1d) * (len(blob) + 1):
        raise MalformedPayload(f"tensor {t.name}: shape {t.shape} cannot fit in {len(blob)} payload bytes")
    try:
        return codec.unpack(bytes(blob), t.shape, cfg)
    except ProtocolError as exc:
        raise type(exc)(f"tensor {t.name}: {exc.args[0] if exc.args else exc}", reason=exc.reason) from exc
    except (ValueError, IndexError, RuntimeError, OverflowError) as exc:
        # A codec bug must not crash a validator on hostile bytes; record it as malformed.
        raise MalformedPayload(f"tensor {t.name}: payload rejected by the codec ({exc})") from exc


# ---------------------------------------------------------------------------- aggregate
def encode_aggregate(a: Aggregate, identity: Identity) -> bytes:
    """Sign and serialize an aggregate (indices must be sorted, unique and inside each shape)."""
    names = sorted(a.tensors)
    table, parts = [], []
    for name in names:
        t = a.tensors[name]
        idx = encode_indices(t.indices.detach().cpu().numpy(), _numel(t.shape))
        vals = t.values.detach().cpu().to(torch.float32).contiguous().numpy()
        if vals.shape != (t.nnz,) or not np.isfinite(vals).all():
            raise MalformedPayload(f"{name}: values must be nnz finite float32 numbers")
        table.append(TensorEntry(name, tuple(t.shape), DTYPE_FLOAT32, (t.nnz, len(idx))))
        parts += [idx, vals.astype("<f4").tobytes()]
    w = Writer()
    write_base(w, a.base)
    w.f64(a.alpha)
    w.text(a.fingerprint, 128)
    write_metadata(w, a.metadata)
    w.varint(len(a.manifest))
    for m in a.manifest:
        write_peer_id(w, m.peer_id)
        w.raw(digest_to_bytes(m.digest))
        w.f64(m.weight)
    write_table(w, table)
    return seal(Kind.AGGREGATE, a.run_hash, a.window, identity, w.getvalue(), b"".join(parts))


def decode_aggregate(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    allowed_signers: Collection[bytes | str] | None,
    window: int | None = None,
    schema: Schema | None = None,
    partial: bool = True,
) -> Aggregate:
    """Verify and parse an aggregate. ``allowed_signers`` (raw or hex public keys, e.g.
    ``spec.validator.public_keys``) is required; pass ``None`` explicitly to skip (inspection only).

    ``schema`` (the model's parameter shapes): every tensor of the aggregate must be one of them
    with that shape, checked before any payload is read. An aggregate legitimately covers a
    *subset* (parameters nobody sent this window, pipeline stages, an empty window), hence the
    default ``partial=True``; ``partial=False`` demands every tensor.

    Raises the envelope errors plus UnknownSigner, WrongWindow, SchemaMismatch, InvalidIndices
    (unsorted, duplicate or out-of-range indices) and NonFiniteValues.
    """
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.AGGREGATE)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, None)
    r = Reader(env.body, "aggregate header")
    a_base = read_base(r)
    alpha = r.f64()
    fingerprint = r.text(128)
    metadata = read_metadata(r)
    n_entries = r.count(_MANIFEST_ENTRY_BYTES, 1 << 20, "manifest entries")
    manifest = tuple(ManifestEntry(read_peer_id(r), r.digest(), r.f64()) for _ in range(n_entries))
    if len({m.peer_id for m in manifest}) != len(manifest):
        raise MalformedPayload("a peer appears twice in the aggregate manifest")
    table = read_table(r, n_lengths=2)
    r.end()
    _check_schema(table, schema, partial)
    lengths = []
    for t in table:
        if t.dtype != DTYPE_FLOAT32:
            raise MalformedPayload(f"{t.name}: unknown dtype code {t.dtype}")
        nnz, idx_len = t.lengths
        if nnz > _numel(t.shape):
            raise MalformedPayload(f"{t.name}: {nnz} values for {_numel(t.shape)} positions")
        lengths += [idx_len, 4 * nnz]
    views = _slices(env.payload, lengths)
    tensors = {}
    for i, t in enumerate(table):
        idx = decode_indices(views[2 * i], t.lengths[0], _numel(t.shape), t.name)
        vals = np.frombuffer(views[2 * i + 1], dtype="<f4")
        if not np.isfinite(vals).all():
            raise NonFiniteValues(f"{t.name}: non-finite aggregate value")
        tensors[t.name] = SparseDelta(t.shape, torch.from_numpy(idx), torch.from_numpy(vals.astype(np.float32)))
    out = Aggregate(env.run_hash, env.window, a_base, alpha, fingerprint, manifest, tensors, metadata)
    fill_signature(out, env)
    return out


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---------------------------------------------------------------------------- any kind
def decode_object(
    data: bytes,
    *,
    max_bytes: int,
    run_hash: str | None = None,
    allowed_signers: Collection[bytes | str] | None = None,
) -> SignedObject:
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
    return decode_announcement(data, run_hash=run_hash, max_bytes=max_bytes)
