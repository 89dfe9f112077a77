"""What decoding a signed object will allocate, read from its header before its payload is.

An object's tensor table declares how many values each tensor holds, and the decoders allocate in
proportion to that (:mod:`protocol.codec.indexcoding`, :func:`protocol.codec.to_sparse`): per
value an int64 position and a code byte (contributions, re-compressed aggregates: 9 bytes) or an
int64 position and a float32 (plain aggregates: 12 bytes), per chunk two scale bytes, plus the
unpacked bit streams (at most one byte per payload bit: 8 × the payload) and temporaries of a few
blocks (under 1 MiB). :func:`declared_bytes` adds these up from the fixed header and the body
alone, so a reader that takes objects from anywhere (``sparseloco inspect``) can refuse one whose
tables ask for more memory than it allows before reading the rest of it::

    need = declared_bytes(head)         # head: the first FIXED_HEADER_BYTES + body_len bytes
    if need > max_memory: refuse        # PayloadTooLarge

The number is a statement of the header, not a verified fact: a header that does not parse
declares 0 here and is refused by the decoder itself, and every decoder refuses a payload too
short for the values it declares before allocating for them. Objects without tensors (checkpoint
manifests, announcements, dataset manifests) declare 0: their parsers allocate a small multiple
of their body (the fuzz tests bound it at 32 × the input).
"""

from __future__ import annotations

from protocol.codec.chunking import geometry
from protocol.config import CodecConfig
from protocol.errors import ProtocolError
from protocol.wire import aggregate, contribution
from protocol.wire.fields import TensorEntry, shape_numel
from protocol.wire.frame import _FIXED, FIXED_HEADER_BYTES, Kind

__all__ = ["CODED_VALUE_BYTES", "PLAIN_VALUE_BYTES", "body_end", "declared_bytes"]

CODED_VALUE_BYTES = 9  # int64 position + uint8 code
PLAIN_VALUE_BYTES = 12  # int64 position + float32 value
_STREAM_FACTOR = 8  # unpacked bit streams: one byte per payload bit


def body_end(head: bytes | memoryview) -> int:
    """How many leading bytes of an object hold its fixed header and body (0: not an object)."""
    if len(head) < FIXED_HEADER_BYTES:
        return 0
    body_len = _FIXED.unpack_from(head, 0)[6]
    return FIXED_HEADER_BYTES + int(body_len)


def declared_bytes(head: bytes | memoryview) -> int:
    """The bytes decoding the object that starts with ``head`` allocates, as its header declares
    (module doc); ``head`` holds at least :func:`body_end` bytes. 0 when nothing is declared."""
    end = body_end(head)
    if end == 0 or len(head) < end:
        return 0
    _, _, kind, _, _, _, _, payload_len = _FIXED.unpack_from(head, 0)
    body = memoryview(head)[FIXED_HEADER_BYTES:end]
    try:
        if kind == Kind.CONTRIBUTION:
            _, cfg, _, table = contribution.read_header(body)
            tensors = sum(_coded(t, cfg) for t in table)
        elif kind == Kind.AGGREGATE:
            h = aggregate.read_header(body)
            tensors = sum(_plain(t) if h.codec is None else _coded(t, h.codec) for t in h.table)
        else:
            return 0
    except ProtocolError:
        return 0
    return tensors + _STREAM_FACTOR * int(payload_len)


def _coded(t: TensorEntry, cfg: CodecConfig) -> int:
    """A codec payload's values and scales; 0 for a shape its payload cannot hold (the decoder
    refuses it before building anything: :func:`protocol.wire.contribution.unpack_tensor`)."""
    if shape_numel(t.shape) > max(cfg.block * cfg.block, cfg.chunk_1d) * (t.lengths[0] + 1):
        return 0
    g = geometry(t.shape, cfg)
    return CODED_VALUE_BYTES * g.nnz + 2 * g.n_chunks


def _plain(t: TensorEntry) -> int:
    """A plain aggregate tensor's values (its table row declares their count)."""
    return PLAIN_VALUE_BYTES * min(t.lengths[0], shape_numel(t.shape))
