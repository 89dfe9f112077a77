"""The validator's signed Δ̄ for a window: what every participant applies, θ_{t+1} = θ_t − alpha·Δ̄.

Body: base, alpha (f64), fingerprint of θ_{t+1}, metadata with ``published_at``, manifest
[(raw peer id, contribution digest, f64 weight)], the encoding of Δ̄ (u8), the codec parameters
when it is ``CODEC``, then the tensor table. Format version 2 of the kind has two encodings:

* ``SPARSE`` (plain): per tensor the union of the contributors' positions as a coded index set and
  one bfloat16 value per position (:mod:`protocol.wire.delta`); table lengths (value count, index
  coding, index bytes); payload per tensor: index bytes, then values. ``tensors`` hold
  :class:`SparseDelta`.
* ``CODEC`` (``outer.recompress``): per tensor a codec payload, exactly like a contribution's
  (:func:`protocol.codec.pack`: chunk-wise Top-k, 2-bit codes); table lengths (payload bytes).
  ``tensors`` hold :class:`~protocol.codec.Encoded`, all with the one codec config of the body.

    blob = encode_aggregate(Aggregate(run_hash, t, base, alpha, fp, manifest, tensors, published_at), key)
    agg = decode_aggregate(blob, run_hash=..., max_bytes=cap, allowed_signers=keys, schema=shapes)
    agg.digest                                  # the ``base`` of every contribution to window t + 1
    agg.value.published_at                      # when window t + 1 opened
    protocol.chain.delta_of(agg.value)          # Δ̄ as flat indices + float32 values (apply_outer)
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from protocol.codec import Encoded, pack
from protocol.config import CodecConfig
from protocol.errors import MalformedPayload
from protocol.identity import Identity
from protocol.wire.contribution import unpack_tensor
from protocol.wire.delta import (
    VALUE_BYTES,
    decode_index_set,
    decode_values,
    encode_index_set,
    encode_values,
)
from protocol.wire.fields import (
    DTYPE_FLOAT32,
    Metadata,
    Reader,
    Schema,
    Shape,
    TensorEntry,
    Writer,
    check_dtype,
    check_schema,
    digest_to_bytes,
    read_base,
    read_codec,
    read_peer_id,
    read_published_metadata,
    read_table,
    shape_numel,
    split_payload,
    write_base,
    write_codec,
    write_peer_id,
    write_published_metadata,
    write_table,
)
from protocol.wire.frame import Kind, open_envelope, seal
from protocol.wire.verified import Verified, check_signer, check_window_sender, verified

_MANIFEST_ENTRY_BYTES = 20 + 32 + 8  # raw peer id, contribution digest, f64 weight


class Encoding(enum.IntEnum):
    """How an aggregate's tensors travel (the u8 before its tensor table)."""

    SPARSE = 0
    CODEC = 1


@dataclass(frozen=True)
class SparseDelta:
    """One tensor of a plain Δ̄: sorted flat int64 ``indices`` into ``shape`` and float32 ``values``
    that are bfloat16 numbers (:func:`protocol.wire.delta.round_values`)."""

    shape: Shape
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())


AggregateTensor = SparseDelta | Encoded


@dataclass(frozen=True)
class ManifestEntry:
    """An accepted contribution: who sent it, its digest, and its weight in the aggregate."""

    peer_id: str
    digest: str
    weight: float


@dataclass(frozen=True)
class Aggregate:
    """The validator's signed Δ̄ for ``window``: θ_{t+1} = θ_t − alpha·Δ̄ must have ``fingerprint``.

    ``published_at`` (unix seconds) is when the validator published it, which opens window + 1.
    """

    run_hash: str
    window: int
    base: str
    alpha: float
    fingerprint: str
    manifest: tuple[ManifestEntry, ...]
    tensors: Mapping[str, AggregateTensor]  # all SparseDelta (plain) or all Encoded (re-compressed)
    published_at: float
    metadata: Metadata = field(default_factory=dict)

    @property
    def nnz(self) -> int:
        return sum(t.nnz for t in self.tensors.values())

    @property
    def codec(self) -> CodecConfig | None:
        """The codec of a re-compressed aggregate; None for a plain one (or one without tensors)."""
        return _encoding(self.tensors)[1]


def encode_aggregate(a: Aggregate, identity: Identity) -> bytes:
    """Sign and serialize an aggregate. Plain tensors need sorted unique indices inside their shape
    and bfloat16 values; re-compressed ones one codec config. MalformedPayload otherwise."""
    encoding, cfg = _encoding(a.tensors)
    table, parts = [], []
    for name in sorted(a.tensors):
        t = a.tensors[name]
        if isinstance(t, Encoded):
            blob = pack(t)
            table.append(TensorEntry(name, tuple(t.shape), DTYPE_FLOAT32, (len(blob),)))
            parts.append(blob)
            continue
        if t.values.shape != (t.nnz,):
            raise MalformedPayload(f"{name}: {tuple(t.values.shape)} values for {t.nnz} indices")
        coding, idx = encode_index_set(t.indices.detach().cpu().numpy(), shape_numel(t.shape))
        table.append(TensorEntry(name, tuple(t.shape), DTYPE_FLOAT32, (t.nnz, int(coding), len(idx))))
        parts += [idx, encode_values(t.values, name)]
    w = Writer()
    write_base(w, a.base)
    w.f64(a.alpha)
    w.text(a.fingerprint, 128)
    write_published_metadata(w, a.published_at, a.metadata)
    w.varint(len(a.manifest))
    for m in a.manifest:
        write_peer_id(w, m.peer_id)
        w.raw(digest_to_bytes(m.digest))
        w.f64(m.weight)
    w.u8(encoding)
    if cfg is not None:
        write_codec(w, cfg)
    write_table(w, table)
    return seal(Kind.AGGREGATE, a.run_hash, a.window, identity, w.getvalue(), b"".join(parts))


