"""Read caps of signed objects, derived from the model size, the codec and the swarm size.

Every object is read only after its size is checked against a cap, so a cap bounds what one
hostile upload costs a reader; it must also stay above anything an honest participant produces.
Constants get both wrong as runs grow: a 64 MiB contribution cap refuses every honest
contribution of a model above ~3.5 B parameters, a 512 MiB aggregate cap the honest aggregate of a
1 B model once ~8 peers contribute. So the caps follow the RunSpec:

* **contribution**: twice the largest full contribution (every parameter) the codec can write —
  per chunk its scales, and per kept value its 2-bit code and index (≤ ``b + 5`` bits with the
  Golomb code of parameter ``< 2^b``, see :func:`codec_payload_bound`) — plus the headers; with a
  Top-k warm-up (``outer.warmup_k``) at the largest k of any window (:func:`widest_codec`);
* **aggregate**, the largest the aggregate's encoding can be with ``validator.max_contributors``
  accepted contributions: plain — per tensor the union of their Top-k sets (at most every
  element) with one bfloat16 value each, and its index set (at most one bit per element);
  re-compressed — twice one full contribution under the re-compression codec; plus the manifest
  and the headers.

A nonzero ``validator.max_contribution_bytes`` / ``max_aggregate_bytes`` overrides the derived
value. Peers and the validator compute the caps with the same function::

    caps = object_caps(spec)         # Caps(contribution=..., aggregate=...)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from protocol.broadcast import recompress_codec, recompresses
from protocol.codec.bitpack import packed_size
from protocol.codec.chunking import geometry
from protocol.codec.indexcoding import golomb_param
from protocol.codec.quantizer import SCALES_PER_CHUNK
from protocol.config import CodecConfig, RunSpec
from protocol.model import param_schema
from protocol.wire.delta import VALUE_BYTES, bitmap_nbytes
from protocol.wire.frame import ENVELOPE_OVERHEAD
from protocol.wire.quorum import certificate_bytes

__all__ = [
    "Caps",
    "aggregate_bound",
    "codec_payload_bound",
    "contribution_bound",
    "object_caps",
    "proposal_bytes",
    "published_bytes",
    "widest_codec",
]

CODEC_MARGIN = 2  # caps on codec payloads are twice their bound (the bound itself is rarely approached)
TENSOR_ROW_BYTES = 512  # one tensor table row: a name ≤ 255 bytes, ≤ 8 dimensions, a few lengths
HEADER_BYTES = ENVELOPE_OVERHEAD + (1 << 17)  # frame + base, codec and ≤ 64 metadata fields of ≤ 1 KiB
MANIFEST_ENTRY_BYTES = 20 + 32 + 8
_HEAD_BYTES = 5  # a codec payload's tag and per-tensor scale


@dataclass(frozen=True)
class Caps:
    """Read caps in bytes: of one contribution and of one aggregate."""

    contribution: int
    aggregate: int


def object_caps(spec: RunSpec) -> Caps:
    """The caps every participant of ``spec`` applies (overrides from ``spec.validator`` win)."""
    derived = _derived(spec)
    v = spec.validator
    return Caps(v.max_contribution_bytes or derived.contribution, v.max_aggregate_bytes or derived.aggregate)


@lru_cache(maxsize=16)
def published_bytes(spec: RunSpec) -> int:
    """The read cap of what lies at an aggregate key: the aggregate, or with several validators
    (``protocol.quorum``) its certificate, the aggregate plus one endorsement per validator."""
    cap = object_caps(spec).aggregate
    keys = len(spec.validator.public_keys)
    if keys <= 1 and spec.validator.signing_quorum <= 1:
        return cap
    return certificate_bytes(cap, keys)


def proposal_bytes(spec: RunSpec) -> int:
    """The read cap of a leader's proposal: the aggregate plus the caps of every contributor, per
    tensor a norm, a row cap and, at most, a cap for every row (``protocol.wire.quorum``)."""
    schema = param_schema(spec.model)
    rows = sum(shape[0] if len(shape) > 1 else 1 for shape in schema.values())
    per_contributor = 64 + sum(len(name) + 40 for name in schema) + 16 * rows
    return object_caps(spec).aggregate + max(1, spec.validator.max_contributors) * per_contributor + ENVELOPE_OVERHEAD


def _derived(spec: RunSpec) -> Caps:
    schema = param_schema(spec.model)
    return Caps(
        CODEC_MARGIN * contribution_bound(schema, widest_codec(spec)),
        aggregate_bound(schema, spec, max(1, spec.validator.max_contributors)),
    )


def widest_codec(spec: RunSpec) -> CodecConfig:
    """The codec of the largest k of any window (``outer.warmup_k``): what the caps must allow."""
    k = spec.outer.max_k(spec.codec.k)
    return spec.codec if k == spec.codec.k else dataclasses.replace(spec.codec, k=k)


def codec_payload_bound(shape: tuple[int, ...], cfg: CodecConfig) -> int:
    """Most bytes ``codec.pack`` writes for a tensor of ``shape``, whatever was selected.

    Golomb code: the parameter ``M`` is at most the one for the largest gap sum (a chunk's gaps add
    up to at most its size − k), so every remainder takes ≤ ``b = bit_length(M − 1)`` bits with the
    2-bit code beside it, and the unary quotients take ≤ 1 + 1.62 bits per position (the mean gap is
    at most 1.62·M for the canonical ``M``): ≤ ``b + 5`` bits per kept value, plus the u16 ``M``.
    """
    g = geometry(shape, cfg)
    fixed = _HEAD_BYTES + SCALES_PER_CHUNK * g.n_chunks
    if g.nnz == 0:
        return fixed + 2
    if cfg.index_coding == "packed12":
        return fixed + packed_size(g.nnz, 2) + packed_size(g.nnz, 12)
    gap_sum = (g.n_chunks - 1) * (g.chunk_len - g.k_full) + (g.last_size - g.k_last)
    b = max(golomb_param(gap_sum, g.nnz) - 1, 0).bit_length()
    return fixed + 2 + packed_size(g.nnz, max(b - 1, 0) + 6) + 2


def contribution_bound(schema: Mapping[str, tuple[int, ...]], cfg: CodecConfig) -> int:
    """Largest contribution holding every tensor of ``schema`` under ``cfg``, headers included."""
    return HEADER_BYTES + sum(TENSOR_ROW_BYTES + codec_payload_bound(s, cfg) for s in schema.values())


def aggregate_bound(schema: Mapping[str, tuple[int, ...]], spec: RunSpec, contributors: int) -> int:
    """Largest aggregate of at most ``contributors`` contributions under ``spec``'s encoding of Δ̄:
    re-compressed from ``outer.recompress_from`` contributions on, plain below."""
    fixed = HEADER_BYTES + contributors * MANIFEST_ENTRY_BYTES
    plain_upto = contributors if not spec.outer.recompress else min(contributors, spec.outer.recompress_from - 1)
    largest = fixed + _plain_bound(schema, spec, plain_upto) if plain_upto >= 1 else 0
    if recompresses(spec.outer, contributors):
        coded = fixed + CODEC_MARGIN * contribution_bound(schema, recompress_codec(spec.outer, spec.codec))
        largest = max(largest, coded)
    return largest


def _plain_bound(schema: Mapping[str, tuple[int, ...]], spec: RunSpec, contributors: int) -> int:
    """The tensors of the largest plain aggregate of ``contributors`` contributions."""
    total = 0
    for shape in schema.values():
        numel = math.prod(shape)
        union = min(numel, contributors * geometry(shape, widest_codec(spec)).nnz)
        total += TENSOR_ROW_BYTES + VALUE_BYTES * union + bitmap_nbytes(numel)
    return total
