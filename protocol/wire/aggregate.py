"""The validator's signed Δ̄ for a window: what every peer applies, θ_{t+1} = θ_t − alpha·Δ̄.

Body: base, alpha (f64), fingerprint of θ_{t+1}, metadata with ``published_at``, manifest
[(raw peer id, contribution digest, f64 weight)], tensor table (value count and index bytes per
tensor). Payload per tensor: the sorted flat indices as varint gaps, then the float32 values.

    blob = encode_aggregate(Aggregate(run_hash, t, base, alpha, fp, manifest, tensors, published_at), key)
    agg = decode_aggregate(blob, run_hash=..., max_bytes=cap, allowed_signers=keys, schema=shapes)
    agg.digest                                  # the ``base`` of every contribution to window t + 1
    agg.value.published_at                      # when window t + 1 opened
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from protocol.errors import InvalidIndices, MalformedPayload, NonFiniteValues
from protocol.identity import Identity
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
    read_peer_id,
    read_published_metadata,
    read_table,
    shape_numel,
    split_payload,
    write_base,
    write_peer_id,
    write_published_metadata,
    write_table,
)
from protocol.wire.frame import Kind, open_envelope, seal
from protocol.wire.verified import Verified, check_signer, check_window_sender, verified

_MANIFEST_ENTRY_BYTES = 20 + 32 + 8  # raw peer id, contribution digest, f64 weight


@dataclass(frozen=True)
class SparseDelta:
    """One tensor of Δ̄: sorted flat int64 ``indices`` into ``shape`` and float32 ``values``."""

    shape: Shape
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())


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
    tensors: Mapping[str, SparseDelta]
    published_at: float
    metadata: Metadata = field(default_factory=dict)

    @property
    def nnz(self) -> int:
        return sum(t.nnz for t in self.tensors.values())


def encode_aggregate(a: Aggregate, identity: Identity) -> bytes:
    """Sign and serialize an aggregate (indices must be sorted, unique and inside each shape)."""
    names = sorted(a.tensors)
    table, parts = [], []
    for name in names:
        t = a.tensors[name]
        idx = encode_indices(t.indices.detach().cpu().numpy(), shape_numel(t.shape))
        vals = t.values.detach().cpu().to(torch.float32).contiguous().numpy()
        if vals.shape != (t.nnz,) or not np.isfinite(vals).all():
            raise MalformedPayload(f"{name}: values must be nnz finite float32 numbers")
        table.append(TensorEntry(name, tuple(t.shape), DTYPE_FLOAT32, (t.nnz, len(idx))))
        parts += [idx, vals.astype("<f4").tobytes()]
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
) -> Verified[Aggregate]:
    """Verify and parse an aggregate. ``allowed_signers`` (raw or hex public keys, e.g.
    ``spec.validator.public_keys``) is required; pass ``None`` explicitly to skip (inspection only).

    ``schema`` (the model's parameter shapes): every tensor of the aggregate must be one of them
    with that shape, checked before any payload is read. An aggregate legitimately covers a
    *subset* (parameters nobody sent this window, pipeline stages, an empty window), hence the
    default ``partial=True``; ``partial=False`` demands every tensor.

    Raises the envelope errors plus UnknownSigner, WrongWindow, MalformedPayload (also without a
    ``published_at``), SchemaMismatch, InvalidIndices (unsorted, duplicate or out-of-range indices)
    and NonFiniteValues.
    """
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.AGGREGATE)
    check_signer(env, allowed_signers)
    check_window_sender(env, window, None)
    r = Reader(env.body, "aggregate header")
    a_base = read_base(r)
    alpha = r.f64()
    fingerprint = r.text(128)
    published_at, metadata = read_published_metadata(r)
    n_entries = r.count(_MANIFEST_ENTRY_BYTES, 1 << 20, "manifest entries")
    manifest = tuple(ManifestEntry(read_peer_id(r), r.digest(), r.f64()) for _ in range(n_entries))
    if len({m.peer_id for m in manifest}) != len(manifest):
        raise MalformedPayload("a peer appears twice in the aggregate manifest")
    table = read_table(r, n_lengths=2)
    r.end()
    check_schema(table, schema, partial)
    lengths = []
    for t in table:
        check_dtype(t)
        nnz, idx_len = t.lengths
        if nnz > shape_numel(t.shape):
            raise MalformedPayload(f"{t.name}: {nnz} values for {shape_numel(t.shape)} positions")
        lengths += [idx_len, 4 * nnz]
    views = split_payload(env.payload, lengths)
    tensors: dict[str, SparseDelta] = {}
    for i, t in enumerate(table):
        idx = decode_indices(views[2 * i], t.lengths[0], shape_numel(t.shape), t.name)
        vals = np.frombuffer(views[2 * i + 1], dtype="<f4")
        if not np.isfinite(vals).all():
            raise NonFiniteValues(f"{t.name}: non-finite aggregate value")
        tensors[t.name] = SparseDelta(t.shape, torch.from_numpy(idx), torch.from_numpy(vals.astype(np.float32)))
    agg = Aggregate(env.run_hash, env.window, a_base, alpha, fingerprint, manifest, tensors, published_at, metadata)
    return verified(agg, env)


# ---------------------------------------------------------------------------- sparse indices
# Sorted flat indices are coded as varint gaps with vectorized numpy (millions of indices per
# second; a Python loop would take seconds per aggregate).
_MAX_VARINT_BYTES = 6  # gaps < 2**42 > MAX_NUMEL


def encode_indices(indices: npt.NDArray[np.integer], numel: int) -> bytes:
    """Sorted unique flat indices -> varint gaps (first value, then index[i] − index[i−1] − 1)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return b""
    gaps = np.diff(idx, prepend=np.int64(-1)) - 1
    if gaps.min() < 0 or idx[-1] >= numel:
        raise MalformedPayload("indices must be sorted, unique and inside the tensor")
    g = gaps.astype(np.uint64)
    nbytes = np.ones(g.size, dtype=np.int64)
    for p in range(1, _MAX_VARINT_BYTES):
        nbytes += g >= np.uint64(1 << (7 * p))
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.zeros(int(ends[-1]), dtype=np.uint8)
    for p in range(_MAX_VARINT_BYTES):
        sel = nbytes > p
        byte = (g[sel] >> np.uint64(7 * p)) & np.uint64(0x7F)
        more = (nbytes[sel] > p + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + p] = (byte | more).astype(np.uint8)
    return out.tobytes()


def decode_indices(data: bytes | memoryview, count: int, numel: int, what: str) -> npt.NDArray[np.int64]:
    """Inverse of :func:`encode_indices`, strict: exactly ``count`` canonical varints filling
    ``data``, every index < ``numel``. Raises InvalidIndices / MalformedPayload."""
    b = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise MalformedPayload(f"{what}: index bytes for zero values")
        return np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count or ends[-1] != b.size - 1:
        raise MalformedPayload(f"{what}: index stream does not hold exactly {count} varints")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > _MAX_VARINT_BYTES:
        raise InvalidIndices(f"{what}: index gap too large")
    if np.any((lengths > 1) & (b[ends] == 0)):
        raise MalformedPayload(f"{what}: non-canonical varint")
    pos = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.int64) << (7 * pos)
    gaps = np.add.reduceat(parts, starts)
    # cumsum of (gap + 1) − 1 is strictly increasing by construction; only the range can fail.
    # Gaps are < 2**42 and count ≤ numel ≤ 2**40, so the int64 sum cannot overflow.
    idx = np.cumsum(gaps + 1) - 1
    if idx[-1] >= numel:
        raise InvalidIndices(f"{what}: index {int(idx[-1])} outside a tensor of {numel} values")
    return idx