def _encoding(tensors: Mapping[str, AggregateTensor]) -> tuple[Encoding, CodecConfig | None]:
    """SPARSE when every tensor is a SparseDelta, CODEC (with its config) when every one is an
    Encoded of one codec config; MalformedPayload for a mixture."""
    configs = {t.cfg for t in tensors.values() if isinstance(t, Encoded)}
    if not configs:
        return Encoding.SPARSE, None
    if len(configs) != 1 or not all(isinstance(t, Encoded) for t in tensors.values()):
        raise MalformedPayload("an aggregate's tensors are all sparse deltas or all encoded with one codec config")
    return Encoding.CODEC, next(iter(configs))


def decode_aggregate(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    allowed_signers: Collection[bytes | str] | None,
    window: int | None = None,
    schema: Schema | None = None,
    partial: bool = True,
) -> Verified[Aggregate]:
    """Verify and parse an aggregate. ``allowed_signers`` (raw or hex public keys, e.g.
    ``spec.validator.public_keys``) is required; pass ``None`` explicitly to skip (inspection only).

    ``schema`` (the model's parameter shapes): every tensor of the aggregate must be one of them
    with that shape, checked before any payload is read. An aggregate legitimately covers a
    *subset* (parameters nobody sent this window, pipeline stages, an empty window), hence the
    default ``partial=True``; ``partial=False`` demands every tensor.

    Raises the envelope errors plus UnknownSigner, WrongWindow, MalformedPayload (also without a
    ``published_at``, or for an index set not in its one canonical coding), SchemaMismatch,
    InvalidIndices (out-of-range indices), NonFiniteValues and whatever the codec raises for a
    re-compressed tensor's payload.
    """
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.AGGREGATE)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, None)
    h = read_header(env.body)
    check_schema(h.table, schema, partial)
    for t in h.table:
        check_dtype(t)
    if h.codec is None:
        tensors = _sparse_tensors(h.table, env.payload)
    else:
        tensors = _codec_tensors(h.table, env.payload, h.codec)
    agg = Aggregate(
        env.run_hash, env.window, h.base, h.alpha, h.fingerprint, h.manifest, tensors, h.published_at, h.metadata
    )
    return verified(agg, env)


@dataclass(frozen=True)
class Header:
    """An aggregate's body: everything but its tensors' payload (``codec`` None: plain encoding)."""

    base: str
    alpha: float
    fingerprint: str
    published_at: float
    metadata: Metadata
    manifest: tuple[ManifestEntry, ...]
    codec: CodecConfig | None
    table: list[TensorEntry]


def read_header(body: bytes | memoryview) -> Header:
    """Parse an aggregate's body (MalformedPayload and the field readers' errors)."""
    r = Reader(body, "aggregate header")
    a_base = read_base(r)
    alpha = r.f64()
    fingerprint = r.text(128)
    published_at, metadata = read_published_metadata(r)
    n_entries = r.count(_MANIFEST_ENTRY_BYTES, 1 << 20, "manifest entries")
    manifest = tuple(ManifestEntry(read_peer_id(r), r.digest(), r.f64()) for _ in range(n_entries))
    if len({m.peer_id for m in manifest}) != len(manifest):
        raise MalformedPayload("a peer appears twice in the aggregate manifest")
    encoding = r.u8()
    if encoding not in (Encoding.SPARSE, Encoding.CODEC):
        raise MalformedPayload(f"unknown aggregate encoding {encoding}")
    cfg = read_codec(r) if encoding == Encoding.CODEC else None
    table = read_table(r, n_lengths=3 if cfg is None else 1)
    r.end()
    return Header(a_base, alpha, fingerprint, published_at, metadata, manifest, cfg, table)


def _sparse_tensors(table: list[TensorEntry], payload: memoryview) -> dict[str, AggregateTensor]:
    lengths = []
    for t in table:
        nnz, _, idx_len = t.lengths
        if nnz > shape_numel(t.shape):
            raise MalformedPayload(f"{t.name}: {nnz} values for {shape_numel(t.shape)} positions")
        lengths += [idx_len, VALUE_BYTES * nnz]
    views = split_payload(payload, lengths)
    tensors: dict[str, AggregateTensor] = {}
    for i, t in enumerate(table):
        nnz, coding, _ = t.lengths
        idx = decode_index_set(coding, views[2 * i], nnz, shape_numel(t.shape), t.name)
        tensors[t.name] = SparseDelta(t.shape, torch.from_numpy(idx), decode_values(views[2 * i + 1], t.name))
    return tensors


def _codec_tensors(table: list[TensorEntry], payload: memoryview, cfg: CodecConfig) -> dict[str, AggregateTensor]:
    views = split_payload(payload, [t.lengths[0] for t in table])
    return {t.name: unpack_tensor(t, blob, cfg) for t, blob in zip(table, views)}
